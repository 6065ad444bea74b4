"""SSD read-ahead into the exclusive host tier: the shared SSD never idles while queued work needs it.

Why.  On an SSD-bound line the SSD is the one resource every executor's
switches queue for, and a switch reads only when its batch comes up (or,
with the executor's prefetch, one group before).  Between those reads the
SSD idles while queued groups further back still need experts that no tier
holds; those reads then land later, serially, and the run ends with the
SSD's backlog.  In the simulator on the GPU-class profile the SSD idled about
9 s of A1's 48 s (`coe-agent bench --sim -w A1 --policies coserve,-readahead`).

What.  While no demand read is under way (`storage.disk_activity`), read the
expert of the earliest queued group (breadth-first over the executors'
queues: every queue's first group, then every second, ...) that no pool and
no tier holds or is loading, into the host tier.  The host tier is a victim
cache (exclusive), so this moves nothing out of a GPU or CPU pool; its own
policy makes room as for any admission, and no queued group's expert is a
victim (reading one queued expert in by pushing another out gains nothing).  When the group's batch comes, its switch is a host copy instead of
an SSD read.  A read-ahead is never waited for: it starts only when the SSD
is free, and an expert whose read fails is skipped from then on (the
executor meets the same failure and reports it against its frames).

`next_read_ahead` is the policy (a pure function of the queues and what is
held); `ReadAhead` is the mechanism (a thread).  The simulator runs the same
policy (`executors.simdevice`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from storage.pool import PoolFullError

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02     # how often an idle read-ahead looks at the queues again


def next_read_ahead(queues: Sequence[Sequence[str]], held: Callable[[str], bool],
                    skip: Callable[[str], bool] = lambda _e: False) -> str | None:
    """The expert to read ahead: the first, breadth-first over `queues` (each in the order its groups will
    run), that is not `held` (in a pool or tier, or loading) nor to `skip`; None if there is none."""
    for depth in range(max((len(q) for q in queues), default=0)):
        for q in queues:
            if depth < len(q):
                e = q[depth]
                if not held(e) and not skip(e):
                    return e
    return None


@dataclass
class ReadAheadStats:
    read: int = 0          # experts read into the host tier ahead of their batch
    no_room: int = 0       # candidates the host tier could not make room for (pinned experts)
    failed: int = 0        # reads that raised (the expert is skipped from then on)
    too_big: int = 0       # candidates larger than the whole host tier (skipped from then on)


class ReadAhead:
    """The thread: `queues()` gives each local executor's queued experts in run order; `pools` are the
    pools and tiers whose residents count as held; `host` is the exclusive host tier it reads into."""

    def __init__(self, queues: Callable[[], list[list[str]]], pools: Callable[[], list], host, activity, *,
                 poll: float = POLL_SECONDS) -> None:
        self._queues, self._pools, self.host, self.activity, self._poll = queues, pools, host, activity, poll
        self.stats = ReadAheadStats()
        self._failed: set[str] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ssd-read-ahead", daemon=True)

    def start(self) -> "ReadAhead":
        self._thread.start()
        return self

    def poke(self) -> None:
        """Something was queued or a read ended: look again now instead of at the next poll."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10)

    def held(self, expert_id: str) -> bool:
        return self.host.present(expert_id) or any(p.present(expert_id) for p in self._pools())

    def step(self) -> str | None:
        """One decision and, when the SSD is free, one read.  Returns the expert read in, or None."""
        if self.activity.busy():
            return None
        queues = self._queues()
        eid = next_read_ahead(queues, self.held, self._failed.__contains__)
        if eid is None:
            return None
        try:
            with self.activity.ahead():     # never pushes out a queued expert to read in another
                handle = self.host.acquire(eid, keep={e for q in queues for e in q})
        except PoolFullError:               # larger than the whole host tier: its executor reads it itself
            self._failed.add(eid)
            self.stats.too_big += 1
            return None
        except Exception as exc:  # noqa: BLE001 - the executor that needs it reports it against its frames
            self._failed.add(eid)
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
            if eid is None:            # nothing to do now: wait for a poke or the next poll
                self._wake.wait(self._poll)
                self._wake.clear()
