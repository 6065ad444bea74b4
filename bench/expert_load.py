"""Expert loading benchmark (issue #3): cold loads, warm switches, and prefetch overlap.

Real run on this machine: real expert files (torchvision resnet18 and
resnet101, generated weights) in a real expert store on the local disk.
"Cold" means the file was fsynced and dropped from the page cache with
posix_fadvise(DONTNEED) just before the read (checked with mincore).  Every
figure is a ratio of two things measured side by side in the same run:

  cold load    SSD -> ready-to-run module (flat buffer + skeleton bind),
               against a raw sequential read of the same file        target >= 0.85
  warm switch  CPU tier -> an existing skeleton on the device tier (copy into
               a recycled buffer + rebind), against a plain memcpy    target <= 1.5x
  overlap      batch compute + next expert's cold load, serial vs with the
               background loader

  verified     a cold load checked against the manifest's sha256, hashed
               behind the read (a helper thread) against inline

Usage:  python bench/expert_load.py [--repeats 5] [--dir var/bench/expert_load] [--json-only]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from coe import Expert  # noqa: E402
from executors.backends import get_backend  # noqa: E402
from executors.prefetch import Prefetcher  # noqa: E402
from executors.skeletons import Skeletons  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from storage.pagecache import drop_from_page_cache, resident_fraction  # noqa: E402
from storage.policies import make_policy  # noqa: E402
from storage.pool import Pool  # noqa: E402
from storage.tiers import StoreSource, TierSource  # noqa: E402

CLASSES = ("ok", "missing", "misaligned", "wrong_part")


def expert(eid: str, model: str) -> Expert:
    return Expert(eid, f"torchvision/{model}", "classifier", CLASSES, 64)


def ensure(store: ExpertStore, e: Expert, seed: int) -> None:
    if not store.has(e.id):
        store.write(e, get_backend(e.arch).init_weights(e, seed))


def cold(path: Path) -> None:
    drop_from_page_cache(path)
    frac = resident_fraction(path)
    if frac is not None and frac > 0.05:
        raise SystemExit(f"could not evict {path} from the page cache ({frac:.0%} resident): cold figures "
                         "would be warm ones; run on a filesystem that honours posix_fadvise")


def raw_read(path: Path, buf: np.ndarray) -> float:
    mv = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        got = 0
        while n := fh.readinto(mv[got:got + (16 << 20)]):
            got += n
    return time.perf_counter() - t0


def bench_cold(store: ExpertStore, e: Expert, repeats: int, method: str, reuse: bool) -> dict:
    """SSD -> ready module.  `reuse`: into an evicted same-size expert's buffer (the steady state of a
    pool that switches between experts of one arch); otherwise into freshly allocated memory."""
    path = store.path(e.id)
    size = path.stat().st_size
    buf = np.empty(size, dtype=np.uint8)
    buf.fill(0)  # the raw read goes into faulted-in memory, as a reused tier buffer is
    sk = Skeletons("cpu")
    victim = store.read_flat(e.id)
    sk.bind(e, victim)  # the skeleton exists before timing, as it does on a running line box
    raw, load = [], []
    for _ in range(repeats):
        cold(path)
        raw.append(raw_read(path, buf))
        cold(path)
        out = victim if reuse else None
        t0 = time.perf_counter()
        flat = store.read_flat(e.id, method=method, out=out)
        sk.bind(e, flat)
        load.append(time.perf_counter() - t0)
        victim = flat
    r, l_ = statistics.median(raw), statistics.median(load)
    return {"expert": e.id, "arch": e.arch, "mbytes": round(size / 1e6, 1), "method": method,
            "memory": "reused" if reuse else "fresh",
            "raw_mbps": round(size / r / 1e6, 1), "load_mbps": round(store.nbytes(e.id) / l_ / 1e6, 1),
            "ratio": round((store.nbytes(e.id) / l_) / (size / r), 3)}


def bench_verified(store: ExpertStore, e: Expert, repeats: int) -> dict:
    """A cold load checked against the manifest's sha256 (`expert_verify: first`'s first read): the pieces
    hashed behind the read on a helper thread (what loads do) against hashed after each piece on the reading
    thread (before), both into reused memory, beside the unverified load."""
    from storage import flat

    path, sha = store.path(e.id), store.entry(e.id).sha256
    victim = flat.read_flat(path, e.id)
    times: dict[str, list[float]] = {"plain": [], "behind": [], "inline": []}
    piece = flat._HASH_CHUNK
    try:
        for _ in range(repeats):
            for how in times:
                flat._HASH_CHUNK = piece if how != "inline" else 1 << 62      # one piece: hashed on the reader
                cold(path)
                t0 = time.perf_counter()
                victim = flat.read_flat(path, e.id, out=victim, expect_sha256=None if how == "plain" else sha)
                times[how].append(time.perf_counter() - t0)
    finally:
        flat._HASH_CHUNK = piece
    size = path.stat().st_size
    mbps = {how: round(size / statistics.median(t) / 1e6, 1) for how, t in times.items()}
    return {"expert": e.id, "mbytes": round(size / 1e6, 1), "plain_mbps": mbps["plain"],
            "hash_behind_mbps": mbps["behind"], "hash_inline_mbps": mbps["inline"],
            "gain": round(mbps["behind"] / mbps["inline"], 3)}


def bench_switch(store: ExpertStore, a: Expert, b: Expert, repeats: int) -> dict:
    host = Pool("host", 4 * store.nbytes(a.id), make_policy("lru"), StoreSource(store))
    src = TierSource(host, "cpu")
    dev = Pool("dev", store.nbytes(a.id) + 1024, make_policy("lru"), src)
    sk = Skeletons("cpu")
    for e in (a, b, a):  # warm: both in the host tier, skeleton built, a free buffer to recycle
        h = dev.acquire(e.id)
        sk.bind(e, h.value)
        dev.release(h)
    times = []
    for i in range(repeats * 2):
        e = (b, a)[i % 2]
        t0 = time.perf_counter()
        h = dev.acquire(e.id)
        sk.bind(e, h.value)
        times.append(time.perf_counter() - t0)
        dev.release(h)
    n = store.nbytes(a.id)
    x, y = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    x.fill_(1)
    y.fill_(2)
    mem = []
    for _ in range(repeats * 2):
        t0 = time.perf_counter()
        y.copy_(x)
        mem.append(time.perf_counter() - t0)
    s, m = statistics.median(times), statistics.median(mem)
    return {"arch": a.arch, "mbytes": round(n / 1e6, 1), "switch_ms": round(s * 1e3, 2),
            "memcpy_ms": round(m * 1e3, 2), "ratio": round(s / m, 3), "buffers_reused": src.reused}


def bench_overlap(store: ExpertStore, experts: list[Expert], rounds: int) -> dict:
    images = [np.random.default_rng(i).integers(0, 255, (64, 64, 3), dtype=np.uint8) for i in range(16)]
    be = get_backend(experts[0].arch)

    def run(prefetch: bool) -> float:
        pool = Pool("cpu", 2 * max(store.nbytes(e.id) for e in experts) + 1024, make_policy("lru"),
                    StoreSource(store))
        pf = Prefetcher(pool, "bench") if prefetch else None
        sk = Skeletons("cpu")
        sk.bind(experts[0], store.read_flat(experts[0].id))  # skeleton built before timing
        for e in experts:
            cold(store.path(e.id))
        t0 = time.perf_counter()
        for i in range(rounds):
            e = experts[i % len(experts)]
            h = pool.acquire(e.id)
            if pf is not None:
                pf.hint(experts[(i + 1) % len(experts)].id)
            be.run(sk.bind(e, h.value), e, images)
            pool.release(h)
            if i + 1 < rounds and (i + 1) % len(experts) == 0:
                for x in experts:
                    pool.evict(x.id) if x.id in pool.resident() else None
                    cold(store.path(x.id))
        took = time.perf_counter() - t0
        if pf is not None:
            pf.close()
        return took

    serial, overlapped = run(False), run(True)
    return {"rounds": rounds, "serial_s": round(serial, 3), "overlapped_s": round(overlapped, 3),
            "gain": round(serial / overlapped, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="var/bench/expert_load")
    ap.add_argument("--json-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    store = ExpertStore(args.dir, verify="never")
    small = [expert(f"r18-{i}", "resnet18") for i in range(3)]
    big = [expert(f"r101-{i}", "resnet101") for i in range(2)]
    for i, e in enumerate(small + big):
        ensure(store, e, seed=i)
    cold_rows = [bench_cold(store, e, args.repeats, m, reuse) for e in (small[0], big[0])
                 for m, reuse in (("read", True), ("read", False), ("mmap", True))]
    verified = bench_verified(store, big[0], args.repeats)
    switch_rows = [bench_switch(store, small[0], small[1], args.repeats),
                   bench_switch(store, big[0], big[1], args.repeats)]
    overlap = bench_overlap(store, small, rounds=9)
    gpu = None
    if torch.cuda.is_available():
        gpu = bench_h2d(store, big[0])
    if not args.json_only:
        print(f"expert_load: real run on {os.cpu_count()} CPU cores, store {store.root} "
              f"(page cache dropped before each cold read)")
        print(f"{'cold load':12} {'expert':10} {'MB':>7} {'method':>6} {'memory':>7} {'raw MB/s':>9} "
              f"{'load MB/s':>10} {'ratio':>6}  target >= 0.85")
        for r in cold_rows:
            print(f"{'':12} {r['expert']:10} {r['mbytes']:7.1f} {r['method']:>6} {r['memory']:>7} "
                  f"{r['raw_mbps']:9.1f} {r['load_mbps']:10.1f} {r['ratio']:6.3f}")
        v = verified
        print(f"{'verified':12} {v['expert']:10} {v['mbytes']:7.1f} MB cold, sha256 checked: hashed behind the read "
              f"{v['hash_behind_mbps']} MB/s, hashed inline {v['hash_inline_mbps']} MB/s ({v['gain']}x); "
              f"unverified {v['plain_mbps']} MB/s")
        print(f"{'warm switch':12} {'arch':24} {'MB':>7} {'switch ms':>9} {'memcpy ms':>9} {'ratio':>6}  target <= 1.5")
        for r in switch_rows:
            print(f"{'':12} {r['arch']:24} {r['mbytes']:7.1f} {r['switch_ms']:9.2f} {r['memcpy_ms']:9.2f} "
                  f"{r['ratio']:6.3f}")
        print(f"{'overlap':12} {overlap['rounds']} batches of 16 on resnet18, each next expert cold: serial "
              f"{overlap['serial_s']} s, with background loader {overlap['overlapped_s']} s, gain {overlap['gain']}x")
        if gpu:
            print(f"{'h2d':12} {gpu}")
        else:
            print(f"{'h2d':12} no CUDA device here: host-to-device throughput not measured")
    print(json.dumps({"bench": "expert_load", "real_run": True, "cold": cold_rows, "verified": verified,
                      "switch": switch_rows,
                      "overlap": overlap, "h2d": gpu,
                      "targets": {"cold_ratio": 0.85, "switch_ratio": 1.5}}))
    return 0


def bench_h2d(store: ExpertStore, e: Expert) -> dict:
    """Pinned host tier -> device tier, against the device's measured pinned-copy peak."""
    host = Pool("host", 2 * store.nbytes(e.id), make_policy("lru"), StoreSource(store, pin=True))
    src = TierSource(host, "cuda:0")
    host.release(host.acquire(e.id))
    n = store.nbytes(e.id)
    times = []
    v = src.load(e.id)
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        v = src.load(e.id, reuse=[v])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    peak = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        peak.append(time.perf_counter() - t0)
    t, p = statistics.median(times), statistics.median(peak)
    return {"mbytes": round(n / 1e6, 1), "tier_gbps": round(n / t / 1e9, 2), "peak_gbps": round(n / p / 1e9, 2),
            "ratio": round(p / t, 3), "device": torch.cuda.get_device_name(0)}


if __name__ == "__main__":
    sys.exit(main())
