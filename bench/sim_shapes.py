"""CoServe and chosen ablations on the four paper tasks and seven more board shapes (simulation).

Issue 9 asks the targets to hold on board shapes other than A and B.  For each
board this runs each system under a flood (a frame every 4 ms: the paper's
offline throughput and the efficiency against the valid lower bound), finds
the highest steady rate it sustains (`edge_agent.bench.sustained_rate`) and
measures p99 with frames arriving evenly at F x that rate.  Simulation on
profiled costs (virtual clock), not a real run.

Usage:  python bench/sim_shapes.py [--systems coserve,-readahead,-fill] [--profile P] [--load 0.8]
            [--boards 5,6] [--compression-ratio 0.831 --decode-rate 1.2e9]
Prints a table and one JSON line.  `--compression-ratio` runs every system on
a store compressed to that share of its bytes (`coe-agent bench --sim`'s
what-if: a load's transfer costs max(stored / disk, decoded / decode); the
CPU time decoding takes is not charged to the executors).  0.831 is what the
lossless codec measured on the paper tasks' fp32 vision experts.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coe import CoEError  # noqa: E402
from edge_agent.bench import (GPU_CLASS, build_system, make_workload, sim_compression, simulate,  # noqa: E402
                              sustained_rate, task, uniform_forms)
from executors.profile import Profile  # noqa: E402

# (task, overrides): the paper's four, then boards with more and fewer types, heavier and lighter skew,
# other detector shares and longer tasks
SHAPES = [("A1", {}), ("A2", {}), ("B1", {}), ("B2", {}),
          ("A2", dict(types=250, skew=1.0, requests=4000)),
          ("B2", dict(types=600, skew=0.9, detector_share=0.3, board_size=800, requests=4000)),
          ("A1", dict(skew=0.6, detector_share=0.6, requests=3000)),
          ("B1", dict(types=200, detector_share=0.8, requests=3000)),
          ("B1", dict(types=500, skew=0.5, requests=3500)),
          ("A1", dict(types=120, skew=1.2, detector_share=0.2, requests=5000)),
          ("B1", dict(types=500, skew=0.5, detector_share=0.8, requests=3500))]


def flags(wl: str, kw: dict) -> str:
    return " ".join([f"-w {wl}", *(f"--{k.replace('_', '-')} {v}" for k, v in kw.items())])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="coserve,-readahead,-fill")
    ap.add_argument("--profile", default=str(GPU_CLASS))
    ap.add_argument("--load", type=float, default=0.8, help="F: the share of the sustained rate for p99")
    ap.add_argument("--boards", help="which boards, by their 0-based place in the list (e.g. 5,6); default all")
    ap.add_argument("--compression-ratio", type=float, help="every expert stored at this share of its bytes")
    ap.add_argument("--decode-rate", type=float, help="with --compression-ratio: decoded bytes/s per decode thread")
    ap.add_argument("--decode-threads", type=int, default=2, help="with --compression-ratio: threads a load decodes with")
    args = ap.parse_args()
    if not (math.isfinite(args.load) and 0 < args.load <= 1):
        ap.error(f"--load must be in (0, 1] (a share of the sustained rate), got {args.load}")
    if (args.compression_ratio is None) != (args.decode_rate is None):
        ap.error("--compression-ratio and --decode-rate go together")
    if args.compression_ratio is not None and not 0 < args.compression_ratio <= 1:
        ap.error(f"--compression-ratio must be in (0, 1] (stored over plain bytes), got {args.compression_ratio}")
    if args.decode_threads < 1:
        ap.error(f"--decode-threads must be at least 1, got {args.decode_threads}")
    try:
        boards = [SHAPES[int(i)] for i in args.boards.split(",")] if args.boards else SHAPES
    except (ValueError, IndexError):
        ap.error(f"--boards takes places 0..{len(SHAPES) - 1}, comma-separated; got {args.boards!r}")
    systems = args.systems.split(",")
    try:                  # every name and figure checked before the first (slow) run
        prof = Profile.load(args.profile)
        comp = (sim_compression(prof, args.compression_ratio, args.decode_rate, args.decode_threads)
                if args.compression_ratio is not None else None)
        resources = {s: build_system(s, prof).resources() for s in systems}
    except (OSError, ValueError, KeyError, CoEError) as exc:
        raise SystemExit(f"sim_shapes: {exc}") from None
    if comp is not None:
        prof = comp.profile(prof)
    rows = []
    print(f"{'board':84} {'system':11} {'flood/s':>8} {'eff':>5} {'sust/s':>7} {'p99 s':>6}")
    for wl, kw in boards:
        spec = task(wl, **kw)
        stored = uniform_forms(make_workload(spec).model, comp.ratio) if comp is not None else None
        for s in systems:
            system = build_system(s, prof)
            flood = simulate(make_workload(spec), prof, system, stored=stored)
            rate = sustained_rate(spec, prof, system, flood.throughput, stored=stored)
            p99 = simulate(make_workload(replace(spec, interval=1.0 / (args.load * rate))), prof, system,
                           stored=stored).p99_ms / 1e3
            rows.append({"board": flags(wl, kw), "system": s, "flood": round(flood.throughput, 2),
                         "efficiency": round(flood.efficiency, 3), "sustained": round(rate, 2),
                         "p99_s": round(p99, 3)})
            print(f"{flags(wl, kw):84} {s:11} {flood.throughput:8.1f} {flood.efficiency:5.2f} {rate:7.1f} {p99:6.2f}",
                  flush=True)
    print("resources (every system gets the same machine):")
    for s, r in resources.items():
        print(f"  {s:11} {r}")
    print(json.dumps({"bench": "sim_shapes", "profile": args.profile, "load": args.load,
                      "compression_ratio": args.compression_ratio, "decode_rate": args.decode_rate, "rows": rows,
                      "resources": resources}))


if __name__ == "__main__":
    main()
