"""Replay an access trace through a real `Pool` to count what a policy loads.

The pool, the policy and the bookkeeping are the production ones; only the
source is sizes without bytes.  The scheduler's knowledge is modelled as a
lookahead window: the experts of the next `lookahead` accesses are "queued".
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .policies import make_policy
from .pool import Pool


@dataclass(frozen=True)
class SimResult:
    policy: str
    accesses: int
    loads: int
    hits: int
    evictions: int
    bytes_loaded: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


class SizeSource:
    """A pool source of known sizes and no bytes (trace replays)."""

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = sizes

    def size(self, expert_id: str) -> int:
        return self.sizes[expert_id]

    def load(self, expert_id: str) -> None:
        return None


def simulate(trace: Sequence[str], sizes: Mapping[str, int], capacity: int, policy: str, *,
             probabilities: Mapping[str, float] | None = None,
             preliminaries: Mapping[str, tuple[str, ...]] | None = None, lookahead: int = 32) -> SimResult:
    pos = [0]
    chooser = make_policy(policy)
    oracle = bool(getattr(chooser, "oracle", False))  # only an oracle may see (and pay for) the whole future

    def context() -> dict:
        i = pos[0]
        return {"queued": set(trace[i + 1:i + 1 + lookahead]), "future": tuple(trace[i + 1:]) if oracle else ()}

    pool = Pool("sim", capacity, chooser, SizeSource(sizes), probabilities=dict(probabilities or {}),
                preliminaries=dict(preliminaries or {}), context=context)
    for i, eid in enumerate(trace):
        pos[0] = i
        handle = pool.acquire(eid)
        if handle is None:
            raise ValueError(f"access {i} ({eid}) cannot fit a pool of {capacity} bytes")
        pool.release(handle)
    s = pool.stats()
    return SimResult(policy, len(trace), s.misses, s.hits, s.evictions, s.bytes_in)
