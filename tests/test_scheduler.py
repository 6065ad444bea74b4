"""The grouping scheduler: arranging behind the same expert, batch caps, executor assignment."""
import threading
from collections import deque

import numpy as np
import pytest

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
    t.join(10)
    assert got == [None] and not t.is_alive()
    s2 = grouping(["x"])
    s2.submit(req("a"))
    s2.close()
    assert not s2.drained("x") and s2.next_batch("x") is not None and s2.drained("x")


# -- fill: while the head's expert loads, a resident group that ends before it runs first -------------------

def _queue(policy: str, resident: set[str], *, K: float = 1.0, B: float = 1.0, loading: dict | None = None,
           now=lambda: 0.0, max_wait: float | None = None, max_batch: int = 8, bs: int = 1) -> Scheduler:
    """One queue holding a group of 'a' (submitted first: the head) then `bs` requests of 'b'.  `loading`:
    expert -> seconds its load under way still needs (as the prefetcher reports it)."""
    load = {} if loading is None else loading
    s = Scheduler(["q"], policy, costs=FixedCosts(K=K, B=B, load=10.0, max_batch=max_batch,
                                                  resident=lambda n: resident, loading=lambda n: load),
                  now=now, max_wait=max_wait)
    for i, e in enumerate(["a", "a"] + ["b"] * bs):
        s.submit(req(e, i))
    assert s.queued_groups("q") == ["a", "b"]
    return s


def test_a_resident_group_runs_while_the_head_expert_loads():
    loading = {"a": 10.0}                              # a: its prefetch still needs 10 s; b: resident, 2 s of batch
    s = _queue("coserve", {"b"}, loading=loading)
    first = s.next_batch("q", timeout=0)
    assert first.expert_id == "b" and s.filled == 1
    s.finished(first)
    loading.clear()                                    # a's load is in
    s.costs._resident = lambda n: {"a", "b"}
    second = s.next_batch("q", timeout=0)
    assert second.expert_id == "a" and len(second) == 2 and s.filled == 1


@pytest.mark.parametrize("case", ["paper rule", "no fill lever", "head resident", "head not loading",
                                  "other not resident", "other too long"])
def test_the_head_runs_first_unless_a_resident_group_ends_within_its_load(case):
    # fill's choice alone: with `hold` (coserve) a head still loading that nothing fills is waited on, not taken
    policy = {"paper rule": "coserve-paper", "no fill lever": "coserve-nofill"}.get(case, "coserve-nohold")
    resident = {"head resident": {"a", "b"}, "other not resident": set()}.get(case, {"b"})
    loading = {} if case in ("head not loading", "head resident") else {"a": 2.5}
    K = 1.6 if case == "other too long" else 1.0      # b's batch: K + B = 2.0 s fits a 2.5 s wait, 2.6 s does not
    s = _queue(policy, resident, K=K, loading=loading)
    b = s.next_batch("q", timeout=0)
    assert b.expert_id == "a" and s.filled == 0
    if case == "other too long":                       # the boundary: a batch that ends within the load fills
        s2 = _queue(policy, resident, K=1.0, loading=loading)
        assert s2.next_batch("q", timeout=0).expert_id == "b" and s2.filled == 1


def _host_queue(groups: list[tuple[str, int]], *, resident=(), host=(), wait: float = 3.0, max_batch: int = 4,
                policy: str = "coserve-nohold"):
    """One queue: head 'h' (its load under way, `wait` s left), then `groups` (expert, requests) in order.
    K = B = 0.5 s; a copy from the host tier 1 s, a read from the SSD 10 s.  Fill's choice alone (no `hold`:
    a head that nothing fills is taken, not waited on)."""
    s = Scheduler(["q"], policy, costs=FixedCosts(K=0.5, B=0.5, load=10.0, max_batch=max_batch,
                                                     resident=lambda n: set(resident), loading=lambda n: {"h": wait},
                                                     host=lambda n: set(host), host_load=1.0))
    i = 0
    for e, n in [("h", 1), *groups]:
        for _ in range(n):
            s.submit(req(e, i))
            i += 1
    assert s.queued_groups("q") == ["h", *(e for e, _ in groups)]
    return s


def test_a_group_in_the_host_tier_fills_when_its_copy_and_batch_end_within_the_heads_load():
    """A2 at F = 0.8 (simulated): rare types whose experts sat in the host tier waited 2.5 s behind a head
    whose SSD read was queued, though their copy and batch took 0.02 s.  Copy 1 + K 0.5 * 2 + B 0.5 = 2.5 s
    fits a 3 s wait, not a 2.4 s one; an SSD group never fills."""
    s = _host_queue([("s", 1), ("c", 2)], host={"c"})
    b = s.next_batch("q", timeout=0)
    assert b.expert_id == "c" and len(b) == 2 and s.filled == 1
    s2 = _host_queue([("s", 1), ("c", 2)], host={"c"}, wait=2.4)
    assert s2.next_batch("q", timeout=0).expert_id == "h" and s2.filled == 0


def test_a_group_that_needs_an_ssd_read_never_fills_however_long_the_wait():
    """Its read would queue on the SSD with the head's own: load 10 s + batch 1 s fits a 100 s wait, and still
    the head is served."""
    s = _host_queue([("s", 1)], wait=100.0)
    assert s.next_batch("q", timeout=0).expert_id == "h" and s.filled == 0


def test_of_two_host_groups_that_fit_the_first_in_queue_order_fills():
    s = _host_queue([("c", 1), ("d", 1)], host={"c", "d"}, wait=100.0)
    assert s.next_batch("q", timeout=0).expert_id == "c" and s.filled == 1


def test_a_resident_filler_goes_before_an_earlier_group_that_needs_a_copy():
    """A copy costs a victim and the copy's time; a resident group fills for free, so it is preferred."""
    s = _host_queue([("c", 1), ("r", 1)], resident={"r"}, host={"c"})
    assert s.next_batch("q", timeout=0).expert_id == "r" and s.filled == 1


def test_a_group_in_the_host_tier_fills_only_if_one_batch_takes_all_of_it():
    """A copy made for part of a group would be made again for the rest (B1 with 500 types, skew 0.5,
    flood: 41 more switches and -10% throughput when partial groups filled)."""
    s = _host_queue([("c", 5)], host={"c"}, wait=100.0, max_batch=4)
    assert s.next_batch("q", timeout=0).expert_id == "h" and s.filled == 0
    s2 = _host_queue([("c", 4)], host={"c"}, wait=100.0, max_batch=4)
    assert len(s2.next_batch("q", timeout=0)) == 4 and s2.filled == 1


# -- hold: while the head's expert loads and nothing fills, wait for the load (or a filler), do not block on it --

def test_a_head_still_loading_that_nothing_fills_is_waited_on_not_taken():
    loading = {"a": 2.0}
    s = _queue("coserve", set(), loading=loading, max_wait=100.0)   # b needs a load too: nothing fills
    assert s.next_batch("q", timeout=0) is None and s.held == 1 and s.filled == 0
    assert s.next_batch("q", timeout=0) is None and s.held == 1       # the same head: counted once
    loading.clear()                                         # its load is in
    s.costs._resident = lambda n: {"a"}
    b = s.next_batch("q", timeout=0)
    assert b.expert_id == "a" and len(b) == 2
    s2 = _queue("coserve-nohold", set(), loading={"a": 2.0}, max_wait=100.0)
    assert s2.next_batch("q", timeout=0).expert_id == "a" and s2.held == 0   # the lever off: taken, as before
    s3 = _queue("coserve-nofill", set(), loading={"a": 2.0}, max_wait=100.0)
    assert s3.next_batch("q", timeout=0).expert_id == "a" and s3.held == 0   # hold is part of fill
    s4 = _queue("coserve", set(), loading={"a": 2.0}, max_wait=None)
    assert s4.next_batch("q", timeout=0).expert_id == "a" and s4.held == 0   # no age bound: no backlog rule, no hold


def test_a_queue_in_backlog_takes_its_loading_head_rather_than_hold():
    """Hold only while the queue holds at most `max_wait` of predicted work: deeper, throughput comes first.
    Here the queue predicts a's load (2 s) + 2 x K + B (3 s) + b's switch and batch: over a 1 s bound, under
    a 100 s one."""
    s = _queue("coserve", set(), loading={"a": 2.0}, max_wait=1.0)
    assert s.estimate("q") > 1.0
    assert s.next_batch("q", timeout=0).expert_id == "a" and s.held == 0
    s2 = _queue("coserve", set(), loading={"a": 2.0}, max_wait=100.0)
    assert s2.next_batch("q", timeout=0) is None and s2.held == 1


def test_an_overdue_head_is_not_waited_on():
    """Fill serves nothing ahead of a head the age bound has made due, so waiting would free nothing."""
    clock = [0.0]
    s = _queue("coserve", set(), loading={"a": 2.0}, now=lambda: clock[0], max_wait=100.0)
    assert s.next_batch("q", timeout=0) is None and s.held == 1
    clock[0] = 101.0
    s.costs._loading = lambda n: {"a": 2.0}
    assert s.next_batch("q", timeout=0).expert_id == "a"


def _holding(s: Scheduler) -> tuple[threading.Thread, list]:
    """An executor thread inside `next_batch` (no timeout), once it holds its head; what it gets goes in the list."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(s.next_batch("q", timeout=None)), daemon=True)
    t.start()
    for _ in range(500):
        if s.held:
            break
        threading.Event().wait(0.01)
    assert s.held == 1 and not got
    return t, got


def test_a_held_executor_takes_a_filler_submitted_while_it_waits():
    """The executor is inside next_batch, waiting on a head whose load needs 100 s more; a request for a
    resident expert arrives: it is handed out at once (submit notifies), well before the load's estimate."""
    s = _queue("coserve", {"r"}, loading={"a": 100.0}, max_wait=1000.0)
    t, got = _holding(s)
    s.submit(req("r", 9))
    t.join(10)
    assert not t.is_alive() and got[0].expert_id == "r" and s.filled == 1


def test_a_held_executor_takes_the_head_when_its_load_lands():
    """The pool's load event calls `refresh`, which wakes an executor holding for that load, rather than
    leaving it to sleep out the estimate (100 s here)."""
    loading = {"a": 100.0}
    s = _queue("coserve", set(), loading=loading, max_wait=1000.0)
    t, got = _holding(s)
    loading.clear()
    s.costs._resident = lambda n: {"a"}
    s.refresh("a", "q")
    t.join(10)
    assert not t.is_alive() and got[0].expert_id == "a"


def test_an_executor_retired_while_it_holds_hands_out_nothing_of_its_old_queue():
    """`retire` hands the queue back for requeue; a thread still waiting on that queue must not then serve
    the same requests (they would run twice)."""
    s = _queue("coserve", set(), loading={"a": 100.0}, max_wait=1000.0)
    t, got = _holding(s)
    back = s.retire("q")
    t.join(10)
    assert not t.is_alive() and got == [None] and sorted(r.expert_id for r in back) == ["a", "a", "b"]


def test_a_group_being_drained_is_never_held():
    """A group picked with more requests than one batch is served to the end, even if its expert is reported
    as loading again meanwhile (evicted and being read back)."""
    loading: dict = {}
    s = _queue("coserve", {"a", "b"}, loading=loading, max_batch=1, max_wait=100.0)
    first = s.next_batch("q", timeout=0)
    assert first.expert_id == "a"
    s.finished(first)
    loading["a"] = 5.0
    second = s.next_batch("q", timeout=0)
    assert second is not None and second.expert_id == "a" and s.held == 0


def test_fill_finds_a_resident_group_far_behind_the_head():
    """The head's expert loads; 40 groups behind it need loads too; the 42nd group is resident.  Fill looks
    that far back (FILL_WINDOW): with a window of 8, a hot resident group (a shared detector) queued behind
    many switches waited out every load and piled up to the end of a flood (A2: the last 3.4 s of a 44.6 s
    run were detector batches after the SSD's last read)."""
    from executors import scheduler as sched_mod

    names = ["h"] + [f"x{i:02d}" for i in range(40)] + ["r"]
    s = Scheduler(["q"], "coserve", costs=FixedCosts(K=0.01, B=0.05, load=10.0, max_batch=8,
                                                     resident=lambda n: {"r"}, loading=lambda n: {"h": 1.0}))
    for i, e in enumerate(names):
        s.submit(req(e, i))
    assert s.queued_groups("q") == names and sched_mod.FILL_WINDOW > len(names)
    b = s.next_batch("q", timeout=0)
    assert b.expert_id == "r" and s.filled == 1


def test_fill_never_overrides_the_age_bound():
    """b heads the queue and its load is under way; a, behind it, is overdue; c is resident and short.
    The age bound serves a; fill, which only ever replaces the head, does not swap c in for it."""
    clock = [0.0]
    s = Scheduler(["q"], "coserve", costs=FixedCosts(K=1.0, B=1.0, load=10.0, max_batch=8,
                                                     resident=lambda n: {"c"}, loading=lambda n: {"b": 10.0}),
                  now=lambda: clock[0], max_wait=1.0)
    for i, e in enumerate("abc"):
        clock[0] = 0.1 * i
        s.submit(req(e, i))
    q = s._q["q"]
    by = {g.expert_id: g for g in q.groups}
    q.groups = deque([by["b"], by["a"], by["c"]])
    clock[0] = 5.0
    assert s.next_batch("q", timeout=0).expert_id == "a" and s.aged == 1 and s.filled == 0


def test_fill_never_passes_over_an_overdue_head():
    """The head itself has waited past max_wait: it is served now, even with its load under way and a
    resident group behind it."""
    clock = [0.0]
    s = _queue("coserve-nohold", {"b"}, loading={"a": 10.0}, now=lambda: clock[0], max_wait=1.0)
    clock[0] = 50.0
    assert s.next_batch("q", timeout=0).expert_id == "a" and s.filled == 0


def test_a_filler_runs_one_batch_then_the_head_once_its_load_is_in():
    """Fill checks one batch against the head's load, so it serves one batch of the filler, not the group."""
    loading = {"a": 2.5}
    s = _queue("coserve-nohold", {"b"}, loading=loading, max_batch=1, bs=5)
    b = s.next_batch("q", timeout=0)
    assert b.expert_id == "b" and len(b) == 1 and s.filled == 1
    s.finished(b)
    loading["a"] = 0.4                                 # less left than a batch of b takes: no second fill
    assert s.next_batch("q", timeout=0).expert_id == "a" and s.filled == 1


def stage(expert, i, n):
    r = req(expert, i)
    r.stage = n
    return r


@pytest.mark.parametrize("policy", ["coserve", "coserve-nofollowup"])
def test_a_frames_later_step_that_starts_a_group_goes_right_behind_the_head(policy):
    """Queue: a (head), b, c, all first steps.  A frame's second step for d starts a new group: CoServe puts it
    right behind the head, and the next one (e) behind d; a second step for c joins c's group where it is.
    Without the lever every new group goes to the end.  Batches come out in queue order."""
    s = Scheduler(["q"], policy, costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8), max_wait=None)
    for i, e in enumerate("abc"):
        s.submit(req(e, i))
    s.submit(stage("d", 3, 1))
    s.submit(stage("e", 4, 1))
    s.submit(stage("c", 5, 1))
    expected = ["a", "d", "e", "b", "c"] if policy == "coserve" else ["a", "b", "c", "d", "e"]
    assert s.queued_groups("q") == expected
    served = []
    while (b := s.next_batch("q", timeout=0)) is not None:
        served.append((b.expert_id, len(b)))
        s.finished(b)
    assert served == [(e, 2 if e == "c" else 1) for e in expected]


def test_later_steps_keep_their_order_when_the_queue_holds_only_the_head_and_them():
    """A follow-up that lands at the end (only the head ahead of it) is still one: the next goes behind it."""
    s = Scheduler(["q"], "coserve", costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8), max_wait=None)
    s.submit(req("a", 0))
    for i, e in enumerate("def"):
        s.submit(stage(e, 1 + i, 1))
    s.submit(req("x", 9))
    s.submit(stage("g", 10, 1))
    assert s.queued_groups("q") == ["a", "d", "e", "f", "g", "x"]


def test_a_later_step_behind_the_head_is_due_after_the_time_ahead_of_it():
    """The age bound counts from the wait predicted where the group goes: behind the head (1 s of K), not
    behind the whole queue (4 s)."""
    t = [0.0]
    s = Scheduler(["q"], "coserve", costs=FixedCosts(K=1.0, B=0.0, load=0.0, max_batch=8), now=lambda: t[0],
                  max_wait=2.0)
    for i, e in enumerate("abcd"):
        s.submit(req(e, i))
    t[0] = 0.5
    s.submit(stage("z", 9, 1))
    s.submit(req("y", 10))                          # a first step: at the end, due after the whole queue
    q = s._q["q"]
    assert [g.expert_id for g in q.groups] == ["a", "z", "b", "c", "d", "y"]
    assert q.groups[1].times[0] == pytest.approx(0.5 + 1.0)   # now + a's K
    assert q.groups[-1].times[0] == pytest.approx(0.5 + 5.0)  # now + every queued K


def test_a_queue_estimate_gone_negative_is_counted_and_set_to_zero_and_loses_no_request():
    """A negative estimate is a scheduler bug (here a group's cost corrupted, as a bug would): counted, logged and
    set back to 0 where it is met, never raised, since every caller has changed the queue by then.  Raised, a
    request stayed queued that its caller took for refused (a second verdict), and the next hand-out died on
    the counts."""
    s = grouping(["x"], max_batch=2)
    for i in range(3):
        s.submit(req("e", i))
    group = s._q["x"].groups[0]
    group.cost += 100.0                                   # the corruption: the estimate will go negative
    b = s.next_batch("x", timeout=0)
    assert [r.frame.frame_id for r in b.requests] == ["f0", "f1"]
    assert s.estimate_faults == 1 and s.estimate("x") >= 0
    assert s.submit(req("e", 3)) == "x"                   # placed, and said so
    got = []
    while (b := s.next_batch("x", timeout=0)) is not None:
        got += [r.frame.frame_id for r in b.requests]
    assert got == ["f2", "f3"] and s.depth() == 0          # every request handed out exactly once
    assert s.estimate_faults == 1                         # recomputed, not zeroed: draining it met no second fault


class _Sized(FixedCosts):
    """FixedCosts whose executors hold only the experts `holds[name]` allows (`fits`)."""

    def __init__(self, holds, **kw):
        super().__init__(**kw)
        self.holds = holds

    def fits(self, executor, expert_id):
        return expert_id in self.holds[executor]


@pytest.mark.parametrize("policy", ["coserve", "round-robin", "grouped"])
def test_an_expert_goes_only_to_executors_whose_pool_can_hold_it(policy):
    """A small CPU pool beside a GPU: the scheduler handed it a detector it could not load (every frame of that
    batch failed); now it runs only what it can hold, and the rest goes where it fits."""
    from executors.scheduler import NoExecutor

    costs = _Sized({"gpu": {"cls", "det"}, "cpu": {"cls"}}, load=0.1, max_batch=2)
    s = Scheduler(["cpu", "gpu"], policy, costs=costs)
    assert {s.submit(req("det", i)) for i in range(2)} == {"gpu"}
    if s.policy.steal:                  # the GPU busy with two, four more queued behind: a steal would pay ...
        assert s.next_batch("gpu", timeout=0.05) is not None
    assert {s.submit(req("det", i)) for i in range(2, 6)} == {"gpu"}
    if s.policy.steal:                  # ... but an idle CPU never steals a detector group it could not load
        assert s.next_batch("cpu", timeout=0.05) is None
    with pytest.raises(NoExecutor, match="no executor's pool can hold expert big"):
        s.submit(req("big"))
    if policy == "round-robin":         # the cycle skips the executor that cannot hold it, not the others
        assert [s.submit(req("cls", i)) for i in range(4)].count("cpu") >= 1


def test_a_request_only_a_retired_executor_could_hold_waits_for_it_instead_of_failing():
    from executors.scheduler import NoExecutor

    costs = _Sized({"gpu": {"cls", "det"}, "cpu": {"cls"}}, load=0.1)
    s = Scheduler(["cpu", "gpu"], "coserve", costs=costs)
    s.retire("gpu")                                   # a remote GPU node dropped out
    assert s.submit(req("det", 1)) is None and s.waiting() == 1
    with pytest.raises(NoExecutor):
        s.submit(req("big"))                          # no executor, retired or not, can: that fails at once
    assert s.restore("gpu") == [] and s.waiting() == 0 and s.queued_experts("gpu") == ["det"]


def _r(fid: str, expert: str, stage: int = 0) -> Request:
    return Request(Frame(fid, "l", "b", "c", 0.0, None), expert, stage=stage)


def test_a_handed_back_request_still_goes_in_front_of_younger_ones_by_its_age():
    s = Scheduler(["a"], "coserve", costs=FixedCosts(), max_wait=5.0, now=lambda: 10.0)
    s.submit(_r("young", "y"))
    s.submit(_r("old", "y"), due=1.0)         # handed back (requeue): keeps its age
    batch = s.next_batch("a", timeout=0)
    assert [r.frame.frame_id for r in batch.requests] == ["old", "young"]


def test_after_close_an_executor_idles_on_requests_waiting_for_a_retired_one_until_they_are_given_up():
    """Closed, with a request waiting for a retired executor's return: the others must not spin on next_batch
    (it returned None at once, and their loops called it again, forever); they wait, and once the retired one
    cannot come back, `abandon_waiting` gives the requests up and the others drain."""
    class OnlyBHoldsDet(FixedCosts):
        def fits(self, executor: str, expert_id: str) -> bool:
            return expert_id != "det" or executor == "b"
    s = Scheduler(["a", "b"], "coserve", costs=OnlyBHoldsDet())
    s.retire("b")                              # b's node is lost
    assert s.submit(_r("f1", "det")) is None and s.waiting() == 1    # only b can hold it: it waits for b
    s.close()
    assert not s.drained("a")
    got: list = []
    t = threading.Thread(target=lambda: got.append(s.next_batch("a", timeout=None)))
    t.start()
    t.join(0.3)
    assert t.is_alive()                        # waiting on the condition (the old code returned None at once)
    assert s.abandon_waiting() == 1
    t.join(5)
    assert not t.is_alive() and got == [None] and s.drained("a")


def test_a_stopping_agent_gives_up_requests_only_once_every_lost_remote_executor_has_ended():
    """Requests waiting for a lost node's executor: while that executor's thread runs it may still restore itself,
    so they wait; once it has ended (closed, it does not come back) they are given up, even though another remote
    executor is still up (which never drains while they wait)."""
    from types import SimpleNamespace

    from edge_agent.agent import Agent

    class OnlyR2HoldsDet(FixedCosts):
        def fits(self, executor: str, expert_id: str) -> bool:
            return expert_id != "det" or executor == "r2"
    s = Scheduler(["local", "r1", "r2"], "coserve", costs=OnlyR2HoldsDet())
    s.retire("r2")
    assert s.submit(_r("f1", "det")) is None and s.waiting() == 1
    s.close()
    alive = {"r1": True, "r2": True}
    remote = [SimpleNamespace(name=n, can_restore=True, alive=lambda n=n: alive[n]) for n in ("r1", "r2")]
    agent = SimpleNamespace(executors=[SimpleNamespace(name="local", alive=lambda: True), *remote], scheduler=s)
    Agent._give_up_waiting_if_none_returns(agent)
    assert s.waiting() == 1                       # r2's thread still runs: it might restore itself
    alive["r2"] = False
    Agent._give_up_waiting_if_none_returns(agent)
    assert s.waiting() == 0 and s.drained("r1") and s.drained("local")   # r1 still up: not waited for
