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


def test_a_sync_checks_a_copy_that_was_still_loading_once_it_has_landed():
    """`reload_store` checks each changed expert's copy; one still loading (a prefetch under way) is waited for,
    not skipped: it may be of the version the sync replaced."""
    import threading

    from executors.prefetch import Deferred
    from executors.remote import _settled
    from storage.policies import make_policy
    from storage.pool import Pool

    class Source:
        def size(self, eid):
            return 10

        def load(self, eid):
            return bytearray(b"v1" * 5)

    pool = Pool("cpu", 100, make_policy("lru"), Source())
    own = Deferred()
    fut = pool.acquire_async("x", own)
    assert pool.present("x") and pool.peek("x") is None          # loading: no value yet
    threading.Timer(0.2, own.run).start()
    assert _settled(pool, "x") == bytearray(b"v1" * 5)            # waited for, then checked
    pool.release(fut.result(10))
    assert _settled(pool, "y") is None
