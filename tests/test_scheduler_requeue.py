"""Requests handed back by a lost executor (issue 15): the last one down gets nothing, requests wait in the
scheduler until one is restored, and requeued requests keep their age (the `max_wait` bound and the order
among them hold across the loss).  The real Scheduler on an injected clock."""
from coe import Frame, Request
from executors.scheduler import FixedCosts, Scheduler


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def req(fid: str, expert: str) -> Request:
    return Request(Frame(fid, "A", "B", "C", 0.0, None), expert)


def ids(batch) -> list[str]:
    return [r.frame.frame_id for r in batch.requests]


def test_the_last_executor_down_gets_no_assignment_and_requests_wait_until_one_is_restored():
    s = Scheduler(["a", "b"], "coserve", costs=FixedCosts())
    assert s.requeue(s.retire("b")) == [] and s.active() == ["a"]
    s.submit(req("f1", "x"))
    back = s.retire("a")                                # the last one standing goes down too
    assert [r.frame.frame_id for r in back] == ["f1"] and s.active() == []
    assert s.requeue(back) == []
    assert s.submit(req("f2", "x")) is None             # nowhere to go: it waits in the scheduler
    assert s.waiting() == 2 and s.depth() == 2
    assert s.next_batch("a", timeout=0) is None and s.next_batch("b", timeout=0) is None   # nothing handed out
    s.close()
    assert not s.drained("a") and not s.drained("b")    # closed, but requests still wait for an executor
    s.restore("b")
    assert s.active() == ["b"] and s.waiting() == 0
    assert ids(s.next_batch("b", timeout=0)) == ["f1", "f2"]   # oldest first
    assert s.drained("b")


def _lose_a_with_an_old_request(requeue: bool):
    """`old` (expert x) queued on a at t=0, a younger group of y on b at t=1; a is lost at t=9."""
    now = Clock()
    s = Scheduler(["a", "b"], "coserve-paper", costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8),
                  now=now, max_wait=5.0)
    s.retire("b")
    assert s.submit(req("old", "x")) == "a"              # due at t=0
    s.restore("b")
    now.t = 1.0
    assert s.submit(req("y1", "y")) == "b"               # due at t=1, the head of b's queue
    now.t = 9.0
    back = s.retire("a")
    if requeue:
        assert s.requeue(back) == []
    else:                                                # what a plain resubmission would do: a fresh age
        s.submit(back[0])
    assert s.queued_experts("b") == ["y", "x"]
    now.t = 9.5
    return s, s.next_batch("b", timeout=0)


def test_requeued_requests_keep_their_age_so_the_age_bound_still_fires():
    s, first = _lose_a_with_an_old_request(requeue=True)
    # x's request is overdue by more than max_wait counted from t=0, not from its requeue at t=9: served first
    assert ids(first) == ["old"] and s.aged == 1
    s, first = _lose_a_with_an_old_request(requeue=False)   # the control: made younger, it waits behind y
    assert ids(first) == ["y1"] and s.aged == 0


def test_requeued_requests_go_in_front_of_younger_ones_of_their_group_and_a_lost_batch_keeps_its_age():
    now = Clock()
    s = Scheduler(["a", "b"], "coserve", costs=FixedCosts(max_batch=2), now=now)
    s.retire("b")
    s.submit(req("r0", "x"))                             # due 0
    now.t = 3.0
    s.submit(req("r1", "x"))                             # due 3
    lost = s.next_batch("a", timeout=0)                  # both in flight on a
    assert ids(lost) == ["r0", "r1"] and lost.due == [0.0, 3.0]
    now.t = 10.0
    s.restore("b")
    s.submit(req("r2", "x"))                             # a younger request queued meanwhile (due 10)
    s.finished(lost, lost=True)                          # a dies with the batch
    back = s.retire("a")
    assert s.requeue(list(lost.requests)[::-1] + back) == []   # handed back in any order
    served = []
    while (b := s.next_batch("b", timeout=0)) is not None:
        served += list(zip(ids(b), b.due))
    assert served == [("r0", 0.0), ("r1", 3.0), ("r2", 10.0)]


def test_requests_of_a_lost_batch_run_alone_so_only_the_poison_is_given_up():
    """A batch of three is lost (its executor died): each then runs as a batch of one, the frame that kills
    every executor is given up after `max_lost`, its batch mates run once and are done."""
    now = Clock()
    s = Scheduler(["a"], "coserve", costs=FixedCosts(max_batch=8), now=now, max_lost=2)
    poison, g1, g2 = req("p", "x"), req("g1", "x"), req("g2", "x")
    for r in (poison, g1, g2):
        s.submit(r)
    b = s.next_batch("a", timeout=0)
    assert ids(b) == ["p", "g1", "g2"]
    s.finished(b, lost=True)
    assert s.requeue(b.requests) == []
    s.submit(req("g3", "x"))                              # fresh requests of the same expert
    s.submit(req("g4", "x"))
    first = s.next_batch("a", timeout=0)
    assert ids(first) == ["p"]                            # alone
    s.finished(first, lost=True)
    assert s.requeue(first.requests) == [poison] and s.given_up == 1   # second loss: given up
    second = s.next_batch("a", timeout=0)
    assert ids(second) == ["g1"]                          # alone too (lost once), and it runs
    s.finished(second)
    assert ids(s.next_batch("a", timeout=0)) == ["g2"]
    assert ids(s.next_batch("a", timeout=0)) == ["g3", "g4"]   # never lost: batched as usual


def test_a_request_lost_once_joins_no_batch_of_younger_requests_either():
    """Its kept due time can sit behind a fresh request's: then the fresh ones go without it, and it alone."""
    now = Clock()
    s = Scheduler(["a", "b"], "coserve", costs=FixedCosts(max_batch=8), now=now)
    s.retire("b")
    now.t = 5.0
    s.submit(req("p", "x"))                               # due at 5
    b = s.next_batch("a", timeout=0)
    s.finished(b, lost=True)
    s.restore("b")
    s.retire("a")
    now.t = 6.0
    s.submit(req("g", "x"))                               # queued on b before p comes back
    now.t = 0.0
    s.submit(req("h", "x"))
    assert s.requeue(b.requests) == []
    batches = []
    while (nb := s.next_batch("b", timeout=0)) is not None:
        batches.append(ids(nb))
        s.finished(nb)
    assert sorted(sum(batches, [])) == ["g", "h", "p"]
    assert ["p"] in batches                               # never batched with the others
