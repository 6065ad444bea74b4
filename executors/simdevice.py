"""The simulated device: production scheduler and pools on a virtual clock and profiled costs.

Everything that decides is the production code: `Scheduler` (assign, arrange,
split, steal, age bound, fill, hold), `Pool` with the configured eviction policy,
`ProfileCosts`, chain semantics (a classifier's "ok" submits its detector step
when the classifier finishes).  Only time is simulated:

- a batch first loads its expert from the tier it came from (the SSD is one
  shared channel that parallel executors queue for; a host copy takes the
  profiled host load time), then computes `K*n + B` of solo work;
- executors that share a device share its compute: a GPU's busy executors each
  run at c(m)/m of solo speed (processor sharing by the device's concurrency
  curve), a CPU's executors each own cores/n threads (c(n)/n);
- with an exclusive host tier, GPU victims move down into it and promotions
  leave it; with `cpu_demote`, so do the victims of the CPU executors that
  read it (storage.tiers.HostReadSource.demote), and with `cpu_demote_queued`
  those of their victims a queued request still needs, each charged one host copy
  on the evicting executor's load (the agent copies RAM to RAM on that
  executor's loader thread before its load);
- as the real executor's Prefetcher does, the next group's expert is decided
  and its room reserved when a batch is dispatched, and its read starts once
  the batch's own expert is in, while the batch computes, behind the demand
  reads issued before that (`plan_prefetch`, `book_prefetch`); with the
  scheduler's `hold`, a `wake` event at each prefetch's landing lets an
  executor that waited on its head take it then, as the agent's executor is
  woken by the pool's load event; a request never dispatched raises;
- with `read_ahead` (an exclusive host tier), as the agent's ReadAhead does,
  whenever the front box's SSD is idle it reads the earliest queued group's
  expert behind a queue's head that no pool or tier holds into the host tier (the same policy,
  `executors.readahead.next_read_ahead`).  A read is not preempted: a demand
  read issued meanwhile queues behind it.  Two differences from the agent,
  both in the simulation's favour: it reacts at once (the agent's thread
  polls every 5 ms while the SSD is idle), and the cost model prices the
  expert as a host copy from the moment its read starts (the agent, as an
  SSD read until it lands; its copy waits for the read either way).
  Host-to-GPU copies and demotion copies do not contend with each other or
  with compute (PCIe is not modelled), and a demotion takes no time;
- a pool and the host tier change when a load is issued, while its SSD read
  may still be queued: a copy from the host tier (to a GPU, or a CPU
  executor's host read) starts no earlier than the host tier's copy is there:
  the end of the SSD read that filled it (inclusive), or, for a victim moved
  down, when the victim's own copy had landed (a GPU victim at once; a CPU
  victim once its RAM copy is made).  The copying executor waits for it;
- an expert stored compressed (`stored`) takes `ProfileCosts.load_seconds`
  from SSD: max(stored bytes / disk, decoded bytes / decode) plus the
  profiled rest of the load.  It holds the SSD channel for all of that, as a
  plain load does: where decoding is the longer term the disk would idle part
  of it, which is not lent to the next read (conservative; it only matters
  where compression does not pay), and decoding takes no CPU from compute.

Several boxes (issue 15, `SimSystem.boxes`): each box has its own devices
(its GPU's and CPU's compute are shared only by that box's executors), its
own SSD channel and its own host tier; box 0 is the front box, where frames
arrive.  A batch for an executor on another box first crosses that box's
link: its frames hold the link for n x frame / bandwidth (batches to one box
queue for it), then arrive after the one-way latency; the batch computes once
both its expert and its frames are there.  Outputs are small and their way
back is not modelled.  The scheduler sees the link through ProfileCosts
(per-frame transfer in K, latency in B) and each box's SSD as its own channel.

A paper-scale task (3,500 requests, 350 experts) runs in well under a second.
"""
from __future__ import annotations

import heapq
import itertools
import math
import statistics
import time
from dataclasses import dataclass, field

from coe import CoEModel, Frame, Request
from coe.probabilities import ranked
from coe.workload import Workload, next_expert
from storage.policies import make_policy, ranks_by_value
from storage.pool import FILLS, Pool, fill_pools, initialize

from .costs import ExecutorInfo, ProfileCosts, StoredLookup, ssd_load_seconds
from .links import DEFAULT_FRAME_BYTES, Link
from .profile import DeviceProfile, Profile
from .readahead import next_read_ahead
from .scheduler import Scheduler


@dataclass(frozen=True)
class SimExecutor:
    name: str
    device: str          # 'cuda:0' | 'cpu'
    memory: int          # whole budget of this executor
    expert_memory: int   # pool capacity (the rest is for activations)
    box: int = 0         # the box it runs on (0: the front box, where frames arrive)

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
    tie_seconds: float = 0.0   # assignment: predicted makespans this close count as ties (0: the paper's rule)
    host_mode: str = "inclusive"   # 'exclusive': the host tier is a victim cache of the GPU pools
    max_wait: float | None = None  # scheduler age bound (seconds); None: off
    prefetch: bool = True          # load the next group's expert while a batch computes (as the Executor does)
    boxes: int = 1                 # boxes the executors spread over; each has its own SSD and host tier
    link: Link | None = None       # the link from the front box to each other box (None with one box)
    frame_bytes: int = DEFAULT_FRAME_BYTES   # bytes a frame takes on the link
    cpu_host_reads: bool = False   # CPU executors on the front box copy what the host tier holds instead of reading
    #                                the SSD (storage.tiers.HostReadSource; assumes both hold one dtype); a remote
    #                                box's CPU executors read its SSD, as executors/remote.py does
    cpu_demote: bool = False       # exclusive host tier: those CPU executors' victims move down into it, as GPU
    #                                victims do (the agent's cpu_victims_to_host_tier: always)
    cpu_demote_queued: bool = False   # ... only a victim that a request queued on its box still needs (the
    #                                   agent's cpu_victims_to_host_tier: queued)
    read_ahead: bool = False       # exclusive host tier: an idle SSD reads a queued group's expert that no tier
    #                                holds into the host tier, ahead of the executor that will need it
    victim_admission: bool = False   # exclusive host tier: a victim moving down is declined when the tier's
    #                                  policy ranks it below what it would push out (Pool.admit worth_keeping)
    fill: str = "round-robin"      # warm start: 'round-robin' across every executor (the paper's), or
    #                                'gpu-first': the GPU pools, then the CPU pools (storage.pool.initialize_in_turn)

    def __post_init__(self) -> None:
        if self.boxes < 1:
            raise ValueError(f"a system needs at least one box, got boxes={self.boxes}")
        bad = [e.name for e in self.executors if not 0 <= e.box < self.boxes]
        if bad:
            raise ValueError(f"executor(s) {', '.join(bad)} name a box outside 0..{self.boxes - 1}")
        if self.boxes > 1 and self.link is None:
            raise ValueError(f"{self.boxes} boxes need a link to price the frames' trip to the other boxes")
        if self.fill not in FILLS:
            raise ValueError(f"unknown fill '{self.fill}' (known: {', '.join(FILLS)})")

    def resources(self) -> str:
        """The memory and executors this system gets, for the bench table."""
        by_dev: dict[str, list[SimExecutor]] = {}
        for e in self.executors:
            if e.box == 0:
                by_dev.setdefault(e.device, []).append(e)
        parts = [f"{d}: {len(ex)} exec, {sum(e.expert_memory for e in ex) / 1e9:.2f} GB experts + "
                 f"{sum(e.memory - e.expert_memory for e in ex) / 1e9:.2f} GB activations"
                 for d, ex in by_dev.items()]
        if self.host_tier:
            reads = ("; CPU executors copy from it" + (" on the front box" if self.boxes > 1 else "")
                     + ("; their victims move down into it" if self.cpu_demote and self.host_mode == "exclusive"
                        else "; their victims with queued requests move down into it"
                        if self.cpu_demote_queued and self.host_mode == "exclusive" else "")
                     if self.cpu_host_reads and any(e.kind == "cpu" and e.box == 0 for e in self.executors) else "")
            reads += "; an idle SSD reads queued experts into it" if self.read_ahead and self.host_mode == "exclusive" else ""
            ranked = (self.victim_admission and self.host_mode == "exclusive"
                      and ranks_by_value(make_policy(self.eviction)))
            reads += (("; on the front box a victim enters it" if self.boxes > 1 else "; a victim enters it")
                      + " only above what it pushes out" if ranked else "")
            parts.append(f"host tier {self.host_tier / 1e9:.2f} GB ({self.host_mode}{reads})")
        if self.boxes > 1:
            return f"{self.boxes} boxes, each: " + "; ".join(parts) + f"; link {self.link.source}"
        return "; ".join(parts)


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
    ssd_busy: float = 0.0         # seconds the shared SSD was reading
    switch_floor: int = 0         # experts the task uses that no executor pool held at the start: >= 1 load each
    aged: int = 0                 # batches the scheduler's age bound pulled forward
    stolen: int = 0               # groups an idle executor took over from another queue
    cpu_demotions: int = 0        # CPU executors' victims moved down into the host tier (`cpu_demote`,
    #                               `cpu_demote_queued`)
    read_ahead: int = 0           # SSD reads an idle SSD made into the host tier for queued groups (`read_ahead`)
    declined: int = 0             # victims a full host tier turned away as ranked below its own (`victim_admission`)
    resources: str = ""           # memory and executors of the system
    sustained_rate: float = 0.0   # highest steady arrival rate it sustains (bench --load), 0: not measured
    latency: dict = field(default_factory=dict)        # F -> p50/p99 at F x the sustained rate (bench --load)
    order: list[tuple] = field(default_factory=list)   # (executor, expert, frame ids, start, end) per batch
    # with record_order, every SSD read: (box, expert, kind, due, begin, end); kind is 'demand' (a batch's own,
    # due when its batch was dispatched), 'prefetch' (due when its batch began to compute) or 'ahead'
    reads: list[tuple] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("order", "reads")}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


class _SimWeights:
    __slots__ = ("nbytes", "tier")

    def __init__(self, nbytes: int, tier: str) -> None:
        self.nbytes, self.tier = nbytes, tier


class _SsdSource:
    def __init__(self, model: CoEModel) -> None:
        self.model = model
        self.loads: list[tuple[str, str]] = []

    def size(self, expert_id: str) -> int:
        return self.model.experts[expert_id].nbytes

    def load(self, expert_id: str) -> _SimWeights:
        self.loads.append((expert_id, "ssd"))
        return _SimWeights(self.size(expert_id), "ssd")


class _TierSource:
    """A GPU pool's source: the host tier when the expert is there, else SSD.

    Inclusive (the paper's reading, Samba-CoE): an SSD miss is read into the
    host tier and copied from there, so the host keeps a copy.  Exclusive
    (victim cache): an SSD miss goes straight to the GPU, and an expert
    promoted from the host tier leaves it.
    """

    def __init__(self, model: CoEModel, host: Pool | None, exclusive: bool) -> None:
        self.model, self.host, self.exclusive = model, host, exclusive
        self.loads: list[tuple[str, str]] = []

    def size(self, expert_id: str) -> int:
        return self.model.experts[expert_id].nbytes

    def load(self, expert_id: str) -> _SimWeights:
        tier = "ssd"
        if self.host is not None:
            tier = "host" if self.host.contains(expert_id) else "ssd"
            if tier == "host" or not self.exclusive:
                h = self.host.acquire(expert_id)   # keeps the host tier's LRU/probability state honest
                if h is not None:
                    self.host.release(h)
                if self.exclusive:
                    self.host.discard(expert_id)
        self.loads.append((expert_id, tier))
        return _SimWeights(self.size(expert_id), tier)


class _HostReadSource(_SsdSource):
    """A CPU pool's source (storage.tiers.HostReadSource): a RAM copy of the host tier's copy, which stays
    there, when it holds the expert; else an SSD read."""

    def __init__(self, model: CoEModel, host: Pool) -> None:
        super().__init__(model)
        self.host = host

    def load(self, expert_id: str) -> _SimWeights:
        h = self.host.hold(expert_id)   # a hit keeps the host tier's recency state honest; a miss goes around it
        if h is None:
            return super().load(expert_id)
        self.host.release(h)
        self.loads.append((expert_id, "host"))
        return _SimWeights(self.size(expert_id), "host")


class _Device:
    """Processor sharing of one device's compute among its busy executors (the concurrency curve)."""

    def __init__(self, profile: DeviceProfile, configured: int) -> None:
        self.profile, self.configured = profile, configured
        self.jobs: dict[int, list] = {}   # job id -> [remaining solo seconds, version]
        self.rate = 0.0
        self.t = 0.0

    def _advance(self, now: float) -> None:
        for job in self.jobs.values():
            job[0] -= (now - self.t) * self.rate
        self.t = now

    def change(self, now: float, add: tuple[int, float] | None = None, remove: int | None = None) -> list:
        """Start or end a job at `now`; returns (finish time, job id, version) for every running job."""
        self._advance(now)
        if remove is not None:
            del self.jobs[remove]
        if add is not None:
            self.jobs[add[0]] = [add[1], 0]
        self.rate = self.profile.speed(len(self.jobs), self.configured) if self.jobs else 0.0
        out = []
        for jid, job in self.jobs.items():
            job[1] += 1
            out.append((now + max(job[0], 0.0) / self.rate, jid, job[1]))
        return out


def _device_profiles(profile: Profile, system: SimSystem) -> dict[tuple[int, str], DeviceProfile]:
    """The DeviceProfile each executor's device shares, per (box, device): executors share a device only on
    their own box; a device the profile lacks gets a flat curve."""
    out = {}
    for ex in system.executors:
        if (ex.box, ex.device) not in out:
            out[(ex.box, ex.device)] = profile.devices.get(ex.device) or DeviceProfile(ex.device, ex.kind, ex.memory)
    return out


def _configured(system: SimSystem, key: tuple[int, str]) -> int:
    return sum(1 for e in system.executors if (e.box, e.device) == key)


def simulate(workload: Workload, profile: Profile, system: SimSystem, *, record_order: bool = False,
             stored: StoredLookup | None = None) -> SimReport:
    """Run `workload` on `system`; `stored` says which experts are stored compressed (default: none)."""
    model = workload.model
    probs = model.usage_probabilities()
    prelims = {e: tuple(model.preliminaries(e)) for e in model.experts}
    exclusive = system.host_mode == "exclusive"
    clock = [0.0]
    box: list[Scheduler] = []
    ready: dict[tuple[str, str], float] = {}   # (executor, expert) -> when its prefetch lands (estimated until booked)
    planned: dict[int, tuple[str, str, list]] = {}   # job id -> (executor, its prefetch's expert, loads to book)
    # (box, expert) -> when the host tier's copy is there to copy from: the end of the SSD read that filled it,
    # or when a victim moved down landed (a pool and the host tier change when a load is issued, its read may
    # still be queued on the SSD); absent: there from the start
    avail: dict[tuple[int, str], float] = {}
    demoting: dict[tuple[str, str], float] = {}   # (executor, CPU victim moving down) -> when its own copy landed
    hosts: dict[int, Pool] = {}   # box -> its host tier
    if system.host_tier:
        for b in range(system.boxes):
            hosts[b] = Pool("host", system.host_tier,
                            make_policy("lru" if system.eviction == "fifo" else system.eviction),
                            _SsdSource(model), name="host" if b == 0 else f"host@{b}", probabilities=probs,
                            preliminaries=prelims,
                            on_event=lambda e, b=b: [box[0].refresh(e.expert_id, n) for n in on_box[b]] if box
                            else None,
                            context=lambda b=b: {"queued": above_host(b)})
    host = hosts.get(0)
    on_box = {b: [e.name for e in system.executors if e.box == b] for b in range(system.boxes)}

    def ranked_admission(b: int) -> bool:
        """As the agent: the front box's host tier only (another box's does not see the queues)."""
        return system.victim_admission and b == 0

    def above_host(b: int) -> set[str]:
        """Present for box b's host tier's policy: queued on the box, or held by one of its GPU pools."""
        out = {e for n in on_box[b] for e in (box[0].queued_set(n) if box else ())}
        return out | {e for n in on_box[b] if infos[n].device_kind == "cuda" for e in pools[n].resident()}
    pools, sources, infos = {}, {}, {}
    for ex in system.executors:
        gpu = ex.kind == "cuda"
        host = hosts.get(ex.box)
        if gpu:
            src = _TierSource(model, host, exclusive)
        elif system.cpu_host_reads and host is not None and ex.box == 0:   # as the agent: remote CPUs read SSD
            src = _HostReadSource(model, host)
        else:
            src = _SsdSource(model)

        # a CPU executor that reads the host tier moves its victims down into it too (HostReadSource.demote)
        cpu_demote = system.cpu_demote and exclusive and isinstance(src, _HostReadSource)
        # ... or only a victim a request queued on its box still needs (`cpu_demote_queued`)
        queued_demote = system.cpu_demote_queued and exclusive and isinstance(src, _HostReadSource)

        def on_event(e, name=ex.name, gpu=gpu, host=host, src=src, cpu_demote=cpu_demote,
                     queued_demote=queued_demote, b=ex.box) -> None:
            landed = 0.0
            if e.event == "evict":   # a prefetched expert evicted before its batch came: when its copy lands
                landed = ready.pop((name, e.expert_id), 0.0)
            if not box:
                return
            if exclusive and host is not None and e.event == "evict" and not e.stale:
                if gpu:
                    if host.admit(e.expert_id, keep=(e.incoming,), worth_keeping=ranked_admission(b)):
                        # a GPU victim moved down into the host tier
                        avail[(b, e.expert_id)] = max(clock[0], landed)   # no time, once the GPU's copy is in
                elif (cpu_demote or queued_demote and box[0].has_queued(e.expert_id, on_box[b])) \
                        and host.admit(e.expert_id, keep=(e.incoming,), worth_keeping=ranked_admission(b)):
                    src.loads.append((e.expert_id, "demote"))     # the RAM copy, timed on this executor's load
                    demoting[(name, e.expert_id)] = landed
            box[0].refresh(e.expert_id, name)

        pools[ex.name] = Pool(ex.kind, ex.expert_memory, make_policy(system.eviction), src, name=ex.name,
                              probabilities=probs, preliminaries=prelims, on_event=on_event,
                              context=(lambda n=ex.name: {"queued": box[0].queued_set(n) if box else set()}))
        sources[ex.name] = src
        infos[ex.name] = ExecutorInfo(ex.kind, ex.memory, pools[ex.name], device=ex.device,
                                      node=str(ex.box) if ex.box else "", link=system.link if ex.box else None,
                                      host=host, ssd_channel=str(ex.box) if system.boxes > 1 else "",
                                      host_reads=isinstance(src, _HostReadSource))
    host = hosts.get(0)
    ssd_free = [0.0] * system.boxes         # per box: when its SSD channel is free
    link_free = [0.0] * system.boxes        # per box: when the link to it is free (box 0 has none)
    box_of = {e.name: e.box for e in system.executors}
    costs = ProfileCosts(model, infos, profile, host=host,
                         ssd_inflight=lambda channel="0": max(ssd_free[int(channel)] - clock[0], 0.0)
                         + planned_ssd(int(channel)),
                         arriving=lambda name, e: max(ready.get((name, e), 0.0) - clock[0], 0.0),
                         host_arriving=lambda name, e: max(avail.get((box_of[name], e), 0.0) - clock[0], 0.0),
                         stored=stored,
                         frame_bytes=system.frame_bytes)
    sched = Scheduler([e.name for e in system.executors], system.scheduler, costs=costs,
                      tie_seconds=system.tie_seconds, now=lambda: clock[0], max_wait=system.max_wait)

    order = ranked(model.experts, probs)
    if system.init == "warm":   # the executors' pools of every box (`fill`), then the host tiers round-robin
        fill_pools(list(pools.values()), order, system.fill, {e.name for e in system.executors if e.kind == "cuda"})
        if hosts:
            held = {e for p in pools.values() for e in p.resident()}   # the host tiers start with the next ones
            initialize(list(hosts.values()), [e for e in order if e not in held])
        for s in [*sources.values(), *(h.source for h in hosts.values())]:
            s.loads.clear()
    box.append(sched)
    initial = {e for p in [*pools.values(), *hosts.values()] for e in p.resident()}
    in_pools = {e for p in pools.values() for e in p.resident()}
    init_misses = sum(p.stats().misses for p in pools.values())

    execs = {e.name: e for e in system.executors}
    devprofs = _device_profiles(profile, system)
    devices = {d: _Device(p, _configured(system, d)) for d, p in devprofs.items()}
    events: list = []
    seq = itertools.count()
    for a in workload.arrivals:
        heapq.heappush(events, (a.t, next(seq), "arrive", a))
    start: dict[str, float] = {}
    then: dict[str, str | None] = {}     # frame -> the expert after its classifier (None: none)
    latencies: list[float] = []
    last_done = 0.0        # the makespan: when the last batch ended (a later no-op event, a wake, is not work)
    busy = {n: False for n in execs}
    busy_time = {n: 0.0 for n in execs}
    running: dict[int, tuple] = {}   # job id -> (executor, batch, handle, dispatched at, work)
    ssd_busy = 0.0
    ssd_loads = host_loads = batches = batched = demotions = ahead_loads = 0
    record: list[tuple] = []
    reads_log: list[tuple] = []
    jobs = itertools.count()
    now = 0.0

    def read(name: str, start: float, loads: list[tuple[str, str]], *, book: bool = True,
             kind: str = "demand") -> float:
        """Time the loads the pool just asked its source for, from `start`; returns when they are done.

        A copy from the host tier starts no earlier than the host tier's copy is there (`avail`); an SSD read
        into an inclusive host tier makes its copy available when the read ends.  `book=False` (a planned
        prefetch) estimates, behind the reads booked and planned on the box: the SSD and the counters are
        left as they are, but the host tier's copies these loads make, already in its books, get the
        estimated time in `avail` (nobody copies them sooner; the booking sets the real one)."""
        nonlocal ssd_busy, ssd_loads, host_loads, demotions
        t = start
        b = execs[name].box
        src = sources[name]
        fills_host = isinstance(src, _TierSource) and src.host is not None and not src.exclusive
        ssd_at = ssd_free[b] if book else max(ssd_free[b], clock[0]) + planned_ssd(b)
        for expert_id, tier in loads:
            if tier == "demote":   # a CPU victim copied down into the host tier: one host copy, not a load
                landed = demoting.pop((name, expert_id), 0.0) if book else demoting.get((name, expert_id), 0.0)
                t = avail[(b, expert_id)] = max(t, landed) + costs.load_seconds(name, expert_id, "host")
                if book:
                    demotions += 1
                continue
            secs = costs.load_seconds(name, expert_id, tier)
            if tier == "ssd":
                begin = max(t, ssd_at)
                t = ssd_at = begin + secs
                if book:
                    if record_order:
                        reads_log.append((b, expert_id, kind, start, begin, t))
                    ssd_free[b] = ssd_at
                    ssd_busy += secs
                    ssd_loads += 1
                if fills_host:
                    avail[(b, expert_id)] = t
            else:
                t = max(t, avail.get((b, expert_id), 0.0)) + secs
                if book:
                    host_loads += 1
        return t

    def dispatch() -> None:
        nonlocal batches, batched
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
            # a prefetch of this expert may still be reading: the batch starts when it lands
            t = max(read(name, now, src.loads[n_loads:]), ready.pop((name, b.expert_id), 0.0))
            if ex.box:   # the frames cross the link to the executor's box; it computes once they are there
                per_frame, latency = costs.transfer(name)
                sent = link_free[ex.box] = max(now, link_free[ex.box]) + per_frame * len(b)
                t = max(t, sent + latency)
            jid = next(jobs)
            if system.prefetch:
                plan_prefetch(name, b.expert_id, t, jid)
            a = costs.arch(name, b.expert_id)
            busy[name] = True
            batches += 1
            batched += len(b)
            running[jid] = (name, b, handle, now, a.K * len(b) + a.B)
            heapq.heappush(events, (t, next(seq), "compute", jid))

    def read_ahead() -> None:
        """As the agent's ReadAhead (executors/readahead.py): while box 0's SSD is idle, read the earliest
        queued group's expert that no pool or tier holds into the host tier; its copy is there when the read
        ends (`avail`).  Not preemptive: a demand read issued meanwhile queues behind it, as on the SSD."""
        nonlocal ssd_busy, ssd_loads, ahead_loads
        if not system.read_ahead or host is None or not exclusive or ssd_free[0] > now:
            return
        local = [n for n in execs if execs[n].box == 0]
        queues = [sched.queued_groups(n) for n in local]
        # only for an executor that takes it from the host tier: a GPU, or a CPU executor with host reads
        takes = [isinstance(sources[n], (_TierSource, _HostReadSource)) for n in local]
        eid = next_read_ahead(queues, lambda e: host.present(e) or any(pools[n].present(e) for n in local),
                              usable=[lambda _e, t=t: t for t in takes])
        if eid is None or not host.admit(eid, keep={e for q in queues for e in q}):
            return
        secs = min(costs.load_seconds(n, eid, "ssd") for n in local)
        t = ssd_free[0] = now + secs
        if record_order:
            reads_log.append((0, eid, "ahead", now, now, t))
        avail[(0, eid)] = t
        ssd_busy += secs
        ssd_loads += 1
        ahead_loads += 1
        heapq.heappush(events, (t, next(seq), "ssd-free", None))   # the SSD is free again: look once more

    def plan_prefetch(name: str, current: str, start: float, jid: int) -> None:
        """As the executor's Prefetcher: decide the next group's expert when the batch is dispatched and reserve
        its room, so the scheduler sees it arriving from now on (`ready` holds an estimate); its reads are
        booked when the batch computes (`book_prefetch`), behind the demand reads issued before that."""
        nxt = sched.next_expert(name, current)
        pool, src = pools[name], sources[name]
        if nxt is None or pool.present(nxt):
            return
        n_loads = len(src.loads)
        h = pool.acquire(nxt)
        if h is None:
            return   # it cannot fit next to pinned experts now; the batch will load it
        pool.release(h)
        loads = src.loads[n_loads:]
        ready[(name, nxt)] = read(name, start, loads, book=False)
        planned[jid] = (name, nxt, loads)
        wake(ready[(name, nxt)])

    def wake(t: float) -> None:
        """Look at the executors again at `t`, when a prefetch lands: one holding its head for that load
        (the scheduler's `hold`) takes it then, as the agent's executor wakes on the pool's load event.
        Only for a policy that holds, so every other system's events are as they were."""
        if sched.policy.hold:
            heapq.heappush(events, (t, next(seq), "wake", None))

    def planned_ssd(b: int) -> float:
        """SSD seconds of box b's planned prefetches that have not taken their place on the SSD yet."""
        return sum(costs.load_seconds(n, e, "ssd") for n, _, loads in planned.values() if execs[n].box == b
                   for e, tier in loads if tier == "ssd")

    def book_prefetch(jid: int) -> None:
        """The batch computes: the planned prefetch's reads take their place on the SSD now."""
        got = planned.pop(jid, None)
        if got is None:
            return
        name, nxt, loads = got
        if (name, nxt) in ready:   # not evicted since it was planned
            ready[(name, nxt)] = read(name, now, loads, kind="prefetch")
            wake(ready[(name, nxt)])

    def reschedule(finishes: list) -> None:
        for t, jid, version in finishes:
            heapq.heappush(events, (t, next(seq), "done", (jid, version)))

    while events:
        now, _, kind, data = heapq.heappop(events)
        clock[0] = now
        if kind == "arrive":
            a = data
            start[a.frame_id] = a.t
            then[a.frame_id] = next_expert(model, a)
            frame = Frame(a.frame_id, "sim", "sim", a.component, a.t, None, received_at=a.t)
            sched.submit(Request(frame, model.components[a.component].classifier))
        elif kind in ("ssd-free", "wake"):
            pass
        elif kind == "compute":
            book_prefetch(data)
            name, b, handle, t0, work = running[data]
            reschedule(devices[(execs[name].box, execs[name].device)].change(now, add=(data, work)))
        else:
            jid, version = data
            if jid not in running:
                continue
            name, b, handle, t0, work = running[jid]
            dev = devices[(execs[name].box, execs[name].device)]
            if dev.jobs.get(jid, (0, -1))[1] != version:
                continue   # superseded: the device's sharing changed since this finish was predicted
            del running[jid]
            last_done = now
            reschedule(dev.change(now, remove=jid))
            pools[name].release(handle)
            sched.finished(b)
            busy[name] = False
            busy_time[name] += now - t0
            if record_order:
                record.append((name, b.expert_id, tuple(r.frame.frame_id for r in b.requests), t0, now))
            for r in b.requests:
                nxt = then[r.frame.frame_id] if r.stage == 0 else None
                if nxt is not None:
                    sched.submit(Request(r.frame, nxt, stage=r.stage + 1))
                else:
                    latencies.append(now - start[r.frame.frame_id])
        if events and events[0][0] <= now:
            continue  # simultaneous events first: a dispatch sees everything that happened at `now`
        dispatch()
        read_ahead()

    if sched.depth():
        raise RuntimeError(f"{system.name}: {sched.depth()} request(s) were never dispatched")
    if sched.estimate_faults:   # the agent logs it and runs on; a simulation (and every test on one) fails on it
        raise RuntimeError(f"{system.name}: the scheduler's queue estimate went negative {sched.estimate_faults} "
                           "time(s) (see the log): a scheduler bug")
    makespan = last_done
    frames = len(workload.arrivals)
    lat = sorted(latencies)
    lb = lower_bound(workload, profile, system, initial, stored=stored)
    return SimReport(
        system=system.name, frames=frames, makespan=makespan, throughput=frames / makespan if makespan else 0.0,
        switches=sum(p.stats().misses for p in pools.values()) - init_misses, ssd_loads=ssd_loads, host_loads=host_loads,
        p50_ms=1000 * statistics.median(lat), p99_ms=1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        batches=batches, mean_batch=batched / batches if batches else 0.0, lower_bound=lb,
        efficiency=lb / makespan if makespan else 0.0,
        decision_us=1e6 * sched.decision_seconds / max(sched.decisions, 1),
        busy_fraction=sum(busy_time.values()) / (makespan * len(execs)) if makespan else 0.0, order=record,
        reads=reads_log,
        sched_share=sched.decision_seconds / (makespan * len(execs)) if makespan else 0.0,
        manage_share=sum(p.stats().manage_seconds for p in pools.values()) / (makespan * len(execs))
        if makespan else 0.0, ssd_busy=ssd_busy, aged=sched.aged, stolen=sched.stolen, cpu_demotions=demotions, read_ahead=ahead_loads,
        declined=sum(h.stats().declined for h in hosts.values()),
        resources=system.resources(),
        switch_floor=sum(1 for e in uses(workload) if e not in in_pools))


def uses(workload: Workload) -> dict[str, int]:
    """Requests per expert in the task: each arrival's classifier, and its detector when the frame is ok."""
    model = workload.model
    out: dict[str, int] = {}
    for a in workload.arrivals:
        cls = model.components[a.component].classifier
        out[cls] = out.get(cls, 0) + 1
        nxt = next_expert(model, a)
        if nxt:
            out[nxt] = out.get(nxt, 0) + 1
    return out


def lower_bound(workload: Workload, profile: Profile, system: SimSystem, initial: set[str], *,
                stored: StoredLookup | None = None) -> float:
    """A makespan no schedule of this system can beat; each term is a valid bound on its own.

    (a) The last arrival plus the fastest single pass through its chain.
    (b) Compute: each request costs at least min over device kinds of
        K + B / max batch (a batch never holds more than the profiled max batch,
        so B is shared by at most that many).  In time T a device delivers at
        most capacity x T of profiled-speed work (its concurrency curve: a GPU's
        busy executors share it; a CPU's executors own a share of its cores), so
        T >= sum of per-request minima / sum of device capacities, however
        requests are split across CPU and GPU.
        With two device kinds (a GPU and a CPU) the split itself is bounded too
        (`split_compute`): a request served on kind k costs that kind at least
        its own K + B / max batch there, so the least T over every fractional
        split of each expert's requests between the kinds, each kind
        delivering at most its capacity x T, is below every schedule.
    (c) SSD: every expert the task uses that no tier held at the start is
        read at least once, at its fastest load (as it is stored: `stored`,
        see `simulate`), on the one shared SSD; with several boxes, on one of
        their SSDs, which read at once at best: the sum over the boxes.
    (d) SSD under a memory limit (`memory_limited_reads`): at any time t the
        tiers hold at most their capacity, so of the experts still needed
        after t some must be read after t; the best case over t.
    The link only adds time, so leaving it out keeps every term a bound;
    (b) sums the devices of every box.
    """
    model = workload.model
    devs = _device_profiles(profile, system)
    kinds = {d.kind for d in devs.values()}
    n_by = uses(workload)

    def single(expert_id: str) -> float:
        arch = model.experts[expert_id].arch
        return min(profile.arch(arch, k).batch_seconds(1) / max(d.speed(1, _configured(system, key))
                                                                 for key, d in devs.items() if d.kind == k)
                   for k in kinds)

    by_kind: dict[str, float] = {}
    for key, d in devs.items():
        by_kind[d.kind] = by_kind.get(d.kind, 0.0) + d.capacity(_configured(system, key))
    work: dict[str, list] = {}   # per architecture: [requests, {kind: least seconds a request costs there}]
    for e, n in n_by.items():
        arch = model.experts[e].arch
        if arch not in work:
            work[arch] = [0, {k: profile.arch(arch, k).K + profile.arch(arch, k).B / profile.arch(arch, k).max_batch
                              for k in kinds}]
        work[arch][0] += n
    compute = split_compute([(n, c) for n, c in work.values()], by_kind)
    last = workload.arrivals[-1]
    cls = model.components[last.component].classifier
    nxt = next_expert(model, last)
    chain = single(cls) + (single(nxt) if nxt else 0.0)
    form = stored or (lambda expert_id: None)
    spill = sum(min(ssd_load_seconds(profile.arch(model.experts[e].arch, k), form(e), profile.storage) for k in kinds)
                for e in n_by if e not in initial) / system.boxes   # each box reads its own SSD, at best all at once
    read = {e: min(ssd_load_seconds(profile.arch(model.experts[e].arch, k), form(e), profile.storage) for k in kinds)
            for e in n_by}
    limited = memory_limited_reads(workload, system, read)
    return max(last.t + chain, compute, spill, limited)


def split_compute(work: list[tuple[int, dict[str, float]]], capacity: dict[str, float]) -> float:
    """The least time T in which `work` can be done when each item's requests may be split between the device
    kinds in any fractions: item (n, {kind: c}) is n requests costing c seconds of kind-time each, and kind k
    delivers capacity[k] x T seconds of such time in T.  0 when there is no work.

    Claim: every schedule's compute takes at least this.  Let x_k be how many of an item's requests a schedule
    serves on kind k; kind k then does at least sum x_k c_k of work, and does at most capacity[k] x makespan,
    so the makespan is at least the T of that split, and the least T over all fractional splits is below it.

    With one kind: sum n c / capacity.  With two (a and b): for a given T, kind b must take at least
    total_a - capacity_a T of kind-a work while doing at most capacity_b T of its own, a fractional knapsack
    solved by moving items to b in ascending c_b / c_a, so T is found by moving them in that order until the two
    kinds' times meet.  With more than two kinds, the looser pooled form: every request at its cheapest kind's
    cost, over all kinds' capacity (which the two-kind answer is never below).
    """
    kinds = [k for k, cap in capacity.items() if cap > 0]
    items = [(n, c) for n, c in work if n > 0]
    if not items or not kinds:
        return 0.0
    if len(kinds) != 2:
        return sum(n * min(c[k] for k in kinds) for n, c in items) / sum(capacity[k] for k in kinds)
    a, b = kinds
    ca, cb = capacity[a], capacity[b]
    wa, wb = sum(n * c[a] for n, c in items), 0.0
    for n, c in sorted(items, key=lambda it: (it[1][b] / it[1][a]) if it[1][a] > 0 else math.inf):
        if wb / cb >= wa / ca:
            break
        whole_a, whole_b = wa - n * c[a], wb + n * c[b]
        if whole_b / cb <= whole_a / ca:
            wa, wb = whole_a, whole_b
            continue
        f = (wa / ca - wb / cb) / (n * (c[a] / ca + c[b] / cb))   # the fraction where the two times meet
        return (wb + f * n * c[b]) / cb
    return max(wa / ca, wb / cb)


def last_needed(workload: Workload) -> dict[str, float]:
    """Per expert the task uses: the latest arrival of a frame that needs it (its classifier, or its
    detector when the frame is ok); the expert is served at or after that time."""
    model = workload.model
    out: dict[str, float] = {}
    for a in workload.arrivals:
        cls = model.components[a.component].classifier
        out[cls] = max(out.get(cls, a.t), a.t)
        nxt = next_expert(model, a)
        if nxt:
            out[nxt] = max(out.get(nxt, a.t), a.t)
    return out


def memory_limited_reads(workload: Workload, system: SimSystem, read: dict[str, float]) -> float:
    """Lower bound (d): max over t of t + (SSD seconds that must start after t) / boxes.

    Claim: for every time t, makespan >= t + (sum of r_x over N_t minus
    FK(N_t, C)) / boxes, where N_t are the experts some frame arriving at or
    after t needs (`last_needed` >= t), r_x the fastest read of x (`read`),
    C the bytes of every executor pool and host tier of the system, and
    FK(N, C) the fractional knapsack: the most read seconds a set of N's
    experts of at most C bytes can carry, items taken by r_x / bytes,
    the last one in part.

    Proof.  Each x in N_t is needed by a request served at or after t (a
    request is served after its frame arrives; a detector's after its
    classifier's), so x is resident in that executor's pool then.  Let H be
    the experts held (resident or loading) in any pool or tier at time t.
    Every pool holds at most its capacity, loading entries included, so the
    distinct experts of H take at most C bytes.  An expert enters a tier only
    by an SSD read, or by a copy from a tier that holds it (host tier to GPU,
    host tier to a CPU executor, a GPU or CPU victim moved down), so an x in N_t
    that is not in H is read from SSD by a read issued at or after t, hence
    started at or after t.  Those reads are distinct (one expert each), each
    takes at least r_x, and one box's SSD reads one at a time, so with b
    boxes the last of them ends no earlier than t + sum over N_t minus H of
    r_x, over b.  That sum is at least sum over N_t of r_x minus the read
    seconds of N_t's experts in H, which fit in C bytes: at most the 0/1
    knapsack of N_t into C, and that is at most its fractional relaxation
    FK.  A schedule ends after its last read, so its makespan is at least
    the right-hand side, for every t.  (At t = 0 term (c) is the same
    argument with H known: the experts held at the start.)

    Only t equal to some expert's last-needed time need be tried: between
    two of them N_t does not change and the bound grows with t.
    """
    model = workload.model
    last = last_needed(workload)
    capacity = sum(e.expert_memory for e in system.executors) + system.host_tier * system.boxes
    # densest first: the fractional knapsack keeps the most read seconds per byte
    # (an expert of no bytes takes no room: any set keeps it, so it comes first and is kept whole)
    items = sorted(((read[e] / model.experts[e].nbytes if model.experts[e].nbytes > 0 else float("inf"),
                     model.experts[e].nbytes, read[e], last[e])
                    for e in last if read.get(e, 0.0) > 0), reverse=True)
    best = 0.0
    for t in sorted({t for *_, t in items}):
        room, kept, total = float(capacity), 0.0, 0.0
        for density, nbytes, r, needed in items:
            if needed < t:
                continue
            total += r
            if nbytes <= 0:
                kept += r
            elif room > 0:
                take = min(float(nbytes), room)
                kept += density * take
                room -= take
        best = max(best, t + max(total - kept, 0.0) / system.boxes)
    return best


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
