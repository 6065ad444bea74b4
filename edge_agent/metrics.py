"""Prometheus metrics of one agent, on a registry of its own (no global state).

They are served, with the status page, by `edge_agent.status_server` on the
metrics port; the status page samples the same registry, so the two agree.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)


class Metrics:
    def __init__(self, line: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, {"line": line}
        self.frames_received = Counter("coe_frames_received", "Frames received on ingest", ["line"], registry=r).labels(**lab)
        self.frames_accepted = Counter("coe_frames_accepted", "Frames journaled and acked accepted", ["line"], registry=r).labels(**lab)
        self.duplicates = Counter("coe_frames_duplicate", "Frames acked duplicate (already accepted)", ["line"], registry=r).labels(**lab)
        self._rejects = Counter("coe_frames_rejected", "Frames rejected, by reason", ["line", "reason"], registry=r)
        self._verdicts = Counter("coe_verdicts", "Verdicts stored, by kind", ["line", "verdict"], registry=r)
        self.queue_depth = Gauge("coe_queue_depth", "Requests queued for executors", ["line"], registry=r).labels(**lab)
        self.inflight = Gauge("coe_frames_inflight", "Accepted frames without a verdict", ["line"], registry=r).labels(**lab)
        self._loads = Counter("coe_expert_loads", "Expert loads into a tier", ["line", "tier"], registry=r)
        self._evictions = Counter("coe_expert_evictions", "Expert evictions from a tier", ["line", "tier"], registry=r)
        self._load_seconds = Counter("coe_expert_load_seconds", "Seconds spent loading experts", ["line", "tier"], registry=r)
        self.batch_size = Histogram("coe_batch_size", "Requests per executed batch", ["line"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r).labels(**lab)
        self.frame_latency = Histogram("coe_frame_latency_seconds", "Receive-to-verdict latency", ["line"],
                                       buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r).labels(**lab)
        self.line = line
        self._bad_seconds_logged = False

    def reject(self, reason: str) -> None:
        self._rejects.labels(self.line, reason).inc()

    def verdict(self, kind: str) -> None:
        self._verdicts.labels(self.line, kind).inc()

    def expert_event(self, tier: str, event: str, seconds: float) -> None:
        """Count a pool's load or eviction.  `seconds` may come from another node's report: one that is not a
        finite number >= 0 is left out of `coe_expert_load_seconds` (logged once), since the counter would
        raise on a negative one, in the thread that applies the report, and keep a NaN or inf for good."""
        if event == "load":
            self._loads.labels(self.line, tier).inc()
            ok = isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
            if ok and math.isfinite(seconds) and seconds >= 0:
                self._load_seconds.labels(self.line, tier).inc(seconds)
            elif not self._bad_seconds_logged:
                self._bad_seconds_logged = True
                log.warning("a %s load reported %s seconds: not counted in coe_expert_load_seconds (logged once)",
                            tier, repr(seconds)[:40])
        elif event == "evict":
            self._evictions.labels(self.line, tier).inc()

    def watch_flow(self, *, inflight: Callable[[], float], queue_depth: Callable[[], float]) -> None:
        """Read `coe_frames_inflight` and `coe_queue_depth` at scrape time from these callables.

        Set by hand, the gauges only moved when someone remembered to set them
        (ingest, on each message), so a line that stopped sending froze them at
        whatever they were; read at scrape time they are always current.  Once
        watched, `.set()` on them is ignored.
        """
        self.inflight.set_function(inflight)
        self.queue_depth.set_function(queue_depth)

    def watch_pools(self, pools) -> None:
        """Export every tier pool's counters at scrape time (`pools()` -> {name: Pool})."""
        self.registry.register(_PoolCollector(self.line, pools))


class _PoolCollector:
    """Reads pool stats when Prometheus scrapes, so the hot path pays nothing."""

    def __init__(self, line: str, pools) -> None:
        self.line, self.pools = line, pools

    def describe(self):
        return []

    def collect(self):
        labels = ["line", "pool"]
        fams = {
            "hits": CounterMetricFamily("coe_pool_hits", "Acquires served from the tier", labels=labels),
            "misses": CounterMetricFamily("coe_pool_misses", "Acquires that loaded into the tier", labels=labels),
            "switches": CounterMetricFamily("coe_pool_switches", "Expert switches (loads) into the tier",
                                            labels=labels),
            "evictions": CounterMetricFamily("coe_pool_evictions", "Evictions from the tier", labels=labels),
            "declined": CounterMetricFamily("coe_pool_declined", "Victims handed down that a full tier turned away "
                                            "as ranked below what they would push out (host_tier_admission)",
                                            labels=labels),
            "load_seconds": CounterMetricFamily("coe_pool_load_seconds", "Seconds loading into the tier",
                                                labels=labels),
            "resident_bytes": GaugeMetricFamily("coe_pool_resident_bytes", "Bytes resident", labels=labels),
            "capacity": GaugeMetricFamily("coe_pool_capacity_bytes", "Byte budget", labels=labels),
        }
        for name, pool in self.pools().items():
            s = pool.stats()
            for key, fam in fams.items():
                fam.add_metric([self.line, name], float(getattr(s, key)))
        yield from fams.values()
