"""Executors on other boxes through a REAL local Ray cluster on loopback (issue 15): replay across nodes, a node
killed mid-replay, a node that comes back, experts sync, clear errors.  No mock of Ray: each 'box' is a Ray
node (its own raylet and worker processes) started by ray.cluster_utils.Cluster, with the resource 'coe:<box>'.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from collections import Counter

import pytest
import yaml

try:
    import ray
except ImportError:
    if os.environ.get("CI") == "true":   # CI installs the [cluster] extra: a missing Ray is a failure there
        raise
    pytest.skip("needs the [cluster] extra (Ray): pip install -e '.[cluster]'", allow_module_level=True)

from coe import CoEError  # noqa: E402
from edge_agent.agent import Agent  # noqa: E402
from edge_agent.config import load_config  # noqa: E402
from edge_agent.replay import replay  # noqa: E402
from storage.recording import Recording  # noqa: E402

from conftest import TINY_SPEC, db_rows, frame_messages, until, verdict_rows, write_line  # noqa: E402

NODE_ARGS = {"num_cpus": 1, "include_dashboard": False}   # on this machine: every node is a local process


@pytest.fixture(scope="module")
def cluster():
    """One head (the front box's Ray) and two boxes, shared by the module's tests; torn down at the end."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        **NODE_ARGS, "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                                        "health_check_initial_delay_ms": 0}})
    nodes = {name: c.add_node(**NODE_ARGS, resources={f"coe:{name}": 1}) for name in ("box-2", "box-3")}
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="coe-edge", log_to_driver=False)
    c.boxes = nodes
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    from coe import parse_spec
    from storage.synthetic import record_synthetic

    out = tmp_path_factory.mktemp("rec") / "tiny-120"
    record_synthetic(parse_spec(TINY_SPEC), out, 120, line="T", seed=5, size=48, boards_components=20)
    return out


def _line(tmp_path, tiny_zoo, cluster, executors, call_timeout_s=60, channel="zmq", **extra):
    import shutil

    store = tmp_path / "front-experts"
    shutil.copytree(tiny_zoo, store)
    stores = {n: str(tmp_path / f"{n}-experts") for n in {e["node"] for e in executors if e.get("node")}}
    return write_line(tmp_path / "line", store=store, executors=executors,
                      cluster={"address": cluster.address, "stores": stores, "rejoin_s": 0.5,
                               "connect_timeout_s": 60, "call_timeout_s": call_timeout_s, "channel": channel},
                      **extra)


LOCAL = {"device": "cpu", "count": 1, "memory": "20MB", "threads": 1}


def _remote(node):
    return {**LOCAL, "node": node}


def test_a_store_whose_manifest_is_unreadable_is_not_synced(cluster, tiny_zoo, tmp_path):
    from coe import CoEError
    from edge_agent.cluster import sync_store

    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2")]), env={})
    (Path(cfg.store_path) / "manifest.json").write_text("{not json")
    with pytest.raises(CoEError, match="manifest.json is unreadable .*nothing was sent"):
        sync_store(cfg)
    assert not (tmp_path / "box-2-experts").exists()                 # the node's store was not touched


def test_a_replay_across_two_nodes_gives_one_verdict_per_frame_and_the_same_verdicts(
        cluster, tiny_zoo, tmp_path, recording):
    from edge_agent.cluster import sync_store

    rec = Recording(recording)
    # one box: the reference verdicts
    one = Agent(load_config(write_line(tmp_path / "one", store=tiny_zoo, executors=[LOCAL]), env={})).start()
    try:
        assert replay(rec, one.endpoints["ingest"], window=16).accepted == len(rec)
        assert one.wait_verdicts(len(rec), timeout=120)
    finally:
        one.stop()
    reference = {r["frame_id"]: (r["verdict"], r["reason"]) for r in verdict_rows(one.cfg.db_path)}

    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2")]), env={})
    synced = sync_store(cfg)                                          # fills box-2's own store over Ray
    assert synced["box-2"]["sent"] >= len(TINY_SPEC["experts"]) + 1   # every expert file and the manifest
    assert sync_store(cfg)["box-2"]["sent"] == 0                      # nothing changed: nothing sent
    agent = Agent(cfg).start()
    try:
        remote = next(e for e in agent.executors if getattr(e, "node", None) == "box-2")
        assert remote.where["pid"] != os.getpid() and remote.where["node"] == "box-2"
        assert remote.where["ray_node_id"] == cluster.boxes["box-2"].node_id   # really on that Ray node
        report = replay(rec, agent.endpoints["ingest"], window=16)
        assert (report.accepted, report.unacked) == (len(rec), [])
        assert agent.wait_verdicts(len(rec), timeout=180)
        status = agent.cluster_status.path
        # the status page's cluster view: the same nodes, executors and residency, from the agent's live state
        import urllib.request

        base = f"http://127.0.0.1:{agent.metrics_port}"
        with urllib.request.urlopen(base + "/api/cluster", timeout=10) as r:
            api = json.loads(r.read())
        with urllib.request.urlopen(base + "/api/status", timeout=10) as r:
            page = json.loads(r.read())["cluster"]
        for doc in (api, page):
            assert doc["nodes"]["box-2"]["alive"] and doc["nodes"]["box-2"]["ray_node_id"] == \
                cluster.boxes["box-2"].node_id
            views = {e["name"]: e for e in doc["executors"]}
            assert views["box-2/cpu-1.0"]["node"] == "box-2" and views["box-2/cpu-1.0"]["up"]
            assert views["cpu-0.0"]["node"] == "(front)"
        assert views["box-2/cpu-1.0"]["resident"] and set(views["box-2/cpu-1.0"]["resident"]) <= set(agent.model.experts)

        def fresh():
            with urllib.request.urlopen(base + "/api/cluster", timeout=10) as r:
                view = {e["name"]: e for e in json.loads(r.read())["executors"]}["box-2/cpu-1.0"]
            return view["resident"] == sorted(remote.pool.resident()) and view["batches"] == remote.batches
        until(fresh, 15, "the cluster view follows the remote pool's residency")   # rewritten every second
        # idle, the heartbeat carries what changed since the last batch (a prefetch landing after its reply):
        # the front's view of the remote pool comes to equal what the actor's pool really holds
        until(lambda: sorted(remote.pool.resident()) == ray.get(remote.actor.resident.remote(), timeout=10),
               15, "the front's view of the remote pool equals the actor's own residency")
    finally:
        agent.stop()
    rows = verdict_rows(cfg.db_path)
    assert Counter(r["frame_id"] for r in rows) == Counter(list(reference))  # exactly one verdict per frame
    assert {r["frame_id"]: (r["verdict"], r["reason"]) for r in rows} == reference
    by_exec = dict(db_rows(cfg.db_path, "SELECT executor, count(*) FROM inferences GROUP BY executor"))
    assert by_exec.get("box-2/cpu-1.0", 0) > 0 and by_exec.get("cpu-0.0", 0) > 0, by_exec
    # the remote pool's loads came back as events of that node's tier
    tiers = dict(db_rows(cfg.db_path, "SELECT tier, count(*) FROM expert_events WHERE event='load' GROUP BY tier"))
    assert tiers.get("cpu@box-2", 0) > 0, tiers
    doc = json.loads(status.read_text())
    ex = {e["name"]: e for e in doc["executors"]}
    assert ex["box-2/cpu-1.0"]["node"] == "box-2" and doc["nodes"]["box-2"]["alive"]


def test_killing_a_node_mid_replay_loses_and_duplicates_nothing_and_the_node_rejoins(
        cluster, tiny_zoo, tmp_path, recording):
    """Deterministic: box-3's actor is frozen (SIGSTOP, a hung box) before the second part of the recording,
    so the first batch sent to it after that is provably in flight when the node is killed; then the rest.
    The call timeout (600 s) is far above the wait for the loss (60 s): only Ray's liveness ping, sent while
    the batch is out on the ZeroMQ channel, can end that wait."""
    import signal

    from edge_agent.cluster import sync_store
    from edge_agent.replay import send_messages

    rec = Recording(recording)
    frames = list(rec)
    first, second, rest = frames[:40], frames[40:80], frames[80:]
    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2"), _remote("box-3")],
                            call_timeout_s=600), env={})
    sync_store(cfg)
    agent = Agent(cfg).start()
    frozen = None
    try:
        victim = next(e for e in agent.executors if getattr(e, "node", None) == "box-3")
        assert victim.call_timeout == 600 and victim.channel == "zmq"
        assert victim.where["channel"].startswith("tcp://") and victim.where["channel_echo_ms"] > 0   # handshake
        ingest = agent.endpoints["ingest"]
        assert send_messages(frame_messages(rec, first), ingest, window=40).accepted == len(first)
        assert agent.wait_verdicts(len(first), timeout=120)
        assert victim.batches >= 1, "box-3 served nothing of the first part"

        # box-3 hangs: whatever is sent to it from now on stays in flight (a batch, never answered)
        frozen = victim.where["pid"]
        os.kill(frozen, signal.SIGSTOP)
        sent_before = victim.sent
        done = {}
        sender = threading.Thread(target=lambda: done.setdefault(
            "r", send_messages(frame_messages(rec, second), ingest, window=40)), daemon=True)
        sender.start()
        until(lambda: victim.sent > sent_before and victim.inflight is not None, 120,
               "box-3 was sent a batch after it hung")
        stuck = victim.inflight
        assert stuck is not None and len(stuck) >= 1 and victim.batches == victim.sent - 1
        stuck_ids = {r.frame.frame_id for r in stuck.requests}
        # the batch is out on the ZeroMQ channel, and the channel's wait has sent its liveness ping through Ray
        # (every second; the frozen actor does not answer it)
        assert victim._client is not None
        until(lambda: victim._probe is not None, 10, "the channel's wait pinged box-3's actor through Ray")

        cluster.remove_node(cluster.boxes.pop("box-3"), allow_graceful=False)   # kill its raylet and workers
        os.kill(frozen, signal.SIGKILL)   # the frozen worker cannot notice its raylet is gone
        frozen = None
        killed = time.monotonic()
        until(lambda: victim.lost == 1, 60, "the front noticed box-3 is gone")
        noticed = time.monotonic() - killed
        state = victim.state
        assert not victim.up and "box-3/cpu-2.0" not in agent.scheduler.active()
        health = agent.health()          # the others serve: ready, and the lost one is a warning naming it
        assert health.ready and any("box-3" in w and w.endswith("rejoining") for w in health.warnings), health
        # Ray said the actor died (the ping failed): not the call timeout, which is 10x the wait
        assert state.startswith("lost: ") and "TimeoutError" not in state and "no answer" not in state, state
        # ActorDiedError, or ActorUnavailableError when the connection reset comes first (seen under load)
        assert re.search(r"Actor(Died|Unavailable)Error", state), state
        assert noticed < 60 < victim.call_timeout, noticed
        assert victim.requeued >= len(stuck) > 0     # the batch in flight there was handed back
        sender.join(120)
        assert done["r"].accepted == len(second)
        assert send_messages(frame_messages(rec, rest), ingest, window=16).accepted == len(rest)
        assert agent.wait_verdicts(len(rec), timeout=180)

        # exactly one verdict per frame, and every step of every frame ran to a row once
        rows = verdict_rows(cfg.db_path)
        assert sorted(r["frame_id"] for r in rows) == sorted(f.header["frame_id"] for f in rec)
        assert all(r["verdict"] in ("pass", "defect") for r in rows), Counter(r["reason"] for r in rows)
        steps = db_rows(cfg.db_path, "SELECT frame_id, stage, count(*) FROM inferences GROUP BY 1, 2 HAVING count(*) > 1")
        assert steps == []
        # the stuck batch's frames were run elsewhere, never on box-3
        ran = db_rows(cfg.db_path, "SELECT frame_id, executor FROM inferences WHERE batch_id = %d" % stuck.id)
        assert ran == [] and {f for f, in db_rows(cfg.db_path, "SELECT frame_id FROM inferences")} >= stuck_ids

        # the node comes back: the executor rejoins and serves again
        cluster.boxes["box-3"] = cluster.add_node(**NODE_ARGS, resources={"coe:box-3": 1})
        # `up` turns true inside the rejoin (its connect), before the sync and the restore that end it
        until(lambda: victim.up and victim.rejoined == 1 and "box-3/cpu-2.0" in agent.scheduler.active(), 90,
              "box-3's executor rejoined")
        assert victim.rejoined == 1 and "box-3/cpu-2.0" in agent.scheduler.active()
        # warmed with its share of the start's plan again, not with what the other executors hold
        assert victim.pool.planned and set(victim.pool.resident()) <= set(victim.pool.planned), \
            (victim.pool.resident(), victim.pool.planned)
        before = victim.batches
        msgs = frame_messages(rec, frames, prefix="again-")
        assert send_messages(msgs, ingest, window=16).accepted == len(msgs)
        assert agent.wait_verdicts(2 * len(rec), timeout=180)
        assert victim.batches > before
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGKILL)
        agent.stop()


class _Poison:
    """A frame image that kills whichever process unpickles it: the actor a batch holding it reaches dies,
    every time (a real crash of the worker process; nothing of Ray is replaced)."""

    def __reduce__(self):
        return (os._exit, (13,))


def test_a_batch_that_kills_every_actor_it_reaches_is_given_up_with_an_error_verdict(
        cluster, tiny_zoo, tmp_path, recording):
    from coe import Frame, Request
    from edge_agent.cluster import sync_store
    from edge_agent.replay import send_messages

    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [_remote("box-2")]), env={})   # the only executor
    sync_store(cfg)
    agent = Agent(cfg).start()
    try:
        remote = agent.executors[0]
        import numpy as np

        with agent.scheduler._cond:   # all three queued before the executor takes any: one batch of three
            for fid, image in (("poison-1", _Poison()), ("mate-1", np.zeros((48, 48, 3), np.uint8)),
                               ("mate-2", np.full((48, 48, 3), 200, np.uint8))):
                agent.scheduler.submit(Request(Frame(fid, "T", "B-1", "R0402", 0.0, image), "cls-r0402"))
        assert agent.wait_verdicts(3, timeout=240)
        assert remote.lost == agent.scheduler.max_lost == 3 and agent.scheduler.given_up == 1
        rows = {r["frame_id"]: r for r in verdict_rows(cfg.db_path)}
        assert sorted(rows) == ["mate-1", "mate-2", "poison-1"] and rows["poison-1"]["verdict"] == "error"
        why = rows["poison-1"]["reason"]
        for part in ("poison-1", "cls-r0402", "box-2", "lost 3 times"):
            assert part in why, why
        assert re.search(r"Actor(Died|Unavailable)Error", why), why      # Ray found the death, whichever way
        assert "mate-" not in why
        # its batch mates ran alone once it had been lost, and got their verdicts; nothing ran twice
        assert {rows[m]["verdict"] for m in ("mate-1", "mate-2")} <= {"pass", "defect"}
        errors = db_rows(cfg.db_path, "SELECT frame_id, kind FROM errors")
        assert errors == [("poison-1", "executor_lost")]
        assert db_rows(cfg.db_path, "SELECT frame_id, stage, count(*) FROM inferences GROUP BY 1, 2 "
                                  "HAVING count(*) > 1") == []
        assert {f for f, in db_rows(cfg.db_path, "SELECT frame_id FROM inferences")} == {"mate-1", "mate-2"}

        # the executor came back after each crash and serves the line as before
        until(lambda: remote.up, 90, "box-2's executor rejoined")
        rec = Recording(recording)
        frames = list(rec)[:20]
        assert send_messages(frame_messages(rec, frames), agent.endpoints["ingest"], window=20).accepted == len(frames)
        assert agent.wait_verdicts(3 + len(frames), timeout=180)
        verdicts = Counter(r["verdict"] for r in verdict_rows(cfg.db_path))
        assert verdicts["error"] == 1 and verdicts["pass"] + verdicts["defect"] == 2 + len(frames), verdicts
    finally:
        agent.stop()


def test_an_expert_that_fails_on_a_node_gives_error_verdicts_that_name_the_node(cluster, tiny_zoo, tmp_path,
                                                                                 recording):
    """box-2's own copy of one expert is corrupt (the front box's is fine): its frames get error verdicts whose
    reason says which node failed, and every frame still gets exactly one verdict.  Then a promotion on the
    front box, live, reaches box-2: its frames run the new version there, the failure forgotten."""
    import shutil
    from pathlib import Path

    from edge_agent.cluster import sync_store
    from edge_agent.replay import send_messages
    from storage.expert_store import ExpertStore

    rec = Recording(recording)
    path = _line(tmp_path, tiny_zoo, cluster, [_remote("box-2")], store_poll_s=0.1)
    cfg = load_config(path, env={})
    sync_store(cfg)
    node_store = ExpertStore(cfg.cluster.stores["box-2"])
    bad = node_store.path("cls-r0402")
    data = bytearray(Path(bad).read_bytes())
    data[-1] ^= 0xFF                                                  # a disk error on that box only
    Path(bad).write_bytes(bytes(data))
    agent = Agent(cfg).start()
    try:
        assert replay(rec, agent.endpoints["ingest"], window=16).accepted == len(rec)
        assert agent.wait_verdicts(len(rec), timeout=180)
        rows = verdict_rows(cfg.db_path)
        assert Counter(r["frame_id"] for r in rows) == Counter(f.header["frame_id"] for f in rec)
        errors = [r for r in rows if r["verdict"] == "error"]
        assert errors, Counter(r["verdict"] for r in rows)          # the tiny recording holds R0402 parts
        assert all("node box-2 (box-2/cpu-0.0)" in r["reason"] and "cls-r0402" in r["reason"] for r in errors), \
            errors[0]["reason"]

        # a fixed expert set is promoted on the front box while the agent runs: the watcher syncs box-2's store
        # and its actor follows (new manifest, the failure forgotten), before the frames held meanwhile run
        from click.testing import CliRunner

        from edge_agent.cli import cli

        fixed = tmp_path / "fixed"
        shutil.copytree(tiny_zoo, fixed)
        res = CliRunner().invoke(cli, ["experts", "promote", str(fixed), "--config", str(path)])
        assert res.exit_code == 0, res.output
        until(lambda: agent.store_watch.switches, 60, "the agent switched to the promoted set")
        assert node_store.read_manifest()["cls-r0402"].version == 2            # box-2's own store
        again = frame_messages(rec, list(rec), prefix="again-")
        assert send_messages(again, agent.endpoints["ingest"], window=16).accepted == len(again)
        assert agent.wait_verdicts(2 * len(rec), timeout=180)
    finally:
        agent.stop()
    later = [r for r in verdict_rows(cfg.db_path) if r["frame_id"].startswith("again-")]
    assert len(later) == len(rec) and {r["verdict"] for r in later} <= {"pass", "defect"}, \
        Counter(r["reason"] for r in later)
    ran = db_rows(cfg.db_path, "SELECT DISTINCT expert_id, expert_version, executor FROM inferences "
                             "WHERE frame_id LIKE 'again-%' AND expert_id = 'cls-r0402'")
    assert ran == [("cls-r0402", 2, "box-2/cpu-0.0")], ran


def test_a_node_not_in_the_cluster_and_an_unreachable_address_are_named(cluster, tiny_zoo, tmp_path):
    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-9")]), env={})
    with pytest.raises(CoEError, match="node 'box-9'.*not in the cluster"):
        Agent(cfg).start()
    path = tmp_path / "bad" / "line-T.yaml"
    write_line(path.parent, store=tiny_zoo, executors=[LOCAL, _remote("box-2")],
               cluster={"address": "127.0.0.1:1"})
    with pytest.raises(CoEError, match=r"cluster.address: cannot reach 127.0.0.1:1"):
        Agent(load_config(path, env={})).start()


def test_a_sync_given_a_time_limit_stops_past_it_naming_the_node(cluster, tiny_zoo, tmp_path):
    """A promotion's sync holds the line's new frames: it is bounded, and a node past the bound is named."""
    from edge_agent.cluster import sync_store

    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2")]), env={})
    with pytest.raises(CoEError, match=r"experts sync: node box-2: not done within 1e-06 s"):
        sync_store(cfg, ["box-2"], within=1e-6)
    assert sync_store(cfg, ["box-2"], within=600)["box-2"]["sent"] > 0


def test_a_node_whose_store_serves_other_versions_is_refused_at_start_naming_them(cluster, tiny_zoo, tmp_path):
    """A promotion made on the front box while the agent was down and never synced: the node would serve the
    old weights beside the front's new ones, silently.  The start names the experts and the fix."""
    import shutil

    from click.testing import CliRunner

    from edge_agent.cli import cli
    from edge_agent.cluster import sync_store

    path = _line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2")])
    cfg = load_config(path, env={})
    sync_store(cfg)
    fixed = tmp_path / "fixed"
    shutil.copytree(tiny_zoo, fixed)
    res = CliRunner().invoke(cli, ["experts", "promote", str(fixed), "--config", str(path)])
    assert res.exit_code == 0, res.output
    with pytest.raises(CoEError, match=r"node box-2: its store serves other versions than this box's \(.*node v1, "
                                       r"here v2.*run `coe-agent experts sync`"):
        Agent(cfg).start()
    sync_store(cfg)                                  # the fix it names
    agent = Agent(cfg).start()
    try:
        assert agent.health().ready
    finally:
        agent.stop()


class _Stall:
    """A frame image whose unpickling on the node blocks for 10 minutes: its batch outlasts any call timeout."""

    def __reduce__(self):
        return (time.sleep, (600,))


@pytest.mark.parametrize("channel, says", [("zmq", "no answer from tcp://"), ("ray", "GetTimeoutError")])
def test_a_batch_that_outlasts_the_call_timeout_every_time_is_given_up(cluster, tiny_zoo, tmp_path, channel, says):
    """On either way of sending batches: the ZeroMQ batch channel (default) or Ray calls."""
    from coe import Frame, Request
    from edge_agent.cluster import sync_store

    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [_remote("box-2")], call_timeout_s=2, channel=channel),
                      env={})
    sync_store(cfg)
    agent = Agent(cfg).start()
    try:
        remote = agent.executors[0]
        agent.scheduler.submit(Request(Frame("stall-1", "T", "B-1", "R0402", 0.0, _Stall()), "cls-r0402"))
        assert agent.wait_verdicts(1, timeout=240)
        assert remote.lost == 3 and agent.scheduler.given_up == 1
        (row,) = verdict_rows(cfg.db_path)
        assert row["frame_id"] == "stall-1" and row["verdict"] == "error"
        for part in ("stall-1", "cls-r0402", "box-2", "lost 3 times", says, "in 2 s" if channel == "zmq" else ""):
            assert part in row["reason"], row["reason"]
        until(lambda: remote.up, 90, "box-2's executor rejoined")   # each hung actor was killed, a new one serves
    finally:
        agent.stop()


def test_a_remote_failure_keeps_the_remote_exceptions_own_message_and_hint(cluster, tiny_zoo, tmp_path):
    from edge_agent.cluster import _StoreWriter
    from executors.remote import node_resource, short_error

    # box-2's own store was never synced: the actor's creation fails there, and the hint survives Ray's wrapping
    cfg = load_config(_line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2")]), env={})
    with pytest.raises(CoEError) as err:
        Agent(cfg).start()
    text = str(err.value)
    assert "executor box-2/cpu-1.0 on node box-2: the actor did not come up" in text
    assert "CoEError: node box-2: expert store" in text and "run `coe-agent experts sync`" in text, text
    assert "\x1b[" not in text and "\n" not in text
    # a task that raises on a node: the remote exception itself, not Ray's 'ray::Class.method() (pid=...)' line
    w = ray.remote(_StoreWriter).options(resources={node_resource("box-2"): 0.001}, num_cpus=0).remote(
        str(tmp_path / "w"))
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(w.put.remote("../escape", b"x", "0"), timeout=60)
    finally:
        ray.kill(w)
    assert short_error(err.value) == "ValueError: refusing store file name '../escape'"


def test_a_gpu_actor_sees_the_nodes_gpus_so_cuda_1_means_the_nodes_gpu_1(cluster):
    """A node declaring 2 GPUs (Ray counts what it is told; no GPU needed): placed as an executor's actor is,
    the worker's view is not narrowed to Ray's pick, so `cuda:1` stays the node's GPU 1; placed without that,
    Ray narrows it to the GPU it picked and `local_device` maps or refuses the configured index."""
    from edge_agent.cluster import _Echo
    from executors.remote import actor_options, local_device

    node = cluster.add_node(num_cpus=1, num_gpus=2, include_dashboard=False, resources={"coe:box-g": 1})
    try:
        ours = ray.remote(_Echo).options(**actor_options("box-g", "cuda:1")).remote()
        visible, assigned = ray.get(ours.devices.remote(), timeout=120)
        assert assigned and visible is None                       # Ray assigned one, and left the view alone
        assert local_device("cuda:1", visible, assigned) == "cuda:1"
        opts = {k: v for k, v in actor_options("box-g", "cuda:1").items() if k != "runtime_env"}
        plain = ray.remote(_Echo).options(**opts).remote()
        visible, assigned = ray.get(plain.devices.remote(), timeout=120)
        assert visible == ",".join(assigned) and len(assigned) == 1   # Ray narrowed it to its pick
        mine = f"cuda:{assigned[0]}"
        assert local_device(mine, visible, assigned) == "cuda:0"
        other = "cuda:1" if assigned[0] == "0" else "cuda:0"
        with pytest.raises(CoEError, match=r"Ray gave this actor GPU\(s\) " + assigned[0]):
            local_device(other, visible, assigned)
        ray.kill(ours)
        ray.kill(plain)
    finally:
        cluster.remove_node(node)


def test_a_node_without_a_cluster_section_is_refused(tmp_path, tiny_zoo):
    path = write_line(tmp_path, store=tiny_zoo, executors=[LOCAL, _remote("box-2")])
    with pytest.raises(Exception, match=r"key 'executors.1.node': 'box-2' names a box but the config has no"):
        load_config(path, env={})
    raw = yaml.safe_load(path.read_text())
    raw["executors"] = [LOCAL]
    raw["cluster"] = {"address": "127.0.0.1:6379", "stores": {"box-7": "/x"}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(Exception, match=r"cluster.stores'?: node 'box-7' runs no executor"):
        load_config(path, env={})


def test_cluster_commands_profile_the_links_and_show_the_nodes(cluster, tiny_zoo, tmp_path):
    import json

    from click.testing import CliRunner

    from edge_agent.cli import cli
    from executors.links import Links

    path = _line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2")])
    r = CliRunner().invoke(cli, ["cluster", "profile", "--config", str(path), "--rounds", "5", "--frame-bytes",
                                 "100000"])
    assert r.exit_code == 0, r.output
    links = Links.load(tmp_path / "line" / "data" / "links.json")
    l2 = links.get("box-2")
    assert l2 is not None and l2.latency_s > 0 and l2.bandwidth_bps > 0 and "measured" in l2.source
    assert links.frame_bytes == 100000 and "100000 B frame" in l2.source
    r = CliRunner().invoke(cli, ["cluster", "status", "--config", str(path), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["nodes"]["box-2"]["alive"] and doc["config_nodes"] == ["box-2"] and doc["agent"] is None
    r = CliRunner().invoke(cli, ["experts", "sync", "--config", str(path), "--node", "box-7"])
    assert r.exit_code != 0 and "node 'box-7' runs no executor" in r.output


@pytest.mark.parametrize("channel", ["zmq", "ray"])
def test_the_link_probe_prices_a_real_call_not_half_an_empty_one(cluster, channel, monkeypatch):
    """Frame-sized payloads (inline, as real batches are) and a round trip of a call that waits for work, on the
    path batches take (the ZeroMQ batch channel, or Ray calls)."""
    import edge_agent.cluster as C
    from edge_agent.cluster import INLINE_BYTES, measure_link

    import pickle

    # every probe call runs for real once, and what the node answered is kept (it counts the frames it got);
    # the medians the probe then works from are scripted, so its arithmetic is checked exactly and a busy box's
    # timing cannot turn "loaded" below "empty"
    answers, scripted = [], iter([0.001, 0.003, C.PROBE_WORK_S + 0.0025])    # empty, 6-frame messages, work
    seen, took = [], []

    def median(call, rounds):
        t0 = time.perf_counter()
        got = call()
        took.append(time.perf_counter() - t0)
        answers.append(pickle.loads(got) if isinstance(got, bytes) else got)
        seen.append(next(scripted))
        return seen[-1]
    monkeypatch.setattr(C, "_median_rtt", median)
    s = measure_link("box-2", rounds=10, frame_bytes=150528, channel=channel)
    monkeypatch.undo()
    assert s.frames_per_probe == 6 and 6 * 150528 < INLINE_BYTES          # a message of frames, still inline
    assert answers == [None, 6, 1]                                # the frames really travelled: the node counted them
    assert took[2] >= C.PROBE_WORK_S                                       # that call waited on the node's work
    empty, loaded, real = seen
    assert s.empty_rtt_s == empty and s.frame_bytes == 150528
    assert s.bandwidth_bps == pytest.approx(6 * 150528 / (loaded - empty))
    # the latency is that real call's round trip less its work and its frame's transfer (floored at an empty
    # round trip), not half an empty echo nor the round trip with the work left in
    assert s.latency_s == pytest.approx(real - C.PROBE_WORK_S - 150528 / s.bandwidth_bps)
    big = measure_link("box-2", rounds=5, frame_bytes=3 << 20, channel=channel)   # above the limit: one per message
    assert big.frames_per_probe == 1


def test_coe_agent_profile_measures_the_links_of_a_cluster_line(cluster, tiny_zoo, tmp_path):
    from click.testing import CliRunner

    from edge_agent.cli import cli
    from executors.links import Links

    path = _line(tmp_path, tiny_zoo, cluster, [LOCAL, _remote("box-2")])
    r = CliRunner().invoke(cli, ["profile", "--config", str(path), "--batch-sizes", "1,2", "--repeats", "1",
                                 "--concurrency-seconds", "0.05", "--no-plots", "--link-rounds", "5"])
    assert r.exit_code == 0, r.output
    links = Links.load(tmp_path / "line" / "data" / "links.json")
    assert set(links.links) == {"box-2"} and links.source.startswith("coe-agent profile on ")
    assert "link box-2:" in r.output and "links:" in r.output


def test_the_agent_prices_remote_frames_at_the_measured_frame_size(tiny_zoo, tmp_path):
    """links.json's frame size and link reach the agent's cost model (no Ray needed to build the agent)."""
    from executors.links import Link, Links

    path = write_line(tmp_path / "line", store=tiny_zoo, executors=[LOCAL, _remote("box-2")],
                      cluster={"address": "127.0.0.1:1"})
    Links({"box-2": Link(1e6, 0.004, "test")}, frame_bytes=50_000).save(tmp_path / "line" / "data" / "links.json")
    agent = Agent(load_config(path, env={}))
    assert agent.costs.frame_bytes == 50_000
    assert agent.costs.transfer("box-2/cpu-1.0") == pytest.approx((0.05, 0.004))
    assert agent.costs.transfer("cpu-0.0") == (0.0, 0.0)
    K_local, B_local = agent.costs.exec_cost("cpu-0.0", "cls-r0402")
    K_remote, B_remote = agent.costs.exec_cost("box-2/cpu-1.0", "cls-r0402")
    assert (K_remote - K_local, B_remote - B_local) == pytest.approx((0.05, 0.004))
