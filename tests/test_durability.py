"""Issue 6: no accepted frame lost or doubled, under crashes, overload, faults, strangers and time."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from coe import CoEError, parse_spec
from edge_agent import protocol as P
from edge_agent.agent import Agent
from edge_agent.config import load_config
from edge_agent.ingest import check_frame
from edge_agent.replay import replay
from executors.faults import Faults, faulty_backends
from routing import RuleRouter
from storage.recording import Recording
from storage.results import ResultStore

from conftest import TINY_SPEC, write_line

REPO = Path(__file__).resolve().parent.parent


def db_one(path, sql):
    con = sqlite3.connect(path)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def verdict_count(db: Path) -> int:
    """0 until the agent has created its schema (it may be mid-creation when we look)."""
    try:
        return db_one(db, "SELECT count(*) FROM verdicts")[0][0] if db.exists() else 0
    except sqlite3.OperationalError:
        return 0


def start_agent_process(cfg_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "run", "--config", str(cfg_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_sigkill_mid_stream_then_restart_loses_and_doubles_nothing(tmp_path, tiny_zoo, tiny_recording):
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg_path = write_line(tmp_path / "line", store=store, fixed_ports=True)
    cfg = yaml.safe_load(cfg_path.read_text())
    db = Path(cfg["data_dir"]) / "results.db"
    endpoint = cfg["ingest"].split(":", 1)[1]
    rec = Recording(tiny_recording)
    result = {}
    proc = start_agent_process(cfg_path)
    client = threading.Thread(target=lambda: result.setdefault(
        "r", replay(rec, endpoint, rate=40, window=8, ack_timeout=1.0, deadline=180)))
    client.start()
    try:
        deadline = time.time() + 60       # kill once some, but not all, verdicts are in
        while time.time() < deadline:
            if verdict_count(db) >= 5:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = db_one(db, "SELECT count(*) FROM verdicts")[0][0]
        time.sleep(1.0)                   # the client keeps sending into the void, then resends
        proc = start_agent_process(cfg_path)
        client.join(180)
        deadline = time.time() + 120
        while time.time() < deadline and verdict_count(db) < len(rec):
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report = result["r"]
    ids = sorted(f.header["frame_id"] for f in rec)
    verdicts = [r[0] for r in db_one(db, "SELECT frame_id FROM verdicts")]
    assert killed_at < len(rec)                                       # the kill really was mid-stream
    assert report.unacked == [] and report.accepted + report.duplicate == len(rec)
    assert sorted(verdicts) == ids                                    # every frame exactly once
    assert db_one(db, "SELECT count(*) FROM journal")[0][0] == 0
    assert sorted(r[0] for r in db_one(db, "SELECT frame_id FROM frames")) == ids


def test_saturated_agent_answers_busy_and_the_client_backs_off(tmp_path, tiny_zoo, tiny_recording):
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg = load_config(write_line(tmp_path / "line", store=store, max_inflight=3), env={})
    agent = Agent(cfg, backend_for=faulty_backends(Faults(delay=0.02))).start()
    rec = Recording(tiny_recording)
    try:
        report = replay(rec, agent.endpoints["ingest"], window=32, ack_timeout=30)
        assert agent.wait_verdicts(len(rec), timeout=120)
    finally:
        agent.stop()
    assert report.busy > 0 and report.accepted == len(rec) and report.rejected == 0
    busy_rows = db_one(cfg.db_path, "SELECT count(*) FROM errors WHERE kind='reject:busy'")[0][0]
    assert busy_rows == report.busy                                   # every 'busy' is on record
    assert db_one(cfg.db_path, "SELECT count(*) FROM verdicts")[0][0] == len(rec)


def run_with_faults(tmp_path, tiny_zoo, tiny_recording, faults, prepare=None):
    """Serve the tiny recording on a copy of the tiny zoo (`prepare(store_dir)` may change it first)."""
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    if prepare is not None:
        prepare(store)
    cfg = load_config(write_line(tmp_path / "line", store=store), env={})
    agent = Agent(cfg, backend_for=faulty_backends(faults)).start()
    rec = Recording(tiny_recording)
    try:
        assert replay(rec, agent.endpoints["ingest"]).accepted == len(rec)
        assert agent.wait_verdicts(len(rec), timeout=120)
    finally:
        agent.stop()
    rows = db_one(cfg.db_path, "SELECT f.component, v.verdict, v.reason FROM verdicts v JOIN frames f USING (frame_id)")
    return agent, rows, len(rec), cfg


def test_an_expert_that_raises_gives_error_verdicts_and_the_rest_is_served(tmp_path, tiny_zoo, tiny_recording):
    agent, rows, n, cfg = run_with_faults(tmp_path, tiny_zoo, tiny_recording, Faults(raise_for={"cls-r0402"}))
    assert len(rows) == n
    bad = [r for r in rows if r[0] == "R0402"]
    assert bad and all(v == "error" and "injected fault in cls-r0402" in why for _, v, why in bad)
    assert all(v in ("pass", "defect") for c, v, _ in rows if c != "R0402")
    kinds = Counter(k for (k,) in db_one(cfg.db_path, "SELECT kind FROM errors"))
    assert kinds["expert_run"] == len(bad)


def test_out_of_memory_batches_are_split_and_retried(tmp_path, tiny_zoo, tiny_recording):
    faults = Faults(oom_above={"det-2term": 1, "cls-c0402": 2})
    agent, rows, n, _ = run_with_faults(tmp_path, tiny_zoo, tiny_recording, faults)
    assert len(rows) == n and all(v in ("pass", "defect") for _, v, _ in rows)    # nothing failed
    assert sum(e.oom_splits for e in agent.executors) > 0
    ran = [size for eid, size in faults.calls if eid == "det-2term"]
    assert max(ran) > 1 and 1 in ran                                 # tried big, succeeded small


def test_out_of_memory_at_batch_one_is_declared_failed(tmp_path, tiny_zoo, tiny_recording):
    agent, rows, n, _ = run_with_faults(tmp_path, tiny_zoo, tiny_recording, Faults(oom_above={"cls-c0402": 0}))
    bad = [r for r in rows if r[0] == "C0402"]
    assert bad and all(v == "error" and "out of memory" in why for _, v, why in bad)
    assert len(rows) == n


def test_curve_refuses_unknown_clients(tmp_path, tiny_zoo, tiny_recording):
    from edge_agent.security import client_setup, generate

    keys = tmp_path / "keys"
    server_pub, server_sec = generate(keys, "server")
    good_pub, good_sec = generate(keys, "good")
    _, evil_sec = generate(keys, "evil")
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg = load_config(write_line(tmp_path / "line", store=store,
                                 curve={"server_key": str(server_sec), "allowed_clients": [str(good_pub)]}), env={})
    agent = Agent(cfg).start()
    rec = Recording(tiny_recording)
    frames = list(rec)[:4]
    msgs = [(f.header["frame_id"], [P.encode_header(f.header), rec.payload(f)]) for f in frames]
    from edge_agent.replay import send_messages
    try:
        stranger = send_messages(msgs, agent.endpoints["ingest"], ack_timeout=0.5, deadline=3,
                                 socket_setup=client_setup(evil_sec, server_pub))
        plain = send_messages(msgs, agent.endpoints["ingest"], ack_timeout=0.5, deadline=2)
        friend = send_messages(msgs, agent.endpoints["ingest"], ack_timeout=5, deadline=30,
                               socket_setup=client_setup(good_sec, server_pub))
        assert agent.wait_verdicts(4, timeout=60)
    finally:
        agent.stop()
    assert stranger.acked == 0 and len(stranger.unacked) == 4        # refused: not even a reject
    assert plain.acked == 0
    assert friend.accepted == 4
    assert db_one(cfg.db_path, "SELECT count(*) FROM frames")[0][0] == 4


def test_curve_keys_that_would_refuse_every_client_silently_are_named(tmp_path):
    """An allow-list entry of 40 characters that is neither a file nor a z85 key (a mistyped path), a certificate
    with no public key, and a secret-key path holding only a public key: each is an error naming it."""
    from edge_agent.security import client_key, generate, load_keys

    keys = tmp_path / "keys"
    pub, sec = generate(keys, "good")
    assert client_key(str(pub)) == load_keys(pub, secret=False)[0]
    good = load_keys(pub, secret=False)[0].decode()
    assert client_key(good) == good.encode()                           # a key given inline
    typo = "/etc/coe/keys/clients/line-a.key_secrexx"                 # 40 characters, no such file
    assert len(typo) == 40
    with pytest.raises(CoEError, match=r"curve.allowed_clients\[2\]: '/etc/coe.*' is neither a z85 public key"):
        client_key(typo, "curve.allowed_clients[2]")
    with pytest.raises(CoEError, match=r"is neither a z85 public key"):
        client_key("\u00e9" + "a" * 39)                                # a paste error outside ASCII
    with pytest.raises(CoEError, match="does not exist"):
        client_key("keys/clients/station-04-client-oopsy.key")  # 40 characters ending .key: a path, missing
    with pytest.raises(CoEError, match="holds no secret key"):
        load_keys(pub, secret=True)
    empty = tmp_path / "empty.key"
    empty.write_text("metadata\ncurve\n")
    with pytest.raises(CoEError, match=f"{empty} is not a ZeroMQ certificate: No public key found"):
        load_keys(empty, secret=False)


def test_retention_prunes_old_rows_keeps_verdicts_and_pending_frames(tmp_path):
    rs = ResultStore(tmp_path / "r.db")
    from storage.results import JournalEntry
    old, new = 1_000.0, time.time()
    rs.journal([JournalEntry(f"f{i}", "A", "B", "C", 1.0, old if i < 50 else new, "{}", b"x" * 2000)
                for i in range(60)])
    rs.write(inferences=[{"frame_id": f"f{i}", "stage": 0, "expert_id": "e", "device": "cpu", "executor": "x",
                          "batch_id": 1, "output": "{}" * 500, "latency_ms": 1.0, "started_at": old if i < 50 else new}
                         for i in range(60)],
             verdicts=[{"frame_id": f"f{i}", "verdict": "pass", "reason": "", "decided_at": old,
                        "latency_ms": 1.0, "chain": "[]"} for i in range(40)],
             errors=[{"frame_id": None, "kind": "k", "message": "m" * 1000, "at": old} for _ in range(200)])
    got = rs.prune(time.time() - 86400, keep_verdicts=True)
    assert got["inferences"] == 50 and got["errors"] == 200
    assert rs.db.execute("SELECT count(*) FROM verdicts").fetchone()[0] == 40            # kept as configured
    assert rs.db.execute("SELECT count(*) FROM journal").fetchone()[0] == 20             # pending never pruned
    assert rs.freelist() == 0                                                            # pages given back
    got = rs.prune(time.time() - 86400, keep_verdicts=False)
    assert got["verdicts"] == 40 and got["frames"] == 40
    assert rs.db.execute("SELECT count(*) FROM frames").fetchone()[0] == 20              # pending frames stay


def test_database_and_wal_files_are_owner_only(tmp_path, tiny_line, tiny_recording):
    cfg = load_config(tiny_line, env={})
    agent = Agent(cfg).start()
    try:
        replay(Recording(tiny_recording), agent.endpoints["ingest"])
        agent.wait_verdicts(1, timeout=60)
        files = [p for p in Path(cfg.db_path).parent.iterdir() if p.name.startswith("results.db")]
        assert {p.name for p in files} >= {"results.db", "results.db-wal", "results.db-shm"}
        for p in files:
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
        # ... in a directory the agent made owner-only (its lock file, made first, made it 0755 before)
        assert stat.S_IMODE(Path(cfg.db_path).parent.stat().st_mode) == 0o700
    finally:
        agent.stop()


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.binary(max_size=300), max_size=5))
def test_fuzz_multipart_framing_only_ever_rejects(parts):
    router = RuleRouter(parse_spec(TINY_SPEC))
    try:
        check_frame(parts, line="T", router=router, max_payload=4096)
    except P.Reject as rej:
        assert rej.reason in P.REASONS


@settings(max_examples=200, deadline=None)
@given(header=st.fixed_dictionaries({}, optional={
    "v": st.one_of(st.just(1), st.integers(), st.text(max_size=3)),
    "frame_id": st.text(max_size=20), "line": st.sampled_from(["T", "A", ""]),
    "board_id": st.text(max_size=5), "component": st.sampled_from(["R0402", "nope", ""]),
    "ts": st.one_of(st.floats(allow_nan=True), st.integers()), "encoding": st.sampled_from(["png", "jpeg", "raw", "x"]),
    "shape": st.lists(st.integers(-5, 10), max_size=4)}), payload=st.binary(max_size=400))
def test_fuzz_structured_messages_only_ever_reject(header, payload):
    router = RuleRouter(parse_spec(TINY_SPEC))
    try:
        check_frame([json.dumps(header).encode(), payload], line="T", router=router, max_payload=4096)
    except P.Reject as rej:
        assert rej.reason in P.REASONS


def test_frames_whose_output_cannot_be_used_are_counted_on_the_status_page_by_kind(tmp_path, tiny_zoo,
                                                                                    tiny_recording):
    """Per-frame error kinds ('output': an output no one can read) reach the page's errors-by-kind, not only a
    batch's failure (before, the panel said 'none' beside a table of error verdicts)."""
    agent, rows, n, cfg = run_with_faults(tmp_path, tiny_zoo, tiny_recording,
                                          Faults(garble_for={"cls-r0402"}, raise_for={"cls-r0603"}))
    assert len(rows) == n
    errors = [r for r in rows if r[1] == "error"]
    garbled = [r for r in errors if "handling cls-r0402's output failed" in r[2]]
    raised = [r for r in errors if "injected fault in cls-r0603" in r[2]]
    assert garbled and raised and len(garbled) + len(raised) == len(errors)
    counts = agent.status.snapshot()["errors"]
    assert counts.get("output") == len(garbled) and counts.get("expert_run", 0) + counts.get("executor", 0) \
        == len(raised), counts
    kinds = dict(db_one(cfg.db_path, "SELECT kind, count(*) FROM errors GROUP BY kind"))
    assert kinds.get("output") == len(garbled)


def test_retention_deletes_in_short_transactions_by_index_and_the_same_rows(tmp_path, monkeypatch):
    """A backlog is deleted a chunk per transaction (ingest waits at most one chunk for the write lock), through
    an index on each time column, not a scan of the whole table under the lock."""
    import storage.results as results_mod

    monkeypatch.setattr(results_mod, "PRUNE_CHUNK", 7)
    rs = ResultStore(tmp_path / "r.db")
    old, new = 1_000.0, time.time()
    rs.write(errors=[{"frame_id": None, "kind": "k", "message": "m", "at": old if i < 30 else new}
                     for i in range(40)])
    commits = []
    rs.db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql.strip().upper() == "COMMIT" else None)
    got = rs.prune(time.time() - 86400)
    rs.db.conn.set_trace_callback(None)
    assert got["errors"] == 30 and rs.db.execute("SELECT count(*) FROM errors").fetchone()[0] == 10
    assert len(commits) >= 30 // 7                         # one per chunk, not one for the whole backlog
    for table, col in (("inferences", "started_at"), ("errors", "at"), ("expert_events", "at"),
                       ("frames", "received_at")):
        plan = " ".join(str(r) for r in rs.db.execute(
            f"EXPLAIN QUERY PLAN SELECT rowid FROM {table} WHERE {col} < ? LIMIT 5", (1.0,)).fetchall())
        assert "USING" in plan and "INDEX" in plan, (table, plan)


def test_a_database_a_newer_coe_edge_wrote_is_refused_naming_both_versions(tmp_path):
    from coe import CoEError
    from storage.results import SCHEMA_VERSION

    path = tmp_path / "r.db"
    ResultStore(path).close()
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION      # stamped when made
    con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    con.commit()
    con.close()
    for readonly in (False, True):          # the agent, and the readers (`results`, the status page)
        with pytest.raises(CoEError, match=rf"schema version {SCHEMA_VERSION + 1}, written by a newer coe-edge "
                                           rf"\(this one reads up to {SCHEMA_VERSION}\)"):
            ResultStore(path, readonly=readonly)


def _agent_images(rec: Recording) -> dict[str, "object"]:
    """frame id -> the image the agent decodes for it (what a backend sees)."""
    out = {}
    for f in rec:
        header = P.parse_header(P.encode_header(f.header))
        out[f.header["frame_id"]] = P.decode_image(header, rec.payload(f))
    return out


def test_frames_that_break_an_expert_get_error_verdicts_and_their_batchmates_their_own(tmp_path, tiny_zoo,
                                                                                         tiny_recording):
    """Before, one frame an expert could not take failed its whole batch: its batchmates got error verdicts."""
    poison = lambda img: int(img[0, 0].sum()) % 3 == 0     # noqa: E731
    images = _agent_images(Recording(tiny_recording))
    agent, rows, n, cfg = run_with_faults(tmp_path, tiny_zoo, tiny_recording,
                                          Faults(raise_image=("cls-r0402", poison)))
    assert len(rows) == n
    comp = dict(db_one(cfg.db_path, "SELECT frame_id, component FROM frames"))
    verdict = dict(db_one(cfg.db_path, "SELECT frame_id, verdict FROM verdicts"))
    want_bad = {f for f, c in comp.items() if c == "R0402" and poison(images[f])}
    r0402 = {f for f, c in comp.items() if c == "R0402"}
    assert want_bad and want_bad != r0402                  # some frames of the type fail, not all of them
    assert {f for f, v in verdict.items() if v == "error"} == want_bad
    reasons = dict(db_one(cfg.db_path, "SELECT frame_id, message FROM errors"))
    assert set(reasons) == want_bad
    assert all(f in why and "cls-r0402" in why and "cannot take this frame" in why for f, why in reasons.items())


def test_an_expert_whose_stored_weights_are_nan_gives_error_verdicts_not_passes(tmp_path, tiny_zoo, tiny_recording):
    """A classifier with NaN weights said 'ok' (argmax of NaN is label 0) for every frame, and the detector
    after it 'no defect found': a broken expert passed every board."""
    from storage.expert_store import ExpertStore

    def nan_head(store_dir):
        store = ExpertStore(store_dir)
        tensors = {k: v.clone() for k, v in store.read("cls-r0603").items()}
        head = [k for k in tensors if k.endswith("weight") and tensors[k].dim() == 2][-1]   # the last Linear
        tensors[head].fill_(float("nan"))
        store.write(parse_spec(TINY_SPEC).experts["cls-r0603"], tensors, version=2)

    agent, rows, n, cfg = run_with_faults(tmp_path, tiny_zoo, tiny_recording, Faults(), prepare=nan_head)
    bad = [r for r in rows if r[0] == "R0603"]
    assert len(rows) == n and bad
    assert all(v == "error" and "cls-r0603" in why and "non-finite" in why for _, v, why in bad)
    assert all(v in ("pass", "defect") for c, v, _ in rows if c != "R0603")
    kinds = Counter(k for (k,) in db_one(cfg.db_path, "SELECT kind FROM errors"))
    assert kinds == {"expert_output": len(bad)}
