"""SSD read-ahead into the exclusive host tier (issue 9): the policy, the disk-activity counter, the thread.

Real files, real pools and the real scheduler; the "GPU" is a 'cpu' TierSource,
so the path runs without CUDA through the same code.
"""
from __future__ import annotations

import threading

import pytest
import torch

from coe import Expert, ExpertLoadError, Frame, Request
from executors.readahead import ReadAhead, next_read_ahead, scheduler_note
from executors.scheduler import FixedCosts, Scheduler
from storage.disk_activity import DiskActivity
from storage.expert_store import ExpertStore
from storage.policies import make_policy
from storage.pool import Pool
from storage.tiers import StoreSource, TierSource

N = 4096
FILL = {e: float(i + 1) for i, e in enumerate("abcdefg")}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ExpertStore:
    s = ExpertStore(tmp_path_factory.mktemp("ahead"))
    for eid, v in FILL.items():
        s.write(Expert(eid, "torchvision/none", "classifier", ("a",), 32), {"w": torch.full((N // 4,), v)})
    return s


def req(expert: str, i: int) -> Request:
    return Request(Frame(f"f{i}", "A", "B", "C", 0.0, None), expert)


# -- the policy ----------------------------------------------------------------------------------------------

def test_the_first_unheld_expert_breadth_first_behind_the_heads():
    queues = [["a", "b", "c"], ["x", "y", "z", "w"]]
    assert next_read_ahead(queues, lambda e: False) == "b"                   # a and x: their executors' next loads
    assert next_read_ahead(queues, lambda e: e == "b") == "y"                # every queue's second, then thirds
    assert next_read_ahead(queues, lambda e: e in {"b", "y"}) == "c"
    assert next_read_ahead(queues, lambda e: e in {"b", "y", "c"}) == "z"
    assert next_read_ahead(queues, lambda e: e != "w") == "w"                # a shorter queue is passed over
    assert next_read_ahead(queues, lambda e: e != "w", skip={"w"}.__contains__) is None
    assert next_read_ahead(queues, lambda e: False, usable=[lambda e: False, lambda e: e != "y"]) == "z"
    assert next_read_ahead([["a"], ["x"]], lambda e: False) is None
    assert next_read_ahead([], lambda e: False) is None and next_read_ahead([[], []], lambda e: False) is None


# -- the disk-activity counter -------------------------------------------------------------------------------

def test_demand_reads_count_and_read_ahead_reads_do_not():
    d = DiskActivity()
    assert not d.busy() and d.wait_idle(0)
    with d.reading():
        assert d.busy() and not d.wait_idle(0.01)
        with d.reading():
            assert d.busy()
        assert d.busy()                       # the outer read is still under way
    assert not d.busy()
    with d.ahead(), d.reading():
        assert not d.busy()                   # a read-ahead's own read is not what it waits for
    seen = []

    def executor_reads() -> None:
        with d.reading():
            seen.append(d.busy())
    with d.ahead():                           # ahead() is per thread: another thread's read still counts
        t = threading.Thread(target=executor_reads)
        t.start()
        t.join()
    assert seen == [True] and (d.demand_reads, d.ahead_reads) == (3, 1)
    with pytest.raises(RuntimeError), d.reading():
        raise RuntimeError("a failed read")
    assert not d.busy()                       # a read that raised is no longer under way


# -- the mechanism, on real pools --------------------------------------------------------------------------

class Box:
    """A 'GPU' pool of two experts behind an exclusive host tier of two, one scheduler queue, one DiskActivity."""

    def __init__(self, store: ExpertStore, host_experts: int = 2) -> None:
        self.disk = DiskActivity()
        self.ssd = StoreSource(store, activity=self.disk)
        self.reads: list[str] = []
        real = self.ssd.load
        self.ssd.load = lambda eid, reuse=None: self.reads.append(eid) or real(eid, reuse)
        self.host = Pool("host", host_experts * N, make_policy("lru"), self.ssd, name="host")
        self.tier = TierSource(self.host, "cpu", exclusive=True)
        self.gpu = Pool("gpu", 2 * N, make_policy("lru"), self.tier, name="gpu")
        self.sched = Scheduler(["gpu"], "coserve", costs=FixedCosts(K=1.0, B=1.0, load=5.0))
        self.usable = {"gpu"}
        self.ahead = ReadAhead(lambda: [("gpu", self.sched.queued_groups("gpu"))], lambda n, e: n in self.usable,
                               lambda: [self.gpu], self.host, self.disk)


class Unwatched(FixedCosts):
    """The agent's case: nothing watches the SSD, so the scheduler counts the reads under way itself."""

    def ssd_inflight(self, channel: str = ""):
        return None

    def load_seconds(self, executor: str, expert_id: str, tier: str) -> float:
        return self.load


def test_a_read_ahead_counts_in_the_schedulers_ssd_backlog_while_it_reads(store):
    """A switch predicted while a read-ahead reads waits behind it, as it will on the SSD; after, nothing."""
    box = Box(store)
    now = [0.0]
    box.sched = Scheduler(["gpu"], "coserve", costs=Unwatched(K=1.0, B=1.0, load=5.0), now=lambda: now[0])
    seen = []
    real = box.ssd.load

    def load(eid, reuse=None):
        seen.append((box.sched.ssd_inflight(), box.sched.added_latency("gpu", "g")[0]))
        return real(eid, reuse)
    box.ssd.load = load
    ahead = ReadAhead(lambda: [("gpu", box.sched.queued_groups("gpu"))], lambda n, e: True, lambda: [box.gpu],
                      box.host, box.disk, note=scheduler_note(box.sched, box.sched.costs, ["gpu"]))
    for i, eid in enumerate("ad"):
        box.sched.submit(req(eid, i))
    before = box.sched.added_latency("gpu", "g")[0]
    assert ahead.step() == "d"
    assert seen == [(5.0, before + 5.0)]           # the 5 s read is under way: a new switch waits behind it
    assert box.sched.ssd_inflight() == 0.0 and box.sched.added_latency("gpu", "g")[0] == before


def test_a_noted_read_runs_down_with_time_and_ends_even_when_it_fails():
    now = [10.0]
    s = Scheduler(["q"], "coserve", costs=Unwatched(load=1.0), now=lambda: now[0])
    with s.reading(4.0):
        now[0] = 11.5
        assert s.ssd_inflight() == pytest.approx(2.5)
        assert s.ssd_inflight("box1") == 0.0       # another box's SSD
        now[0] = 20.0
        assert s.ssd_inflight() == 0.0             # past its length: not negative
    with pytest.raises(OSError), s.reading(3.0):
        raise OSError("read failed")
    assert s.ssd_inflight() == 0.0
    with pytest.raises(ValueError, match="seconds"), s.reading(-1.0):
        pass


def test_a_planned_read_counts_whole_until_it_starts_then_runs_down_and_ends_once():
    """A prefetch decided now and read later (`Scheduler.plan_read`): its seconds are in the SSD backlog at
    once, all of them while it waits, then what is left of them; ended (done or dropped), nothing."""
    now = [10.0]
    s = Scheduler(["q"], "coserve", costs=Unwatched(load=1.0), now=lambda: now[0])
    read = s.plan_read(4.0)
    now[0] = 13.0
    assert s.ssd_inflight() == pytest.approx(4.0)          # not started: every second still to come
    assert s.ssd_inflight("box1") == 0.0
    read.start()
    now[0] = 14.0
    assert s.ssd_inflight() == pytest.approx(3.0)
    read.start()                                            # a second start does not restart it
    assert s.ssd_inflight() == pytest.approx(3.0)
    read.end()
    read.end()
    assert s.ssd_inflight() == 0.0
    dropped = s.plan_read(2.0)
    assert s.ssd_inflight() == pytest.approx(2.0)
    dropped.end()                                           # never started
    assert s.ssd_inflight() == 0.0
    with pytest.raises(ValueError, match="seconds"):
        s.plan_read(float("nan"))


def test_an_idle_ssd_reads_a_queued_expert_into_the_host_tier_and_the_switch_is_a_host_copy(store):
    box = Box(store)
    for eid in ("a", "b"):
        box.gpu.release(box.gpu.acquire(eid))
    box.reads.clear()
    for i, eid in enumerate("aac"):
        box.sched.submit(req(eid, i))
    assert box.ahead.step() == "c"                          # a is on the GPU; c is held nowhere
    assert box.host.resident() == ["c"] and set(box.gpu.resident()) == {"a", "b"}
    assert box.reads == ["c"] and (box.disk.demand_reads, box.disk.ahead_reads) == (2, 1)   # 2: a and b
    assert box.ahead.step() is None and box.ahead.stats.read == 1   # nothing more to read: no second read
    h = box.gpu.acquire("c")                                # the batch's switch: promoted from the host tier
    assert torch.all(h.value.buffer.view(torch.float32) == FILL["c"])
    box.gpu.release(h)
    assert box.reads == ["c"] and box.tier.promoted == 1 and "c" not in box.host.resident()


def test_no_read_ahead_while_a_demand_read_is_under_way(store):
    box = Box(store)
    for i, eid in enumerate("ad"):                          # a heads the queue (its executor's next load)
        box.sched.submit(req(eid, i))
    with box.disk.reading():                                # an executor is reading the SSD
        assert box.ahead.step() is None
        assert box.reads == [] and box.host.resident() == []
    assert box.ahead.step() == "d" and box.reads == ["d"]


def test_read_ahead_never_evicts_a_pool_above_and_skips_an_expert_that_failed(store, tmp_path):
    import shutil

    bad_root = tmp_path / "bad"
    shutil.copytree(store.root, bad_root)
    bad = ExpertStore(bad_root)
    path = bad.path("e")
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8                                 # corrupt the tensor bytes: the sha256 check fails
    path.write_bytes(bytes(data))
    box = Box(bad, host_experts=1)
    for eid in ("a", "b"):
        box.gpu.release(box.gpu.acquire(eid))
    for i, eid in enumerate("aefg"):                        # a (resident) heads the queue
        box.sched.submit(req(eid, i))
    assert box.ahead.step() is None and box.ahead.stats.failed == 1   # e's file is corrupt: no half entry
    assert box.host.resident() == [] and not box.host.present("e")
    assert box.ahead.step() == "f"                          # e is skipped for RETRY_SECONDS
    assert box.ahead.step() is None                         # the host tier (one expert) holds f, queued: no room
    assert box.ahead.stats.no_room == 1 and box.host.resident() == ["f"]
    assert set(box.gpu.resident()) == {"a", "b"}            # nothing above was touched
    with pytest.raises(ExpertLoadError, match="e.*sha256"):  # the executor meets the failure itself, and reports it
        box.gpu.acquire("e")


def test_the_thread_reads_ahead_on_its_own_and_stops(store):
    box = Box(store)
    box.ahead.start()
    try:
        for i, eid in enumerate("ag"):
            box.sched.submit(req(eid, i))
        for _ in range(3000):
            if box.host.contains("g"):
                break
            threading.Event().wait(0.01)
        assert box.host.resident() == ["g"] and box.ahead.stats.read == 1
    finally:
        box.ahead.close()
    assert not box.ahead._thread.is_alive()


def test_a_failed_expert_is_tried_again_after_the_retry_time(store, tmp_path, monkeypatch):
    """A file fixed later (a promotion, a passing I/O error) is read ahead again once RETRY_SECONDS pass."""
    import shutil

    import executors.readahead as ra

    root = tmp_path / "fixed"
    shutil.copytree(store.root, root)
    s = ExpertStore(root)
    good = s.path("e").read_bytes()
    s.path("e").write_bytes(good[:-8] + b"\xff" * 8)
    box = Box(s)
    for i, eid in enumerate("ae"):
        box.sched.submit(req(eid, i))
    assert box.ahead.step() is None and box.ahead.stats.failed == 1
    s.path("e").write_bytes(good)                           # fixed
    assert box.ahead.step() is None                         # still within the retry time
    monkeypatch.setattr(ra, "RETRY_SECONDS", 0.0)
    assert box.ahead.step() == "e" and box.host.contains("e")


def test_only_what_the_queued_executor_takes_from_the_host_tier_is_read_ahead(store):
    """An executor that reads the SSD itself (a CPU pool without host reads, or in another dtype) would not
    use a read-ahead copy: its queued experts are never read ahead, and they stay protected all the same."""
    from executors.costs import ExecutorInfo
    from executors.readahead import usable_from_host

    gpu = usable_from_host(ExecutorInfo("cuda", 1, None))
    cpu_reads = usable_from_host(ExecutorInfo("cpu", 1, None, host_reads=True))
    cpu_ssd = usable_from_host(ExecutorInfo("cpu", 1, None, host_reads=False))
    half = usable_from_host(ExecutorInfo("cpu", 1, None, host_reads=lambda e: e != "x"))
    assert gpu("x") and cpu_reads("x") and not cpu_ssd("x") and not half("x") and half("y")
    box = Box(store)
    box.usable = set()                                      # the queue's executor reads the SSD itself
    for i, eid in enumerate("ba"):
        box.sched.submit(req(eid, i))
    assert box.ahead.step() is None and box.reads == [] and box.ahead.stats.read == 0
    box.usable = {"gpu"}
    assert box.ahead.step() == "a"


def test_the_prefetcher_says_how_long_its_load_still_needs(store, monkeypatch):
    """What the scheduler's fill reads in the agent (`arriving`): the estimate given with the hint, less the
    time the load has run; 0 for another expert, and once the load is in.  On a stand-in clock."""
    import time

    from executors.prefetch import Prefetcher

    clock = [100.0]

    src = StoreSource(store)
    gate = threading.Event()
    real = src.load
    monkeypatch.setattr(src, "load", lambda eid, reuse=None: gate.wait(10) and real(eid, reuse))
    pool = Pool("cpu", 4 * N, make_policy("lru"), src, name="cpu")
    pf = Prefetcher(pool, "cpu", clock=lambda: clock[0])
    try:
        pf.hint("b", expected=5.0)
        for _ in range(3000):
            if pool.present("b"):
                break
            time.sleep(0.01)
        assert pool.present("b"), "the prefetch never reserved b"
        clock[0] += 1.5                                     # the load has run 1.5 s of its estimated 5
        assert pf.remaining("b") == pytest.approx(3.5) and pf.remaining("a") == 0.0
        clock[0] += 10.0                                    # past its estimate and still loading: 0, not negative
        assert pf.remaining("b") == 0.0
        gate.set()
        assert pf.idle(10) and pf.remaining("b") == 0.0 and pool.contains("b")
    finally:
        gate.set()
        pf.close()


def test_the_prefetchers_remaining_time_is_zero_once_the_expert_is_in(store, monkeypatch):
    """The pool's load event (which refreshes the scheduler's switch costs) comes before the prefetcher's
    bookkeeping ends: what it reports then must already be 0, not the estimate's leftover."""
    from executors.prefetch import Prefetcher

    seen = []
    pool = Pool("cpu", 4 * N, make_policy("lru"), StoreSource(store), name="cpu",
                on_event=lambda e: seen.append((e.event, e.expert_id, pf.remaining(e.expert_id)))
                if e.event == "load" else None)
    pf = Prefetcher(pool, "cpu")
    try:
        pf.hint("c", expected=5.0)
        assert pf.idle(10)
    finally:
        pf.close()
    assert seen == [("load", "c", 0.0)]


def test_fill_runs_a_resident_batch_while_a_real_prefetch_is_loading_the_head(store, monkeypatch):
    """The chain the agent runs: the executor's prefetcher loads the head's expert, its remaining time is the
    cost model's `arriving`, and the scheduler fills with a resident group until the load is in."""
    import time

    from executors.prefetch import Prefetcher

    src = StoreSource(store)
    gate = threading.Event()
    real = src.load
    monkeypatch.setattr(src, "load", lambda eid, reuse=None: (gate.wait(10) if eid == "a" else True)
                        and real(eid, reuse))
    pool = Pool("cpu", 4 * N, make_policy("lru"), src, name="cpu")
    pool.release(pool.acquire("b"))
    pf = Prefetcher(pool, "q", clock=lambda: 100.0)         # a stand-in clock: the load has just begun
    costs = FixedCosts(K=0.1, B=0.1, load=5.0, resident=lambda n: set(pool.resident()),
                       loading=lambda n: {e: pf.remaining(e) for e in ("a",) if pf.remaining(e) > 0})
    s = Scheduler(["q"], "coserve", costs=costs)
    try:
        for i, e in enumerate("aab"):
            s.submit(req(e, i))
        pf.hint("a", expected=5.0)                          # what the executor does when a batch starts
        for _ in range(3000):
            if pool.present("a"):
                break
            time.sleep(0.01)
        assert pool.present("a"), "the prefetch never reserved a"
        first = s.next_batch("q", timeout=0)
        assert first.expert_id == "b" and s.filled == 1     # a is loading: b's 0.2 s batch runs meanwhile
        s.finished(first)
        gate.set()
        assert pf.idle(10) and pf.remaining("a") == 0.0
        second = s.next_batch("q", timeout=0)
        assert second.expert_id == "a" and s.filled == 1
    finally:
        gate.set()
        pf.close()


def test_fill_copies_a_host_tier_group_in_while_a_real_prefetch_is_loading_the_head(store, monkeypatch):
    """The same chain with the filler in the host tier, not the pool: a CPU executor's pool copies it from
    the real host tier (`HostReadSource`) while the head's prefetch is still held on its SSD read, and the
    copy's bytes are the expert's.  Copy 0.1 s + batch 0.2 s fit the head's 5 s; the head runs next."""
    import time

    from executors.prefetch import Prefetcher
    from storage.tiers import HostReadSource

    src = StoreSource(store)
    gate = threading.Event()
    real = src.load
    monkeypatch.setattr(src, "load", lambda eid, reuse=None: (gate.wait(10) if eid == "a" else True)
                        and real(eid, reuse))
    host = Pool("host", 4 * N, make_policy("lru"), StoreSource(store), name="host")
    host.release(host.acquire("b"))
    reader = HostReadSource(host, src)
    pool = Pool("cpu", 4 * N, make_policy("lru"), reader, name="cpu")
    pf = Prefetcher(pool, "q", clock=lambda: 100.0)
    costs = FixedCosts(K=0.1, B=0.1, load=5.0, resident=lambda n: set(pool.resident()),
                       loading=lambda n: {e: pf.remaining(e) for e in ("a",) if pf.remaining(e) > 0},
                       host=lambda n: {e for e in host.resident() if reader.compatible(e)}, host_load=0.1)
    s = Scheduler(["q"], "coserve", costs=costs)
    try:
        for i, e in enumerate("aab"):
            s.submit(req(e, i))
        pf.hint("a", expected=5.0)
        for _ in range(3000):       # the prefetch thread has reserved a and reached its SSD read (held on the gate)
            if pool.present("a") and reader.from_ssd == 1:
                break
            time.sleep(0.01)
        assert pool.present("a") and reader.from_ssd == 1, "the prefetch never reached its held SSD read"
        first = s.next_batch("q", timeout=0)
        assert first.expert_id == "b" and s.filled == 1
        handle = pool.acquire("b")                          # what the executor does with the batch
        try:
            assert torch.equal(handle.value.tensors()["w"], torch.full((N // 4,), FILL["b"]))
        finally:
            pool.release(handle)
        # b was copied from the host tier; the one SSD read is a's, still held on the gate
        assert reader.from_host == 1 and reader.from_ssd == 1 and not pool.contains("a")
        s.finished(first)
        gate.set()
        assert pf.idle(10)
        second = s.next_batch("q", timeout=0)
        assert second.expert_id == "a" and s.filled == 1
    finally:
        gate.set()
        pf.close()


def test_a_head_its_executor_cannot_take_from_the_host_tier_still_counts_as_the_head(store):
    """The head is left to its executor whatever it is; the group right behind it is the first candidate."""
    box = Box(store)
    box.ahead._usable = lambda n, e: e != "a"               # e.g. a CPU executor whose dtype differs for a
    for i, eid in enumerate("abc"):
        box.sched.submit(req(eid, i))
    assert box.ahead.step() == "b"
