"""Trace-driven real decode at batch B: the baseline policies against eviction + substitution, side by side.

The importance paper's headline (a 48% cut in decode latency against the best
baseline system) is at batch 3; `coe-agent llm bench --part d` decodes at
batch 1.  This bench groups the trained model's held-out prompts B at a time
(`edge_agent.llm_bench.batch_prompts`: each decode pass holds one token of
each of B prompts, each with its own routing from the trace) and decodes them
through the big generated model's pools as (d) does: real loads from SSD
(page cache dropped after each read), real expert matmuls, a pool of 25% of
the experts.  Real run, not a simulation.

Rows: `POLICY` or `POLICY:ALPHA` (substitution at ALPHA).  The baselines stand
for the systems the paper compares with: LRU (mixtral-offloading, llama.cpp),
LFU seeded by prefill counts (SMoE's Fixed-N, MoE-Infinity's frequency cache),
FIFO, popularity (`probability`).  `gate-score` is the paper's own eviction and
`predicted` ours, so they are not baselines.  Each substituting row's latency
cut is printed against the best baseline row and against the best row without
substitution.  LRU runs first and last; ratios are against the mean of the two.

Usage:  python bench/moe_batch_decode.py [--batch 3] [--work var/llm]
            [--rows lru,lfu,fifo,probability,gate-score,predicted,gate-score:0.3,predicted:0.3,predicted:0.5,
                    predicted:0.7,lru]
Needs var/llm/big and the trained model's trace (`coe-agent llm bench --part b` makes both; docs/llm.md).
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = "lru,lfu,fifo,probability,gate-score,predicted,gate-score:0.3,predicted:0.3,predicted:0.5,predicted:0.7,lru"
BASELINES = ("lru", "lfu", "fifo", "probability")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="var/llm", type=Path)
    ap.add_argument("--trace", default=None, type=Path, help="default: WORK/trained-40x32.trace")
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--rows", default=ROWS)
    args = ap.parse_args()

    import edge_agent.llm_bench as lb
    from coe.moe import MoELayout
    from executors.moe_decode import remap, trace_decode
    from executors.moe_model import load_pooled
    from routing.moe_predictor import TokenPredictor
    from routing.moe_trace import Trace

    store = args.work / "big"
    trace_path = args.trace or args.work / "trained-40x32.trace"
    for need in (store / "llm.json", trace_path):
        if not need.is_file():
            raise SystemExit(f"{need} is missing: run `coe-agent llm bench --work {args.work} --part b` first")
    layout = MoELayout.load(store)
    profile, replay = lb.split_trace(Trace.load(trace_path))
    profile = remap(profile, layout.model)
    trace = lb.batch_prompts(remap(replay, layout.model), args.batch)
    predictor, popularity = TokenPredictor.train(profile), profile.popularity()
    from executors.moe_threads import usable_cores

    speed = lb.store_read_speed(store, layout)
    pool_bytes = int(layout.expert_bytes * args.share)
    resources = (f"pool {pool_bytes / 1e9:.2f} GB ({args.share:.0%} of {layout.expert_bytes / 1e9:.2f} GB of experts) "
                 f"+ {layout.resident_nbytes / 1e6:.0f} MB resident, every row; CPU, {usable_cores()} cores; "
                 f"disk {speed / 1e9:.2f} GB/s cold")
    rows = []
    print(f"{'row':18} {'tokens/s':>9} {'hit rate':>9} {'GiB read':>9} {'x LRU':>6} {'substituted':>11}")
    for spec in args.rows.split(","):
        policy, _, alpha = spec.partition(":")
        lb.drop_store(store)
        pm = load_pooled(store, memory=int(layout.expert_bytes * args.share), policy=policy, drop_after_read=True,
                         predictor=predictor if policy == "predicted" else None,
                         popularity=popularity if policy in ("predicted", "probability") else None,
                         **({"alpha": float(alpha)} if alpha else {}))
        r = trace_decode(pm, trace, prefill=False)
        pm.close()
        rows.append({"row": spec, "policy": policy, "alpha": float(alpha) if alpha else 0.0, "tokens": r.tokens,
                     "tokens_per_second": r.tokens_per_second, "hit_rate": r.stats.hit_rate,
                     "gib_read": r.stats.bytes_in / 2**30, "substituted": pm.tap.substituted})
    base = lb.lru_baseline(rows)
    for r in rows:
        r["x_lru"] = r["tokens_per_second"] / base
        print(f"{r['row']:18} {r['tokens_per_second']:>9.2f} {r['hit_rate']:>9.1%} {r['gib_read']:>9.2f} "
              f"{r['x_lru']:>6.2f} {r['substituted']:>11}")
    plain = [r for r in rows if not r["alpha"]]
    best_base = max((r for r in plain if r["policy"] in BASELINES), key=lambda r: r["tokens_per_second"], default=None)
    best_plain = max(plain, key=lambda r: r["tokens_per_second"], default=None)
    cuts = []
    for r in rows:
        if not r["alpha"]:
            continue
        cut = {"row": r["row"]}
        for name, ref in (("best_baseline", best_base), ("best_without_substitution", best_plain)):
            if ref is not None:
                cut[f"vs_{name}"] = 1 - ref["tokens_per_second"] / r["tokens_per_second"]
                cut[name] = ref["row"]
        cuts.append(cut)
        print(f"    decode latency of {r['row']}: "
              + ", ".join(f"{-cut['vs_' + n]:+.1%} against {cut[n]} (the best {label})"
                          for n, label in (("best_baseline", "baseline"),
                                           ("best_without_substitution", "row without substitution"))
                          if n in cut))
    passes = sum(1 for _, step, _ in trace.passes() if step > 0)
    print(f"batch {args.batch}: {passes} decode passes of {args.batch} prompts ({rows[0]['tokens']} tokens); "
          f"model {store}; {resources}; real run on this machine")
    print(json.dumps({"bench": "moe_batch_decode", "batch": args.batch, "share": args.share,
                      "expert_gib": layout.expert_bytes / 2**30, "resources": resources, "disk_bytes_per_s": speed,
                      "lru_baseline": base, "rows": rows, "latency_cuts": cuts}))


if __name__ == "__main__":
    main()
