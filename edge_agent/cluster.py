"""The front box's side of a line spread over several boxes (issue 15): connect, check, build, report.

The agent keeps ingest, the journal, the results and the scheduler; this
module connects it to the Ray cluster named in `cluster.address`, checks that
every node an executor names is there (a Ray node started with the custom
resource 'coe:<node>'), builds each remote executor's spec and its front-side
pool view, and answers `coe-agent cluster status|profile` and `experts sync`.
Ray is imported here lazily: a line without `cluster:` never loads it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coe import CoEError
from executors.links import DEFAULT_FRAME_BYTES, Link, Links
from executors.remote import RESOURCE_PREFIX, RemoteSpec, node_resource, short_error

if TYPE_CHECKING:
    from .config import ClusterConfig, LineConfig

log = logging.getLogger(__name__)


def _host_port(address: str) -> tuple[str, int] | None:
    """'ray://h:10001' or 'h:6379' -> (h, port); 'auto'/'local' -> None (nothing to pre-check)."""
    a = address.split("://", 1)[-1]
    if a in ("auto", "local") or ":" not in a:
        return None
    host, port = a.rsplit(":", 1)
    try:
        return host, int(port)
    except ValueError:
        raise CoEError(f"cluster.address: expected 'HOST:PORT' or 'ray://HOST:PORT', got '{address}'") from None


def connect(cluster: "ClusterConfig", nodes: list[str]) -> dict[str, dict]:
    """Join the Ray cluster and check every node in `nodes` is in it; returns the cluster's nodes by name.

    Fails with one clear line: an address that cannot be reached, or a node
    that no alive Ray node carries the resource of.
    """
    try:
        import ray
    except ImportError:
        raise CoEError("cluster: executors on other boxes need Ray: pip install 'coe-edge[cluster]'") from None
    hp = _host_port(cluster.address)
    if hp is not None:
        try:
            socket.create_connection(hp, timeout=min(cluster.connect_timeout_s, 5.0)).close()
        except OSError as exc:
            raise CoEError(f"cluster.address: cannot reach {hp[0]}:{hp[1]} ({exc.strerror or exc}); is the Ray "
                           f"head running (`ray start --head`)?") from None
    if not ray.is_initialized():
        # frames are raw crops of ~150 KB: above Ray's 100 KB inline limit they would go through the object
        # store, which costs ~6 ms a batch on loopback (bench/cluster_overhead.py); 1 MiB keeps them inline
        os.environ.setdefault("RAY_max_direct_call_object_size", str(1 << 20))
        ray.init(address=cluster.address, namespace="coe-edge", log_to_driver=False, ignore_reinit_error=True,
                 logging_level=logging.WARNING)
    known = cluster_nodes()
    for node in nodes:
        if node not in known or not known[node]["alive"]:
            have = ", ".join(sorted(known)) or "none"
            raise CoEError(f"cluster: node '{node}' (an executor's `node:`) is not in the cluster at "
                           f"{cluster.address} (nodes with a 'coe:' resource: {have}); start it with "
                           f"`ray start --address ... --resources '{{\"{node_resource(node)}\": 1}}'`")
    return known


def cluster_nodes() -> dict[str, dict]:
    """Every Ray node that carries a 'coe:<name>' resource, by name: alive, address, CPUs, GPUs."""
    import ray

    out: dict[str, dict] = {}
    for n in ray.nodes():
        res = n.get("Resources", {})
        for key in res:
            if key.startswith(RESOURCE_PREFIX):
                name = key[len(RESOURCE_PREFIX):]
                if name in out and out[name]["alive"] and not n.get("Alive"):
                    continue   # a dead incarnation does not hide the live one
                out[name] = {"alive": bool(n.get("Alive")), "address": n.get("NodeManagerAddress"),
                             "cpus": res.get("CPU", 0), "gpus": res.get("GPU", 0), "ray_node_id": n.get("NodeID")}
    return out


def remote_spec(cfg: "LineConfig", name: str, node: str, device: str, memory: int, expert_memory: int, *,
                prefetch: bool, threads: int | None, probabilities: dict[str, float],
                preliminaries: dict[str, tuple[str, ...]]) -> RemoteSpec:
    """The spec a remote executor is built from: the line's settings, the node's own store."""
    store = cfg.cluster.stores.get(node, str(cfg.store_path))
    gpu = device.startswith("cuda")
    return RemoteSpec(name=name, node=node, device=device, memory=memory, expert_memory=expert_memory, store=store,
                      eviction=cfg.eviction, expert_read=cfg.expert_read, expert_verify=cfg.expert_verify,
                      compute_dtype=cfg.gpu_compute_dtype if gpu else cfg.cpu_compute_dtype,
                      host_tier=cfg.cpu_tier if gpu and not cfg.unified_memory else 0,
                      exclusive=cfg.cpu_tier_mode == "exclusive", prefetch=prefetch, threads=threads,
                      probabilities=dict(probabilities), preliminaries=dict(preliminaries))


def load_links(cfg: "LineConfig") -> Links:
    """The measured links ({data_dir}/links.json, `coe-agent profile`), else an empty set."""
    path = links_path(cfg)
    if not path.is_file():
        return Links(source="none measured")
    return Links.load(path)


def default_link(node: str) -> Link:
    """A node with no measured link: a stated 1 Gb/s, 0.5 ms one way (a modest factory network); logged."""
    log.warning("no measured link to node %s: scheduling with a stated 1 Gb/s, 0.5 ms (run `coe-agent profile` "
                "or `coe-agent cluster profile`)", node)
    return Link.ethernet(1.0, 0.5, "stated default: 1 Gb/s, 0.5 ms one way (not measured)")


# -- link profile ------------------------------------------------------------------------------------

INLINE_BYTES = 1 << 20   # frames stay inline in Ray calls up to this (connect() raises Ray's limit to it)
PROBE_WORK_S = 0.005     # what the probe's 'real' call spends on the node, as a batch of a small expert does


@dataclass(frozen=True)
class LinkSample:
    """One node's link as measured: medians of real round trips through Ray to an actor there."""

    node: str
    latency_s: float          # what a batch call adds beyond its frames' transfer and its work: a round trip
    bandwidth_bps: float      # frame bytes per second, from frame-sized payloads
    rounds: int
    empty_rtt_s: float        # an empty call's round trip (for the record: a real call costs more)
    frames_per_probe: int
    frame_bytes: int


class _Echo:
    """A tiny actor on a node: answers pings, for the link profile and the overhead benchmark."""

    def ping(self, payload=None):
        return None if payload is None else len(payload)

    def devices(self) -> tuple[str | None, list[str]]:
        """What this worker sees: CUDA_VISIBLE_DEVICES and the GPU ids Ray assigned it (a GPU node's check)."""
        import ray

        return os.environ.get("CUDA_VISIBLE_DEVICES"), [str(g) for g in ray.get_gpu_ids()]

    def work(self, payload, seconds: float):
        """A stand-in for a batch: takes the frames, spends `seconds`, answers small."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            time.sleep(max(0.0, min(end - time.perf_counter(), 0.001)))
        return len(payload)

    def open_channel(self) -> str:
        """Answer `ping`/`work` on a ZeroMQ batch channel too, as a remote executor's actor does batches."""
        import ray

        from executors.remote_channel import ChannelServer

        self._channel = ChannelServer(self._answer, ray.util.get_node_ip_address())
        return self._channel.endpoint

    def _answer(self, blob) -> bytes:
        payload, seconds = pickle.loads(blob)
        return pickle.dumps(self.work(payload, seconds) if seconds else self.ping(payload))


def _median_rtt(call, rounds: int) -> float:
    """Median seconds of `call()`, which blocks for one round trip (and times out rather than hang)."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def measure_link(node: str, *, rounds: int = 50, frame_bytes: int = DEFAULT_FRAME_BYTES,
                 work_s: float = PROBE_WORK_S, channel: str = "zmq") -> LinkSample:
    """Real round trips to an actor on `node`, the way batches go, with payloads the size real calls carry.

    `channel` is the line's `cluster.channel`: 'zmq' times the ZeroMQ batch
    channel remote executors send batches on, 'ray' Ray actor calls.

    - bandwidth: messages of k frame-sized payloads (as many as stay under the
      1 MiB inline limit real batches use, at least one) against empty calls:
      k x frame_bytes / (their extra round-trip time);
    - latency: a call that carries one frame and keeps the node busy `work_s`
      (as a batch does) takes a round trip of work + transfer + this: what a
      remote batch adds per call, which is what the cost model charges per
      batch.  (Half an empty call, the old figure, is ~10x too cheap: Ray's
      reply to a call that waits costs more than an empty echo's.)
    """
    import ray

    from executors.remote_channel import ChannelClient, ChannelError

    actor = ray.remote(_Echo).options(resources={node_resource(node): 0.001}, num_cpus=0).remote()
    k = max(1, min(8, (INLINE_BYTES - 4096) // max(frame_bytes, 1)))
    frames = [b"\0" * frame_bytes for _ in range(k)]
    one = frames[:1]
    client = None
    try:
        ray.get(actor.ping.remote(), timeout=60)
        if channel == "zmq":
            client = ChannelClient(ray.get(actor.open_channel.remote(), timeout=60))

            def call(payload=None, seconds=0.0):
                blob = pickle.dumps((payload, seconds), protocol=5)
                return lambda: client.call(blob, timeout=60, alive=lambda: None)
        else:
            def call(payload=None, seconds=0.0):
                return (lambda: ray.get(actor.work.remote(payload, seconds), timeout=60)) if seconds else \
                    (lambda: ray.get(actor.ping.remote(payload), timeout=60))
        call(frames)()                     # warm the path
        empty = _median_rtt(call(), rounds)
        loaded = _median_rtt(call(frames), rounds)
        real = _median_rtt(call(one, work_s), rounds)
    except (ray.exceptions.RayError, ChannelError, TimeoutError) as exc:
        raise CoEError(f"node {node}: the link probe failed: {short_error(exc)}") from None
    finally:
        if client is not None:
            client.close()
        ray.kill(actor)
    transfer = max(loaded - empty, 1e-7)
    bandwidth = k * frame_bytes / transfer
    latency = max(real - work_s - frame_bytes / bandwidth, empty)
    return LinkSample(node, latency, bandwidth, rounds, empty, k, frame_bytes)


def profile_links(cfg: "LineConfig", *, rounds: int = 50, frame_bytes: int = DEFAULT_FRAME_BYTES,
                  command: str = "coe-agent cluster profile") -> Links:
    nodes = sorted({ex.node for ex in cfg.executors if ex.node})
    connect(cfg.cluster, nodes)
    links = {}
    channel = cfg.cluster.channel
    for node in nodes:
        s = measure_link(node, rounds=rounds, frame_bytes=frame_bytes, channel=channel)
        links[node] = Link(s.bandwidth_bps, s.latency_s,
                           f"measured from {socket.gethostname()} over the {channel} channel, {s.rounds} round trips "
                           f"each: a call "
                           f"with a {s.frame_bytes} B frame and {PROBE_WORK_S * 1e3:g} ms of work, {s.frames_per_probe}-"
                           f"frame messages vs empty ones (empty round trip {s.empty_rtt_s * 1e3:.3f} ms), "
                           f"{time.strftime('%Y-%m-%d')}")
    return Links(links, frame_bytes=frame_bytes, source=f"{command} on {socket.gethostname()}")


def links_path(cfg: "LineConfig") -> Path:
    return Path(cfg.data_dir) / "links.json"


def describe_links(links: Links) -> list[str]:
    """One line per node, for the commands that measure them."""
    return [f"{node}: {l.latency_s * 1e3:.3f} ms per call, {l.bandwidth_bps * 8 / 1e9:.2f} Gb/s; a frame of "
            f"{links.frame_bytes} B costs {l.per_request(links.frame_bytes) * 1e3:.3f} ms on the link "
            f"({l.source})" for node, l in sorted(links.links.items())]


# -- expert sync -------------------------------------------------------------------------------------

class _StoreWriter:
    """On a node: which store files it has (by sha256 of the bytes), and taking a new set in one step.

    Files are staged under temp names of their own (a concurrent sync never
    writes into another's), flushed to disk, and renamed into place by
    `commit` under the store's own lock, the manifest last.  An `ExpertStore`
    opened on the node meanwhile (an actor starting mid-sync) therefore never
    sees a promoted file without the manifest that names it, which its sweep
    would take for a crash's leftover and delete.
    """

    STALE_S = 3600.0      # staged files a killed sync left: removed by the next sync after this long

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._staged: dict[str, Path] = {}
        now = time.time()
        for p in self.root.glob(".sync.*.part"):
            try:
                if now - p.stat().st_mtime > self.STALE_S:
                    p.unlink()
            except FileNotFoundError:
                pass

    def digests(self) -> dict[str, str]:
        out = {}
        for p in self.root.iterdir():
            if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".part"):
                out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
        return out

    def put(self, name: str, data: bytes, sha256: str) -> int:
        import uuid

        if "/" in name or name.startswith(".") or name in ("", ".."):
            raise ValueError(f"refusing store file name {name!r}")
        if hashlib.sha256(data).hexdigest() != sha256:
            raise ValueError(f"{name}: bytes arrived corrupted (sha256 mismatch)")
        tmp = self.root / f".sync.{name}.{uuid.uuid4().hex[:8]}.part"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        old = self._staged.pop(name, None)
        if old is not None:
            old.unlink(missing_ok=True)
        self._staged[name] = tmp
        return len(data)

    def commit(self) -> int:
        """Rename every staged file into place, the manifest last, under the store's lock; how many."""
        from coe.files import fsync_dir
        from storage.expert_store import MANIFEST, store_lock

        names = sorted(self._staged, key=lambda n: n == MANIFEST)
        with store_lock(self.root):
            for name in names:
                os.replace(self._staged.pop(name), self.root / name)
            fsync_dir(self.root)
        return len(names)

    def where(self) -> str:
        return socket.gethostname()


def _snapshot(src: Path, line: str, attempts: int = 5) -> tuple[bytes, dict[str, str]]:
    """The store's manifest bytes, and the sha256 of every file it names, read as one consistent set.

    A promotion may land while the files are hashed: the manifest is read
    before and after, and the set is read again until both agree (a file that
    went with a replaced version counts as a change too).  Files are hashed a
    block at a time, never held whole: a store may be gigabytes.  Files the
    manifest does not name (retired versions a running agent still serves,
    temp files) are the front box's business, not the nodes'.
    """
    import json

    from storage.expert_store import MANIFEST

    path = src / MANIFEST
    for _ in range(attempts):
        try:
            before = path.read_bytes()
        except FileNotFoundError:
            raise CoEError(f"experts sync: {src} has no {MANIFEST} (run `coe-agent zoo build --line {line}`)") from None
        try:
            raw = json.loads(before.decode("utf-8"))
            named = sorted({e["file"] for e in raw["experts"].values()} if isinstance(raw["experts"], dict)
                           else {e["file"] for e in raw["experts"]})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # a manifest this box cannot read must not be pushed to every node as if it were the store's
            raise CoEError(f"experts sync: {path} is unreadable ({exc}); nothing was sent "
                           f"(check it with `coe-agent experts verify --line {line}`)") from None
        files: dict[str, str] = {}
        try:
            for name in named:
                if "/" in name or name.startswith("."):
                    raise CoEError(f"experts sync: {path} names the file {name!r}, which is not in the store")
                files[name] = _sha256_file(src / name)
        except FileNotFoundError:
            continue                     # a version replaced under us: read the new set
        if path.read_bytes() == before:
            files[MANIFEST] = hashlib.sha256(before).hexdigest()
            return before, files
    raise CoEError(f"experts sync: {src} kept changing while it was read ({attempts} tries); try again")


def _sha256_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


class _Changed(Exception):
    """A file changed between the snapshot and its send: the sync starts again from a new snapshot."""


def sync_store(cfg: "LineConfig", nodes: list[str] | None = None, *, progress=lambda m: None,
               attempts: int = 3, within: float | None = None) -> dict[str, dict]:
    """Copy the front box's expert store to each node's own store (`cluster.stores`), file by file.

    Only files whose bytes differ are sent (sha256 on both sides).  What is
    sent is one consistent snapshot of the store (`_snapshot`; a file whose
    bytes changed by the time it is sent starts the sync again), and the
    node takes it in one step, the manifest last (`_StoreWriter.commit`), so a
    node's store is never ahead of its files and never a mix of two versions.
    Returns per node: files sent, bytes sent, files already there.  `within`:
    seconds the whole sync may take (a promotion holds the line's new frames
    while it is carried; a node that hangs must not hold them for 600 s a
    file): past it, a CoEError naming the node, and what was staged is dropped.
    """
    import ray

    want = sorted({ex.node for ex in cfg.executors if ex.node})
    nodes = nodes or want
    unknown = sorted(set(nodes) - set(want))
    if unknown:
        raise CoEError(f"experts sync: node '{unknown[0]}' runs no executor of line {cfg.line} "
                       f"(its nodes: {', '.join(want) or 'none'})")
    connect(cfg.cluster, nodes)
    src = Path(cfg.store_path)
    out = {}
    deadline = None if within is None else time.monotonic() + within

    def left(cap: float, node: str) -> float:
        if deadline is None:
            return cap
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CoEError(f"experts sync: node {node}: not done within {within:g} s")
        return min(cap, remaining)
    for node in nodes:
        dest = cfg.cluster.stores.get(node, str(src))
        for attempt in range(attempts):
            manifest, files = _snapshot(src, cfg.line)
            w = ray.remote(_StoreWriter).options(resources={node_resource(node): 0.001}, num_cpus=0).remote(dest)
            try:
                have = ray.get(w.digests.remote(), timeout=left(cfg.cluster.connect_timeout_s, node))
                sent = nbytes = 0
                for name, sha in files.items():
                    if have.get(name) == sha:
                        continue
                    data = manifest if name == "manifest.json" else (src / name).read_bytes()
                    if hashlib.sha256(data).hexdigest() != sha:
                        raise _Changed(name)
                    nbytes += ray.get(w.put.remote(name, data, sha), timeout=left(600, node))
                    sent += 1
                ray.get(w.commit.remote(), timeout=left(600, node))
                out[node] = {"store": dest, "sent": sent, "bytes": nbytes, "unchanged": len(files) - sent}
                progress(f"{node}: {sent} file(s) sent ({nbytes / 1e6:.1f} MB), {len(files) - sent} already there, "
                         f"store {dest}")
                break
            except (_Changed, FileNotFoundError) as exc:
                if attempt == attempts - 1:
                    raise CoEError(f"experts sync: {src} kept changing while it was sent to {node} ({exc}); "
                                   "try again") from None
                log.info("experts sync to %s: the store changed while it was sent (%s); starting again", node, exc)
            except ray.exceptions.RayError as exc:
                raise CoEError(f"experts sync: node {node} (store {dest}): {short_error(exc)}") from None
            finally:
                ray.kill(w)       # a sync that did not commit leaves staged files only (removed after an hour)
    return out


def status(agent) -> dict:
    """Nodes, their executors, residency and health: `coe-agent cluster status` and /api/cluster."""
    remote = [e for e in agent.executors if hasattr(e, "node")]
    try:
        nodes = cluster_nodes()
    except Exception as exc:  # noqa: BLE001 - the operator view must answer even when Ray does not
        nodes = {"?": {"alive": False, "error": str(exc)}}
    local = [{"name": e.name, "node": "(front)", "device": e.device, "state": "up" if e.alive() else "dead",
              "up": e.alive(), "resident": sorted(agent.pools[e.name].resident()),
              "resident_bytes": agent.pools[e.name].stats().resident_bytes,
              "capacity": agent.pools[e.name].capacity} for e in agent.executors if not hasattr(e, "node")]
    return {"line": agent.cfg.line, "address": agent.cfg.cluster.address if agent.cfg.cluster else None,
            "nodes": nodes, "executors": local + [e.status() for e in remote],
            "scheduler_active": agent.scheduler.active()}


class StatusFile:
    """Writes `status(agent)` to {data_dir}/cluster-status.json every `interval` s while the agent runs, so
    `coe-agent cluster status` (another process) shows what this agent sees: its executors' residency and state."""

    def __init__(self, agent, interval: float = 1.0) -> None:
        import threading

        self.agent, self.interval = agent, interval
        self.path = Path(agent.cfg.data_dir) / "cluster-status.json"
        self.last: dict | None = None   # the document last written (the status page reads it, not Ray again)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cluster-status", daemon=True)

    def start(self) -> "StatusFile":
        self.write()
        self._thread.start()
        return self

    def write(self) -> None:
        import json

        doc = {**status(self.agent), "written_at": time.time()}
        self.last = json.loads(json.dumps(doc, default=str))   # JSON-safe, as the file holds it
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(self.path)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.write()
            except Exception:  # noqa: BLE001 - the operator file must not take the agent down
                log.exception("writing %s failed", self.path)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self.write()
        except Exception:  # noqa: BLE001
            log.exception("writing %s failed", self.path)
