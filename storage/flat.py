"""Experts as one flat byte buffer: the unit every tier stores and moves.

A safetensors file is an 8-byte header length, a JSON header, then the tensor
bytes back to back.  Reading the data section straight into one buffer with
`readinto` is a plain sequential read (the fastest a cold load can be), and
moving an expert between tiers is then one copy of one buffer (one DMA on a
GPU).  The tensors are views into the buffer, so nothing is copied twice.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import mmap
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coe import ExpertLoadError

from .pinned import host_empty
from .safetensors_io import _itemsize, _numel

if TYPE_CHECKING:
    import torch

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
STORED_DTYPES = frozenset(_DTYPES.values())   # the torch dtypes an expert file may hold (what reads parse)
_MAX_HEADER = 100 * 2**20
_CHUNK = 16 * 2**20
_YIELD_CHUNK = 2 * 2**20        # a read that may yield checks this often (about a millisecond of disk)
_HASH_CHUNK = 1 * 2**20         # a read that is hashed hands the hasher pieces this size (see `_HashBehind`)


class ReadYielded(Exception):
    """A read that may yield (a prefetch) stopped because more urgent reads wanted the disk."""


_yielding = threading.local()


@contextlib.contextmanager
def yield_to(urgent: Callable[[], bool], *, pause: Callable[[], bool] | None = None,
             wait: Callable[[float], object] | None = None):
    """Reads on this thread stop with `ReadYielded` (before they start, and between chunks) while `urgent()`.

    A prefetch reads under it, so it never holds the disk while a load that
    a layer waits for is queued behind it: at most one small chunk.

    With `pause`, a read that `pause()` says must wait stops between chunks
    without giving up: it keeps what it has read and its place, calls
    `wait(PAUSE_POLL_SECONDS)` (which returns early when the disk is free, or
    sleeps), and goes on when `pause()` is false, unless `urgent()` has become
    true meanwhile.  A prefetch whose guess may still be of use pauses for a
    layer's read instead of throwing its partial read away and starting over.
    """
    before = getattr(_yielding, "urgent", None), getattr(_yielding, "pause", None), getattr(_yielding, "wait", None)
    _yielding.urgent, _yielding.pause, _yielding.wait = urgent, pause, wait
    try:
        yield
    finally:
        _yielding.urgent, _yielding.pause, _yielding.wait = before


PAUSE_POLL_SECONDS = 0.005      # how often a paused read looks again whether it may go on or must give up


def may_yield(expert_id: str) -> None:
    """Raise `ReadYielded` if this thread's reads must give way now (see `yield_to`)."""
    _chunk(expert_id)


def _chunk(expert_id: str) -> int:
    """This thread's chunk size; raises `ReadYielded` if its reads must give way now, waits while paused."""
    urgent = getattr(_yielding, "urgent", None)
    if urgent is None:
        return _CHUNK
    pause = getattr(_yielding, "pause", None)
    while True:
        if urgent():
            raise ReadYielded(f"{expert_id}: a read that may yield gave way to a more urgent one")
        if pause is None or not pause():
            return _YIELD_CHUNK
        wait = getattr(_yielding, "wait", None)
        (wait or time.sleep)(PAUSE_POLL_SECONDS)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str          # torch dtype name, e.g. 'float32'
    shape: tuple[int, ...]
    start: int          # byte offsets inside the data section
    end: int


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives in an expert's flat buffer."""

    specs: tuple[TensorSpec, ...]
    data_offset: int    # where the data section starts in the file
    nbytes: int         # size of the data section (= the flat buffer)

    @functools.cached_property
    def signature(self) -> tuple:
        """Experts with equal signatures can share a module skeleton byte for byte."""
        return tuple((s.name, s.dtype, s.shape, s.start) for s in self.specs)


def read_layout(path: str | os.PathLike, expert_id: str) -> tuple[Layout, bytes]:
    """Parse and check a safetensors header; returns the layout and the raw header bytes (for hashing)."""
    where = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ExpertLoadError(expert_id, where, f"truncated: {size} bytes, no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ExpertLoadError(expert_id, where, f"corrupt or truncated: header claims {n} bytes, "
                                                        f"file has {size}")
            raw = fh.read(n)
    except OSError as exc:
        raise ExpertLoadError(expert_id, where, f"cannot read: {exc.strerror or exc}") from None
    return parse_layout(raw, size - 8 - n, 8 + n, expert_id, where), head + raw


def parse_layout(raw: bytes, data: int, data_offset: int, expert_id: str, where: str) -> Layout:
    """Check a safetensors header (its JSON bytes) against a data section of `data` bytes."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ExpertLoadError(expert_id, where, f"corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ExpertLoadError(expert_id, where, "corrupt safetensors header: not a JSON object")
    specs = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            if info["dtype"] not in _DTYPES:
                raise ExpertLoadError(expert_id, where, f"tensor '{name}' has dtype {str(info['dtype'])[:20]!r}, "
                                                        f"which the store does not read ({', '.join(_DTYPES)})")
            dtype = _DTYPES[info["dtype"]]
            shape, offsets = tuple(info["shape"]), tuple(info["data_offsets"])
            if not all(type(d) is int for d in (*shape, *offsets)) or len(offsets) != 2:
                raise ValueError("a shape or offset that is not an integer")
            start, end = offsets
        except (KeyError, TypeError, ValueError):
            raise ExpertLoadError(expert_id, where, f"corrupt safetensors header entry for '{name}'") from None
        want = _numel(shape) * _itemsize(dtype)
        if min(shape, default=0) < 0 or end - start != want:     # else the first batch fails in torch, unnamed
            raise ExpertLoadError(expert_id, where, f"corrupt safetensors: tensor '{name}' of shape {list(shape)} "
                                                    f"{dtype} needs {want} bytes, its offsets span {end - start}")
        specs.append(TensorSpec(name, dtype, shape, start, end))
    specs.sort(key=lambda s: s.start)
    pos = 0
    for s in specs:
        if s.start != pos or s.end < s.start:
            raise ExpertLoadError(expert_id, where, f"corrupt safetensors: tensor '{s.name}' at {s.start}, "
                                                    f"expected {pos}")
        pos = s.end
    if pos != data:
        raise ExpertLoadError(expert_id, where, f"truncated or corrupt: tensors need {pos} data bytes, "
                                                f"file has {data}")
    return Layout(tuple(specs), data_offset, pos)


class FlatWeights:
    """An expert resident in one tier: a layout plus one byte buffer on some device."""

    def __init__(self, layout: Layout, buffer: "torch.Tensor", *, like: "FlatWeights | None" = None) -> None:
        self.layout, self.buffer = layout, buffer
        self.version: int | None = None     # the store's version of the expert these bytes are
        self._views: dict[str, torch.Tensor] | None = None
        if (like is not None and like.buffer is buffer and like._views is not None
                and like.layout.signature == layout.signature):
            self._views = like._views  # same bytes, same places: the views are the same too

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def device(self) -> "torch.device":
        return self.buffer.device

    def tensors(self) -> dict[str, "torch.Tensor"]:
        """Typed views into the buffer (no copy)."""
        import torch

        if self._views is None:
            views = {}
            for s in self.layout.specs:
                raw = self.buffer[s.start:s.end]
                dtype = getattr(torch, s.dtype)
                views[s.name] = (raw.view(dtype) if s.end > s.start else
                                 torch.empty(0, dtype=dtype, device=self.buffer.device)).view(s.shape)
            self._views = views
        return self._views

    def to(self, device: str, *, non_blocking: bool = False) -> "FlatWeights":
        """A copy in another tier's memory: one buffer copy."""
        import torch

        dst = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        dst.copy_(self.buffer, non_blocking=non_blocking)
        return FlatWeights(self.layout, dst)


READ_METHODS = ("mmap", "read")


_bounce = threading.local()     # each thread's 1 MiB buffer for `MappedFlat`'s read-through


class MappedFlat:
    """An expert's tensors over its file's memory map: the page cache's pages, no copy, no buffer of its own.

    What a computation that must not take memory beside the pools reads from
    (a pooled MoE layer's declined miss, `executors.moe_fiddler.HostWeights`).
    The file is first read through a reused 1 MiB bounce buffer, as a load
    reads it: sequential reads at disk speed bring it into the page cache,
    where the computation then finds it.  On this box (`bench/moe_admission.py`)
    the decode beside the pools' loads ran at 0.94-1.01x the same policy
    without admission with this read, 0.78x left to the map's page faults (an
    earlier form, on four threads), and 0.75-0.84x with
    `posix_fadvise(WILLNEED)` first (`storage.pagecache.warm_page_cache`).
    The map is private (copy on write), so the tensors are as writable as any
    and the file never changes.  It is unmapped when the last view of it is gone: torch's
    storage keeps the map object alive, so `close` only lets go of it.
    """

    def __init__(self, path: str | os.PathLike, expert_id: str, *, expect_sha256: str | None = None) -> None:
        """`expect_sha256`: the whole file's digest, checked on the read-through (one pass over the bytes)."""
        import torch

        layout, header = read_layout(path, expert_id)     # a short or corrupt file is refused here, named
        hasher = hashlib.sha256(header) if expect_sha256 else None
        buf = getattr(_bounce, "buf", None)
        if buf is None:
            buf = _bounce.buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        with open(path, "rb") as fh:
            fh.seek(layout.data_offset)
            while n := fh.readinto(buf):
                if hasher is not None:
                    hasher.update(view[:n])
            if hasher is not None and hasher.hexdigest() != expect_sha256:
                raise ExpertLoadError(expert_id, str(path), f"sha256 mismatch: manifest {expect_sha256[:12]}…, "
                                                            f"file {hasher.hexdigest()[:12]}…")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        data = (torch.frombuffer(mm, dtype=torch.uint8, count=layout.nbytes, offset=layout.data_offset)
                if layout.nbytes else torch.empty(0, dtype=torch.uint8))
        self.flat: FlatWeights | None = FlatWeights(layout, data)

    def tensors(self) -> dict[str, "torch.Tensor"]:
        return self.flat.tensors()

    def close(self) -> None:
        """Let go of the map; it is unmapped with the last view (an error's traceback may still hold one)."""
        self.flat = None


def read_flat(path: str | os.PathLike, expert_id: str, *, pin: bool = False,
              expect_sha256: str | None = None, method: str = "read",
              out: "FlatWeights | None" = None) -> FlatWeights:
    """Read an expert file into one (optionally pinned) buffer, front to back.

    `mmap` maps the file with sequential-access advice and copies the data
    section into the buffer chunk by chunk (the kernel reads ahead while we
    copy); `read` uses `readinto`.  If `expect_sha256` is given the bytes are
    hashed as they stream in, so checking costs CPU time but no second pass
    over the disk.  `out` (an evicted expert of the same size) lends its buffer.
    """
    if method not in READ_METHODS:
        raise ValueError(f"read method must be one of {READ_METHODS}, got {method!r}")
    _chunk(expert_id)            # a read that must give way does so before it reads or allocates anything
    layout, head = read_layout(path, expert_id)
    if out is not None and (out.nbytes != layout.nbytes or out.device.type != "cpu"):
        raise ValueError(f"out must hold {layout.nbytes} bytes on the CPU")
    buf = out.buffer if out is not None else host_empty(layout.nbytes, pin)
    mv = memoryview(buf.numpy()) if layout.nbytes else memoryview(b"")
    hasher = hashlib.sha256(head) if expect_sha256 else None
    try:
        got = (_copy_mmap if method == "mmap" else _copy_read)(path, layout, mv, hasher, expert_id)
    except OSError as exc:
        raise ExpertLoadError(expert_id, str(path), f"cannot read: {exc.strerror or exc}") from None
    if got != layout.nbytes:
        raise ExpertLoadError(expert_id, str(path), f"truncated while reading: {got} of {layout.nbytes} bytes")
    if hasher is not None and hasher.hexdigest() != expect_sha256:
        raise ExpertLoadError(expert_id, str(path), f"sha256 mismatch: manifest {expect_sha256[:12]}…, "
                                                    f"file {hasher.hexdigest()[:12]}…")
    return FlatWeights(layout, buf, like=out)


class _HashBehind:
    """Hashes a read's pieces on a helper thread while the reader reads the next one.

    sha256 runs at about the disk's speed here (1.7 GB/s), so hashing each
    piece on the reading thread after reading it about halves a verified
    load's speed.  `hashlib` lets go of the GIL while it hashes, so a second
    thread hashes piece i while piece i+1 is read: a cold 170 MB expert loads
    at 1619 MB/s against 999 MB/s hashed inline (the read path before it,
    16 MiB reads), 2586 MB/s unchecked (`python bench/expert_load.py`, row
    'verified', one run).  Pieces are hashed in order, by one thread; `finish`
    waits for the last one.  Reads of at most one piece hash inline.
    """

    def __init__(self, hasher) -> None:
        self.hasher = hasher
        self._pieces: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="coe-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (piece := self._pieces.get()) is not None:
            if self._error is None and not self._cancelled:
                try:
                    self.hasher.update(piece)
                except BaseException as exc:  # noqa: BLE001 - handed to the reader in finish()
                    self._error = exc

    def update(self, piece) -> None:
        self._pieces.put(piece)

    def finish(self, *, cancel: bool = False) -> None:
        """Wait for the helper to end (always called, so the thread never outlives the read): every piece hashed.

        `cancel`: the read failed or gave way; the pieces still queued are
        dropped unhashed and a hashing error is not raised over the read's own.
        """
        self._cancelled = cancel
        self._pieces.put(None)
        self._thread.join()
        if self._error is not None and not cancel:
            raise self._error


@contextlib.contextmanager
def _hashing(hasher, nbytes: int):
    """(hash(piece) callable, piece size) for one read: behind on a helper thread when there is more than one piece."""
    if hasher is None or nbytes <= _HASH_CHUNK:
        yield (hasher.update if hasher is not None else None), None
        return
    behind = _HashBehind(hasher)
    try:
        yield behind.update, _HASH_CHUNK
    except BaseException:
        behind.finish(cancel=True)
        raise
    behind.finish()


def _step(expert_id: str, piece: int | None) -> int:
    """How much the next read may take: this thread's chunk (see `_chunk`), at most one hash piece."""
    step = _chunk(expert_id)
    return min(step, piece) if piece else step


def _copy_read(path, layout: Layout, mv: memoryview, hasher, expert_id: str = "") -> int:
    got = 0
    with _hashing(hasher, layout.nbytes) as (hash_piece, piece), open(path, "rb", buffering=0) as fh:
        fh.seek(layout.data_offset)
        while got < layout.nbytes:
            n = fh.readinto(mv[got:got + _step(expert_id, piece)])
            if not n:
                break
            if hash_piece is not None:
                hash_piece(mv[got:got + n])
            got += n
    return got


def _copy_mmap(path, layout: Layout, mv: memoryview, hasher, expert_id: str = "") -> int:
    if layout.nbytes == 0:
        return 0
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < layout.data_offset + layout.nbytes:
            return max(0, size - layout.data_offset)
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
                if getattr(_yielding, "urgent", None) is None:   # a read that may give way reads only what it copies
                    mm.madvise(mmap.MADV_WILLNEED)
            src = memoryview(mm)
            try:
                base, got = layout.data_offset, 0
                with _hashing(hasher, layout.nbytes) as (hash_piece, piece):
                    while got < layout.nbytes:
                        n = min(_step(expert_id, piece), layout.nbytes - got)
                        mv[got:got + n] = src[base + got:base + got + n]
                        if hash_piece is not None:
                            hash_piece(mv[got:got + n])
                        got += n
            finally:
                src.release()
    return got


def iter_plain(path: str | os.PathLike, layout: Layout, expert_id: str, piece: int = 1 << 20):
    """Read a plain file's data section in pieces that never cross a tensor: yields (start, end, bytes).

    The scratch buffer is reused, so a piece is valid until the next one.
    """
    import numpy as np

    from .convert import pieces

    ranges = pieces(layout, piece)
    scratch = np.empty(max((e - s for s, e in ranges), default=0), np.uint8)
    try:
        with open(path, "rb", buffering=0) as fh:
            fh.seek(layout.data_offset)
            for s, e in ranges:
                view = scratch[:e - s]
                got = fh.readinto(memoryview(view))
                if got != e - s:
                    raise ExpertLoadError(expert_id, str(path), f"truncated while reading at data byte {s + (got or 0)}")
                yield s, e, view
    except OSError as exc:
        raise ExpertLoadError(expert_id, str(path), f"cannot read: {exc.strerror or exc}") from None
