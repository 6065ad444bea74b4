"""The offline searches of CoServe §4.4-4.5, run on the simulated device with measured costs.

Per device, for each executor count n = 1..max_executors:

- Activation reserve.  Every executor keeps memory for its biggest batch:
  `reserve` = max over the line's archs that run on the device kind of
  activation_bytes x max_batch.  Experts get at most memory - n x reserve
  (the cap); a count whose executors cannot hold the largest expert next to
  their reserve is infeasible and skipped.
- Memory split, by the paper's two rules (§4.4):
  * weak processor ("limited computation performance"): when the reserve of
    all n executors is at most WEAK_RULE_SHARE of the device memory, the
    max batch occupies little memory; reserve it and give the rest (the cap)
    to experts.  No search.
  * strong processor ("sufficient computation performance"): otherwise the
    decay-window search (Eq. 1-3) over "experts loaded" in descending usage
    probability, each sample a simulated run of the line's own spec, up to
    the most experts that fit the cap (the search never samples past it).
    The split is the midpoint of the final window when Eq. 3 stopped the
    search (the paper picks any value in the window; the midpoint is
    reproducible); otherwise (no upward trend in its first samples, or the
    cap reached) the best point it measured, the fewer experts on a tie.
- Executor count: the simulated throughput of each feasible count at its own
  split; the best wins (ties: fewer executors).  The simulator shares a
  device's compute among its executors by the device's measured concurrency
  curve (DeviceProfile.concurrency, relative to `profiled_executors`), so
  nothing here scales K or B.

The profile that comes out carries the outcome in each device's `executors`
and `expert_memory` (and the samples in `split_points` / `count_points`), with
one note per device saying which rule was used and why.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from coe import CoEModel
from coe.probabilities import ranked
from coe.workload import Workload, from_model

from .profile import DeviceProfile, Profile, decay_window_search, stop_reason
from .simdevice import SimExecutor, SimSystem, simulate
from .systems import MAX_WAIT

SAMPLE_REQUESTS = 800
# The weak-processor rule applies when the max-batch activation reserve of all executors is at most this
# share of the device memory.  25% is what the "casual" 75/25 experts/activations split gives activations
# anyway: if the max batch fits in it, reserving it costs experts no more than the casual split, so the
# processor is "limited" in the paper's sense (its max batch "occupies minimal memory") and the rest can go
# to experts without a search.  Above it, the batches compete with experts for a substantial share of the
# memory, which is the case the paper's decay-window search is for.
WEAK_RULE_SHARE = 0.25
NOTE_PREFIX = "tune: "     # every note tune() writes starts with this; a re-run replaces them
_GB = 1e9


@dataclass(frozen=True)
class CountPlan:
    """One executor count's outcome on one device."""

    executors: int
    rule: str                      # 'weak' | 'search' | 'infeasible'
    reserve: int                   # activation bytes reserved per executor
    cap: int                       # most bytes experts may get on the device: memory - executors x reserve
    expert_memory: int = 0
    experts: int = 0               # experts (in usage order) the expert memory was sized for (search rule)
    n_max: int = 0                 # the most experts (in usage order) that fit the cap (search rule)
    throughput: float = 0.0
    points: tuple[tuple[int, float], ...] = ()   # the split search's samples (search rule)
    window: tuple[int, int] | None = None
    stopped: str = ""              # 'Eq. 3' | 'no upward trend' | 'cap' (search rule)
    reason: str = ""               # why infeasible


def activation_reserve(profile: Profile, model: CoEModel, kind: str) -> tuple[int, str]:
    """Bytes one executor of a `kind` device keeps for its biggest batch, and the arch that sets it."""
    best, arch = 0, ""
    for a in sorted({e.arch for e in model.experts.values()}):
        key = Profile.key(a, kind)
        if key in profile.archs:
            p = profile.archs[key]
            need = p.activation_bytes * p.max_batch
            if need > best:
                best, arch = need, f"{a} at batch {p.max_batch}"
    return best, arch


def expert_cap(dev: DeviceProfile, executors: int, reserve: int) -> int:
    """Most bytes of the device's memory experts may hold with `executors` executors, each with its reserve."""
    return (dev.memory // executors - reserve) * executors


def weak_rule(dev: DeviceProfile, executors: int, reserve: int) -> bool:
    """The paper's rule for processors of limited computation: the reserve is a small share of the memory."""
    return executors * reserve <= WEAK_RULE_SHARE * dev.memory


def agent_levers(cfg=None) -> dict:
    """The simulator's switches for the levers the agent runs with this line's config (`cfg`; None: the
    defaults): CPU executors copy from the host tier (`cpu_reads_host_tier`), an idle SSD reads ahead
    (`ssd_read_ahead`), CPU victims move down (`cpu_victims_to_host_tier`: queued, always or never), and a
    victim enters the host tier only if it outranks what it pushes out (`host_tier_admission`: ranked), and the
    GPU pools start with the most probable experts (`pool_fill`: gpu-first).
    The searches simulate the system the agent will run, not a plainer one."""
    host_reads = bool(getattr(cfg, "cpu_reads_host_tier", True))
    victims = getattr(cfg, "cpu_victims_to_host_tier", "queued")
    return dict(cpu_host_reads=host_reads, read_ahead=bool(getattr(cfg, "ssd_read_ahead", True)),
                cpu_demote=host_reads and victims == "always", cpu_demote_queued=host_reads and victims == "queued",
                victim_admission=getattr(cfg, "host_tier_admission", "ranked") == "ranked",
                fill=getattr(cfg, "start_fill", "gpu-first"))


def _system(dev: DeviceProfile, count: int, expert_memory: int, levers: dict | None = None) -> SimSystem:
    """The system the agent runs (exclusive host tier, age bound, the levers of `agent_levers`), on this
    device's executors."""
    ex = tuple(SimExecutor(f"{dev.name}#{i}", dev.name, dev.memory // count, expert_memory // count)
               for i in range(count))
    return SimSystem("tune", ex, "coserve", "coserve", host_tier=dev.host_tier, host_mode="exclusive",
                     max_wait=MAX_WAIT, **(agent_levers() if levers is None else levers))


class _Sampler:
    """Simulated sample runs of one device, cached by (executors, expert memory)."""

    def __init__(self, sample: Workload, profile: Profile, dev: DeviceProfile, levers: dict | None = None) -> None:
        self.sample, self.profile, self.dev, self.levers = sample, profile, dev, levers
        self.cache: dict[tuple[int, int], float] = {}

    def __call__(self, executors: int, expert_memory: int) -> float:
        key = (executors, int(expert_memory))
        if key not in self.cache:
            rep = simulate(self.sample, self.profile,
                           _system(self.dev, executors, int(expert_memory), self.levers))
            self.cache[key] = round(rep.throughput, 3)
        return self.cache[key]


def plan_count(run: _Sampler, dev: DeviceProfile, executors: int, reserve: int, sizes: list[int], *,
               window: int = 15, margin: float = 0.05, fit_points: int = 3) -> CountPlan:
    """The split for `executors` executors on `dev` (weak rule or search) and its simulated throughput.

    `sizes`: the experts' bytes in descending usage probability.
    """
    cap = expert_cap(dev, executors, reserve)
    largest = max(sizes)
    if cap < largest * executors:
        per = dev.memory // executors
        return CountPlan(executors, "infeasible", reserve, cap,
                         reason=f"{executors} executor(s) get {_size(per)} each, less than the largest expert "
                                f"({_size(largest)}) plus the activation reserve ({_size(reserve)})")
    if weak_rule(dev, executors, reserve):
        return CountPlan(executors, "weak", reserve, cap, expert_memory=cap, throughput=run(executors, cap))
    floor = largest * executors        # every executor's pool must hold the largest expert
    cum = [0]
    for s in sizes:
        cum.append(cum[-1] + s)
    n_max = max(1, max(n for n in range(len(sizes) + 1) if cum[n] <= cap))   # the most experts that fit the cap

    def memory(n_experts: int) -> int:
        return min(cap, max(cum[n_experts], floor))

    # the floor (every pool holds the largest expert) may cover the first windows: their samples would all be
    # the floor's, read as "no upward trend", and the search would end at the floor whatever the memory buys.
    # Then it starts from the last count the floor covers.
    n0 = max((n for n in range(len(cum)) if cum[n] <= floor), default=0) if memory(min(window, n_max)) == floor \
        else 0
    n0 = min(n0, n_max - 1)
    low, high, pts = decay_window_search(lambda k: run(executors, memory(n0 + k)), n_max - n0, window=window,
                                         margin=margin, fit_points=fit_points)
    low, high, pts = low + n0, high + n0, [(n + n0, tp) for n, tp in pts]
    stopped = stop_reason(pts, margin=margin, fit_points=fit_points)
    if stopped == "Eq. 3":       # the paper's choice: inside the window where throughput starts to drop
        chosen = max(1, (low + high) // 2)
    else:
        # no upward trend from the start, or the cap reached (with too few samples for Eq. 3 when few experts
        # fit): the best point measured, the fewer experts on a tie; the window's midpoint (or the cap) chose
        # a point the samples showed worse (100/s at 15 experts and 20/s at the cap of 25 chose 25)
        chosen = max(pts, key=lambda p: (p[1], -p[0]))[0]
    mem = memory(chosen)
    return CountPlan(executors, "search", reserve, cap, expert_memory=mem, experts=chosen,
                     throughput=run(executors, mem), points=tuple(pts), window=(low, high), n_max=n_max,
                     stopped=stopped or "cap")


def tune(profile: Profile, model: CoEModel, cfg=None, *, requests: int = SAMPLE_REQUESTS,
         window: int = 15, margin: float = 0.05, fit_points: int = 3, max_executors: int = 4) -> Profile:
    """Fill each device's `executors`, `expert_memory`, `split_points` and `count_points` from the searches.

    `profile` is passed to the simulator as it is: its device entries carry
    the concurrency curves and `profiled_executors` the simulator scales the
    measured K and B by.  `cfg` (the line's config, when there is one) says
    which levers the agent runs (`agent_levers`: CPU host reads, read-ahead, CPU victims moving down).
    """
    unsized = sorted(e for e, x in model.experts.items() if x.nbytes <= 0)
    if unsized:   # a spec read from YAML has no sizes: every split would hold 0 bytes of experts
        raise ValueError(f"the searches need each expert's size; {len(unsized)} of {len(model.experts)} have none "
                         f"(e.g. '{unsized[0]}'): give the model its store's sizes (CoEModel.with_sizes)")
    levers = agent_levers(cfg)
    sample = from_model(model, requests)
    probs = model.usage_probabilities()
    order = ranked(model.experts, probs)
    model_archs = {e.arch for e in model.experts.values()}
    devices = dict(profile.devices)
    searched: dict[str, list[CountPlan]] = {}
    notes = [n for n in profile.notes if not n.startswith(NOTE_PREFIX)]
    for name, dev in profile.devices.items():
        missing = sorted(a for a in model_archs if Profile.key(a, dev.kind) not in profile.archs)
        if missing:
            notes.append(f"{NOTE_PREFIX}{name}: not searched: the profile has no {dev.kind} entry for "
                         f"{', '.join(missing)}; executors and expert memory left as they were")
            continue
        reserve, by = activation_reserve(profile, model, dev.kind)
        run = _Sampler(sample, profile, dev, levers)
        sizes = [model.experts[e].nbytes for e in order]
        plans = [plan_count(run, dev, n, reserve, sizes, window=window, margin=margin, fit_points=fit_points)
                 for n in range(1, max_executors + 1)]
        feasible = [p for p in plans if p.rule != "infeasible"]
        if not feasible:
            notes.append(f"{NOTE_PREFIX}{name}: no executor count fits: {plans[0].reason}; executors and expert "
                         f"memory left as they were")
            continue
        best = max(feasible, key=lambda p: (p.throughput, -p.executors))
        devices[name] = replace(dev, executors=best.executors, expert_memory=int(best.expert_memory),
                                split_points=best.points, count_points=tuple((p.executors, p.throughput)
                                                                             for p in plans))
        notes.append(NOTE_PREFIX + _device_note(name, dev, best, plans, by))
        searched[name] = feasible
    if len(searched) > 1:
        devices, joint = _joint(sample, profile, devices, searched, levers)
        notes.append(NOTE_PREFIX + joint)
    notes.append(f"{NOTE_PREFIX}each device's executors and expert_memory above are the searches' outcome: a "
                 f"simulated sample of {requests} frames of the line's spec per point; executor count = best "
                 f"simulated throughput of 1..{max_executors}, each count at its own split (the simulator shares "
                 f"a device by its concurrency curve); split search: decay window {window}, fit of the first "
                 f"{fit_points} points, margin {margin:.0%}")
    return replace(profile, devices=devices, notes=notes)


def _joint(sample: Workload, profile: Profile, devices: dict[str, DeviceProfile],
           searched: dict[str, list[CountPlan]], levers: dict | None = None) -> tuple[dict[str, DeviceProfile], str]:
    """Choose the executor counts of all devices together, each count at its own split.

    Searched alone, a device's best count ignores that the others share the
    queue, the SSD and the host tier: a CPU's executors that win alone can
    hold back a GPU that could have taken their work.  So every combination
    of the devices' feasible counts runs on the whole machine (the system the
    agent and the bench run: exclusive host tier), and the best wins (ties:
    fewer executors).
    """
    import itertools

    names = list(searched)
    host = max((d.host_tier for d in devices.values()), default=0)
    results = []
    for combo in itertools.product(*(searched[n] for n in names)):
        execs = tuple(SimExecutor(f"{n}#{i}", n, devices[n].memory // p.executors,
                                  int(p.expert_memory) // p.executors)
                      for n, p in zip(names, combo) for i in range(p.executors))
        rep = simulate(sample, profile, SimSystem("tune", execs, "coserve", "coserve", host_tier=host,
                                                  host_mode="exclusive", max_wait=MAX_WAIT,
                                                  **(agent_levers() if levers is None else levers)))
        results.append((round(rep.throughput, 3), -sum(p.executors for p in combo), combo))
    tp, _, combo = max(results, key=lambda r: (r[0], r[1]))
    out = dict(devices)
    for n, p in zip(names, combo):
        out[n] = replace(out[n], executors=p.executors, expert_memory=int(p.expert_memory), split_points=p.points)
    tried = ", ".join("+".join(f"{p.executors}" for p in c) + f": {t:g}/s" for t, _, c in results)
    chosen = ", ".join(f"{n} {p.executors} executor(s) with {_size(p.expert_memory)} of experts"
                       for n, p in zip(names, combo))
    return out, (f"joint count search on the whole machine ({' + '.join(names)} executors): {chosen} "
                 f"({tp:g}/s); tried {tried}")


def _device_note(name: str, dev: DeviceProfile, best: CountPlan, plans: list[CountPlan], by: str) -> str:
    n, share = best.executors, best.executors * best.reserve / dev.memory
    reserve = (f"the max-batch activation reserve ({by}: {_size(best.reserve)} per executor) of {n} "
               f"executor(s) is {share:.0%} of {_size(dev.memory)}")
    if best.rule == "weak":
        text = (f"{name}: weak-processor rule (limited computation): {reserve}, at most {WEAK_RULE_SHARE:.0%}, so the "
                f"max batch is reserved and the rest, {_size(best.expert_memory)}, goes to experts")
    else:
        low, high = best.window
        ended = "the expert-memory cap" if best.stopped == "cap" else best.stopped
        text = (f"{name}: memory-split search (sufficient computation): {reserve}, over {WEAK_RULE_SHARE:.0%}; "
                f"the decay-window search over 1..{best.n_max} experts (the most that fit the cap) ended on "
                f"{ended} in window [{low}, {high}] after {len(best.points)} sample(s), so {best.experts} experts: "
                f"{_size(best.expert_memory)} for experts (cap {_size(best.cap)})")
    counts = ", ".join(f"{p.executors}: {p.throughput:g}/s ({p.rule})" if p.rule != "infeasible"
                       else f"{p.executors}: infeasible" for p in plans)
    text += f"; {n} executor(s), the best simulated throughput of {counts}"
    bad = [p for p in plans if p.rule == "infeasible"]
    if bad:
        text += "; infeasible: " + "; ".join(p.reason for p in bad)
    return text + "."


def _size(nbytes: float) -> str:
    return f"{nbytes / _GB:.2f} GB" if abs(nbytes) >= 0.1 * _GB else f"{nbytes / 1e6:.1f} MB"
