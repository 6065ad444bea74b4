"""Cache admission with the prompts' prefills computed: policies with and without it, real decode on this box.

`coe-agent llm bench --part b` shows the router its prompts' prefills but
computes only the decode steps, and there admission changes little: a decode
step asks for top-k experts per layer, and a miss that a value-ranked policy
would decline is rare.  A served model computes every prompt's prefill, which
asks for most experts of every layer and, without admission, sweeps the pool.
This bench decodes the retrained small model's replay prompts through the
2.2 GB generated model (`--part b`'s store) with their prefills computed: real
loads (page cache dropped, every miss read from the disk), real matmuls, pool
25% of the experts.  With admission a declined expert is computed over its
file's memory map, one at a time; the page cache holds it meanwhile, so one
expert of the memory is set aside for it and the pools get the rest.  Each
row runs in its own process, whose memory cgroup's peak (RSS and page cache
together) is reported, so the rows' memory can be compared.  LRU runs first
and last; ratios are against their mean.

Usage:  python bench/moe_admission.py [--work var/llm] [--decode-tokens 200]
Prints a table and one JSON line.  Needs `coe-agent llm bench --part b` to have run once (the store and trace).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = (("lru", False), ("predicted", False), ("predicted", True), ("gate-score", False), ("gate-score", True),
        ("lfu", False), ("lfu", True), ("lru", False))


def run_row(work: Path, policy: str, admission: bool, decode_tokens: int, share: float) -> dict:
    """Decode the replay prompts, prefills computed, with one policy; see the module docstring."""
    from coe.moe import MoELayout
    from edge_agent import llm_bench as lb
    from executors.moe_decode import remap, trace_decode
    from executors.moe_model import load_pooled
    from routing.moe_predictor import TokenPredictor
    from routing.moe_trace import Trace

    traces = sorted(work.glob("trained-*.trace"))
    store = work / "big"
    if not traces or not (store / "llm.json").is_file():
        sys.exit(f"{work}: no trained-*.trace or big/ store; run `coe-agent llm bench --work {work} --part b` first")
    profile, rep = lb.split_trace(Trace.load(traces[0]))
    layout = MoELayout.load(store)
    trace, profile = remap(lb.decode_only(rep, decode_tokens), layout.model), remap(profile, layout.model)
    predictor = TokenPredictor.train(profile) if policy == "predicted" else None
    memory = int(layout.expert_bytes * share)
    lb.drop_store(store)
    pm = load_pooled(store, memory=memory, policy=policy, popularity=profile.popularity(), drop_after_read=True,
                     predictor=predictor, admission=admission)
    r = trace_decode(pm, trace, prefill=True)
    pm.close()
    return {"policy": policy, "admission": admission, "tokens": r.tokens, "decode_tokens": int((trace.step > 0).sum()),
            "seconds": r.seconds, "tokens_per_second": r.tokens_per_second, "hit_rate": r.stats.hit_rate,
            "loads": r.stats.misses, "declined": r.stats.bypassed,
            "gib_read": (r.stats.bytes_in + r.stats.bypassed_bytes) / 2**30, "memory": memory,
            "expert_bytes": layout.expert_bytes, "line": r.stats.line()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="var/llm", help="coe-agent llm bench's --work directory")
    ap.add_argument("--decode-tokens", type=int, default=200)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--rows", default=None, help="rows to run, e.g. lru,predicted,predicted+admission,lru "
                    "(default: the table's eight)")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)     # POLICY or POLICY+admission: one child's row
    args = ap.parse_args()
    work = Path(args.work)
    from edge_agent.llm_bench import row_policy

    if args.row:
        print(json.dumps(run_row(work, *row_policy(args.row), args.decode_tokens, args.share)))
        return

    import subprocess

    from edge_agent.memory_cgroup import MemoryCgroup

    rows = []
    wanted = [row_policy(r) for r in args.rows.split(",")] if args.rows else ROWS
    for policy, admission in wanted:
        # each row in its own process, in a memory cgroup when the box has one: its peak counts RSS and page cache
        # together, so a load's pass through the page cache and a declined expert's mapped pages count alike
        cg = MemoryCgroup.create(f"coe-admission-{os.getpid()}", 64 << 30)
        try:
            out = subprocess.run([sys.executable, __file__, "--work", str(work), "--row",
                                  policy + ("+admission" if admission else ""), "--decode-tokens",
                                  str(args.decode_tokens), "--share", str(args.share)],
                                 capture_output=True, text=True, preexec_fn=cg.enter if cg else None)
            if out.returncode:
                sys.exit(f"row {policy}{' + admission' if admission else ''} failed:\n{out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["peak_bytes"] = cg.peak() if cg else None
        finally:
            if cg:
                cg.remove()
        print(f"  {policy}{' + admission' if admission else ''}: {row.pop('line')}", file=sys.stderr, flush=True)
        rows.append(row)
    lru = (rows[0]["tokens_per_second"] + rows[-1]["tokens_per_second"]) / 2
    r0 = rows[0]
    print(f"real run, this box: {r0['tokens']} tokens ({r0['decode_tokens']} decode, the rest their prompts' "
          f"prefills, computed), memory {r0['memory'] / 1e9:.2f} GB = {args.share:.0%} of "
          f"{r0['expert_bytes'] / 1e9:.2f} GB of experts, page cache dropped before each row and each expert file "
          f"dropped once read; each row in its own process; peak: its memory cgroup's (RSS and page cache"
          f"{'' if r0['peak_bytes'] is not None else ': no cgroup on this box, not measured'}); x LRU against the "
          f"mean of the first and last LRU rows ({lru:.2f} tokens/s)")
    print(f"{'policy':24} {'tokens/s':>9} {'x LRU':>6} {'hit rate':>9} {'loads':>6} {'declined':>9} {'GiB read':>9} "
          f"{'peak MB':>8}")
    for r in rows:
        name = r["policy"] + (" + admission" if r["admission"] else "")
        peak = f"{r['peak_bytes'] / 1e6:>8.0f}" if r["peak_bytes"] is not None else f"{'-':>8}"
        print(f"{name:24} {r['tokens_per_second']:>9.2f} {r['tokens_per_second'] / lru:>6.2f} {r['hit_rate']:>9.1%} "
              f"{r['loads']:>6} {r['declined']:>9} {r['gib_read']:>9.2f} {peak}")
    print(json.dumps({"bench": "moe_admission", "lru_baseline": lru, "rows": rows}))


if __name__ == "__main__":
    main()
