"""The grouping scheduler: arranging behind the same expert, batch caps, executor assignment."""
import threading

import numpy as np

from coe import Frame, Request
from executors.scheduler import FixedCosts, Scheduler


def grouping(executors, *, max_batch=16, policy="grouped", resident=None):
    """The scheduler without a profile: fixed costs, grouping and batching."""
    return Scheduler(executors, policy, costs=FixedCosts(max_batch=max_batch, resident=resident))


def req(expert, i=0):
    return Request(Frame(f"f{i}", "A", "B1", "R", 0.0, np.zeros((2, 2, 3), np.uint8)), expert)


def test_fcfs_only_batches_neighbours():
    s = grouping(["x"], max_batch=8, policy="fcfs")
    for i, e in enumerate("aab a".replace(" ", "")):
        s.submit(req(e, i))
    assert [len(s.next_batch("x", timeout=0)) for _ in range(3)] == [2, 1, 1]


def test_max_batch_caps_a_group():
    s = grouping(["x"], max_batch=4)
    for i in range(10):
        s.submit(req("a", i))
    assert [len(s.next_batch("x", timeout=0)) for _ in range(3)] == [4, 4, 2]
    assert s.next_batch("x", timeout=0) is None


def test_assignment_prefers_executor_holding_the_expert():
    resident = {"x": set(), "y": {"b"}}
    s = grouping(["x", "y"], resident=lambda n: resident[n])
    assert s.submit(req("a")) == "x"         # both empty: first shortest
    assert s.submit(req("b")) == "y"         # y has b resident
    assert s.submit(req("a")) == "x"         # x has a queued
    # nobody holds or queues c, so every executor is a candidate and the shortest queue wins:
    # y holds one request (b), x two (a, a)
    assert s.submit(req("c")) == "y"
    assert s.queued_experts("x") == ["a", "a"] and s.queued_experts("y") == ["b", "c"]


def test_age_bound_serves_a_starved_group_first():
    """A head group that keeps growing (a hot expert under a continuous stream) would starve a group
    queued behind it; past `max_wait` the oldest waiting request's group is served next, once the
    requests the head group held when it was picked are served (a group is never split between reloads)."""
    def run(max_wait):
        t = [0.0]
        s = Scheduler(["x"], "grouped", costs=FixedCosts(K=0.0, B=0.0, load=0.0, max_batch=1), now=lambda: t[0],
                      max_wait=max_wait)   # free costs: the predicted wait is 0, the bound is max_wait
        s.submit(req("a", 0))
        s.submit(req("a", 1))
        t[0] = 1.0
        s.submit(req("b", 2))                     # behind the a group
        t[0] = 1.5
        got = [s.next_batch("x", timeout=0)]      # picks a with 2 requests: both are served first
        t[0] = 2.0
        s.submit(req("a", 3))
        s.submit(req("a", 4))                     # join the head group (arranging) after it was picked
        t[0] = 3.5                                # b has waited 2.5 s, the head group's newest 1.5 s
        got += [s.next_batch("x", timeout=0) for _ in range(4)]
        return [b.expert_id for b in got], s.aged

    assert run(2.0) == (["a", "a", "b", "a", "a"], 1)   # fired once, for b, after a's first two
    assert run(3.0) == (["a", "a", "a", "a", "b"], 0)   # 2.5 s is within the bound: the head first
    assert run(None) == (["a", "a", "a", "a", "b"], 0)  # off: the head group, however long b waits


def test_close_wakes_waiters_and_drains():
    s = grouping(["x"])
    got = []
    t = threading.Thread(target=lambda: got.append(s.next_batch("x")))
    t.start()
    s.close()
    t.join(2)
    assert got == [None] and not t.is_alive()
    s2 = grouping(["x"])
    s2.submit(req("a"))
    s2.close()
    assert not s2.drained("x") and s2.next_batch("x") is not None and s2.drained("x")
