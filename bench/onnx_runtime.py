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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from coe import load_spec  # noqa: E402
from edge_agent.config import find_config, load_config  # noqa: E402
from edge_agent.onnx_cli import max_output_difference  # noqa: E402
from executors.backends import get_backend  # noqa: E402
from executors.onnx_export import export_onnx, onnx_expert, onnx_tensors  # noqa: E402
from executors.runtime_choice import choose_runtime  # noqa: E402
from storage.flat import FlatWeights, Layout, TensorSpec  # noqa: E402

BATCHES = (1, 8, 16)


def flat_of(tensors: dict) -> FlatWeights:
    """The tensors as one flat buffer, as a pool would hold them (for Skeletons.bind)."""
    specs, parts, pos = [], [], 0
    for name, t in tensors.items():
        pad = -pos % 64                                   # every view aligned, as a store's file keeps them
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
            pos += pad
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), pos, pos + raw.numel()))
        parts.append(raw)
        pos += raw.numel()
    return FlatWeights(Layout(tuple(specs), 0, pos), torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_arch(expert, repeats: int) -> dict:
    from executors.skeletons import Skeletons

    backend = get_backend(expert.arch)
    tensors = backend.init_weights(expert, 0)
    blob = export_onnx(expert, tensors)
    twin = onnx_expert(expert, expert.id + "-onnx")
    onnx_backend = get_backend("onnx")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (expert.input_size, expert.input_size, 3), dtype=np.uint8) for _ in range(16)]
    module = backend.build(expert, tensors)
    session = onnx_backend.build(twin, onnx_tensors(blob))
    row = {"arch": expert.arch, "kind": expert.kind, "input": expert.input_size, "mb": round(len(blob) / 1e6, 1),
           "parity": max_output_difference(expert, tensors, blob, batch=8)}
    for n in BATCHES:
        t = median_ms(lambda: backend.run(module, expert, images[:n]), repeats)
        o = median_ms(lambda: onnx_backend.run(session, twin, images[:n]), repeats)
        row[f"torch_ms_b{n}"], row[f"onnx_ms_b{n}"] = round(t, 2), round(o, 2)
    # switch: two experts of the arch alternately bound (torch: re-point; onnx: a new session)
    other = backend.init_weights(expert, 1)
    flats = [flat_of(tensors), flat_of(other)]
    oflats = [flat_of(onnx_tensors(blob)), flat_of(onnx_tensors(export_onnx(expert, other)))]
    sk, osk = Skeletons("cpu"), Skeletons("cpu")
    sk.bind(expert, flats[0])
    i = [0]

    def switch_torch():
        i[0] ^= 1
        sk.bind(expert, flats[i[0]])

    def switch_onnx():
        i[0] ^= 1
        osk.bind(twin, oflats[i[0]])
    row["torch_switch_ms"] = round(median_ms(switch_torch, max(5, repeats // 3)), 2)
    row["onnx_switch_ms"] = round(median_ms(switch_onnx, max(5, repeats // 3)), 2)
    row["auto"] = choose_runtime({n: (row[f"torch_ms_b{n}"], row[f"onnx_ms_b{n}"]) for n in BATCHES})
    return row


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
        rows.append(bench_arch(expert, a.repeats))
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
