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

Both costs depend on where a miss's weights are when the split decides: in
the host tier (a load is a host-to-GPU copy, an in-place computation a
matmul on pinned RAM) or only in the file (both read the file first).  One
mean over both sources misleads the rule: after a run of cheap host-tier
matmuls the mean in-place cost fell below a load's, and on the H200 box the
split computed file-only misses on the CPU too.  So the costs are kept per
source, and each miss is weighed at its own source's.  A load cost is filed under a source only when all of a layer's loads came
from it (a mixed layer's wall time is neither's); a source whose load cost is
not yet measured is weighed at the mean over both.  A source whose in-place
cost is not yet measured has its lowest-score miss computed in place, to learn
it, and the rest loaded: weighed at the other source's mean, all its misses
would go in place on the strength of cheaper host-tier matmuls.

Measured per source on that box (`llm bench --part e`, figures in the
docs/llm.md's GPU section), computing in place is cheaper per step, and the split
still does not pay there: an expert computed in place never enters the pool,
so the next token misses it again.  The rule weighs one step, not the reuse
a load buys.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

# where a miss's weights are when the split decides: the host tier, or only the file (page cache or disk)
HOST, FILE = "host", "file"


def ema(old: float, new: float, a: float) -> float:
    """A recent mean: `new` itself when nothing was measured before (old <= 0)."""
    return new if old <= 0 else (1 - a) * old + a * new


@dataclass
class SplitStats:
    loaded: int = 0                 # layers whose loads were measured
    in_place: int = 0               # experts computed in place
    load_seconds: float = 0.0       # recent mean cost of one load, any source
    compute_seconds: float = 0.0    # recent mean cost of one in-place computation, any source
    by_source: dict = field(default_factory=dict)   # {("load" | "other", HOST | FILE): recent mean seconds}


def choose_split(costs: list[tuple[float, float]]) -> int:
    """How many of the misses to load, given (C_load, C_other) of each in descending score order.

    The first n are loaded, the rest computed in place; n makes
    max(Σ C_load of the first n, Σ C_other of the rest) smallest (ties: load more).
    """
    m = len(costs)
    best, best_cost = m, float("inf")
    for n in range(m, -1, -1):
        cost = max(sum(c for c, _ in costs[:n]), sum(o for _, o in costs[n:]))
        if cost < best_cost - 1e-12:
            best, best_cost = n, cost
    return best


def choose_loads(m: int, c_load: float, c_other: float) -> int:
    """How many of m misses to load so that max(n·c_load, (m−n)·c_other) is smallest (ties: load more)."""
    return choose_split([(c_load, c_other)] * m)


class LoadComputeSplit:
    """The recent costs and the decision; a mechanism with state, the rule (`choose_split`) is pure."""

    def __init__(self, smoothing: float = 0.3) -> None:
        self._a = smoothing
        self._lock = threading.Lock()
        self.stats = SplitStats()

    def cost(self, kind: str, source: str) -> float:
        """The recent cost of one 'load' or 'other' (in place) from `source`; the mean over sources until measured."""
        with self._lock:
            mean = self.stats.load_seconds if kind == "load" else self.stats.compute_seconds
            return self.stats.by_source.get((kind, source), mean)

    def split(self, misses_by_score: list[int], sources: list[str] | None = None) -> tuple[list[int], list[int]]:
        """(to load, to compute in place) of misses sorted by descending score; `sources` says where each is."""
        with self._lock:
            c_load, c_other = self.stats.load_seconds, self.stats.compute_seconds
        m = len(misses_by_score)
        if m == 0:
            return [], []
        if c_load <= 0:                 # nothing measured yet: load, and learn what a load costs
            return list(misses_by_score), []
        if c_other <= 0:                # learn what an in-place computation costs on the lowest-score miss
            return list(misses_by_score[:-1]), misses_by_score[-1:]
        srcs = sources if sources is not None else [FILE] * m
        with self._lock:
            known = {src for kind, src in self.stats.by_source if kind == "other"}
        new = [i for i, src in enumerate(srcs) if src not in known]
        if new:     # a source whose in-place cost was never measured: the mean over the others' (cheap host-tier
            #         matmuls) would send all its misses in place; compute its lowest-score one, to learn
            return [e for i, e in enumerate(misses_by_score) if i != new[-1]], [misses_by_score[new[-1]]]
        n = choose_split([(self.cost("load", src), self.cost("other", src)) for src in srcs])
        return list(misses_by_score[:n]), list(misses_by_score[n:])

    def measured(self, *, load: float | None = None, compute: float | None = None,
                 source: str | None = None) -> None:
        """Fold in a measured load (per load, a layer's) or in-place cost; `source` when all of it was one source."""
        with self._lock:
            s, a = self.stats, self._a
            if load is not None:
                s.loaded += 1
                s.load_seconds = ema(s.load_seconds, load, a)
                if source is not None:
                    s.by_source[("load", source)] = ema(s.by_source.get(("load", source), 0.0), load, a)
            if compute is not None:
                s.in_place += 1
                s.compute_seconds = ema(s.compute_seconds, compute, a)
                if source is not None:
                    s.by_source[("other", source)] = ema(s.by_source.get(("other", source), 0.0), compute, a)

    def summary(self) -> str:
        """The costs in ms, per source where measured: what the bench prints beside the counts."""
        with self._lock:
            s = self.stats
            parts = [f"C_load {s.load_seconds * 1e3:.1f} ms", f"C_cpu {s.compute_seconds * 1e3:.1f} ms"]
            per = [f"{'C_load' if k == 'load' else 'C_cpu'}[{src}] {v * 1e3:.1f}"
                   for (k, src), v in sorted(s.by_source.items())]
        return " ".join(parts) + (f" ({', '.join(per)} ms)" if per else "")
