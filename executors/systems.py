"""The systems the benchmark compares, all built from one profile's devices (DESIGN.md §4).

Every system gets the same machine: the profile's GPU and CPU memory and
the host memory behind them.  How each spends it:

- CoServe: the executors and memory split of the profile's searches; each
  executor reserves activation memory for its max batch and the rest holds
  experts; the host tier is an exclusive victim cache of the GPU pools
  (and of the front box's CPU executors' victims that a queued request still
  needs), and the front box's CPU executors copy what it holds instead of
  reading the SSD.
- coserve-paper: the same executors with the paper's rules read exactly
  (exact assignment ties, stage 2 strictly by probability, no SSD term,
  no age bound) and an inclusive host tier (it keeps a copy of what it
  hands to a GPU).
- Samba-CoE: one GPU executor, FCFS, LRU.  Its expert memory is the whole
  GPU less the activations of one request of the largest-activation
  architecture (FCFS in arrival order: only neighbours for the same expert
  batch, 1.05 requests a batch on the tasks, and the splitter caps them at
  what fits); its host tier is
  all the CPU memory that CoServe's CPU executor and host tier share.
- Several boxes (`boxes`, issue 15): CoServe's executors, memory split and
  host tier on each box, as the profile gives them for one; every box has its
  own SSD, and the front box reaches the others over `link`.
- Samba-CoE FIFO and Parallel, and CoServe's ablations (the paper's: none, em,
  em+ra; ours: -ssd, -steal, -exclusive, -age, -protect, -work, -hostread,
  -readahead, -fill, -hold, -cpuqueued, -admit, -ties, -gpufirst, -followup, each CoServe with one lever
  off),
  change one knob each.  In CoServe a victim moving down enters a full host
  tier only if the eviction policy ranks it above what it would push out,
  never for being used last (`-admit` takes every victim, as before):
  a board's rare types share one probability and a line cycles through
  them, so taking every victim made the GPU pool and the host tier LRU on a
  cycle.  CoServe's eviction also breaks ties in usage probability in a fixed
  order (by id) instead of by recency, for the same reason (`-ties` keeps
  recency; `-protect` is CoServe's eviction with queued experts unprotected,
  `coserve-noprotect`).  In CoServe a front-box CPU executor's victim that a request
  queued on the box still needs moves down into the exclusive host tier
  (the agent's cpu_victims_to_host_tier: queued; `-cpuqueued` turns it off;
  it needs their host reads, whose HostReadSource checks the victim's dtype
  and version, so `-hostread` turns it off too).  At a line rate few victims
  are still queued for, so it seldom fires there; under a flood its next use
  is certain.  `+cpudemote` moves every such victim down ('always').  It raises
  the flood throughput on most boards, but at a steady line rate it sets off
  thrash between the CPU pools and the host tier (every CPU read from SSD
  pushes a victim down that pushes out the next one needed): the highest rate
  sustained fell on all eleven boards of bench/sim_shapes.py, by more than 5%
  on four (up to 47%), so 'always' is not the default.
- CoServe starts its GPU pools with the most probable experts, then its
  CPU pools with the next ones (`fill`: gpu-first; storage.pool.initialize_in_turn),
  where the paper deals them round-robin over all executors (`-gpufirst`,
  and coserve-paper, keep that).  Round-robin put two of every three of the
  hottest experts on the two CPU executors, so under load the GPU, which
  runs most requests, read them from SSD first: on B1 (seed 0) 14 of the 30
  most probable experts were read from SSD during the flood.
"""
from __future__ import annotations

from dataclasses import replace

from .links import Link
from .profile import DeviceProfile, Profile
from .simdevice import SimExecutor, SimSystem

SYSTEMS = ("coserve", "coserve-paper", "samba", "samba-fifo", "samba-parallel", "none", "em", "em+ra",
           "-ssd", "-steal", "-exclusive", "-age", "-protect", "-work", "-hostread", "-readahead", "-fill",
           "-hold", "-cpuqueued", "-admit", "-ties", "-gpufirst", "-followup", "+cpudemote")
DEFAULT = SYSTEMS
MAX_WAIT = 2.0   # seconds: CoServe's age bound in the benchmark (the agent's default, scheduler.max_wait)


def _expert_memory(dev: DeviceProfile) -> int:
    return dev.expert_memory if dev.expert_memory is not None else int(dev.memory * 0.75)


def coserve_executors(profile: Profile) -> tuple[SimExecutor, ...]:
    out = []
    for dev in profile.devices.values():
        n = max(1, dev.executors)
        expert = _expert_memory(dev)
        out += [SimExecutor(f"{dev.name}#{i}", dev.name, dev.memory // n, expert // n) for i in range(n)]
    return tuple(out)


def activation_reserve(profile: Profile, kind: str, batch: int | None = None) -> int:
    """Activation bytes one executor on a `kind` device needs: the largest over the profile's
    architectures of per-sample bytes x `batch` (None: each architecture's max batch)."""
    return max((a.activation_bytes * (batch or a.max_batch) for a in profile.archs.values() if a.device == kind),
               default=0)


def samba_executors(profile: Profile) -> tuple[SimExecutor, ...]:
    if not profile.devices:     # Profile.load refuses this; a profile built in code may not
        raise ValueError(f"profile ({profile.source}) has no devices to run a system on")
    gpus = [d for d in profile.devices.values() if d.kind == "cuda"]
    dev = gpus[0] if gpus else next(iter(profile.devices.values()))
    reserve = activation_reserve(profile, dev.kind, batch=1)
    return (SimExecutor(f"{dev.name}#0", dev.name, dev.memory, dev.memory - reserve),)


def host_tier(profile: Profile) -> int:
    return max((d.host_tier for d in profile.devices.values()), default=0)


def samba_host_tier(profile: Profile) -> int:
    """All the CPU memory CoServe uses: its host tier plus its CPU executors' memory."""
    if not any(d.kind == "cuda" for d in profile.devices.values()):
        return 0
    return host_tier(profile) + sum(d.memory for d in profile.devices.values() if d.kind == "cpu")


def on_boxes(executors: tuple[SimExecutor, ...], boxes: int) -> tuple[SimExecutor, ...]:
    """The same executors on each of `boxes` boxes; box 0 keeps the names, box b's are prefixed 'b{b}/'."""
    return tuple(replace(e, name=e.name if b == 0 else f"b{b}/{e.name}", box=b)
                 for b in range(boxes) for e in executors)


def build_system(name: str, profile: Profile, *, init: str = "warm", boxes: int = 1,
                 link: Link | None = None) -> SimSystem:
    co, host = coserve_executors(profile), host_tier(profile)
    one, one_host = samba_executors(profile), samba_host_tier(profile)
    #        executors, scheduler, eviction, host tier, host mode, age bound
    table = {
        "coserve": (co, "coserve", "coserve", host, "exclusive", MAX_WAIT),
        "coserve-paper": (co, "coserve-paper", "coserve-paper", host, "inclusive", None),
        "samba": (one, "fcfs", "lru", one_host, "inclusive", None),
        "samba-fifo": (one, "fcfs", "fifo", one_host, "inclusive", None),
        "samba-parallel": (co, "round-robin", "lru", host, "inclusive", None),
        "none": (co, "none", "fifo", host, "inclusive", None),
        "em": (co, "em", "coserve", host, "exclusive", None),
        "em+ra": (co, "em+ra", "coserve", host, "exclusive", None),
        # CoServe with one of our levers off, to attribute the gain over coserve-paper
        "-ssd": (co, "coserve-nossd", "coserve", host, "exclusive", MAX_WAIT),
        "-steal": (co, "coserve-nosteal", "coserve", host, "exclusive", MAX_WAIT),
        "-work": (co, "coserve-nowork", "coserve", host, "exclusive", MAX_WAIT),
        "-exclusive": (co, "coserve", "coserve", host, "inclusive", MAX_WAIT),
        "-age": (co, "coserve", "coserve", host, "exclusive", None),
        "-protect": (co, "coserve", "coserve-noprotect", host, "exclusive", MAX_WAIT),
        "-hostread": (co, "coserve", "coserve", host, "exclusive", MAX_WAIT),
        "-readahead": (co, "coserve", "coserve", host, "exclusive", MAX_WAIT),
        "+cpudemote": (co, "coserve", "coserve", host, "exclusive", MAX_WAIT),
        "-fill": (co, "coserve-nofill", "coserve", host, "exclusive", MAX_WAIT),
        "-hold": (co, "coserve-nohold", "coserve", host, "exclusive", MAX_WAIT),
        "-cpuqueued": (co, "coserve", "coserve", host, "exclusive", MAX_WAIT),
        "-admit": (co, "coserve", "coserve", host, "exclusive", MAX_WAIT),
        "-ties": (co, "coserve", "coserve-recencyties", host, "exclusive", MAX_WAIT),
        "-gpufirst": (co, "coserve", "coserve", host, "exclusive", MAX_WAIT),
        "-followup": (co, "coserve-nofollowup", "coserve", host, "exclusive", MAX_WAIT),
    }
    # CoServe's own levers: on in CoServe and in every ablation but the one that turns that lever off
    levers = name in ("coserve", "+cpudemote") or name.startswith("-")
    host_reads = levers and name != "-hostread"     # CPU executors copy from the host tier
    cpu_demote = name == "+cpudemote"               # their victims move down into the exclusive host tier (off)
    # ... those a request queued on the box still needs (on; all of them with +cpudemote)
    cpu_demote_queued = host_reads and name != "-cpuqueued"
    read_ahead = levers and name != "-readahead"    # an idle SSD reads a queued group's expert into it
    admission = levers and name != "-admit"         # a victim moving down must outrank what it pushes out
    fill = "gpu-first" if levers and name != "-gpufirst" else "round-robin"   # the GPU pools start with the top
    try:
        execs, sched, evict, tier, mode, max_wait = table[name]
    except KeyError:
        raise ValueError(f"unknown system '{name}' (known: {', '.join(SYSTEMS)})") from None
    if boxes < 1:
        raise ValueError(f"boxes must be >= 1, got {boxes}")
    return SimSystem(name, on_boxes(execs, boxes), sched, evict, host_tier=tier, init=init, host_mode=mode,
                     max_wait=max_wait, boxes=boxes, link=link if boxes > 1 else None, cpu_host_reads=host_reads,
                     cpu_demote=cpu_demote, cpu_demote_queued=cpu_demote_queued, read_ahead=read_ahead,
                     victim_admission=admission, fill=fill)
