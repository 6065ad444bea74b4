"""Trying a candidate expert set without touching the line, and promoting one while frames flow."""
from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from coe import CoEError, parse_spec
from edge_agent.cli import cli
from storage.expert_store import ExpertStore
from storage.promote import promote

from conftest import TINY_SPEC, write_line
from test_judge import _run_line

MODEL = parse_spec(TINY_SPEC)


def _copy(src: Path, dst: Path) -> ExpertStore:
    shutil.copytree(src, dst)
    return ExpertStore(dst)


def test_promote_refuses_a_bad_candidate_and_changes_nothing(tmp_path, tiny_zoo):
    line = _copy(tiny_zoo, tmp_path / "line")
    cand = ExpertStore(tmp_path / "cand")
    good = line.read("cls-r0402")
    cand.write(MODEL.experts["cls-r0402"], good)
    wrong = MODEL.experts["det-ic"]
    cand.write(wrong.__class__(**{**wrong.__dict__, "id": "cls-c0402"}), line.read("det-ic"))   # a detector
    before = {e.id: e.version for e in line.entries()}
    with pytest.raises(CoEError, match="cls-c0402' is a ultralytics/yolov8n detector in the candidate"):
        promote(line, cand, MODEL)
    with pytest.raises(CoEError, match="'cls-u-soic8' is not in the candidate"):
        promote(line, cand, MODEL, ["cls-u-soic8"])
    # right arch and kind, but tensors the line's model cannot take: every load on the line would have failed
    odd = {k: v for k, v in good.items() if not k.startswith("classifier.")}
    cand.write(MODEL.experts["cls-r0603"], odd)
    with pytest.raises(CoEError, match=r"'cls-r0603' in the candidate lacks \d+ tensor\(s\) the line's has "
                                       r"\(classifier\."):
        promote(line, cand, MODEL, ["cls-r0603"])
    grown = {**good, "classifier.3.weight": torch.zeros(9, good["classifier.3.weight"].shape[1])}
    cand.write(MODEL.experts["cls-r0603"], grown, version=2)
    with pytest.raises(CoEError, match=r"'cls-r0603': tensor classifier\.3\.weight is \[9, \d+\] in the candidate"):
        promote(line, cand, MODEL, ["cls-r0603"])
    assert {e.id: e.version for e in line.entries()} == before
    done = promote(line, cand, MODEL, ["cls-r0402"])
    assert [(p.expert_id, p.old_version, p.new_version) for p in done] == [("cls-r0402", 1, 2)]


def test_a_candidate_runs_in_its_own_agent_and_the_gate_catches_it(tmp_path, tiny_zoo, tiny_recording):
    base_cfg = write_line(tmp_path / "line", store=_copy(tiny_zoo, tmp_path / "store").root)
    res = _run_line(base_cfg, tiny_recording, "--report", str(tmp_path / "r-base"))
    assert res.exit_code == 0, res.output
    from edge_agent.config import load_config

    base_db = load_config(base_cfg, env={}).db_path
    worse = _copy(tiny_zoo, tmp_path / "worse")
    tensors = dict(worse.read("cls-c0402"))
    bias = next(k for k in tensors if k.endswith("classifier.3.bias"))
    tensors[bias] = torch.tensor([0.0, 0.0, 0.0, 50.0])                   # 'wrong_part' for everything
    worse.write(MODEL.experts["cls-c0402"], tensors, version=2)
    rows_before = sqlite3.connect(base_db).execute("SELECT count(*) FROM verdicts").fetchone()[0]
    bad = CliRunner().invoke(cli, ["replay", str(tiny_recording), "--config", str(base_cfg),
                                   "--candidate", str(worse.root), "--report", str(tmp_path / "r-cand"),
                                   "--baseline", str(base_db), "--gate", "regressions<=0"])
    assert bad.exit_code == 3, bad.output
    report = json.loads((tmp_path / "r-cand" / "report.json").read_text())
    assert report["broken"]["count"] > 0 and set(report["expert_versions"]["cls-c0402"]) == {"2"}
    assert (tmp_path / "r-cand" / "results.db").is_file()                  # its own database...
    assert sqlite3.connect(base_db).execute("SELECT count(*) FROM verdicts").fetchone()[0] == rows_before  # ...only
    again = CliRunner().invoke(cli, ["replay", str(tiny_recording), "--config", str(base_cfg),
                                     "--candidate", str(worse.root), "--report", str(tmp_path / "r-cand")])
    assert again.exit_code != 0 and "fresh directory" in again.output


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_promotion_under_a_running_replay_loses_and_duplicates_nothing(tmp_path, tiny_zoo, tiny_recording, runtime):
    """Frames keep flowing while the candidate is promoted; the frames sent after it run on version 2.

    With `runtime: onnx` the line serves ONNX twins: the promotion is exported again before version 2 runs.
    """
    from edge_agent.agent import Agent
    from edge_agent.config import load_config
    from edge_agent.replay import recording_messages, send_messages
    from storage.recording import Recording

    store = _copy(tiny_zoo, tmp_path / "store")
    config = write_line(tmp_path / "line", store=store.root, store_poll_s=0.05, runtime=runtime)
    cand = _copy(tiny_zoo, tmp_path / "cand")                                # the same weights, new versions
    rec = Recording(tiny_recording)
    messages = list(recording_messages(rec))
    first, second = messages[:40], messages[40:]
    agent = Agent(load_config(config, env={})).start()
    try:
        out = {}
        # 2 s of frames: the promotion (~0.5 s of CLI) lands while they still flow, so the switch must hold some
        sender = threading.Thread(target=lambda: out.setdefault("a", send_messages(first, agent.endpoints["ingest"],
                                                                                   rate=20, window=8)))
        sender.start()
        assert agent.wait_verdicts(1, timeout=60)                          # frames are in flight, on version 1
        res = CliRunner().invoke(cli, ["experts", "promote", str(cand.root), "--config", str(config)])
        assert res.exit_code == 0, res.output
        sender.join(60)
        assert agent.wait_verdicts(len(first), timeout=120)
        deadline = time.monotonic() + 30
        while (agent.store_watch.store.entry("cls-r0402").version != 2 or agent.store_watch.pending()) \
                and time.monotonic() < deadline:
            time.sleep(0.02)                         # the watcher has seen the promotion and settled every pool
        assert agent.store_watch.store.entry("cls-r0402").version == 2 and not agent.store_watch.pending(), \
            "the store watcher did not settle the promotion within 30 s"
        later = send_messages(second, agent.endpoints["ingest"], window=8)
        assert out["a"].accepted + later.accepted == len(rec) and not out["a"].unacked and not later.unacked
        assert agent.wait_verdicts(len(rec), timeout=120)
    finally:
        agent.stop()
    switches = agent.store_watch.switches
    store.reload()
    con = sqlite3.connect(load_config(config, env={}).db_path)
    try:
        verdicts = con.execute("SELECT frame_id, verdict, versions FROM verdicts").fetchall()
        late = con.execute("SELECT DISTINCT expert_version FROM inferences WHERE frame_id IN (%s)"
                           % ",".join("?" * len(second)), [m[0] for m in second]).fetchall()
        spans = {v: (lo, hi) for v, lo, hi in con.execute(
            "SELECT expert_version, min(started_at), max(started_at) FROM inferences GROUP BY expert_version")}
    finally:
        con.close()
    ids = [v[0] for v in verdicts]
    assert sorted(ids) == sorted(f.header["frame_id"] for f in rec)         # every frame exactly once
    assert all(v[1] in ("pass", "defect") for v in verdicts)               # no errors from the swap
    assert late == [(2,)]                                                   # after the promotion: version 2
    assert all(json.loads(v[2]) for v in verdicts)
    # every frame ran its whole chain on one version of the set: the one live when it was accepted
    mixed = [(v[0], v[2]) for v in verdicts if len(set(json.loads(v[2]).values())) != 1]
    assert not mixed, mixed
    assert len(switches) == 1 and switches[0]["late"] == 0 and set(switches[0]["experts"].values()) == {2}
    # both sides of the switch ran. (Whether the switch held frames depends on one arriving during a drain of
    # tiny experts, microseconds here: tests/test_frame_gate.py holds them deterministically.)
    sets = [set(json.loads(v[2]).values()) for v in verdicts]
    assert {1} in sets and {2} in sets, sets
    assert sorted(spans) == [1, 2] and spans[1][1] < spans[2][0], spans     # no v1 step ran after a v2 one
    assert not [f for f in store.root.glob("*.safetensors") if f.name not in {e.file for e in store.entries()}]
    if runtime == "onnx":
        assert agent.store.twins.current("cls-r0402") and agent.store.entry("cls-r0402").arch.startswith("onnx/")


def test_the_watcher_drops_stale_copies_once_no_batch_holds_them(tmp_path, tiny_zoo):
    from edge_agent.store_watch import StoreWatcher
    from storage.policies import make_policy
    from storage.pool import Pool
    from storage.tiers import StoreSource

    line = _copy(tiny_zoo, tmp_path / "line")
    pool = Pool("cpu", 10**9, make_policy("lru"), StoreSource(line))
    forgotten = []
    watch = StoreWatcher(line, lambda: [pool], forget=forgotten.append)
    for eid in ("cls-r0402", "cls-c0402"):
        pool.release(pool.acquire(eid))
    held = pool.acquire("cls-c0402")                                      # a batch is running on it
    assert watch.tick() == 0                                              # nothing changed yet
    time.sleep(0.01)
    writer = ExpertStore(line.root)                                       # another process promotes
    for eid in ("cls-r0402", "cls-c0402"):
        writer.write(MODEL.experts[eid], writer.read(eid), version=2)
    assert watch.tick() == 1 and sorted(forgotten) == ["cls-c0402", "cls-r0402"]
    assert not pool.contains("cls-r0402") and pool.contains("cls-c0402")  # the held copy stays for its batch
    assert held.value.version == 1
    pool.release(held)                      # the batch ends: its release drops the stale copy, no tick needed
    fresh = pool.acquire("cls-c0402")       # a hot expert's next batch, straight after: no gap for a tick
    assert fresh.value.version == 2
    pool.release(fresh)
    assert watch.tick() == 0 and watch.pending() == set()


def test_the_watcher_sees_a_promotion_even_when_the_store_reloaded_itself_first(tmp_path, tiny_zoo):
    from edge_agent.store_watch import StoreWatcher
    from storage.policies import make_policy
    from storage.pool import Pool
    from storage.tiers import StoreSource

    line = _copy(tiny_zoo, tmp_path / "line")
    pool = Pool("cpu", 10**9, make_policy("lru"), StoreSource(line))
    forgotten = []
    watch = StoreWatcher(line, lambda: [pool], forget=forgotten.append)
    pool.release(pool.acquire("cls-r0402"))
    writer = ExpertStore(line.root)                                       # another process promotes
    writer.write(MODEL.experts["cls-r0402"], writer.read("cls-r0402"), version=2)
    line.reload()                                  # e.g. a load that found the newer file re-read the manifest
    assert watch.tick() == 1 and forgotten == ["cls-r0402"] and not pool.contains("cls-r0402")


def test_a_verified_once_store_names_the_version_of_the_file_it_read_after_a_promotion(tmp_path, tiny_zoo):
    line = _copy(tiny_zoo, tmp_path / "line")
    reader = ExpertStore(line.root, verify="first")
    assert reader.read_flat("cls-r0402").version == 1                     # verified once, manifest cached
    writer = ExpertStore(line.root)                                       # another process promotes
    writer.write(MODEL.experts["cls-r0402"], writer.read("cls-r0402"), version=2)
    assert reader.entry("cls-r0402").version == 1                         # the reader has not looked yet
    assert reader.read_flat("cls-r0402").version == 2                     # new bytes, named as such


def test_a_manifest_gone_for_a_moment_keeps_the_experts_served_and_its_return_is_followed(tmp_path, tiny_zoo,
                                                                                             caplog):
    """A missing manifest (a restore by `mv`) was read as an empty store: the live agent served no expert and
    logged nothing."""
    from edge_agent.store_watch import StoreWatcher

    line = _copy(tiny_zoo, tmp_path / "line")
    watch = StoreWatcher(line, lambda: [], forget=lambda e: None)
    before = sorted(e.id for e in line.entries())
    kept = line.manifest_path.with_name("kept.json")
    line.manifest_path.rename(kept)
    with caplog.at_level("ERROR", logger="edge_agent.store_watch"):
        for _ in range(3):
            watch.tick()
    assert sorted(e.id for e in line.entries()) == before
    assert [r.getMessage() for r in caplog.records].count(
        "store watcher: the expert store manifest is gone; serving the experts last read") == 1
    with pytest.raises(CoEError, match="manifest is gone"):
        line.reload()                                       # the store itself keeps what it read, too
    kept.rename(line.manifest_path)
    writer = ExpertStore(line.root)
    writer.write(MODEL.experts["cls-r0402"], writer.read("cls-r0402"), version=2)
    watch.tick()
    assert line.entry("cls-r0402").version == 2 and sorted(e.id for e in line.entries()) == before


def test_a_manifest_read_that_fails_once_is_read_again_at_the_next_tick(tmp_path, tiny_zoo, monkeypatch):
    """The stamp was marked seen before the read: one failed read (too many open files, EIO) and the promotion
    was never picked up, though the log said 'retrying'."""
    from edge_agent.store_watch import StoreWatcher

    line = _copy(tiny_zoo, tmp_path / "line")
    watch = StoreWatcher(line, lambda: [], forget=lambda e: None)
    writer = ExpertStore(line.root)
    writer.write(MODEL.experts["cls-r0402"], writer.read("cls-r0402"), version=2)
    real = line.reload
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(24, "Too many open files")
        return real()
    monkeypatch.setattr(line, "reload", flaky)
    watch.tick()
    assert line.entry("cls-r0402").version == 1
    watch.tick()                                            # no new change of the manifest: read again all the same
    assert line.entry("cls-r0402").version == 2 and len(calls) == 2


def test_held_frames_wait_for_a_load_of_the_old_version_begun_before_the_switch(tmp_path, tiny_zoo):
    """A prefetch reading version 1 when the drain ended: the gate opened while it still loaded, the load landed
    version 1 in the pool, and a held frame could run on it."""
    from edge_agent.frame_gate import FrameGate
    from edge_agent.store_watch import StoreWatcher
    from storage.policies import make_policy
    from storage.pool import Pool
    from storage.tiers import StoreSource

    line = _copy(tiny_zoo, tmp_path / "line")
    go, started = threading.Event(), threading.Event()

    class Slow(StoreSource):
        def load(self, expert_id, reuse=None):
            flat = super().load(expert_id)          # version 1's bytes, read before the switch ...
            started.set()
            go.wait(10)                             # ... and landing after it
            return flat

    pool = Pool("cpu", 10**9, make_policy("lru"), Slow(line))
    lock, inflight, scheduled = threading.Condition(), {}, []
    gate = FrameGate(lock, inflight, scheduled.extend, lambda f: f)
    watch = StoreWatcher(line, lambda: [pool], forget=lambda e: None, gate=gate)
    got = {}
    prefetch = threading.Thread(target=lambda: got.setdefault("h", pool.acquire("cls-r0402")))
    prefetch.start()
    started.wait(10)
    writer = ExpertStore(line.root)
    writer.write(MODEL.experts["cls-r0402"], writer.read("cls-r0402"), version=2)
    ticking = threading.Thread(target=watch.tick)   # nothing in flight: drained at once, the switch runs ...
    ticking.start()
    ticking.join(0.5)
    assert ticking.is_alive() and gate.closed       # ... and waits for the load, the gate shut
    go.set()
    ticking.join(10)
    prefetch.join(10)
    assert not gate.closed
    assert got["h"].value.version == 1              # the prefetch's own holder has the bytes it read
    pool.release(got["h"])                          # its release drops the stale copy (marked at the switch)
    fresh = pool.acquire("cls-r0402")               # what a released frame gets: the new version
    assert fresh.value.version == 2
    pool.release(fresh)


def test_reload_if_adopts_only_what_its_check_accepts_and_a_broken_line_file_can_still_be_promoted_over(
        tmp_path, tiny_zoo):
    line = _copy(tiny_zoo, tmp_path / "line")
    writer = ExpertStore(line.root)
    writer.write(MODEL.experts["cls-r0402"], writer.read("cls-r0402"), version=2)
    assert not line.reload_if(lambda entries: entries["cls-r0402"].version == 1)
    assert line.entry("cls-r0402").version == 1                      # refused: nothing adopted
    assert line.reload_if(lambda entries: entries["cls-r0402"].version == 2)
    assert line.entry("cls-r0402").version == 2
    # the line's own file of an expert is truncated: promoting a good candidate over it is the fix, not refused
    cand = ExpertStore(tmp_path / "cand")
    cand.write(MODEL.experts["cls-c0402"], line.read("cls-c0402"))
    path = line.path("cls-c0402")
    path.write_bytes(path.read_bytes()[:100])
    done = promote(line, cand, MODEL, ["cls-c0402"])
    assert [(p.expert_id, p.new_version) for p in done] == [("cls-c0402", 2)]


def test_stopping_the_watcher_ends_a_switchs_wait_for_loads(tmp_path, tiny_zoo):
    """The switch's wait for loads begun before it ignored stop(): Agent.stop() waited out its 5 s join."""
    from edge_agent.frame_gate import FrameGate
    from edge_agent.store_watch import StoreWatcher
    from storage.policies import make_policy
    from storage.pool import Pool
    from storage.tiers import StoreSource

    line = _copy(tiny_zoo, tmp_path / "line")
    go, started = threading.Event(), threading.Event()

    class Stuck(StoreSource):
        def load(self, expert_id, reuse=None):
            flat = super().load(expert_id)
            started.set()
            go.wait(30)
            return flat

    pool = Pool("cpu", 10**9, make_policy("lru"), Stuck(line))
    lock, inflight, scheduled = threading.Condition(), {}, []
    watch = StoreWatcher(line, lambda: [pool], forget=lambda e: None,
                         gate=FrameGate(lock, inflight, scheduled.extend, lambda f: f))
    loader = threading.Thread(target=lambda: pool.release(pool.acquire("cls-r0402")))
    loader.start()
    started.wait(10)
    writer = ExpertStore(line.root)
    writer.write(MODEL.experts["cls-r0402"], writer.read("cls-r0402"), version=2)
    ticking = threading.Thread(target=watch.tick)
    ticking.start()
    ticking.join(0.5)
    assert ticking.is_alive()                       # waiting for the load
    watch.stop()
    ticking.join(10)                                # the old wait ran on to its 30 s bound: still alive here
    try:
        assert not ticking.is_alive() and not go.is_set()     # it ended while the load was still stuck
    finally:
        go.set()
        loader.join(10)
