"""Measure torch against ONNX Runtime for one architecture on this box: what `auto` decides on.

For one expert of the architecture (seeded random weights: only the shapes
matter for speed), the torch module and its ONNX export run side by side,
alternating, on the same images at batches 1, 8 and 16, with the same
threads.  Also measured: the output difference (parity) and what a switch
costs once the bytes are resident (torch re-points a skeleton; ONNX builds a
session from the bytes).  `bench/onnx_runtime.py` prints these as a table;
the line agent, with `runtime: auto`, keeps them per architecture and input
size in `{data_dir}/runtimes.json` and runs each expert in the faster one
(`runtime_choice.choose_runtime`).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from coe import Expert

BATCHES = (1, 8, 16)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall milliseconds of `fn` over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def flat_of(tensors: dict):
    """The tensors as one flat buffer, as a pool would hold them (for Skeletons.bind)."""
    import torch

    from storage.flat import FlatWeights, Layout, TensorSpec

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


def measure_arch(expert: Expert, repeats: int = 15, *, switches: bool = True) -> dict:
    """One row: median ms per batch for both runtimes, parity, switch ms if asked, and the `auto` choice."""
    from .backends import get_backend
    from .onnx_export import export_onnx, max_output_difference, onnx_expert, onnx_tensors
    from .runtime_choice import choose_runtime

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
    if switches:
        row.update(_switch_ms(expert, twin, backend, tensors, blob, max(5, repeats // 3)))
    row["auto"] = choose_runtime({n: (row[f"torch_ms_b{n}"], row[f"onnx_ms_b{n}"]) for n in BATCHES})
    return row


def _switch_ms(expert: Expert, twin: Expert, backend, tensors: dict, blob: bytes, repeats: int) -> dict:
    """Two experts of the arch bound alternately: torch re-points a skeleton, ONNX builds a new session."""
    from .onnx_export import export_onnx, onnx_tensors
    from .skeletons import Skeletons

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
    return {"torch_switch_ms": round(median_ms(switch_torch, repeats), 2),
            "onnx_switch_ms": round(median_ms(switch_onnx, repeats), 2)}
