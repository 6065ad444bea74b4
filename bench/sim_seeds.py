"""Flood throughput and p99 at one steady rate, seed by seed (simulation, GPU-class profile).

A flood is chaotic: one decision changed early sends a whole run elsewhere, so
one seed's throughput can move 10-20% either way when a lever changes very
little.  This runs each system on each task for several seeds (`task(...,
seed=k)`: the same board shape, other frames) and prints each seed's flood
throughput and p99 with frames evenly spaced at `--rate`, and their means, to
judge a change by.  Simulation on profiled costs (virtual clock), not a real run.

Usage:  python bench/sim_seeds.py [-w A1,A2,B1,B2] [--systems coserve,-steal] [--seeds 0-3] [--rate 11.5]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coe import CoEError  # noqa: E402
from edge_agent.bench import GPU_CLASS, build_system, make_workload, simulate, task  # noqa: E402
from executors.profile import Profile  # noqa: E402


def seed_range(text: str) -> list[int]:
    """'0-3' -> [0, 1, 2, 3]; '0,5,7' -> [0, 5, 7]."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            seeds = list(range(lo, hi + 1))
        else:
            seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds takes 'FIRST-LAST' or a comma-separated list of integers, got {text!r}") from None
    if not seeds:
        raise SystemExit(f"--seeds {text!r} names no seed")
    return seeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-w", "--workload", default="A1,A2,B1,B2")
    ap.add_argument("--systems", default="coserve")
    ap.add_argument("--seeds", default="0-3", help="FIRST-LAST or a comma-separated list")
    ap.add_argument("--rate", type=float, default=11.5, help="frames/s for p99, evenly spaced")
    ap.add_argument("--profile", default=str(GPU_CLASS))
    args = ap.parse_args()
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise SystemExit(f"--rate must be a positive, finite number of frames/s, got {args.rate}")
    seeds = seed_range(args.seeds)
    try:                  # every name checked before the first (slow) run
        prof = Profile.load(args.profile)
        systems = {s: build_system(s, prof) for s in args.systems.split(",")}
        resources = {s: system.resources() for s, system in systems.items()}
        for wl in args.workload.split(","):
            task(wl)
    except (OSError, ValueError, KeyError, CoEError) as exc:
        raise SystemExit(f"sim_seeds: {exc}") from None
    out: dict = {}
    print(f"{'task':5} {'system':12} {'flood frames/s per seed':>40} {'mean':>6}  "
          f"{f'p99 s at {args.rate:g}/s per seed':>36} {'mean':>6}")
    for wl in args.workload.split(","):
        for s, system in systems.items():
            flood = [simulate(make_workload(task(wl, seed=k)), prof, system).throughput for k in seeds]
            p99 = [simulate(make_workload(replace(task(wl, seed=k), interval=1.0 / args.rate)), prof,
                            system).p99_ms / 1e3 for k in seeds]
            out.setdefault(wl, {})[s] = {"flood": [round(x, 2) for x in flood], "p99_s": [round(x, 3) for x in p99]}
            print(f"{wl:5} {s:12} {' '.join(f'{x:.1f}' for x in flood):>40} {statistics.mean(flood):6.1f}  "
                  f"{' '.join(f'{x:.2f}' for x in p99):>36} {statistics.mean(p99):6.2f}", flush=True)
    print("resources (every system gets the same machine):")
    for s, r in resources.items():
        print(f"  {s:12} {r}")
    print(json.dumps({"bench": "sim_seeds", "profile": args.profile, "seeds": seeds, "rate": args.rate,
                      "tasks": out, "resources": resources}))


if __name__ == "__main__":
    main()
