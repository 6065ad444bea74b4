"""Token-wise prefetch at several confidence gates, against the same settings without it (real runs).

Issue 11 asks prefetch for >= 1.1x the same policy without it.  `llm bench --part d` measures one gate
(p >= 0.5, the break-even when a wrong guess costs what a right one saves).  This runs the best row's
settings (`predicted` eviction, alpha 0.3) without prefetch and with the prefetch at each gate, in that
order, `--repeats` times interleaved, forward then backward (ABBA), so a drift over the run favours no gate.  Same workload as (d): the
generated model in WORK/big (made by `llm bench --part b` or `d`), routing from the trained model's trace,
200 decode tokens, pool at 25%, page cache dropped after every read.

Usage:  python bench/moe_prefetch_gates.py [--work var/llm] [--gates 0.5,0.7,0.8] [--repeats 2]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_agent import llm_bench as lb  # noqa: E402
from routing.moe_trace import Trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="var/llm", help="llm bench's work dir (big/ and trained-40x32.trace)")
    ap.add_argument("--gates", default="0.5,0.7,0.8", help="comma-separated minimum probabilities of a guess")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200, help="decode tokens replayed per row")
    args = ap.parse_args()
    work = Path(args.work)
    store, trace_path = work / "big", work / "trained-40x32.trace"
    for need in (store / "llm.json", trace_path):
        if not need.is_file():
            sys.exit(f"{need} is missing: run `coe-agent llm bench --work {work} --part d` once first")
    try:
        gates = [float(g) for g in args.gates.split(",") if g.strip()]
    except ValueError:
        sys.exit(f"--gates {args.gates!r}: give comma-separated numbers between 0 and 1")
    if not gates or any(not 0 <= g <= 1 for g in gates):
        sys.exit(f"--gates {args.gates!r}: give comma-separated numbers between 0 and 1")
    names = ["no prefetch"] + [f"prefetch p >= {g}" for g in gates]
    rows = [("predicted", "no prefetch", {"alpha": 0.3})] + [
        ("predicted", f"prefetch p >= {g}", {"alpha": 0.3, "prefetch": "token", "prefetch_min_prob": g})
        for g in gates]
    profile, rep = lb.split_trace(Trace.load(trace_path))
    # ABBA...: forward, then backward, so a drift over the run favours neither the first gates nor the last
    order = [row for k in range(args.repeats) for row in (rows if k % 2 == 0 else rows[::-1])]
    out = lb.run_ablation(store, profile, lb.decode_only(rep, args.tokens), rows_to_run=tuple(order),
                          on_row=lambda r: print(f"  {r['row']}: {r['tokens_per_second']:.2f} tokens/s",
                                                 file=sys.stderr, flush=True))
    runs = {n: [r for r in out if r["row"] == n] for n in names}
    base = statistics.mean(r["tokens_per_second"] for r in runs["no prefetch"])
    print(f"best row's settings (predicted eviction, alpha 0.3), {args.tokens} decode tokens, pool 25%, page cache "
          f"dropped; real runs on this machine, {args.repeats} of each, interleaved")
    print(f"{'row':22} {'tokens/s (each run)':28} {'x no prefetch':>13} {'hit rate':>9} {'GiB read':>9} "
          f"{'precision':>9} {'recall':>7}")
    table = []
    for n in names:
        rs = runs[n]
        tps = [r["tokens_per_second"] for r in rs]
        row = {"row": n, "tokens_per_second": tps, "vs_no_prefetch": statistics.mean(tps) / base,
               "hit_rate": statistics.mean(r["hit_rate"] for r in rs),
               "gib_read": statistics.mean(r["gib_read"] for r in rs),
               "precision": statistics.mean(r.get("prefetch_precision", 0.0) for r in rs),
               "recall": statistics.mean(r.get("prefetch_recall", 0.0) for r in rs)}
        table.append(row)
        print(f"{n:22} {', '.join(f'{t:.2f}' for t in tps):28} {row['vs_no_prefetch']:>13.2f} "
              f"{row['hit_rate']:>9.1%} {row['gib_read']:>9.2f} {row['precision']:>9.2f} {row['recall']:>7.2f}")
    print(json.dumps({"bench": "moe_prefetch_gates", "repeats": args.repeats, "tokens": args.tokens, "rows": table}))


if __name__ == "__main__":
    main()
