"""Losing a remote executor hands its requests back first: a clean-up step that raises strands none of them.

The real `RemoteExecutor._lose` and the real `Scheduler`; the actor is already gone (None), as after a node
death, so no Ray cluster is needed.
"""
from __future__ import annotations

import pytest

from coe import Frame, Request
from executors.remote import RemoteExecutor, RemoteSpec
from executors.scheduler import Batch, FixedCosts, Scheduler

pytest.importorskip("ray")


class _BrokenPool:
    """A pool view whose clean-up fails, as a view in a state nobody foresaw might."""

    def forget(self) -> None:
        raise RuntimeError("forget failed")


def _req(fid: str, expert: str) -> Request:
    return Request(Frame(fid, "A", "B", "C", 0.0, None), expert)


def test_a_failing_clean_up_after_a_loss_still_requeues_every_request_the_executor_held():
    s = Scheduler(["gone", "left"], "coserve-paper", costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8))
    s.retire("left")
    for i in range(3):
        assert s.submit(_req(f"q{i}", "x")) == "gone"
    s.restore("left")
    batch = Batch("gone", "y", [_req("b0", "y")])
    spec = RemoteSpec(name="gone", node="n1", device="cpu", memory=1 << 20, expert_memory=1 << 20, store="/nowhere")
    ex = RemoteExecutor(spec, model=None, pool=_BrokenPool(), scheduler=s, on_result=lambda r: None)
    ex._lose(RuntimeError("node died"), batch)
    assert s.active() == ["left"]
    assert ex.requeued == 4 and ex.lost == 1 and ex.actor is None
    got = []
    while (b := s.next_batch("left", timeout=0)) is not None:
        got += [r.frame.frame_id for r in b.requests]
    assert sorted(got) == ["b0", "q0", "q1", "q2"]


def test_a_sync_drops_a_stale_copy_and_checks_one_still_loading_before_it_serves(tmp_path, tiny_zoo, monkeypatch):
    """The node's actor body (`ExecutorHost`, plain Python here) after a promotion reached its store: a resident
    copy of the replaced version is dropped; a copy still loading past the short wait is checked later (the
    next batch or heartbeat), not skipped, and not waited for so long that the front takes the node for lost."""
    import shutil

    from coe import parse_spec
    from conftest import TINY_SPEC
    from executors import remote as remote_mod
    from executors.prefetch import Deferred
    from executors.remote import ExecutorHost
    from storage.expert_store import ExpertStore

    store_dir = tmp_path / "node-store"
    shutil.copytree(tiny_zoo, store_dir)
    model = parse_spec(TINY_SPEC)
    spec = RemoteSpec(name="box-2/cpu-0.0", node="box-2", device="cpu", memory=40 << 20, expert_memory=40 << 20,
                      store=str(store_dir), prefetch=False)
    host = ExecutorHost(spec, model)
    eid = "det-2term"
    host.pool.release(host.pool.acquire(eid))                   # version 1, resident
    store = ExpertStore(store_dir)
    tensors = store.read(eid)
    first = next(iter(tensors))
    store.write(model.experts[eid], {**tensors, first: tensors[first] + 1}, version=2)   # other bytes
    host.reload_store([eid])
    assert not host.pool.present(eid) and not host._unchecked      # the stale copy went

    other = "cls-r0402"
    monkeypatch.setattr(remote_mod, "SETTLE_S", 0.05)
    own = Deferred()
    fut = host.pool.acquire_async(other, own)                      # a load under way when the sync comes
    host.reload_store([other])
    assert other in host._unchecked                                # not waited for past the short wait
    own.run()
    host.pool.release(fut.result(10))
    host.heartbeat()                                               # checked once it has landed
    assert not host._unchecked and host.pool.present(other)        # current: kept


class _Costs(FixedCosts):
    """Fixed costs that fail for the experts in `broken`: a cost model that lost an expert's profile."""

    broken: set = set()

    def exec_cost(self, executor: str, expert_id: str):
        if expert_id in self.broken:
            raise KeyError(f"no cost for {expert_id}")
        return super().exec_cost(executor, expert_id)


def test_a_request_that_cannot_be_scheduled_again_gets_an_error_result_and_strands_none_after_it():
    costs = _Costs(K=1.0, B=0.0, load=0.0, max_batch=8)
    s = Scheduler(["gone", "left"], "coserve-paper", costs=costs)
    s.retire("left")
    for fid, expert in (("q0", "x"), ("q1", "z"), ("q2", "x")):
        assert s.submit(_req(fid, expert)) == "gone"
    s.restore("left")
    costs.broken = {"z"}
    results = []
    spec = RemoteSpec(name="gone", node="n1", device="cpu", memory=1 << 20, expert_memory=1 << 20, store="/nowhere")
    ex = RemoteExecutor(spec, model=None, pool=_BrokenPool(), scheduler=s, on_result=results.append)
    ex._lose(RuntimeError("node died"), Batch("gone", "y", [_req("b0", "y")]))
    got = []
    while (b := s.next_batch("left", timeout=0)) is not None:
        got += [r.frame.frame_id for r in b.requests]
    assert sorted(got) == ["b0", "q0", "q2"] and ex.requeued == 3      # before: q1 raised, q2 was stranded
    [err] = results
    assert [r.frame.frame_id for r in err.batch.requests] == ["q1"] and err.error_kind == "internal"
    assert "scheduling failed: KeyError" in err.error and "no cost for z" in err.error


def test_restore_assigns_every_waiting_request_it_can_and_returns_the_others_with_why():
    costs = _Costs(K=1.0, B=0.0, load=0.0, max_batch=8)
    s = Scheduler(["a"], "coserve-paper", costs=costs)
    s.retire("a")
    for fid, expert in (("w0", "x"), ("w1", "z"), ("w2", "x")):
        assert s.submit(_req(fid, expert)) is None                     # no executor: they wait
    costs.broken = {"z"}
    unplaced = s.restore("a")
    assert [(r.frame.frame_id, why.startswith("scheduling failed: KeyError")) for r, why in unplaced] == [("w1", True)]
    assert s.waiting() == 0 and s.depth() == 2
    assert s.restore("a") == []                                        # already active: nothing to do


def test_a_lost_executor_ends_its_thread_when_the_agent_closes_though_requests_wait_for_it():
    """Every executor lost, requests waiting for one to rejoin, the agent stops: the thread must end (before,
    it tried to rejoin forever and `stop` counted it stuck, keeping the results database locked)."""
    import threading

    s = Scheduler(["gone"], "coserve-paper", costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8))
    s.retire("gone")
    assert s.submit(_req("w0", "x")) is None and s.waiting() == 1
    spec = RemoteSpec(name="gone", node="n1", device="cpu", memory=1 << 20, expert_memory=1 << 20, store="/nowhere")
    ex = RemoteExecutor(spec, model=None, pool=_BrokenPool(), scheduler=s, on_result=lambda r: None, rejoin_s=0.05)
    ex.state = "lost: node died"
    s.close()
    t = threading.Thread(target=ex._loop, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive() and s.waiting() == 1        # ended; the request stays (journaled: the next start)


def test_a_node_the_promotion_did_not_reach_leaves_service_and_the_others_still_follow(monkeypatch):
    """Each node is synced and reloaded on its own: box-2's failed sync no longer stops box-3's actors from
    following, and box-2's executor retires before its next batch (it rejoins, which syncs, before it serves
    again) instead of serving the old weights until some later loss."""
    import threading
    from types import SimpleNamespace

    from coe import CoEError
    from edge_agent import cluster
    from edge_agent.agent import Agent

    s = Scheduler(["box-2/cpu", "box-3/cpu"], "coserve-paper", costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8))
    made = {}
    for name, node in (("box-2/cpu", "box-2"), ("box-3/cpu", "box-3")):
        spec = RemoteSpec(name=name, node=node, device="cpu", memory=1 << 20, expert_memory=1 << 20, store="/x")
        ex = made[node] = RemoteExecutor(spec, model=None, pool=_BrokenPool(), scheduler=s, on_result=lambda r: None)
        ex.up, ex.state = True, "up"
    reloaded = []
    made["box-3"].reload_store = lambda changed, timeout=60.0: reloaded.append(changed)
    made["box-2"].reload_store = lambda changed, timeout=60.0: reloaded.append(("box-2", changed))
    synced = []

    def sync(cfg, nodes, within=None):
        assert within is not None           # a promotion's sync is bounded: it holds the line's new frames
        if nodes == ["box-2"]:
            raise CoEError("experts sync: node box-2 (store /x): disk full")
        synced.append(nodes)
    monkeypatch.setattr(cluster, "sync_store", sync)
    Agent._promote_remote(SimpleNamespace(executors=list(made.values()), cfg=None, _synced={},
                                          _manifest_digest=lambda: "m2"), {"cls-a": 2})
    assert synced == [["box-3"]] and reloaded == [["cls-a"]]          # box-3 followed; box-2 was not reloaded
    assert made["box-3"]._stale is None and "disk full" in made["box-2"]._stale

    r = _req("q0", "x")
    assert s.submit(r) in ("box-2/cpu", "box-3/cpu")
    s.retire("box-3/cpu")                  # so the next batch of the queue is box-2's to take
    s.requeue([r])
    s.restore("box-3/cpu")
    s.close()
    t = threading.Thread(target=made["box-2"]._loop, daemon=True)
    t.start()
    t.join(30)
    ex = made["box-2"]
    assert not t.is_alive() and ex.lost == 1 and not ex.up and ex.state.startswith("lost: ")
    assert "promotion" in ex.state and ex.batches == 0                # nothing ran there on the old weights
    assert "box-2/cpu" not in s.active()


def test_a_node_that_answers_a_batch_with_its_own_failure_is_not_taken_for_lost():
    """The batch channel's error status (the node's handler raised, e.g. a frame it cannot unpickle): the
    batch's frames get error results naming the node, and the live node keeps serving (before: retired, its
    warm pool thrown away, the batch retried on the next node, three times)."""
    import numpy as np

    from coe import parse_spec
    from conftest import TINY_SPEC
    from executors.remote import RemotePool
    from executors.remote_channel import ChannelClient, ChannelServer

    def handler(blob):
        raise ValueError("cannot unpickle the frame (test)")
    server = ChannelServer(handler, "127.0.0.1")
    model = parse_spec(TINY_SPEC)
    s = Scheduler(["box-2/cpu"], "coserve-paper", costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8))
    results = []
    spec = RemoteSpec(name="box-2/cpu", node="box-2", device="cpu", memory=1 << 20, expert_memory=1 << 20,
                      store="/x")
    pool = RemotePool("box-2/cpu", "cpu", 1 << 20, model, "box-2")
    ex = RemoteExecutor(spec, model=model, pool=pool, scheduler=s, on_result=results.append)
    ex.up, ex.state, ex._client = True, "up", ChannelClient(server.endpoint)
    ex._alive = lambda: None                  # the channel's liveness probe asks Ray; there is no actor here
    try:
        expert = next(iter(model.experts))
        s.submit(Request(Frame("f0", "A", "B", "C", 0.0, np.zeros((2, 2, 3), np.uint8)), expert))
        batch = s.next_batch("box-2/cpu", timeout=0)
        ex._serve(batch)
    finally:
        ex._client.close()
        server.close()
    [res] = results
    assert res.error_kind == "expert_run" and "node box-2" in res.error and "cannot unpickle the frame" in res.error
    assert ex.up and ex.lost == 0 and s.active() == ["box-2/cpu"] and ex.inflight is None


def test_a_nodes_warm_up_may_take_as_long_as_its_planned_bytes_need_at_the_slowest_read():
    from coe import parse_spec
    from conftest import TINY_SPEC
    from executors.remote import WARM_MIN_BPS, RemotePool

    model = parse_spec(TINY_SPEC)
    spec = RemoteSpec(name="b/cpu", node="b", device="cpu", memory=1 << 30, expert_memory=1 << 30, store="/x")
    sizes = {e: 300 * 10**6 for e in model.experts}             # what the front store's manifest says
    ex = RemoteExecutor(spec, model=model, pool=RemotePool("b/cpu", "cpu", 1 << 30, model, "b"),
                        scheduler=Scheduler(["b/cpu"], "coserve-paper", costs=FixedCosts()), on_result=print,
                        call_timeout=60.0, connect_timeout=30.0, size_of=sizes.__getitem__)
    assert ex._warm_timeout([]) == 60.0                          # nothing planned: the call limits
    planned = list(model.experts)[:6]
    assert ex._warm_timeout(planned) == 6 * 300e6 / WARM_MIN_BPS > 60.0   # 1.8 GB at the slowest read: 90 s


def test_a_rejoin_syncs_a_node_only_when_the_store_changed_since_its_last_sync(tmp_path, monkeypatch):
    """A node that keeps failing to rejoin must not have the whole store hashed on both boxes every time."""
    from types import SimpleNamespace

    from edge_agent import cluster
    from edge_agent.agent import Agent

    (tmp_path / "manifest.json").write_text('{"v": 1}')
    calls = []
    monkeypatch.setattr(cluster, "sync_store", lambda cfg, nodes, **kw: calls.append(list(nodes)))
    agent = SimpleNamespace(cfg=None, _synced={},
                            _line_store_base=lambda: SimpleNamespace(manifest_path=tmp_path / "manifest.json"))
    agent._manifest_digest = lambda: Agent._manifest_digest(agent)
    for _ in range(3):
        Agent._sync_node(agent, "box-2")
    assert calls == [["box-2"]]                       # once; the two rejoins after it found nothing new
    (tmp_path / "manifest.json").write_text('{"v": 2}')    # a promotion
    Agent._sync_node(agent, "box-2")
    Agent._sync_node(agent, "box-3")
    assert calls == [["box-2"], ["box-2"], ["box-3"]]
    Agent._sync_node(agent, "box-3", force=True)          # a node whose store is not what was synced (wiped)
    assert calls[-1] == ["box-3"] and len(calls) == 4
