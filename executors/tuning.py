"""The offline searches of CoServe §4.4-4.5, run on the simulated device with measured costs.

- Memory split: the decay-window search over "experts loaded" (Eq. 1-3),
  where a sample run's throughput comes from the simulator fed with the
  line's own spec and the profile.  The split is the window's midpoint (the
  paper picks any value in the final window; the midpoint is reproducible).
- Executor count: the same sample run for 1..4 executors per device, each
  with an equal share of the device's memory.  On a CPU, executors share the
  cores, so each one's K and B grow with the count (profiled at one executor's
  share of the threads).
"""
from __future__ import annotations

from dataclasses import replace

from coe import CoEModel
from coe.workload import from_model

from .profile import DeviceProfile, Profile, decay_window_search
from .simdevice import SimExecutor, SimSystem, simulate

SAMPLE_REQUESTS = 800


def _system(dev: DeviceProfile, count: int, expert_memory: int) -> SimSystem:
    ex = tuple(SimExecutor(f"{dev.name}#{i}", dev.name, dev.memory // count, expert_memory // count)
               for i in range(count))
    return SimSystem("tune", ex, "coserve", "coserve", host_tier=dev.host_tier)


def _scaled(profile: Profile, dev: DeviceProfile, count: int, base: int) -> Profile:
    """CPU executors split the cores: compute per executor slows in proportion (relative to `base`)."""
    if dev.kind != "cpu" or count == base:
        return profile
    f = count / base
    archs = {k: (replace(a, K=a.K * f, B=a.B * f) if a.device == "cpu" else a) for k, a in profile.archs.items()}
    return replace(profile, archs=archs)


def tune(profile: Profile, model: CoEModel, cfg=None, *, requests: int = SAMPLE_REQUESTS,
         window: int = 15, margin: float = 0.05, max_executors: int = 4) -> Profile:
    """Fill each device's `expert_memory`, `executors`, `split_points` and `count_points`."""
    sample = from_model(model, requests)
    by_size = sorted((e.nbytes for e in model.experts.values()), reverse=False)
    probs = model.usage_probabilities()
    ranked = sorted(model.experts, key=lambda e: -probs[e])
    devices = dict(profile.devices)
    for name, dev in profile.devices.items():
        if not any(a.device == dev.kind for a in profile.archs.values()):
            continue
        base = max(1, dev.executors)
        counts = []
        for n in range(1, max_executors + 1):
            prof_n = _scaled(profile, dev, n, base)
            mem = dev.expert_memory or int(dev.memory * 0.75)
            if mem // n < by_size[-1]:      # the largest expert would not fit one executor's share
                counts.append((n, 0.0))
                continue
            rep = simulate(sample, prof_n, _system(dev, n, mem))
            counts.append((n, round(rep.throughput, 3)))
        best_n = max(counts, key=lambda c: (c[1], -c[0]))[0]
        prof_n = _scaled(profile, dev, best_n, base)
        sizes = [model.experts[e].nbytes for e in ranked]

        floor = by_size[-1] * best_n   # every executor must hold at least its largest expert

        def throughput(n_experts: int) -> float:
            mem = min(dev.memory - 1, max(sum(sizes[:n_experts]), floor))
            return simulate(sample, prof_n, _system(dev, best_n, mem)).throughput

        low, high, pts = decay_window_search(throughput, len(ranked), window=window, margin=margin)
        mid = (low + high) // 2 or high
        expert_memory = min(dev.memory, max(sum(sizes[:mid]), floor))
        devices[name] = replace(dev, executors=best_n, expert_memory=int(expert_memory),
                                split_points=tuple((n, round(t, 3)) for n, t in pts), count_points=tuple(counts))
    notes = list(profile.notes) + [f"searches: simulated sample of {requests} frames of the line's spec; "
                                   f"split = midpoint of the final decay window (window {window}, margin "
                                   f"{margin:.0%}); executor count = best simulated throughput of 1..{max_executors}"]
    return replace(profile, devices=devices, notes=notes)
