"""How far can eviction get on the trained MoE's trace? Realisable policies against lookahead oracles.

Simulation on real pools (`routing.moe_replay`, the bench's part (a)): the
trained small MoE's held-out trace, first half of its prompts the profile
(popularity, token predictor), second half replayed, pool at `--size` of the
experts.  Besides the policies `coe-agent llm bench --part a` runs, it replays
analysis oracles that no online policy can be:
- `next-token q alone`: `predicted` without a popularity profile, which is
  how it ranked before popularity joined the rank;
- `lookahead-n`: exact knowledge of every access up to the end of the n-th
  next token (the rest of this token's layers included); experts not asked for
  in that window go first, by popularity, then recency;
- `belady`: the whole future.
On the synthetic Mixtral-popularity trace (independent requests drawn from
measured marginals, `--part a`'s second kind) it adds `oracle: A0`: the
experts ranked by the replayed trace's own marginals, which for independent
requests is the classic optimal online policy (keep the most probable).

Issue 10 asks the best realisable policy for <= 0.7x LRU's misses.  The
lookahead oracles are not bounds (another use of the same knowledge may do
better); they show how far perfect next-token knowledge, used this way, goes.

Usage:  python bench/moe_lookahead.py [--trace var/llm/trained-40x32.trace] [--size 0.25]
Prints a table and one JSON line.  The trace comes from `coe-agent llm bench --part a`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from edge_agent.llm_bench import split_trace  # noqa: E402
from routing.moe_predictor import TokenPredictor  # noqa: E402
from routing.moe_replay import replay  # noqa: E402
from routing.moe_trace import Trace  # noqa: E402
from storage.policies import PoolState, _evict_in_order  # noqa: E402


class Lookahead:
    """Oracle: knows every access up to the end of the n-th next forward pass; the rest by popularity."""

    oracle = True

    def __init__(self, n: int, pass_of: np.ndarray, pass_end: np.ndarray) -> None:
        self.name, self.n = f"lookahead-{n}", n
        self.pass_of, self.pass_end = pass_of, pass_end     # access index -> pass; pass -> its last access + 1

    def choose_victims(self, state: PoolState, need_bytes: int):
        start = len(self.pass_of) - len(state.future)        # the access being served now
        last = min(self.pass_of[start] + self.n, len(self.pass_end) - 1)
        window = set(state.future[i] for i in range(self.pass_end[last] - start))
        return _evict_in_order(state, need_bytes, sorted(state.residents, key=lambda r: (
            r.expert_id in window, state.probabilities.get(r.expert_id, 0.0), r.used_seq, r.expert_id)))


def pass_index(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(pass of each access in replay order, end position of each pass's accesses)."""
    per_pass: dict[int, int] = {}
    for p, _, ids, _ in trace.accesses():
        per_pass[p] = per_pass.get(p, 0) + len(ids)
    counts = np.array([per_pass[p] for p in sorted(per_pass)])
    return np.repeat(np.arange(len(counts)), counts), np.cumsum(counts)


def replayer(rep: Trace, size: float, popularity: dict, predictor=None):
    """(run(policy, quota='shared', popularity=...), LRU at its better quota) for `rep` at `size` of its experts."""
    experts = max(1, round(len(rep.layers) * rep.num_experts * size))

    def run(policy, quota="shared", popularity=popularity):
        return replay(rep, policy=policy, capacity=experts, expert_nbytes=1, quota=quota, popularity=popularity,
                      predictor=predictor)

    return run, min((run("lru", q) for q in ("shared", "per-layer")), key=lambda r: r.loads)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="example: python bench/moe_lookahead.py --size 0.25")
    ap.add_argument("--trace", default="var/llm/trained-40x32.trace",
                    help="the trained model's trace (made by `coe-agent llm bench --part a`)")
    ap.add_argument("--size", type=float, default=0.25, help="pool size as a share of all experts")
    args = ap.parse_args(argv)
    path = Path(args.trace)
    if not path.is_file():
        sys.exit(f"{path}: no trace; `coe-agent llm bench --part a` makes it")
    profile, rep = split_trace(Trace.load(path))
    experts = max(1, round(len(rep.layers) * rep.num_experts * args.size))
    pass_of, pass_end = pass_index(rep)
    run, lru = replayer(rep, args.size, profile.popularity(), TokenPredictor.train(profile))
    rows = [("lru (best quota: " + lru.quota + ")", lru)]
    rows += [(name, run(name)) for name in ("probability", "gate-score")]
    rows += [("predicted, next-token q alone", run("predicted", popularity=None)),   # no popularity: q alone
             ("predicted, q + popularity", run("predicted"))]
    rows += [(f"oracle: lookahead-{n}", run(Lookahead(n, pass_of, pass_end))) for n in (1, 2, 4)]
    rows.append(("oracle: belady", run("belady")))
    print(f"trained trace, {rep.tokens} tokens replayed, pool {experts} of {len(rep.layers) * rep.num_experts} "
          f"experts ({args.size:.1%}), shared quota unless stated (simulation on real pools)")
    print(f"{'policy':34} {'hit rate':>9} {'misses':>7} {'x LRU':>7}")
    for name, r in rows:
        print(f"{name:34} {r.hit_rate:>9.1%} {r.loads:>7} {r.loads / lru.loads:>7.3f}")
    mix = mixtral_rows(args.size)
    print(f"mixtral-popularity trace (independent requests), {args.size:.1%}, shared quota unless stated")
    mlru = mix[0][1]
    for name, r in mix:
        print(f"{name:38} {r.hit_rate:>9.1%} {r.loads:>7} {r.loads / mlru.loads:>7.3f}")
    print(json.dumps({"bench": "moe_lookahead", "size": args.size, "experts": experts,
                      "rows": [{"policy": n, "hit_rate": round(r.hit_rate, 4), "misses": r.loads,
                                "x_lru": round(r.loads / lru.loads, 3)} for n, r in rows],
                      "mixtral": [{"policy": n, "hit_rate": round(r.hit_rate, 4), "misses": r.loads,
                                   "x_lru": round(r.loads / mlru.loads, 3)} for n, r in mix]}))


def mixtral_rows(size: float) -> list[tuple[str, object]]:
    """The Mixtral trace's LRU (best quota), lfu, probability (from the profile subject), A0 and Belady."""
    from edge_agent.llm_bench import mixtral_data_dir, mixtral_traces

    prof, rep = mixtral_traces(mixtral_data_dir())
    run, lru = replayer(rep, size, prof.popularity())
    return [("lru (best quota: " + lru.quota + ")", lru), ("lfu", run("lfu")), ("probability", run("probability")),
            ("oracle: A0, the trace's own marginals", run("probability", popularity=rep.popularity())),
            ("oracle: belady", run("belady"))]


if __name__ == "__main__":
    main()
