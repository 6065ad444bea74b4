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
    assert s.submit(req("c")) in ("x", "y")
    assert s.depth() == 4


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
