"""The byte-budgeted pool and the LRU/FIFO policies: capacity, pins, exact eviction order."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coe import CoEError
from storage.policies import FIFO, LRU, PoolState, Resident, make_policy
from storage.pool import Pool, PoolFullError


class Source:
    """A real in-memory source: byte strings of the declared size."""

    def __init__(self, sizes):
        self.sizes, self.loads = sizes, []

    def size(self, eid):
        return self.sizes[eid]

    def load(self, eid):
        self.loads.append(eid)
        return bytearray(self.sizes[eid])


def pool(policy="lru", cap=100, sizes=None, events=None):
    sizes = sizes or {k: 30 for k in "abcdef"}
    return Pool("cpu", cap, make_policy(policy), Source(sizes), on_event=(events.append if events is not None else None))


def use(p, eid):
    h = p.acquire(eid)
    p.release(h)
    return h


def test_lru_exact_order():
    events = []
    p = pool(events=events)
    for e in "abc":
        use(p, e)
    use(p, "a")          # a is now most recent; b is least recent
    use(p, "d")          # evicts b
    assert sorted(p.resident()) == ["a", "c", "d"]
    use(p, "e")          # evicts c
    assert sorted(p.resident()) == ["a", "d", "e"]
    assert [(e.expert_id, e.event) for e in events if e.event == "evict"] == [("b", "evict"), ("c", "evict")]
    s = p.stats()
    assert (s.hits, s.misses, s.evictions) == (1, 5, 2)


def test_fifo_ignores_recency():
    p = pool("fifo")
    for e in "abc":
        use(p, e)
    use(p, "a")
    use(p, "d")          # a was loaded first: evicted despite its recent use
    assert sorted(p.resident()) == ["b", "c", "d"]


def test_pinned_expert_never_evicted_and_full_returns_none():
    p = pool(cap=60)
    ha = p.acquire("a")
    hb = p.acquire("b")
    assert p.acquire("c") is None          # both pinned: no room now
    p.release(hb)
    hc = p.acquire("c")                     # b goes, a stays pinned
    assert "a" in p.resident() and "b" not in p.resident()
    with pytest.raises(CoEError):
        p.evict("a")
    p.release(ha)
    p.release(hc)
    assert p.evict("a") and not p.evict("zz")


def test_too_big_for_pool():
    p = pool(cap=10)
    with pytest.raises(PoolFullError, match="needs 30 bytes"):
        p.acquire("a")


def test_release_without_acquire_is_an_error():
    p = pool()
    h = use(p, "a")
    with pytest.raises(CoEError):
        p.release(h)


def test_policy_is_pure_and_returns_none_when_impossible():
    state = PoolState(100, (Resident("a", 50, 1, 5), Resident("b", 40, 2, 3, pinned=True)))
    assert LRU().choose_victims(state, 40) == ["a"]
    assert LRU().choose_victims(state, 10) == []
    assert LRU().choose_victims(state, 80) is None
    assert FIFO().choose_victims(state, 40) == ["a"]
    assert state.residents[0].expert_id == "a" and len(state.residents) == 2  # untouched
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["lru", "fifo"]), cap=st.integers(50, 200),
       trace=st.lists(st.tuples(st.sampled_from("abcdefgh"), st.booleans()), min_size=1, max_size=60))
def test_capacity_never_exceeded_and_pins_respected(policy, cap, trace):
    sizes = {k: 10 + 5 * i for i, k in enumerate("abcdefgh")}
    p = Pool("cpu", cap, make_policy(policy), Source(sizes))
    held = []
    for eid, keep in trace:
        h = p.acquire(eid)
        assert p.used_bytes() <= cap
        if h is None:
            assert held                             # only pins can block
            continue
        for x in held:
            assert x.expert_id in p.resident()      # a pinned expert is never evicted
        if keep and len(held) < 2:
            held.append(h)
        else:
            p.release(h)
    for h in held:
        p.release(h)


class SlowFailing(Source):
    """Loads block until released; the first load of 'bad' fails."""

    def __init__(self, sizes):
        super().__init__(sizes)
        import threading
        self.gate = threading.Event()
        self.calls = 0

    def load(self, eid):
        self.calls += 1
        self.gate.wait(5)
        if eid == "bad":
            raise OSError("disk on fire")
        return super().load(eid)


def test_two_threads_share_one_load_and_a_failed_load_leaves_no_placeholder():
    import threading
    src = SlowFailing({"a": 10, "bad": 10})
    p = Pool("cpu", 100, make_policy("lru"), src)
    got = []
    threads = [threading.Thread(target=lambda: got.append(p.acquire("a"))) for _ in range(2)]
    for t in threads:
        t.start()
    src.gate.set()
    for t in threads:
        t.join(5)
    assert len(got) == 2 and all(h is not None for h in got) and src.calls == 1   # one load, shared
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(_try(p, "bad")))
    waiter.start()
    waiter.join(5)
    assert isinstance(errors[0], OSError) and not waiter.is_alive()
    assert "bad" not in p.resident() and p.used_bytes() == 10                      # no leaked reservation
    src.sizes["bad"] = 10
    with pytest.raises(OSError, match="disk on fire"):
        p.acquire("bad")                                                           # retried, not hung
    assert src.calls == 3                      # the retry read again: the failure was not remembered and re-raised


def _try(pool, eid):
    try:
        return pool.acquire(eid)
    except Exception as exc:  # noqa: BLE001
        return exc


class Box:
    def __init__(self, data):
        self.data = data


def test_victims_are_freed_before_the_new_expert_loads():
    import gc
    import weakref

    refs = {}

    class Tracking(Source):
        def load(self, eid):
            gc.collect()
            alive = [k for k, r in refs.items() if r() is not None and k not in self_resident()]
            seen.append((eid, alive))
            v = Box(super().load(eid))
            refs[eid] = weakref.ref(v)
            return v

    seen = []
    src = Tracking({k: 40 for k in "abc"})
    p = Pool("cpu", 80, make_policy("lru"), src)
    self_resident = p.resident
    for e in "abc":
        use(p, e)
    assert seen[-1] == ("c", [])   # 'a' was evicted for 'c' and nothing kept it alive during the load


# -- admit / discard: an expert handed down from the tier above, or let go to it ----------------------

def test_admit_inserts_without_loading_and_counts_an_admit_not_a_miss():
    events = []
    p = pool(events=events)
    use(p, "a")
    assert p.admit("b") and p.contains("b")
    assert p.source.loads == ["a"]                       # b was not read from the source
    h = p.acquire("b")
    assert h.value is None                               # produce=None: a weightless value (the simulator)
    p.release(h)
    s = p.stats()
    assert (s.hits, s.misses, s.switches, s.admits) == (1, 1, 1, 1)
    assert [(e.expert_id, e.event, e.nbytes) for e in events] == [("a", "load", 30), ("b", "admit", 30)]
    assert not p.admit("b") and p.stats().admits == 1    # already resident: nothing changes


def test_admit_evicts_by_policy_and_hands_the_victims_to_produce():
    p = pool(cap=60)
    use(p, "a")
    b = use(p, "b").value
    use(p, "a")                                          # b is least recent: the LRU victim
    offered = []

    def produce(reuse):
        offered.extend(reuse)
        return reuse.pop()                               # refill the victim's buffer instead of allocating

    assert p.admit("c", produce)
    assert sorted(p.resident()) == ["a", "c"] and p.used_bytes() == 60
    assert len(offered) == 1 and offered[0] is b
    h = p.acquire("c")
    assert h.value is b                                  # c now lives in b's old buffer
    p.release(h)


def test_admit_never_evicts_pinned_and_fails_cleanly_when_it_cannot_fit():
    events = []
    p = pool(cap=60, events=events)
    ha = p.acquire("a")
    use(p, "b")
    assert p.admit("c")                                  # b goes, a is pinned and stays
    assert sorted(p.resident()) == ["a", "c"]
    hc = p.acquire("c")
    before = (sorted(p.resident()), p.used_bytes(), p.stats(), len(events))
    assert not p.admit("d")                              # only pinned experts: no room, nothing changes
    assert (sorted(p.resident()), p.used_bytes(), p.stats(), len(events)) == before
    p.release(ha)
    p.release(hc)


def test_admit_keeps_the_experts_it_is_told_to_keep():
    events = []
    p = pool(cap=60, events=events)
    use(p, "a")
    use(p, "b")                                          # a is the LRU victim ...
    assert p.admit("c", keep=("a",))                     # ... but kept: b goes instead
    assert sorted(p.resident()) == ["a", "c"]
    assert [(e.expert_id, e.incoming) for e in events if e.event == "evict"] == [("b", "c")]
    assert not p.admit("d", keep=("a", "c"))             # everything kept: no room, nothing changes
    assert sorted(p.resident()) == ["a", "c"]


def ranked_pool(policy="probability", queued=(), events=None):
    """A full 60-byte tier holding a (p 0.5) and b (p 0.3), ranked by usage probability."""
    probs = {"a": 0.5, "b": 0.3, "c": 0.1, "d": 0.4, "e": 0.4}
    p = Pool("host", 60, make_policy(policy), Source({k: 30 for k in probs}), probabilities=probs,
             context=lambda: {"queued": set(queued)}, on_event=(events.append if events is not None else None))
    assert p.admit("a") and p.admit("b")
    return p


def test_worth_keeping_declines_a_victim_ranked_below_what_it_would_push_out():
    events = []
    p = ranked_pool(events=events)
    before = len(events)
    assert not p.admit("c", worth_keeping=True)           # 0.1 < 0.3: it would push out a more probable expert
    assert sorted(p.resident()) == ["a", "b"] and len(events) == before
    assert (p.stats().declined, p.stats().admits, p.stats().evictions) == (1, 2, 0)
    assert p.admit("d", worth_keeping=True)               # 0.4 > 0.3: in, and b (the lowest) goes
    assert sorted(p.resident()) == ["a", "d"] and p.stats().declined == 1
    assert not p.admit("e", worth_keeping=True)           # 0.4 = 0.4: the one already held stays
    assert sorted(p.resident()) == ["a", "d"] and p.stats().declined == 2
    assert p.admit("e")                                   # without the test: every victim enters (d goes, LRU tie)
    assert sorted(p.resident()) == ["a", "e"]


def test_worth_keeping_admits_into_free_room_and_a_queued_expert_over_a_more_probable_one():
    p = Pool("host", 90, make_policy("coserve"), Source({k: 30 for k in "abc"}),
             probabilities={"a": 0.5, "b": 0.3, "c": 0.1}, context=lambda: {"queued": {"c"}})
    assert p.admit("a", worth_keeping=True) and p.admit("b", worth_keeping=True)   # room: no test needed
    p2 = ranked_pool("coserve", queued=("c",))
    assert p2.admit("c", worth_keeping=True)              # a queued request is a certain use: it outranks b
    assert sorted(p2.resident()) == ["a", "c"] and p2.stats().declined == 0
    p3 = ranked_pool("coserve")
    assert not p3.admit("c", worth_keeping=True)          # the same expert with nothing queued is declined


def test_worth_keeping_weighs_the_newcomer_only_against_what_it_could_push_out():
    p = ranked_pool()
    assert not p.admit("d", keep=("b",), worth_keeping=True)   # only a (0.5) could make room: d (0.4) is worth less
    assert sorted(p.resident()) == ["a", "b"] and p.stats().declined == 1
    held = p.acquire("a")                                       # a pinned by a running batch: same as kept
    assert p.admit("d", worth_keeping=True)                     # b (0.3) can go: d outranks it
    assert sorted(p.resident()) == ["a", "d"]
    p.release(held)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_worth_keeping_does_not_apply_under_a_recency_only_policy(policy):
    """A newcomer shown as least recently used could never win under LRU or FIFO, so the test would freeze a
    full tier: the pool skips it there and admits as the plain admit does (a, the oldest, goes)."""
    p = ranked_pool(policy)
    assert p.admit("c", worth_keeping=True)               # c (p 0.1) would be declined under a ranking policy
    assert sorted(p.resident()) == ["b", "c"] and p.stats().declined == 0


def test_admit_of_an_expert_larger_than_the_pool_is_refused():
    p = pool(cap=20)
    assert not p.admit("a") and p.resident() == [] and p.stats().admits == 0


def test_a_failed_produce_leaves_no_half_entry():
    p = pool(cap=60)
    use(p, "a")
    use(p, "b")

    def boom(reuse):
        raise MemoryError("no pinned memory")

    with pytest.raises(MemoryError):
        p.admit("c", boom)
    assert "c" not in p.resident() and not p.present("c")
    assert p.used_bytes() == sum(p.source.sizes[e] for e in p.resident())   # no leaked reservation
    assert p.stats().admits == 0
    assert p.admit("c", lambda reuse: bytearray(30)) and p.contains("c")     # and it can be admitted later


def test_discard_evicts_only_an_unpinned_resident_and_never_raises():
    events = []
    p = pool(events=events)
    use(p, "a")
    h = p.acquire("b")
    assert not p.discard("b")                            # pinned: stays (another tier still copies from it)
    assert not p.discard("zz")                           # absent
    assert p.discard("a") and p.resident() == ["b"]
    assert events[-1].event == "evict" and events[-1].expert_id == "a"
    p.release(h)
    assert p.discard("b") and p.resident() == []


def test_a_stale_copy_marked_while_held_goes_with_the_release_that_frees_it():
    events = []
    p = pool(events=events)
    a1, a2 = p.acquire("a"), p.hold("a")
    assert not p.discard("a", when_free=True) and p.contains("a")      # two holders: both finish on it
    p.release(a1)
    assert p.contains("a")                                              # one still holds it
    p.release(a2)
    assert not p.present("a") and events[-1].event == "evict" and events[-1].expert_id == "a"
    assert events[-1].stale                                             # not to be demoted into a tier below
    c = p.acquire("c")
    assert not p.discard("c", when_free=True) and p.hold("c") is None   # a marked copy is not handed up a tier
    p.release(c)
    assert not p.present("c")
    b = p.acquire("b")
    assert not p.discard("b") and (p.release(b) or p.contains("b"))    # unmarked: a release keeps it


def test_hold_pins_only_a_resident_expert_and_never_loads():
    p = pool()
    assert p.hold("a") is None and p.source.loads == [] and p.stats().misses == 0
    use(p, "a")
    h = p.hold("a")
    assert h is not None and p.stats().hits == 1
    assert not p.discard("a")                            # held
    p.release(h)
    assert p.discard("a")


def test_acquire_async_never_leaves_a_reservation_behind():
    """A load that is never run (the submit fails, or its future is cancelled) clears its reservation."""
    from concurrent.futures import Future

    from conftest import SizedSource
    from storage.policies import make_policy
    from storage.pool import Pool

    pool = Pool("cpu", 10, make_policy("lru"), SizedSource({"a": 4, "b": 4}))

    def broken(fn):
        raise RuntimeError("loader shut down")
    with pytest.raises(RuntimeError, match="shut down"):
        pool.acquire_async("a", broken)
    assert not pool.present("a") and pool.used_bytes() == 0
    h = pool.acquire("a")                      # would wait forever on a stale 'loading' entry
    assert h is not None and pool.contains("a")
    pool.release(h)

    held = []
    fut = pool.acquire_async("b", lambda fn: held.append(fn) or Future())
    assert pool.present("b") and fut.cancel()
    assert not pool.present("b") and pool.used_bytes() == 4


def test_a_reservation_that_never_loads_still_reports_the_victims_it_evicted():
    """An exclusive host tier takes the device pool's victims from their evict events: a cancelled
    reservation (a prefetch that gave way before its read began) evicted them too, so they are reported,
    once; a reservation whose load runs reports its victims from the load, once."""
    from concurrent.futures import Future

    events = []
    p = pool(cap=60, events=events)
    use(p, "a")
    use(p, "b")                                             # full: a and b
    fut = p.acquire_async("c", lambda fn: Future())         # never started: room made by evicting a
    assert not p.contains("a") and [e.expert_id for e in events if e.event == "evict"] == []
    assert fut.cancel()
    assert [(e.expert_id, e.event, e.incoming) for e in events if e.event == "evict"] == [("a", "evict", "c")]
    assert not p.present("c") and p.used_bytes() == 30
    use(p, "e")                                             # full again: b and e
    events.clear()
    ran = p.acquire_async("d", lambda fn: _done(fn))        # the load runs: b evicted, reported by it
    p.release(ran.result())
    assert [(e.expert_id, e.event) for e in events] == [("b", "evict"), ("d", "load")]


def _done(fn):
    from concurrent.futures import Future

    f = Future()
    f.set_result(fn())
    return f


# -- how the executors' pools start (pool_fill) --------------------------------------------------------

def _sized_pools(sizes: dict[str, int]) -> list[Pool]:
    from storage.tracesim import SizeSource

    src = SizeSource({e: 10 for e in "abcdefghij"})
    return [Pool(name, cap, make_policy("lru"), src, name=name) for name, cap in sizes.items()]


def test_round_robin_deals_the_hottest_experts_across_every_pool():
    from storage.pool import fill_pools

    gpu, cpu0, cpu1 = _sized_pools({"gpu": 40, "cpu0": 20, "cpu1": 20})
    got = fill_pools([gpu, cpu0, cpu1], list("abcdefghij"), "round-robin", {"gpu"})
    assert got == {"gpu": ["a", "d", "g", "h"], "cpu0": ["b", "e"], "cpu1": ["c", "f"]}


def test_gpu_first_fills_the_gpu_pools_then_the_cpu_pools_with_the_next_experts():
    from storage.pool import fill_pools

    gpu0, gpu1, cpu0, cpu1 = _sized_pools({"gpu0": 30, "gpu1": 20, "cpu0": 20, "cpu1": 10})
    got = fill_pools([cpu0, gpu0, cpu1, gpu1], list("abcdefghij"), "gpu-first", {"gpu0", "gpu1"})
    # the GPU pools round-robin among themselves, then the CPU pools with what no GPU pool holds
    assert got == {"gpu0": ["a", "c", "e"], "gpu1": ["b", "d"], "cpu0": ["f", "h"], "cpu1": ["g"]}
    held = [e for p in (gpu0, gpu1, cpu0, cpu1) for e in p.resident()]
    assert sorted(held) == list("abcdefgh")                          # each expert in one pool only


def test_gpu_first_without_a_gpu_is_round_robin_and_an_unknown_fill_is_named():
    from storage.pool import fill_pools

    a = _sized_pools({"cpu0": 20, "cpu1": 20})
    b = _sized_pools({"cpu0": 20, "cpu1": 20})
    order = list("abcdefghij")
    assert fill_pools(a, order, "gpu-first", set()) == fill_pools(b, order, "round-robin", set())
    with pytest.raises(ValueError, match="unknown fill 'fastest' \\(known: gpu-first, round-robin\\)"):
        fill_pools(_sized_pools({"cpu": 10}), order, "fastest", set())


class HeldSource(Source):
    """A source whose first load waits at `gate` (a prefetch's read under way), and optionally fails."""

    def __init__(self, sizes, *, fail_first=False):
        super().__init__(sizes)
        import threading
        self.gate, self.started, self.fail_first, self.calls = threading.Event(), threading.Event(), fail_first, []

    def load(self, eid):
        self.calls.append(eid)
        if len(self.calls) == 1:
            self.started.set()
            self.gate.wait(5)
            if self.fail_first:
                raise OSError("disk said no")
        return super().load(eid)


def test_acquire_async_join_pins_a_loading_expert_and_shares_its_load():
    """join: an expert another thread is loading is pinned at once and handed over when that load lands."""
    from concurrent.futures import ThreadPoolExecutor

    src = HeldSource({k: 30 for k in "abcd"})
    gate, started = src.gate, src.started
    p = Pool("cpu", 60, make_policy("lru"), src)
    with ThreadPoolExecutor(2) as ex:
        first = p.acquire_async("a", ex.submit)             # the prefetch's load, under way
        assert started.wait(5)
        joined = p.acquire_async("a", ex.submit, join=ex.submit)
        assert joined is not None and not joined.done()     # did not block the caller, did not load again
        with p._cond:
            assert p._entries["a"].pins == 2                # pinned at the join, not when the load lands
        gate.set()
        p.release(first.result(5))
        h = joined.result(5)
        with pytest.raises(CoEError):
            p.evict("a")                                    # still the joiner's
    assert h.expert_id == "a" and src.loads == ["a"]
    s = p.stats()
    assert (s.misses, s.hits) == (1, 1)
    hb = p.acquire("b")
    assert p.acquire("c") is None                           # 'a' stays pinned by the joiner: no room for c
    p.release(h)
    assert p.acquire("c") is not None and not p.present("a")    # given back, it may go
    p.release(hb)


def test_acquire_async_join_of_a_load_that_fails_loads_the_expert_itself():
    from concurrent.futures import ThreadPoolExecutor

    src = HeldSource({k: 30 for k in "ab"}, fail_first=True)
    gate, started, calls = src.gate, src.started, src.calls
    p = Pool("cpu", 60, make_policy("lru"), src)
    with ThreadPoolExecutor(2) as ex:
        first = p.acquire_async("a", ex.submit)
        assert started.wait(5)
        joined = p.acquire_async("a", ex.submit, join=ex.submit)
        gate.set()
        with pytest.raises(OSError, match="disk said no"):
            first.result(5)                                 # the failed load's error goes to its own caller
        h = joined.result(5)                                # the joiner read it itself
    assert h.expert_id == "a" and calls == ["a", "a"] and p.stats().misses == 1
    p.release(h)


def test_a_joiner_that_cancels_gives_its_pin_back_and_two_joiners_each_get_one():
    from concurrent.futures import ThreadPoolExecutor

    src = HeldSource({k: 30 for k in "ab"})
    gate, started = src.gate, src.started
    p = Pool("cpu", 60, make_policy("lru"), src)
    with ThreadPoolExecutor(2) as ex:
        first = p.acquire_async("a", ex.submit)
        assert started.wait(5)
        quitter = p.acquire_async("a", ex.submit, join=ex.submit)
        one, two = (p.acquire_async("a", ex.submit, join=ex.submit) for _ in range(2))
        assert quitter.cancel()
        gate.set()
        p.release(first.result(5))
        h1, h2 = one.result(5), two.result(5)
    assert src.loads == ["a"] and p.stats().hits == 2       # the one who left is not a hit
    with p._cond:
        assert p._entries["a"].pins == 2                    # the quitter's pin went back, each joiner holds one
    p.release(h1)
    p.release(h2)
    assert p.evict("a")                                     # nothing holds it now


def test_wait_for_room_retries_until_room_and_names_the_expert_past_its_deadline():
    import time

    from storage.pool import wait_for_room

    tries = iter([None, None, "in"])
    assert wait_for_room(lambda: next(tries), time.monotonic() + 60, lambda: "never") == "in"
    p = pool(cap=30)
    held = p.acquire("a")                                   # pinned: no room for b
    with pytest.raises(CoEError, match="expert 'b': pinned experts hold the room"):
        wait_for_room(lambda: p.acquire("b"), time.monotonic() + 0.05,
                      lambda: "expert 'b': pinned experts hold the room")
    p.release(held)
    assert wait_for_room(lambda: p.acquire("b"), time.monotonic() + 60, lambda: "never").expert_id == "b"


def test_a_held_back_reservation_can_report_its_victims_at_once_and_its_load_reports_none_again():
    """`report_victims` after `acquire_async` (a prefetch planned now and read later): the victims go now, so
    a victim cache below takes them at once; the load, when it runs, reports only its own load.  Once the
    load has run (or the reservation is gone), there is nothing left to report."""
    from concurrent.futures import Future
    events = []
    p = pool(events=events, cap=60)
    use(p, "a")
    use(p, "b")
    held = []

    def later(load):
        held.append(load)
        return Future()
    p.acquire_async("c", later)
    assert [e.event for e in events if e.event == "evict"] == []       # by default, reported when it loads
    p.report_victims("c")
    assert [(e.expert_id, e.event) for e in events if e.event == "evict"] == [("a", "evict")]
    assert "c" not in p.resident() and p.present("c") and p.source.loads == ["a", "b"]
    n = len(events)
    p.report_victims("c")                                                # once only
    assert len(events) == n
    p.release(held[0]())
    assert [(e.expert_id, e.event) for e in events[n:]] == [("c", "load")]
    p.report_victims("c")                                                # loaded: nothing left
    p.report_victims("zz")                                               # never reserved: nothing
    assert len(events) == n + 1
    # without it the victims are reported when the load runs
    p.acquire_async("d", later)
    assert [e.event for e in events[n + 1:]] == []
    p.release(held[1]())
    assert [(e.expert_id, e.event) for e in events[n + 1:]] == [("b", "evict"), ("d", "load")]


def test_victims_reported_early_still_give_their_memory_to_the_load():
    """`report_victims` tells the listeners now, but the load still refills the victim's memory (the pool
    hands it the values); losing that made every prefetched load allocate afresh, and a real CPU run's
    Samba-CoE a quarter slower."""
    from concurrent.futures import Future

    class Reusing(Source):
        reuses_memory = True

        def __init__(self, sizes):
            super().__init__(sizes)
            self.offered = []

        def load(self, eid, reuse=None):
            self.offered.append([id(v) for v in reuse or []])
            return reuse.pop() if reuse else super().load(eid)

    events = []
    src = Reusing({k: 30 for k in "abc"})
    p = Pool("cpu", 60, make_policy("lru"), src, on_event=events.append)
    use(p, "a")
    use(p, "b")
    a = p.peek("a")
    held = []
    p.acquire_async("c", lambda load: held.append(load) or Future())
    p.report_victims("c")
    assert [e.expert_id for e in events if e.event == "evict"] == ["a"]
    p.release(held[0]())
    assert src.offered[-1] == [id(a)] and p.peek("c") is a      # the victim's buffer, refilled
    # a reservation dropped after its early report: its victims were reported once, and the entry is gone
    fut = p.acquire_async("a", lambda load: held.append(load) or Future())
    p.report_victims("a")
    evicted = [e.expert_id for e in events if e.event == "evict"]
    fut.cancel()
    assert [e.expert_id for e in events if e.event == "evict"] == evicted == ["a", "b"]
    assert not p.present("a") and p.resident() == ["c"]


def test_a_stale_report_takes_nothing_from_a_newer_reservation_and_a_failed_load_lets_its_victims_go():
    """`report_victims(eid, reservation)` reports only for that reservation: a dropped plan's report must not
    take the victims of a newer reservation of the same expert.  A load that fails after an early report
    lets the victims' memory go though its error is kept (a future keeps it; checked with the collector
    off)."""
    import gc
    import weakref
    from concurrent.futures import Future

    class Buf(bytearray):
        pass

    class Failing(Source):
        reuses_memory = True

        def load(self, eid, reuse=None):
            if eid == "c":
                raise OSError("disk error reading c")
            self.loads.append(eid)
            return Buf(self.sizes[eid])

    events = []
    src = Failing({k: 30 for k in "abc"})
    p = Pool("cpu", 60, make_policy("lru"), src, on_event=events.append)
    use(p, "a")
    use(p, "b")
    held = []
    old = p.acquire_async("c", lambda load: held.append(load) or Future())
    old.cancel()                                        # the plan is dropped: its victim 'a' is reported there
    assert [e.expert_id for e in events if e.event == "evict"] == ["a"]
    use(p, "a")                                         # back in; 'b' is now the least recent
    victim = weakref.ref(p.peek("b"))
    new = p.acquire_async("c", lambda load: held.append(load) or Future())
    p.report_victims("c", old)                          # the stale report: nothing
    assert [e.expert_id for e in events if e.event == "evict"] == ["a"]
    p.report_victims("c", new)                          # the standing one: its victim 'b' goes now
    assert [e.expert_id for e in events if e.event == "evict"] == ["a", "b"]
    events.clear()
    gc.disable()
    try:
        kept = None
        try:
            held[1]()
        except OSError as exc:
            kept = exc                                  # kept, as a future keeps a failed load's error
        assert "disk error" in str(kept) and kept.__traceback__ is not None
        assert victim() is None and not p.present("c")  # its traceback does not keep the victim's memory
    finally:
        gc.enable()


def test_a_listener_that_raises_leaks_no_pin_and_every_victim_is_still_told(caplog):
    """A listener (the agent's: scheduler refresh, metrics, status) that raises on a load or an eviction: the
    load's caller still gets its handle, the entry can be released and evicted, and the victims after the one
    that raised are still reported."""
    told = []

    def listener(ev):
        told.append((ev.event, ev.expert_id))
        if ev.event == "load" and ev.expert_id == "a" or ev.event == "evict" and ev.expert_id == "b":
            raise RuntimeError("listener bug")
    p = Pool("cpu", 90, make_policy("lru"), Source({k: 30 for k in "abcde"}), on_event=listener)
    h = p.acquire("a")                                   # its load event raised
    assert h is not None and h.expert_id == "a"
    p.release(h)
    for eid in "bc":
        use(p, eid)
    use(p, "d")                                          # evicts a (LRU)
    use(p, "e")                                          # evicts b, whose listener raises
    assert ("evict", "a") in told and ("evict", "b") in told and ("load", "e") in told
    assert p.evict("c") is True and not p.contains("c")  # no pin was left behind anywhere
    assert set(p.resident()) == {"d", "e"}
    assert sum("a listener failed" in r.getMessage() for r in caplog.records) == 2


class _Value(bytearray):
    eid = ""


class Tagged(Source):
    """A source whose values know their expert, so `measure` can book for each what a test says it holds."""

    def load(self, eid):
        value = _Value(super().load(eid))
        value.eid = eid
        return value


def test_a_load_booked_above_its_reservation_makes_room_so_the_pool_stays_within_capacity():
    """The pool reserves the source's size, then books what `measure` says the loaded value really holds (a
    CUDA allocator's rounded block): when that is more, the policy's victims go, so used <= capacity."""
    booked = {"a": 40, "b": 30, "c": 45}                  # c's source says 30 (it fits), its value holds 45
    events = []

    p = Pool("cpu", 100, make_policy("lru"), Tagged({"a": 40, "b": 30, "c": 30}), on_event=events.append,
             measure=lambda v: booked[v.eid])
    use(p, "a")
    use(p, "b")
    use(p, "c")                                           # 40 + 30 + 45 > 100 once booked: a (LRU) goes
    assert p.used_bytes() <= p.capacity and set(p.resident()) == {"b", "c"}
    assert [e.expert_id for e in events if e.event == "evict"] == ["a"]


def shared_pool(events=None):
    """A 120-byte pool ranked by probability; x, y, z (an LLM's experts, p 0.5 each) outrank a, b, c."""
    probs = {"x": 0.5, "y": 0.5, "z": 0.5, "a": 0.2, "b": 0.1, "c": 0.05}
    p = Pool("cpu", 120, make_policy("probability"), Source({k: 30 for k in probs}), probabilities=probs,
             on_event=(events.append if events is not None else None))
    p.limit_share("llm.max_share", {"x", "y", "z"}, 60)
    return p


def test_a_capped_group_over_its_share_makes_room_among_its_own_experts():
    p = shared_pool()
    for e in "abc":
        use(p, e)
    use(p, "x")                      # room in the pool and the share: nothing goes
    assert sorted(p.resident()) == ["a", "b", "c", "x"] and p.share_bytes() == 30
    use(p, "y")                      # the pool is full: c (0.05) goes, as without a share; the share is now full
    assert sorted(p.resident()) == ["a", "b", "x", "y"] and p.share_bytes() == 60
    use(p, "z")                      # over the share: x or y goes, though b (0.1) ranks far below them
    assert sorted(p.resident()) == ["a", "b", "y", "z"] and p.share_bytes() == 60
    # without the share, the same uses push the line's experts out instead
    q = Pool("cpu", 120, make_policy("probability"), Source({k: 30 for k in "xyzabc"}),
             probabilities={"x": 0.5, "y": 0.5, "z": 0.5, "a": 0.2, "b": 0.1, "c": 0.05})
    for e in "abcxyz":
        use(q, e)
    assert sorted(q.resident()) == ["a", "x", "y", "z"]


def test_an_expert_outside_the_group_may_still_evict_the_groups_experts():
    p = shared_pool()
    for e in "xyab":
        use(p, e)
    p.release(p.acquire("c"))        # full: the lowest-ranked of everything goes (b, 0.1), the share is no floor
    assert sorted(p.resident()) == ["a", "c", "x", "y"]
    q = Pool("cpu", 60, make_policy("lru"), Source({k: 30 for k in "xya"}))
    q.limit_share("llm.max_share", {"x", "y"}, 60)
    use(q, "x"), use(q, "y"), use(q, "a")
    assert sorted(q.resident()) == ["a", "y"]          # LRU: x, the group's, was the least recent


def test_a_group_whose_share_is_pinned_waits_and_one_bigger_than_its_share_is_refused():
    p = shared_pool()
    hx, hy = p.acquire("x"), p.acquire("y")
    assert p.acquire("z") is None    # the pool has room, the share's experts are pinned: wait, evict nothing
    assert sorted(p.resident()) == ["x", "y"] and p.stats().evictions == 0
    assert not p.admit("z")          # a hand-down follows the same rule
    p.release(hx)
    p.release(p.acquire("z"))
    assert sorted(p.resident()) == ["y", "z"]
    p.release(hy)
    big = Pool("cpu", 120, make_policy("lru"), Source({"x": 90, "a": 30}))
    big.limit_share("llm.max_share", {"x"}, 60)
    with pytest.raises(PoolFullError, match="x.*90 bytes.*llm.max_share caps its group at 60 bytes"):
        big.acquire("x")
    assert not big.admit("x") and big.resident() == []


def test_start_fill_keeps_a_capped_group_within_its_share():
    from storage.pool import initialize

    p = shared_pool()
    got = initialize([p], ["x", "y", "z", "a", "b", "c"])
    assert got == {"cpu": ["x", "y", "a", "b"]} and p.share_bytes() == 60 and p.stats().evictions == 0


def test_a_waiter_is_woken_by_the_release_that_frees_its_room(monkeypatch):
    import threading
    import time

    import storage.pool as pool_mod
    from storage.pool import wait_for_room

    monkeypatch.setattr(pool_mod, "WAIT_CHECK_S", 3600.0)   # no re-check to fall back on: only the wake-up counts

    p = pool(cap=30)
    held = p.acquire("a")
    since = p.generation
    assert p.acquire("b") is None and p.generation == since       # a failed attempt changes nothing
    assert p.wait_changed(since, 0.01) is False                    # nothing changed: the wait times out
    got = []
    waiter = threading.Thread(target=lambda: got.append(
        wait_for_room(lambda: p.acquire("b"), time.monotonic() + 60, lambda: "never", p)))
    waiter.start()
    p.release(held)                  # the release wakes it (a missed wake-up would wait an hour: join fails)
    waiter.join(60)
    assert not waiter.is_alive() and got[0].expert_id == "b" and p.resident() == ["b"]
    assert p.generation > since
    p.release(got[0])


def test_a_group_expert_booked_above_its_reservation_trims_its_own_group_back_under_the_share():
    """A CUDA allocator's rounded block booked for an LLM expert: the group goes back under its share, from its
    own experts, though the pool as a whole has room."""
    booked = {"x": 30, "y": 40, "a": 30}

    p = Pool("cpu", 200, make_policy("lru"), Tagged({"x": 30, "y": 30, "a": 30}), measure=lambda v: booked[v.eid])
    p.limit_share("llm.max_share", {"x", "y"}, 60)
    use(p, "a")
    use(p, "x")
    use(p, "y")                                           # 30 + 40 > 60 once booked: x (the group's LRU) goes
    assert set(p.resident()) == {"a", "y"} and p.share_bytes() <= 60


def test_a_group_that_cannot_get_under_its_share_still_leaves_the_pool_within_capacity():
    booked = {"x": 30, "y": 40, "a": 20}

    p = Pool("cpu", 90, make_policy("lru"), Tagged({"x": 30, "y": 30, "a": 20}), measure=lambda v: booked[v.eid])
    p.limit_share("llm.max_share", {"x", "y"}, 60)
    use(p, "a")
    hx = p.acquire("x")                                   # pinned: the group cannot shed it
    use(p, "y")                                           # 20 + 30 + 40 = 90... booked: within the pool, over share
    assert p.used_bytes() <= p.capacity
    booked["y"] = 45
    p.evict("y")
    use(p, "y")                                           # 20 + 30 + 45 = 95 > 90: a goes, the pool comes first
    assert p.used_bytes() <= p.capacity and "a" not in p.resident()
    p.release(hx)


def test_a_load_booked_above_its_reservation_asks_the_policy_context_outside_the_pool_lock():
    """The context is the scheduler's queued set (its lock), and the scheduler asks pools (`present`,
    `used_bytes`) under that lock: a trim that asked it under the pool's lock deadlocked both (ABBA)."""
    import threading

    from storage.policies import CoServe

    class Val:
        def __init__(self, n):
            self.nbytes, self.measured = n, n + 100     # a CUDA allocator books more than was reserved

    class Src:
        def size(self, e):
            return 1000

        def load(self, e):
            if e == "b":
                loaded.set()
            return Val(1000)

    scheduler_lock = threading.Lock()
    entered, held, loaded, got = threading.Event(), threading.Event(), threading.Event(), []

    def context():
        if loaded.is_set():     # the trim's call, after b's load
            entered.set()
            got.append(scheduler_lock.acquire(timeout=5))   # False: it waited on the pool's lock's holder
            if got[-1]:
                scheduler_lock.release()
        return {"queued": set()}

    pool = Pool("cuda", 2150, CoServe(), Src(), context=context, measure=lambda v: v.measured)
    pool.release(pool.acquire("a"))

    def scheduler():          # holds its lock and asks the pool, as Scheduler.submit -> costs.tier_of does
        with scheduler_lock:
            held.set()
            entered.wait(10)
            pool.present("a")

    t = threading.Thread(target=scheduler)
    t.start()
    held.wait(10)
    pool.release(pool.acquire("b"))       # 1100 + 1100 > 2150: trimmed
    t.join(10)
    assert got == [True] and not t.is_alive()
    assert pool.used_bytes() <= 2150 and pool.resident() == ["b"]


def test_a_copy_marked_stale_is_not_handed_to_a_new_holder_who_waits_for_the_new_version():
    """A held copy marked stale by a promotion (`discard(when_free=True)`) was still a hit for `acquire`: a tier
    above kept copying the old weights for as long as holders overlapped."""
    import threading

    from conftest import SizedSource

    class Versioned(SizedSource):
        version = 1

        def load(self, expert_id):
            return f"{expert_id} v{self.version}"

    src = Versioned({"a": 10})
    pool = Pool("host", 100, make_policy("lru"), src)
    h1 = pool.acquire("a")
    assert h1.value == "a v1"
    src.version = 2                                   # the store now has version 2
    assert not pool.discard("a", when_free=True)      # held: marked, dropped at its last release
    assert pool.hold("a") is None
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire("a")))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got                   # it waits for the stale copy's release ...
    pool.release(h1)
    t.join(10)
    assert got and got[0].value == "a v2"             # ... and gets the new version, not the old one
    pool.release(got[0])
