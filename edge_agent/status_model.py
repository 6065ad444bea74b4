"""What the status page shows, kept as the agent runs: bookkeeping only, no HTTP, no SQL.

The agent calls a few cheap hooks on its hot paths (a batch ran, verdicts
committed, a pool loaded or evicted, a defect was decided); each is one append
to a bounded deque.  Everything else is read when it is asked for:

- counters come from the agent's own Prometheus registry, sampled once a
  second by `tick()` (so the page and `/metrics` always tell the same story,
  and rates are deltas of the same counters a Prometheus server would rate);
- pools, queues and health are read from the agent through `StatusSources`;
- `snapshot_bytes()` builds the whole document once per sample (and at most
  once per `min_interval` between samples), so any number of open pages cost
  one build a second, not one per viewer.

Nothing here grows without bound: latencies and batches keep the last
`window_s`, counter samples the last `history_s`, the pool timeline and the
defects a fixed number of entries.  The clock is injected for tests.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from storage.pool import Pool, PoolEvent

RATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class Health:
    """Whether the agent can take frames now, and why not.  Warnings do not make it unready."""

    ready: bool
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    inflight: int = 0
    max_inflight: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StatusSources:
    """What the model reads from the agent, as callables, so it never reaches into the agent's fields."""

    line: str
    registry: "CollectorRegistry"
    pools: Callable[[], dict[str, "Pool"]]                 # pool name -> Pool (executor pools, then 'host')
    queue_depths: Callable[[], dict[str, int]]             # executor -> queued requests
    executors: dict[str, str]                              # executor -> device
    health: Callable[[], Health]
    llm_experts: frozenset[str] | None = None              # the LLM's expert ids, when an llm: section is set
    llm_model: str | None = None
    # a line with executors on other boxes: the nodes, their executors, residency and health, as
    # `coe-agent cluster status` shows them (edge_agent.cluster.status); None on one box
    cluster: Callable[[], dict | None] | None = None


@dataclass(frozen=True)
class DefectEntry:
    """A defect as the page lists it: where, why, the chain with each step's output and expert version."""

    frame_id: str
    board_id: str
    component: str
    reason: str
    decided_at: float
    steps: list[dict]          # [{expert_id, output, version}], in chain order
    thumbnail: bool


@dataclass(frozen=True)
class _Sample:
    at: float
    values: dict[str, float]


def _counter_values(registry: "CollectorRegistry") -> dict[str, float]:
    """Every `_total` and gauge sample of the registry as 'name' or 'name{label=value}' (the line label dropped)."""
    out: dict[str, float] = {}
    for fam in registry.collect():
        if fam.type not in ("counter", "gauge"):
            continue
        for s in fam.samples:
            if fam.type == "counter" and not s.name.endswith("_total"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "line")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class StatusModel:
    """The live state behind the status page; hooks from any thread, `snapshot()` from the HTTP threads."""

    def __init__(self, sources: StatusSources, *, clock: Callable[[], float] = time.time,
                 window_s: float = 60.0, history_s: float = 120.0, timeline: int = 400, defects: int = 24,
                 min_interval: float = 1.0) -> None:
        self.src = sources
        self.clock = clock
        self.window_s, self.history_s, self.min_interval = window_s, history_s, min_interval
        self._lock = threading.Lock()
        self._latency: deque[tuple[float, float]] = deque(maxlen=200_000)   # (decided_at, seconds)
        self._batches: deque[tuple[float, str, int]] = deque(maxlen=50_000)  # (at, executor, size)
        self._events: deque[dict] = deque(maxlen=timeline)
        self._pending: dict[str, DefectEntry] = {}
        self._defects: deque[DefectEntry] = deque(maxlen=defects)
        self._errors: Counter[str] = Counter()
        self._samples: deque[_Sample] = deque(maxlen=int(history_s) + 10)
        self.tokens = 0
        self.started_at = clock()
        self._cached: tuple[int, float, bytes] | None = None   # (version, built at, document)
        self._build = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.version = 0                       # bumped by every tick: SSE clients wait for the next one
        self._ticked = threading.Condition()

    # -- hooks (hot path: one append each) ----------------------------------------------
    def batch(self, executor: str, size: int) -> None:
        at = self.clock()
        with self._lock:
            self._batches.append((at, executor, size))

    def verdicts(self, latencies_s: list[float]) -> None:
        now = self.clock()
        with self._lock:
            self._latency.extend((now, s) for s in latencies_s)

    def pool_event(self, pool: str, e: "PoolEvent") -> None:
        row = {"at": e.at, "pool": pool, "tier": e.tier, "event": e.event, "expert_id": e.expert_id,
               "nbytes": e.nbytes, "seconds": round(e.seconds, 4)}
        with self._lock:
            self._events.append(row)

    def error(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self._errors[kind] += n

    def token(self, n: int = 1) -> None:
        self.tokens += n

    def defect(self, entry: DefectEntry) -> None:
        """A defect decided; it is listed once its verdict commits (`committed`), so its row and thumbnail exist."""
        with self._lock:
            if len(self._pending) >= 4096:      # commits stalled: keep memory bounded, lose only page entries
                self._pending.pop(next(iter(self._pending)))
            self._pending[entry.frame_id] = entry

    def committed(self, frame_ids: list[str], stored: set[str]) -> None:
        with self._lock:
            for fid in frame_ids:
                entry = self._pending.pop(fid, None)
                if entry is not None and fid in stored:
                    self._defects.appendleft(entry)

    # -- sampling -------------------------------------------------------------------------
    def tick(self) -> None:
        """Sample the counters (once a second from `start()`'s thread, or by hand in tests)."""
        values = _counter_values(self.src.registry)
        values["tokens"] = float(self.tokens)
        with self._ticked:
            self._samples.append(_Sample(self.clock(), values))
            self.version += 1
            self._ticked.notify_all()

    def wait_tick(self, version: int, timeout: float) -> int:
        """Block until a tick newer than `version` (or the timeout); returns the current version."""
        with self._ticked:
            self._ticked.wait_for(lambda: self.version != version or self._stop.is_set(), timeout)
            return self.version

    def start(self, interval: float = 1.0) -> "StatusModel":
        self.tick()

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - a failed sample leaves a gap in the page, never stops the agent
                    import logging

                    logging.getLogger(__name__).exception("status sample failed")
        self._thread = threading.Thread(target=loop, name="status-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._ticked:
            self._ticked.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # -- reading ----------------------------------------------------------------------------
    def snapshot_bytes(self) -> bytes:
        """The status document as JSON bytes, built once per sample (`version`) for every viewer.

        Keyed on the sample, not on the time of the last build: an event stream
        woken by a new tick must get a document with that tick in it, even when
        another viewer's poll built one a moment before the tick.  Between
        ticks it is still rebuilt once `min_interval` has passed, so health and
        `at` stay current when nothing samples (a stopped sampler, tests).
        """
        with self._build:
            now, version = self.clock(), self.version
            cached = self._cached
            if cached is None or cached[0] != version or now - cached[1] >= self.min_interval:
                cached = self._cached = (version, now, json.dumps(self.snapshot(), separators=(",", ":")).encode())
            return cached[2]

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        samples = list(self._samples)
        last = samples[-1].values if samples else {}
        health = self.src.health()
        return {
            "line": self.src.line, "at": now, "uptime_s": round(now - self.started_at, 1),
            "health": health.to_json(),
            "flow": self._flow(samples, last, health.inflight),
            "history": self._history(samples),
            "latency": self._latency_stats(now),
            "executors": self._executors(now),
            "pools": self.pools(),
            "timeline": self.timeline(),
            "defects": [asdict(d) for d in self._copy(self._defects)],
            "errors": self._error_counts(last),
            "llm": self._llm(samples),
            "cluster": self.cluster(),
        }

    def cluster(self) -> dict | None:
        """The line's boxes (None on one box): nodes with their health, and every executor with its node,
        state, residency and losses, from the agent's live view."""
        return self.src.cluster() if self.src.cluster is not None else None

    def _flow(self, samples: list[_Sample], last: dict[str, float], inflight: int) -> dict:
        rate = lambda key: _rate(samples, key)  # noqa: E731
        rejects = {k.split("reason=", 1)[1].rstrip("}"): int(v) for k, v in last.items()
                   if k.startswith("coe_frames_rejected_total{")}
        verdicts = {k.split("verdict=", 1)[1].rstrip("}"): int(v) for k, v in last.items()
                    if k.startswith("coe_verdicts_total{")}
        return {
            "line_rate": rate("coe_frames_received_total"),          # everything the line sent
            "in_rate": rate("coe_frames_accepted_total"),            # journaled and acked accepted
            "out_rate": _rate_sum(samples, "coe_verdicts_total{"),   # verdicts committed
            "received": int(last.get("coe_frames_received_total", 0)),
            "accepted": int(last.get("coe_frames_accepted_total", 0)),
            "duplicate": int(last.get("coe_frames_duplicate_total", 0)),
            "rejected": rejects,
            "verdicts": verdicts,
            "inflight": inflight,                                    # accepted, verdict not yet committed
        }

    def _history(self, samples: list[_Sample]) -> dict:
        """Per-sample rates over the last `history_s`, for the sparklines."""
        keys = {"line": ("coe_frames_received_total",), "in": ("coe_frames_accepted_total",),
                "out": tuple(k for k in (samples[-1].values if samples else {}) if k.startswith("coe_verdicts_total{"))}
        out: dict[str, list] = {"t": [], **{k: [] for k in keys}}
        for a, b in zip(samples, samples[1:]):
            dt = b.at - a.at
            if dt <= 0:
                continue
            out["t"].append(round(b.at, 2))
            for name, ks in keys.items():
                out[name].append(round(sum(b.values.get(k, 0) - a.values.get(k, 0) for k in ks) / dt, 2))
        return out

    def _latency_stats(self, now: float) -> dict:
        cut = now - self.window_s
        with self._lock:
            while self._latency and self._latency[0][0] < cut:   # trim what fell out of the window
                self._latency.popleft()
            lat = np.fromiter((s for _, s in self._latency), dtype=float, count=len(self._latency))
        if not lat.size:
            return {"window_s": self.window_s, "count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
        p50, p99 = np.percentile(lat, [50, 99])
        return {"window_s": self.window_s, "count": int(lat.size), "p50_ms": round(1000 * p50, 1),
                "p99_ms": round(1000 * p99, 1), "max_ms": round(1000 * float(lat.max()), 1)}

    def _executors(self, now: float) -> list[dict]:
        cut = now - self.window_s
        depths = self.src.queue_depths()
        sizes: dict[str, list[int]] = {name: [] for name in self.src.executors}
        for at, ex, n in self._copy(self._batches):
            if at >= cut:
                sizes.setdefault(ex, []).append(n)
        out = []
        for name, device in self.src.executors.items():
            s = sizes.get(name, [])
            out.append({"name": name, "device": device, "queued": depths.get(name, 0), "batches": len(s),
                        "mean_batch": round(sum(s) / len(s), 2) if s else None, "max_batch": max(s) if s else None,
                        "last_batch": s[-1] if s else None,
                        "batch_sizes": _histogram(s)})
        return out

    def pools(self) -> list[dict]:
        """Every tier pool: who is resident (LLM experts marked), bytes against capacity, hits, loads, evictions."""
        llm = self.src.llm_experts or frozenset()
        out = []
        for name, pool in self.src.pools().items():
            st = pool.stats()
            state = pool.state()
            residents = sorted(state.residents, key=lambda r: -r.used_seq)
            n = st.hits + st.misses
            out.append({
                "name": name, "tier": pool.tier, "capacity": st.capacity, "resident_bytes": st.resident_bytes,
                "hits": st.hits, "misses": st.misses, "evictions": st.evictions, "admits": st.admits,
                "declined": st.declined,
                "hit_rate": round(st.hits / n, 4) if n else None, "load_seconds": round(st.load_seconds, 3),
                "residents": [{"expert_id": r.expert_id, "nbytes": r.nbytes, "pinned": r.pinned,
                               "llm": r.expert_id in llm} for r in residents],
            })
        return out

    def timeline(self, n: int = 200) -> list[dict]:
        """The last `n` loads, evictions and admits, oldest first."""
        return self._copy(self._events)[-n:]

    def _copy(self, d: deque) -> list:
        with self._lock:
            return list(d)

    def _error_counts(self, last: dict[str, float]) -> dict[str, int]:
        """Errors by kind since start, named as in the errors table (rejects are 'reject:<reason>')."""
        with self._lock:
            out = dict(self._errors)
        for k, v in last.items():
            if k.startswith("coe_frames_rejected_total{") and v:
                out["reject:" + k.split("reason=", 1)[1].rstrip("}")] = int(v)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _llm(self, samples: list[_Sample]) -> dict | None:
        if self.src.llm_experts is None:
            return None
        resident = set()
        nbytes = 0
        for p in self.src.pools().values():
            for r in p.state().residents:
                if r.expert_id in self.src.llm_experts and r.expert_id not in resident:
                    resident.add(r.expert_id)
                    nbytes += r.nbytes
        return {"model": self.src.llm_model, "tokens": self.tokens, "tokens_per_s": _rate(samples, "tokens"),
                "experts": len(self.src.llm_experts), "resident": len(resident), "resident_bytes": nbytes}


def _rate(samples: list[_Sample], key: str) -> float:
    return _rate_sum(samples, key, exact=True)


def _rate_sum(samples: list[_Sample], prefix: str, *, exact: bool = False) -> float:
    """Per-second increase of a counter (or of every counter starting with `prefix`) over the last few seconds."""
    if len(samples) < 2:
        return 0.0
    last = samples[-1]
    base = next((s for s in reversed(samples[:-1]) if last.at - s.at >= RATE_WINDOW_S), samples[0])
    dt = last.at - base.at
    if dt <= 0:
        return 0.0
    pick = (lambda vals: vals.get(prefix, 0.0)) if exact else \
        (lambda vals: sum(v for k, v in vals.items() if k.startswith(prefix)))
    return round(max(0.0, pick(last.values) - pick(base.values)) / dt, 2)


def _histogram(sizes: list[int]) -> dict[str, int]:
    """Batch sizes in power-of-two buckets ('1', '2-3', '4-7', ...), for the executor cards."""
    out: Counter[str] = Counter()
    for n in sizes:
        lo = 1 << (max(n, 1).bit_length() - 1)
        out[str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"] += 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0].split("-")[0])))
