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
            assert any(x.expert_id for x in held)   # only pins can block
            continue
        for x in held:
            assert x.expert_id in p.resident()      # a pinned expert is never evicted
        if keep and len(held) < 2:
            held.append(h)
        else:
            p.release(h)
    for h in held:
        p.release(h)
