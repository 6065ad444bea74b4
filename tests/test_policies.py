"""Every eviction policy under one contract, then exact orders, then a CoE trace."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coe import load_spec
from coe.probabilities import ranked
from storage.policies import POLICIES, CoServe, PoolState, Resident, make_policy, stage_one
from storage.pool import Pool
from storage.tracesim import simulate

from conftest import SizedSource

REPO = Path(__file__).resolve().parent.parent
EXPERTS = "abcdefgh"


residents = st.lists(st.tuples(st.sampled_from(EXPERTS), st.integers(1, 50), st.booleans()),
                     unique_by=lambda t: t[0], max_size=8)


def make_state(rs, need_room, queued, probs, incoming=None):
    res = tuple(Resident(e, n, i, (i * 7) % 11, pin) for i, (e, n, pin) in enumerate(rs))
    cap = sum(r.nbytes for r in res) + need_room
    prelims = {"g": ("a", "b"), "h": ("c",), "f": ("a",)}
    if incoming in {r.expert_id for r in res}:
        incoming = None             # the pool only makes room for an expert it does not hold
    return PoolState(cap, res, probs, prelims, frozenset(queued), tuple(reversed(EXPERTS)), incoming)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=200, deadline=None)
@given(rs=residents, room=st.integers(0, 30), need=st.integers(1, 120),
       queued=st.sets(st.sampled_from(EXPERTS)), probs=st.dictionaries(st.sampled_from(EXPERTS), st.floats(0, 1)),
       incoming=st.none() | st.sampled_from(EXPERTS))
def test_contract_on_random_states(name, rs, room, need, queued, probs, incoming):
    state = make_state(rs, room, queued, probs, incoming)
    before = repr(state)
    victims = make_policy(name).choose_victims(state, need)
    assert repr(state) == before and victims == make_policy(name).choose_victims(state, need)   # pure
    unpinned = sum(r.nbytes for r in state.residents if not r.pinned)
    if victims is None:
        assert state.free + unpinned < need          # None only when it truly cannot fit
        return
    by_id = {r.expert_id: r for r in state.residents}
    assert len(set(victims)) == len(victims) and all(v in by_id for v in victims)
    assert not any(by_id[v].pinned for v in victims)                     # never a pinned expert
    assert state.free + sum(by_id[v].nbytes for v in victims) >= need    # enough room
    if victims:                                                           # and no more than needed
        assert state.free + sum(by_id[v].nbytes for v in victims[:-1]) < need
    if name.startswith("coserve"):                                        # stage 1 strictly before stage 2
        first = [r.expert_id for r in stage_one(state)]
        here = {r.expert_id for r in state.residents} | set(state.queued) | {state.incoming}
        assert not any(here & set(state.preliminaries[v]) for v in first)   # stage 1 only takes orphans
        stage2 = [v for v in victims if v not in first]
        if stage2:
            assert victims[:len(first)] == first
        else:
            assert victims == first[:len(victims)]


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"belady"}))
@settings(max_examples=120, deadline=None)
@given(trace=st.lists(st.sampled_from(EXPERTS), min_size=1, max_size=80), slots=st.integers(1, 6))
def test_belady_never_loses_on_equal_sizes(name, trace, slots):
    sizes = {e: 10 for e in EXPERTS}
    probs = {e: (i + 1) / 36 for i, e in enumerate(EXPERTS)}
    prelims = {"g": ("a", "b"), "h": ("c",)}
    cap = 10 * slots
    other = simulate(trace, sizes, cap, name, probabilities=probs, preliminaries=prelims)
    oracle = simulate(trace, sizes, cap, "belady", probabilities=probs, preliminaries=prelims)
    assert oracle.loads <= other.loads


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=80, deadline=None)
@given(trace=st.lists(st.tuples(st.sampled_from(EXPERTS), st.booleans()), min_size=1, max_size=50))
def test_pool_never_exceeds_capacity_nor_evicts_pins(name, trace):
    sizes = {e: 10 + 3 * i for i, e in enumerate(EXPERTS)}
    pool = Pool("t", 70, make_policy(name), SizedSource(sizes), probabilities={e: 0.1 for e in EXPERTS},
                preliminaries={"g": ("a",)}, context=lambda: {"future": tuple(EXPERTS)})
    held = []
    for e, keep in trace:
        h = pool.acquire(e)
        assert pool.used_bytes() <= 70
        assert all(x.expert_id in pool.resident() for x in held)
        if h is None:
            assert held
            continue
        if keep and len(held) < 2:
            held.append(h)
        else:
            pool.release(h)


def test_coserve_exact_order():
    rs = (Resident("cls-a", 10, 1, 9), Resident("cls-b", 10, 2, 1), Resident("det-x", 30, 3, 2),
          Resident("det-y", 40, 4, 3), Resident("det-z", 20, 5, 4))
    prelims = {"det-x": ("cls-a",), "det-y": ("cls-q",), "det-z": ("cls-r",)}
    probs = {"cls-a": 0.3, "cls-b": 0.05, "det-x": 0.5, "det-y": 0.1, "det-z": 0.2}
    state = PoolState(110, rs, probs, prelims, frozenset({"det-z"}))
    # det-y is orphaned (cls-q not resident) and not queued: stage 1; det-z is queued; det-x's cls-a is resident
    assert CoServe().choose_victims(state, 40) == ["det-y"]
    # more room: then ascending probability (cls-b 0.05 before det-z 0.2) as the paper states it ...
    assert make_policy("coserve-paper").choose_victims(state, 55) == ["det-y", "cls-b", "det-z"]
    # ... or, by default, with queued experts (det-z) evicted last
    assert CoServe().choose_victims(state, 55) == ["det-y", "cls-b", "cls-a"]
    assert make_policy("probability").choose_victims(state, 40) == ["cls-b", "det-y"]
    assert make_policy("lru").choose_victims(state, 40) == ["cls-b", "det-x"]
    oracle = PoolState(110, rs, probs, prelims, future=("det-x", "cls-b", "cls-a"))
    assert make_policy("belady").choose_victims(oracle, 40) == ["det-y"]
    assert make_policy("belady").choose_victims(oracle, 55) == ["det-y", "det-z"]   # never used again, largest first


def test_coserve_breaks_probability_ties_in_a_fixed_order_and_the_paper_by_recency():
    """Three experts of one probability: CoServe evicts the largest id first whatever was used last (the reverse
    of the order pools are filled in, `ranked`: a line cycling through a board's rare types keeps the subset it
    started with); coserve-paper and -ties evict the least recently used; -protect keeps the fixed order but
    evicts a queued expert by probability."""
    rs = (Resident("cls-a", 10, 1, 1), Resident("cls-b", 10, 2, 2), Resident("cls-c", 10, 3, 3))
    probs = {"cls-a": 0.1, "cls-b": 0.1, "cls-c": 0.1, "cls-z": 0.2}
    state = PoolState(30, rs, probs)
    assert CoServe().choose_victims(state, 10) == ["cls-c"]                      # largest id, though used last
    assert make_policy("coserve-paper").choose_victims(state, 10) == ["cls-a"]   # least recently used
    assert make_policy("coserve-recencyties").choose_victims(state, 20) == ["cls-a", "cls-b"]
    used_again = PoolState(30, (rs[0], rs[1], replace(rs[2], used_seq=0)), probs)
    assert CoServe().choose_victims(used_again, 20) == ["cls-c", "cls-b"]        # recency changes nothing
    queued = PoolState(30, rs, probs, queued=frozenset({"cls-c"}))
    assert CoServe().choose_victims(queued, 10) == ["cls-b"]                     # queued: last
    assert make_policy("coserve-noprotect").choose_victims(queued, 10) == ["cls-c"]
    # the order pools are filled in is the reverse: a pool with room for two starts with the two it would keep
    assert ranked(["cls-c", "cls-a", "cls-z", "cls-b"], probs) == ["cls-z", "cls-a", "cls-b", "cls-c"]


# Stage 1 and the expert being loaded (issue 9, item 4).  The pool holds detector det-d (high
# probability) and classifier cls-x (low probability); making room for 30 bytes takes one of them.
# Stage 2 alone would take cls-x; stage 1 would take det-d first, but only if det-d is an orphan.
STAGE1_RESIDENTS = (Resident("det-d", 40, 1, 1), Resident("cls-x", 30, 2, 2))
STAGE1_PRELIMS = {"det-d": ("cls-c",), "cls-x": (), "cls-c": ()}
STAGE1_PROBS = {"det-d": 0.5, "cls-x": 0.1, "cls-c": 0.3, "cls-y": 0.1}


def stage1_state(*, incoming=None, queued=()):
    return PoolState(70, STAGE1_RESIDENTS, STAGE1_PROBS, STAGE1_PRELIMS, frozenset(queued), incoming=incoming)


@pytest.mark.parametrize("name", ["coserve", "coserve-paper"])
def test_stage_one_spares_the_detector_of_the_classifier_being_loaded(name):
    # cls-c (whose 'ok' leads to det-d) is the expert being loaded: det-d is about to be needed
    state = stage1_state(incoming="cls-c")
    assert stage_one(state) == []
    assert make_policy(name).choose_victims(state, 30) == ["cls-x"]


@pytest.mark.parametrize("name", ["coserve", "coserve-paper"])
def test_a_queued_classifier_protects_its_detector(name):
    state = stage1_state(incoming="cls-y", queued={"cls-c"})
    assert stage_one(state) == []
    assert make_policy(name).choose_victims(state, 30) == ["cls-x"]


@pytest.mark.parametrize("name", ["coserve", "coserve-paper"])
def test_a_truly_orphaned_detector_is_still_evicted_first(name):
    # nothing that leads to det-d is resident, loading or queued: stage 1 takes it despite its probability
    state = stage1_state(incoming="cls-y")
    assert [r.expert_id for r in stage_one(state)] == ["det-d"]
    assert make_policy(name).choose_victims(state, 30) == ["det-d"]


def test_pool_tells_the_policy_which_expert_it_is_loading():
    """The same case through `Pool.acquire`: the pool must put the incoming expert in the policy's state."""
    sizes = {"det-d": 40, "cls-x": 30, "cls-c": 30, "cls-y": 30}
    pool = Pool("t", 100, CoServe(), SizedSource(sizes), probabilities=STAGE1_PROBS, preliminaries=STAGE1_PRELIMS)
    for e in ("det-d", "cls-x", "cls-y"):       # full: 40 + 30 + 30
        pool.release(pool.acquire(e))
    pool.release(pool.acquire("cls-c"))        # room for cls-c: det-d is its follower and must stay
    assert sorted(pool.resident()) == ["cls-c", "cls-x", "det-d"]   # cls-y: lowest probability, ties: largest id


def coe_trace(n_frames: int, seed: int = 0):
    """Steps of the demo line A in arrival order: classifier, then its detector on 'ok'."""
    model = load_spec(REPO / "configs" / "specs" / "line-A.coe.yaml")
    rng = np.random.default_rng(seed)
    names = sorted(model.components)
    freq = np.array([model.components[c].frequency for c in names], float)
    layout = [names[i] for i in rng.choice(len(names), 40, p=freq / freq.sum())]
    trace = []
    for i in range(n_frames):
        cls = model.components[layout[i % len(layout)]].classifier
        trace.append(cls)
        exp = model.experts[cls]
        if rng.random() < exp.prior("ok"):
            trace.append(exp.next["ok"])
    sizes = {"torchvision/mobilenet_v3_small": 4, "torchvision/shufflenet_v2_x1_0": 5, "torchvision/resnet18": 45,
             "ultralytics/yolov8n": 12, "ultralytics/yolov8s": 45}
    return model, trace, {e.id: sizes[e.arch] * 10**6 for e in model.experts.values()}


@pytest.mark.parametrize("seed", [0, 1])
def test_coserve_loads_fewer_experts_than_lru_and_fifo_on_a_coe_trace(seed):
    """The same state for every policy: no queued knowledge at all (lookahead 0), so CoServe cannot win
    by knowing the next requests that LRU and FIFO ignore; what it uses is the spec's usage probabilities
    and dependencies, which are in every policy's state."""
    model, trace, sizes = coe_trace(2000, seed)
    prelims = {e: tuple(model.preliminaries(e)) for e in model.experts}
    probs = model.usage_probabilities()
    res = {p: simulate(trace, sizes, 160 * 10**6, p, probabilities=probs, preliminaries=prelims, lookahead=0)
           for p in ("coserve", "lru", "fifo")}
    # the demo line's hot classifiers and shared detectors fit; recency alone keeps cycling the cold ones
    # out and in, so a probability-blind policy loads at least half as often again
    assert 3 * res["coserve"].loads < 2 * res["lru"].loads
    assert 3 * res["coserve"].loads < 2 * res["fifo"].loads
    for r in res.values():   # every access is a hit or a load, and every load that did not fit evicted
        assert r.hits + r.loads == len(trace) and r.loads > r.evictions > 0
