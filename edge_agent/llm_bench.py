"""`coe-agent llm bench`, part (a): hit rate and bytes moved per policy and pool size, on two trace kinds.

Simulation on real pools: the traces are replayed through the production
`Pool` and policies (`routing.moe_replay`); only the bytes are absent.
- 'trained': the small MoE trained here on stdlib text (`coe-agent llm
  make-model --trained`), traced on held-out text.  The first half of the
  prompts is the profile the 'probability' policy ranks by; the second half
  is replayed.
- 'mixtral': synthetic traces whose per-layer marginals are Mixtral-8x7B's
  measured popularity (`../shared/data/mixtral-expert-popularity`):
  replayed on one subject, profiled on another.  No temporal locality is
  assumed (the counts carry none), which is the hardest case for any cache.
Belady is the offline oracle: a bound, not a contender.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from routing.moe_replay import replay
from routing.moe_trace import Trace, load_popularity, synthetic

SIZES = (0.125, 0.25, 0.5)
POLICIES = ("lru", "fifo", "lfu", "gate-score", "probability", "belady")
REALISABLE = ("lfu", "gate-score", "probability", "fifo")
QUOTAS = ("shared", "per-layer")


@dataclass(frozen=True)
class Row:
    trace: str
    size: float
    quota: str
    policy: str
    hit_rate: float | None
    loads: int | None
    gib_moved: float | None
    experts: int            # pool capacity in experts, all pools together


def split_trace(trace: Trace) -> tuple[Trace, Trace]:
    """(profile, replay): the first and second half of the trace's prompts."""
    import numpy as np

    seqs = np.unique(trace.seq)
    if len(seqs) < 2:
        raise ValueError("a trace needs at least two prompts to split into a profile and a replay")
    cut = seqs[len(seqs) // 2]

    def part(mask):
        return Trace(trace.model, trace.layers, trace.top_k, trace.scoring, trace.probs[mask], trace.chosen[mask],
                     trace.seq[mask], trace.step[mask])
    return part(trace.seq < cut), part(trace.seq >= cut)


def mixtral_traces(data_dir: Path, tokens: int = 256, seed: int = 0) -> tuple[Trace, Trace]:
    """(profile, replay) drawn from two MMLU subjects' measured Mixtral popularity."""
    prof = synthetic(load_popularity(data_dir / "college_computer_science.json"), tokens=tokens, seed=seed + 1)
    rep = synthetic(load_popularity(data_dir / "international_law.json"), tokens=tokens, seed=seed)
    return prof, rep


def run_replays(kind: str, profile: Trace, trace: Trace, *, expert_nbytes: int = 1,
                progress: Callable[[str], None] | None = None) -> list[Row]:
    popularity = profile.popularity()
    total = len(trace.layers) * trace.num_experts
    rows = []
    for size in SIZES:
        experts = max(1, round(total * size))
        for quota in QUOTAS:
            for policy in POLICIES:
                if progress:
                    progress(f"{kind} {size:.1%} {quota} {policy}")
                try:
                    r = replay(trace, policy=policy, capacity=experts * expert_nbytes, expert_nbytes=expert_nbytes,
                               quota=quota, popularity=popularity)
                except Exception as exc:  # a per-layer share below top-k experts: reported, not fatal
                    if "cannot hold" not in str(exc):
                        raise
                    rows.append(Row(kind, size, quota, policy, None, None, None, experts))
                    continue
                rows.append(Row(kind, size, quota, policy, r.hit_rate, r.loads, r.bytes_loaded / 2**30, experts))
    return rows


def summary(rows: list[Row]) -> dict:
    """Per trace kind at 25%: LRU's misses, the best realisable policy's, their ratio (target <= 0.7)."""
    out = {}
    for kind in sorted({r.trace for r in rows}):
        at = [r for r in rows if r.trace == kind and r.size == 0.25 and r.loads is not None]
        lru = min((r for r in at if r.policy == "lru"), key=lambda r: r.loads)
        best = min((r for r in at if r.policy in REALISABLE + ("lru",)), key=lambda r: r.loads)
        oracle = min((r for r in at if r.policy == "belady"), key=lambda r: r.loads)
        out[kind] = {"lru_hit_rate": round(lru.hit_rate, 4), "lru_quota": lru.quota,
                     "best": best.policy, "best_quota": best.quota, "best_hit_rate": round(best.hit_rate, 4),
                     "miss_ratio_vs_lru": round(best.loads / lru.loads, 3) if lru.loads else None,
                     "belady_hit_rate": round(oracle.hit_rate, 4),
                     "belady_miss_ratio_vs_lru": round(oracle.loads / lru.loads, 3) if lru.loads else None}
    return out


def table(rows: list[Row]) -> str:
    lines = [f"{'trace':8} {'size':>6} {'quota':9} " + " ".join(f"{p:>12}" for p in POLICIES)]
    keys = sorted({(r.trace, r.size, r.quota) for r in rows}, key=lambda k: (k[0], k[1], QUOTAS.index(k[2])))
    for k in keys:
        cells = []
        for p in POLICIES:
            r = next(x for x in rows if (x.trace, x.size, x.quota, x.policy) == (*k, p))
            cells.append(f"{'n/a':>12}" if r.hit_rate is None else f"{r.hit_rate:>11.1%} ")
        lines.append(f"{k[0]:8} {k[1]:>6.1%} {k[2]:9} " + " ".join(cells))
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
