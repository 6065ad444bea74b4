"""A real run of one system on this machine: real experts, real pools, real executor threads.

The same `Scheduler`, `Pool`, `Executor` and chain semantics as the agent, fed
in-process (no sockets, so the comparison measures scheduling and expert
management, not ZeroMQ).  Frames arrive on a real clock every `interval`
seconds.  With `cold=True` every expert file is dropped from the page cache
before the run and again after each load, so every load is a real SSD read
(a line box whose RAM cannot cache its zoo).
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from coe import CoEModel, Frame, Request, StepError, decide
from coe.probabilities import ranked
from coe.workload import Workload
from storage.disk_activity import DiskActivity
from storage.pagecache import drop_from_page_cache
from storage.policies import make_policy
from storage.pool import Pool, fill_pools, initialize_tier, present_above
from storage.tiers import HostReadSource, StoreSource, TierSource, current_in, demote, measured_nbytes

from .costs import ExecutorInfo, ProfileCosts, store_forms
from .executor import BatchResult, Executor
from .profile import Profile
from .readahead import ReadAhead, scheduler_note, usable_from_host
from .scheduler import Scheduler
from .simdevice import SimReport, SimSystem


class ColdStoreSource(StoreSource):
    """StoreSource that drops each file from the page cache after reading it: every load hits the disk."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0                      # SSD reads through this source (executor and prefetch threads)
        self._count = threading.Lock()

    def load(self, expert_id: str, reuse=()):
        value = super().load(expert_id, reuse)
        drop_from_page_cache(self.store.path(expert_id))
        with self._count:
            self.reads += 1
        return value


@dataclass
class RealOptions:
    interval: float = 0.004
    cold: bool = True
    image_size: int = 64
    timeout: float = 900.0
    prequeue: bool = False   # submit every arrival before the executors start (order tests)


def run_real(workload: Workload, model: CoEModel, store, profile: Profile | None, system: SimSystem,
             opts: RealOptions | None = None, *, images: dict[str, list[np.ndarray]] | None = None) -> SimReport:
    """Run `system` on real experts; the report has the simulator's shape.

    CPU executors load from the SSD (or copy what the host tier holds, with
    `system.cpu_host_reads`); CUDA executors load through a pinned host tier
    of `system.host_tier` bytes (straight from the SSD without one), which is
    a victim cache of the GPU pools when `system.host_mode` is 'exclusive':
    the agent's tiers, wired as `edge_agent.agent` wires them.
    """
    opts = opts or RealOptions()
    probs = model.usage_probabilities()
    prelims = {e: tuple(model.preliminaries(e)) for e in model.experts}
    box: list[Scheduler] = []
    execs: dict[str, Executor] = {}    # filled once the scheduler exists; pool events before that find none
    pools, infos = {}, {}
    built: list[StoreSource] = []   # every store source of this run: with `cold`, their reads are the SSD reads

    disk = DiskActivity()              # the box's SSD: the demand reads a read-ahead waits out (as the agent)

    def store_source(**kw) -> StoreSource:
        built.append((ColdStoreSource if opts.cold else StoreSource)(store, activity=disk, **kw))
        return built[-1]
    gpus = [ex.name for ex in system.executors if ex.kind == "cuda"]

    def above_host() -> set[str]:
        return present_above((box[0].queued_set(n) for n in pools) if box else (),
                             (pools[n] for n in gpus if n in pools))

    if system.cpu_demote:
        raise ValueError(f"{system.name}: real runs do not move every CPU victim into the host tier (cpu_demote, "
                         "+cpudemote), only those a queued request still needs (cpu_demote_queued); the simulator "
                         "and the agent do both")
    host = None
    if gpus and system.host_tier:
        host = Pool("host", system.host_tier, make_policy(system.eviction), store_source(pin=True, dtype="float32"),
                    name="host", probabilities=probs, preliminaries=prelims, context=lambda: {"queued": above_host()},
                    on_event=lambda e: box[0].refresh(e.expert_id, None) if box else None, measure=measured_nbytes)
    exclusive = host is not None and system.host_mode == "exclusive"

    closing: list[bool] = []
    host_readers: dict[str, HostReadSource] = {}   # CPU executor -> its HostReadSource (it demotes its victims)

    def on_event(e, name: str, kind: str) -> None:
        if e.event == "evict":
            if exclusive and kind == "cuda" and not e.stale and not closing:
                # the GPU victim moves down into the host tier (unless read back in before a late report)
                # (or held by another GPU pool: the exclusive tier takes no second copy)
                demote(e, host, ranked=system.victim_admission, held=lambda x: any(pools[n].present(x) for n in gpus),
                       current=current_in(store))
            elif (exclusive and system.cpu_demote_queued and name in host_readers and not e.stale and not closing
                  and box and box[0].has_queued(e.expert_id)):
                # as the agent: a CPU victim a queued request still needs
                host_readers[name].demote(e, ranked=system.victim_admission)
            if name in execs:
                execs[name].on_evicted(e.value)     # as the agent: its skeleton lets the victim's buffer go
        if box:
            box[0].refresh(e.expert_id, name)

    for ex in system.executors:
        if ex.kind == "cuda":
            src = TierSource(host or store_source(pin=True, dtype="float32"), ex.device, exclusive=exclusive)
        elif ex.kind == "cpu":
            src = store_source(dtype="float32")   # as the agent's CPU pools
            if host is not None and system.cpu_host_reads:
                src = host_readers[ex.name] = HostReadSource(host, src)
        else:
            raise ValueError(f"real runs use CPU and CUDA executors; {ex.name} is on {ex.device}")
        pools[ex.name] = Pool(ex.device if ex.kind == "cuda" else "cpu", ex.expert_memory,
                              make_policy(system.eviction), src, name=ex.name, probabilities=probs,
                              preliminaries=prelims, on_event=lambda e, n=ex.name, k=ex.kind: on_event(e, n, k),
                              context=(lambda n=ex.name: {"queued": box[0].queued_set(n)}),
                              measure=measured_nbytes if ex.kind == "cuda" else None)
        reads = src.compatible if isinstance(src, HostReadSource) else False
        infos[ex.name] = ExecutorInfo(ex.kind, ex.memory, pools[ex.name], device=ex.device, host_reads=reads)
    costs = ProfileCosts(model, infos, profile, host=host, stored=store_forms(store),
                         arriving=lambda n, e: execs[n].prefetch_remaining(e) if n in execs else 0.0)
    sched = Scheduler([e.name for e in system.executors], system.scheduler, costs=costs,
                      tie_seconds=system.tie_seconds, max_wait=system.max_wait)
    box.append(sched)
    for name in pools:      # each expert's loaded size, read now as the agent does: not under the scheduler's lock
        for e in model.experts:
            costs.fits(name, e)
    if system.init == "warm":
        order = ranked(model.experts, probs)
        fill_pools(list(pools.values()), order, system.fill, set(gpus))
        if host is not None:   # then the next most probable experts the pools above it do not hold, as the agent
            above = gpus + (list(host_readers) if exclusive and system.cpu_demote_queued else [])   # does
            initialize_tier(host, [pools[n] for n in above], order)
    init_misses = sum(p.stats().misses for p in pools.values())

    def ssd_reads() -> int:
        return sum(getattr(src, "reads", 0) for src in built)

    init_reads = ssd_reads()
    if opts.cold:
        for e in model.experts:
            drop_from_page_cache(store.path(e))

    lock = threading.Condition()
    start: dict[str, float] = {}
    latencies: list[float] = []
    done = [0]
    batches = [0, 0]
    order: list[tuple] = []

    failed: list[str] = []        # why frames got no output: a benchmark figure is not reported off them
    ended: set[str] = set()       # frames counted once, whatever calls on_result again (the executor's fallback)

    def on_result(res: BatchResult) -> None:
        b = res.batch
        outs = res.outputs if res.error is None and isinstance(res.outputs, list) and len(res.outputs) == len(b) \
            else [StepError(res.error_kind or "expert_run", res.error or "no outputs")] * len(b)
        with lock:
            order.append((b.executor, b.expert_id, tuple(r.frame.frame_id for r in b.requests)))
            batches[0] += 1
            batches[1] += len(b)
        for r, out in zip(b.requests, outs):
            fid = r.frame.frame_id
            nxt = None
            if not isinstance(out, StepError):
                nxt = decide(model, b.expert_id, out).next_expert
            if nxt is not None:
                sched.submit(Request(r.frame, nxt, stage=r.stage + 1))
                continue
            with lock:
                if fid in ended:
                    continue
                ended.add(fid)
                if isinstance(out, StepError):
                    failed.append(f"{fid} ({b.expert_id}): {out.message}")
                else:
                    latencies.append(time.perf_counter() - start[fid])
                done[0] += 1
                lock.notify_all()

    ahead = None
    finished = False
    try:
        try:
            # an idle SSD reads queued groups' experts into the exclusive host tier (as the agent)
            if system.read_ahead and exclusive:
                usable = {n: usable_from_host(infos[n]) for n in pools}
                ahead = ReadAhead(lambda: [(n, sched.queued_groups(n)) for n in pools], lambda n, e: usable[n](e),
                                  lambda: list(pools.values()), host, disk,
                                  note=scheduler_note(sched, costs, list(pools))).start()
            execs.update((ex.name, Executor(ex.name, ex.device if ex.kind == "cuda" else "cpu", pools[ex.name], sched,
                                            model, on_result, prefetch=not opts.prequeue))
                         for ex in system.executors)
            if not opts.prequeue:
                for e in execs.values():
                    e.start()
            arrivals = workload.arrivals
            t0 = time.perf_counter()
            for i, a in enumerate(arrivals):
                wait = t0 + a.t - time.perf_counter()
                if wait > 0 and not opts.prequeue:
                    time.sleep(wait)
                pics = images[a.component] if images else [np.zeros((opts.image_size, opts.image_size, 3),
                                                                     np.uint8)]
                frame = Frame(a.frame_id, "bench", "bench", a.component, a.t, pics[i % len(pics)])
                start[a.frame_id] = time.perf_counter()
                sched.submit(Request(frame, model.components[a.component].classifier))
            if opts.prequeue:
                for e in execs.values():
                    e.start()
            with lock:
                finished = lock.wait_for(lambda: done[0] >= len(arrivals), opts.timeout)
            makespan = time.perf_counter() - t0
        finally:     # a submit that raised, or the wait's end: nothing keeps running behind the caller
            if ahead is not None:
                ahead.close()
            sched.close()
            for e in execs.values():
                e.join(10)     # one never started closes its prefetcher
        if not finished:
            raise TimeoutError(f"{system.name}: only {done[0]} of {len(arrivals)} frames finished in "
                               f"{opts.timeout} s")
        if failed:   # throughput and latency of frames that errored out would flatter the system
            raise RuntimeError(f"{system.name}: {len(failed)} of {len(arrivals)} frames failed, so no figure is "
                               f"reported; the first: {failed[0]}")
        if sched.estimate_faults:   # as in the simulation: a benchmark figure is not reported off a scheduler bug
            raise RuntimeError(f"{system.name}: the scheduler's queue estimate went negative "
                               f"{sched.estimate_faults} time(s) (see the log): a scheduler bug")
        lat = sorted(latencies)
        stats = [p.stats() for p in pools.values()]
        switches = sum(s.misses for s in stats) - init_misses
        # cold: every SSD read is counted; a switch that read none copied the host tier's copy
        ssd = ssd_reads() - init_reads if opts.cold else switches
        return SimReport(
            system=system.name, frames=len(arrivals), makespan=makespan, throughput=len(arrivals) / makespan,
            switches=switches, ssd_loads=ssd, host_loads=switches - ssd if opts.cold else 0,
            p50_ms=1000 * statistics.median(lat), p99_ms=1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            batches=batches[0], mean_batch=batches[1] / max(batches[0], 1), lower_bound=0.0, efficiency=0.0,
            decision_us=1e6 * sched.decision_seconds / max(sched.decisions, 1),
            busy_fraction=sum(s.load_seconds for s in stats) / (makespan * len(execs)),
            sched_share=sched.decision_seconds / (makespan * len(execs)),
            manage_share=sum(s.manage_seconds for s in stats) / (makespan * len(execs)), real_run=True, order=order,
            cpu_demotions=sum(r.demoted for r in host_readers.values()))
    finally:
        closing.append(True)   # the run is over: the pools let their experts go (GPU and pinned memory) undemoted
        for p in [*pools.values(), *([host] if host is not None else [])]:
            p.close()
