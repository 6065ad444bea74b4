"""An executor on another box: a Ray actor there, driven by the front box's scheduler (issue 15, DESIGN.md §11).

Two halves, one per side of the link:

- `ExecutorHost` runs inside a Ray actor on the executor's node.  It builds
  what a local executor has (a `Pool` over that node's own expert store, with
  its host tier for a GPU, the prefetcher and the module skeletons) by
  reusing `executors.executor.Executor` itself, and runs the batches it is
  sent with `Executor.run_batch`.  Every answer carries the pool's residency
  and the load/evict events since the last answer, so the front box's
  switch costs follow what the remote pool really holds.
- `RemoteExecutor` runs on the front box in place of a local `Executor`:
  a thread takes batches from the `Scheduler` (the scheduler still decides
  everything), sends each to its actor and turns the answer into the same
  `BatchResult` a local executor gives.  `RemotePool` is the front's view
  of the remote pool, what the cost model, the initialisation and the
  metrics read.

Batches travel on a ZeroMQ channel the actor binds on its node
(`remote_channel`; `cluster.channel: zmq`, the default): a Ray call that waits
on compute costs ~1.5 ms more on loopback.  Ray still places, warms and
health-checks the actor, and says when it died; `channel: ray` sends batches
as Ray calls.

Failure: when an actor dies or its node goes away (a `RayError`, or no
answer within `call_timeout`), the executor is retired from the scheduler:
its queued requests and the batch that was in flight go back through
`Scheduler.submit` to the executors left.  No frame is lost (the front box
still holds every request, and outputs are applied only on the front) and
none runs twice to a verdict (a lost batch's outputs never arrived, so
nothing of it was written).  A request whose batch was lost
`Scheduler.max_lost` times (3: a batch that kills every actor it reaches, or
outlasts `call_timeout` each time) is not requeued again: its frames get an
error result, as a failing expert's do on the front box, naming the frames,
the expert, the node and the reason.  While retired it looks for its node every
`rejoin_s`; when the node is back it starts a new actor, warms its pool
again and rejoins the scheduler.

Ray is imported lazily, only here and only when a remote executor is built,
so the package works without the `[cluster]` extra.
"""
from __future__ import annotations

import logging
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coe import CoEError, CoEModel, Frame, Request
from coe.probabilities import ranked
from storage.policies import PoolState, Resident
from storage.pool import Handle, PoolEvent, PoolStats

from .executor import BatchResult, Executor
from .scheduler import Batch, Scheduler

log = logging.getLogger(__name__)

RESOURCE_PREFIX = "coe:"   # a node named box-2 is a Ray node started with the custom resource 'coe:box-2'
ACTOR_SHARE = 0.001        # of that resource per actor: many executors fit one node


def node_resource(node: str) -> str:
    return RESOURCE_PREFIX + node


@dataclass(frozen=True)
class RemoteSpec:
    """Everything an `ExecutorHost` needs to build its executor on its node (pickled to the actor)."""

    name: str
    node: str
    device: str
    memory: int
    expert_memory: int
    store: str                     # the expert store path on that node
    eviction: str = "coserve"
    expert_read: str = "read"
    expert_verify: str = "first"
    compute_dtype: str = "float32"
    host_tier: int = 0             # bytes of the node-local host tier behind a GPU pool (0: none)
    exclusive: bool = True
    prefetch: bool = True
    threads: int | None = None
    probabilities: dict[str, float] = field(default_factory=dict)
    preliminaries: dict[str, tuple[str, ...]] = field(default_factory=dict)


NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def actor_options(node: str, device: str) -> dict:
    """How an executor's actor is placed: on `node` (its 'coe:' resource), and for a GPU on a node Ray counts
    a GPU on (Jetson: `ray start --num-gpus 1`).  Ray would narrow a GPU actor's CUDA_VISIBLE_DEVICES to the
    one GPU it picked, whatever the config's `cuda:N` says; it is told not to, so N means the node's GPU N, as
    for a local executor (`local_device` maps N if a Ray version narrows it anyway)."""
    opts = {"resources": {node_resource(node): ACTOR_SHARE}, "num_cpus": 0, "num_gpus": 0.0, "max_restarts": 0,
            "max_concurrency": 1, "name": None}
    if device.startswith("cuda"):
        opts["num_gpus"] = ACTOR_SHARE
        opts["runtime_env"] = {"env_vars": {NOSET_CUDA: "1"}}
    return opts


def _assigned_gpus() -> list[str]:
    try:
        import ray

        return [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
    except Exception:  # noqa: BLE001 - outside a Ray worker: nothing was assigned
        return []


def local_device(device: str, visible: str | None, assigned: list[str]) -> str:
    """The torch device for the configured `device` ('cuda:N', N as the node numbers its GPUs) in a process
    whose CUDA_VISIBLE_DEVICES is `visible`, given the GPU ids Ray `assigned` to it.

    Only when Ray itself narrowed the visible set (it equals the assigned
    ids) is N mapped: to its position in that set, or refused, naming both,
    if Ray gave this process other GPUs.  A set the node's operator chose
    (or none) is left alone: N is then what torch numbers on that node.
    """
    if not device.startswith("cuda"):
        return device
    index = device.split(":", 1)[1] if ":" in device else "0"
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not ids or not assigned or ids != [str(a) for a in assigned]:
        return device
    if index not in ids:
        raise CoEError(f"executor device {device}: Ray gave this actor GPU(s) {','.join(ids)} only "
                       f"(CUDA_VISIBLE_DEVICES={visible}); start the actor with {NOSET_CUDA}=1 (the agent does) "
                       f"or name one of those GPUs")
    return f"cuda:{ids.index(index)}"


class _Hints:
    """What `Executor.run_batch` asks its scheduler for: the next group's expert, sent with each batch."""

    def __init__(self) -> None:
        self.next: str | None = None

    def next_expert(self, executor: str, current: str) -> str | None:
        return self.next if self.next != current else None


class ExecutorHost:
    """The actor body: one local `Executor` with its pool over the node's own store.

    Ray runs one method at a time on an actor (max_concurrency 1); batches may
    also come over the batch channel's thread (`open_channel`), so running,
    warming and reporting take one lock.
    """

    def __init__(self, spec: RemoteSpec, model: CoEModel) -> None:
        from storage.expert_store import ExpertStore
        from storage.policies import make_policy
        from storage.pool import Pool
        from storage.tiers import StoreSource, TierSource, measured_nbytes, source_dtype

        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        self.spec, self.model = spec, model
        self.store = ExpertStore(spec.store, verify=spec.expert_verify)
        missing = [e for e in model.experts if not self.store.has(e)]
        if missing:
            raise CoEError(f"node {spec.node}: expert store {spec.store} lacks {len(missing)} expert(s) of the "
                           f"spec, e.g. {', '.join(missing[:3])}; run `coe-agent experts sync`")
        self._events: list[tuple] = []
        self._reports = 0         # reports made, each one's `seq`: the front applies only the newest residency
        dtype = source_dtype(spec.compute_dtype)
        gpu = spec.device.startswith("cuda")
        # the configured index names the node's GPU; this process may see a narrower set (Ray's assignment)
        device = local_device(spec.device, os.environ.get("CUDA_VISIBLE_DEVICES"), _assigned_gpus()) if gpu \
            else spec.device
        self.device = device
        self.host = None
        if gpu and spec.host_tier:
            self.host = Pool("host", spec.host_tier, make_policy(spec.eviction),
                             StoreSource(self.store, pin=True, method=spec.expert_read, dtype=dtype),
                             name=f"host@{spec.node}", on_event=self._on_event,
                             probabilities=spec.probabilities, preliminaries=spec.preliminaries,
                             measure=measured_nbytes)
        if gpu:
            source = TierSource(self.host or StoreSource(self.store, pin=True, method=spec.expert_read, dtype=dtype),
                                device, exclusive=spec.exclusive and self.host is not None)
        else:
            source = StoreSource(self.store, method=spec.expert_read, dtype=dtype)
        self.hints = _Hints()
        self.pool = Pool(spec.device if not gpu else "cuda", spec.expert_memory, make_policy(spec.eviction), source,
                         name=spec.name, on_event=self._on_event, probabilities=spec.probabilities,
                         preliminaries=spec.preliminaries, measure=measured_nbytes,
                         context=lambda: {"queued": {self.hints.next} - {None}})
        self.executor = Executor(spec.name, device, self.pool, self.hints, model, lambda r: None,
                                 prefetch=spec.prefetch)
        self._lock = threading.RLock()
        self._unchecked: set[str] = set()   # experts a sync changed whose copy was still loading (`_check_versions`)
        self._channel = None

    def _on_event(self, e: PoolEvent) -> None:
        if e.event == "evict" and e.tier != "host":
            self.executor.on_evicted(e.value)
            if self.host is not None and self.spec.exclusive:
                from storage.tiers import current_in, demote

                # every victim: this tier does not see the front's queues, so a ranked admission could
                # not protect one a queued request needs (the simulator's other boxes do the same)
                demote(e, self.host, current=current_in(self.store))
        self._events.append((e.expert_id, e.tier, e.event, e.nbytes, e.seconds, e.at))

    def where(self) -> dict:
        """Which node and process this actor runs in (the operator view, and the tests' proof)."""
        import ray

        return {"node": self.spec.node, "host": socket.gethostname(), "pid": os.getpid(),
                "ray_node_id": ray.get_runtime_context().get_node_id(), "device": self.device,
                "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def open_channel(self) -> str:
        """Start answering batches over ZeroMQ on this node's address (`remote_channel`); returns the endpoint."""
        import ray

        from .remote_channel import ChannelServer

        if self._channel is None:
            self._channel = ChannelServer(self.run_packed, ray.util.get_node_ip_address())
        return self._channel.endpoint

    def warm(self, experts: list[str]) -> dict:
        """Load `experts` in order (the front's initialisation by usage probability), as far as they fit."""
        with self._lock:
            return self._warm(experts)

    def _warm(self, experts: list[str]) -> dict:
        for expert_id in experts:
            if self.pool.contains(expert_id) or self.pool.capacity - self.pool.used_bytes() < \
                    self.model.experts[expert_id].nbytes:
                continue
            h = self.pool.acquire(expert_id)
            if h is not None:
                self.pool.release(h)
        return self.report()

    def run(self, batch_id: int, expert_id: str, frames: list[tuple[str, Any]], next_expert: str | None) -> dict:
        """Run one batch; `frames` are (frame_id, image).  Returns the outcome and the pool's report."""
        with self._lock:
            if self._unchecked:          # a sync came while a copy was loading: check it before it serves
                self._check_versions(time.monotonic() + SETTLE_S if expert_id in self._unchecked else None)
            self.hints.next = next_expert
            reqs = [Request(Frame(fid, "", "", "", 0.0, image), expert_id) for fid, image in frames]
            r = self.executor.run_batch(Batch(self.spec.name, expert_id, reqs, id=batch_id))
            # residency changes only with a load or an eviction: without one, no report (it is most of the reply)
            return {"outputs": r.outputs, "error": r.error, "error_kind": r.error_kind,
                    "started_at": r.started_at, "seconds": r.seconds, "version": r.expert_version,
                    "report": self.report() if self._events else None}

    def run_packed(self, blob: bytes) -> bytes:
        """`run` with its arguments and its answer each as one pickle (protocol 5): what the front calls.

        Ray serialises every argument and the reply on its own, through
        cloudpickle and its own reducers; one C-pickled blob each way is
        ~0.5 ms a call cheaper on loopback (bench/cluster_overhead.py, 'packed')."""
        return pickle.dumps(self.run(*pickle.loads(blob)), protocol=5)

    def reload_store(self, changed: list[str]) -> dict:
        """The node's store was synced with a promotion: follow its manifest, forget failures of the `changed`
        experts (a fixed expert gets another chance) and drop their stale copies once no batch holds them."""
        with self._lock:
            self.store.reload()
            deadline = time.monotonic() + SETTLE_S
            for expert_id in changed:
                self.executor.failed.forget(expert_id)
                self._unchecked.add(expert_id)
            self._check_versions(deadline)
            return self.report()

    def _check_versions(self, deadline: float | None = None) -> None:
        """Drop copies of a version the store no longer serves, for the experts a sync changed.

        A copy still loading (a prefetch under way when the sync came) may be of
        the replaced version: it is waited for until `deadline` (kept short: the
        actor answers no ping meanwhile), else checked again before the next
        batch and at each heartbeat.  Under `self._lock`."""
        for expert_id in sorted(self._unchecked):
            want = self.store.entry(expert_id).version if self.store.has(expert_id) else None
            settled = True
            for pool in (self.pool, self.host):
                if pool is None:
                    continue
                value, loading = _settled(pool, expert_id, deadline)
                settled = settled and not loading
                if value is not None and getattr(value, "version", want) != want:
                    pool.discard(expert_id, when_free=True)
            if settled:
                self._unchecked.discard(expert_id)

    def versions(self) -> dict[str, int]:
        """The version of every expert in the node's store, as this actor reads it."""
        return {e.id: e.version for e in self.store.entries()}

    def ping(self, payload: Any = None) -> Any:
        return payload

    def heartbeat(self) -> dict | None:
        """The idle health check's answer: the pool's report when it changed since the last one (a prefetch
        that landed after the last batch's reply, say), else None."""
        with self._lock:
            if self._unchecked:
                self._check_versions()
            return self.report() if self._events else None

    def resident(self) -> list[str]:
        """What the pool holds now (read-only: no events are consumed)."""
        return sorted(self.pool.resident())

    def report(self) -> dict:
        """Residency, stats and the events since the last report (the front's RemotePool follows them)."""
        with self._lock:
            return self._report()

    def _report(self) -> dict:
        st = self.pool.stats()
        state = self.pool.state()
        events, self._events = self._events, []
        self._reports += 1
        return {"seq": self._reports, "resident": [(r.expert_id, r.nbytes) for r in state.residents],
                "stats": vars(st),
                "host": self.host.stats().__dict__ if self.host is not None else None,
                "host_resident": self.host.resident() if self.host is not None else [], "events": events}

    def close(self) -> dict:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.executor.prefetcher is not None:
            self.executor.prefetcher.close()
        self.pool.close()
        if self.host is not None:
            self.host.close()
        return self.report()


class _SizeSource:
    """`initialize` asks the first pool's source for sizes; a RemotePool answers from the spec."""

    def __init__(self, model: CoEModel) -> None:
        self.model = model

    def size(self, expert_id: str) -> int:
        return self.model.experts[expert_id].nbytes


RESYNC_S = 60.0       # a rejoin that keeps failing syncs the node's store again at most this often
WARM_MIN_BPS = 20e6   # the slowest expert read a node's warm-up is allowed (bytes/s): an SD card, a busy USB disk
SETTLE_S = 3.0     # how long a sync waits for copies still loading (the front declares a silent node lost at 10 s)


def _settled(pool, expert_id: str, deadline: float | None = None) -> tuple[object | None, bool]:
    """(`expert_id`'s value in `pool`, False) once any load under way has landed, (None, False) if it is not
    there, or (None, True) if it is still loading at `deadline` (None: do not wait)."""
    while pool.present(expert_id):
        value = pool.peek(expert_id)
        if value is not None:
            return value, False
        if deadline is None or time.monotonic() > deadline:
            return None, True
        time.sleep(0.01)
    return None, False


class RemotePool:
    """The front box's view of a remote executor's pool: what the cost model, `initialize` and metrics read.

    Before the actor is up, `acquire` only records the initialisation's plan
    (`planned`), which `RemoteExecutor.start` sends as the warm-up list; after
    that, every report from the actor replaces the view.  An expert counts as
    present from the moment a batch for it is sent (it is loading there).
    """

    remote = True   # the store watcher leaves it alone: its node's store is synced, not watched

    def __init__(self, name: str, tier: str, capacity: int, model: CoEModel, node: str) -> None:
        self.name, self.tier, self.capacity, self.node = name, tier, capacity, node
        self.source = _SizeSource(model)
        self._lock = threading.Lock()
        self._resident: dict[str, int] = {}
        self._loading: set[str] = set()
        self._stats = PoolStats(capacity=capacity)
        self.host_resident: list[str] = []
        self.planned: list[str] = []
        self._seq = 0       # the newest node report applied (`update`): an older one arriving later changes nothing

    def acquire(self, expert_id: str) -> Handle:
        with self._lock:
            n = self.source.size(expert_id)
            self._resident[expert_id] = n
            self.planned.append(expert_id)
            return Handle(expert_id, None, n)

    def release(self, handle: Handle) -> None:
        pass

    def loading(self, expert_id: str) -> None:
        with self._lock:
            if expert_id not in self._resident:
                self._loading.add(expert_id)

    def settled(self, expert_id: str) -> None:
        """A batch ran with no load or eviction: the expert was resident there all along."""
        with self._lock:
            self._loading.discard(expert_id)

    def update(self, report: dict) -> None:
        """The node's residency and stats, unless a newer report (its `seq`, from this actor) was applied."""
        with self._lock:
            seq = report.get("seq")
            if isinstance(seq, int):
                if seq <= self._seq:
                    return
                self._seq = seq
            self._resident = dict(report["resident"])
            self._loading.clear()
            self._stats = PoolStats(**report["stats"])
            self.host_resident = list(report.get("host_resident", []))

    def forget(self) -> None:
        """The actor is gone: nothing is resident there any more (a new actor counts its reports from 1)."""
        with self._lock:
            self._seq = 0
            self._resident.clear()
            self._loading.clear()
            self.host_resident = []
            self._stats = PoolStats(capacity=self.capacity)

    def contains(self, expert_id: str) -> bool:
        with self._lock:
            return expert_id in self._resident

    def present(self, expert_id: str) -> bool:
        with self._lock:
            return expert_id in self._resident or expert_id in self._loading

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._resident)

    def room_for(self, expert_id: str) -> int:
        """Free bytes on the node's pool (`Pool.room_for`; a node's pool caps no group)."""
        return self.capacity - self.used_bytes()

    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._resident.values())

    def stats(self) -> PoolStats:
        with self._lock:
            s = PoolStats(**vars(self._stats))
            s.resident_bytes, s.capacity = sum(self._resident.values()), self.capacity
            return s

    def state(self) -> PoolState:
        with self._lock:
            return PoolState(self.capacity, tuple(Resident(e, n, 0, 0) for e, n in self._resident.items()))

    def close(self) -> None:
        pass


CHANNELS = ("zmq", "ray")   # how batches reach the actor: the ZeroMQ batch channel, or Ray calls


def channel_handshake(endpoint: str, *, name: str, node: str, timeout: float):
    """The front's end of an actor's batch channel, once one echo went over it within `timeout`.

    A ZeroMQ connect never fails (it retries in the background), so without
    this a port the front cannot reach would show only as batches lost 3
    times.  Returns (client, the echo's round trip in seconds); raises a
    `CoEError` naming the executor, the node, its address and the port.
    """
    from .remote_channel import ChannelClient

    client = ChannelClient(endpoint)
    try:
        return client, client.echo(timeout)
    except Exception as exc:  # noqa: BLE001 - no answer, or a wrong one: this channel cannot carry batches
        client.close()
        address, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        raise CoEError(f"executor {name} on node {node}: its batch channel at address {address}, port {port} "
                       f"({endpoint}) did not answer an echo from this box: {exc}.  The actor binds a random port "
                       f"(49152-65535) on its node's address: let this box reach the node's TCP ports there (a "
                       f"firewall between the boxes?), or set cluster.channel: ray") from None


REPLY_KEYS = ("outputs", "error", "error_kind", "started_at", "seconds", "version", "report")


def reply_problem(reply: object, frames: int) -> str | None:
    """What is wrong with a node's answer to a batch of `frames` frames (`NodeExecutor.run`), or None.

    A reply of another shape (a node on another coe-edge version) must not
    be read key by key: a missing key would end the call as a lost node, and
    fewer outputs than frames would leave the rest without a verdict.
    """
    if not isinstance(reply, dict):
        return f"a {type(reply).__name__}, not a dict"
    missing = [k for k in REPLY_KEYS if k not in reply]
    if missing:
        return f"missing {', '.join(missing)}"
    if reply["error"] is not None:
        return None if isinstance(reply["error"], str) else f"error {type(reply['error']).__name__}, not a string"
    outputs = reply["outputs"]
    if not isinstance(outputs, list):
        return f"outputs {type(outputs).__name__}, not a list"
    if len(outputs) != frames:
        return f"{len(outputs)} outputs for {frames} frames"
    return report_problem(reply["report"])


def _answered_with_error(exc: BaseException) -> bool:
    """Did the node's actor answer, with its own failure (the batch channel's error status, or a Ray task
    error: the method raised), rather than die, hang or vanish?  Such a batch gets error results; retiring a
    live node for it would throw its warm pool away and retry the same failure on the next node."""
    from .remote_channel import ChannelError

    if isinstance(exc, ChannelError):
        return True
    try:
        from ray.exceptions import RayActorError, RayTaskError
    except ImportError:
        return False
    return isinstance(exc, RayTaskError) and not isinstance(exc, RayActorError)


REPORT_KEYS = ("resident", "stats", "host", "host_resident", "events")
_STATS_FIELDS = frozenset(PoolStats.__dataclass_fields__)


def report_problem(report: object) -> str | None:
    """What is wrong with a node's pool report (`ExecutorHost._report`; None: nothing new), or None.

    Checked before it is applied: one of another shape (a node on another
    coe-edge version) read field by field would raise in the serving thread,
    which takes that for a lost node and kills a healthy actor.
    """
    if report is None:
        return None
    if not isinstance(report, dict):
        return f"report: a {type(report).__name__}, not a dict"
    missing = [k for k in REPORT_KEYS if k not in report]
    if missing:
        return f"report: missing {', '.join(missing)}"
    stats = report["stats"]
    if not isinstance(stats, dict) or not set(stats) <= _STATS_FIELDS:
        extra = sorted(set(stats) - _STATS_FIELDS) if isinstance(stats, dict) else []
        return f"report: stats {'with unknown fields ' + ', '.join(map(str, extra)) if extra else 'not a dict'}"
    resident = report["resident"]
    if not isinstance(resident, list) or not all(isinstance(r, (list, tuple)) and len(r) == 2 for r in resident):
        return "report: resident is not a list of (expert, bytes) pairs"
    events = report["events"]
    if not isinstance(events, list) or not all(isinstance(e, (list, tuple)) and len(e) == 6 for e in events):
        return "report: events is not a list of 6-field events"
    if not isinstance(report["host_resident"], list):
        return "report: host_resident is not a list"
    return None


class RemoteExecutor:
    """The front box's stand-in for an executor on another node: same surface as `Executor`.

    `on_event` gets each remote load/evict as a `PoolEvent` (for the results
    database, the metrics and the scheduler's refresh); `on_state` is told
    'up', 'lost: why' and 'rejoined' for the operator view.
    """

    # it retires itself when its node is lost and restores itself when the node rejoins, so requests that wait
    # in the scheduler for it have a future only while its thread runs (the agent's stop counts on that)
    can_restore = True

    def __init__(self, spec: RemoteSpec, model: CoEModel, pool: RemotePool, scheduler: Scheduler,
                 on_result: Callable[[BatchResult], None], *, on_event: Callable[[PoolEvent], None] | None = None,
                 call_timeout: float = 60.0, rejoin_s: float = 2.0, connect_timeout: float = 30.0,
                 channel: str = "zmq", sync: Callable[..., None] | None = None,
                 versions: Callable[[], dict[str, int]] | None = None,
                 size_of: Callable[[str], int] | None = None) -> None:
        if channel not in CHANNELS:
            raise CoEError(f"executor {spec.name}: channel must be one of {', '.join(CHANNELS)}, got {channel!r}")
        self.spec, self.model, self.pool, self.scheduler = spec, model, pool, scheduler
        self.channel = channel
        self._sync = sync                  # copies the front's store to the node's (before a rejoin)
        self._versions = versions          # the front store's version of each expert (None: not checked)
        self._size_of = size_of            # an expert's bytes, for the warm-up's time limit (None: the spec's)
        self._client = None                # the batch channel to the actor (`remote_channel`), when zmq
        self._probe = None                 # a liveness ping through Ray while a batch is out on the channel
        self.name, self.device, self.node = spec.name, spec.device, spec.node
        self._on_result = on_result
        self._on_event = on_event or (lambda e: None)
        self.call_timeout, self.rejoin_s, self.connect_timeout = call_timeout, rejoin_s, connect_timeout
        self.actor = None
        self.up = False
        self.state = "created"
        self._stale: str | None = None   # `mark_stale`: why it must rejoin before it serves again
        self._failed_rejoins = 0          # rejoins that failed since the last one that worked
        self._forced_sync_at = 0.0        # when a rejoin last synced the node's store whatever the front's did
        self.where: dict = {}
        self.lost = 0          # times it was lost (counted once its requests are back with the scheduler)
        self.requeued = 0      # requests handed back to the scheduler
        self.batches = 0
        self.sent = 0          # batches sent to an actor (answered or not)
        self.inflight: Batch | None = None   # the batch sent and not answered yet (the operator view, the tests)
        self.rejoined = 0
        self._contact = time.monotonic()   # last answer from the actor
        self._ping = None                  # (ObjectRef, sent at) of the idle health check under way
        self._thread = threading.Thread(target=self._loop, name=f"remote-{self.name}", daemon=True)

    # -- the Executor surface --------------------------------------------------------
    def start(self) -> None:
        """Start the actor on its node and warm its pool with the initialisation's plan, then serve."""
        self._connect(self.pool.planned)
        try:
            differ = self._version_skew()
        except Exception as exc:  # noqa: BLE001 - a node that cannot say its versions is not started on
            self._drop_actor()
            self.up, self.state = False, "created"
            raise CoEError(f"executor {self.name} on node {self.node}: could not read the versions its store "
                           f"serves: {short_error(exc)}") from None
        if differ:
            self._drop_actor()
            self.up, self.state = False, "created"
            raise CoEError(f"executor {self.name} on node {self.node}: its store serves other versions than this "
                           f"box's ({self._skew_text(differ)}): run `coe-agent experts sync` for the line, then "
                           "start again")
        self._thread.start()

    def _warm_timeout(self, warm: list[str]) -> float:
        """Seconds a new actor may take to warm `warm`: the call limits, or the planned bytes read at
        WARM_MIN_BPS (a big pool on slow storage, a Jetson's card, must not fail every start and rejoin)."""
        size = self._size_of or self.pool.source.size
        planned = sum(size(e) for e in warm if e in self.model.experts)
        return max(self.connect_timeout, self.call_timeout, planned / WARM_MIN_BPS)

    def _version_skew(self) -> dict[str, tuple]:
        """{expert: (node's version, this box's)} where the node's actor reads another version than the front's
        store holds (a promotion made while the agent was down, or one that landed while it rejoined)."""
        import ray

        if self._versions is None or self.actor is None:
            return {}
        want = self._versions()
        got = ray.get(self.actor.versions.remote(), timeout=self.connect_timeout)
        return {e: (got.get(e), want.get(e)) for e in sorted(self.model.experts) if got.get(e) != want.get(e)}

    @staticmethod
    def _skew_text(differ: dict[str, tuple]) -> str:
        shown = ", ".join(f"{e}: node v{n}, here v{h}" for e, (n, h) in list(differ.items())[:3])
        return shown + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread, then close the actor; one never started (a failed start) closes at once."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive and self.actor is not None:
            self._close_actor()
        return not alive

    def alive(self) -> bool:
        return self._thread.is_alive()

    def on_evicted(self, value) -> None:
        pass   # the skeletons live on the node

    # -- actor lifecycle ---------------------------------------------------------------
    def _connect(self, warm: list[str]) -> None:
        import ray

        cls = ray.remote(ExecutorHost)
        actor = cls.options(**actor_options(self.node, self.device)).remote(self.spec, self.model)
        try:
            self.where = ray.get(actor.where.remote(), timeout=self.connect_timeout)
            report = ray.get(actor.warm.remote(warm), timeout=self._warm_timeout(warm))
            endpoint = ray.get(actor.open_channel.remote(), timeout=self.connect_timeout) \
                if self.channel == "zmq" else None
        except Exception as exc:  # noqa: BLE001 - any failure to come up is this node's, named
            ray.kill(actor)
            raise CoEError(f"executor {self.name} on node {self.node}: the actor did not come up: "
                           f"{short_error(exc)}") from None
        problem = report_problem(report)
        if problem is not None:      # before the actor is kept: a rejoin that fails here leaks no actor
            ray.kill(actor)
            raise CoEError(f"executor {self.name} on node {self.node}: its warm-up answered with a {problem} "
                           "(is the node on the same coe-edge version as this box?)")
        if endpoint is not None:
            try:
                self._client, rtt = channel_handshake(endpoint, name=self.name, node=self.node,
                                                      timeout=self.connect_timeout)
            except CoEError:
                ray.kill(actor)
                raise
            self.where["channel"] = endpoint
            self.where["channel_echo_ms"] = round(rtt * 1e3, 3)
        self.actor = actor
        self._apply(report)
        self.up, self.state = True, "up"
        self._contact = time.monotonic()
        log.info("executor %s up on node %s (%s, pid %s)", self.name, self.node, self.where.get("host"),
                 self.where.get("pid"))

    def _close_channel(self) -> None:
        self._probe = None
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _alive(self) -> None:
        """While a batch is out on the channel: raise if Ray says the actor or its node died."""
        import ray

        if self._probe is None:
            self._probe = self.actor.ping.remote()
            return
        ready, _ = ray.wait([self._probe], timeout=0)
        if ready:
            ref, self._probe = self._probe, None
            ray.get(ref)

    def _close_actor(self) -> None:
        import ray

        try:
            self._apply(ray.get(self.actor.close.remote(), timeout=10))
        except Exception:  # noqa: BLE001 - closing a dead actor has nothing to flush
            pass
        self._drop_actor()

    def _drop_actor(self) -> None:
        """Close the batch channel and kill the actor (already dead, or not): it is not used again."""
        import ray

        try:
            self._close_channel()
        except Exception:  # noqa: BLE001 - a socket that will not close is dropped with its client
            log.warning("closing %s's batch channel failed", self.name, exc_info=True)
        if self.actor is not None:
            try:
                ray.kill(self.actor)
            except Exception:  # noqa: BLE001 - it is already gone
                pass
        self.actor = None

    def _apply(self, report: dict) -> None:
        problem = report_problem(report)
        if problem is not None:      # the caller carries on; this node's view waits for a well-formed report
            log.warning("executor %s on node %s: its pool %s; not applied", self.name, self.node, problem)
            return
        self.pool.update(report)
        for expert_id, tier, event, nbytes, seconds, at in report["events"]:
            tier_name = f"{tier}@{self.node}"
            self._on_event(PoolEvent(expert_id, tier_name, event, nbytes, seconds, at))

    # -- serving ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            if not self.up:
                # lost while the agent closes: its requests wait in the scheduler, journaled, for the next start
                # (rejoining on forever would keep the agent's stop from ending this thread)
                if self.scheduler.closed:
                    return
                if not self._rejoin():
                    time.sleep(min(self.rejoin_s, 0.25) if self.scheduler.drained(self.name) else self.rejoin_s)
                continue
            try:
                if self._stale is not None:     # a promotion did not reach this node: out until it rejoins
                    why, self._stale = self._stale, None
                    self._lose(CoEError(why), None)
                    continue
                batch = self.scheduler.next_batch(self.name, timeout=0.25)
                if batch is None:
                    if self.scheduler.drained(self.name):
                        return
                    self._check()   # idle: a dead node is found now, not at its next batch
                    continue
                if self._stale is not None:     # marked while it waited: the batch goes back, unrun
                    why, self._stale = self._stale, None
                    self.scheduler.finished(batch, lost=True, attempt=False)   # not sent: not an attempt
                    self._lose(CoEError(why), batch)
                    continue
                self._serve(batch)
            except Exception as exc:  # noqa: BLE001 - a dead serving thread would strand every request it holds
                log.exception("executor %s on node %s: serving failed", self.name, self.node)
                held, self.inflight = self.inflight, None
                if held is not None:
                    self.scheduler.finished(held, lost=True)
                if self.up:
                    self._lose(exc, held)

    def _check(self) -> None:
        """The idle health check, without blocking: a ping goes out once the actor has been quiet for
        `rejoin_s`, and its answer is looked at on the next idle turns, so a batch assigned meanwhile is
        sent at once rather than behind a ping to a node that hangs."""
        import ray

        now = time.monotonic()
        if self._ping is None:
            if now - self._contact > self.rejoin_s:
                self._ping = (self.actor.heartbeat.remote(), now)
            return
        ref, sent = self._ping
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            if now - sent > min(self.call_timeout, 10.0):
                self._ping = None
                self._lose(TimeoutError(f"no answer to a ping in {now - sent:.1f} s"), None)
            return
        self._ping = None
        try:
            report = ray.get(ref)
            self._contact = now
        except Exception as exc:  # noqa: BLE001 - any failure to answer is the node's or the actor's
            self._lose(exc, None)
            return
        if report is not None:
            self._apply(report)     # residency changed while idle: the front's switch costs follow

    def _settle_ping(self, wait: float = 1.0) -> None:
        """Drop the pending ping once its answer is read: the heartbeat took the node's events since the last
        report, which are in no other answer (dropped unread, a prefetch's load never reached expert_events).
        Residency follows whichever report is newer (`RemotePool.update`)."""
        import ray

        if self._ping is None:
            return
        ref, _ = self._ping
        self._ping = None
        try:
            ready, _ = ray.wait([ref], timeout=wait)
            report = ray.get(ready[0]) if ready else None
        except Exception:  # noqa: BLE001 - the batch's answer proved the actor alive; a lost ping is only events
            log.warning("executor %s on node %s: a heartbeat's answer was lost", self.name, self.node, exc_info=True)
            return
        if report is not None:
            self._apply(report)

    def _serve(self, batch: Batch) -> None:
        import ray

        self.inflight = batch
        self.pool.loading(batch.expert_id)
        nxt = self.scheduler.next_expert(self.name, batch.expert_id)
        frames = [(r.frame.frame_id, r.frame.image) for r in batch.requests]
        try:
            blob = pickle.dumps((batch.id, batch.expert_id, frames, nxt), protocol=5)
        except Exception as exc:  # noqa: BLE001 - this box's fault, not the node's: an error result, no loss
            self._front_error(batch, f"cannot send the batch to node {self.node}: {short_error(exc)}")
            return
        self.sent += 1
        try:
            if self._client is not None:
                raw = self._client.call(blob, timeout=self.call_timeout, alive=self._alive)
                self._probe = None
            else:
                raw = ray.get(self.actor.run_packed.remote(blob), timeout=self.call_timeout)
        except Exception as exc:  # noqa: BLE001 - RayActorError, node death, timeout: the batch is lost there
            if _answered_with_error(exc):   # the actor is alive and said why: the batch's error, not a lost node
                self._probe = None
                self._contact = time.monotonic()
                self._front_error(batch, f"node {self.node} ({self.name}) could not run batch {batch.id}: "
                                         f"{short_error(exc)}")
                return
            self.scheduler.finished(batch, lost=True)
            self.inflight = None
            self._lose(exc, batch)
            return
        try:
            reply = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001 - an answer this box cannot read: the batch ran, its result is lost
            self._front_error(batch, f"cannot read node {self.node}'s answer: {short_error(exc)}")
            return
        problem = reply_problem(reply, len(batch.requests))
        if problem is not None:   # another coe-edge version on the node, say: its frames get errors, none is lost
            self._front_error(batch, f"node {self.node} ({self.name}) answered batch {batch.id} malformed: {problem}")
            return
        self._contact = time.monotonic()
        self._settle_ping()    # the answer proves the actor alive; the ping's answer may still carry events
        if reply["report"] is not None:
            self._apply(reply["report"])
        else:
            self.pool.settled(batch.expert_id)
        error = reply["error"]
        if error is not None and not error.startswith("node "):
            error = f"node {self.node} ({self.name}): {error}"   # a node's own store fault reads as that node's
        result = BatchResult(batch, self.name, f"{self.device}@{self.node}", reply["started_at"], reply["seconds"],
                             outputs=reply["outputs"], error=error, error_kind=reply["error_kind"],
                             expert_version=reply["version"])
        self.inflight = None      # from here the result is delivered whatever happens (`_deliver`)
        self.scheduler.finished(batch)
        self.batches += 1
        self._deliver(result)

    def _front_error(self, batch: Batch, msg: str) -> None:
        """The batch's frames get an error result for a fault on this box (not a node loss, not retried)."""
        self.inflight = None
        self.pool.settled(batch.expert_id)
        self.scheduler.finished(batch)
        self._deliver(BatchResult(batch, self.name, f"{self.device}@{self.node}", time.time(), 0.0,
                                  error=msg, error_kind="expert_run"))

    def _deliver(self, result: BatchResult) -> None:
        """Hand a result to the agent; if that fails, an error result for the same frames, so none is lost."""
        try:
            self._on_result(result)
        except Exception:  # noqa: BLE001 - as Executor: the frames still get verdicts
            log.exception("handling the result of batch %d from %s failed", result.batch.id, self.name)
            self._on_result(BatchResult(result.batch, self.name, self.device, result.started_at, result.seconds,
                                        error="internal error after the batch ran", error_kind="internal"))

    def _lose(self, exc: BaseException, batch: Batch | None) -> None:
        """Retire from the scheduler and hand every request it held back to the executors left.

        The requests of `batch` (the one in flight, already counted lost by
        `Scheduler.finished`) that were lost `Scheduler.max_lost` times are given up
        instead: they get an error result, as a failing expert's frames do on
        the front box, naming the frames, the expert, the node and why.
        """
        why = short_error(exc)
        self.up, self.state = False, f"lost: {why}"
        self._ping = None
        log.error("executor %s on node %s lost (%s); requeueing its requests", self.name, self.node, why)
        queued = self.scheduler.retire(self.name)
        # its requests go back before anything else is tried: a clean-up step that raises must not strand
        # the requests this thread alone holds between `retire` and `requeue`
        again = (list(batch.requests) if batch is not None else []) + queued
        unplaced: list = []
        gone = self.scheduler.requeue(again, unplaced)
        self.requeued += len(again) - len(gone) - len(unplaced)
        self._deliver_unplaced(unplaced)
        try:
            self.pool.forget()
        except Exception:  # noqa: BLE001 - a bug, but its requests are already back: this thread goes on
            log.warning("forgetting %s's residency after its loss failed", self.name, exc_info=True)
        self._drop_actor()
        self.lost += 1   # counted once its requests are back with the scheduler: `lost` says the loss is handled
        if gone:
            frames = ", ".join(r.frame.frame_id for r in gone[:8]) + (" ..." if len(gone) > 8 else "")
            msg = (f"frame(s) {frames}: expert {batch.expert_id} given up after its batch was lost "
                   f"{self.scheduler.max_lost} times; last on executor {self.name}, node {self.node}: {why}")
            log.error("%s", msg)
            try:
                self._deliver(BatchResult(Batch(self.name, batch.expert_id, gone, id=batch.id), self.name,
                                          f"{self.device}@{self.node}", time.time(), 0.0, error=msg,
                                          error_kind="executor_lost"))
            except Exception:  # noqa: BLE001 - even the fallback failed: this thread must go on rejoining
                log.exception("handling the given-up batch %d from %s failed", batch.id, self.name)

    def _rejoin(self) -> bool:
        """Look for the node; when it is back, a new actor warms its pool and the executor rejoins."""
        import ray

        before = self.state
        lost = before.split("; rejoin failing: ")[0]
        try:
            if ray.cluster_resources().get(node_resource(self.node), 0) <= 0:
                return False
            self._stale = None      # whatever made it stale, the sync below brings the node up to date
            if self._sync is not None:
                # a promotion made while the node was away reaches its store first; after a failed rejoin the
                # node's store is synced again even if the front's did not change (it may have been wiped), at
                # most once a minute (a sync hashes every expert file on both boxes)
                now = time.monotonic()
                force = self._failed_rejoins > 0 and now - self._forced_sync_at >= RESYNC_S
                if force:
                    self._forced_sync_at = now
                self._sync(force=force)
            # the start's plan again (its share of the initialisation across executors), not the most probable
            # experts overall, which the other executors hold already
            order = self.pool.planned or ranked(self.model.experts, self.spec.probabilities)
            self._connect(order)
            differ = self._version_skew()
            if differ and self._sync is not None:   # a promotion landed between the sync and the actor's start
                now = time.monotonic()           # (or the node's store is not what was synced: at most once a minute)
                force = self._failed_rejoins == 0 or now - self._forced_sync_at >= RESYNC_S
                if force:
                    self._forced_sync_at = now
                self._sync(force=force)
                self.reload_store(list(differ))
                differ = self._version_skew()
            if differ:
                raise CoEError(f"its store serves other versions than this box's ({self._skew_text(differ)})")
        except Exception as exc:  # noqa: BLE001 - not back yet
            why = short_error(exc)
            self._failed_rejoins += 1
            self.up = False                 # `_connect` may have got as far as marking it up
            if self.actor is not None:      # ... and keeping an actor: not used, so not leaked either
                self._drop_actor()
                try:
                    self.pool.forget()      # its reports' sequence goes with it: the next actor counts from 1
                except Exception:  # noqa: BLE001 - as in `_lose`: this thread goes on rejoining
                    log.warning("forgetting %s's residency after a failed rejoin failed", self.name, exc_info=True)
            if not before.endswith(f"; rejoin failing: {why}"):   # said once per reason, in the log and state
                log.warning("executor %s: node %s is in the cluster but cannot rejoin (%s); retrying every %g s",
                            self.name, self.node, why, self.rejoin_s)
            self.state = f"{lost}; rejoin failing: {why}"
            return False
        self.rejoined += 1
        self._failed_rejoins = 0
        self._deliver_unplaced(self.scheduler.restore(self.name))
        self.state = "up (rejoined)"
        return True

    def _deliver_unplaced(self, unplaced: list) -> None:
        """Error results for requests the scheduler could not assign again ((request, why) from `requeue` or
        `restore`): each frame still gets its one verdict."""
        by_expert: dict[str, list] = {}
        for r, why in unplaced:
            by_expert.setdefault(r.expert_id, []).append((r, why))
        for expert, items in by_expert.items():
            try:
                self._deliver(BatchResult(Batch(self.name, expert, [r for r, _ in items]), self.name,
                                          f"{self.device}@{self.node}", time.time(), 0.0, error=items[0][1],
                                          error_kind="internal"))
            except Exception:  # noqa: BLE001 - even the fallback failed: this thread must go on
                log.exception("%s: the error results of %d request(s) that could not be scheduled again failed",
                              self.name, len(items))

    def mark_stale(self, why: str) -> None:
        """The node did not take a promotion: this executor's thread retires it before its next batch (no batch
        runs on the old weights) and it rejoins, which syncs the node's store and starts a new actor on it."""
        self._stale = why

    def reload_store(self, changed: list[str], timeout: float = 60.0) -> None:
        """After the node's store was synced with a promotion: the actor follows it (see `ExecutorHost`)."""
        import ray

        if not self.up or self.actor is None:
            return                  # a retired executor syncs and starts a new actor when it rejoins
        self._apply(ray.get(self.actor.reload_store.remote(sorted(changed)), timeout=timeout))

    def ping(self, payload: Any = None, timeout: float = 10.0) -> Any:
        import ray

        return ray.get(self.actor.ping.remote(payload), timeout=timeout)

    def status(self) -> dict:
        """For `coe-agent cluster status` and the status page: where it runs and how it is."""
        st = self.pool.stats()
        return {"name": self.name, "node": self.node, "device": self.device, "state": self.state, "up": self.up,
                "where": self.where, "resident": sorted(self.pool.resident()), "resident_bytes": st.resident_bytes,
                "capacity": st.capacity, "switches": st.misses, "batches": self.batches, "lost": self.lost,
                "requeued": self.requeued, "rejoined": self.rejoined}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*): (.*)$")   # 'coe.errors.CoEError: message' in a traceback


def short_error(exc: BaseException, limit: int = 600) -> str:
    """One line for logs, the state and error verdicts that keeps what the remote side said.

    Ray wraps a remote exception with its traceback: a task's (`RayTaskError`)
    carries the exception itself as `cause`; an actor whose creation failed
    (`ActorDiedError`) carries it only as text, after the traceback.  Either
    way the remote exception's own message is kept whole (a node's "run
    `coe-agent experts sync`" is in it), not Ray's first line.
    """
    name = type(exc).__name__
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return _clip(f"{type(cause).__name__}: {cause}", limit)
    lines = [l.rstrip() for l in _ANSI.sub("", str(exc)).strip().splitlines()]
    if not lines:
        return name
    for i in range(len(lines) - 1, 0, -1):   # a traceback as text: its last unindented 'Type: message' line on
        m = _RAISED.match(lines[i])
        if m and not lines[i].startswith(" ") and lines[i - 1].startswith(" "):
            head = lines[0].split(", ray::")[0].split(" ray::")[0].rstrip(",: ")
            return _clip(f"{name}: {head}: {m.group(1)}: {' '.join([m.group(2), *lines[i + 1:]]).strip()}", limit)
    return _clip(f"{name}: {' '.join(l.strip() for l in lines)}", limit)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
