"""The line agent: wires ingest, routing, scheduling, executors and the result writer.

Threads: one ingest (owns the ROUTER socket and the journal connection), one per
executor, and one result writer (owns the PUB socket and its own connection).
Frames move between them as `Request`s; a frame is "in flight" from its
journal commit until its verdict commits, and `stop()` waits for that count to
reach zero before it closes anything, which is what "drain" means here.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from coe import CoEError, CoEModel, Frame, Request, StepError, decide, finite_problem, load_spec
from coe.probabilities import ranked
from executors.costs import ExecutorInfo, ProfileCosts, store_forms
from executors.executor import BatchResult, Executor, FailedExperts, result_problem
from executors.profile import Profile
from executors.readahead import ReadAhead, scheduler_note, usable_from_host
from executors.scheduler import Scheduler
from executors.systems import activation_reserve
from routing import RuleRouter
from storage.disk_activity import DiskActivity
from storage.expert_store import ExpertStore
from storage.policies import make_policy
from storage.pool import Pool, PoolEvent, fill_pools, initialize_tier, present_above
from storage.results import ResultStore
from storage.tiers import (HostReadSource, StoreSource, TierSource, current_in, demote, measured_nbytes,
                           source_dtype)

from . import protocol as P
from .bind_errors import why_bind_failed
from .config import ExecutorConfig, LineConfig, endpoint_parts
from .ingest import MAX_READ, Accepted, Ingest, check_frame, route_learned
from .instance_lock import InstanceLock
from .metrics import Metrics
from .status_model import DefectEntry, Health, StatusModel, StatusSources
from .writer import ResultWriter

if TYPE_CHECKING:
    from .llm_service import LLMService
    from .status_server import StatusServer

log = logging.getLogger(__name__)

# result writes failing this long make the agent not ready: a brief lock is retried quietly, an unwritable
# database (full disk, read-only mount, corrupt file) is named in the health an orchestrator or operator reads
WRITER_STALL_S = 10.0
# a promotion holds the line's new frames while it is carried to the nodes: a node whose sync takes longer leaves
# service and syncs when it rejoins, with the frames flowing
PROMOTE_SYNC_S = 60.0


def ingest_hard_cap(max_payload: int) -> int:
    """The largest message part ZeroMQ lets the ingest socket hold: 4x the payload limit plus 1 MiB for headers."""
    return 4 * max_payload + (1 << 20)


@dataclass
class _InFlight:
    frame: Frame
    chain: list[str] = field(default_factory=list)
    versions: dict[str, int | None] = field(default_factory=dict)   # expert -> store version that ran
    steps: list[dict] = field(default_factory=list)   # each step's expert, output and version (for the page)


@dataclass(frozen=True)
class _Slot:
    """One executor as planned at start: its config entry and its share of the entry's memory."""

    name: str
    ex: ExecutorConfig
    memory: int           # this executor's whole budget (experts + activations)
    expert_memory: int    # of which for experts


class _SchedulerCollector:
    """The scheduler's counters at scrape time (the hot path pays nothing)."""

    def __init__(self, line: str, scheduler: Scheduler, read_ahead=None) -> None:
        self.line, self.scheduler, self.read_ahead = line, scheduler, read_ahead

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily("coe_scheduler_aged", "Batches the age bound (scheduler.max_wait) served ahead "
                                                        "of the head group", labels=["line"])
        fam.add_metric([self.line], float(getattr(self.scheduler, "aged", 0)))
        yield fam
        fam = CounterMetricFamily("coe_scheduler_filled", "Batches served while the head group's expert was still "
                                                          "to load (a resident expert, or one copied from the host tier)", labels=["line"])
        fam.add_metric([self.line], float(getattr(self.scheduler, "filled", 0)))
        yield fam
        fam = CounterMetricFamily("coe_scheduler_held", "Head groups an executor waited on, free for fillers, "
                                                        "while their expert loaded", labels=["line"])
        fam.add_metric([self.line], float(getattr(self.scheduler, "held", 0)))
        yield fam
        if self.read_ahead is not None:
            fam = CounterMetricFamily("coe_read_ahead_reads", "Experts an idle SSD read into the host tier ahead "
                                                              "of their queued batch", labels=["line"])
            fam.add_metric([self.line], float(self.read_ahead.stats.read))
            yield fam


def _check_cuda(device: str, key: str) -> None:
    """A CUDA device this box has, or a ValueError naming the config key (not a driver's traceback later)."""
    import torch

    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        raise ValueError(f"{key}: {device}: this machine has {count} CUDA device(s)"
                         + ("" if count else " (no NVIDIA driver or no GPU: use device: cpu)"))


def _line_args(cfg: LineConfig) -> str:
    """The options that name this line's config in a command a message suggests (its --config when it was
    given one: without it the command would read another store)."""
    source = getattr(cfg, "source", "") or ""
    default = Path("configs") / f"line-{cfg.line}.yaml"
    if not source or not Path(source).is_file() or Path(source).resolve() == default.resolve():
        return f"--line {cfg.line}"        # a config built in code, or the line's own file
    return f"--config {source}"


class Agent:
    """One line's service.  `start()` binds and returns; `stop()` drains and closes."""

    def __init__(self, cfg: LineConfig, model: CoEModel | None = None, *, backend_for=None) -> None:
        try:
            self._init(cfg, model, backend_for)
        except BaseException:
            self._undo_init()
            raise

    def _undo_init(self) -> None:
        """What a constructor that failed (a config error found while building, an expert no pool can hold) had
        opened: its executors' prefetch threads, its pools (pinned memory), the store's reader lock (which keeps a
        promotion's retired files) and the zmq context.  Nothing else is open before `start`; an agent built and
        never started is closed the same way by `stop`."""
        for ex in getattr(self, "executors", []):
            try:
                ex.join(0)      # never started: closes its prefetcher's thread
            except Exception:  # noqa: BLE001 - as below
                log.debug("closing an executor of a failed start failed", exc_info=True)
        pools = list(getattr(self, "pools", {}).values())
        if getattr(self, "host_tier", None) is not None:
            pools.append(self.host_tier)
        for pool in pools:
            try:
                pool.close()
            except Exception:  # noqa: BLE001 - the constructor's own error is the one to report
                log.debug("closing a pool of a failed start failed", exc_info=True)
        store = getattr(self, "_line_store", None)
        if store is not None:
            store.close_reader()
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.destroy(linger=0)

    def _init(self, cfg: LineConfig, model: CoEModel | None, backend_for) -> None:
        self.cfg = cfg
        self.model = model or load_spec(cfg.spec_path)
        # a reader from its first manifest read on: a promotion keeps the files of the versions this agent
        # serves (pools filled at start, journaled frames re-run) until it has switched past them
        self.store = ExpertStore(cfg.store_path, verify=cfg.expert_verify, reader=True)
        self._line_store = self.store
        missing = [e for e in self.model.experts if not self.store.has(e)]  # the router is not a spec expert
        if missing:
            self._line_store.close_reader()
            raise FileNotFoundError(
                f"expert store {cfg.store_path} lacks {len(missing)} expert(s) of the spec, e.g. "
                f"{', '.join(missing[:3])}; run `coe-agent demo {_line_args(cfg)}` (trained experts) or "
                f"`coe-agent zoo build {_line_args(cfg)}` (generated weights)")
        self.model = self.model.with_sizes({e.id: e.nbytes for e in self.store.entries()})
        self.llm_layout = self._llm_store() if cfg.llm is not None else None
        self.llm: "LLMService | None" = None
        self.metrics = Metrics(cfg.line)
        self.router = RuleRouter(self.model)
        if cfg.routing.mode == "learned":
            from routing import LearnedRouter

            self.router = LearnedRouter.load(self.model, self.store, threshold=cfg.routing.threshold)
        self.ctx = zmq.Context()
        self._lock = threading.Condition()
        self._inflight: dict[str, _InFlight] = {}
        from .frame_gate import FrameGate

        # closed by the store watcher while a promotion's frames in flight finish on their versions
        self.gate: FrameGate[Accepted] = FrameGate(self._lock, self._inflight, self._schedule_accepted,
                                                  lambda a: a.frame.frame_id)
        self.accepted_total = 0
        self.verdicts_total = 0
        self.endpoints: dict[str, str] = {}
        self.metrics_port: int | None = None
        self._started = False
        self._closing = False
        self._synced: dict[str, str | None] = {}   # node -> the store manifest digest last synced there
        self.phase = "created"       # created -> starting -> serving -> stopping -> stopped (for /api/health)

        self.profile = Profile.load(cfg.scheduler.profile) if Path(cfg.scheduler.profile).is_file() else None
        if self.profile is not None:
            self._check_profile(self.profile)
        self.slots = self._plan_executors()
        n = len(self.slots)
        self.threads = min((s.ex.threads or max(1, (os.cpu_count() or 1) // n)) for s in self.slots)
        from .runtime_select import apply_runtime

        # before any pool reads the store: ONNX twins, measured (auto) at the threads executors will run with
        self.model, self.store, self.runtime = apply_runtime(
            cfg.runtime, self.model, self.store, cfg.data_dir, threads=self.threads,
            gpu=any(ex.device.startswith("cuda") for ex in cfg.executors), max_batch=cfg.scheduler.max_batch)
        if cfg.runtime != "torch":
            log.info("%s", self.runtime.describe())
            self.model = self.model.with_sizes({e.id: e.nbytes for e in self.store.entries()})
        self.llm_slot = self._llm_slot() if cfg.llm is not None else None
        self.probabilities = self._usage_probabilities()
        if self.llm_layout is not None:
            self.probabilities.update(self._llm_probabilities())
        self.preliminaries = {e: tuple(self.model.preliminaries(e)) for e in self.model.experts}  # once, not per pool
        self.failed = FailedExperts()
        self.pools: dict[str, Pool] = {}
        self.executors: list[Executor] = []
        self.host_tier: Pool | None = None
        self.gpu_pools = [s.name for s in self.slots if s.ex.device.startswith("cuda") and s.ex.node is None]
        self._current = current_in(self.store)   # a demoted GPU victim must be of the version the store serves
        self.disk = DiskActivity()     # the box's SSD: demand reads in flight, which a read-ahead gives way to
        if self.gpu_pools and not cfg.unified_memory:
            self.host_tier = self._pool("host", "host", cfg.cpu_tier,
                                        StoreSource(self.store, pin=True, method=cfg.expert_read,
                                                    dtype=source_dtype(cfg.gpu_compute_dtype), activity=self.disk),
                                        None)
        # exclusive: the host tier is a victim cache (GPU victims move down, promotions leave it)
        self.exclusive = self.host_tier is not None and cfg.cpu_tier_mode == "exclusive"
        infos = {}
        self.links = None
        # CPU pools whose victims move down into an exclusive host tier (cpu_victims_to_host_tier): pool name ->
        # its HostReadSource, which checks the victim's dtype and version (only the front box's CPU pools);
        # with 'queued', only a victim that a request queued on one of this box's executors still needs
        self.cpu_demoters: dict[str, HostReadSource] = {}
        self.cpu_demote_queued_only = cfg.cpu_victims_to_host_tier == "queued"
        # a victim enters a full host tier only if it outranks what it would push out (host_tier_admission;
        # the pool skips the test under a recency-only eviction, where a full tier would freeze)
        self.ranked_admission = cfg.host_tier_admission == "ranked"
        self._local_names = [s.name for s in self.slots if s.ex.node is None]   # executors on this box
        for slot in self.slots:
            ex = slot.ex
            if ex.node is not None:   # on another box: a Ray actor there holds the pool (edge_agent/cluster.py)
                infos[slot.name] = self._remote_pool(slot)
                continue
            reads = False
            if ex.device == "cpu":
                source = StoreSource(self.store, method=cfg.expert_read, dtype=source_dtype(cfg.cpu_compute_dtype),
                                     activity=self.disk)
                if self.host_tier is not None and cfg.cpu_reads_host_tier:   # RAM copies instead of SSD reads
                    source = HostReadSource(self.host_tier, source)
                    reads = source.compatible
                    if self.exclusive and cfg.cpu_victims_to_host_tier != "never":
                        self.cpu_demoters[slot.name] = source
            else:  # a GPU pool loads through the shared host tier, or straight from SSD on unified memory
                source = TierSource(self.host_tier or StoreSource(self.store, pin=True, method=cfg.expert_read,
                                                                  dtype=source_dtype(cfg.gpu_compute_dtype),
                                                                  activity=self.disk),
                                    ex.device, exclusive=self.exclusive)
            pool = self._pool(slot.name, ex.device, slot.expert_memory, source, slot.name)
            self.pools[slot.name] = pool
            infos[slot.name] = ExecutorInfo("cpu" if ex.device == "cpu" else "cuda", slot.memory, pool,
                                            device=ex.device, host_reads=reads,
                                            thread_share=max(1, (os.cpu_count() or 1) // self.threads))
        # remote executors are priced at the frame size their links were measured with ({data_dir}/links.json)
        link_frames = {"frame_bytes": self.links.frame_bytes} if self.links is not None else {}
        # a head whose expert the executor's prefetcher is still loading is a wait the scheduler may fill
        self.costs = ProfileCosts(self.model, infos, self.profile, host=self.host_tier,
                                  default_max_batch=cfg.scheduler.max_batch, stored=store_forms(self.store),
                                  arriving=self._prefetch_remaining, **link_frames)
        self._check_every_expert_fits()
        tie = cfg.scheduler.tie_seconds
        self.scheduler = Scheduler([s.name for s in self.slots], cfg.scheduler.policy, costs=self.costs,
                                   tie_seconds=tie, max_wait=cfg.scheduler.max_wait)
        for slot in self.slots:
            if slot.ex.node is not None:
                self.executors.append(self._remote_executor(slot))
                continue
            self.executors.append(Executor(slot.name, slot.ex.device, self.pools[slot.name], self.scheduler,
                                           self.model, self._on_batch, failed=self.failed, prefetch=slot.ex.prefetch,
                                           **({"backend_for": backend_for} if backend_for else {})))
        self._by_name = {e.name: e for e in self.executors}
        # an exclusive host tier: an idle SSD reads queued groups' experts into it (executors/readahead.py)
        self.read_ahead: ReadAhead | None = None
        if self.exclusive and cfg.ssd_read_ahead:
            local = self._local_names
            usable = {n: usable_from_host(infos[n]) for n in local}
            self.read_ahead = ReadAhead(lambda: [(n, self.scheduler.queued_groups(n)) for n in local],
                                        lambda n, e: usable[n](e), lambda: [self.pools[n] for n in local],
                                        self.host_tier, self.disk,
                                        note=scheduler_note(self.scheduler, self.costs, local))
        self.metrics.registry.register(_SchedulerCollector(cfg.line, self.scheduler, self.read_ahead))
        self.metrics.watch_pools(self._all_pools)
        self.metrics.watch_flow(inflight=self._inflight_count, queue_depth=self.scheduler.depth)   # read at scrape
        self.status = StatusModel(StatusSources(
            line=cfg.line, registry=self.metrics.registry, pools=self._all_pools, queue_depths=self._queue_depths,
            executors={s.name: s.ex.device for s in self.slots}, health=self.health,
            llm_experts=frozenset(self.llm_layout.ids()) if self.llm_layout is not None else None,
            llm_model=self.llm_layout.model if self.llm_layout is not None else None,
            cluster=self._cluster_view if cfg.cluster is not None else None))
        self.status_server: "StatusServer | None" = None
        # thumbnails exist for the status page and /api/frames; none are kept without it
        self.thumbnails = cfg.metrics.thumbnails if cfg.metrics.enabled else 0

    def _still_queued(self, expert_id: str) -> bool:
        """Whether a CPU victim moves down: always with cpu_victims_to_host_tier 'always' (or true); with
        'queued', only if a request queued on this box still needs it (its next use is certain, not a guess
        that thrashes)."""
        if not self.cpu_demote_queued_only:
            return True
        scheduler = getattr(self, "scheduler", None)
        return scheduler is not None and scheduler.has_queued(expert_id, self._local_names)

    def _prefetch_remaining(self, executor: str, expert_id: str) -> float:
        ex = getattr(self, "_by_name", {}).get(executor)
        return ex.prefetch_remaining(expert_id) if hasattr(ex, "prefetch_remaining") else 0.0

    def _cluster_view(self) -> dict:
        """The status page's cluster view: what the cluster status file last wrote, else asked now."""
        from .cluster import status

        written = getattr(getattr(self, "cluster_status", None), "last", None)
        return written if written is not None else status(self)

    def _remote_pool(self, slot: _Slot) -> ExecutorInfo:
        """The front's view of a remote executor's pool, priced with the link to its node."""
        from executors.remote import RemotePool

        from .cluster import default_link, load_links

        if self.links is None:
            self.links = load_links(self.cfg)
        node = slot.ex.node
        self.pools[slot.name] = RemotePool(slot.name, "cpu" if slot.ex.device == "cpu" else "cuda",
                                           slot.expert_memory, self.model, node)
        return ExecutorInfo("cpu" if slot.ex.device == "cpu" else "cuda", slot.memory, self.pools[slot.name],
                            device=slot.ex.device, node=node, link=self.links.get(node) or default_link(node),
                            ssd_channel=node)

    def _remote_executor(self, slot: _Slot):
        from executors.remote import RemoteExecutor

        from .cluster import remote_spec

        c = self.cfg.cluster
        spec = remote_spec(self.cfg, slot.name, slot.ex.node, slot.ex.device, slot.memory, slot.expert_memory,
                           prefetch=slot.ex.prefetch, threads=slot.ex.threads, probabilities=self.probabilities,
                           preliminaries=self.preliminaries)
        return RemoteExecutor(spec, self.model, self.pools[slot.name], self.scheduler, self._on_batch,
                              on_event=lambda e, n=slot.name: self._on_pool_event(e, n),
                              call_timeout=c.call_timeout_s, rejoin_s=c.rejoin_s, connect_timeout=c.connect_timeout_s,
                              channel=c.channel,
                              sync=lambda force=False, node=slot.ex.node: self._sync_node(node, force=force),
                              versions=self._store_versions, size_of=self._line_store_base().nbytes)

    def _store_versions(self) -> dict[str, int]:
        """The version of each expert in the line's store on disk now: what `experts sync` copies to a node, so
        what a node's actor must read (`RemoteExecutor._version_skew`)."""
        return {k: e.version for k, e in self._line_store_base().read_manifest().items()}

    def _line_store_base(self):
        """The line's own expert store, under an LLM store union or ONNX twins."""
        base = self.store
        while hasattr(base, "primary"):
            base = base.primary
        return base

    def _sync_node(self, node: str, force: bool = False) -> None:
        """Before a lost executor's node rejoins: copy the line's store there, unless this agent already synced
        that node with the manifest the store has now and not `force` (a rejoin that keeps failing would
        otherwise hash every expert file on both boxes each time; the version check after the actor starts
        forces one when the node's store is not what was synced)."""
        from .cluster import sync_store

        digest = self._manifest_digest()
        if not force and digest is not None and self._synced.get(node) == digest:
            return
        sync_store(self.cfg, [node])
        self._synced[node] = digest

    def _manifest_digest(self) -> str | None:
        import hashlib

        try:
            return hashlib.sha256(self._line_store_base().manifest_path.read_bytes()).hexdigest()
        except OSError:
            return None

    def _usage_probabilities(self) -> dict[str, float]:
        """From `coe-agent probabilities` ({data_dir}/probabilities.json) when present, else from the spec."""
        from coe import probabilities as probs

        path = Path(self.cfg.data_dir) / "probabilities.json"
        spec = self.model.usage_probabilities()
        if not path.is_file():
            return spec
        source, measured = probs.load_document(path)
        unknown = set(measured) - set(spec)
        if unknown or not measured:
            log.warning("ignoring %s (%s): it names experts the spec does not (%s)", path, source,
                        ", ".join(sorted(unknown)[:3]))
            return spec
        log.info("usage probabilities from %s (%s)", path, source)
        return {e: measured.get(e, 0.0) for e in spec}

    def _llm_store(self):
        """The LLM's imported store, read through the same sources as the line's (a `StoreUnion`)."""
        from coe.moe import MoELayout
        from storage.store_union import StoreUnion

        llm = self.cfg.llm
        layout = MoELayout.load(llm.store)
        self.store = StoreUnion(self.store, ExpertStore(llm.store, verify=self.cfg.expert_verify))
        return layout

    def _llm_slot(self) -> _Slot:
        """The executor whose pool and device the LLM shares: `llm.executor` (a name or an entry), else the first."""
        want = self.cfg.llm.executor
        for slot in self.slots:
            if want is None and slot.ex.node is not None:
                continue                     # the LLM computes here, on a pool of this box
            if want is None or slot.name == want or slot.name.startswith(want + "."):
                if slot.ex.node is not None:
                    raise ValueError(f"llm.executor: '{slot.name}' runs on node '{slot.ex.node}'; the LLM shares the "
                                     "pool of an executor on this box (name one without 'node:')")
                return slot
        if want is None:
            raise ValueError("llm: every executor runs on another node; the LLM needs one on this box "
                             "(set llm.executor to an executor without 'node:')")
        raise ValueError(f"llm.executor: '{want}' names no executor (they are "
                         f"{', '.join(s.name for s in self.slots)})")

    def _llm_probabilities(self) -> dict[str, float]:
        """Usage probability of each LLM expert: its per-layer popularity (from `llm.trace`), else k/E.

        Both kinds are 'the chance that the next unit of work (a frame, a token)
        uses this expert', which is what ranks them together in a shared pool.
        """
        layout = self.llm_layout
        if self.cfg.llm.trace:
            from routing.moe_trace import Trace

            trace = Trace.load(self.cfg.llm.trace)
            popularity = trace.popularity_for(layout.model, f"llm.trace {self.cfg.llm.trace}", layout)
            return {eid: popularity.get(eid, 0.0) for eid in layout.ids()}
        return {eid: layout.top_k / l.num_experts for l in layout.layers for eid in layout.ids(l.layer)}

    def _plan_executors(self) -> list[_Slot]:
        """Every executor with its budget: the count from the config, else the profile's search, else 1.

        With the count from the profile, the entry's `memory` (and `expert_memory`)
        is shared equally, as the executor-count search simulated it.  One INFO
        line per entry says what was used and where it came from.
        """
        slots = []
        for i, ex in enumerate(self.cfg.executors):
            if ex.device.startswith("cuda") and not ex.node:
                _check_cuda(ex.device, f"executors.{i}.device")
            n, why = self._executor_count(ex)
            share = 1 if ex.count_is_set else n
            memory = ex.memory // share
            expert, expert_why = self._expert_memory(ex, memory, share)
            self._check_split(i, ex, memory, expert, expert_why)
            log.info("%s: %d executor%s, %.0f MB experts each (of %.0f MB), %s; expert memory %s", ex.device, n,
                     "" if n == 1 else "s", expert / 1e6, memory / 1e6, why, expert_why)
            where = f"{ex.node}/" if ex.node else ""
            slots += [_Slot(f"{where}{ex.device}-{i}.{j}", ex, memory, expert) for j in range(n)]
        return slots

    def _check_every_expert_fits(self) -> None:
        """Refuse a line with an expert no executor's pool can hold (at the size its pool loads it at): every
        frame routed to it would fail, at serving time, one by one.  Name, in a warning, the executors that
        cannot hold some (the scheduler never hands them those: `Scheduler.able`).  Reads every expert's
        loaded size once, so no first submit reads a file header under the scheduler's lock."""
        names = [s.name for s in self.slots]
        unable = {n: [e for e in self.model.experts if not self.costs.fits(n, e)] for n in names}
        homeless = sorted(set.intersection(*(set(ids) for ids in unable.values()))) if names else []
        if names and homeless:
            raise CoEError(f"executors: no executor's pool can hold expert {homeless[0]}"
                           f"{f' nor {len(homeless) - 1} more' if len(homeless) > 1 else ''} (the largest pool "
                           f"holds {max(self.pools[n].capacity for n in names) / 1e6:.0f} MB of experts); give "
                           "one more memory")
        for n, ids in unable.items():
            if ids:
                log.warning("%s: its pool (%.0f MB) cannot hold %d expert(s), e.g. %s: the others run them", n,
                            self.pools[n].capacity / 1e6, len(ids), ids[0])

    def _check_profile(self, profile: Profile) -> None:
        """A profile measured for another line is refused; one for another spec or other hardware is used with a
        warning (its costs per architecture may still hold; its searched split and counts were for the other)."""
        from executors.profile import box_identity, spec_digest

        where = self.cfg.scheduler.profile
        made = profile.made_for
        log.info("profile %s: %s", where, profile.source)
        if made.get("line") and made["line"] != self.cfg.line:
            raise CoEError(f"scheduler.profile: {where} was measured for line {made['line']}, this is line "
                           f"{self.cfg.line}; run `coe-agent profile --line {self.cfg.line}` (or point "
                           "scheduler.profile at this line's)")
        if made.get("spec") and Path(self.cfg.spec_path).is_file() and made["spec"] != spec_digest(self.cfg.spec_path):
            log.warning("profile %s was measured for another version of the spec %s: its executor counts and "
                        "memory split were searched for those experts (run `coe-agent profile` again)", where,
                        self.cfg.spec_path)
        box = made.get("box") or {}
        here = box_identity(list(box))          # a device this box lacks (no CUDA here) is left out of it
        other = {d: (box[d], here[d]) for d in box if d in here and here[d] != box[d]}
        for d, (then, now) in other.items():
            log.warning("profile %s was measured on %s (%s); this box's %s is %s: its costs may not hold here "
                        "(run `coe-agent profile` on this box)", where, d, then, d, now)

    def _check_split(self, i: int, ex: ExecutorConfig, memory: int, expert: int, why: str) -> None:
        """Warn when activations get less than the profiled max batch needs (batches are then split down to
        fit, or run out of memory).  Which experts a pool cannot hold is checked once the pools exist
        (`_check_every_expert_fits`)."""
        reserve = activation_reserve(self.profile, "cuda" if ex.device.startswith("cuda") else "cpu") \
            if self.profile is not None else 0
        if memory - expert < reserve:
            log.warning("%s (executors.%d): %.0f MB left for activations, below the %.0f MB the profiled max batch "
                        "needs; batches will be split to fit (or run out of memory)", ex.device, i,
                        (memory - expert) / 1e6, reserve / 1e6)

    def _device_profile(self, ex: ExecutorConfig):
        return self.profile.devices.get(ex.device) if self.profile is not None else None

    def _executor_count(self, ex: ExecutorConfig) -> tuple[int, str]:
        """How many executors this entry runs, and why."""
        if ex.count_is_set:
            return ex.count, "from config"
        dev = self._device_profile(ex)
        if dev is not None and dev.executors >= 1:
            return dev.executors, f"from profile {self.cfg.scheduler.profile} (executor-count search)"
        where = "no profile" if self.profile is None else f"no entry for {ex.device} in the profile"
        return 1, f"default (count unset, {where})"

    def _expert_memory(self, ex: ExecutorConfig, memory: int, share: int = 1) -> tuple[int, str]:
        """An executor's bytes for experts, and why: configured, else the profiled split, else 75% (CoServe §4.4).

        The profiled split is proportional: the executor gets the device's
        searched expert bytes times its share of the device's memory, which is
        the search's own figure divided by the count when the count came from it.
        """
        if ex.expert_memory is not None:
            return min(ex.expert_memory // share, memory), "from config"
        dev = self._device_profile(ex)
        if dev is not None and dev.expert_memory:
            scaled = min(memory, int(dev.expert_memory * memory / max(dev.memory, 1)))
            # an executor this config sizes differently from the search still keeps its max-batch reserve
            reserve = activation_reserve(self.profile, dev.kind)
            if memory - scaled < reserve:
                biggest = max((e.nbytes for e in self.model.experts.values()), default=0)
                if memory - reserve >= biggest:
                    return (memory - reserve,
                            "from profile (memory-split search), cut to keep the max-batch activation reserve")
                return (min(biggest, memory), f"from profile (memory-split search), cut to the largest expert: "
                                              f"{(memory - min(biggest, memory)) / 1e6:.0f} MB left for "
                                              f"activations, below the max batch's {reserve / 1e6:.0f} MB")
            return scaled, "from profile (memory-split search)"
        return int(memory * 0.75), "default (75%)"

    def _pool(self, name: str, tier: str, capacity: int, source, executor: str | None) -> Pool:
        """A tier pool with the line's eviction policy and the scheduler's live knowledge."""
        def context() -> dict:
            if executor:
                return {"queued": self.scheduler.queued_set(executor)}
            return {"queued": self._above_host()}

        return Pool(tier, capacity, make_policy(self.cfg.eviction), source, name=name,
                    on_event=lambda e: self._on_pool_event(e, executor),
                    probabilities=self.probabilities,
                    preliminaries=self.preliminaries,
                    context=context, measure=measured_nbytes)

    def _above_host(self) -> set[str]:
        """What the host tier's policy must count as present (`present_above`)."""
        return present_above((self.scheduler.queued_set(n) for n in self.pools),
                             (self.pools[n] for n in self.gpu_pools))

    def _all_pools(self) -> dict[str, Pool]:
        pools = dict(self.pools)
        if self.host_tier is not None:
            pools["host"] = self.host_tier
        return pools

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> "Agent":
        import cv2
        import torch

        torch.set_num_threads(self.threads)
        cv2.setNumThreads(1)
        cfg = self.cfg
        self.phase = "starting"
        try:
            if cfg.cluster is not None:   # before anything binds: a missing node or address fails the start cleanly
                from .cluster import connect

                connect(cfg.cluster, sorted({s.ex.node for s in self.slots if s.ex.node}))
            self._instance = InstanceLock(cfg.db_path).acquire()    # before anything binds or reads the journal
        except BaseException:
            self.phase = "created"      # nothing started: still an agent built and not started (`stop` closes it)
            raise
        try:
            self._start_parts(cfg)
        except BaseException:
            self._abort_start()
            raise
        self._started = True
        self.phase = "serving"
        log.info("line %s agent up: ingest %s, publish %s, %d executor(s), metrics %s", cfg.line,
                 self.endpoints["ingest"], self.endpoints["publish"], len(self.executors),
                 self.metrics_port or "off")
        return self

    def _abort_start(self) -> None:
        """A start that failed part-way (a port taken, an LLM that does not fit): undo what it started, so no
        thread keeps running and no port stays bound, and the error reaches the caller as it was."""
        for what, step in (("llm", lambda: self.llm.stop(timeout=5) if getattr(self, "llm", None) else None),
                           ("store watch", lambda: self.store_watch.stop() if getattr(self, "store_watch", None)
                            else None)):
            try:
                step()
            except Exception:  # noqa: BLE001 - the start's own error is the one to report
                log.warning("undoing a failed start: closing the %s failed", what, exc_info=True)
        stuck, _ = self._close_parts(join_s=lambda ex: 10.0, graceful=False)
        self._release_when_idle(stuck)

    def _close_parts(self, *, join_s: Callable[[Any], float], graceful: bool
                     ) -> tuple[list, BaseException | None]:
        """Close what a start opened, each after what uses it, every step tried whatever the one before raised
        (a writer that fails to stop must not leave the ports bound and the pools open).  Shared by `stop`
        (`graceful`: sockets closed with linger unless a thread is stuck; a failure logged as an error) and
        `_abort_start` (what a failed start has opened; sockets dropped).  Returns the threads still running
        and the first error."""
        first: list[BaseException] = []

        def step(what: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the other parts still close; the first error is returned
                if graceful:
                    log.exception("stopping: closing the %s failed", what)
                else:
                    log.warning("undoing a failed start: closing the %s failed", what, exc_info=True)
                first.append(exc)

        step("read-ahead", lambda: self.read_ahead.close() if self.read_ahead is not None else None)
        step("scheduler", self.scheduler.close)
        # a remote executor may be waiting on its node for up to call_timeout_s: its answer (or its hand-back)
        # must reach the writer before the writer stops
        # each on its own: one that fails to close leaves the others to be closed (started or not).  The lost
        # (retired) remote executors first: closed, they do not come back, and once their threads have ended the
        # requests that waited for one have no executor left; given up, the others drain instead of idling on
        # them for good.  Checked again before each join: an executor lost while the others close is one more
        active = self.scheduler.active()
        lost = [ex for ex in self.executors if getattr(ex, "can_restore", False) and ex.name not in active]
        for ex in lost + [ex for ex in self.executors if ex not in lost]:
            self._give_up_waiting_if_none_returns()
            step(f"executor {ex.name}", lambda ex=ex: ex.join(timeout=join_s(ex)))
        step("cluster status", lambda: self.cluster_status.stop() if getattr(self, "cluster_status", None)
             else None)
        self._closing = True                  # closing GPU pools does not demote into the host tier
        for name, pool in self._all_pools().items():                                    # their evictions are recorded
            step(f"pool {name}", pool.close)
        step("writer", lambda: self.writer.stop() if getattr(self, "writer", None) and self.writer.alive() else None)
        step("journal", lambda: self.journal.close() if getattr(self, "journal", None) else None)
        step("store", lambda: self._line_store.close_reader() if getattr(self, "_line_store", None) else None)
        step("status page", lambda: self.status_server.close() if self.status_server is not None else None)
        step("status", self.status.stop)
        self.phase = "stopped"
        step("authenticator", lambda: self._auth.stop() if getattr(self, "_auth", None) is not None else None)
        stuck = [t for t in self._threads_started() if t.alive()]
        if stuck and graceful:
            log.error("%d thread(s) did not stop; closing sockets without waiting", len(stuck))
        step("sockets", lambda: self.ctx.term() if graceful and not stuck else self.ctx.destroy(linger=0))
        return stuck, (first[0] if first else None)

    def _give_up_waiting_if_none_returns(self) -> None:
        """Once closed, requests waiting for a lost remote executor whose thread has ended have no future: give
        them up (their frames stay journaled) so the other executors can drain."""
        back = [ex for ex in self.executors
                if getattr(ex, "can_restore", False) and ex.name not in self.scheduler.active()]
        if self.scheduler.waiting() and not any(ex.alive() for ex in back):
            gone = self.scheduler.abandon_waiting()
            if gone:
                log.error("%d request(s) waited for an executor whose node is lost; their frames stay journaled "
                          "and run again at the next start", gone)

    def _threads_started(self) -> list:
        """The executors, the writer, ingest, the store watcher and the read-ahead, where started: a failed start may
        have left
        one running, and one still running keeps the instance lock and the sockets' graceful close from it."""
        extra = [getattr(self, name, None) for name in ("writer", "ingest", "store_watch", "read_ahead")]
        return [*self.executors, *(t for t in extra if t is not None)]

    def _start_parts(self, cfg: LineConfig) -> None:
        router_sock = self._socket(zmq.ROUTER, cfg.ingest, "ingest")
        pub_sock = self._socket(zmq.PUB, cfg.publish, "publish")
        self.journal = ResultStore(cfg.db_path, synchronous="FULL")
        self.writer = ResultWriter(str(cfg.db_path), pub_sock, cfg.line, batch_rows=cfg.writer.batch_rows,
                                   flush_ms=cfg.writer.flush_ms, on_committed=self._on_committed,
                                   retention_days=cfg.retention.days, keep_verdicts=cfg.retention.keep_verdicts,
                                   retention_interval=cfg.retention.interval_s, keep_thumbnails=self.thumbnails)
        self.ingest = Ingest(router_sock, self.journal, line=cfg.line, router=self.router,
                             max_payload=cfg.max_payload_bytes, metrics=self.metrics,
                             on_accepted=self._submit_accepted, free_slots=self._free_slots)
        if cfg.metrics.enabled:
            self.metrics_port = self._serve_status()
        self.writer.start()
        if cfg.scheduler.initialize:
            loaded = self._initialize()
            log.info("initialised pools by usage probability: %s",
                     ", ".join(f"{k} {len(v)}" for k, v in loaded.items()))
        for ex in self.executors:
            ex.start()
        if self.read_ahead is not None:
            self.read_ahead.start()
        self._recover()
        if cfg.llm is not None:
            self.llm = self._start_llm()
        from .store_watch import StoreWatcher

        # remote pools read their node's own store: a promotion reaches them by `experts sync` and a restart
        self.store_watch = StoreWatcher(self._line_store_base(),
                                        lambda: [p for p in self._all_pools().values() if not getattr(p, "remote", 0)],
                                        forget=self.failed.forget, prepare=self._prepare_version,
                                        interval=cfg.store_poll_s, gate=self.gate,
                                        on_switch=self._promote_remote if cfg.cluster is not None else None).start()
        self.cluster_status = None
        if cfg.cluster is not None:
            from .cluster import StatusFile

            self.cluster_status = StatusFile(self).start()
        self.ingest.start()

    def _promote_remote(self, changed: dict[str, int]) -> None:
        """A promotion switched the line's store (frames in flight drained): sync it to every node that runs an
        executor and have their actors follow, before the held frames run.  A node that is down gets the
        sync when its executor rejoins."""
        from .cluster import sync_store

        remote = [e for e in self.executors if hasattr(e, "reload_store")]
        nodes = sorted({e.node for e in remote if e.up})
        if not nodes:
            return
        t = time.monotonic()
        failed = []
        digest = self._manifest_digest()
        for node in nodes:        # each node on its own: one that fails must not keep the others on old weights
            here = [e for e in remote if e.node == node]
            try:
                sync_store(self.cfg, [node], within=PROMOTE_SYNC_S)
                self._synced[node] = digest
            except Exception as exc:  # noqa: BLE001 - its executors leave service until a rejoin syncs them
                why = f"the promotion's sync failed: {exc}"
                log.error("node %s: %s; its executors rejoin (and sync) before they serve again", node, exc)
                failed.append(node)
                for ex in here:
                    ex.mark_stale(why)
                continue
            for ex in here:
                try:
                    ex.reload_store(list(changed))
                except Exception as exc:  # noqa: BLE001 - this executor rejoins with a new actor on the new store
                    log.error("executor %s on node %s did not follow the promotion (%s); it rejoins before it "
                              "serves again", ex.name, node, exc)
                    failed.append(ex.name)
                    ex.mark_stale(f"did not follow the promotion: {exc}")
        log.info("promotion carried to node(s) %s in %.1f s%s", ", ".join(nodes), time.monotonic() - t,
                 f"; not to {', '.join(failed)} (they rejoin first)" if failed else "")

    def _serve_status(self) -> int:
        """/metrics, the status page and the read-only API on the metrics port; returns the bound port."""
        from .status_server import StatusServer

        m = self.cfg.metrics
        self.status.start()
        try:
            self.status_server = StatusServer(m.bind, m.port, registry=self.metrics.registry, model=self.status,
                                              db_path=self.cfg.db_path, token=m.token, health=self.health).start()
        except OSError as exc:
            self.status.stop()
            raise OSError(f"metrics port {m.bind}:{m.port}: {why_bind_failed(exc, f'{m.bind}:{m.port}')}") from None
        return self.status_server.port

    def health(self) -> Health:
        """Ready to take frames, or why not: starting or stopping, a dead thread, saturation.

        Experts that failed to load and retried result writes are warnings: the
        agent still serves, and the frames they touch get error verdicts.
        """
        reasons: list[str] = []
        if self.phase != "serving":
            reasons.append({"created": "not started", "starting": "starting: filling the pools",
                            "stopping": "stopping: draining in-flight frames"}.get(self.phase, self.phase))
        else:
            reasons += [f"{d} is not running" for d in self.dead_threads()]
        lost = [f"executor {e.name} on node {e.node} {e.state}" for e in self.executors
                if getattr(e, "node", None) and not e.up and e.state != "created"]
        if self.phase == "serving" and lost and not self.scheduler.active():
            reasons.append(f"no executor is serving: {self.scheduler.waiting()} request(s) wait for one to "
                           f"rejoin ({'; '.join(lost)})")
        with self._lock:
            inflight = len(self._inflight)
        if inflight >= self.cfg.max_inflight:
            reasons.append(f"saturated: {inflight} frames in flight (max_inflight {self.cfg.max_inflight}); "
                           "new frames are acked busy")
        warnings = [f"expert {e} failed: {why}" for e, why in sorted(self.failed.all().items())]
        warnings += [f"{w}; rejoining" for w in lost]
        writer = getattr(self, "writer", None)
        stalled = writer.stalled() if writer is not None and writer.failing_since is not None else None
        if stalled is not None and stalled >= WRITER_STALL_S:
            reasons.append(f"result database {self.cfg.db_path}: writes failing for {stalled:.0f} s "
                           f"({writer.last_failure}); verdicts wait and their frames stay journaled")
        ingest = getattr(self, "ingest", None)
        journal_stall = ingest.stalled() if ingest is not None else 0.0
        if journal_stall > 0 and journal_stall >= WRITER_STALL_S:
            reasons.append(f"results database {self.cfg.db_path}: journal writes failing for {journal_stall:.0f} s "
                           f"({ingest.stall_reason()}); no frame is accepted (clients are not acked and resend)")
        if writer is not None and writer.failures:
            warnings.append(f"result writes failed {writer.failures} time(s) and were retried")
        if writer is not None and writer.set_aside:
            warnings.append(f"{writer.set_aside} result row(s) no write could store were set aside (the log and the "
                            "errors table name them; a set-aside verdict became an error verdict saying why)")
        return Health(ready=not reasons, reasons=reasons, warnings=warnings, inflight=inflight,
                      max_inflight=self.cfg.max_inflight)

    def _queue_depths(self) -> dict[str, int]:
        return {name: len(self.scheduler.queued_experts(name)) for name in self._by_name}

    def _start_llm(self) -> "LLMService":
        """The LLM on the pool of `llm_slot`, serving /v1/completions."""
        from executors.moe_model import load_pooled

        from .llm_service import LLMService

        llm, slot = self.cfg.llm, self.llm_slot
        name = slot.name
        pool = self.pools[name]
        cap = int(pool.capacity * llm.max_share)
        layout = self.llm_layout
        need = layout.top_k * max(l.expert_nbytes for l in layout.layers)
        if cap < need:      # a layer pins one token's experts at once: less could never run
            raise ValueError(f"llm.max_share {llm.max_share} leaves the LLM {cap} bytes of pool {name}, which "
                             f"cannot hold one token's {layout.top_k} experts ({need} bytes)")
        pm = load_pooled(llm.store, memory=pool.capacity, device=slot.ex.device, shared_pool=pool,
                         verify=self.cfg.expert_verify)
        if cap < pool.capacity:
            pool.limit_share("llm.max_share", self.llm_layout.ids(), cap)
        first = self.llm_layout.layers[0].layer
        status = self.status

        def count_token(layer: int, probs, chosen) -> None:
            if layer == first:    # one forward pass per generated token, each calls the first router once
                status.token()
        pm.tap.listen(count_token)
        try:
            service = LLMService(pm, bind=llm.bind, port=llm.port, default_tokens=llm.max_tokens,
                                 limit=llm.max_tokens_limit, max_waiting=llm.max_waiting).start()
        except BaseException:
            pm.close()         # its router hooks and the pool's model references go with it
            raise
        self.endpoints["llm"] = f"http://{llm.bind}:{service.port}/v1/completions"
        log.info("LLM '%s' shares pool %s (%.0f MB, up to %.0f MB of it for its experts): %s",
                 self.llm_layout.model, name, pool.capacity / 1e6, cap / 1e6, self.endpoints["llm"])
        return service

    def _initialize(self) -> dict[str, list[str]]:
        """CoServe's initialisation: the executors' pools by usage probability (`pool_fill`: the GPU pools first,
        or the paper's round-robin across all), then the host tier.

        The host tier is filled last, with the most probable experts that no
        GPU pool holds: exclusive, so it starts as the next tier of the same
        ranking rather than a copy of the GPU pools (inclusive, it also keeps
        the copies the GPU loads left in it).  It is the victim cache of the
        CPU pools whose victims move down into it too (`cpu_demoters`), so
        it holds none of theirs either, as the simulator starts it.
        """
        failed = self.failed.all()
        order = [e for e in ranked(self.model.experts, self.probabilities) if e not in failed]
        gpus = {s.name for s in self.slots if s.ex.device.startswith("cuda")}
        loaded = fill_pools(list(self.pools.values()), order, self.cfg.start_fill, gpus)
        if self.host_tier is not None:
            above = [self.pools[n] for n in [*self.gpu_pools, *self.cpu_demoters]]
            loaded[self.host_tier.name] = initialize_tier(self.host_tier, above, order)
        return loaded

    def _socket(self, kind: int, endpoint: str, name: str) -> zmq.Socket:
        _, bind, addr = endpoint_parts(endpoint)
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 1000)
        if kind == zmq.ROUTER:
            # a frame up to a few times the payload limit is read and rejected as oversize, by name; one far past
            # it is refused by ZeroMQ before it is held in memory, and its sender disconnected (it gets no ack)
            sock.setsockopt(zmq.MAXMSGSIZE, ingest_hard_cap(self.cfg.max_payload_bytes))
        if self.cfg.curve is not None:
            self._curve_server(sock)
        try:
            if bind:
                sock.bind(addr)
            else:
                sock.connect(addr)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"{name} endpoint {endpoint}: {why_bind_failed(exc, endpoint)}") from None
        self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else addr
        return sock

    def _curve_server(self, sock: zmq.Socket) -> None:
        """CURVE on this socket; the first call starts the authenticator with the client allow-list."""
        from .security import start_authenticator

        if getattr(self, "_auth", None) is None:
            self._auth, self._server_keys = start_authenticator(self.ctx, self.cfg.curve)
        sock.curve_publickey, sock.curve_secretkey = self._server_keys
        sock.curve_server = True

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop taking frames, finish every accepted one, flush, close.  True if fully drained."""
        if not self._started:
            if self.phase == "created":         # built, never started (a start that failed closed everything)
                self._undo_init()
                self.phase = "stopped"
            return True
        self._started = False
        self.phase = "stopping"
        early: list[BaseException] = []     # a part that fails to stop here must not keep the rest open

        def first_steps() -> None:
            for what, fn in (("ingest", self.ingest.stop), ("store watcher", lambda: self._stop_watch(timeout)),
                             ("LLM server", self.llm.stop if self.llm is not None else lambda: None)):
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - the others still stop; the first error is raised last
                    log.exception("stopping: stopping the %s failed", what)
                    early.append(exc)
        first_steps()
        drained = self.wait_idle(timeout)
        stuck, error = self._close_parts(join_s=lambda ex: max(10.0, getattr(ex, "call_timeout", 0.0) + 5.0),
                                         graceful=True)
        # what counts is what is left once everything closed: executors run their queues out after a drain
        # that timed out, so frames may still have committed in between (a frame's later step that reaches an
        # executor whose thread has already ended stays in flight: journaled, re-run at the next start)
        with self._lock:
            left = len(self._inflight)
        if left:
            log.error("stopped with %d frame(s) still in flight; they are journaled and re-run at next start", left)
        elif not drained:
            log.info("the drain timed out after %.1f s, but every frame committed while the agent closed", timeout)
        if self.writer.set_aside:
            log.error("%d result row(s) were set aside as unstorable while serving (see the log above and the "
                      "errors table): a bug upstream to report", self.writer.set_aside)
        self._release_when_idle(stuck)
        error = early[0] if early else error
        if error is not None:
            raise error               # everything else is closed: the caller hears of the part that failed
        return not left

    def _prepare_version(self, expert_id: str) -> None:
        """On the store watcher's thread, for an expert with a new version, before held frames run on it: its
        ONNX twin (where the store makes them) and its loaded size per executor, which the scheduler reads under
        its lock (`ProfileCosts.fits`) and the store caches per version."""
        prepare = getattr(self.store, "prepare", None)
        try:
            if prepare is not None:
                prepare(expert_id)
        finally:
            for slot in self.slots:
                self.costs.fits(slot.name, expert_id)

    def _stop_watch(self, timeout: float) -> None:
        """Stop the store watcher; open the gate once it has ended.

        A switch under way runs to its end and opens the gate itself; one not
        begun is not made.  Only once the watcher has ended is the gate ours to
        open: earlier, held frames would run mid-switch (on versions, pools and
        nodes half switched).
        """
        if getattr(self, "store_watch", None) is None:
            return
        if self.store_watch.stop(timeout=timeout):
            self.gate.open()    # frames held for a switch run on the versions this agent serves now
        else:
            log.error("an expert switch is still under way after %.0f s; the frames it holds stay journaled "
                      "(re-run at next start) unless it ends first", timeout)

    def _release_when_idle(self, threads: list) -> None:
        """Drop the instance lock once `threads` have ended: a thread still writing keeps the data this agent's
        (another agent started meanwhile would re-run its frames); the process's exit drops it too."""
        if not threads:
            self._instance.release()
            return
        log.error("the results database stays locked by this process until its %d stuck thread(s) end",
                  len(threads))

        def wait_then_release() -> None:
            while any(t.alive() for t in threads):
                time.sleep(0.1)
            self._instance.release()
        threading.Thread(target=wait_then_release, name="instance-lock", daemon=True).start()

    def dead_threads(self) -> list[str]:
        """Threads that should be running and are not (the agent cannot serve without any of them)."""
        dead = [] if self.ingest.alive() else [f"ingest ({self.ingest.error})"]
        dead += [f"executor {e.name}" for e in self.executors if not e.alive()]
        if not self.writer.alive():
            dead.append(f"result writer ({self.writer.error})")
        return dead

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no accepted frame is waiting for its verdict."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._inflight, timeout)

    def wait_verdicts(self, n: int, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.verdicts_total >= n, timeout)

    def run_forever(self) -> int:
        """Serve until SIGINT/SIGTERM, then drain; the exit code for the CLI."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        while not stop.wait(0.5):
            dead = self.dead_threads()
            if dead:
                log.error("stopping: %s died (accepted frames stay journaled and are re-run at next start)",
                          ", ".join(dead))
                try:
                    self.stop(timeout=10)
                except Exception:  # noqa: BLE001 - already failing: say what did not close, exit 1 either way
                    log.exception("stopping after a dead thread: a part did not close")
                return 1
        log.info("signal received: draining %d in-flight frame(s)", len(self._inflight))
        return 0 if self.stop() else 1

    # -- flow ---------------------------------------------------------------------------
    def _inflight_count(self) -> int:
        with self._lock:
            return len(self._inflight)

    def _free_slots(self) -> int:
        with self._lock:
            n = len(self._inflight)
        return max(0, self.cfg.max_inflight - n)

    def _submit_accepted(self, accepted: list[Accepted]) -> None:
        with self._lock:
            for a in accepted:
                self._inflight[a.frame.frame_id] = _InFlight(a.frame)
            self.accepted_total += len(accepted)
            now = self.gate.admit(accepted)   # none while a promotion's frames in flight finish
        self._schedule_accepted(now)

    def _schedule_accepted(self, accepted) -> None:
        for a in accepted:      # each on its own: a frame the scheduler cannot take gets an error verdict, the
            try:                # rest are still scheduled (none left in flight with nothing to run it)
                self.scheduler.submit(Request(a.frame, a.expert_id))
            except Exception as exc:  # noqa: BLE001 - a scheduler fault must cost one frame, not the ones after it
                log.exception("scheduling frame %s failed", a.frame.frame_id)
                self._fail(a.frame, "schedule", f"scheduling failed: {type(exc).__name__}: {exc}")

    def _recover(self) -> None:
        """Re-run frames a previous run accepted but never gave a verdict."""
        pending = self.journal.pending()
        if not pending:
            return
        log.warning("recovering %d accepted frame(s) without a verdict from the journal", len(pending))
        checked: list = []
        for entry in pending:
            try:
                c = check_frame([entry.header.encode(), entry.payload], line=self.cfg.line, router=self.router,
                                max_payload=1 << 62)
            except P.Reject as rej:
                c = rej
            except Exception as exc:  # noqa: BLE001 - one unreadable entry costs its frame, not the start
                log.exception("journaled frame %s cannot be read back", entry.frame_id)
                c = P.Reject(P.BAD_FIELD, f"unreadable in the journal ({type(exc).__name__}: {exc})", entry.frame_id)
            # a learned route was decided when the frame was accepted: where the header named no component, the
            # journaled one is the router's choice, kept (a router changed since, or failing now, must not turn an
            # accepted frame into an error); a frame whose header named one is routed again
            comp = self.model.components.get(entry.component or "")
            if isinstance(c, Accepted) and c.expert_id is None and comp is not None and not c.frame.component:
                c.expert_id, c.frame.component = comp.classifier, comp.name
            if isinstance(c, Accepted):      # its latency counts from its first accept, the restart's wait included
                c.frame.received_at = entry.received_at
            checked.append((entry, c))
        if getattr(self.router, "needs_image", False):
            for i in range(0, len(checked), MAX_READ):     # as ingest routes: a read at a time, not the backlog
                part = checked[i:i + MAX_READ]
                route_learned(self.router, part)
                checked[i:i + MAX_READ] = part
        again = []
        for entry, c in checked:
            if isinstance(c, P.Reject):  # spec or router changed since: still exactly one verdict per frame
                self._finish(_InFlight(Frame(entry.frame_id, entry.line, entry.board_id, entry.component or "",
                                             entry.ts, None, entry.received_at)),
                             "error", f"recovery: {c.ack_detail}", register=True)
            else:
                again.append(c)
        self._submit_accepted(again)

    def _on_batch(self, result: BatchResult) -> None:
        """Each frame of a finished batch to its next expert or its verdict; nothing raises out of here once a
        frame has been handled (the executor's batch-wide fallback would give the frames before it a second
        verdict)."""
        b = result.batch
        problem = result_problem(result)
        if problem is not None:       # every frame of the batch gets an error verdict: none is left without one
            result = replace(result, outputs=None, error=problem, error_kind=result.error_kind or "expert_run")
        self.metrics.batch_size.observe(len(b))
        self.status.batch(result.executor, len(b))
        if result.error is not None:
            for req in b.requests:
                self._fail_safely(req.frame, result.error_kind, result.error, expert=b.expert_id)
            return
        latency_ms = result.seconds * 1000.0
        for req, out in zip(b.requests, result.outputs or []):
            if isinstance(out, StepError):   # this frame alone failed (the executor narrowed the batch's error)
                self._fail_safely(req.frame, out.kind, f"frame {req.frame.frame_id}: {out.message}",
                                  expert=b.expert_id)
                continue
            # each frame on its own: one whose output cannot be handled gets an error verdict, and the frames
            # before it (finished, or handed to their next expert) are not given a second one by the executor's
            # batch-wide fallback (`Executor._loop`)
            handed = [False]
            try:
                self._on_output(result, req, out, latency_ms, handed)
            except Exception as exc:  # noqa: BLE001 - a malformed output, a decision that fails: this frame only
                log.exception("handling %s's output for frame %s failed", b.expert_id, req.frame.frame_id)
                if not handed[0]:
                    self._fail_safely(req.frame, "output", f"handling {b.expert_id}'s output failed: "
                                                           f"{type(exc).__name__}: {exc}", expert=b.expert_id)

    def _fail_safely(self, frame: Frame, kind: str, message: str, *, expert: str | None = None) -> None:
        """`_fail`, logged instead of raised: one frame's failed error verdict leaves the next frames theirs."""
        try:
            self._fail(frame, kind, message, expert=expert)
        except Exception:  # noqa: BLE001 - the frame stays in the journal: a restart recovers it
            log.exception("could not record the error verdict of frame %s (%s)", frame.frame_id, message)

    def _fail(self, frame: Frame, kind: str, message: str, *, expert: str | None = None) -> None:
        """The frame's error verdict, an `errors` row saying why, and its count on the status page (every kind:
        a batch's failure, a frame's output that could not be decided, one the scheduler could not take)."""
        self.status.error(kind or "executor")
        self.writer.put_error({"frame_id": frame.frame_id, "kind": kind, "message": message, "at": time.time()})
        self._finish(self._flight(frame), "error", message, expert=expert)

    def _on_output(self, result: BatchResult, req: Request, out, latency_ms: float, handed: list) -> None:
        """One frame's step output: recorded, then the frame goes to its next expert or gets its verdict
        (`handed[0]` turns true once it has: a failure before that, the submit or the verdict's own included,
        leaves the frame to the caller's error verdict)."""
        b = result.batch
        bad = finite_problem(out)
        if bad is not None:      # a backend checks its raw output; this is the backstop for any other source
            raise ValueError(f"{b.expert_id} gave a non-finite {bad}")
        self.writer.put_inference({"frame_id": req.frame.frame_id, "stage": req.stage, "expert_id": b.expert_id,
                                   "device": result.device, "executor": result.executor, "batch_id": b.id,
                                   "output": json.dumps(out.to_json()), "latency_ms": latency_ms,
                                   "started_at": result.started_at, "expert_version": result.expert_version})
        flight = self._flight(req.frame)
        flight.versions[b.expert_id] = result.expert_version
        flight.steps.append({"expert_id": b.expert_id, "output": out.to_json(), "version": result.expert_version})
        decision = decide(self.model, b.expert_id, out)
        if decision.next_expert is not None:
            flight.chain.append(b.expert_id)
            self.scheduler.submit(Request(req.frame, decision.next_expert, stage=req.stage + 1))
        else:
            self._finish(flight, decision.verdict or "error", decision.reason, expert=b.expert_id)
        handed[0] = True
    def _flight(self, frame: Frame) -> _InFlight:
        with self._lock:
            return self._inflight.setdefault(frame.frame_id, _InFlight(frame))

    def _finish(self, flight: _InFlight, verdict: str, reason: str, *, expert: str | None = None,
                register: bool = False) -> None:
        if expert:
            flight.chain.append(expert)
        if register:
            with self._lock:
                self._inflight[flight.frame.frame_id] = flight
        now = time.time()
        frame = flight.frame
        try:
            thumb = self._defect(flight, reason, now) if verdict == "defect" and self.cfg.metrics.enabled else None
        except Exception:  # noqa: BLE001 - a thumbnail the page cannot have must not cost the frame its verdict
            log.exception("the status page's defect entry for frame %s failed", flight.frame.frame_id)
            thumb = None
        self.writer.put_verdict({"frame_id": frame.frame_id, "verdict": verdict, "reason": reason,
                                 "decided_at": now, "latency_ms": (now - frame.received_at) * 1000.0,
                                 "chain": json.dumps(flight.chain), "versions": json.dumps(flight.versions),
                                 "component": frame.component or None, "board_id": frame.board_id}, thumb)

    def _defect(self, flight: _InFlight, reason: str, now: float) -> dict | None:
        """A defect for the status page, and its thumbnail row for the writer (None when it has no image)."""
        from .thumbnails import MIME, make_thumbnail

        frame = flight.frame
        data = make_thumbnail(frame.image) if self.thumbnails else None
        self.status.defect(DefectEntry(frame.frame_id, frame.board_id, frame.component or "", reason, now,
                                       list(flight.steps), data is not None))
        return None if data is None else {"frame_id": frame.frame_id, "mime": MIME, "data": data, "at": now}

    def _on_committed(self, verdicts: list[dict], stored: set[str]) -> None:
        """Called by the writer after commit; a verdict not in `stored` already existed (idempotent)."""
        with self._lock:
            for v in verdicts:
                self._inflight.pop(v["frame_id"], None)
                if v["frame_id"] in stored:
                    self.metrics.verdict(v["verdict"])
                    self.metrics.frame_latency.observe(v["latency_ms"] / 1000.0)
            self.verdicts_total += len(stored)
            self._lock.notify_all()
        self.status.verdicts([v["latency_ms"] / 1000.0 for v in verdicts if v["frame_id"] in stored])
        self.status.committed([v["frame_id"] for v in verdicts if v["verdict"] == "defect"], stored)

    def _on_pool_event(self, e: PoolEvent, executor: str | None) -> None:
        """A pool loaded, evicted or admitted an expert: demote GPU and CPU victims, unbind, refresh costs, record.

        Runs before the evicting pool reuses the victim's buffer (see
        `Pool.acquire`), so the demotion copy reads the victim's own bytes.
        The host tier's admit (and its own evictions) come back here with no
        executor, so the scheduler's switch costs follow a demotion.
        """
        if e.event == "evict" and executor is not None:
            if self.exclusive and not self._closing and not e.stale:   # a promotion's stale copy is dropped
                if executor in self.gpu_pools:
                    # held by any GPU pool (this one read it back, or another holds it): the exclusive tier
                    # takes no second copy
                    demote(e, self.host_tier, ranked=self.ranked_admission,
                           held=lambda x: any(self.pools[n].present(x) for n in self.gpu_pools),
                           current=self._current)
                elif executor in self.cpu_demoters and self._still_queued(e.expert_id):
                    # same dtype and current version only (HostReadSource)
                    self.cpu_demoters[executor].demote(e, ranked=self.ranked_admission)
            self._by_name[executor].on_evicted(e.value)
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:   # where the expert lives changed: queued groups' switch costs follow
            scheduler.refresh(e.expert_id, executor)
        self.metrics.expert_event(e.tier, e.event, e.seconds)
        status = getattr(self, "status", None)
        if status is not None:
            status.pool_event(executor or "host", e)
        self.writer.put_event({"expert_id": e.expert_id, "tier": e.tier, "event": e.event, "nbytes": e.nbytes,
                               "seconds": e.seconds, "at": e.at})
