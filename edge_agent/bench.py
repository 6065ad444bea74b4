"""`coe-agent bench`: CoServe against Samba-CoE and the ablations, side by side in one run.

Simulation (`--sim`): the production scheduler and pools on a virtual clock
with a profile's costs (default: the documented GPU-class profile in
configs/profiles/gpu-class.json).  Real (`--real`): small real experts
(resnet18 classifiers, yolov8n detectors) on this machine's CPU, cold SSD
loads, a memory budget that forces switching.  Every row says which it is.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import replace
from pathlib import Path

from coe.workload import make_workload, task
from executors.profile import Profile
from executors.simdevice import SimExecutor, SimReport, SimSystem, decision_overhead, simulate
from executors.systems import DEFAULT, build_system

REPO = Path(__file__).resolve().parent.parent
GPU_CLASS = REPO / "configs" / "profiles" / "gpu-class.json"


def run_sim(workloads: list[str], profile: Profile, systems: list[str], *, init: str = "warm",
            overrides: dict | None = None) -> dict[str, list[SimReport]]:
    out = {}
    for wl in workloads:
        w = make_workload(task(wl, **(overrides or {})))
        out[wl] = [simulate(w, profile, build_system(s, profile, init=init)) for s in systems]
    return out


def overhead(profile: Profile, workload: str = "B2") -> float:
    w = make_workload(task(workload))
    return decision_overhead(w, profile, build_system("coserve", profile), queued=3500)


def real_systems(memory: int, expert_memory: int) -> dict[str, SimSystem]:
    ex = (SimExecutor("cpu#0", "cpu", memory, expert_memory),)
    return {"coserve": SimSystem("coserve", ex, "coserve", "coserve"),
            "samba": SimSystem("samba", ex, "fcfs", "lru")}


def run_real(data_dir: Path, *, requests: int = 600, types: int = 24, memory: int = 400_000_000,
             expert_memory: int = 300_000_000, seed: int = 0, progress=print) -> tuple[list[SimReport], dict]:
    """CoServe and Samba-CoE on real resnet18/yolov8n experts, cold SSD loads, side by side."""
    import numpy as np

    from executors.backends import get_backend
    from executors.realrun import RealOptions
    from executors.realrun import run_real as real
    from storage.expert_store import ExpertStore
    from storage.synthetic import draw_component

    spec = task("A1", types=types, requests=requests, board_size=120, detectors=2, seed=seed,
                classifier_arch="torchvision/resnet18", detector_archs=("ultralytics/yolov8n",))
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
    reports = []
    for name, system in real_systems(memory, expert_memory).items():
        progress(f"real run: {name} ({len(w.arrivals)} frames, one every {spec.interval * 1000:g} ms, cold SSD)")
        reports.append(real(w, model, store, profile, system, RealOptions(interval=spec.interval, cold=True),
                            images=images))
    info = {"requests": requests, "types": types, "experts": len(model.experts),
            "zoo_mb": round(sum(e.nbytes for e in model.experts.values()) / 1e6, 1),
            "memory_mb": memory / 1e6, "expert_memory_mb": expert_memory / 1e6,
            "profile": profile.source if profile else "estimates (no profile.json; run coe-agent profile)"}
    return reports, info


def table(reports: list[SimReport], baseline: str = "samba") -> list[dict]:
    base = next((r for r in reports if r.system == baseline), reports[0])
    rows = []
    for r in reports:
        rows.append({**r.to_json(), "speedup": round(r.throughput / base.throughput, 2) if base.throughput else None,
                     "switch_reduction": round(1 - r.switches / base.switches, 4) if base.switches else None})
    return rows


def format_table(title: str, rows: list[dict]) -> str:
    head = (f"{'system':15} {'frames/s':>9} {'x samba':>8} {'switches':>9} {'-switch':>8} {'p99 s':>8} "
            f"{'makespan s':>10} {'bound s':>8} {'eff':>5} {'batch':>6}")
    lines = [title, head]
    for r in rows:
        lines.append(f"{r['system']:15} {r['throughput']:9.2f} {r['speedup']:8.2f} {r['switches']:9d} "
                     f"{r['switch_reduction'] * 100:7.1f}% {r['p99_ms'] / 1000:8.2f} {r['makespan']:10.2f} "
                     f"{r['lower_bound']:8.2f} {r['efficiency']:5.2f} {r['mean_batch']:6.2f}")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results)
    systems = [r["system"] for r in results[workloads[0]]]
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(workloads) * max(1, len(systems) / 4), 4.5))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        ys = [next(r["throughput"] for r in results[w] if r["system"] == s) for w in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], ys, width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("throughput (frames/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} CPU cores)"


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)
