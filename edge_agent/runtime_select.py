"""The line's `runtime` key: which experts run on ONNX Runtime, and the twins that serve them.

`torch` (the default) changes nothing.  `onnx` serves every torchvision and
ultralytics expert through its ONNX twin (`executors.onnx_twins`).  `auto`
decides per architecture and input size, from measurements of this box
(`executors.runtime_probe.measure_arch`: both runtimes side by side at
batches 1, 8 and 16, same threads), taken once and kept in
`{data_dir}/runtimes.json`; they are taken again when the thread count
changes.  The measurement runs on the CPU: on a box with GPU executors it
is the CPU's verdict, and the log says so.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coe import CoEError, CoEModel, Expert
from coe.files import write_json_atomic
from executors.onnx_twins import EXPORTABLE

log = logging.getLogger(__name__)

RUNTIMES_FILE = "runtimes.json"


def runtime_key(expert: Expert) -> str:
    """What a measurement holds for: the architecture at its input size."""
    return f"{expert.arch}@{expert.input_size}"


def onnx_experts(model: CoEModel, runtime: str, choices: Mapping[str, str]) -> list[str]:
    """The ids of the experts to serve on ONNX Runtime (pure: `choices` maps runtime_key to 'onnx'|'torch')."""
    if runtime == "torch":
        return []
    exportable = [e for e in model.experts.values() if e.family in EXPORTABLE]
    if runtime == "onnx":
        return [e.id for e in exportable]
    if runtime != "auto":
        raise ValueError(f"runtime must be torch, onnx or auto, got {runtime!r}")
    return [e.id for e in exportable if choices.get(runtime_key(e)) == "onnx"]


def measured_choices(path: Path, experts: Iterable[Expert], *, threads: int,
                     measure: Callable[[Expert], dict] | None = None,
                     progress: Callable[[str], None] | None = None, max_batch: int | None = None) -> dict[str, str]:
    """runtime_key -> 'onnx'|'torch' for `experts`, measuring the keys `path` does not hold for `threads`.

    With `max_batch`, the choice weighs only the measured batch sizes the line can run (up to it; batch 1
    always): ONNX Runtime 3x faster at batch 1 and slower at 16 is the right runtime for a line of batch 1.

    The file is written after each arch, so a start that stops half-way keeps what it measured.  An arch whose
    measurement fails stays on torch (the runtime that needs no export) with the reason, logged and kept in the
    file, so it neither fails the agent's start nor is measured again at every start (delete the file to
    retry)."""
    if measure is None:
        from executors.runtime_probe import measure_arch

        def measure(e: Expert) -> dict:
            return measure_arch(e, switches=False)
    kept: dict = {}
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or not isinstance(doc.get("archs", {}), dict):
                raise ValueError("expected {'threads': N, 'archs': {...}}")
        except (OSError, ValueError) as exc:
            raise CoEError(f"{path}: unreadable runtime measurements ({exc}); delete it to measure again") from None
        if doc.get("threads") == threads:
            kept = doc.get("archs", {})
    firsts: dict[str, Expert] = {}
    for e in experts:
        firsts.setdefault(runtime_key(e), e)
    todo = [k for k in firsts if not isinstance(kept.get(k), dict) or kept[k].get("auto") not in ("onnx", "torch")]
    for key in todo:
        if progress is not None:
            progress(key)
        try:
            kept[key] = measure(firsts[key])
        except Exception as exc:  # noqa: BLE001 - one arch that cannot be measured must not stop the line
            why = f"{type(exc).__name__}: {exc}"
            log.warning("runtime auto: measuring %s failed (%s); it stays on torch (delete %s to measure again)",
                        key, why, path)
            kept[key] = {"auto": "torch", "error": why}
        write_json_atomic(path, {"threads": threads, "archs": kept})
    return {k: _choice(kept[k], max_batch) for k in firsts}


def _choice(row: dict, max_batch: int | None) -> str:
    """The row's `auto`, or the choice over the batch sizes up to `max_batch` it has latencies for."""
    from executors.runtime_choice import choose_runtime
    from executors.runtime_probe import BATCHES

    if max_batch is None:
        return row["auto"]
    sizes = [n for n in BATCHES if n <= max_batch or n == 1]
    try:
        return choose_runtime({n: (float(row[f"torch_ms_b{n}"]), float(row[f"onnx_ms_b{n}"])) for n in sizes})
    except (KeyError, TypeError, ValueError):
        return row["auto"]               # a row without per-batch latencies: its overall choice


@dataclass
class RuntimePlan:
    """What the line serves on which runtime, and why some experts stayed on torch."""

    runtime: str
    onnx: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    choices: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        if self.runtime == "torch":
            return "runtime torch"
        on = f"{len(self.onnx)} expert(s) on ONNX Runtime"
        if self.choices:
            on += " (" + ", ".join(f"{k} {v}" for k, v in sorted(self.choices.items())) + ")"
        return f"runtime {self.runtime}: {on}" + (f"; {len(self.refused)} kept on torch" if self.refused else "")


def apply_runtime(runtime: str, model: CoEModel, store, data_dir: str | Path, *, threads: int | None = None,
                  gpu: bool = False, measure: Callable[[Expert], dict] | None = None, max_batch: int | None = None):
    """(model, store, RuntimePlan): `model` and `store` as the agent serves them under `runtime`.

    `threads`: what the executors will compute with; `auto` measures with exactly that many.
    """
    plan = RuntimePlan(runtime)
    if runtime == "torch":
        return model, store, plan
    if runtime == "auto":
        import torch

        if gpu:
            log.warning("runtime auto: measured on this box's CPU; GPU executors follow the CPU's choice")
        threads = threads or torch.get_num_threads()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)      # onnxruntime's intra-op pool is set to match in the probe
        try:
            plan.choices = measured_choices(Path(data_dir) / RUNTIMES_FILE,
                                            [e for e in model.experts.values() if e.family in EXPORTABLE],
                                            threads=threads, measure=measure, max_batch=max_batch,
                                            progress=lambda k: log.info("runtime auto: measuring %s", k))
        finally:
            torch.set_num_threads(before)
    wanted = onnx_experts(model, runtime, plan.choices)
    from executors.onnx_twins import serve_with_twins

    served, store, plan.refused = serve_with_twins(
        model, store, wanted, progress=lambda eid: log.info("runtime %s: exporting %s to ONNX", runtime, eid))
    plan.onnx = [eid for eid in wanted if eid not in plan.refused]
    return served, store, plan
