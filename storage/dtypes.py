"""The dtype an expert is stored in: fp32, fp16 or bf16, chosen once at import or zoo build.

Halving the bytes of an expert halves what every switch reads from SSD and
copies into a pool, so the importers can cast weights before they are written.
The manifest then records the stored dtype (`ManifestEntry.dtype`, the
dominant dtype of the tensors written), and executors compute in it.

Casting is checked: fp16 tops out at 65504, and a weight beyond it would be
stored as inf and silently corrupt every verdict the expert gives, so such a
cast is refused, naming the tensor.  bf16 has fp32's exponent range and cannot
overflow this way.  Torch is imported inside the functions, so parsing an
option costs nothing.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from coe import CoEError

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


def cast_floating(tensors: Mapping[str, "torch.Tensor"], dtype: str) -> dict[str, "torch.Tensor"]:
    """`tensors` with every floating-point tensor cast to `dtype`; the others are returned unchanged.

    Only floating tensors are cast: integer and bool buffers (BatchNorm's
    num_batches_tracked, index tables) are counts and masks, and casting them
    to a float type would change their meaning or lose exactness.  Raises
    CoEError naming the tensor when a cast to fp16 would turn a finite value
    into inf (its magnitude exceeds 65504).
    """
    import torch

    target = getattr(torch, parse_dtype(dtype, where="dtype"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if str(t.dtype).removeprefix("torch.") not in FLOATING_DTYPES or t.dtype == target:
            out[name] = t
            continue
        cast = t.to(target)
        if target == torch.float16:
            _check_no_overflow(name, t, cast)
        out[name] = cast
    return out


def _check_no_overflow(name: str, src: "torch.Tensor", cast: "torch.Tensor") -> None:
    import torch

    overflow = torch.isinf(cast) & torch.isfinite(src)
    if bool(overflow.any()):
        biggest = float(src[overflow].abs().max())
        raise CoEError(f"tensor '{name}': {int(overflow.sum())} value(s) overflow fp16 (max |value| {biggest:.6g} "
                       f"> {torch.finfo(torch.float16).max:.0f}) and would be stored as inf; "
                       "store it as bf16 or fp32 instead")
