"""The lookahead oracle of `bench/moe_lookahead.py`, on which a README claim rests: its window is exactly the
accesses from now to the end of the n-th next forward pass."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from routing.moe_replay import FutureView, replay
from routing.moe_trace import synthetic
from storage.policies import PoolState, Resident

_spec = importlib.util.spec_from_file_location("moe_lookahead", Path(__file__).parents[1] / "bench" / "moe_lookahead.py")
_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench)
Lookahead, pass_index = _bench.Lookahead, _bench.pass_index


def test_pass_index_maps_every_access_to_its_forward_pass():
    trace = synthetic([[5, 4, 3, 2, 1, 1, 1, 1]] * 3, tokens=40, top_k=2, locality=0.5, seed=1)
    pass_of, pass_end = pass_index(trace)
    accesses = list(trace.accesses())
    assert len(pass_of) == sum(len(ids) for _, _, ids, _ in accesses) == pass_end[-1]
    assert list(pass_of) == [p for p, _, ids, _ in accesses for _ in ids]
    assert np.all(np.diff(pass_end) > 0)


def test_the_window_runs_from_now_to_the_end_of_the_nth_next_pass():
    # three passes of two accesses each; we are serving access 1 (the second of pass 0)
    flat = ["a", "b", "c", "d", "e", "f"]
    pass_of, pass_end = np.array([0, 0, 1, 1, 2, 2]), np.array([2, 4, 6])
    residents = tuple(Resident(e, 1, i, i) for i, e in enumerate(["a", "c", "e"]))
    popular = {"a": 0.9, "c": 0.1, "e": 0.5}           # by popularity alone, c would go first
    state = PoolState(3, residents, probabilities=popular, future=FutureView(flat, 1), incoming="x")
    # n = 1: the window is accesses 1..3 (b, c, d): c is kept, a (0.9) and e (0.5) are outside it, e goes first
    assert Lookahead(1, pass_of, pass_end).choose_victims(state, 1) == ["e"]
    # n = 2: e is in the window too; only a is outside it
    assert Lookahead(2, pass_of, pass_end).choose_victims(state, 1) == ["a"]
    # n = 0: the rest of this pass only (b): everything resident is outside, by popularity
    assert Lookahead(0, pass_of, pass_end).choose_victims(state, 1) == ["c"]


def test_a_lookahead_oracle_replays_and_never_beats_belady():
    trace = synthetic([[6, 5, 4, 3, 2, 1, 1, 1]] * 3, tokens=150, top_k=2, locality=0.6, seed=3)
    pass_of, pass_end = pass_index(trace)
    pop = synthetic([[6, 5, 4, 3, 2, 1, 1, 1]] * 3, tokens=150, top_k=2, locality=0.6, seed=4).popularity()
    belady = replay(trace, policy="belady", capacity=6, expert_nbytes=1)
    got = [replay(trace, policy=Lookahead(n, pass_of, pass_end), capacity=6, expert_nbytes=1, popularity=pop).loads
           for n in (1, 3)]
    lru = replay(trace, policy="lru", capacity=6, expert_nbytes=1).loads
    assert all(belady.loads <= g for g in got) and min(got) < lru      # knowing ahead helps, never past Belady


def test_the_mixtral_table_has_a0_between_belady_and_lru():
    rows = dict(_bench.mixtral_rows(0.25))
    a0, belady = rows["oracle: A0, the trace's own marginals"], rows["oracle: belady"]
    lru = next(r for name, r in rows.items() if name.startswith("lru"))
    assert belady.loads <= a0.loads < lru.loads
    assert a0.loads <= rows["probability"].loads        # the true ranking beats one from another subject
