"""SSD read-ahead into the exclusive host tier: the shared SSD never idles while queued work needs it.

Why.  On an SSD-bound line the SSD is the one resource every executor's
switches queue for, and a switch reads only when its batch comes up (or,
with the executor's prefetch, one group before).  Between those reads the
SSD idles while queued groups further back still need experts that no tier
holds; those reads then land later, serially, and the run ends with the
SSD's backlog.  In the simulator on the GPU-class profile, before this
module, the SSD idled 9.4 s of A1's 48.0 s (`coe-agent bench --sim -w A1` at
commit 20a1c4e: its makespan less its "SSD s" column).

What.  While no demand read is under way (`storage.disk_activity`), read the
expert of the earliest queued group behind a queue's head (breadth-first over
the executors' queues: every queue's second group, then every third, ...)
that no pool and no tier holds or is loading, into the host tier.  The host tier is a victim
cache (exclusive), so this moves nothing out of a GPU or CPU pool; its own
policy makes room as for any admission, and no queued group's expert is a
victim (reading one queued expert in by pushing another out gains nothing).
When the group's batch comes, its switch is a host copy instead of an SSD
read.  Only experts that the executor they are queued on takes from
the host tier are read (a GPU always; a CPU executor where it copies the host
tier's copy, `usable_from_host`).  A read-ahead is never waited for: it starts
only when the SSD is free, and an expert whose read fails is skipped for
RETRY_SECONDS (the executor meets the same failure and reports it against its
frames).

The thread waits on the disk counter while executors read, so it starts the
moment their reads end, and polls the queues every POLL_SECONDS otherwise;
the simulator reacts at once.

`next_read_ahead` is the policy (a pure function of the queues and what is
held); `ReadAhead` is the mechanism (a thread).  The simulator runs the same
policy (`executors.simdevice`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from storage.pool import PoolFullError

log = logging.getLogger(__name__)

POLL_SECONDS = 0.005    # how often an idle read-ahead looks at the queues again (the simulator reacts at once)
RETRY_SECONDS = 60.0    # an expert whose read failed is not read ahead again for this long
JOIN_SECONDS = 10.0     # how long close() waits for a read under way to end


def next_read_ahead(queues: Sequence[Sequence[str]], held: Callable[[str], bool],
                    skip: Callable[[str], bool] = lambda _e: False,
                    usable: Sequence[Callable[[str], bool]] | None = None) -> str | None:
    """The expert to read ahead: the first, breadth-first over `queues` (each in the order its groups will
    run) behind each queue's head, that queue's executor takes from the host tier (`usable[i]`, default:
    any), and that is not `held` (in a pool or tier, or loading) nor to `skip`; None if there is none.

    Each queue's head is left to its executor: its load is the executor's next one anyway, and on a line
    a read-ahead of it mostly takes the SSD just before the executor's own read would.  Measured
    (`python bench/sim_shapes.py`, eleven boards): leaving the heads out, p99 at F = 0.8 was lower on 7
    boards and higher on 3 than reading from the heads on, with the same flood throughput on 10.
    """
    for depth in range(1, max((len(q) for q in queues), default=0)):
        for i, q in enumerate(queues):
            if depth < len(q):
                e = q[depth]
                if (usable is None or usable[i](e)) and not held(e) and not skip(e):
                    return e
    return None


@dataclass
class ReadAheadStats:
    read: int = 0          # experts read into the host tier ahead of their batch
    no_room: int = 0       # candidates the host tier could not make room for (pinned experts)
    failed: int = 0        # reads that raised (the expert is skipped for RETRY_SECONDS)
    too_big: int = 0       # candidates larger than the whole host tier (never tried again)


def usable_from_host(info) -> Callable[[str], bool]:
    """Whether an executor (its `executors.costs.ExecutorInfo`) takes an expert from the host tier: a GPU
    always (it promotes from it); a CPU executor only where it copies the host tier's copy (`host_reads`:
    True, or a predicate, e.g. only where both hold one dtype).  A read-ahead for any other is wasted."""
    if info.device_kind == "cuda":
        return lambda _e: True
    reads = info.host_reads
    return reads if callable(reads) else (lambda _e: bool(reads))


def scheduler_note(scheduler, costs, executors: Sequence[str]) -> Callable[[str], contextlib.AbstractContextManager]:
    """`ReadAhead`'s `note` for the agent and real runs: each read counts in `scheduler`'s SSD backlog
    (`Scheduler.reading`) for the fastest SSD load of the expert among `executors` by the cost model, which
    is how the simulator prices a read-ahead.  Without it the scheduler sees only its batches' reads, and
    predicts a switch issued during a read-ahead as if the SSD were free."""
    channel = scheduler.channel(executors[0]) if executors else ""   # the local executors' SSD

    def note(expert_id: str) -> contextlib.AbstractContextManager:
        try:
            seconds = min(costs.load_seconds(n, expert_id, "ssd") for n in executors)
        except Exception:  # noqa: BLE001 - an expert the cost model cannot price: the read still happens
            log.debug("no SSD price for read-ahead of %s", expert_id, exc_info=True)
            return contextlib.nullcontext()
        if not (math.isfinite(seconds) and seconds >= 0):   # not a price: the read still happens, uncounted
            return contextlib.nullcontext()
        return scheduler.reading(seconds, channel)
    return note


class ReadAhead:
    """The thread: `queues()` gives (executor, its queued groups' experts in run order) for each local
    executor; `usable(executor, expert)` says whether that executor takes the expert from the host tier;
    `pools` are the pools and tiers whose residents count as held; `host` is the exclusive host tier it
    reads into."""

    def __init__(self, queues: Callable[[], list[tuple[str, list[str]]]], usable: Callable[[str, str], bool],
                 pools: Callable[[], list], host, activity, *, poll: float = POLL_SECONDS,
                 note: Callable[[str], contextlib.AbstractContextManager] | None = None) -> None:
        self._queues, self._usable, self._pools = queues, usable, pools
        # around each read: tells the scheduler a read is under way, so the switches it predicts meanwhile wait
        # behind it as they will on the SSD (`Scheduler.reading`); the expert's id goes in
        self._note = note or (lambda _e: contextlib.nullcontext())
        self.host, self.activity, self._poll = host, activity, poll
        self.stats = ReadAheadStats()
        self._failed: dict[str, float] = {}    # expert -> when its read failed (tried again after RETRY_SECONDS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ssd-read-ahead", daemon=True)

    def start(self) -> "ReadAhead":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; one still running after JOIN_SECONDS (a read stuck on the SSD) is logged, not waited
        for: it is a daemon, and `alive()` lets the agent count it among the threads that did not stop."""
        self._stop.set()
        self._thread.join(JOIN_SECONDS)
        if self._thread.is_alive():
            log.error("read-ahead thread still running %.0f s after close (a read stuck on the SSD?); left behind",
                      JOIN_SECONDS)

    def alive(self) -> bool:
        """Whether the thread runs (after `close`: it did not stop)."""
        return self._thread.is_alive()

    def held(self, expert_id: str) -> bool:
        return self.host.present(expert_id) or any(p.present(expert_id) for p in self._pools())

    def step(self) -> str | None:
        """One decision and, when the SSD is free, one read.  Returns the expert read in, or None."""
        if self.activity.busy():
            return None
        named = self._queues()
        now = time.monotonic()
        eid = next_read_ahead([q for _, q in named], self.held,
                              lambda e: e in self._failed and now - self._failed[e] < RETRY_SECONDS,
                              [lambda e, n=n: self._usable(n, e) for n, _ in named])
        if eid is None:
            return None
        try:
            with self.activity.ahead(), self._note(eid):   # never pushes out a queued expert to read in another
                handle = self.host.acquire(eid, keep={e for _, q in named for e in q})
        except PoolFullError:               # larger than the whole host tier: its executor reads it itself
            self._failed[eid] = float("inf")
            self.stats.too_big += 1
            return None
        except Exception as exc:  # noqa: BLE001 - the executor that needs it reports it against its frames
            self._failed[eid] = now         # a fixed file or a passing I/O error: tried again later
            self.stats.failed += 1
            log.debug("read-ahead of %s failed: %r", eid, exc)
            return None
        if handle is None:
            self.stats.no_room += 1
            return None
        self.host.release(handle)
        self.stats.read += 1
        return eid

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                eid = self.step()
            except Exception:  # noqa: BLE001 - a read-ahead must never take the agent down
                log.exception("read-ahead step failed")
                eid = None
            if eid is not None:
                continue
            if self.activity.busy():   # woken the moment the executors' reads end, as the simulator assumes
                self.activity.wait_idle(self._poll)
            else:                      # nothing to read now: look again at the next poll
                self._stop.wait(self._poll)
