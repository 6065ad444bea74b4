"""Which runtime runs an architecture when the user asks for `auto`: a pure function of measured latencies.

Measured per batch size on this box (bench/onnx_runtime.py, or the
profiler): torch's median batch latency and ONNX Runtime's.  ONNX wins only
when it is faster over the batch sizes the line runs by more than `margin`;
a tie stays with torch, whose switches are cheaper (a re-point, not a
session build).
"""
from __future__ import annotations

from collections.abc import Mapping

RUNTIMES = ("torch", "onnx")


def choose_runtime(latencies: Mapping[int, tuple[float, float]], *, margin: float = 0.05) -> str:
    """'onnx' or 'torch' from {batch size: (torch seconds, onnx seconds)}; ValueError on no data."""
    if not latencies:
        raise ValueError("choose_runtime needs at least one measured batch size")
    torch_total = sum(t for t, _ in latencies.values())
    onnx_total = sum(o for _, o in latencies.values())
    if min(torch_total, onnx_total) <= 0:
        raise ValueError(f"latencies must be positive, got {dict(latencies)}")
    return "onnx" if onnx_total < (1 - margin) * torch_total else "torch"
