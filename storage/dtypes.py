"""The dtype an expert is stored in: fp32, fp16 or bf16, chosen once at import or zoo build.

Halving the bytes of an expert halves what every switch reads from SSD and
copies into a pool, so the importers can cast weights before they are written.
The manifest then records the stored dtype (`ManifestEntry.dtype`, the
dominant dtype of the tensors written), and executors compute in it.

Casting is checked: fp16 tops out at 65504, and a weight beyond it would be
stored as inf and silently corrupt every verdict the expert gives, so such a
cast is refused, naming the tensor.  bf16 has fp32's exponent range and cannot
overflow this way.  The other end of fp16's range is as dangerous: a tensor
whose values sit below fp16's smallest normal number (6.1e-5) loses them to
zero or to a few bits of subnormal precision.  The bias a demo classifier is
calibrated with can be 1e-10; flushed to zero it changes most verdicts.  Such
a tensor keeps its source dtype (a log line names it): an expert is then
mostly fp16 with a few small tensors in fp32, and the manifest records the
dominant dtype.  Torch is imported inside the functions, so parsing an
option costs nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from coe import CoEError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

STORED_DTYPES = ("fp32", "fp16", "bf16")
TORCH_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_ALIASES = {**TORCH_NAMES, "float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "half": "float16"}
FLOATING_DTYPES = ("float16", "bfloat16", "float32", "float64")   # torch names of what `cast_floating` casts


def parse_dtype(name: str, where: str = "--dtype") -> str:
    """The torch dtype name ('float32', 'float16', 'bfloat16') for `name` (fp32/fp16/bf16 or a torch name).

    `where` names the option or field in the error, so the operator knows what to fix.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in _ALIASES:
        raise CoEError(f"{where}: unknown stored dtype {name!r}; expected one of {', '.join(STORED_DTYPES)} "
                       f"(or {', '.join(sorted(set(_ALIASES) - set(STORED_DTYPES)))})")
    return _ALIASES[key]


def cast_floating(tensors: Mapping[str, "torch.Tensor"], dtype: str, *,
                  keep_underflow: bool = True) -> dict[str, "torch.Tensor"]:
    """`tensors` with every floating-point tensor cast to `dtype`; the others are returned unchanged.

    Only floating tensors are cast: integer and bool buffers (BatchNorm's
    num_batches_tracked, index tables) are counts and masks, and casting them
    to a float type would change their meaning or lose exactness.  Raises
    CoEError naming the tensor when a cast to fp16 would turn a finite value
    into inf (its magnitude exceeds 65504); keeps a tensor that fp16 would
    flush to zero (`fp16_underflows`) in its source dtype, or with
    `keep_underflow=False` (a store that must hold one dtype, like an LLM's
    `llm.json` layout) refuses it, naming the tensor.
    """
    import torch

    target = getattr(torch, parse_dtype(dtype, where="dtype"))
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, t in tensors.items():
        if str(t.dtype).removeprefix("torch.") not in FLOATING_DTYPES or t.dtype == target:
            out[name] = t
            continue
        cast = t.to(target)
        if target == torch.float16:
            _check_no_overflow(name, t, cast)
            if fp16_underflows(t, cast):
                if not keep_underflow:
                    raise CoEError(f"tensor '{name}': fp16 would flush its values to zero (max |value| "
                                   f"{float(t.abs().max()):.3g}, fp16's smallest normal is "
                                   f"{torch.finfo(torch.float16).tiny:.3g}); store it as bf16 or fp32 instead")
                kept.append(name)
                out[name] = t
                continue
        out[name] = cast
    if kept:
        log.warning("kept %d tensor(s) in their source dtype: fp16 would flush their values to zero or "
                    "subnormals (%s); CPU pools computing in fp32 use them as they are, but a GPU computing in "
                    "fp16 (gpu_compute_dtype: stored) flushes them: give it gpu_compute_dtype: float32, or "
                    "store this expert as bf16", len(kept), ", ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""))
    return out


UNDERFLOW_SHARE = 0.01


def fp16_underflows(src: "torch.Tensor", cast: "torch.Tensor") -> bool:
    """True when fp16 cannot hold `src`: all of it below the smallest normal, or over 1% of it flushed to zero.

    A weight matrix always has a few values near zero, and losing those
    costs nothing; losing a whole bias vector, or a share of a tensor's
    values, changes what the expert says.
    """
    import torch

    nonzero = src != 0
    n = int(nonzero.sum())
    if n == 0:
        return False
    if float(src.abs().max()) < torch.finfo(torch.float16).tiny:
        return True
    flushed = int((nonzero & (cast == 0)).sum())
    return flushed > UNDERFLOW_SHARE * n


def _check_no_overflow(name: str, src: "torch.Tensor", cast: "torch.Tensor") -> None:
    import torch

    overflow = torch.isinf(cast) & torch.isfinite(src)
    if bool(overflow.any()):
        biggest = float(src[overflow].abs().max())
        raise CoEError(f"tensor '{name}': {int(overflow.sum())} value(s) overflow fp16 (max |value| {biggest:.6g} "
                       f"> {torch.finfo(torch.float16).max:.0f}) and would be stored as inf; "
                       "store it as bf16 or fp32 instead")
