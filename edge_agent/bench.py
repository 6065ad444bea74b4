"""`coe-agent bench`: CoServe against Samba-CoE and the ablations, side by side in one run.

Simulation (`--sim`): the production scheduler and pools on a virtual clock
with a profile's costs (default: the documented GPU-class profile in
configs/profiles/gpu-class.json).  Real (`--real`): small real experts
(resnet18 classifiers, yolov8n detectors) on this machine's CPU, cold SSD
loads, a memory budget that forces switching.  Every row says which it is.

With a compression what-if (`SimCompression`, `--compression-ratio`), each
system also runs with every expert stored exponent-compressed at that ratio
and decoded at the given rate, and `compare` puts the two side by side.
"""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path

from coe.workload import make_workload, task
from executors.costs import StoredLookup, uniform_forms
from executors.links import Link
from executors.profile import Profile, StorageProfile
from executors.simdevice import SimExecutor, SimReport, SimSystem, decision_overhead, simulate
from executors.systems import MAX_WAIT, build_system

REPO = Path(__file__).resolve().parent.parent
GPU_CLASS = REPO / "configs" / "profiles" / "gpu-class.json"


# A rate is sustained when the backlog left at the last arrival drains within 1% of the run: an overload of
# x% leaves a backlog of about x% of the run, so at most a 1% overload passes.
SUSTAIN_TAIL = 0.01
SUSTAIN_FLOOR = 1e-6    # the bisection gives up below this share of the flood throughput


@dataclass(frozen=True)
class SimCompression:
    """The what-if of `bench --sim --compression-ratio`: every expert stored at `ratio` of its bytes.

    `storage` carries the decode rate (per thread, and the threads a load
    decodes with) and the disk rate; a disk rate of None means each arch's
    own profiled plain load rate (weight bytes over its SSD load), which is
    how a profile without a measured disk (the GPU-class one) states its SSD.
    """

    ratio: float
    storage: StorageProfile

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ValueError(f"compression ratio must be in (0, 1] (stored over plain bytes), got {self.ratio}")
        if not self.storage.decode_total_bps:
            raise ValueError("a compression what-if needs a decode rate")

    def profile(self, profile: Profile) -> Profile:
        return replace(profile, storage=self.storage)

    def load_factors(self, profile: Profile) -> dict[str, float]:
        """Per arch@device of `profile`: a compressed SSD load's time over the plain one's (transfer only)."""
        out = {}
        for key, a in profile.archs.items():
            if "ssd" not in a.load_seconds or a.load_seconds["ssd"] <= 0:
                continue
            disk = self.storage.disk_bps or a.weight_bytes / a.load_seconds["ssd"]
            out[key] = max(self.ratio, disk / self.storage.decode_total_bps)
        return out


def sim_compression(profile: Profile, ratio: float, decode_rate: float | str | None,
                    decode_threads: int | None) -> SimCompression:
    """The what-if for `bench --sim`: `decode_rate` in decoded bytes/s per thread, 'here' to measure it on
    this machine now (the bf16 sample), or None for the profile's (its load decode rate on the line's
    experts where it has one); the disk stays the profile's.  Raises ValueError naming the option when no
    decode rate is to be had."""
    from executors.storage_profiler import loader_decode_threads, measure_decode_contended

    if decode_threads is not None and not (isinstance(decode_threads, int) and decode_threads >= 1):
        raise ValueError(f"--decode-threads must be an integer >= 1 (threads one load decodes with), "
                         f"got {decode_threads!r}")
    have = profile.storage
    disk = have.disk_bps if have is not None else None
    if decode_rate == "here":
        threads = decode_threads or loader_decode_threads()
        n = max(2, threads)
        per_thread = measure_decode_contended(n) / n
        source = (f"decode measured here on {platform.node()} ({os.cpu_count()} cores): bf16 exponent-zstd, "
                  f"per thread with {n} decoding at once")
    elif decode_rate is not None:
        threads, per_thread = decode_threads or 1, float(decode_rate)
        source = "decode rate given on the command line (--decode-rate)"
    elif have is not None and have.decode_total_bps:
        if decode_threads is not None:
            have = replace(have, decode_threads=decode_threads)
        storage = replace(have, ratio=ratio, source=f"decode and disk from the profile ({have.source})")
        return SimCompression(ratio, storage)
    else:
        raise ValueError(f"--compression-ratio needs a decode rate and the profile ({profile.source[:60]}...) has "
                         f"none: pass --decode-rate BYTES_PER_S (per thread) or --decode-rate here, or a --profile "
                         f"written by `coe-agent profile` (it measures one)")
    if not (per_thread > 0 and math.isfinite(per_thread)):
        raise ValueError(f"--decode-rate must be positive (decoded bytes per second per thread), got {decode_rate}")
    disk_how = ("disk from the profile's measured rate" if disk else
                "disk: each arch's profiled SSD load rate (weight bytes / SSD load seconds)")
    storage = StorageProfile(disk_bps=disk, decode_bps=per_thread, decode_threads=threads, ratio=ratio,
                             source=f"{source}; {disk_how}")
    return SimCompression(ratio, storage)


def run_sim(workloads: list[str], profile: Profile, systems: list[str], *, init: str = "warm",
            overrides: dict | None = None, loads: tuple[float, ...] = (),
            load_systems: tuple[str, ...] = ("coserve", "coserve-paper", "samba"),
            compression: SimCompression | None = None) -> dict[str, list[SimReport]]:
    """Each system on each task, side by side; with `loads`, also at F x its own saturation rate.

    The task itself (one frame every 4 ms) floods every system: its throughput
    is the paper's offline metric, and a flood lets a system batch a board's
    requests across many boards.  A line cannot wait that long, so for `loads`
    the saturation rate is the highest steady arrival rate the system
    sustains (`sustained_rate`), and for each F the same frames arrive evenly
    spaced at F x that rate; the report's `latency[F]` holds p50/p99 there.
    With `compression`, every expert is stored compressed (see SimCompression);
    the systems themselves (memory, executors) are the plain run's.
    """
    out = {}
    plain = profile
    if compression is not None:
        profile = compression.profile(profile)
    for wl in workloads:
        spec = task(wl, **(overrides or {}))
        w = make_workload(spec)
        stored = uniform_forms(w.model, compression.ratio) if compression is not None else None
        reps = []
        for s in systems:
            system = build_system(s, plain, init=init)
            rep = simulate(w, profile, system, stored=stored)
            if loads and s in load_systems:
                rate = sustained_rate(spec, profile, system, rep.throughput, stored=stored)
                rep.sustained_rate = round(rate, 3)
                for f in loads:
                    r = simulate(make_workload(replace(spec, interval=1.0 / (f * rate))), profile, system,
                                 stored=stored)
                    rep.latency[f] = {"p50_s": round(r.p50_ms / 1000, 3), "p99_s": round(r.p99_ms / 1000, 3),
                                      "rate": round(f * rate, 3), "aged": r.aged}
            reps.append(rep)
        out[wl] = reps
    return out


def sustains(spec, profile: Profile, system: SimSystem, rate: float, *, stored: StoredLookup | None = None) -> bool:
    """True if frames arriving evenly at `rate` leave a backlog that drains within SUSTAIN_TAIL of the run."""
    w = make_workload(replace(spec, interval=1.0 / rate))
    span = w.arrivals[-1].t
    if not span > 0:        # one frame: no arrival rate to sustain, and every backlog test would fail
        raise ValueError(f"a sustained rate needs frames arriving over time: the task has {len(w.arrivals)} "
                         f"frame(s) (--requests must be at least 2 with --load)")
    r = simulate(w, profile, system, stored=stored)
    return r.makespan - span <= SUSTAIN_TAIL * span


def sustained_rate(spec, profile: Profile, system: SimSystem, flood: float, *, precision: float = 0.03,
                   stored: StoredLookup | None = None) -> float:
    """The highest steady arrival rate (frames/s) `system` sustains, by bisection below its flood throughput."""
    if not (flood > 0 and math.isfinite(flood)):
        raise ValueError(f"{system.name}: no sustained rate below a flood throughput of {flood} frames/s")
    lo, hi = 0.0, flood
    if sustains(spec, profile, system, hi, stored=stored):
        return hi
    while hi - lo > precision * hi:
        if hi < flood * SUSTAIN_FLOOR:   # bisected to nothing: it sustains no rate (hi would underflow to 0)
            raise ValueError(f"{system.name}: sustains no steady arrival rate down to {hi:.3g} frames/s "
                             f"({SUSTAIN_FLOOR:g} of its flood throughput, {flood:.3g}/s)")
        mid = (lo + hi) / 2 if lo else hi / 4
        if sustains(spec, profile, system, mid, stored=stored):
            lo = mid
        else:
            hi = mid
    return lo


def overhead(profile: Profile, workload: str = "B2") -> float:
    w = make_workload(task(workload))
    return decision_overhead(w, profile, build_system("coserve", profile), queued=3500)


def real_systems(memory: int, coserve_experts: int, samba_experts: int) -> dict[str, SimSystem]:
    """One CPU executor each, the same memory: CoServe reserves activations for its max batch, Samba-CoE
    (FCFS, one request at a time) for one request; the rest holds experts."""
    return {"coserve": SimSystem("coserve", (SimExecutor("cpu#0", "cpu", memory, coserve_experts),), "coserve",
                                 "coserve", max_wait=MAX_WAIT),
            "samba": SimSystem("samba", (SimExecutor("cpu#0", "cpu", memory, samba_experts),), "fcfs", "lru")}


def activation_reserves(model, profile: Profile | None, default_max_batch: int = 16,
                        kind: str = "cpu") -> tuple[int, int]:
    """(bytes for the max batch, bytes for one request) of the largest-activation expert, traced by its backend;
    the max batch is the profile's on a `kind` device."""
    from executors.backends import get_backend

    big = one = 0
    for arch in {e.arch for e in model.experts.values()}:
        e = next(x for x in model.experts.values() if x.arch == arch)
        mb = profile.archs[Profile.key(arch, kind)].max_batch if profile and Profile.key(arch, kind) in \
            profile.archs else default_max_batch
        big = max(big, get_backend(arch).activation_bytes(e, mb))
        one = max(one, get_backend(arch).activation_bytes(e, 1))
    return int(big), int(one)


def gpu_real_systems(gpu: str, memory: int, host: int, gpu_reserves: tuple[int, int],
                     cpu_reserve: int) -> dict[str, SimSystem]:
    """A GPU box's systems with the same memory: CoServe gets a GPU executor and a CPU executor of `memory`
    each and a pinned host tier of `host` (exclusive, CPU host reads, the CPU's victims that queued requests
    still need moved down into it, a victim entering it only if it outranks what it pushes out, SSD read-ahead);
    Samba-CoE (FCFS, LRU) the GPU executor
    and, as host tier, all the CPU memory CoServe uses (`host` + its CPU executor's), as in the simulator.
    `gpu_reserves`: the GPU's activation bytes at the max batch and for one request; `cpu_reserve`: the CPU's
    at its max batch."""
    big, one = gpu_reserves
    co = (SimExecutor(f"{gpu}#0", gpu, memory, memory - big),
          SimExecutor("cpu#0", "cpu", memory, memory - cpu_reserve))
    return {"coserve": SimSystem("coserve", co, "coserve", "coserve", host_tier=host, host_mode="exclusive",
                                 max_wait=MAX_WAIT, cpu_host_reads=True, cpu_demote_queued=True, read_ahead=True,
                                 victim_admission=True),
            "samba": SimSystem("samba", (SimExecutor(f"{gpu}#0", gpu, memory, memory - one),), "fcfs", "lru",
                               host_tier=host + memory, host_mode="inclusive")}


def run_real(data_dir: Path, *, requests: int = 600, types: int = 24, memory: int = 400_000_000,
             seed: int = 0, repeats: int = 1, device: str = "cpu", host: int = 400_000_000,
             interval: float | None = None, progress=print) -> tuple[list[list[SimReport]], dict]:
    """CoServe and Samba-CoE on real resnet18/yolov8n experts, cold SSD loads, side by side, `repeats` times.

    On a CUDA `device`, `gpu_real_systems`: each GPU executor has `memory` behind a pinned host tier.
    `interval` (seconds between frames; default the task's 4 ms) sets the arrival rate: a GPU box keeps up
    with one frame every 4 ms, so its saturation throughput needs faster arrivals (0.5 ms).
    """
    import numpy as np

    from executors.backends import get_backend
    from executors.realrun import RealOptions
    from executors.realrun import run_real as real
    from storage.expert_store import ExpertStore
    from storage.synthetic import draw_component

    spec = task("A1", types=types, requests=requests, board_size=120, detectors=2, seed=seed,
                classifier_arch="torchvision/resnet18", detector_archs=("ultralytics/yolov8n",))
    if interval is not None:
        spec = replace(spec, interval=interval)
    w = make_workload(spec)
    model = w.model
    # real experts: the workload's archs at line-box input sizes (64 px crops, 128 px detector input)
    experts = {k: replace(e, input_size=64 if e.kind == "classifier" else 128,
                          classes=("ok", "missing") if e.kind == "classifier" else e.classes)
               for k, e in model.experts.items()}
    experts = {k: replace(e, next=e.next, priors={"ok": 0.9, "missing": 0.1}) if e.kind == "classifier" else e
               for k, e in experts.items()}
    model = replace(model, experts=experts)
    store = ExpertStore(data_dir / "bench-real" / "experts", verify="never")
    for i, (k, e) in enumerate(sorted(model.experts.items())):
        if not store.has(k):
            progress(f"building real expert {k} ({e.arch})")
            store.write(e, get_backend(e.arch).init_weights(e, seed + i))
    model = model.with_sizes({e.id: e.nbytes for e in store.entries()})
    w = replace(w, model=model)
    rng = np.random.default_rng(seed)
    families = ["R0402", "C0603", "U-SOIC8", "Q-SOT23", "D-SOD123", "L0603"]
    images = {c: [draw_component(families[i % len(families)], "ok", rng, 64) for _ in range(4)]
              for i, c in enumerate(model.components)}
    prof_path = data_dir / "profile.json"
    profile = Profile.load(prof_path) if prof_path.is_file() else None
    big, one = activation_reserves(model, profile)
    cuda = device.startswith("cuda")
    systems = (gpu_real_systems("cuda:0" if device == "cuda" else device, memory, host,
                                activation_reserves(model, profile, kind="cuda"), big) if cuda
               else real_systems(memory, memory - big, memory - one))
    runs = []
    for rep in range(repeats):
        reports = []
        for name, system in systems.items():
            progress(f"real run {rep + 1}/{repeats}: {name} ({len(w.arrivals)} frames, one every "
                     f"{spec.interval * 1000:g} ms, cold SSD)")
            r = real(w, model, store, profile, system, RealOptions(interval=spec.interval, cold=True), images=images)
            r.resources = system.resources()
            reports.append(r)
        runs.append(reports)
    ratios = [rs[0].throughput / rs[1].throughput for rs in runs]
    info = {"requests": requests, "types": types, "interval_ms": spec.interval * 1e3, "experts": len(model.experts),
            "zoo_mb": round(sum(e.nbytes for e in model.experts.values()) / 1e6, 1), "memory_mb": memory / 1e6,
            "expert_memory_mb": {n: round(s.executors[0].expert_memory / 1e6, 1) for n, s in systems.items()},
            "device": device, "resources": {n: s.resources() for n, s in systems.items()},
            "ratios": [round(x, 3) for x in ratios],
            "profile": profile.source if profile else "estimates (no profile.json; run coe-agent profile)"}
    return runs, info


def table(reports: list[SimReport], baseline: str = "samba") -> list[dict]:
    base = next((r for r in reports if r.system == baseline), reports[0])
    paper = next((r for r in reports if r.system == "coserve-paper"), None)
    rows = []
    for r in reports:
        rows.append({**r.to_json(), "speedup": round(r.throughput / base.throughput, 2) if base.throughput else None,
                     "vs_paper": round(r.throughput / paper.throughput, 3) if paper and paper.throughput else None,
                     "switch_reduction": round(1 - r.switches / base.switches, 4) if base.switches else None,
                     "baseline_switches": base.switches})
    return rows


def format_table(title: str, rows: list[dict]) -> str:
    loads = sorted({float(f) for r in rows for f in r.get("latency", {})})
    head = (f"{'system':15} {'frames/s':>9} {'x samba':>8} {'x paper':>8} {'switches':>9} {'-switch':>8} "
            f"{'floor':>6} {'p99 s':>8} {'makespan s':>10} {'bound s':>8} {'eff':>5} {'batch':>6} {'SSD s':>7}"
            + "".join(f" {'p50@' + format(f, 'g'):>8} {'p99@' + format(f, 'g'):>8}" for f in loads))
    lines = [title, head] if title else [head]
    for r in rows:
        vs = f"{r['vs_paper']:8.2f}" if r.get("vs_paper") is not None else f"{'-':>8}"
        lat = "".join(f" {r['latency'][f]['p50_s']:8.2f} {r['latency'][f]['p99_s']:8.2f}"
                      if f in r.get("latency", {}) else f" {'-':>8} {'-':>8}" for f in loads)
        cut = f"{r['switch_reduction'] * 100:7.1f}%" if r.get("switch_reduction") is not None else f"{'-':>8}"
        lines.append(f"{r['system']:15} {r['throughput']:9.2f} {r['speedup']:8.2f} {vs} {r['switches']:9d} "
                     f"{cut} "
                     f"{'-' if r.get('real_run') else r.get('switch_floor', 0):>6} {r['p99_ms'] / 1000:8.2f} "
                     f"{r['makespan']:10.2f} "
                     f"{r['lower_bound']:8.2f} {r['efficiency']:5.2f} {r['mean_batch']:6.2f} "
                     f"{r.get('ssd_busy', 0.0):7.1f}{lat}")
    rates = [r for r in rows if r.get("sustained_rate")]
    if rates:
        lines.append("sustained rate (highest steady arrival rate with a bounded backlog; F is a share of it): "
                     + ", ".join(f"{r['system']} {r['sustained_rate']:.1f}/s" for r in rates))
    lines.append("floor: switches no schedule avoids (experts the task uses that no executor pool held at start)")
    lines.append("resources (every system gets the same machine):")
    lines += [f"  {r['system']:15} {r.get('resources', '')}" for r in rows]
    return "\n".join(lines)


def compare(plain: list[dict], packed: list[dict], factor: float = 1.0) -> list[dict]:
    """One row per system: its throughput with the store plain and compressed, and the gain.

    `expected` is the gain if only the SSD time changed, by `factor` (the load
    factor): 1 / (1 - s (1 - factor)) for the plain run's SSD share s.  Where
    the measured gain falls short of it, the schedule itself changed (cheaper
    switches invite more of them).
    """
    by = {r["system"]: r for r in packed}
    rows = []
    for p in plain:
        c = by[p["system"]]
        share = min(1.0, p["ssd_busy"] / p["makespan"]) if p["makespan"] else 0.0
        rows.append({"system": p["system"], "plain": p["throughput"], "compressed": c["throughput"],
                     "gain": round(c["throughput"] / p["throughput"], 3) if p["throughput"] else None,
                     "expected": round(1 / (1 - share * (1 - factor)), 3),
                     "ssd_plain": p["ssd_busy"], "ssd_compressed": c["ssd_busy"], "ssd_share": round(share, 3),
                     "switches_plain": p["switches"], "switches_compressed": c["switches"],
                     "sustained_plain": p.get("sustained_rate") or None,
                     "sustained_compressed": c.get("sustained_rate") or None,
                     "resources": p.get("resources", "")})
    return rows


def format_compare(title: str, rows: list[dict]) -> str:
    """The side-by-side table: frames/s plain and compressed, the gain, and how SSD-bound the plain run was."""
    sustained = any(r["sustained_plain"] for r in rows)
    head = (f"{'system':15} {'plain f/s':>10} {'compr f/s':>10} {'gain':>6} {'expect':>7} {'SSD s plain':>12} "
            f"{'SSD s compr':>12} "
            f"{'SSD share':>10} {'switches':>9} {'switches c':>11}"
            + (f" {'sust plain':>11} {'sust compr':>11}" if sustained else ""))
    lines = [title, head] if title else [head]
    for r in rows:
        sus = (f" {r['sustained_plain'] or 0:11.2f} {r['sustained_compressed'] or 0:11.2f}" if sustained else "")
        lines.append(f"{r['system']:15} {r['plain']:10.2f} {r['compressed']:10.2f} {r['gain']:5.2f}x "
                     f"{r['expected']:6.2f}x "
                     f"{r['ssd_plain']:12.1f} {r['ssd_compressed']:12.1f} {r['ssd_share'] * 100:9.0f}% "
                     f"{r['switches_plain']:9d} {r['switches_compressed']:11d}{sus}")
    lines.append("SSD share: seconds the shared SSD channel was reading over the plain run's makespan "
                 "(near 100%: SSD-bound); expect: the gain if only the SSD time shrank, 1 / (1 - share x (1 - load "
                 "factor))")
    lines.append("resources (every system gets the same machine, plain and compressed alike):")
    lines += [f"  {r['system']:15} {r['resources']}" for r in rows]
    return "\n".join(lines)


def summary(co: list[dict], loads: tuple[float, ...] = ()) -> list[str]:
    """CoServe's rows against the issue's targets, one line each.

    A task where the baseline made no switch has no switch reduction (it is
    left out of that range, and the line says so) rather than a division by 0.
    """
    cut = [r for r in co if r.get("switch_reduction") is not None and r.get("baseline_switches")]
    if cut:
        floor = [1 - r["switch_floor"] / r["baseline_switches"] for r in cut]
        switches = (f"switches -{min(r['switch_reduction'] for r in cut) * 100:.1f}% to "
                    f"-{max(r['switch_reduction'] for r in cut) * 100:.1f}% (target >= 90%; at CoServe's floor it "
                    f"would be -{min(floor) * 100:.1f}% to -{max(floor) * 100:.1f}%)"
                    + (f"; {len(co) - len(cut)} task(s) where Samba-CoE made no switch left out" if len(cut) < len(co)
                       else ""))
    else:
        switches = "switches: Samba-CoE made no switch on any task, so there is no reduction to report"
    lines = [f"CoServe vs Samba-CoE: throughput {min(r['speedup'] for r in co):.2f}x to "
             f"{max(r['speedup'] for r in co):.2f}x (target >= 4.5x), {switches}, efficiency "
             f"{min(r['efficiency'] for r in co):.2f} to {max(r['efficiency'] for r in co):.2f} vs the lower bound "
             f"(target >= 0.8)"]
    if all(r.get("vs_paper") for r in co):
        lines.append(f"CoServe vs coserve-paper: {min(r['vs_paper'] for r in co):.2f}x to "
                     f"{max(r['vs_paper'] for r in co):.2f}x (target >= 1.25x)")
    for f in loads:
        p99 = [r["latency"][f]["p99_s"] for r in co]
        lines.append(f"CoServe at F = {f:g} of its sustained rate: p99 {min(p99):.2f} s to {max(p99):.2f} s"
                     + (" (target <= 2 s)" if f == 0.8 else ""))
    return lines


def plot(results: dict[str, list[dict]], path: Path, title: str) -> Path:
    """Throughput per workload and system, as grouped bars, saved as a PNG."""
    import matplotlib.pyplot as plt

    fig = chart(results, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def chart(results: dict[str, list[dict]], title: str):
    """The figure `plot` saves.

    The title is wrapped to the figure's width (a profile's source note is long)
    and the legend sits below the axes, so neither is cut off nor covers a bar.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results)
    systems = [r["system"] for r in results[workloads[0]]]
    width_in = max(6.0, 2 + 1.6 * len(workloads) * max(1, len(systems) / 4))
    ncol = max(1, min(len(systems), int(width_in * 1.1)))
    legend_rows = -(-len(systems) // ncol)
    lines = textwrap.wrap(title, width=max(30, int(width_in * 72 / (9 * 0.6))))
    fig, ax = plt.subplots(figsize=(width_in, 4.2 + 0.16 * len(lines) + 0.2 * legend_rows), layout="constrained")
    width = 0.8 / len(systems)
    colors = plt.get_cmap("tab10" if len(systems) <= 10 else "tab20").colors   # one colour per system
    for i, s in enumerate(systems):
        ys = [next(r["throughput"] for r in results[w] if r["system"] == s) for w in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], ys, width, label=s, color=colors[i % len(colors)])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("throughput (frames/s)")
    ax.set_title("\n".join(lines), fontsize=9, loc="left")
    fig.legend(loc="outside lower center", ncol=ncol, fontsize=7, frameon=False)
    return fig


def latency_chart(p99: dict[str, dict[float, dict[str, float]]], title: str, target: float = 2.0):
    """p99 against the arrival rate, one panel per task and one line per system, log scale, with the target.

    `p99[system][rate][task]` in seconds (what `bench/sim_rates.py` measures).  A
    table of p99 per rate hides where each system's latency turns up; beyond
    its sustained rate a backlog grows through the run and p99 climbs by orders
    of magnitude, so the y axis is logarithmic.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(p99)
    rates = sorted({r for by_rate in p99.values() for r in by_rate})
    tasks = list(next(iter(p99[systems[0]].values())))
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.6), sharey=True, squeeze=False,
                             layout="constrained")
    colors = plt.get_cmap("tab10").colors
    for ax, t in zip(axes[0], tasks):
        for i, s in enumerate(systems):
            xs = [r for r in rates if r in p99[s]]
            ax.plot(xs, [max(p99[s][r][t], 1e-3) for r in xs], marker="o", ms=3, label=s,
                    color=colors[i % len(colors)])
        ax.axhline(target, ls="--", lw=0.8, color="grey")
        ax.set_yscale("log")
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("frames/s")
    axes[0][0].set_ylabel(f"p99 latency, s (dashed: {target:g} s)")
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=8)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=min(len(systems), 6),
               fontsize=7, frameon=False)
    return fig


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} CPU cores)"


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)


def run_boxes(workloads: list[str], profile: Profile, boxes: list[int], systems: list[str], link: Link, *,
              overrides: dict | None = None, frame_bytes: int | None = None,
              init: str = "warm") -> dict[str, list[dict]]:
    """Each system on 1..N boxes (`bench --sim --boxes`): throughput, speedup over its own one-box run, switches.

    Every box count gets the same frames, and they arrive as a flood for the
    largest: one every 4 ms / max(boxes) (a frame every 4 ms per box), so
    throughput measures what the boxes can do, not the arrival rate.  Each
    box has the profile's devices, memory split and host tier, its own SSD,
    and (past the front box) `link`.  This is a simulation on profiled
    costs, never a measurement.
    """
    from executors.links import DEFAULT_FRAME_BYTES

    if not boxes or any(b < 1 for b in boxes):
        raise ValueError(f"--boxes: each box count must be >= 1, got {boxes}")
    counts = sorted(set(boxes))
    out: dict[str, list[dict]] = {}
    for wl in workloads:
        spec = task(wl, **(overrides or {}))
        spec = replace(spec, interval=spec.interval / max(counts))
        w = make_workload(spec)
        rows = []
        for s in systems:
            one = None
            for n in counts:
                system = replace(build_system(s, profile, init=init, boxes=n, link=link),
                                 frame_bytes=frame_bytes or DEFAULT_FRAME_BYTES)
                r = simulate(w, profile, system)
                one = one or r
                rows.append({"system": s, "boxes": n, "throughput": round(r.throughput, 3),
                             "speedup": round(r.throughput / one.throughput, 3) if one.throughput else None,
                             "switches": r.switches, "switches_per_frame": round(r.switches / r.frames, 4),
                             "ssd_loads": r.ssd_loads, "host_loads": r.host_loads, "floor": r.switch_floor,
                             "mean_batch": round(r.mean_batch, 2), "makespan": round(r.makespan, 3),
                             "lower_bound": round(r.lower_bound, 3), "efficiency": round(r.efficiency, 3),
                             "p99_s": round(r.p99_ms / 1000, 3), "interval_s": spec.interval,
                             "resources": r.resources})
        out[wl] = rows
    return out


def format_boxes(title: str, rows: list[dict]) -> str:
    head = (f"{'system':14} {'boxes':>5} {'frames/s':>9} {'x 1 box':>8} {'switches':>9} {'per frame':>9} "
            f"{'SSD':>5} {'host':>5} {'floor':>6} {'batch':>6} {'makespan s':>10} {'bound s':>8} {'eff':>5}")
    lines = [title, head]
    for r in rows:
        lines.append(f"{r['system']:14} {r['boxes']:5d} {r['throughput']:9.2f} {r['speedup']:8.2f} "
                     f"{r['switches']:9d} {r['switches_per_frame']:9.4f} {r['ssd_loads']:5d} {r['host_loads']:5d} "
                     f"{r['floor']:6d} {r['mean_batch']:6.2f} {r['makespan']:10.2f} {r['lower_bound']:8.2f} "
                     f"{r['efficiency']:5.2f}")
    lines.append("switches: loads into executor pools (SSD + host tier); floor: experts the task uses that no "
                 "executor pool held at start")
    lines.append("resources per box count:")
    seen = set()
    for r in rows:
        if r["boxes"] not in seen:
            seen.add(r["boxes"])
            lines.append(f"  {r['boxes']} box(es): {r['resources']}")
    return "\n".join(lines)
