"""Trace-driven decode: the pooled experts of a real model, with routing taken from a trace.

Each forward pass of the trace calls every MoE layer's `PooledExperts` with
the trace's chosen experts and gate weights on a fixed hidden state: real
loads through the pools (SSD -> memory) and real expert matmuls, with no
attention or router in between.  It isolates what the eviction policy
changes, so tokens/s per policy compare the policies and nothing else.  The
router tap is fed from the trace, so LFU and gate-score see what they would
see live; the Belady oracle gets the remaining accesses.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from coe import CoEError

from .moe_model import OffloadStats, PooledModel
from .moe_threads import loader_friendly_threads
from .pooled_experts import DECODE_TOKENS, PooledExperts


@dataclass(frozen=True)
class DecodeResult:
    tokens: int
    seconds: float
    stats: OffloadStats

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def future_accesses(trace, *, prefill: bool = True) -> list[str]:
    """Every expert request of the trace in execution order (what the oracle may see); decode only if not `prefill`."""
    steps = [step for _, step, _ in trace.passes()]
    return [eid for p, _, ids, _ in trace.accesses() if prefill or steps[p] > 0 for eid in ids]


def trace_decode(pm: PooledModel, trace, *, position: list[int] | None = None, seed: int = 0,
                 prefill: bool = True) -> DecodeResult:
    """Run `trace`'s passes through `pm`'s pooled experts; see the module docstring.

    With `prefill=False` a prompt's prefill pass is only shown to the router
    tap (it seeds LFU's counts, as a live prefill would) and not computed, and
    tokens/s counts decode tokens.  `position`, if given, is advanced to the
    index (in `future_accesses(trace, prefill=prefill)`) of the next request,
    for a Belady context built over the same list.
    """
    if pm.tap.alpha > 0 and any(hasattr(m, "e_score_correction_bias") for m in pm.model.modules()):
        # a trace holds gate scores, not the biased, grouped ranking such a router selects on, which
        # substitution needs (`routing.moe_router._router_rank`): only a live generation has it
        raise CoEError(f"model '{pm.layout.model}' ({pm.layout.model_type}): its router selects on biased scores "
                       "a trace does not hold; substitution runs on it in live generation only (alpha 0 here)")
    layers = {m.layer: m for m in pm.model.modules() if isinstance(m, PooledExperts)}
    missing = [l for l in trace.layers if l not in layers]
    if missing or trace.num_experts != pm.layout.layers[0].num_experts:
        raise CoEError(f"trace of {len(trace.layers)} layers x {trace.num_experts} experts does not fit model "
                       f"'{pm.layout.model}' ({len(layers)} MoE layers x {pm.layout.layers[0].num_experts} experts)")
    dtype = getattr(torch, pm.layout.dtype)
    hidden = pm.layout.layers[0].hidden
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, hidden, generator=g) * 0.05).to(dtype=dtype, device=pm.device)
    before = pm.stats()
    tokens, pos = 0, 0
    start = time.perf_counter()
    with torch.no_grad(), loader_friendly_threads(pm.device.type):
        for _, step, rows in trace.passes():
            states = x.expand(len(rows), hidden).contiguous()
            for j, layer in enumerate(trace.layers):
                idx = trace.chosen[rows, j, :].astype(np.int64)
                probs = trace.probs[rows, j, :].astype(np.float32)
                computed = step > 0 or prefill
                sub = pm.tap.route(layer, probs, idx) if computed else pm.tap.observe(layer, probs, idx)
                if not computed:
                    continue
                w = np.take_along_axis(probs, idx, axis=1)
                w = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-9)
                if sub is not None:      # substitution replaced some experts: their own weights, renormalised
                    idx = np.where(sub.changed[:, None], sub.chosen, idx)
                    w = np.where(sub.changed[:, None], sub.weights, w).astype(np.float32)
                if position is not None:
                    position[0] = pos
                layers[layer](states, torch.from_numpy(idx).to(pm.device),
                              torch.from_numpy(w).to(dtype=dtype, device=pm.device))
                pos += len(np.unique(idx))
            if step > 0 or prefill:
                tokens += len(rows)
    if pm.device.type == "cuda":
        torch.cuda.synchronize(pm.device)   # the last layer's kernels are queued, not done
    seconds = time.perf_counter() - start
    after = pm.stats()
    return DecodeResult(tokens, seconds, after.since(before, tokens, seconds))


class TraceGuesses:
    """An offline oracle for the token-wise prefetch (`TokenPrefetcher.guess_with`) in trace-driven decode.

    Called once per router call of a layer that the prefetcher treats as a
    decode step (at most `DECODE_TOKENS` rows), in trace order, it returns
    what the trace's next decode token of the same prompt asks that layer for
    (nothing at a prompt's last token).  With `top_alpha` > 0 only the experts
    substitution at that alpha would not replace, those scoring above
    (1 + alpha) x the token's (k+1)-th score (`routing.substitution`'s
    top-score band): a missing expert below it is substituted, not read, so
    prefetching it reads what the layer would not have.  Not realisable: it
    bounds what prefetch can pay on this box, predictor aside.
    """

    def __init__(self, trace, top_alpha: float = 0.0) -> None:
        from routing.substitution import top_score

        calls = [(seq, step, rows) for seq, step, rows in trace.passes() if len(rows) <= DECODE_TOKENS]
        self._next: dict[int, list[list[int]]] = {}
        for j, layer in enumerate(trace.layers):
            sets = []
            for i, (seq, _, _) in enumerate(calls):
                nxt = calls[i + 1] if i + 1 < len(calls) else None
                if nxt is None or nxt[0] != seq or nxt[1] == 0:
                    sets.append([])
                    continue
                rows = nxt[2]
                picked = trace.chosen[rows, j, :].astype(np.int64)
                if top_alpha > 0:       # substitution's own band, on the float32 scores the decode routes with
                    sets.append(sorted(top_score(trace.probs[rows, j, :].astype(np.float32), picked, top_alpha)))
                else:
                    sets.append(sorted({int(e) for e in picked.reshape(-1)}))
            self._next[layer] = sets
        self._calls = {layer: 0 for layer in trace.layers}

    def __call__(self, layer: int) -> list[int]:
        i = self._calls[layer]
        self._calls[layer] = i + 1
        sets = self._next[layer]
        return sets[i] if i < len(sets) else []


def remap(trace, model: str):
    """The same trace addressed to another model's expert ids (a big generated model of the same shape)."""
    return dataclasses.replace(trace, model=model)

