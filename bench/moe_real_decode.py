"""Real decode with real routing at a big model's size: eviction policies, with and without each prefetch.

`coe-agent llm bench` (b) and (d) drive a random-weights 2.2 GB model with
routing from the trained small model's trace, so the next-layer prefetch,
which guesses from real hidden states, cannot be a row there.  This bench
widens the trained model's experts to the big model's size
(`edge_agent.llm_models.inflated_model`: same routing and outputs, 34 MB
experts, 2.2 GB), imports it, and decodes held-out text that no trace saw,
token by token with teacher forcing (`executors.moe_quality.decode_quality`),
through a pool of 25% of the experts, every miss read from SSD (page cache
dropped).  The token-wise predictor and the popularity come from the first
half of the trained model's trace.  Real run, not a simulation.

Each row is one policy, with no prefetch, the next-layer prefetch (`nl`) or
the token-wise one (`tok`, guesses with p >= 0.5).  LRU runs first and last;
ratios are against the mean of the two, and each prefetch row also against
its policy without prefetch, side by side in one run.

Usage:  python bench/moe_real_decode.py [--work var/llm] [--tokens 200]
            [--rows lru,lru:nl,lru:tok,gate-score,gate-score:nl,gate-score:tok,predicted,predicted:nl,predicted:tok,lru]
Needs var/llm/trained-hf and its trace (`coe-agent llm make-model --trained`, `coe-agent llm trace`; see
docs/llm.md).  Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = "lru,lru:nl,lru:tok,gate-score,gate-score:nl,gate-score:tok,predicted,predicted:nl,predicted:tok,lru"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="var/llm", type=Path)
    ap.add_argument("--trace", default=None, type=Path, help="default: WORK/trained-40x32.trace")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--expert-mb", type=float, default=34.4, help="each widened expert's size (the big model's)")
    ap.add_argument("--rows", default=ROWS)
    args = ap.parse_args()

    import edge_agent.llm_bench as lb
    from coe.moe import MoELayout
    from edge_agent.llm_models import SPECIALS, inflated_model
    from executors.moe_decode import remap
    from executors.moe_model import load_pooled
    from executors.moe_quality import decode_quality
    from routing.moe_predictor import TokenPredictor
    from routing.moe_trace import Trace
    from storage.llm_import import import_checkpoint

    work = args.work
    hf, store = work / f"inflated-{args.expert_mb:g}mb-hf", work / f"inflated-{args.expert_mb:g}mb"
    made_file = store / "inflated.json"
    if not made_file.exists():
        print(f"widening {work / 'trained-hf'} to {args.expert_mb} MB experts -> {hf}", file=sys.stderr)
        made = inflated_model(work / "trained-hf", hf, expert_mb=args.expert_mb)
        print(f"  intermediate {made['from_intermediate']} -> {made['intermediate']}, "
              f"{made['expert_bytes'] / 2**30:.2f} GiB of experts, logits within {made['max_logit_diff']:.1e} "
              f"of the small model's", file=sys.stderr)
        import_checkpoint(hf, store)
        made_file.write_text(json.dumps(made))
    made = json.loads(made_file.read_text())
    layout = MoELayout.load(store)
    profile, _ = lb.split_trace(Trace.load(args.trace or work / "trained-40x32.trace"))
    profile = remap(profile, layout.model)
    predictor, popularity = TokenPredictor.train(profile), profile.popularity()
    # held-out text no trace saw: the stretch between the trace's first two prompts (as docs/llm.md's quality runs)
    offset = 160
    text = (work / "trained-hf" / "heldout.txt").read_bytes()[offset:offset + args.tokens]
    seq = [1] + [b + len(SPECIALS) for b in text]
    rows = []
    print(f"{'row':24} {'tokens/s':>9} {'hit rate':>9} {'GiB read':>9} {'x LRU':>6} {'x same, no pf':>13}  prefetch")
    for spec in args.rows.split(","):
        policy, _, mode = spec.partition(":")
        extra = {"nl": {"prefetch": "next-layer"}, "tok": {"prefetch": "token"}, "": {}}[mode]
        lb.drop_store(store)
        pm = load_pooled(store, memory=int(layout.expert_bytes * args.share), policy=policy, drop_after_read=True,
                         predictor=predictor if policy == "predicted" or mode == "tok" else None,
                         popularity=popularity if policy in ("predicted", "probability") else None, **extra)
        t0 = time.perf_counter()
        q = decode_quality(pm, [seq])
        seconds = time.perf_counter() - t0
        if pm.prefetcher is not None:
            pm.prefetcher.drain()       # a read still under way at the end counts in the bytes read
        st = pm.stats()
        row = {"row": spec, "policy": policy, "prefetch": mode or None, "tokens": q.tokens,
               "tokens_per_second": q.tokens / seconds, "hit_rate": st.hit_rate,
               "gib_read": st.bytes_in / 2**30, "nll": q.nll, "argmax": q.argmax}
        if pm.prefetcher is not None:
            s = pm.prefetcher.stats
            row.update(precision=s.precision, recall=s.recall, issued=s.issued, useful=s.useful, adopted=s.adopted,
                       paused=s.paused, stopped=s.yielded, dropped=s.dropped, stopped_ran=s.stopped_ran,
                       stopped_room=s.stopped_room, stopped_limit=s.stopped_limit)
        pm.close()
        rows.append(row)
    lrus = [r["tokens_per_second"] for r in rows if r["row"] == "lru"]
    base = sum(lrus) / len(lrus) if lrus else float("nan")
    plain = {r["policy"]: r["tokens_per_second"] for r in rows if not r["prefetch"] and r["policy"] != "lru"}
    plain["lru"] = base
    ref = rows[0]
    for r in rows:
        r["x_lru"] = r["tokens_per_second"] / base
        r["x_same_without_prefetch"] = (r["tokens_per_second"] / plain[r["policy"]]
                                        if r["prefetch"] and r["policy"] in plain else None)
        # bit-exact: the same predicted token and the same log-likelihood, to the last bit, in every row
        r["exact"] = r["argmax"] == ref["argmax"] and r["nll"] == ref["nll"]
    for r in rows:
        r.pop("argmax")
        pf = (f"precision {r['precision']:.2f} recall {r['recall']:.2f}; {r['useful']} of {r['issued']} read in "
              f"used ({r['adopted']} joined midway), {r['paused']} pauses, {r['stopped']} stopped (layer ran "
              f"without it {r['stopped_ran']}, room wanted {r['stopped_room']}, paused too long "
              f"{r['stopped_limit']}), {r['dropped']} dropped"
              if r["prefetch"] else "")
        same = f"{r['x_same_without_prefetch']:.2f}" if r["x_same_without_prefetch"] is not None else ""
        print(f"{r['row']:24} {r['tokens_per_second']:>9.2f} {r['hit_rate']:>9.1%} {r['gib_read']:>9.2f} "
              f"{r['x_lru']:>6.2f} {same:>13}  {pf}")
    if not all(r["exact"] for r in rows):
        raise SystemExit("a row computed something else: prefetch and eviction must leave the logits exact")
    print(f"model {store} ({layout.expert_bytes / 2**30:.2f} GiB of experts: the trained model's intermediate "
          f"{made['from_intermediate']} widened to {made['intermediate']}), pool {args.share:.0%}, "
          f"{rows[0]['tokens']} tokens of held-out text from byte {offset}, teacher-forced; every row bit-exact; "
          f"real run on this machine")
    print(json.dumps({"bench": "moe_real_decode", "store": str(store), "expert_mb": args.expert_mb,
                      "intermediate": made["intermediate"], "max_logit_diff_vs_small": made["max_logit_diff"],
                      "text_offset": offset, "share": args.share, "rows": rows}))


if __name__ == "__main__":
    main()
