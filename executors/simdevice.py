"""The simulated device: production scheduler and pools on a virtual clock and profiled costs.

Everything that decides is the production code: `Scheduler` (assign, arrange,
split), `Pool` with the configured eviction policy, `ProfileCosts`, chain
semantics (a classifier's "ok" submits its detector step when the classifier
finishes).  Only time is simulated: a batch takes the profiled K*n+B plus the
profiled load latency of its expert from the tier it came from, and the SSD is
one shared channel (parallel executors queue for it, as they would for one
disk).  A paper-scale task (3,500 requests, 350 experts) runs in seconds.
"""
from __future__ import annotations

import heapq
import itertools
import statistics
import time
from dataclasses import dataclass, field

from coe import CoEModel, Frame, Request
from coe.workload import Workload
from storage.policies import make_policy
from storage.pool import Pool, initialize

from .costs import ExecutorInfo, ProfileCosts
from .profile import Profile
from .scheduler import Scheduler


@dataclass(frozen=True)
class SimExecutor:
    name: str
    device: str          # 'cuda:0' | 'cpu'
    memory: int          # whole budget of this executor
    expert_memory: int   # pool capacity (the rest is for activations)

    @property
    def kind(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class SimSystem:
    """One system under test: executors, scheduler policy, eviction policy, host tier."""

    name: str
    executors: tuple[SimExecutor, ...]
    scheduler: str
    eviction: str
    host_tier: int = 0
    init: str = "warm"   # 'warm': pools filled by usage probability before the task; 'cold': empty
    tie_seconds: float = 0.0   # CoServe assignment: predicted makespans this close count as ties


@dataclass
class SimReport:
    system: str
    frames: int
    makespan: float
    throughput: float
    switches: int                 # loads into executor pools
    ssd_loads: int
    host_loads: int
    p50_ms: float
    p99_ms: float
    batches: int
    mean_batch: float
    lower_bound: float
    efficiency: float
    decision_us: float
    busy_fraction: float          # executor time busy (loading or computing) / (makespan x executors)
    sched_share: float = 0.0      # scheduler decision time / (makespan x executors)
    manage_share: float = 0.0     # expert-management bookkeeping time / (makespan x executors)
    real_run: bool = False
    order: list[tuple] = field(default_factory=list)   # (executor, expert, frame ids, start, end) per batch

    def to_json(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k != "order"}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


class _SimWeights:
    __slots__ = ("nbytes", "tier")

    def __init__(self, nbytes: int, tier: str) -> None:
        self.nbytes, self.tier = nbytes, tier


class _SsdSource:
    def __init__(self, model: CoEModel) -> None:
        self.model = model

    def size(self, expert_id: str) -> int:
        return self.model.experts[expert_id].nbytes

    def load(self, expert_id: str) -> _SimWeights:
        return _SimWeights(self.size(expert_id), "ssd")


class _TierSource:
    """Loads into an executor pool from the host tier when it is there, else from SSD (through it)."""

    def __init__(self, model: CoEModel, host: Pool | None) -> None:
        self.model, self.host = model, host
        self.loads: list[tuple[str, str]] = []

    def size(self, expert_id: str) -> int:
        return self.model.experts[expert_id].nbytes

    def load(self, expert_id: str) -> _SimWeights:
        tier = "ssd"
        if self.host is not None:
            tier = "host" if self.host.contains(expert_id) else "ssd"
            h = self.host.acquire(expert_id)   # keeps the host tier's LRU/probability state honest
            if h is not None:
                self.host.release(h)
        self.loads.append((expert_id, tier))
        return _SimWeights(self.size(expert_id), tier)


def simulate(workload: Workload, profile: Profile, system: SimSystem, *, record_order: bool = False) -> SimReport:
    model = workload.model
    probs = model.usage_probabilities()
    prelims = {e: tuple(model.preliminaries(e)) for e in model.experts}
    host = None
    if system.host_tier:
        host = Pool("host", system.host_tier, make_policy("lru" if system.eviction == "fifo" else system.eviction),
                    _SsdSource(model), probabilities=probs, preliminaries=prelims)
    sched_box: list[Scheduler] = []
    pools, sources, infos = {}, {}, {}
    for ex in system.executors:
        src = _TierSource(model, host)
        pools[ex.name] = Pool(ex.kind, ex.expert_memory, make_policy(system.eviction), src, name=ex.name,
                              probabilities=probs, preliminaries=prelims,
                              context=(lambda n=ex.name: {"queued": sched_box[0].queued_set(n)}))
        sources[ex.name] = src
        infos[ex.name] = ExecutorInfo(ex.kind, ex.memory, pools[ex.name])
    costs = ProfileCosts(model, infos, profile, host=host)
    sched = Scheduler([e.name for e in system.executors], system.scheduler, costs=costs,
                      tie_seconds=system.tie_seconds)
    sched_box.append(sched)

    order = sorted(model.experts, key=lambda e: -probs[e])
    if system.init == "warm":
        initialize(list(pools.values()), order)
        if host is not None:
            initialize([host], [e for e in order if not any(p.contains(e) for p in pools.values())])
        for s in sources.values():
            s.loads.clear()
    initial = {e for p in [*pools.values(), *([host] if host else [])] for e in p.resident()}
    init_misses = sum(p.stats().misses for p in pools.values())

    execs = {e.name: e for e in system.executors}
    events: list = []
    seq = itertools.count()
    for a in workload.arrivals:
        heapq.heappush(events, (a.t, next(seq), "arrive", a))
    start: dict[str, float] = {}
    ok: dict[str, bool] = {}
    latencies: list[float] = []
    busy = {n: False for n in execs}
    busy_time = {n: 0.0 for n in execs}
    ssd_free = 0.0
    ssd_loads = host_loads = batches = batched = 0
    record: list[tuple] = []
    now = 0.0

    def dispatch() -> None:
        nonlocal ssd_free, ssd_loads, host_loads, batches, batched
        for name, ex in execs.items():
            if busy[name]:
                continue
            b = sched.next_batch(name, timeout=0)
            if b is None:
                continue
            pool, src = pools[name], sources[name]
            n_loads = len(src.loads)
            handle = pool.acquire(b.expert_id)
            if handle is None:
                raise RuntimeError(f"{name}: expert {b.expert_id} cannot fit next to pinned experts")
            t = now
            for expert_id, tier in src.loads[n_loads:]:
                a = costs.arch(name, expert_id)
                if tier == "ssd":
                    begin = max(t, ssd_free)
                    t = ssd_free = begin + a.load("ssd")
                    ssd_loads += 1
                else:
                    t += a.load("host")
                    host_loads += 1
            K, B = costs.exec_cost(name, b.expert_id)
            done = t + K * len(b) + B
            busy[name] = True
            busy_time[name] += done - now
            batches += 1
            batched += len(b)
            if record_order:
                record.append((name, b.expert_id, tuple(r.frame.frame_id for r in b.requests), now, done))
            heapq.heappush(events, (done, next(seq), "done", (name, b, handle)))

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            a = data
            start[a.frame_id] = a.t
            ok[a.frame_id] = a.ok
            frame = Frame(a.frame_id, "sim", "sim", a.component, a.t, None, received_at=a.t)
            sched.submit(Request(frame, model.components[a.component].classifier))
        else:
            name, b, handle = data
            pools[name].release(handle)
            busy[name] = False
            expert = model.experts[b.expert_id]
            for r in b.requests:
                nxt = expert.next.get("ok") if r.stage == 0 and ok[r.frame.frame_id] else None
                if nxt is not None:
                    sched.submit(Request(r.frame, nxt, stage=r.stage + 1))
                else:
                    latencies.append(now - start[r.frame.frame_id])
        if events and events[0][0] <= now:
            continue  # simultaneous events first: a dispatch sees everything that happened at `now`
        dispatch()

    makespan = now
    frames = len(workload.arrivals)
    lat = sorted(latencies)
    lb = lower_bound(workload, profile, system, initial)
    return SimReport(
        system=system.name, frames=frames, makespan=makespan, throughput=frames / makespan if makespan else 0.0,
        switches=sum(p.stats().misses for p in pools.values()) - init_misses, ssd_loads=ssd_loads, host_loads=host_loads,
        p50_ms=1000 * statistics.median(lat), p99_ms=1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        batches=batches, mean_batch=batched / batches if batches else 0.0, lower_bound=lb,
        efficiency=lb / makespan if makespan else 0.0,
        decision_us=1e6 * sched.decision_seconds / max(sched.decisions, 1),
        busy_fraction=sum(busy_time.values()) / (makespan * len(execs)) if makespan else 0.0, order=record,
        sched_share=sched.decision_seconds / (makespan * len(execs)) if makespan else 0.0,
        manage_share=sum(p.stats().manage_seconds for p in pools.values()) / (makespan * len(execs))
        if makespan else 0.0)


def lower_bound(workload: Workload, profile: Profile, system: SimSystem, initial: set[str]) -> float:
    """A makespan no schedule can beat on these executors.

    The larger of: (a) the last arrival plus the fastest single pass through its
    chain; (b) all compute at the best batch efficiency of the fastest device,
    spread over every executor; (c) the SSD time of experts the task uses that
    no tier held at the start, each read once, on the one shared SSD.
    """
    model = workload.model
    kinds = {e.kind for e in system.executors}
    uses: dict[str, int] = {}
    for a in workload.arrivals:
        cls = model.components[a.component].classifier
        uses[cls] = uses.get(cls, 0) + 1
        nxt = model.experts[cls].next.get("ok") if a.ok else None
        if nxt:
            uses[nxt] = uses.get(nxt, 0) + 1

    def best(expert_id: str, n: int) -> float:
        arch = model.experts[expert_id].arch
        out = []
        for k in kinds:
            a = profile.arch(arch, k)
            out.append(a.K * n + a.B * -(-n // a.max_batch))
        return min(out)

    compute = sum(best(e, n) for e, n in uses.items()) / len(system.executors)
    last = workload.arrivals[-1]
    cls = model.components[last.component].classifier
    chain = best(cls, 1) + (best(model.experts[cls].next["ok"], 1) if last.ok and model.experts[cls].next else 0)
    spill = sum(min(profile.arch(model.experts[e].arch, k).load("ssd") for k in kinds)
                for e in uses if e not in initial)
    return max(last.t + chain, compute, spill)


def decision_overhead(workload: Workload, profile: Profile, system: SimSystem, queued: int = 3500) -> float:
    """Mean seconds per `submit` with `queued` requests already queued (no execution)."""
    model = workload.model
    infos, pools = {}, {}
    for ex in system.executors:
        pools[ex.name] = Pool(ex.kind, ex.expert_memory, make_policy(system.eviction), _SsdSource(model),
                              name=ex.name)
        infos[ex.name] = ExecutorInfo(ex.kind, ex.memory, pools[ex.name])
    sched = Scheduler([e.name for e in system.executors], system.scheduler,
                      costs=ProfileCosts(model, infos, profile))
    arrivals = list(workload.arrivals)
    reqs = [Request(Frame(a.frame_id, "sim", "sim", a.component, a.t, None),
                    model.components[a.component].classifier) for a in itertools.islice(
                        itertools.cycle(arrivals), queued + 500)]
    for r in reqs[:queued]:
        sched.submit(r)
    t0 = time.perf_counter()
    for r in reqs[queued:]:
        sched.submit(r)
    return (time.perf_counter() - t0) / 500
