"""Fewer bytes per switch (issue #12): half-precision storage and lossless exponent compression.

Real run on this machine, every figure measured side by side in one run:

  ratio      compressed / plain file bytes of the trained MoE's experts (the small
             Mixtral-style model `coe-agent llm make-model --trained` trains here),
             stored as bf16, fp16 and fp32, and of the line A vision zoo in fp32
             and fp16, next to each one's entropy bound (8+H)/16 (bf16; for fp16
             H is the coded high byte's entropy) or (24+H)/32 (fp32).
                                                     target bf16 <= 0.69, bound + 2 points
  decode     decoded bytes per second per core: one thread on trained-like bf16
             weights, and whole compressed experts decoded from the page cache
             on one thread and on every core.        target >= 1 GB/s per core
  cold load  page cache dropped before every read: a plain bf16 expert against
             the same expert compressed, alternating, verify off for both (the
             sha256 costs both the same).  Each expert is several trained
             experts' tensors concatenated, about 50 MB, like a real expert slice.
                                                     target <= 0.8x, decoded B/s > raw disk B/s
  vision     verdict agreement of the fp16-stored line A zoo (cast to fp32 on
             load, the CPU pool's compute dtype) with the fp32 zoo, on one
             replayed recording through the real agent.  target >= 99.5%

Usage:  python bench/compression.py [--moe var/llm/trained-hf] [--dir var/bench/compression]
                                    [--repeats 5] [--frames 600] [--skip-vision] [--json-only]
Without a trained model at --moe the MoE rows use generated N(0, 0.02) weights and say so.
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from coe import Expert  # noqa: E402
from storage.compressed import decode_threads, decode_to, read_header  # noqa: E402
from storage.exponent_codec import measure_decode_rate  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from bench.expert_load import cold  # noqa: E402  (drop a file from the page cache, checked)

MB = 1e6


def compressed_copy(src: ExpertStore, dst_root: Path) -> ExpertStore:
    """A compressed copy of a plain store (the plain one stays for side-by-side reads)."""
    if dst_root.exists():
        shutil.rmtree(dst_root)
    shutil.copytree(src.root, dst_root)
    dst = ExpertStore(dst_root, verify="never")
    dst.set_compression("exponent-zstd")
    for e in dst.entries():
        dst.recompress(e.id)
    return dst


def ratio_row(name: str, source: str, store: ExpertStore) -> dict:
    entries = store.entries()
    plain = sum(e.plain_nbytes for e in entries)
    stored = sum(e.stored_nbytes for e in entries)
    bound = sum(e.bound_nbytes for e in entries)
    return {"set": name, "weights": source, "dtype": entries[0].dtype, "experts": len(entries),
            "plain_mb": round(plain / MB, 2), "stored_mb": round(stored / MB, 2), "ratio": round(stored / plain, 4),
            "bound": round(bound / plain, 4), "gap_points": round(100 * (stored - bound) / plain, 2)}


# -- the MoE ---------------------------------------------------------------------------------------------
def moe_stores(moe: Path, work: Path) -> tuple[dict[str, ExpertStore], str]:
    """Plain stores of the MoE's experts in bf16, fp16 and fp32."""
    out: dict[str, ExpertStore] = {}
    if (moe / "config.json").is_file():
        from storage.llm_import import import_checkpoint

        for dt in ("bf16", "fp16", "fp32"):
            root = work / f"moe-{dt}"
            if not (root / "llm.json").is_file():
                if root.exists():
                    shutil.rmtree(root)
                import_checkpoint(moe, root, dtype=dt)
            out[dt] = ExpertStore(root, verify="never")
        return out, f"trained ({moe})"
    gen = torch.Generator().manual_seed(0)
    tensors = [{"w1": torch.randn(512, 256, generator=gen) * 0.02, "w2": torch.randn(256, 512, generator=gen) * 0.02}
               for _ in range(16)]
    for dt, torch_dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        root = work / f"gen-{dt}"
        if root.exists():
            shutil.rmtree(root)
        st = ExpertStore(root, verify="never")
        for i, t in enumerate(tensors):
            st.write(Expert(f"gen.E{i:03d}", "moe/expert", "expert", (), 0), {k: v.to(torch_dt) for k, v in t.items()})
        out[dt] = st
    return out, "generated N(0, 0.02), no trained model at --moe"


def big_experts(src: ExpertStore, work: Path, target_mb: float = 48.0, count: int = 3) -> ExpertStore:
    """`count` plain bf16 experts of about `target_mb`, each the trained experts' tensors side by side.

    A trained model this box can train is small (64 experts, 13 MB in bf16);
    real expert slices are tens to hundreds of MB, and a cold load of a
    small file measures latency, not bandwidth.  Each big expert takes the
    trained tensors in a different order, repeated as needed, so its bytes
    have exactly the trained exponent distribution.
    """
    root = work / "cold-bf16"
    if root.exists():
        shutil.rmtree(root)
    dst = ExpertStore(root, verify="never")
    tensors = [(f"{e.id}.{k}", v) for e in src.entries() for k, v in src.read(e.id).items()]
    rng = np.random.default_rng(0)
    for n in range(count):
        group: dict[str, torch.Tensor] = {}
        size, rep = 0, 0
        while size < target_mb * MB:
            for i in rng.permutation(len(tensors)):
                name, v = tensors[i]
                group[f"r{rep}.{name}"] = v.clone()
                size += v.numel() * v.element_size()
            rep += 1
        dst.write(Expert(f"big{n:02d}", "moe/expert", "expert", (), 0), group)
    return dst


# -- decode and cold load --------------------------------------------------------------------------------
def decode_rates(zstore: ExpertStore) -> dict:
    """Decoded bytes/s of whole experts from the page cache (decode-bound), 1 thread and every core."""
    headers = {e.id: read_header(zstore.root / e.file, e.id) for e in zstore.entries()}
    bufs = {eid: np.empty(h.layout.nbytes, np.uint8) for eid, h in headers.items()}
    total = sum(h.layout.nbytes for h in headers.values())
    out = {}
    for threads in sorted({1, decode_threads()}):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for eid, h in headers.items():
                decode_to(zstore.root / zstore.entry(eid).file, h, eid, bufs[eid], threads=threads)
            best = min(best, time.perf_counter() - t0)
        out[threads] = total / best
    return out


def raw_read_seconds(path: Path) -> float:
    buf = bytearray(16 << 20)
    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0


@contextlib.contextmanager
def read_throttle(path: Path, bps: int | None):
    """Run the block inside a blkio cgroup (v1) that caps this process's reads of `path`'s disk at `bps`.

    A line box's disk (SATA SSD about 500 MB/s, eMMC about 250) is slower
    than this VM's; the kernel's throttle makes the same files come off the
    disk at that speed, for the plain and the compressed load alike.
    """
    if not bps:
        yield "raw"
        return
    root = Path("/sys/fs/cgroup/blkio")
    if not (root / "blkio.throttle.read_bps_device").exists():
        raise SystemExit("--disk-mbps needs the cgroup v1 blkio controller (and root)")
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    parent = Path(f"/sys/dev/block/{major}:{minor}/..")
    if (parent / "dev").is_file() and (Path(f"/sys/dev/block/{major}:{minor}") / "partition").exists():
        major, minor = (int(x) for x in (parent / "dev").read_text().split(":"))   # throttle the whole disk
    group = root / f"coe-bench-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{major}:{minor} {int(bps)}")
        (group / "cgroup.procs").write_text(str(os.getpid()))
        yield f"{bps / MB:.0f} MB/s (blkio throttle on {major}:{minor})"
    finally:
        (root / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()


def settle(bps: int | None) -> None:
    """Let the throttle go idle before a timed read, so every read starts from the same state.

    The kernel's throttle accounts bytes in time slices; a read that starts
    inside a slice another read used (or left unused) runs faster or slower
    than the cap.  After half a second idle each read gets the same fresh
    slice: a small fixed burst, then the capped rate.
    """
    if bps:
        time.sleep(0.5)


def cold_loads(plain: ExpertStore, zstore: ExpertStore, repeats: int, *, bps: int | None = None) -> list[dict]:
    rows = []
    for e in plain.entries():
        p_path, z_path = plain.root / e.file, zstore.root / zstore.entry(e.id).file
        raw, pt, zt = [], [], []
        for r in range(repeats):
            order = ("raw", "plain", "z") if r % 2 == 0 else ("z", "plain", "raw")
            for what in order:
                path = z_path if what == "z" else p_path
                cold(path)
                settle(bps)
                if what == "raw":
                    raw.append(raw_read_seconds(path))
                    continue
                t0 = time.perf_counter()
                flat = (zstore if what == "z" else plain).read_flat(e.id)
                (zt if what == "z" else pt).append(time.perf_counter() - t0)
                assert flat.nbytes == e.nbytes
        z = zstore.entry(e.id)
        rows.append({"expert": e.id, "mb": round(e.nbytes / MB, 1), "ratio": round(z.ratio, 4),
                     "raw_read_mbps": round(p_path.stat().st_size / statistics.median(raw) / MB),
                     "plain_ms": round(1e3 * statistics.median(pt), 2), "z_ms": round(1e3 * statistics.median(zt), 2),
                     "load_ratio": round(statistics.median(zt) / statistics.median(pt), 3),
                     "z_decoded_mbps": round(e.nbytes / statistics.median(zt) / MB)})
    return rows


# -- vision ------------------------------------------------------------------------------------------------
def vision(work: Path, frames: int, quiet: bool) -> tuple[list[dict], dict]:
    from coe import load_spec
    from edge_agent.config import find_config, load_config
    from edge_agent.demo import ensure_recording, run_demo
    from edge_agent.zoo import build_zoo
    from edge_agent.demo import sample_images_for
    from storage.results import ResultStore

    base = load_config(find_config("A"))
    model = load_spec(base.spec_path)
    verdicts, ratios, runs = {}, [], {}
    rec = None
    for dt in ("fp32", "fp16"):
        d = work / f"vision-{dt}"
        cfg = base.model_copy(update={"data_dir": str(d), "expert_store": str(d / "experts"),
                                      "results_db": str(d / "results.db")})
        store = ExpertStore(cfg.store_path)
        build_zoo(model, store, seed=0, sample_images=sample_images_for(model, seed=0), dtype=dt)
        ratios.append(ratio_row(f"vision zoo line A ({dt})", "generated + calibrated (zoo build)",
                                compressed_copy(store, d / "experts-z")))
        rec = rec or ensure_recording(cfg, model, frames, 0, quiet=True)
        result = run_demo(cfg, model, recording=rec, quiet=quiet)
        runs[dt] = {k: result.summary[k] for k in ("verdicts", "by_verdict", "throughput_fps", "expert_loads")}
        rs = ResultStore(Path(result.summary["database"]), readonly=True)
        try:
            verdicts[dt] = dict(rs.db.execute("SELECT frame_id, verdict FROM verdicts").fetchall())
        finally:
            rs.close()
    common = set(verdicts["fp32"]) & set(verdicts["fp16"])
    agree = sum(verdicts["fp32"][f] == verdicts["fp16"][f] for f in common)
    return ratios, {"frames": len(common), "agree": agree, "agreement": round(agree / max(1, len(common)), 5),
                    "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--moe", default="var/llm/trained-hf", help="a trained HF MoE checkpoint directory")
    ap.add_argument("--dir", default="var/bench/compression", help="work directory (stores are rebuilt here)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--frames", type=int, default=600)
    ap.add_argument("--disk-mbps", default="raw,500,250",
                    help="disk read speeds to run the cold loads at: 'raw' (this machine's disk) and MB/s caps "
                         "(a blkio throttle; 500 is a SATA SSD, 250 an eMMC)")
    ap.add_argument("--skip-vision", action="store_true")
    ap.add_argument("--json-only", action="store_true")
    a = ap.parse_args()
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    say = (lambda *_: None) if a.json_only else print

    plain, source = moe_stores(Path(a.moe), work)
    zs = {dt: compressed_copy(st, work / f"{st.root.name}-z") for dt, st in plain.items()}
    ratios = [ratio_row(f"MoE experts ({dt})", source, zs[dt]) for dt in ("bf16", "fp16", "fp32")]
    one_thread = measure_decode_rate()
    small_rates = decode_rates(zs["bf16"])
    big = big_experts(plain["bf16"], work)
    zbig = compressed_copy(big, work / "cold-bf16-z")
    rates = decode_rates(zbig)
    loads = []
    for speed in a.disk_mbps.split(","):
        bps = None if speed.strip() == "raw" else int(float(speed) * MB)
        with read_throttle(big.root, bps) as disk:
            loads += [{"disk": disk, **r} for r in cold_loads(big, zbig, a.repeats, bps=bps)]
    vis_ratios, agreement = ([], None) if a.skip_vision else vision(work, a.frames, a.json_only)
    ratios += vis_ratios

    cores = os.cpu_count()
    say(f"compression: real run on {cores} CPU cores ({decode_threads()} decode threads), stores under {work}")
    say(f"{'ratio':10} {'set':28} {'dtype':9} {'experts':>7} {'plain MB':>9} {'stored MB':>9} {'ratio':>6} "
        f"{'bound':>6} {'gap pt':>6}  weights")
    for r in ratios:
        say(f"{'':10} {r['set']:28} {r['dtype']:9} {r['experts']:7} {r['plain_mb']:9.1f} {r['stored_mb']:9.1f} "
            f"{r['ratio']:6.3f} {r['bound']:6.3f} {r['gap_points']:6.2f}  {r['weights']}")
    def per_core(r: dict) -> str:
        return ", ".join(f"{t} thread{'s' if t > 1 else ''} {v / 1e9:.2f} GB/s ({v / t / 1e9:.2f} per core)"
                         for t, v in r.items())
    say(f"{'decode':10} decoded bytes/s, page cache warm (decode-bound)  target >= 1 GB/s per core")
    say(f"{'':10} codec alone, one thread, trained-like bf16 in 512 KiB chunks: {one_thread / 1e9:.2f} GB/s")
    say(f"{'':10} whole {big.entries()[0].nbytes / MB:.0f} MB experts (decode_to): {per_core(rates)}")
    say(f"{'':10} the 64 trained experts, {zs['bf16'].entries()[0].nbytes / MB:.2f} MB each: {per_core(small_rates)}"
        f" (a load's fixed cost dominates at this size)")
    say(f"{'cold load':10} {'disk':40} {'expert':8} {'MB':>6} {'ratio':>6} {'raw MB/s':>9} {'plain ms':>9} "
        f"{'zstd ms':>8} {'load':>6} {'decoded MB/s':>12}  target load <= 0.8x, decoded > raw")
    for r in loads:
        say(f"{'':10} {r['disk']:40} {r['expert']:8} {r['mb']:6.1f} {r['ratio']:6.3f} {r['raw_read_mbps']:9} "
            f"{r['plain_ms']:9.1f} {r['z_ms']:8.1f} {r['load_ratio']:6.3f} {r['z_decoded_mbps']:12}")
    by_disk = {d: statistics.median(r["load_ratio"] for r in loads if r["disk"] == d)
               for d in dict.fromkeys(r["disk"] for r in loads)}
    med_load = by_disk
    say(f"{'':10} median load ratio by disk: " + ", ".join(f"{d}: {v:.3f}" for d, v in by_disk.items())
        + " (page cache dropped before each read; verify off for both)")
    if agreement is not None:
        say(f"{'vision':10} fp16-stored vs fp32 zoo, {agreement['frames']} replayed frames: "
            f"{agreement['agree']} verdicts agree = {100 * agreement['agreement']:.2f}%  target >= 99.5%  "
            f"(runs: {json.dumps(agreement['runs'])})")
    print(json.dumps({"bench": "compression", "real_run": True, "cores": cores, "decode_threads": decode_threads(),
                      "ratios": ratios, "decode_gbps_one_thread": round(one_thread / 1e9, 3),
                      "decode_gbps_big_experts": {str(t): round(v / 1e9, 3) for t, v in rates.items()},
                      "decode_gbps_trained_experts": {str(t): round(v / 1e9, 3) for t, v in small_rates.items()},
                      "cold": loads, "cold_load_ratio_median": med_load, "vision": agreement}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
