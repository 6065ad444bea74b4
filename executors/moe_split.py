"""Load versus compute for missing experts (importance paper Alg. 2; Fiddler): the split rule.

Each missing expert is either loaded into the pool (it may be reused) or
computed where its weights already are, without entering the pool: on a CPU
box, straight from the expert file's memory map (the page cache), with no
copy and no eviction.  The split sorts a layer's misses by gate score and
chooses how many to load so that max(n_load·C_load, n_other·C_other) is
smallest, from the recent measured cost of one load and of one in-place
computation (on a GPU box the two run at once: loads on the loader threads,
in-place matmuls on a CPU thread; on a CPU box the in-place matmuls run
before the loads start, and the rule then only weighs them).  High-score
misses are loaded, low-score ones computed in place.

This module is the rule and its measured costs; where the in-place experts
run is `moe_fiddler`: on a CPU pool the matmul from the memory map on the
calling thread, on a CUDA pool (Fiddler) a CPU thread computing from the host
tier's copy or the memory map while the loads proceed, its result copied to
the GPU.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class SplitStats:
    loaded: int = 0
    in_place: int = 0
    load_seconds: float = 0.0       # recent mean cost of one load
    compute_seconds: float = 0.0    # recent mean cost of one in-place computation


def choose_loads(m: int, c_load: float, c_other: float) -> int:
    """How many of m misses to load so that max(n·c_load, (m−n)·c_other) is smallest (ties: load more)."""
    best, best_cost = m, float("inf")
    for n in range(m, -1, -1):
        cost = max(n * c_load, (m - n) * c_other)
        if cost < best_cost - 1e-12:
            best, best_cost = n, cost
    return best


class LoadComputeSplit:
    """The recent costs and the decision; a mechanism with state, the rule (`choose_loads`) is pure."""

    def __init__(self, smoothing: float = 0.3) -> None:
        self._a = smoothing
        self._lock = threading.Lock()
        self.stats = SplitStats()

    def split(self, misses_by_score: list[int]) -> tuple[list[int], list[int]]:
        """(to load, to compute in place) of misses sorted by descending score."""
        with self._lock:
            c_load, c_other = self.stats.load_seconds, self.stats.compute_seconds
        m = len(misses_by_score)
        if m == 0:
            return [], []
        if c_load <= 0:                 # nothing measured yet: load, and learn what a load costs
            return list(misses_by_score), []
        if c_other <= 0:                # learn what an in-place computation costs on the lowest-score miss
            return list(misses_by_score[:-1]), misses_by_score[-1:]
        n = choose_loads(m, c_load, c_other)
        return list(misses_by_score[:n]), list(misses_by_score[n:])

    def measured(self, *, load: float | None = None, compute: float | None = None) -> None:
        with self._lock:
            s = self.stats
            if load is not None:
                s.loaded += 1
                s.load_seconds = load if s.load_seconds <= 0 else (1 - self._a) * s.load_seconds + self._a * load
            if compute is not None:
                s.in_place += 1
                s.compute_seconds = (compute if s.compute_seconds <= 0
                                     else (1 - self._a) * s.compute_seconds + self._a * compute)
