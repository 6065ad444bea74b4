"""The offline profiler: measure what the CoServe scheduler predicts with (paper §4.5).

For each (architecture, device kind) that the line can run, one expert of the
architecture stands for all of them (experts of one architecture have the same
parameters and FLOPs, so the paper profiles them once).  It is loaded through
the real tier code, run on real batches of synthetic component crops, and
timed.  Out come the `K*n + B` latency fit, the max useful batch, weight and
per-sample activation bytes, and the load latency from each tier, as a
`Profile` that says where and when it was measured.

What "load" means here is an expert switch in steady state: the skeleton for
the architecture is already built and a full pool recycles the buffer of an
evicted same-sized expert, so a load is the read (or copy) into that buffer
plus a rebind.  Skeleton construction happens once per executor and is not a
switch cost.

After the per-arch measurements, each device of the config gets its
concurrency curve: k = 1..K executor threads run the device's most used arch
at its max batch at once, and their aggregate throughput relative to one alone
is `DeviceProfile.concurrency` (the simulator shares a device's compute by it).

Last, the box's storage (`executors.storage_profiler`): the raw disk rate on
the same expert files and the exponent decoder's rate per thread, which price
a compressed expert's load and decide whether compression pays here.

The memory-split and executor-count searches live elsewhere (`executors.tuning`);
this module only measures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coe import CoEError, CoEModel, Expert

from . import storage_profiler
from .lockstep import run_in_lockstep
from .profile import ArchProfile, DeviceProfile, Profile, fit_latency, max_useful_batch

if TYPE_CHECKING:
    import numpy as np

    from edge_agent.config import LineConfig
    from storage.expert_store import ExpertStore
    from storage.flat import FlatWeights

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
CAP_SECONDS = 2.0          # a batch slower than this ends the sweep for its arch (keeps a run to minutes)
MIN_SAMPLE_SECONDS = 0.05  # a timed sample repeats a fast batch until it lasts about this long
MAX_LOOPS = 10
CONTENDED_CORES = 0.3      # other processes using more CPU than this (cores, on average) disturb a timing
ROUND_RETRIES = 2
RETRY_PAUSE_SECONDS = 0.5
POOR_FIT = 0.5             # a fit that misses a measured point by more than this gets a note
COLD_RESIDENT_MAX = 0.05   # a 'cold' file with more of its pages cached than this is reported as not cold
FIXED_STEPS = 4            # progress steps per target besides one per batch size and one per timed round:
                           # build, activation, ssd load, host load
CONCURRENCY_SECONDS = 0.5  # how long k concurrent executors run for one point of a device's concurrency curve
MIN_CONCURRENCY = 4        # a curve covers at least 1..4 executors (the executor-count search's range) ...
CUDA_CONCURRENCY = 4       # ... and a GPU's exactly that; a CPU's at most its cores

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """One (arch, device kind) to microbenchmark, and the expert of the store that stands for the arch."""

    arch: str
    kind: str                       # 'cpu' | 'cuda'
    device: str                     # the torch device it runs on: 'cpu' or the config's first 'cuda:N'
    expert: Expert
    components: tuple[str, ...]     # component types whose crops reach this expert (for realistic samples)

    @property
    def label(self) -> str:
        return Profile.key(self.arch, self.kind)


def device_kind(device: str) -> str:
    return "cpu" if device == "cpu" else "cuda"


def check_devices(cfg: "LineConfig") -> None:
    """Raise CoEError naming the device if the config asks for a GPU this machine does not have."""
    import torch

    for ex in cfg.executors:
        if device_kind(ex.device) != "cuda":
            continue
        if not torch.cuda.is_available():
            raise CoEError(f"{cfg.source}: executor device '{ex.device}' is not available: this machine has no "
                           f"CUDA GPU (torch {torch.__version__}); profile on the machine that has it, or "
                           f"list only cpu executors in the config")
        index = torch.device(ex.device).index or 0
        if index >= torch.cuda.device_count():
            raise CoEError(f"{cfg.source}: executor device '{ex.device}' is not available: this machine has "
                           f"{torch.cuda.device_count()} CUDA device(s)")


def plan_targets(cfg: "LineConfig", model: CoEModel, store: "ExpertStore") -> list[Target]:
    """The distinct (arch, device kind) pairs of the line, each with its stand-in expert.

    The stand-in is the most used expert of the arch that the store holds, so
    its input size is the one most requests see.
    """
    devices: dict[str, str] = {}
    for ex in cfg.executors:
        # 'cuda' means cuda:0; spelled out so buffers it allocates compare equal when recycled
        devices.setdefault(device_kind(ex.device), "cuda:0" if ex.device == "cuda" else ex.device)
    uses = model.expected_uses()
    by_arch: dict[str, list[Expert]] = {}
    for e in model.experts.values():
        by_arch.setdefault(e.arch, []).append(e)
    targets = []
    for arch, experts in by_arch.items():
        stored = [e for e in experts if store.has(e.id)]
        if not stored:
            raise CoEError(f"no expert of arch {arch} in the expert store {store.root} (needed to profile it; "
                           f"run: coe-agent zoo build --line {cfg.line})")
        expert = max(stored, key=lambda e: (uses.get(e.id, 0.0), e.id))
        for kind, device in devices.items():
            targets.append(Target(arch, kind, device, expert, _components_of(model, expert.id)))
    return targets


def step_count(targets: Sequence[Target], batch_sizes: Sequence[int], repeats: int, cfg: "LineConfig") -> int:
    """How many times `profile_line` calls `progress` (for a progress bar's total).

    Per target: one per batch size, one per timed round and FIXED_STEPS; per
    device of `cfg`: one for building its concurrency copies and one per point
    of its curve; then the storage's (storage_profiler.STEPS).
    """
    per_target = len(targets) * (len(set(batch_sizes)) + repeats + FIXED_STEPS)
    return per_target + sum(1 + k for k in concurrency_plan(cfg).values()) + storage_profiler.STEPS


def profiled_executors(cfg: "LineConfig", device: str) -> int:
    """The executor count whose thread share K and B of `device` are measured at (threads = cores // count).

    A GPU's K and B are one executor alone on it: 1.
    """
    if device_kind(device) == "cuda":
        return 1
    cores = os.cpu_count() or 1
    return max(1, cores // executor_threads(cfg))


def concurrency_plan(cfg: "LineConfig") -> dict[str, int]:
    """Device name -> K, the most concurrent executors its concurrency curve is measured for.

    CPU: max(MIN_CONCURRENCY, its configured count, the count K and B were
    profiled at), capped at the cores; GPU: CUDA_CONCURRENCY.
    """
    cores = os.cpu_count() or 1
    counts: dict[str, int] = {}
    for ex in cfg.executors:
        counts[ex.device] = counts.get(ex.device, 0) + ex.count
    return {name: CUDA_CONCURRENCY if device_kind(name) == "cuda"
            else max(1, min(cores, max(MIN_CONCURRENCY, n, profiled_executors(cfg, name))))
            for name, n in counts.items()}


def profile_line(cfg: "LineConfig", model: CoEModel, store: "ExpertStore", *,
                 batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, repeats: int = 3,
                 progress: Progress | None = None, cap_seconds: float = CAP_SECONDS,
                 concurrency_seconds: float = CONCURRENCY_SECONDS, decode_bytes: int | None = None) -> Profile:
    """Microbenchmark every (arch, device kind) of the line once; return the measured Profile.

    Runs with the intra-op thread count one executor of this config gets, so
    K and B are what one executor will see.  Then measures each device's
    concurrency curve, `concurrency_seconds` per point, and the storage: disk
    rate on the profiled experts' files, decode rate on a `decode_bytes`
    sample (default storage_profiler.DECODE_SAMPLE_BYTES).  Torch's thread
    setting is restored afterwards.
    """
    import torch

    sizes = sorted(set(int(b) for b in batch_sizes))
    if len(sizes) < 2 or sizes[0] < 1:
        raise CoEError(f"batch sizes must be at least two distinct positive integers, got {list(batch_sizes)}")
    if repeats < 1:
        raise CoEError(f"repeats must be at least 1, got {repeats}")
    if not concurrency_seconds > 0:
        raise CoEError(f"concurrency seconds must be positive, got {concurrency_seconds}")
    check_devices(cfg)
    targets = plan_targets(cfg, model, store)
    say = progress or (lambda msg: None)
    threads = executor_threads(cfg)
    saved = torch.get_num_threads()
    notes: list[str] = []
    archs: dict[str, ArchProfile] = {}
    watch = _Contention()
    devices = device_profiles(cfg)
    torch.set_num_threads(threads)
    try:
        for t in targets:
            archs[t.label] = _profile_target(t, cfg, store, sizes, repeats, cap_seconds, say, notes)
        for name, k_max in concurrency_plan(cfg).items():
            t = _concurrency_target(name, targets, model)
            curve, how = _measure_concurrency(name, t, archs[t.label].max_batch, cfg, store, k_max,
                                              concurrency_seconds, say)
            devices[name] = dataclasses.replace(devices[name], concurrency=curve, concurrency_source=how,
                                                profiled_executors=profiled_executors(cfg, name))
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(saved)
    storage = storage_profiler.profile_storage(store, [t.expert.id for t in targets], repeats=repeats,
                                               decode_bytes=decode_bytes, say=say)
    notes.extend(_input_size_notes(model, targets))
    others = watch.cores()
    if others is not None and others > CONTENDED_CORES:
        notes.append(f"other processes kept {others:.1f} of {os.cpu_count()} cores busy on average while "
                     f"profiling ({threads} thread(s) used here): latencies may be inflated; rerun on an idle machine")
    notes.append("load = steady-state switch: read (or copy) into a recycled same-size buffer + skeleton rebind; "
                 "'ssd' after dropping the file from the page cache, 'host' from a resident host copy")
    for name in sorted({ex.device for ex in cfg.executors if device_kind(ex.device) == "cuda"}):
        notes.append(f"{name}: {torch.cuda.get_device_name(torch.device(name))}")
    stamp = dt.datetime.now(dt.timezone.utc).astimezone().isoformat(timespec="seconds")
    source = (f"measured on {platform.node()} ({cpu_model()}, torch {torch.__version__}, {threads} threads) "
              f"at {stamp}")
    return Profile(source=source, devices=devices, archs=archs, notes=notes, storage=storage)


def executor_threads(cfg: "LineConfig") -> int:
    """Intra-op threads per executor, divided as the agent divides them."""
    total = sum(ex.count for ex in cfg.executors)
    return min(ex.threads or max(1, (os.cpu_count() or 1) // total) for ex in cfg.executors)


def device_profiles(cfg: "LineConfig") -> dict[str, DeviceProfile]:
    """One DeviceProfile per device of the config: its executors' summed budgets and their count."""
    memory: dict[str, int] = {}
    count: dict[str, int] = {}
    for ex in cfg.executors:
        memory[ex.device] = memory.get(ex.device, 0) + ex.memory * ex.count
        count[ex.device] = count.get(ex.device, 0) + ex.count
    out = {}
    for name in memory:
        kind = device_kind(name)
        host = cfg.cpu_tier if kind == "cuda" and not cfg.unified_memory else 0
        out[name] = DeviceProfile(name=name, kind=kind, memory=memory[name], executors=count[name], host_tier=host)
    return out


class _Contention:
    """How many cores other processes kept busy since this watch started, from /proc/stat (Linux).

    Machine-wide busy time minus this process's own CPU time, over wall time.
    Steal time counts as busy: a hypervisor taking the CPU disturbs a timing
    just as another process does.  `cores()` is None where /proc/stat is missing.
    """

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._c0 = _cpu_seconds()

    def cores(self) -> float | None:
        c1 = _cpu_seconds()
        wall = time.perf_counter() - self._t0
        if self._c0 is None or c1 is None or wall <= 0:
            return None
        return max(0.0, ((c1[0] - self._c0[0]) - (c1[1] - self._c0[1])) / wall)


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process) now."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(v) for v in fields[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if fields[0] != "cpu" or len(ticks) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / hz, own.user + own.system


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else whatever platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# -- one target ----------------------------------------------------------------------

class _Held:
    """A TierSource parent that hands over one given host copy: the host tier's resident value."""

    def __init__(self, store: "ExpertStore") -> None:
        self.store = store
        self.value: "FlatWeights | None" = None

    def size(self, expert_id: str) -> int:
        return self.store.nbytes(expert_id)

    def load(self, expert_id: str) -> "FlatWeights":
        if self.value is None:
            raise CoEError(f"profiler: no host copy of '{expert_id}' staged")
        return self.value


def _profile_target(t: Target, cfg: "LineConfig", store: "ExpertStore", sizes: list[int], repeats: int,
                    cap_seconds: float, say: Progress, notes: list[str]) -> ArchProfile:
    import torch

    from storage.pagecache import drop_from_page_cache, resident_fraction
    from storage.tiers import StoreSource, TierSource

    from .backends import get_backend
    from .skeletons import Skeletons

    backend = get_backend(t.arch)
    eid = t.expert.id
    path = store.path(eid)
    expert = t.expert if t.expert.uri else dataclasses.replace(t.expert, uri=str(path))
    cuda = t.kind == "cuda"
    sync = (lambda: torch.cuda.synchronize(t.device)) if cuda else (lambda: None)
    skeletons = Skeletons(t.device)

    # the first load builds the skeleton and verifies the file per the store's policy: untimed
    host_src = StoreSource(store, pin=cuda, method=cfg.expert_read, dtype=_compute_dtype(cfg, cuda))
    held = _Held(store)
    tier = TierSource(held, t.device) if cuda else None
    host = host_src.load(eid)
    held.value = host
    weights = tier.load(eid) if tier else host
    module = skeletons.bind(expert, weights)
    say(f"{t.label}: built from {eid} ({store.nbytes(eid) / 1e6:.1f} MB) on {t.device}")

    try:
        images = _sample_images(expert, t.components, sizes[-1])
        points = _time_batches(t, lambda n: (backend.run(module, expert, images[:n]), sync()), sizes, repeats,
                               cap_seconds, say, notes)
        k, b = fit_latency(points)
        best = max_useful_batch(points)
        better = [n for n, secs in points if n > best and secs / n < 0.8 * dict(points)[best] / best]
        if better:
            notes.append(f"{t.label}: max batch {best} is where the per-request latency first stopped improving, "
                         f"but batch {better[0]} is over 20% faster per request")
        miss, n_miss, s_miss = max((abs(k * n + b - secs) / secs, n, secs) for n, secs in points)
        if miss > POOR_FIT:
            notes.append(f"{t.label}: K*n+B is {miss:.0%} off at batch {n_miss} ({(k * n_miss + b) * 1e3:.1f} ms vs "
                         f"{s_miss * 1e3:.1f} ms measured): latency is not linear in the batch there, or the "
                         f"machine was busy")

        if cuda:
            sync()
            base = torch.cuda.memory_allocated(t.device)
            torch.cuda.reset_peak_memory_stats(t.device)
            backend.run(module, expert, images[:best])
            sync()
            act = math.ceil((torch.cuda.max_memory_allocated(t.device) - base) / best)
            say(f"{t.label}: activations {act / 1e6:.2f} MB/sample (allocator peak at batch {best})")
        else:
            act = int(backend.activation_bytes(expert, 1))
            say(f"{t.label}: activations {act / 1e6:.2f} MB/sample (traced)")

        # ssd: cold read into a recycled host buffer (+ copy into a recycled device buffer) + rebind
        timings: list[float] = []
        resident: list[float] = []
        dropped = True
        for _ in range(repeats):
            dropped = drop_from_page_cache(path) and dropped
            frac = resident_fraction(path)
            if frac is not None:
                resident.append(frac)
            t0 = time.perf_counter()
            host = host_src.load(eid, reuse=[host])
            if tier:
                held.value = host
                weights = tier.load(eid, reuse=[weights])
            else:
                weights = host
            skeletons.bind(expert, weights)
            sync()
            timings.append(time.perf_counter() - t0)
        ssd = statistics.median(timings)
        say(f"{t.label}: ssd load {ssd * 1e3:.1f} ms")
        if not dropped:
            notes.append(f"{t.label}: ssd load measured without dropping the page cache (no posix_fadvise here)")
        elif resident and max(resident) > COLD_RESIDENT_MAX:
            notes.append(f"{t.label}: ssd load not cold: {max(resident):.0%} of {path.name} stayed in the page "
                         f"cache after dropping it (tmpfs or mapped elsewhere)")

        # host: on cpu a page-cache-warm read; on cuda a copy from the resident pinned host copy
        timings = []
        if cuda:
            held.value = host
            for _ in range(repeats):
                t0 = time.perf_counter()
                weights = tier.load(eid, reuse=[weights])
                skeletons.bind(expert, weights)
                sync()
                timings.append(time.perf_counter() - t0)
        else:
            host_src.load(eid, reuse=[host])  # make sure the page cache holds the file
            for _ in range(repeats):
                t0 = time.perf_counter()
                host = host_src.load(eid, reuse=[host])
                skeletons.bind(expert, host)
                timings.append(time.perf_counter() - t0)
        warm = statistics.median(timings)
        say(f"{t.label}: host load {warm * 1e3:.1f} ms")
    finally:
        skeletons.unbind(eid)
        held.value = None
        if cuda:
            torch.cuda.empty_cache()

    entry = store.entry(eid)
    return ArchProfile(arch=t.arch, device=t.kind, K=k, B=b, max_batch=best, weight_bytes=host.nbytes,
                       activation_bytes=act, load_seconds={"ssd": ssd, "host": warm}, points=tuple(points),
                       ssd_stored_bytes=entry.stored_nbytes if entry.compression != "none" else 0)


# -- concurrency ---------------------------------------------------------------------

def _concurrency_target(device: str, targets: Sequence[Target], model: CoEModel) -> Target:
    """The target of `device`'s kind whose arch the line uses most (expected requests per frame)."""
    uses = model.expected_uses()
    by_arch: dict[str, float] = {}
    for e in model.experts.values():
        by_arch[e.arch] = by_arch.get(e.arch, 0.0) + uses.get(e.id, 0.0)
    mine = [t for t in targets if t.kind == device_kind(device)]
    return max(mine, key=lambda t: (by_arch.get(t.arch, 0.0), t.arch))


def _measure_concurrency(device: str, t: Target, batch: int, cfg: "LineConfig", store: "ExpertStore", k_max: int,
                         seconds: float, say: Progress) -> tuple[tuple[float, ...], str]:
    """`device`'s concurrency curve: aggregate throughput of k = 1..k_max executors relative to one.

    Each executor is a thread with its own copy of `t`'s module (sharing one
    copy of the weights) running batches of `batch` in a loop for `seconds`,
    all k starting together.  On a CPU each gets the thread share an executor
    would get, cores // k (torch's setting is process-wide and a thread reads
    it at its first parallel op, so it is set before the k threads start and
    the caller restores it); on a GPU each runs on its own CUDA stream.
    """
    import torch

    from storage.tiers import StoreSource, TierSource

    from .backends import get_backend
    from .skeletons import Skeletons

    cuda = t.kind == "cuda"
    where = "cuda:0" if device == "cuda" else device
    backend = get_backend(t.arch)
    eid = t.expert.id
    expert = t.expert if t.expert.uri else dataclasses.replace(t.expert, uri=str(store.path(eid)))
    host_src = StoreSource(store, pin=cuda, method=cfg.expert_read, dtype=_compute_dtype(cfg, cuda))
    held = _Held(store)
    held.value = host_src.load(eid)
    weights = TierSource(held, where).load(eid) if cuda else held.value
    skeletons = [Skeletons(where) for _ in range(k_max)]
    modules = [s.bind(expert, weights) for s in skeletons]
    images = _sample_images(expert, t.components, batch)
    cores = os.cpu_count() or 1
    say(f"{device}: concurrency: {k_max} executor copies of {eid} ({t.arch}) at batch {batch}")
    rates: list[float] = []
    try:
        for k in range(1, k_max + 1):
            if not cuda:
                torch.set_num_threads(max(1, cores // k))
            rates.append(_run_concurrently(backend, expert, modules[:k], images, seconds,
                                           torch.device(where) if cuda else None))
            say(f"{device}: {k} concurrent executor(s): {rates[-1]:.1f} requests/s "
                f"({rates[-1] / rates[0]:.2f}x one)")
    finally:
        for s in skeletons:
            s.unbind(weights)
        held.value = None
        if cuda:
            torch.cuda.empty_cache()
    curve = (1.0, *(round(r / rates[0], 4) for r in rates[1:]))
    if cuda:    # m streams cannot beat m whole GPUs (c(m) <= m, which the loader holds a GPU profile to): noise
        curve = tuple(min(c, float(m)) for m, c in enumerate(curve, 1))   # near 2x on a small model is clamped
    machine = torch.cuda.get_device_name(torch.device(where)) if cuda else f"{cpu_model()}, {cores} cores"
    how = (f"measured on {platform.node()} ({machine}) with {t.arch} at batch {batch}, {seconds:g} s per point"
           + ("" if cuda else "; k executors at cores // k threads each") + (", one CUDA stream each" if cuda else ""))
    return curve, how


def _run_concurrently(backend, expert: Expert, modules: Sequence[Any], images: list, seconds: float,
                      cuda: Any = None) -> float:
    """Requests per second of len(modules) threads running `images` batches at once for about `seconds`.

    Each thread warms up once, then all start together and each runs whole
    batches until `seconds` have passed; the aggregate is the sum of each
    thread's requests over its own elapsed time.  `cuda`: the torch device,
    each thread on its own stream; None on a CPU.
    """
    import torch

    k = len(modules)
    done: list[tuple[int, float] | None] = [None] * k

    def body(i: int, start) -> None:
        stream = torch.cuda.Stream(cuda) if cuda is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            backend.run(modules[i], expert, images)   # warm-up: this thread's pool, allocator, kernels
            if stream is not None:
                stream.synchronize()
            start()
            t0 = time.perf_counter()
            n = 0
            while True:
                backend.run(modules[i], expert, images)
                n += 1
                if time.perf_counter() - t0 >= seconds:
                    break
            if stream is not None:
                stream.synchronize()
            done[i] = (n * len(images), time.perf_counter() - t0)

    run_in_lockstep(body, k, "concurrency")
    return sum(d[0] / d[1] for d in done if d is not None and d[1] > 0)


def _time_batches(t: Target, run: Callable[[int], Any], sizes: list[int], repeats: int, cap_seconds: float,
                  say: Progress, notes: list[str]) -> list[tuple[int, float]]:
    """Median seconds per batch size: one warm-up each, then `repeats` rounds over all sizes.

    Rounds interleave the sizes, so a burst of load from another process
    lands on one repeat of several sizes (which the median drops) instead of
    on every repeat of one size (which would bend the fit).  A fast batch is
    run several times per sample, and the sample is the best of those runs (as
    timeit advises: noise only ever adds time), until a sample spans about
    MIN_SAMPLE_SECONDS.  A warm-up slower than `cap_seconds` ends the sweep
    once two sizes are kept.
    """
    def timed(n: int, loops: int = 1) -> float:
        best = math.inf
        for _ in range(loops):
            t0 = time.perf_counter()
            run(n)
            best = min(best, time.perf_counter() - t0)
        return best

    loops: dict[int, int] = {}
    last = 0.0
    for n in sizes:
        if len(loops) >= 2 and last > cap_seconds:
            say(f"{t.label}: batch {n}: skipped (batch {max(loops)} took over {cap_seconds:g} s)")
            continue
        last = timed(n)  # warm-up: allocator, kernel selection, caches
        loops[n] = min(MAX_LOOPS, max(1, math.ceil(MIN_SAMPLE_SECONDS / max(last, 1e-6))))
        say(f"{t.label}: batch {n}: warm-up {last * 1e3:.1f} ms")
    if len(loops) < len(sizes):
        notes.append(f"{t.label}: batch sizes above {max(loops)} skipped (a batch took over {cap_seconds:g} s)")
    times: dict[int, list[float]] = {n: [] for n in loops}
    redone, contended = 0, 0.0
    for r in range(repeats):
        kept: tuple[float, dict[int, float]] | None = None
        for attempt in range(1 + ROUND_RETRIES):
            if attempt:
                time.sleep(RETRY_PAUSE_SECONDS)  # bursts of other work are often short: let this one pass
                redone += 1
            watch = _Contention()
            sample = {n: timed(n, loops[n]) for n in loops}
            others = watch.cores() or 0.0
            if kept is None or others < kept[0]:
                kept = (others, sample)
            if others <= CONTENDED_CORES:
                break
        contended = max(contended, kept[0])
        for n, secs in kept[1].items():
            times[n].append(secs)
        if r < repeats - 1:
            say(f"{t.label}: timed round {r + 1}/{repeats}")
    if redone:
        notes.append(f"{t.label}: {redone} timed round(s) re-run because other processes were using the CPU"
                     + (f"; still {contended:.1f} core(s) busy elsewhere in the worst round kept"
                        if contended > CONTENDED_CORES else ""))
    points = [(n, statistics.median(times[n])) for n in loops]
    say(f"{t.label}: timed round {repeats}/{repeats}; median ms per batch: "
        + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in points))
    return points


def _components_of(model: CoEModel, expert_id: str) -> tuple[str, ...]:
    """Component types whose requests reach `expert_id`: directly, or through a classifier that leads to it."""
    firsts = {expert_id, *model.preliminaries(expert_id)}
    return tuple(c.name for c in model.components.values() if c.classifier in firsts)


def _sample_images(expert: Expert, components: Sequence[str], n: int) -> list["np.ndarray"]:
    """`n` uint8 crops at the expert's input size: drawn components where the spec names some, else noise."""
    import numpy as np

    from storage.synthetic import LABELS, draw_component

    rng = np.random.default_rng(0)
    size = expert.input_size
    if not components or not 16 <= size <= 1024:
        return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]
    return [draw_component(components[i % len(components)], LABELS[i % len(LABELS)] if i % 5 == 4 else "ok",
                           rng, size=size) for i in range(n)]


def _input_size_notes(model: CoEModel, targets: Sequence[Target]) -> list[str]:
    """Say where one arch serves several input sizes, since its profile was measured at one."""
    out = []
    for t in {t.arch: t for t in targets}.values():
        others = sorted({e.input_size for e in model.experts.values() if e.arch == t.arch} - {t.expert.input_size})
        if others:
            out.append(f"{t.arch}: measured at input {t.expert.input_size} px ({t.expert.id}); "
                       f"other experts of the arch use {', '.join(map(str, others))} px")
    return out


# -- plots ---------------------------------------------------------------------------

def plot_profile(profile: Profile, out_dir: str | Path) -> list[Path]:
    """Write the profile's PNGs into `out_dir`; return the paths written.

    latency_vs_batch.png always; throughput_vs_experts.png when a device has
    memory-split points; throughput_vs_executors.png when one has count points;
    concurrency.png when one has a concurrency curve.
    """
    import matplotlib

    matplotlib.use("Agg")  # here, not at import: importing this module must not change matplotlib for others
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_plot_latency(plt, profile, out_dir / "latency_vs_batch.png")]
    split = {k: d for k, d in profile.devices.items() if d.split_points}
    if split:
        written.append(_plot_split(plt, profile, split, out_dir / "throughput_vs_experts.png"))
    count = {k: d for k, d in profile.devices.items() if d.count_points}
    if count:
        written.append(_plot_count(plt, profile, count, out_dir / "throughput_vs_executors.png"))
    curves = {k: d for k, d in profile.devices.items() if d.concurrency}
    if curves:
        written.append(_plot_search(plt, profile, curves, out_dir / "concurrency.png", field="concurrency",
                                    xlabel="executors busy at once",
                                    ylabel="aggregate throughput (x one executor)",
                                    title="concurrency: throughput of k executors sharing the device"))
    return written


def _plot_latency(plt, profile: Profile, path: Path) -> Path:
    fig, (ax_b, ax_r) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, (key, a) in enumerate(sorted(profile.archs.items())):
        color = f"C{i % 10}"
        pts = sorted(a.points)
        if pts:
            ns = [p[0] for p in pts]
            xs = [ns[0] + (ns[-1] - ns[0]) * j / 50 for j in range(51)]
            ax_b.plot(ns, [s * 1e3 for _, s in pts], "o", color=color, label=f"{key} measured")
            ax_b.plot(xs, [a.batch_seconds(x) * 1e3 for x in xs], "--", color=color,
                      label=f"fit K={a.K * 1e3:.2f} ms, B={a.B * 1e3:.2f} ms")
            ax_r.plot(ns, [s / n * 1e3 for n, s in pts], "o-", color=color, label=key)
        star = dict(pts).get(a.max_batch, a.batch_seconds(a.max_batch))  # measured where it was, else the fit
        ax_b.plot([a.max_batch], [star * 1e3], "*", color=color, markersize=14)
        ax_r.plot([a.max_batch], [star / a.max_batch * 1e3], "*", color=color, markersize=14)
    ax_b.set(xlabel="batch size", ylabel="batch latency (ms)", title="latency vs batch size (★ max batch)")
    ax_r.set(xlabel="batch size", ylabel="latency per request (ms)", title="average latency per request")
    sizes = sorted({n for a in profile.archs.values() for n, _ in a.points}
                   | {a.max_batch for a in profile.archs.values()})
    for ax in (ax_b, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    ax_b.legend(fontsize=7)
    ax_r.legend(fontsize=7)
    fig.suptitle(profile.source, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_search(plt, profile: Profile, devices: dict[str, DeviceProfile], path: Path, *, field: str,
                 xlabel: str, title: str, ylabel: str = "throughput (requests/s)") -> Path:
    """Throughput against the searched quantity, one line per device, with the search's outcome marked.

    `field` names (x, y) points of the device, or "concurrency": its curve
    (y at x = 1..k), with the chosen executor count marked as for the count search.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, d) in enumerate(sorted(devices.items())):
        color = f"C{i % 10}"
        raw = getattr(d, field)
        order = [(k, c) for k, c in enumerate(raw, 1)] if field == "concurrency" else list(raw)
        pts = sorted(order)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=name)
        if field == "split_points":
            # the decay-window search ends on its final window: from the previous point to the last one measured
            low = order[-2][0] if len(order) > 1 else 0
            ax.axvspan(low, order[-1][0], color=color, alpha=0.15, label=f"{name} final window [{low}, {order[-1][0]}]")
        else:
            ax.axvline(d.executors, color=color, linestyle=":", label=f"{name} chosen: {d.executors}")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(profile.source, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_split(plt, profile: Profile, devices: dict[str, DeviceProfile], path: Path) -> Path:
    return _plot_search(plt, profile, devices, path, field="split_points", xlabel="experts loaded",
                        title="memory split: throughput vs experts")


def _plot_count(plt, profile: Profile, devices: dict[str, DeviceProfile], path: Path) -> Path:
    return _plot_search(plt, profile, devices, path, field="count_points", xlabel="executors",
                        title="executor count: throughput vs executors")


def _compute_dtype(cfg, cuda: bool) -> str:
    """The dtype the agent's pools would load this device's experts in (profile what runs)."""
    from storage.tiers import source_dtype

    return source_dtype(getattr(cfg, "gpu_compute_dtype" if cuda else "cpu_compute_dtype", "stored"))
