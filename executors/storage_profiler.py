"""Measure the box's expert storage for the profile: raw disk read rate and exponent decode rate.

Compression trades disk bytes for CPU work, so whether it pays is mostly a
property of the box (and partly of the experts' dtypes and tensor sizes, see
below): a compressed load costs
max(stored / disk, decoded / decode) against decoded / disk for a plain one
(`executors.costs.compressed_load_seconds`), which is smaller exactly when
decoding outruns the disk.  `profile_storage` measures both sides and
`verdict` says which way it goes, in figures.

- disk: cold reads of the expert files the profiler already loads, raw
  bytes into a buffer (no decode, no rebind), after dropping each file from
  the page cache;
- decode: one thread alone (`storage.exponent_codec.measure_decode_rate`),
  then `threads` threads decoding at once, since one load decodes on that
  many threads (`storage.compressed.decode_threads`) and they share the
  cores: the per-thread figure under that contention;
- decode of the line's own experts: the same files compressed (in a
  temporary directory where the store keeps them plain) and decoded whole
  through the real reader from the page cache.  The synthetic sample is
  bf16 in 512 KiB chunks; an fp32 expert decodes four bytes per coded byte
  and a small expert pays a load's fixed costs, so this is the rate the cost
  model uses where it is known, and its ratio is the one the verdict quotes.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .lockstep import run_in_lockstep
from .profile import StorageProfile

if TYPE_CHECKING:
    from storage.expert_store import ExpertStore

DECODE_SAMPLE_BYTES = 16 << 20   # decoded bytes per decode sample: a few dozen chunks per thread, ~0.1 s each
COLD_RESIDENT_MAX = 0.05         # as the profiler's: more of a 'cold' file cached than this is not cold
STEPS = 3                        # progress steps: disk, decode sample, decode of the line's experts


def loader_decode_threads() -> int:
    """Threads one compressed load decodes with: the reader's own count where it has one, else one."""
    from storage import compressed

    count = getattr(compressed, "decode_threads", None)
    return max(1, int(count())) if callable(count) else 1


def measure_disk_rate(paths: Sequence[Path], repeats: int = 3) -> tuple[float, bool]:
    """(stored bytes per second of cold raw reads of `paths`, whether the reads were really cold).

    Each file is read `repeats` times whole into one reused buffer after
    dropping it from the page cache; its median time counts.  The rate is
    the bytes of all files over their summed medians (big files weigh more).
    """
    from storage.pagecache import drop_from_page_cache, resident_fraction

    paths = sorted({Path(p) for p in paths})
    if not paths:
        raise ValueError("no expert files to time the disk on")
    buf = bytearray(max(p.stat().st_size for p in paths))
    total_bytes, total_secs, cold = 0, 0.0, True
    for p in paths:
        size = p.stat().st_size
        view = memoryview(buf)[:size]
        times = []
        for _ in range(repeats):
            dropped = drop_from_page_cache(p)
            frac = resident_fraction(p)
            cold = cold and dropped and (frac is None or frac <= COLD_RESIDENT_MAX)
            t0 = time.perf_counter()
            with open(p, "rb", buffering=0) as f:
                got = 0
                while got < size:
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
            times.append(time.perf_counter() - t0)
        total_bytes += size
        total_secs += statistics.median(times)
    return total_bytes / max(total_secs, 1e-9), cold


def _bf16_sample(nbytes: int, seed: int = 0):
    """bf16 bytes with a trained-like spread, as `measure_decode_rate` draws them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(nbytes // 4, dtype=np.float32) * 0.02
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def measure_decode_contended(threads: int, nbytes: int = DECODE_SAMPLE_BYTES, *, chunk_bytes: int = 1 << 20,
                             repeats: int = 3) -> float:
    """Decoded bytes/s of `threads` threads decoding at once, summed (the best of `repeats` rounds).

    The chunks are encoded once and shared; each thread decodes all of them
    into its own buffer.  All start on a barrier, and each thread's rate is
    its bytes over its own elapsed time, so one that started late is not
    charged for the wait.
    """
    import numpy as np

    from storage.exponent_codec import decode_into, encode

    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    data = _bf16_sample(nbytes)
    spans = [(i, min(i + chunk_bytes, data.size)) for i in range(0, data.size, chunk_bytes)]
    chunks = [encode(data[a:b], "bf16") for a, b in spans]
    best = 0.0
    for _ in range(repeats):
        rates = [0.0] * threads

        def body(i: int, start) -> None:
            out = np.empty(data.size, np.uint8)
            start()
            t0 = time.perf_counter()
            for (a, b), c in zip(spans, chunks):
                decode_into(out[a:b], "bf16", c.zplane, c.raw)
            rates[i] = data.size / max(time.perf_counter() - t0, 1e-9)

        run_in_lockstep(body, threads, "decode")
        best = max(best, sum(rates))
    return best


def measure_expert_decode(store: "ExpertStore", expert_ids: Sequence[str], repeats: int = 3) -> tuple[float, float]:
    """(decoded bytes/s, stored/plain ratio) of whole loads of `expert_ids` compressed, decode only.

    An expert the store keeps plain is compressed into a temporary directory
    first (as `coe-agent experts compress` would store it).  Each file is
    decoded once to warm the page cache, then `repeats` times through
    `storage.compressed.decode_to` (the loader's path, its decode threads);
    the median counts and the rate is all decoded bytes over the summed medians.
    """
    import tempfile

    import numpy as np

    from storage.compressed import compress_file, decode_to, read_header

    ids = sorted(set(expert_ids))
    if not ids:
        raise ValueError("no experts to time decoding on")
    decoded = stored = plain = 0
    secs = 0.0
    with tempfile.TemporaryDirectory(prefix="coe-decode-") as tmp:
        for eid in ids:
            entry = store.entry(eid)
            path = store.path(eid)
            if entry.compression == "none":
                dst = Path(tmp) / f"{eid}.coez"
                stats = compress_file(path, dst, eid)
                path, s_bytes, p_bytes = dst, stats.stored_bytes, stats.raw_bytes
            else:
                s_bytes, p_bytes = entry.stored_nbytes, entry.plain_nbytes
            header = read_header(path, eid)
            dest = np.empty(header.layout.nbytes, np.uint8)
            decode_to(path, header, eid, dest)   # warm: the page cache, the decode pool, zstd's contexts
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                decode_to(path, header, eid, dest)
                times.append(time.perf_counter() - t0)
            decoded += dest.size
            secs += statistics.median(times)
            stored += s_bytes
            plain += p_bytes
    return decoded / max(secs, 1e-9), stored / plain


def profile_storage(store: "ExpertStore", expert_ids: Sequence[str], *, repeats: int = 3,
                    decode_bytes: int | None = None, threads: int | None = None,
                    say: Callable[[str], None] = lambda m: None) -> StorageProfile:
    """Measure the disk under `expert_ids`' files and the decoder on this CPU; returns the StorageProfile."""
    from storage.exponent_codec import measure_decode_rate

    nbytes = decode_bytes or DECODE_SAMPLE_BYTES
    ids = sorted(set(expert_ids))
    disk, cold = measure_disk_rate([store.path(e) for e in ids], repeats)
    say(f"storage: disk {disk / 1e9:.2f} GB/s raw cold reads of {len(ids)} expert file(s)"
        + ("" if cold else " (NOT cold: the page cache kept them)"))
    k = threads or loader_decode_threads()
    alone = measure_decode_rate(nbytes, repeats=repeats)
    n = max(2, k)
    contended = measure_decode_contended(n, nbytes, repeats=repeats) / n
    say(f"storage: decode sample {alone / 1e9:.2f} GB/s on one thread alone, {contended / 1e9:.2f} GB/s per "
        f"thread with {n} decoding at once")
    experts, ratio = measure_expert_decode(store, ids, repeats)
    say(f"storage: the line's experts compress to {ratio:.2f} and decode at {experts / 1e9:.2f} GB/s per load")
    cores = os.cpu_count() or 1
    source = (f"measured on {platform.node()} ({cores} cores): disk = cold whole-file reads of the profiled "
              f"experts' files, {repeats} each" + ("" if cold else " (page cache not dropped: a warm rate)")
              + f"; decode sample = bf16 exponent-zstd, {nbytes >> 20} MB, per thread with {n} threads at once; "
              f"load decode and ratio = the profiled experts compressed, decoded whole from the page cache on "
              f"the loader's {k} thread(s)")
    return StorageProfile(disk_bps=disk, decode_bps=contended, decode_threads=k, decode_bps_alone=alone,
                          load_decode_bps=experts, ratio=ratio, source=source)


def verdict(storage: StorageProfile | None) -> str:
    """One line an engineer can act on: does exponent compression make this box's SSD loads faster, and why."""
    if storage is None or storage.compression_pays is None:
        return ("compression: unknown on this box: the profile has no disk and decode rates (written before "
                "`coe-agent profile` measured them; rerun it); compressed experts are charged their plain load")
    disk, dec = storage.disk_bps, storage.decode_total_bps
    sample = (f"{storage.decode_threads} thread(s) x {storage.decode_bps / 1e9:.2f} GB/s"
              if storage.decode_bps else "")
    how = (f"the line's experts; the bf16 sample: {sample}" if storage.load_decode_bps and sample
           else sample or "the line's experts")
    figures = f"disk {disk / 1e9:.2f} GB/s raw vs decode {dec / 1e9:.2f} GB/s ({how})"
    if storage.ratio is not None:
        at = (f"at the experts' ratio {storage.ratio:.2f} the disk delivers {disk / storage.ratio / 1e9:.2f} GB/s "
              f"decoded -> a load takes {storage.load_factor(storage.ratio):.2f}x the plain one")
    else:
        at = (f"a load would take max(ratio, {disk / dec:.2f})x the plain one (e.g. "
              f"{storage.load_factor(0.66):.2f}x at bf16's typical 0.66; the store is plain)")
    if storage.compression_pays:
        return f"compression: pays on this box: {figures}: {at}"
    return (f"compression: does not pay on this box: decoding is slower than the disk: {figures}: {at}; "
            f"keep the store plain (compression: none)")
