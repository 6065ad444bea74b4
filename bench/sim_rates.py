"""p99 latency of CoServe and chosen ablations at the same absolute arrival rates (simulation).

`coe-agent bench --load F` gives p99 at F x each system's own sustained rate;
this gives it side by side at the same rates (frames evenly spaced), so a
lever that raises the sustained rate is not judged at a higher rate.
Simulation on profiled costs (virtual clock), not a real run.

Usage:  python bench/sim_rates.py [--systems coserve,-readahead,-fill] [--rates 8.6,10,11.5,11.9] [--plot PNG]
Prints a table and one JSON line.
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
from edge_agent.bench import GPU_CLASS, build_system, latency_chart, make_workload, simulate, task  # noqa: E402
from executors.profile import Profile  # noqa: E402


def rate_list(text: str) -> list[float]:
    """--rates: comma-separated frames/s, each positive and finite."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise SystemExit(f"--rates takes comma-separated frames/s like 8.6,10,11.5, got {text!r}") from None
    bad = [r for r in rates if not (math.isfinite(r) and r > 0)]
    if bad:
        raise SystemExit(f"--rates: each rate must be a positive, finite number of frames/s, got {bad[0]:g} "
                         f"in {text!r}")
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="coserve,-readahead,-fill")
    ap.add_argument("--rates", default="8.6,10,11.5,11.9", help="frames/s, comma separated")
    ap.add_argument("-w", "--workload", default="A1,A2,B1,B2")
    ap.add_argument("--profile", default=str(GPU_CLASS))
    ap.add_argument("--plot", metavar="PNG", help="also draw p99 against the rate, a panel per task, to this PNG")
    args = ap.parse_args()
    rates = rate_list(args.rates)
    tasks, systems = args.workload.split(","), args.systems.split(",")
    try:                  # every name checked before the first (slow) run
        prof = Profile.load(args.profile)
        resources = {s: build_system(s, prof).resources() for s in systems}
        for t in tasks:
            task(t)
    except (OSError, ValueError, KeyError, CoEError) as exc:
        raise SystemExit(f"sim_rates: {exc}") from None
    out: dict = {}
    print(f"{'rate':>6}  " + "  ".join(f"{s + ' p99 s, ' + '/'.join(tasks):>32}" for s in systems))
    for rate in rates:
        cells = []
        for s in systems:
            system = build_system(s, prof)
            p99 = [simulate(make_workload(replace(task(t), interval=1.0 / rate)), prof, system).p99_ms / 1e3
                   for t in tasks]
            out.setdefault(s, {})[str(rate)] = dict(zip(tasks, (round(p, 3) for p in p99)))
            cells.append(" / ".join(f"{p:.2f}" for p in p99))
        print(f"{rate:6.1f}  " + "  ".join(f"{c:>32}" for c in cells), flush=True)
    if args.plot:
        import matplotlib.pyplot as plt

        fig = latency_chart({s: {float(r): v for r, v in by_rate.items()} for s, by_rate in out.items()},
                            f"p99 against the arrival rate, frames evenly spaced; simulation on {Path(args.profile).name}, "
                            "not a real run")
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
        print(f"chart: {args.plot}")
    print("resources (every system gets the same machine):")
    for s, r in resources.items():
        print(f"  {s:15} {r}")
    print(json.dumps({"bench": "sim_rates", "profile": args.profile, "p99_s": out, "resources": resources}))


if __name__ == "__main__":
    main()
