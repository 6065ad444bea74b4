"""Importance-driven substitution (the importance paper's Alg. 1 with its prose): a routing decision.

A missing low-score active expert is replaced by a resident inactive expert of
similar gate score, so the layer computes with what is in memory instead of
waiting for a load.  With S the token's (k+1)-th gate score and threshold α:
- top-score experts: s > (1+α)·S (always kept; loaded if missing);
- low-score experts: S < s ≤ (1+α)·S (kept if resident or top-score for some
  token of the batch, else a substitution candidate);
- substitutes: inactive experts with (1−α)·S < s ≤ S that are resident or
  top-score for some token of the batch.
The set of top-score experts is built over the whole batch first, so the
result does not depend on token order (the printed pseudo-code builds it
inside the token loop).  Missing low-score experts are replaced, lowest score
first, by the highest-scoring substitutes.

Weights.  A substitute gets its own gate weight, computed as the model
family's router computes weights for its chosen set: the gate score (softmax
probability, or sigmoid score for DeepSeek-V3-style routers), renormalised
over the token's final k experts when the family normalises its top-k
(`norm_topk_prob`: always for Mixtral, per config for Qwen2/Qwen3-MoE, OLMoE,
DeepSeek-V3), then times `routed_scaling_factor` where the family has one.

α = 0 makes the low-score and substitute bands empty: nothing changes, and
generation stays exact.  Any α > 0 is approximate and says so once.
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from coe import CoEError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightRule:
    """How a family turns gate scores of the chosen experts into weights."""

    normalise: bool = True          # norm_topk_prob
    scale: float = 1.0              # routed_scaling_factor

    def weights(self, scores: np.ndarray) -> np.ndarray:
        """[T, k] scores of the chosen experts -> [T, k] weights."""
        w = scores.astype(np.float64)
        if self.normalise:
            w = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-20)
        return w * self.scale


@dataclass(frozen=True)
class Substitution:
    chosen: np.ndarray          # [T, k] expert indices after substitution
    weights: np.ndarray         # [T, k] the family's weights for the final experts (meaningful where `changed`)
    changed: np.ndarray         # [T] bool: tokens whose experts changed (the others keep the router's own weights)
    substituted: int            # experts replaced, over all tokens
    missing_low: int            # low-score experts that were neither resident nor top-score


def _top_set(scores: np.ndarray, chosen: np.ndarray, hi: np.ndarray) -> set[int]:
    """The batch's top-score set: experts a token chose and scores above its `hi` (built before any token).
    An index outside the experts (a router's padding) is no expert."""
    E = scores.shape[1]
    return {int(e) for t in range(len(chosen)) for e in chosen[t] if 0 <= e < E and scores[t, e] > hi[t]}


def top_score(scores: np.ndarray, chosen: np.ndarray, alpha: float) -> set[int]:
    """The experts `substitute` at `alpha` always keeps (and loads if missing): every chosen expert but the
    low-score ones (S < s <= (1+alpha)S), which it may replace: the top-score set, and any chosen at or below S
    (a tie with the (k+1)-th).

    Every chosen expert when k >= E (nothing is substituted then).  Used by
    the trace oracle of the token-wise prefetch (`executors.moe_decode.TraceGuesses`).
    """
    scores = np.asarray(scores, dtype=np.float64)
    chosen = np.asarray(chosen, dtype=np.int64)
    T, E = scores.shape
    k = chosen.shape[1]
    if k >= E:
        return {int(e) for e in chosen.reshape(-1) if 0 <= e < E}
    s_next = -np.sort(-scores, axis=1)[:, k]
    hi = (1 + alpha) * s_next
    return {int(e) for t in range(T) for e in chosen[t]
            if 0 <= e < E and not s_next[t] < scores[t, e] <= hi[t]}


def substitute(scores: np.ndarray, chosen: np.ndarray, resident: Collection[int], alpha: float,
               rule: WeightRule, rank: np.ndarray | None = None) -> Substitution:
    """Alg. 1 on one layer's batch: `scores` [T, E] gate scores, `chosen` [T, k] the router's experts.

    `rank` [T, E] is what the router selects on, where that is not the gate
    score itself: DeepSeek-V3 picks on sigmoid + a correction bias, and only
    within its best groups (-inf elsewhere).  S is then the gate score of the
    router's own (k+1)-th pick, and a substitute must be one the router could
    have picked (finite `rank`); the bands and the weights stay on gate scores.
    """
    if not 0 <= alpha < 1:
        raise CoEError(f"substitution threshold alpha must be in [0, 1), got {alpha}")
    scores = np.asarray(scores, dtype=np.float64)
    chosen = np.array(chosen, dtype=np.int64, copy=True)
    T, E = scores.shape
    k = chosen.shape[1]
    changed = np.zeros(T, dtype=bool)
    padded = ((chosen < 0) | (chosen >= E)).any(axis=1)   # a router's padding: such a token is left as it is
    gather = np.clip(chosen, 0, E - 1)                    # (its weights are never used: it does not change)
    if k >= E:
        return Substitution(chosen, rule.weights(np.take_along_axis(scores, gather, 1)), changed, 0, 0)
    if rank is None:
        s_next = -np.sort(-scores, axis=1)[:, k]              # the (k+1)-th score of each token
        eligible = np.ones_like(scores, dtype=bool)
    else:
        rank = np.asarray(rank, dtype=np.float64)
        if rank.shape != scores.shape:
            raise CoEError(f"substitution: router ranks of shape {list(rank.shape)}, gate scores "
                           f"{list(scores.shape)}")
        eligible = np.isfinite(rank)
        nxt = np.argsort(-np.where(eligible, rank, -np.inf), axis=1, kind="stable")[:, k]
        # a token whose router could pick no (k+1)-th expert has no low band: nothing of it is replaced
        s_next = np.where(eligible[np.arange(T), nxt], scores[np.arange(T), nxt], np.inf)
    hi, lo = (1 + alpha) * s_next, (1 - alpha) * s_next
    top = _top_set(scores, chosen, hi)                       # the batch's top-score set
    avail = set(int(e) for e in resident) | top
    replaced = missing_low = 0
    for t in range(T):
        if padded[t]:
            continue
        picked = set(int(e) for e in chosen[t])
        missing = [j for j, e in enumerate(chosen[t])
                   if s_next[t] < scores[t, e] <= hi[t] and int(e) not in avail]
        if not missing:
            continue
        missing_low += len(missing)
        subs = [e for e in np.argsort(-scores[t], kind="stable") if int(e) not in picked and int(e) in avail
                and eligible[t, e] and lo[t] < scores[t, e] <= s_next[t]]
        missing.sort(key=lambda j: scores[t, chosen[t, j]])    # replace the least important first
        for j, e in zip(missing, subs):
            chosen[t, j] = e
            replaced += 1
            changed[t] = True
    return Substitution(chosen, rule.weights(np.take_along_axis(scores, np.clip(chosen, 0, E - 1), 1)), changed,
                        replaced, missing_low)


_warned = False


def warn_approximate(alpha: float) -> None:
    """Say once per process that generation is approximate (α > 0)."""
    global _warned
    if alpha > 0 and not _warned:
        _warned = True
        log.warning("expert substitution alpha=%.2f: generation is approximate (alpha=0 is exact)", alpha)
