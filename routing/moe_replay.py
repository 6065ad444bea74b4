"""Replay an MoE routing trace through real `Pool`s to count what each policy loads.

The pools, policies and bookkeeping are the production ones; the source has
sizes, not bytes.  Each forward pass asks each MoE layer, in order, for the
union of its tokens' chosen experts; the layer's experts are pinned together
(in waves if they do not fit), as `PooledExperts` pins them.  What the
policies see is built from the trace as the router tap builds it live:
- `counts`: tokens that chose each expert so far (the prompt's prefill first);
- `gate_scores`: each expert's gate score averaged over the last `window` passes;
- `probabilities`: per-layer popularity from a *different* trace (a profile),
  never from the trace being replayed;
- `predicted`: a token predictor's probability that the next token asks for
  each expert (`predicted` policy; the predictor is trained on the profile);
- `future`: the remaining accesses, for oracles only (Belady).
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from coe import CoEError
from coe.moe import expert_id
from storage.policies import EvictionPolicy, make_policy, ranks_by_value
from storage.pool import Pool
from storage.tracesim import SizeSource

from .moe_trace import Trace


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    quota: str
    capacity: int           # bytes, all pools together
    accesses: int           # expert requests (one per layer per pass per expert asked for)
    hits: int
    loads: int
    bytes_loaded: int
    bypassed: int = 0       # misses the pools declined (`admission`): read for one use, never resident

    @property
    def misses(self) -> int:
        """Every request that found its expert absent: loads plus bypassed reads."""
        return self.loads + self.bypassed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


class FutureView:
    """flat[start:] without the copy (the oracle reads it once per eviction, stopping early)."""

    def __init__(self, flat: list[str], start: int) -> None:
        self.flat, self.start = flat, start

    def __iter__(self):
        return itertools.islice(self.flat, self.start, None)

    def __len__(self) -> int:
        return len(self.flat) - self.start

    def __getitem__(self, i):
        return self.flat[self.start + i]


def replay(trace: Trace, *, policy: "str | EvictionPolicy", capacity: int, expert_nbytes: int,
           quota: str = "shared", popularity: Mapping[str, float] | None = None, window: int = 8,
           predictor=None, admission: bool = False) -> ReplayResult:
    """Replay `trace` with `capacity` bytes of pool (split per layer with quota='per-layer').

    `policy` is a name from `storage.policies` or a policy object (an analysis
    oracle, say); one whose `oracle` attribute is true sees `future`.
    `admission`: a miss the pool declines (`Pool.admissions`: worth less than
    what it would push out) is read for its one use and never enters the
    pool, as a pooled layer computes it over its file's memory map; it counts
    as a miss and its bytes as moved.  Its pages take one expert of
    `capacity` while it is computed, as `load_pooled(admission=True)` sets
    them aside: the pools get the rest.
    """
    chooser = make_policy(policy) if isinstance(policy, str) else policy
    policy = chooser.name
    if quota not in ("shared", "per-layer"):
        raise CoEError(f"quota must be 'shared' or 'per-layer', got {quota!r}")
    if policy == "probability" and not popularity:
        raise CoEError("policy 'probability' needs a popularity profile (from another trace)")
    if policy == "predicted" and predictor is None:
        raise CoEError("policy 'predicted' needs a token predictor (trained on another trace)")
    accesses = list(trace.accesses())
    flat = [eid for _, _, ids, _ in accesses for eid in ids]
    counts: dict[str, float] = {}
    recent = {layer: deque(maxlen=window) for layer in trace.layers}
    scores: dict[str, float] = {}
    pos = [0]
    oracle = bool(getattr(chooser, "oracle", False))

    predicted: dict[str, float] = {}
    scorer = None
    if policy == "predicted":
        from .moe_predictor import NextTokenScores

        predictor.fits(trace.layers, trace.num_experts, trace.model, trace.top_k)
        scorer = NextTokenScores(predictor, {l: [expert_id(trace.model, l, e) for e in range(trace.num_experts)]
                                             for l in trace.layers})
        predicted = scorer.scores

    def context() -> dict:
        return {"counts": counts, "gate_scores": scores, "predicted": predicted,
                "future": FutureView(flat, pos[0]) if oracle else ()}

    admission = admission and ranks_by_value(chooser)     # LRU, FIFO never decline: nothing is set aside
    if admission and quota != "shared":
        raise CoEError("admission sets one expert of the capacity aside; equal per-layer pools would each give up "
                       "a slot for it: use quota 'shared'")
    pools_capacity = capacity - expert_nbytes if admission else capacity
    per = pools_capacity // len(trace.layers) if quota == "per-layer" else pools_capacity
    if per < trace.top_k * expert_nbytes:
        raise CoEError(f"a {quota} pool of {per} bytes cannot hold one token's {trace.top_k} experts")
    sizes = SizeSource(dict.fromkeys(trace.ids(), expert_nbytes))
    pools = {key: Pool("sim", per, chooser, sizes, probabilities=dict(popularity or {}),
                       context=context)
             for key in (trace.layers if quota == "per-layer" else [None])}
    rows_by_pass = [rows for _, _, rows in trace.passes()]
    for p, layer, ids, mean_scores in accesses:
        j = trace.layers.index(layer)
        rows = rows_by_pass[p]
        for e, n in zip(*np.unique(trace.chosen[rows, j, :], return_counts=True)):
            key = expert_id(trace.model, layer, int(e))
            counts[key] = counts.get(key, 0.0) + float(n)
        if scorer is not None:   # as the live router tap: the layer's router call comes before its loads
            scorer.on_router(layer, trace.probs[rows, j, :], trace.chosen[rows, j, :])
        recent[layer].append(mean_scores)
        mean = np.mean(np.stack(recent[layer]), axis=0)
        scores.update((expert_id(trace.model, layer, e), float(v)) for e, v in enumerate(mean))
        pool = pools[layer if quota == "per-layer" else None]
        pending = list(ids)
        if admission:
            pending = _admitted(pool, trace, rows, j, layer, pending, pos)
        while pending:
            held = []
            for eid in pending:
                h = pool.acquire(eid)
                pos[0] += 1
                if h is None:
                    pos[0] -= 1
                    break
                held.append(h)
            if not held:
                raise CoEError(f"layer {layer}: the pool cannot hold even one expert")
            for h in held:
                pool.release(h)
            pending = pending[len(held):]
    stats = [p.stats() for p in pools.values()]
    hits, loads = sum(s.hits for s in stats), sum(s.misses for s in stats)
    bypassed = sum(s.bypassed for s in stats)
    return ReplayResult(policy, quota, per * len(pools) + (expert_nbytes if admission else 0),
                        hits + loads + bypassed, hits, loads,
                        sum(s.bytes_in + s.bypassed_bytes for s in stats), bypassed)


def _admitted(pool: Pool, trace: Trace, rows, j: int, layer: int, ids: list[str], pos: list[int]) -> list[str]:
    """What the layer acquires under admission, as `PooledExperts` decides it: the misses weighed in descending
    gate score with the layer's resident experts pinned (`Pool.admissions`), the declined ones counted and
    served beside the pool; the resident ones first, then the admitted misses in that order."""
    present = [e for e in ids if pool.present(e)]
    resident = set(present)
    chosen = trace.chosen[rows, j, :].astype(np.int64)
    probs = trace.probs[rows, j, :].astype(np.float32)
    weight = {expert_id(trace.model, layer, int(e)): float(probs[:, e][(chosen == e).any(axis=1)].sum())
              for e in np.unique(chosen)}
    misses = sorted((e for e in ids if e not in resident), key=lambda e: -weight[e])
    start = pos[0]
    pos[0] = start + len(ids)           # an oracle weighs the uses after this layer's
    answers = pool.admissions(misses, keep=present)
    pos[0] = start
    admitted = []
    for e, ok in zip(misses, answers):
        if ok:
            admitted.append(e)
        else:
            pool.bypass(e)              # served beside the pool: no pin, no eviction
            pos[0] += 1
    return present + admitted
