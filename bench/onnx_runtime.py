"""ONNX Runtime against torch on this CPU (issue #13): per arch, batches 1, 8 and 16, and the switch cost.

Real run.  For each architecture of the line A spec, one expert is generated
(the zoo's seeded init), exported with `coe-agent experts export-onnx`'s
exporter, and run side by side, alternating, on the same images:

  batch latency   torch (the executor's module) vs onnxruntime (CPU provider), median ms
  parity          max |torch - onnxruntime| over the raw outputs     target <= 1e-4
  switch          what a switch costs once the bytes are resident: torch re-points a
                  skeleton (Skeletons.bind), ONNX builds a session from the bytes
  auto            the runtime `choose_runtime` picks per arch: the faster at the
                  batch sizes the line runs (a tie goes to torch)

Both runtimes get the same threads (torch.get_num_threads(), onnxruntime's intra-op
pool set to match).  Usage:  python bench/onnx_runtime.py [--repeats 15] [--json-only]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from coe import load_spec  # noqa: E402
from edge_agent.config import find_config, load_config  # noqa: E402
from executors.runtime_probe import BATCHES, measure_arch  # noqa: E402

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json-only", action="store_true")
    a = ap.parse_args()
    say = (lambda *_: None) if a.json_only else print
    model = load_spec(load_config(find_config("A")).spec_path)
    seen, rows = set(), []
    for expert in model.experts.values():
        if expert.arch in seen:
            continue
        seen.add(expert.arch)
        rows.append(measure_arch(expert, a.repeats))
    threads = torch.get_num_threads()
    say(f"onnx_runtime: real run on {os.cpu_count()} CPU cores, torch {torch.__version__} and onnxruntime each "
        f"with {threads} intra-op threads; median ms per batch of the line A experts' own input size")
    say(f"{'arch':32} {'in':>4} {'MB':>5} " + " ".join(f"{'torch b' + str(n):>9} {'onnx b' + str(n):>9}"
                                                       for n in BATCHES)
        + f" {'sw torch':>8} {'sw onnx':>8} {'parity':>8}  auto")
    for r in rows:
        say(f"{r['arch']:32} {r['input']:4} {r['mb']:5.1f} "
            + " ".join(f"{r[f'torch_ms_b{n}']:9.2f} {r[f'onnx_ms_b{n}']:9.2f}" for n in BATCHES)
            + f" {r['torch_switch_ms']:8.2f} {r['onnx_switch_ms']:8.2f} {r['parity']:8.1e}  {r['auto']}")
    print(json.dumps({"bench": "onnx_runtime", "real_run": True, "cores": os.cpu_count(), "threads": threads,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
