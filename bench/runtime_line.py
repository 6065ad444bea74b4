"""The line A demo served with `runtime: torch` against `runtime: auto` and `runtime: onnx` (issue #13).

Real run.  The demo's trained zoo and recording (run `coe-agent demo --line A`
first) are replayed through a real agent, as fast as acked, once per runtime
per round, the runtimes alternating so the machine's noise falls on each
alike.  Every run gets the same line config (the same executor, memory,
scheduler and recording); only `runtime` differs.  `auto` measures both
runtimes per architecture once (kept in {data_dir}/runtimes.json) and exports
the ONNX twins once (kept in the store's .onnx): both happen before the
agent serves, so they are outside the timed replay, and are reported apart.

Usage:  python bench/runtime_line.py [--rounds 3] [--runtimes torch,auto,onnx]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coe import load_spec  # noqa: E402
from edge_agent.config import find_config, load_config  # noqa: E402
from edge_agent.demo import ensure_recording, run_demo  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runtimes", default="torch,auto,onnx")
    ap.add_argument("--frames", type=int, default=600)
    a = ap.parse_args()
    runtimes = [r.strip() for r in a.runtimes.split(",") if r.strip()]
    cfg = load_config(find_config("A"))
    model = load_spec(cfg.spec_path)
    rec = ensure_recording(cfg, model, a.frames, 0, quiet=True)
    fps: dict[str, list[float]] = {r: [] for r in runtimes}
    acc: dict[str, float] = {}
    first_start: dict[str, float] = {}
    for rnd in range(a.rounds):
        for rt in runtimes:
            t0 = time.perf_counter()
            res = run_demo(cfg.model_copy(update={"runtime": rt}), model, recording=rec, quiet=True, train=False)
            wall = time.perf_counter() - t0
            s = res.summary
            if not res.ok:
                print(f"runtime {rt}: the run lost frames: {s}", file=sys.stderr)
                return 1
            fps[rt].append(s["throughput_fps"])
            acc[rt] = s.get("accuracy", float("nan"))
            if rnd == 0:
                first_start[rt] = round(wall - s["seconds"], 1)
            print(f"  round {rnd + 1} {rt:6} {s['throughput_fps']:7.1f} frames/s", file=sys.stderr)
    runtimes_json = Path(cfg.data_dir) / "runtimes.json"
    choices = json.loads(runtimes_json.read_text())["archs"] if runtimes_json.is_file() else {}
    ex = cfg.executors[0]
    print(f"runtime_line: real run, {os.cpu_count()} CPU cores; line A demo zoo, {a.frames}-frame recording, "
          f"executor {ex.device} {ex.memory / 1e6:.0f} MB, scheduler {cfg.scheduler.policy}; median of {a.rounds} "
          f"alternating rounds")
    base = statistics.median(fps[runtimes[0]])
    print(f"{'runtime':8} {'frames/s':>9} {'vs ' + runtimes[0]:>9} {'accuracy':>9} {'first start s':>14}")
    for rt in runtimes:
        m = statistics.median(fps[rt])
        print(f"{rt:8} {m:9.1f} {m / base:8.2f}x {100 * acc[rt]:8.1f}% {first_start[rt]:14.1f}")
    if choices:
        print("auto chose: " + ", ".join(f"{k} {v['auto']}" for k, v in sorted(choices.items())))
    print(json.dumps({"bench": "runtime_line", "real_run": True, "cores": os.cpu_count(), "rounds": a.rounds,
                      "fps": fps, "median_fps": {r: statistics.median(v) for r, v in fps.items()},
                      "accuracy": acc, "first_start_s": first_start,
                      "auto": {k: v["auto"] for k, v in choices.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
