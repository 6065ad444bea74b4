"""Converting an expert's dtype while it loads, inside its flat buffer.

A store may hold experts in half precision (half the bytes per switch) while
a CPU executor computes in fp32, where half-precision kernels are slow or
missing.  Converting after the load would hold the expert twice; here the
bytes stream in piece by piece (a compressed chunk, or up to 1 MiB of a plain
file) through one small scratch buffer and are cast into their place in the
final buffer, so the only full-size allocation is the buffer the pool keeps.

Only floating tensors change dtype: integer buffers (BatchNorm's
num_batches_tracked) keep their meaning and their bytes.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .flat import Layout, TensorSpec

FLOATING = ("float16", "bfloat16", "float32", "float64")
_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_ALIGN = 64


def converted_layout(layout: Layout, dtype: str | None) -> Layout:
    """The layout of `layout` with every floating tensor in `dtype` (the same layout when nothing changes).

    Tensors start on 64-byte boundaries in a converted buffer, so every typed
    view is aligned whatever the mix of element sizes.
    """
    if dtype is None or all(s.dtype == dtype or s.dtype not in FLOATING for s in layout.specs):
        return layout
    if dtype not in FLOATING:
        raise ValueError(f"compute dtype must be one of {', '.join(FLOATING)}, got {dtype!r}")
    specs, pos = [], 0
    for s in layout.specs:
        pos = -(-pos // _ALIGN) * _ALIGN
        new = dtype if s.dtype in FLOATING else s.dtype
        n = (s.end - s.start) // _SIZE[s.dtype] * _SIZE[new] if s.dtype in FLOATING else s.end - s.start
        specs.append(replace(s, dtype=new, start=pos, end=pos + n))
        pos += n
    return Layout(tuple(specs), layout.data_offset, pos)


class Placer:
    """Casts decoded pieces of the stored data section into a converted buffer."""

    def __init__(self, stored: Layout, target: Layout, dest: "np.ndarray") -> None:
        import torch

        self._torch = torch
        self.stored, self.target = stored, target
        self._dest = torch.from_numpy(dest) if isinstance(dest, np.ndarray) else dest
        self._pairs: list[tuple[TensorSpec, TensorSpec]] = list(zip(stored.specs, target.specs))
        self._i = 0

    def place(self, start: int, end: int, piece: "np.ndarray") -> None:
        """Write stored bytes [start, end) into the target buffer, tensor by tensor, casting floats.

        Pieces arrive in order; one may span several tensors (a compressed
        chunk covers a run of same-dtype tensors).
        """
        torch = self._torch
        while start < end:
            while self._pairs[self._i][0].end <= start:
                self._i += 1
            src, dst = self._pairs[self._i]
            stop = min(end, src.end)
            a, b = start - src.start, stop - src.start
            raw = torch.from_numpy(piece[:stop - start])
            if src.dtype == dst.dtype:
                self._dest[dst.start + a:dst.start + b].copy_(raw)
            else:
                ws, wd = _SIZE[src.dtype], _SIZE[dst.dtype]
                out = self._dest[dst.start + a // ws * wd:dst.start + b // ws * wd].view(getattr(torch, dst.dtype))
                out.copy_(raw.view(getattr(torch, src.dtype)))
            piece = piece[stop - start:]
            start = stop


def pieces(layout: Layout, size: int = 1 << 20) -> list[tuple[int, int]]:
    """Byte ranges of the data section that never cross a tensor and hold whole elements."""
    out = []
    for s in layout.specs:
        width = _SIZE.get(s.dtype, 8)
        step = max(width, size // width * width)
        out += [(p, min(p + step, s.end)) for p in range(s.start, s.end, step)]
    return out


def only_widens(stored, target) -> bool:
    """Whether every tensor keeps or widens its element size from `stored` to `target` (what `cast_in_place`
    needs: a total that grows can still narrow one tensor, when the others' padding outweighs it)."""
    return all(_SIZE.get(t.dtype, 0) >= _SIZE.get(s.dtype, 0) for s, t in zip(stored.specs, target.specs))


def cast_in_place(stored: Layout, target: Layout, buf, offset: int, piece: int = 1 << 20) -> None:
    """Cast a stored data section sitting at `buf[offset:]` into `target`'s places from `buf[0]` on.

    Safe when no tensor narrows (`offset` = target size - stored size >= 0
    and every element is at least as wide in the target): the target bytes
    of anything up to element e end before the stored bytes of any later
    element begin, so casting front to back only ever overwrites bytes
    already cast.  Each piece is copied out through a small scratch buffer
    first, since its own target range may overlap its source.
    """
    import torch

    if offset < 0 or not only_widens(stored, target):
        raise ValueError("cast_in_place only widens")
    flat = buf if isinstance(buf, torch.Tensor) else torch.from_numpy(buf)
    scratch = torch.empty(piece, dtype=torch.uint8)
    placer = Placer(stored, target, flat)
    ends = {s.start: (s, t) for s, t in zip(stored.specs, target.specs)}
    spec = None
    for start, end in pieces(stored, piece):
        spec = ends.get(start, spec)
        src, dst = spec
        width = _SIZE.get(src.dtype, 1)
        target_end = dst.start + (end - src.start) // width * _SIZE.get(dst.dtype, 1)
        if target_end <= offset + start:        # the piece's target lies wholly before its source: cast direct
            placer.place(start, end, flat[offset + start:offset + end].numpy())
            continue
        bounce = scratch[:end - start]
        bounce.copy_(flat[offset + start:offset + end])
        placer.place(start, end, bounce.numpy())
