"""The systems the benchmark compares, all built from one profile's devices (DESIGN.md §4).

CoServe uses every executor the profile's searches chose; Samba-CoE is FCFS
with LRU on one GPU executor (CPU memory as its second tier); its FIFO and
Parallel variants and CoServe's ablations run on the same code with one knob
changed each.  Every system gets the same expert memory per device and the
same host tier, and starts from the same warm pools unless told otherwise.
"""
from __future__ import annotations

from .profile import Profile
from .simdevice import SimExecutor, SimSystem

SYSTEMS = ("coserve", "coserve-paper", "samba", "samba-fifo", "samba-parallel", "none", "em", "em+ra")
DEFAULT = ("coserve", "coserve-paper", "samba", "samba-fifo", "samba-parallel", "none", "em", "em+ra")


def coserve_executors(profile: Profile) -> tuple[SimExecutor, ...]:
    out = []
    for dev in profile.devices.values():
        n = max(1, dev.executors)
        expert = dev.expert_memory if dev.expert_memory is not None else int(dev.memory * 0.75)
        out += [SimExecutor(f"{dev.name}#{i}", dev.name, dev.memory // n, expert // n) for i in range(n)]
    return tuple(out)


def single_executor(profile: Profile) -> tuple[SimExecutor, ...]:
    gpus = [d for d in profile.devices.values() if d.kind == "cuda"]
    dev = gpus[0] if gpus else next(iter(profile.devices.values()))
    expert = dev.expert_memory if dev.expert_memory is not None else int(dev.memory * 0.75)
    return (SimExecutor(f"{dev.name}#0", dev.name, dev.memory, expert),)


def host_tier(profile: Profile) -> int:
    return max((d.host_tier for d in profile.devices.values()), default=0)


def build_system(name: str, profile: Profile, *, init: str = "warm") -> SimSystem:
    co, one, host = coserve_executors(profile), single_executor(profile), host_tier(profile)
    table = {
        "coserve": (co, "coserve", "coserve"),
        "coserve-paper": (co, "coserve", "coserve-paper"),
        "samba": (one, "fcfs", "lru"),
        "samba-fifo": (one, "fcfs", "fifo"),
        "samba-parallel": (co, "round-robin", "lru"),
        "none": (co, "none", "fifo"),
        "em": (co, "em", "coserve"),
        "em+ra": (co, "em+ra", "coserve"),
    }
    try:
        execs, sched, evict = table[name]
    except KeyError:
        raise ValueError(f"unknown system '{name}' (known: {', '.join(SYSTEMS)})") from None
    return SimSystem(name, execs, sched, evict, host_tier=host, init=init, tie_seconds=tie_seconds(profile, name))


def tie_seconds(profile: Profile, system: str) -> float:
    """CoServe treats predicted makespans within one median SSD load as ties; the paper reading does not."""
    if system != "coserve":
        return 0.0
    loads = sorted(a.load_seconds.get("ssd", 0.0) for a in profile.archs.values())
    return loads[len(loads) // 2] if loads else 0.0
