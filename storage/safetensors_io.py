"""Read safetensors checkpoints a slice at a time, and write one a tensor at a time.

An MoE checkpoint can be larger than the box's memory, so importing it must
never hold more than one tensor slice.  `ShardReader` parses the header (JSON;
nothing is unpickled) and reads a whole tensor or one index along its first
dimension with `os.pread` into a fresh tensor: no memory map, so pages read
once do not linger in the process's resident set.  `StreamWriter` writes a
safetensors file whose header is known up front, then each tensor's bytes as
they come, hashing as it goes.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coe import CoEError

if TYPE_CHECKING:
    import torch

_TO_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_MAX_HEADER = 100 * 2**20
DATA_ALIGN = 64     # files written here start their data section on this boundary (`StreamWriter`)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str              # torch dtype name
    shape: tuple[int, ...]
    start: int              # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class ShardReader:
    """One safetensors file, read by tensor or by first-dimension slice."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        where = str(self.path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CoEError(f"{where}: cannot open checkpoint shard: {exc.strerror or exc}") from None
        try:
            size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, 8, 0)
            if len(head) < 8:
                raise CoEError(f"{where}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CoEError(f"{where}: corrupt safetensors header (claims {n} bytes, file has {size})")
            try:
                header = json.loads(os.pread(self._fd, n, 8).decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise CoEError(f"{where}: corrupt safetensors header: {exc}") from None
            if not isinstance(header, dict):
                raise CoEError(f"{where}: corrupt safetensors header: not a JSON object")
            self.metadata = header.pop("__metadata__", None) or {}
            base = 8 + n
            self.tensors: dict[str, TensorInfo] = {}
            for name, info in header.items():
                raw_dtype = info.get("dtype") if isinstance(info, dict) else None
                if isinstance(raw_dtype, str) and raw_dtype not in _TO_TORCH:
                    raise CoEError(f"{where}: tensor '{name}' is {raw_dtype}, which coe-edge does not read "
                                   f"(it reads {', '.join(sorted(_TO_TORCH))}); convert the checkpoint first")
                try:
                    dtype = _TO_TORCH[info["dtype"]]
                    shape, offsets = tuple(info["shape"]), tuple(info["data_offsets"])
                    if not all(type(d) is int for d in (*shape, *offsets)):   # 2.9, true, Infinity
                        raise ValueError("a shape or offset that is not an integer")
                    lo, hi = offsets
                except (KeyError, TypeError, ValueError):
                    raise CoEError(f"{where}: corrupt safetensors header entry for '{name}'") from None
                if any(d < 0 for d in shape) or lo < 0:
                    raise CoEError(f"{where}: corrupt safetensors header entry for '{name}': negative "
                                   f"{'shape ' + str(list(shape)) if any(d < 0 for d in shape) else 'offset'}")
                t = TensorInfo(name, dtype, shape, base + lo, base + hi)
                if hi < lo or t.end > size:
                    raise CoEError(f"{where}: tensor '{name}' runs past the end of the file (truncated?)")
                if t.nbytes != _numel(shape) * _itemsize(dtype):
                    raise CoEError(f"{where}: tensor '{name}' holds {t.nbytes} bytes, its shape {list(shape)} "
                                   f"of {dtype} needs {_numel(shape) * _itemsize(dtype)}")
                self.tensors[name] = t
            end = base
            for t in sorted(self.tensors.values(), key=lambda t: t.start):
                if t.start < end:
                    raise CoEError(f"{where}: tensor '{t.name}' overlaps the tensor before it (corrupt header)")
                end = t.end
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, name: str, index: int | None = None) -> "torch.Tensor":
        """Tensor `name`, or its `index`-th slice along dimension 0, read into a fresh CPU tensor."""
        import torch

        t = self.tensors[name]
        shape, start, nbytes = t.shape, t.start, t.nbytes
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise CoEError(f"{self.path}: tensor '{name}' of shape {list(shape)} has no slice {index}")
            nbytes //= shape[0]
            start += index * nbytes
            shape = shape[1:]
        out = torch.empty(nbytes, dtype=torch.uint8)
        mv = memoryview(out.numpy())
        got = 0
        while got < nbytes:
            n = os.preadv(self._fd, [mv[got:]], start + got)
            if n <= 0:
                raise CoEError(f"{self.path}: truncated while reading '{name}' ({got} of {nbytes} bytes)")
            got += n
        return out.view(getattr(torch, t.dtype)).view(shape) if nbytes else torch.empty(shape,
                                                                                          dtype=getattr(torch, t.dtype))


class StreamWriter:
    """Write a safetensors file tensor by tensor, in the order the header lists them.

    `specs` is [(name, dtype, shape)]; `write` must then be called with each
    tensor in that order.  `close` checks that every byte arrived, fsyncs and
    moves the file into place atomically; the sha256 covers the whole file, as
    the expert store's manifest does.
    """

    def __init__(self, path: str | os.PathLike, specs: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, *, sync: bool = True) -> None:
        self.path = Path(path)
        header: dict = {}
        if metadata:
            header["__metadata__"] = metadata
        off = 0
        self._order = []
        for name, dtype, shape in specs:
            n = _numel(shape) * _itemsize(dtype)
            header[name] = {"dtype": _FROM_TORCH[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            self._order.append((name, n))
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        # the data section starts on a 64-byte boundary: mapped (computed in place, `ExpertStore.map_flat`), each
        # tensor then sits at the alignment it has in a pool's buffer, and CPU kernels round the same there
        raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)
        self.nbytes = off
        self._sync = sync           # False: the caller fsyncs the file when it installs it (the expert store)
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self._fh = open(self._tmp, "wb")
        except OSError as exc:         # a missing or read-only directory: name the file, as `_put` does
            raise CoEError(f"{self.path}: cannot write ({exc.strerror or exc})") from None
        self._hash = hashlib.sha256()
        try:
            self._put(struct.pack("<Q", len(raw)) + raw)
        except BaseException:     # no writer is returned: its temp file and descriptor go here
            self.abort()
            raise
        self._next = 0

    def _put(self, data) -> None:
        try:
            self._fh.write(data)
        except OSError as exc:         # a full disk, a file-size limit: name the file, not just the errno
            raise CoEError(f"{self.path}: cannot write ({exc.strerror or exc}; is the disk full?)") from None
        self._hash.update(data)

    def write(self, name: str, tensor: "torch.Tensor") -> None:
        want, n = self._order[self._next]
        if name != want:
            raise CoEError(f"{self.path}: tensor '{name}' written out of order (expected '{want}')")
        data = tensor.detach().to("cpu").contiguous().view(-1).view(_u8()).numpy()
        if data.nbytes != n:
            raise CoEError(f"{self.path}: tensor '{name}' has {data.nbytes} bytes, the header says {n}")
        self._put(memoryview(data))
        self._next += 1

    def close(self) -> str:
        """Finish the file; returns its sha256."""
        try:
            if self._next != len(self._order):
                raise CoEError(f"{self.path}: {len(self._order) - self._next} tensors were never written")
            try:
                self._fh.flush()
                if self._sync:
                    os.fsync(self._fh.fileno())
                self._fh.close()
                os.replace(self._tmp, self.path)
            except OSError as exc:
                raise CoEError(f"{self.path}: cannot write ({exc.strerror or exc}; is the disk full?)") from None
        except BaseException:
            self.abort()
            raise
        return self._hash.hexdigest()

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self._tmp.unlink(missing_ok=True)


def torch_dtype_name(safetensors_dtype: str) -> str:
    return _TO_TORCH[safetensors_dtype]


def _u8():
    import torch

    return torch.uint8


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}[dtype]
