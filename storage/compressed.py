"""Compressed expert files (`compression: exponent-zstd`): format, writer, streaming reader.

A compressed expert keeps the safetensors header of the file it replaces, so
the layout, and the sha256 of the decoded bytes, are those of the
uncompressed file: the manifest's hash means the same thing either way and a
corrupt chunk is caught exactly as a corrupt plain file is.

    magic "COEZSTD1"  | u64 n | JSON (format, version, prefix length, chunk table)
    the original safetensors prefix (u64 header length + header JSON)
    chunk payloads back to back: zstd frame of the exponent plane, then the raw plane

Chunks never cross a tensor and hold whole elements, so each decodes by
itself (on any thread) straight to its place in the flat buffer.  Reading is
a pipeline: while chunk group i decodes on the loader thread, the read of
group i+1 is already in flight on a reader thread (`os.pread` and zstd both
release the GIL), so a cold load costs max(read, decode), not their sum.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from coe import ExpertLoadError

from . import exponent_codec as codec
from .flat import Layout, parse_layout, read_layout

MAGIC = b"COEZSTD1"
FORMAT = "coe-edge/exponent-zstd"
VERSION = 1
SUFFIX = ".coez"
CHUNK_BYTES = 512 << 10        # decoded bytes per chunk: zstd's tables pay off well below this
_GROUP_BYTES = 4 << 20         # stored bytes per read: one pread while the previous group decodes
_MAX_HEAD = 64 << 20
_TASK_BYTES = 256 << 10        # stored bytes per decode task: small, so the decoders start early
_BLOCK_BYTES = 2 << 20         # stored bytes per read: large requests keep a disk at full speed
READ_AHEAD = 2                 # blocks read ahead of the one being decoded
_readers: ThreadPoolExecutor | None = None
_local = threading.local()
_decoders: ThreadPoolExecutor | None = None


def decode_threads() -> int:
    """Threads that decode chunks: one per core (decoding is CPU work; more threads only queue)."""
    return max(1, min(8, os.cpu_count() or 1))


_pools_lock = threading.Lock()


def _reader() -> ThreadPoolExecutor:
    global _readers
    with _pools_lock:
        if _readers is None:
            _readers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="coe-read")
        return _readers


def _decoder() -> ThreadPoolExecutor:
    """Shared by every loader thread: the cores, not the loads, bound decoding."""
    global _decoders
    with _pools_lock:
        if _decoders is None:
            _decoders = ThreadPoolExecutor(max_workers=decode_threads(), thread_name_prefix="coe-decode")
        return _decoders


@dataclass(frozen=True)
class Chunk:
    start: int        # decoded data-section byte range
    end: int
    codec: str
    zlen: int         # exponent frame bytes
    rlen: int         # raw plane bytes
    offset: int       # where the payload starts in the file

    @property
    def stored(self) -> int:
        return self.zlen + self.rlen


@dataclass(frozen=True)
class CompressedHeader:
    layout: Layout
    prefix: bytes                 # the uncompressed file's first bytes (hashing starts with them)
    chunks: tuple[Chunk, ...]
    file_bytes: int


@dataclass(frozen=True)
class CompressionStats:
    """What compressing one expert achieved, against what the exponent entropy allows."""

    raw_bytes: int        # the uncompressed file
    stored_bytes: int     # the compressed file
    bound_bytes: int      # header + raw planes + entropy of each tensor's coded plane

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def bound(self) -> float:
        return self.bound_bytes / self.raw_bytes if self.raw_bytes else 1.0


def compress_file(src: str | os.PathLike, dst: str | os.PathLike, expert_id: str, *,
                  chunk_bytes: int = CHUNK_BYTES) -> CompressionStats:
    """Write `dst`, the exponent-zstd form of the safetensors file `src` (not atomic: write to a temp name)."""
    layout, prefix = read_layout(src, expert_id)
    chunks: list[list] = []
    payloads: list[bytes] = []
    bound_bits = 0.0
    with open(src, "rb") as fh:
        fh.seek(layout.data_offset)
        data = np.frombuffer(fh.read(layout.nbytes), np.uint8)
    if data.size != layout.nbytes:
        raise ExpertLoadError(expert_id, str(src), "truncated while compressing")
    for spec in layout.specs:   # the bound: each tensor's own exponent entropy
        kind = codec.codec_for(spec.dtype)
        tensor = data[spec.start:spec.end]
        bound_bits += (codec.bound_bits(kind, codec.exponent_histogram(tensor, kind))
                       * (tensor.size // codec.element_size(kind)) if kind != "raw" else 8 * tensor.size)
    for start, end, kind in runs(layout):
        width = codec.element_size(kind)
        step = max(width, chunk_bytes // width * width)
        for pos in range(start, end, step):
            enc = codec.encode(data[pos:min(pos + step, end)], kind)
            chunks.append([pos, min(pos + step, end), kind, len(enc.zplane), len(enc.raw)])
            payloads += [enc.zplane, enc.raw]
    head = json.dumps({"format": FORMAT, "version": VERSION, "prefix": len(prefix), "chunks": chunks},
                      separators=(",", ":")).encode()
    with open(dst, "wb") as out:
        out.write(MAGIC + struct.pack("<Q", len(head)) + head + prefix)
        for p in payloads:
            out.write(p)
        stored = out.tell()
    overhead = len(MAGIC) + 8 + len(head) + len(prefix)
    return CompressionStats(raw_bytes=len(prefix) + layout.nbytes, stored_bytes=stored,
                            bound_bytes=overhead + int(bound_bits / 8))


def runs(layout: Layout) -> list[tuple[int, int, str]]:
    """Byte ranges of consecutive tensors that share a codec: chunks may span tensors inside a run.

    An expert of many small tensors (a vision model's BatchNorm vectors)
    would otherwise become thousands of tiny chunks, each paying a zstd
    frame, a table entry and a task switch.  Inside a run every tensor holds
    whole elements of one width, so a chunk of whole elements still splits
    and joins its planes correctly.
    """
    out: list[list] = []
    for spec in layout.specs:
        kind = codec.codec_for(spec.dtype)
        if spec.end == spec.start:
            continue
        if out and out[-1][2] == kind and out[-1][1] == spec.start:
            out[-1][1] = spec.end
        else:
            out.append([spec.start, spec.end, kind])
    return [tuple(r) for r in out]


def read_header(path: str | os.PathLike, expert_id: str) -> CompressedHeader:
    """Parse and check a compressed file's header and chunk table (no payload is read)."""
    where = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            start = fh.read(len(MAGIC) + 8)
            if len(start) < len(MAGIC) + 8 or start[:len(MAGIC)] != MAGIC:
                raise ExpertLoadError(expert_id, where, "not an exponent-zstd expert file (bad magic)")
            (n,) = struct.unpack("<Q", start[len(MAGIC):])
            if n > _MAX_HEAD or len(start) + n > size:
                raise ExpertLoadError(expert_id, where, f"corrupt or truncated: header claims {n} bytes, "
                                                        f"file has {size}")
            head = fh.read(n)
            try:
                doc = json.loads(head.decode("utf-8"))
                if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                    raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
                plen = doc["prefix"]
                if type(plen) is not int:
                    raise ValueError(f"prefix length {str(plen)[:20]} is not an integer")
                raw_chunks = doc["chunks"]
                if not isinstance(raw_chunks, list) or not 8 <= plen <= _MAX_HEAD:
                    raise ValueError("bad chunk table or prefix length")
            except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ExpertLoadError(expert_id, where, f"corrupt compressed header: {exc}") from None
            prefix = fh.read(plen)
    except OSError as exc:
        raise ExpertLoadError(expert_id, where, f"cannot read: {exc.strerror or exc}") from None
    if len(prefix) != plen:
        raise ExpertLoadError(expert_id, where, "truncated inside the safetensors prefix")
    (hlen,) = struct.unpack("<Q", prefix[:8])
    if hlen != plen - 8:
        raise ExpertLoadError(expert_id, where, "corrupt compressed header: prefix length disagrees")
    offset = len(MAGIC) + 8 + n + plen
    chunks, pos = [], 0
    try:
        for c in raw_chunks:
            s, e, kind, zlen, rlen = c
            if not all(type(v) is int for v in (s, e, zlen, rlen)):
                raise ValueError(f"chunk {len(chunks)} ({c!r}) has a field that is not an integer")
            if kind not in codec.CODECS or s != pos or e <= s or zlen < 0 or rlen < 0:
                raise ValueError(f"chunk {len(chunks)} ({c!r}) is out of place")
            # what a chunk decodes to is tied to what it stores (so a file never claims more than twice its
            # size): raw is stored as is; a plane split keeps width-1 of every width bytes raw
            width = codec.element_size(kind)
            if (rlen != e - s or zlen) if kind == "raw" else ((e - s) % width or rlen != (e - s) // width * (width - 1)
                                                              or zlen <= 0):
                raise ValueError(f"chunk {len(chunks)} ({c!r}): its stored sizes do not fit {e - s} bytes of {kind}")
            chunks.append(Chunk(s, e, kind, zlen, rlen, offset))
            offset += zlen + rlen
            pos = e
    except (ValueError, TypeError) as exc:
        raise ExpertLoadError(expert_id, where, f"corrupt chunk table: {exc}") from None
    layout = parse_layout(prefix[8:], pos, 8 + hlen, expert_id, where)
    wrong = _codec_mismatch(layout, chunks)
    if wrong:   # a relabelled chunk (bf16 as fp16) decodes without error into wrong weights
        raise ExpertLoadError(expert_id, where, f"corrupt chunk table: {wrong}")
    if offset != size:
        raise ExpertLoadError(expert_id, where, f"truncated or corrupt: chunks need {offset} bytes, file has {size}")
    return CompressedHeader(layout, prefix, tuple(chunks), size)


def _codec_mismatch(layout, chunks: list[Chunk]) -> str:
    """Why a chunk's codec is not that of a tensor it covers ('' when every one is)."""
    i = 0
    for spec in layout.specs:
        if spec.end == spec.start:
            continue
        want = codec.codec_for(spec.dtype)
        while i < len(chunks) and chunks[i].end <= spec.start:
            i += 1
        j = i
        while j < len(chunks) and chunks[j].start < spec.end:
            if chunks[j].codec != want:
                return f"chunk {j} is {chunks[j].codec}, but tensor {spec.name!r} ({spec.dtype}) is {want}"
            j += 1
    return ""


def _groups(chunks: tuple[Chunk, ...], limit: int = _GROUP_BYTES) -> list[tuple[Chunk, ...]]:
    groups, cur, size = [], [], 0
    for c in chunks:
        cur.append(c)
        size += c.stored
        if size >= limit:
            groups.append(tuple(cur))
            cur, size = [], 0
    if cur:
        groups.append(tuple(cur))
    return groups


def iter_decoded(path: str | os.PathLike, header: CompressedHeader, expert_id: str,
                 dest: np.ndarray | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """Decode chunk by chunk, in order: yields (start, end, decoded bytes).

    With `dest` (the flat buffer as uint8) each chunk decodes in place there;
    without, into a scratch buffer that the next chunk reuses (for a caller
    that converts dtypes on the way).  Reads run one group ahead.
    """
    where = str(path)
    groups = _groups(header.chunks)
    scratch = None if dest is not None else np.empty(max((c.end - c.start for c in header.chunks), default=0),
                                                     np.uint8)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ExpertLoadError(expert_id, where, f"cannot read: {exc.strerror or exc}") from None
    pool = _reader()

    def read(g: tuple[Chunk, ...]):
        return pool.submit(os.pread, fd, sum(c.stored for c in g), g[0].offset)

    ahead = read(groups[0]) if groups else None
    try:
        for gi, group in enumerate(groups):
            try:
                data = ahead.result()
            except OSError as exc:
                raise ExpertLoadError(expert_id, where, f"cannot read: {exc.strerror or exc}") from None
            ahead = read(groups[gi + 1]) if gi + 1 < len(groups) else None
            want = sum(c.stored for c in group)
            if len(data) != want:
                raise ExpertLoadError(expert_id, where, f"truncated while reading: {len(data)} of {want} bytes "
                                                        f"at offset {group[0].offset}")
            mv, at = memoryview(data), 0
            for c in group:
                out = dest[c.start:c.end] if dest is not None else scratch[:c.end - c.start]
                try:
                    codec.decode_into(out, c.codec, mv[at:at + c.zlen], mv[at + c.zlen:at + c.stored])
                except codec.CodecError as exc:
                    index = header.chunks.index(c)
                    raise ExpertLoadError(expert_id, where, f"corrupt chunk {index} (data bytes {c.start}-{c.end}, "
                                                            f"{c.codec}): {exc}") from None
                at += c.stored
                yield c.start, c.end, out
    finally:
        if ahead is not None:
            ahead.cancel()
            try:
                ahead.result()
            except Exception:  # noqa: BLE001 - the read we no longer need may fail too
                pass
        os.close(fd)


def _read_block(fd: int, where: str, expert_id: str, offset: int, view: memoryview) -> memoryview:
    """One large pread (on a reader thread: it waits on the disk, not on a core)."""
    try:
        got = os.preadv(fd, [view], offset)
    except OSError as exc:
        raise ExpertLoadError(expert_id, where, f"cannot read: {exc.strerror or exc}") from None
    if got != len(view):
        raise ExpertLoadError(expert_id, where, f"truncated while reading: {got} of {len(view)} bytes "
                                                f"at offset {offset}")
    return view


def _decode_group(read, base: int, where: str, header: CompressedHeader, group: tuple[Chunk, ...],
                  expert_id: str, dest: np.ndarray) -> None:
    """Decode one group's chunks to their places in `dest` once the block holding them is read."""
    mv = read.result()
    at = group[0].offset - base
    for c in group:
        try:
            codec.decode_into(dest[c.start:c.end], c.codec, mv[at:at + c.zlen], mv[at + c.zlen:at + c.stored])
        except codec.CodecError as exc:
            raise ExpertLoadError(expert_id, where, f"corrupt chunk {header.chunks.index(c)} (data bytes "
                                                    f"{c.start}-{c.end}, {c.codec}): {exc}") from None
        at += c.stored


def _blocks(groups: list[tuple[Chunk, ...]]) -> list[list[tuple[Chunk, ...]]]:
    """Runs of consecutive groups holding at least _BLOCK_BYTES: one read each."""
    out, cur, size = [], [], 0
    for g in groups:
        cur.append(g)
        size += sum(c.stored for c in g)
        if size >= _BLOCK_BYTES:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def _ring(count: int, size: int) -> list[np.ndarray]:
    """Read buffers of the calling loader thread, kept between loads (np.empty: no zero-fill)."""
    ring = getattr(_local, "ring", None)
    if ring is None or len(ring) < count or ring[0].size < size:
        ring = _local.ring = [np.empty(max(size, 2 * _BLOCK_BYTES), np.uint8) for _ in range(count)]
    return ring


def decode_to(path: str | os.PathLike, header: CompressedHeader, expert_id: str, dest: np.ndarray,
              expect_sha256: str | None = None, threads: int | None = None) -> None:
    """Decode the whole expert into `dest` (the flat buffer), checking the decoded bytes' sha256.

    Two stages.  The file is read in large blocks (MiBs: one request each,
    which a disk, or a throttled one, serves at full speed), `READ_AHEAD`
    blocks ahead, on the reader threads.  Each block's groups of chunks
    decode on the shared decode pool, `threads` (default: one per core) at a
    time plus one, as soon as their block lands.  The calling loader thread
    hashes the decoded bytes in order as groups finish.  A cold load then
    costs about max(stored bytes / disk, decoded bytes / decode), not their sum.
    `threads=1`, or an expert that fits one read block, reads and decodes
    on the calling thread alone (what one core does: the profiler's
    per-thread figure).
    """
    where = str(path)
    hasher = hashlib.sha256(header.prefix) if expect_sha256 else None
    blocks = _blocks(_groups(header.chunks, _TASK_BYTES))
    if threads == 1 or len(blocks) <= 1:     # one read: nothing to overlap, and hand-offs would cost more
        _decode_serial(path, header, expert_id, dest, blocks, hasher)
    else:
        _decode_pipelined(path, header, expert_id, dest, blocks, hasher, threads)
    if hasher is not None and hasher.hexdigest() != expect_sha256:
        raise ExpertLoadError(expert_id, where, f"sha256 of the decoded bytes mismatch: manifest "
                                                f"{expect_sha256[:12]}…, decoded {hasher.hexdigest()[:12]}…")


class _Done:
    """A finished read, for the serial path (`_decode_group` takes anything with `result()`)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def result(self) -> memoryview:
        return self._view


def _decode_serial(path, header: CompressedHeader, expert_id: str, dest: np.ndarray, blocks, hasher) -> None:
    where = str(path)
    ring = _ring(1, max((sum(c.stored for g in b for c in g) for b in blocks), default=0))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ExpertLoadError(expert_id, where, f"cannot read: {exc.strerror or exc}") from None
    try:
        for block in blocks:
            base = block[0][0].offset
            size = sum(c.stored for g in block for c in g)
            read = _Done(_read_block(fd, where, expert_id, base, memoryview(ring[0])[:size]))
            for g in block:
                _decode_group(read, base, where, header, g, expert_id, dest)
                if hasher is not None:
                    hasher.update(dest[g[0].start:g[-1].end])
    finally:
        os.close(fd)


def _decode_pipelined(path, header: CompressedHeader, expert_id: str, dest: np.ndarray, blocks, hasher,
                      threads: int | None) -> None:
    where = str(path)
    width = max(1, threads or decode_threads()) + 1
    sizes = [sum(c.stored for g in b for c in g) for b in blocks]
    ring = _ring(READ_AHEAD + 1, max(sizes, default=0))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ExpertLoadError(expert_id, where, f"cannot read: {exc.strerror or exc}") from None
    reader, decoder = _reader(), _decoder()
    reads: deque = deque()     # (block index, read future): at most READ_AHEAD + 1 buffers in use
    decodes: deque = deque()   # (block index, group, decode future), in file order
    next_read = 0
    queue: deque = deque()     # (block index, group, read future) waiting for a decode slot
    try:
        while next_read < len(blocks) or reads or queue or decodes:
            while next_read < len(blocks) and len(reads) <= READ_AHEAD:
                base = blocks[next_read][0][0].offset
                view = memoryview(ring[next_read % len(ring)])[:sizes[next_read]]
                rf = reader.submit(_read_block, fd, where, expert_id, base, view)
                reads.append((next_read, rf))
                queue.extend((next_read, g, rf) for g in blocks[next_read])
                next_read += 1
            while queue and len(decodes) < width:
                bi, g, rf = queue.popleft()
                base = blocks[bi][0][0].offset
                decodes.append((bi, g, decoder.submit(_decode_group, rf, base, where, header, g, expert_id, dest)))
            bi, g, df = decodes.popleft()
            df.result()
            if hasher is not None:
                hasher.update(dest[g[0].start:g[-1].end])
            if g is blocks[bi][-1]:          # the block's last group: its buffer is free again
                assert reads[0][0] == bi
                reads.popleft()
    finally:
        pending = [f for _, _, f in decodes] + [f for _, f in reads]
        for f in pending:
            f.cancel()
        for f in pending:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - the first failure is already raised
                pass
        os.close(fd)


def decompress_file(src: str | os.PathLike, dst: str | os.PathLike, expert_id: str) -> None:
    """Write `dst`, the plain safetensors file `src` was made from."""
    header = read_header(src, expert_id)
    buf = np.empty(header.layout.nbytes, np.uint8)
    decode_to(src, header, expert_id, buf)
    with open(dst, "wb") as out:
        out.write(header.prefix)
        out.write(buf.tobytes())
