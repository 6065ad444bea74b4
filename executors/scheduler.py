"""Request scheduling onto executor queues (CoServe paper §4.2, DESIGN.md §4).

One `Scheduler` class runs every policy, so the baselines and ablations use the
same code as CoServe:

- assigning: `cost` puts a request on the queue that minimises the maximum
  predicted queue time over all executors (ties: the smallest added latency),
  where adding a request costs K (joining a batch) or K+B (starting one) plus
  the switch latency (0 if the expert is resident there, loading there or
  already queued there, else the load time from the tier where it lives);
  `round-robin` cycles; `affinity` prefers an executor that holds or queues
  the expert.
- shared-SSD awareness (`coserve`, not `coserve-paper`): the SSD is one
  channel that every executor's switches queue for, so it is one more
  resource in the min-max: the objective is the larger of the executors'
  predicted queue times and the SSD's predicted backlog (reads under way plus
  the SSD switches of every queued group).  A makespan is at least every
  resource's backlog, so the weight of the SSD term is 1, derived, not fitted.
  A predicted SSD switch also waits behind the reads already under way.
  With executors on several boxes (issue 15) each box has its own SSD: the
  cost model names each executor's channel (`ssd_channel`), and the backlog
  and the wait are per channel.  One box, one channel: the rule above.
- work awareness (`coserve`): the min-max is blind to work added below the
  maximum, so a request whose group waits on the busiest queue went to a
  switch elsewhere to save K on the max, paying a whole load.  Every queued
  second is run by some executor (and stealing spreads the tail), so each
  candidate's objective also carries what it adds to the executors' mean
  time: added / n executors.  The weight 1/n is that mean's, not fitted.
  With several boxes, each with its own SSD, the SSD max is blind the same
  way to a read on a less busy box's SSD, so an SSD read also carries
  ssd / n SSDs (with one SSD the max is the mean, and nothing is added).
- work stealing (`coserve`): an executor that runs dry takes a waiting group
  that would finish sooner on it, its switch there included; SSD-aware, the
  SSD seconds the move adds are charged once more (see `_steal`).
- arranging: a request goes right behind the last queued request for the same
  expert (`arrange=True`); otherwise arrival order, and only neighbours batch.
- hold (`coserve`, with fill): while the head's expert still loads, nothing
  fills and the queue holds at most `max_wait` of predicted work, the
  executor waits for the load, or for a filler to arrive, instead of taking
  the head and blocking on the load (`_hold`).
- frames in progress first (`coserve`, policy `followups`): a frame's later
  step (a detector after its classifier) that starts a new group goes right
  behind the queue's head (behind the earlier such groups), not at the end.
  Its frame has already waited through its first step; at the end of the
  queue it waited again behind the first steps of frames that arrived after
  it, which made most of a line's slowest frames.  A later step that finds
  its expert's group joins it where it is.  The head is never passed, and a
  group's predicted wait (the age bound's start) is the time ahead of where
  it goes.
- splitting: a batch is capped at the cost model's max batch, which is
  min(profiled max batch, what fits in free memory now) when `split=True`.
- age bound: a request that has waited `max_wait` longer than the wait the
  scheduler predicted when it queued it is served next, whatever its group
  (`aged` counts how often that fired), so a hot head group cannot starve the
  rest of a queue under a continuous stream.  At a sustainable rate the
  predicted wait is near 0 and the bound is `max_wait` itself; under a flood,
  where no request can start within `max_wait`, it fires only for requests
  that later arrivals overtook, so it does not turn grouping into FIFO.

Executors that come and go (remote executors, issue 15): `retire` takes one
out of assignment and hands back its queue, `finished(batch, lost=True)` a
batch lost with it, and `requeue` assigns them again with their original due
times (so the age bound holds across a loss), giving up a request whose batch
was lost `max_lost` times.  A request lost once runs alone from then on (a
batch of one), so only the frame that kills its executor is given up, not its
batch mates.  With every executor retired, requests wait in the scheduler
until `restore`.

Predictions follow what runs: each queued group carries its predicted cost
(switch + K*n + B*ceil(n/cap) with the splitter's real cap), a batch handed to
an executor stays in its queue's estimate until `finished` is called, and
`refresh` recomputes switch costs when a load or an eviction changes where an
expert lives.  An estimate that goes negative is a bug: it is counted
(`estimate_faults`, on which a benchmark reports no figure), logged and
recomputed from the queue's groups (`_set_cost`), never clamped silently.

The scheduler decides; costs come from a `CostModel`; clocks are injected, so
the simulated device drives this same code on virtual time.
"""
from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from coe import CoEError, Request

log = logging.getLogger(__name__)


class NoExecutor(CoEError):
    """No executor's pool can hold the expert a request asks for."""


class _WaitForRetired(Exception):
    """Only a retired executor's pool can hold the expert: the request waits for it (`submit`)."""

# Groups past the head that `fill` looks at (each one a cost-model call; the scan stops at the first resident
# group that fits, and runs the whole window only when none does).
# 8 left a hot resident group queued far back (a shared detector behind many switches) waiting out every load
# until the end of a flood; at 256 the simulated decision cost rose from 34 to 38 us (A2 flood).
FILL_WINDOW = 256

_batch_ids = itertools.count(1)
_EPS = 1e-9
# a request whose batch was lost with its executor this many times is given up (an error verdict), not requeued:
# a batch that kills every actor it reaches, or outlasts the call timeout every time, must not circle forever
MAX_LOST = 3


@dataclass
class Batch:
    """Requests for one expert, run together on one executor."""

    executor: str
    expert_id: str
    requests: list[Request]
    id: int = field(default_factory=lambda: next(_batch_ids))
    predicted: float = 0.0        # seconds the scheduler predicted for it (switch + K*n + B)
    due: list[float] = field(default_factory=list)   # per request: when its age bound counts from (requeues keep it)

    def __len__(self) -> int:
        return len(self.requests)


class PlannedRead:
    """A read the scheduler counts in its SSD backlog (`Scheduler.plan_read`): `start` when it starts, `end`
    when it is over or will never happen (either may come more than once; only the first counts)."""

    def __init__(self, scheduler: "Scheduler", key: int) -> None:
        self._scheduler, self._key, self._started = scheduler, key, False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._scheduler._start_read(self._key)

    def end(self) -> None:
        self._scheduler._end_read(self._key)


@dataclass(frozen=True)
class SchedulerPolicy:
    name: str
    assign: str          # 'cost' | 'round-robin' | 'affinity'
    arrange: bool
    split: bool
    ssd_aware: bool = False   # the shared SSD is a resource in the assignment objective
    steal: bool = False       # an idle executor takes a waiting group that would finish sooner on it
    work_aware: bool = False  # the objective also charges what a choice adds to the executors' mean time
    fill: bool = False        # while the head group's expert loads, serve a group that ends before it (a resident
    #                           one, else one copied whole from the host tier)
    hold: bool = False        # with fill: while the head's expert still loads and nothing fills, the executor waits
    #                           for the load (or a filler's arrival) instead of taking the head and blocking on it
    followups: bool = False   # a frame's later step that starts a new group goes right behind the head


POLICIES = {
    "coserve": SchedulerPolicy("coserve", "cost", True, True, ssd_aware=True, steal=True, work_aware=True,
                               fill=True, hold=True, followups=True),
    "coserve-paper": SchedulerPolicy("coserve-paper", "cost", True, True),   # the paper's rule, exactly
    # one lever of ours off at a time (bench ablations)
    "coserve-nossd": SchedulerPolicy("coserve-nossd", "cost", True, True, steal=True, work_aware=True, fill=True,
                                     hold=True, followups=True),
    "coserve-nosteal": SchedulerPolicy("coserve-nosteal", "cost", True, True, ssd_aware=True, work_aware=True,
                                       fill=True, hold=True, followups=True),
    "coserve-nowork": SchedulerPolicy("coserve-nowork", "cost", True, True, ssd_aware=True, steal=True, fill=True,
                                      hold=True, followups=True),
    "coserve-nofill": SchedulerPolicy("coserve-nofill", "cost", True, True, ssd_aware=True, steal=True,
                                      work_aware=True, followups=True),     # hold is part of fill: off with it
    "coserve-nohold": SchedulerPolicy("coserve-nohold", "cost", True, True, ssd_aware=True, steal=True,
                                      work_aware=True, fill=True, followups=True),
    "coserve-nofollowup": SchedulerPolicy("coserve-nofollowup", "cost", True, True, ssd_aware=True, steal=True,
                                          work_aware=True, fill=True, hold=True),
    "em+ra": SchedulerPolicy("em+ra", "round-robin", True, True),      # ablation: no cost-based assigning
    "em": SchedulerPolicy("em", "round-robin", False, True),           # ablation: expert management only
    "none": SchedulerPolicy("none", "round-robin", False, True),
    # Samba-CoE: arrival order; the splitter still caps a batch at what fits, as for every system
    "fcfs": SchedulerPolicy("fcfs", "round-robin", False, True),
    "round-robin": SchedulerPolicy("round-robin", "round-robin", False, True),
    "grouped": SchedulerPolicy("grouped", "affinity", True, False),    # simple grouping without a profile
}


def make_scheduler_policy(name: str) -> SchedulerPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduler policy '{name}' (known: {', '.join(sorted(POLICIES))})") from None


class CostModel(Protocol):
    """What the scheduler needs to know about costs; see executors.costs for the profiled one."""

    def exec_cost(self, executor: str, expert_id: str) -> tuple[float, float]:
        """(K, B) in seconds for this expert's architecture on this executor (contention included)."""

    def switch_cost(self, executor: str, expert_id: str) -> float:
        """0 if resident or loading in the executor's pool, else the load time from where the expert lives."""

    def ssd_seconds(self, executor: str, expert_id: str) -> float:
        """The SSD read time a switch to `expert_id` on `executor` would take now (0 unless it is on SSD only)."""

    def ssd_inflight(self) -> float:
        """Seconds of SSD reads already under way or waiting at the device."""

    def max_batch(self, executor: str, expert_id: str, *, memory: bool = True) -> int:
        """Profiled max batch; with `memory`, also capped by what fits in free memory now."""

    def resident(self, executor: str) -> set[str]:
        """Experts resident in the executor's pool."""


class FixedCosts:
    """A cost model with one K, B, load time and max batch for everything (tests, no profile)."""

    def __init__(self, K: float = 1.0, B: float = 1.0, load: float = 10.0, max_batch: int = 16,
                 resident: Callable[[str], set[str]] | None = None,
                 loading: Callable[[str], dict[str, float]] | None = None,
                 host: Callable[[str], set[str]] | None = None, host_load: float = 1.0) -> None:
        self.K, self.B, self.load, self.mb = K, B, load, max_batch
        self._resident = resident or (lambda name: set())
        self._loading = loading or (lambda name: {})   # per executor: expert -> seconds its load still needs
        self._host = host or (lambda name: set())      # per executor: experts it copies from the host tier
        self.host_load = host_load

    def exec_cost(self, executor: str, expert_id: str) -> tuple[float, float]:
        return self.K, self.B

    def tier_of(self, executor: str, expert_id: str) -> str:
        """'resident' (loading counts as arriving), 'host' or 'ssd'."""
        if expert_id in self._resident(executor) or expert_id in self._loading(executor):
            return "resident"
        return "host" if expert_id in self._host(executor) else "ssd"

    def switch_cost(self, executor: str, expert_id: str) -> float:
        tier = self.tier_of(executor, expert_id)
        if tier == "resident":
            return self._loading(executor).get(expert_id, 0.0)
        return self.host_load if tier == "host" else self.load

    def ssd_seconds(self, executor: str, expert_id: str) -> float:
        """A read under way counts what is left of it (every load here is a read, but a copy from the host tier)."""
        return 0.0 if self.tier_of(executor, expert_id) == "host" else self.switch_cost(executor, expert_id)

    def ssd_inflight(self) -> float:
        return 0.0

    def max_batch(self, executor: str, expert_id: str, *, memory: bool = True) -> int:
        return self.mb

    def resident(self, executor: str) -> set[str]:
        return self._resident(executor)


class _Group:
    """Queued requests for one expert on one queue, with their predicted cost."""

    __slots__ = ("expert_id", "requests", "times", "switch", "ssd", "cost", "drain", "followup", "held")

    def __init__(self, expert_id: str, switch: float, ssd: float) -> None:
        self.expert_id, self.switch, self.ssd = expert_id, switch, ssd
        self.requests: deque[Request] = deque()
        self.times: deque[float] = deque()   # when each request was due: queued + predicted wait (age bound)
        self.cost = 0.0
        self.drain = 0    # requests this group had when it was picked: served before the age bound looks again
        self.followup = False   # started by a frame's later step (policy `followups`)
        self.held = False       # an executor has waited on it as its head while its expert loaded (`hold`)


class _Queue:
    """One executor's queue as a sequence of expert groups, with its predicted total time."""

    def __init__(self) -> None:
        self.groups: deque[_Group] = deque()
        self.by_expert: dict[str, _Group] = {}   # the group new requests of an expert join (arranging)
        self.counts: dict[str, int] = {}          # queued requests per expert
        self.queued = 0.0                         # sum of the queued groups' predicted costs
        self.ssd = 0.0                            # SSD seconds the queued groups' switches will read
        self.inflight: dict[int, tuple[float, float, float]] = {}   # batch id -> (start, predicted end, SSD s)
        self.n = 0


class Scheduler:
    """Per-executor queues; `submit` from any thread, `next_batch` from each executor's thread."""

    def __init__(self, executors: list[str], policy: SchedulerPolicy | str = "coserve", *,
                 costs: CostModel | None = None, clock: Callable[[], float] = time.perf_counter,
                 now: Callable[[], float] = time.monotonic, tie_seconds: float = 0.0,
                 max_wait: float | None = None, max_lost: int = MAX_LOST) -> None:
        if not executors:
            raise ValueError("a scheduler needs at least one executor")
        if max_wait is not None and max_wait < 0:
            raise ValueError(f"max_wait must be >= 0 seconds (0 or None: no age bound), got {max_wait}")
        if max_lost < 1:
            raise ValueError(f"max_lost must be >= 1 attempts, got {max_lost}")
        self.policy = make_scheduler_policy(policy) if isinstance(policy, str) else policy
        self.costs = costs or FixedCosts()
        self.tie_seconds = tie_seconds
        self.max_wait = max_wait or None
        self.names = list(executors)
        self._q = {e: _Queue() for e in executors}
        self._rr = itertools.cycle(self.names)
        self._cond = threading.Condition()
        self._closed = False
        self._clock = clock      # measures decision time (real CPU time, also in simulation)
        self._now = now          # the time requests wait in (virtual in simulation)
        self.decisions = 0
        self.decision_seconds = 0.0
        self.aged = 0            # batches the age bound pulled ahead of the head group
        self.stolen = 0          # groups an idle executor took over from another queue
        self.filled = 0          # batches served ahead of a head group whose expert was still to load (`fill`)
        self.held = 0            # head groups an executor waited on, not took, while their expert loaded (`hold`)
        self.estimate_faults = 0   # queue estimates that went negative (a bug; logged, recomputed: `_set_cost`)
        self.max_lost = max_lost
        self._lost: dict[int, int] = {}   # request id -> batches of it lost with their executor (while it lives)
        self._due: dict[int, float] = {}   # request id -> its due time, while it is handed back (retire, lost batch)
        self._waiting: deque[tuple[Request, float]] = deque()   # (request, due) while no executor is active
        self.given_up = 0        # requests `requeue` refused after `max_lost` losses
        # reads not of a batch: id -> (start, s, channel); start None: planned, not started (counted whole)
        self._reads: dict[int, tuple[float | None, float, str]] = {}
        self._read_ids = itertools.count()

    # -- costs ----------------------------------------------------------------------
    def _cap(self, executor: str, expert_id: str) -> int:
        """The splitter's cap: what `next_batch` will really cut a batch at."""
        return max(1, self.costs.max_batch(executor, expert_id, memory=self.policy.split))

    def _group_cost(self, executor: str, g: _Group, n: int) -> float:
        if n == 0:
            return 0.0
        K, B = self.costs.exec_cost(executor, g.expert_id)
        return g.switch + K * n + B * -(-n // self._cap(executor, g.expert_id))

    def _set_cost(self, executor: str, q: _Queue, g: _Group) -> None:
        """Refresh `g`'s predicted cost in `q`'s estimate.  An estimate that goes negative is a scheduler bug:
        counted (`estimate_faults`; a simulation fails on it), logged, and recomputed from the queue's groups
        here, never raised:
        every caller has changed the queue by then, and a raise would leave a request queued that its caller
        took for refused (a second verdict), or popped and never handed out."""
        new = self._group_cost(executor, g, len(g.requests))
        q.queued += new - g.cost
        g.cost = new
        if q.queued < -_EPS:
            self.estimate_faults += 1
            log.error("scheduler bug: %s's predicted queue time went negative (%.6f s) at group %s (%d request(s)); "
                      "recomputed from its groups", executor, q.queued, g.expert_id, len(g.requests))
            q.queued = sum(x.cost for x in q.groups)     # every caller has set the group's new cost by now

    def estimate(self, executor: str) -> float:
        """Predicted seconds until `executor`'s queue is empty: queued groups plus batches still running."""
        q = self._q[executor]
        now = self._now()
        # a batch running past its prediction is still running: it counts as ending now, not in the past
        return q.queued + self._running(q, now)

    @staticmethod
    def _running(q: _Queue, now: float) -> float:
        """Predicted seconds the batches handed out from `q` still run (one past its prediction: 0, not less)."""
        return sum(max(end - now, 0.0) for _, end, _ in q.inflight.values())

    def _ahead(self, q: _Queue, at: int) -> float:
        """Predicted seconds before the group at position `at` of `q` starts: batches running, then the groups
        in front of it."""
        return self._running(q, self._now()) + sum(g.cost for g in itertools.islice(q.groups, at))

    def channel(self, executor: str) -> str:
        """The SSD channel `executor` reads from: its box's ('' when the cost model knows one SSD only)."""
        f = getattr(self.costs, "ssd_channel", None)
        return f(executor) if f is not None else ""

    def ssd_inflight(self, channel: str = "") -> float:
        """SSD seconds still to read on `channel` for work already handed out.

        From the cost model when it watches the device (the simulator's SSD
        channels); otherwise from the batches handed out: a batch reads its
        expert first, so one that started at `s` with `r` seconds of SSD read
        has max(s + r - now, 0) left (0 once it is past its read); and so for
        each read under way in `reading` (the read-ahead's).
        """
        f = getattr(self.costs, "ssd_inflight", None)
        watched = (f(channel) if channel else f()) if f is not None else None
        if watched is not None:
            return watched
        with self._cond:
            now = self._now()   # under the lock, as `_start_read` stamps: a read never counts more than its seconds
            other = sum(ssd if start is None else max(start + ssd - now, 0.0)
                        for start, ssd, ch in self._reads.values() if ch == channel)
            return other + sum(max(start + ssd - now, 0.0) for n, q in self._q.items()
                               if self.channel(n) == channel for start, _, ssd in q.inflight.values())

    @contextlib.contextmanager
    def reading(self, seconds: float, channel: str = ""):
        """Around an SSD read that no batch handed out makes (the host tier's read-ahead,
        `executors.readahead`): while it runs it counts in `ssd_inflight` like a batch's read, so a switch
        predicted meanwhile waits behind it, as it will on the SSD.  Where the cost model watches the
        device (the simulator) its own count already holds the read, and this adds nothing."""
        read = self.plan_read(seconds, channel)
        read.start()
        try:
            yield
        finally:
            read.end()

    def plan_read(self, seconds: float, channel: str = "") -> "PlannedRead":
        """An SSD read decided now that starts later (a prefetch, `executors.prefetch`): `ssd_inflight`
        counts all its seconds until `start`, then what is left of them, until `end`."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"a read takes a finite number of seconds >= 0, got {seconds}")
        with self._cond:
            key = next(self._read_ids)
            self._reads[key] = (None, seconds, channel)
        return PlannedRead(self, key)

    def _start_read(self, key: int) -> None:
        with self._cond:
            if key in self._reads:
                _, seconds, channel = self._reads[key]
                self._reads[key] = (self._now(), seconds, channel)

    def _end_read(self, key: int) -> None:
        with self._cond:
            self._reads.pop(key, None)

    def ssd_backlog(self, channel: str = "") -> float:
        """Predicted SSD seconds on `channel`: reads under way plus the SSD switch of every group queued on it."""
        return self.ssd_inflight(channel) + sum(q.ssd for n, q in self._q.items() if self.channel(n) == channel)

    def added_latency(self, executor: str, expert_id: str) -> tuple[float, float, float]:
        """(added seconds, switch seconds, SSD seconds) if a request for `expert_id` joins `executor`."""
        q = self._q[executor]
        g = self._join_target(q, expert_id)
        if g is not None:
            n = len(g.requests)
            return self._group_cost(executor, g, n + 1) - self._group_cost(executor, g, n), 0.0, 0.0
        switch, ssd = (0.0, 0.0) if q.counts.get(expert_id) else self._switch(executor, expert_id)
        K, B = self.costs.exec_cost(executor, expert_id)
        return K + B + switch, switch, ssd

    def _switch(self, executor: str, expert_id: str) -> tuple[float, float]:
        """(switch seconds, SSD read seconds) of loading `expert_id` on `executor` now.

        SSD-aware, a read also waits behind the reads already under way (the
        SSD is one channel); the paper's rule charges the load time alone.
        """
        switch = self.costs.switch_cost(executor, expert_id)
        ssd = self._ssd_seconds(executor, expert_id) if switch else 0.0
        if ssd and self.policy.ssd_aware:
            switch += self.ssd_inflight(self.channel(executor))
        return switch, ssd

    def _ssd_seconds(self, executor: str, expert_id: str) -> float:
        f = getattr(self.costs, "ssd_seconds", None)
        return f(executor, expert_id) if f is not None else 0.0

    def _join_target(self, q: _Queue, expert_id: str) -> _Group | None:
        if self.policy.arrange:
            return q.by_expert.get(expert_id)
        return q.groups[-1] if q.groups and q.groups[-1].expert_id == expert_id else None

    # -- submit ---------------------------------------------------------------------
    def submit(self, request: Request, *, due: float | None = None) -> str | None:
        """Assign, arrange and queue a request; returns the executor it went to.

        `due` is when the request's age bound counts from (on the `now`
        clock): by default now plus the wait predicted on its queue; a request
        handed back (`requeue`) keeps the one it had, so it is not made
        younger by being lost, and it goes in front of younger requests of its
        group.  With no executor active (every one retired) it waits in the
        scheduler, and None is returned; `restore` assigns it.
        """
        with self._cond:
            if not self.names:
                self._waiting.append((request, self._now() if due is None else due))
                return None
            t0 = self._clock()
            try:
                name, switch, ssd = self._assign(request.expert_id)
            except _WaitForRetired:      # `restore` assigns it, as a request made while no executor is active
                self._waiting.append((request, self._now() if due is None else due))
                return None
            q = self._q[name]
            x = request.expert_id
            group = self._join_target(q, x)
            at = len(q.groups)   # where a new group goes: the end, or (a frame's later step) behind the head
            followup = group is None and self.policy.followups and request.stage > 0
            if followup and q.groups:
                at = 1
                while at < len(q.groups) and q.groups[at].followup:
                    at += 1   # behind the earlier ones: frames in progress in the order they got here
            if due is None and self.max_wait is not None:   # the wait predicted for it
                due = self._now() + (self.estimate(name) if group is not None or at == len(q.groups)
                                     else self._ahead(q, at))
            elif due is None:
                due = self._now()
            if group is None:
                group = _Group(x, switch, ssd)
                group.followup = followup   # even at the end: a later follow-up goes behind it, not in front
                q.groups.insert(at, group)
                q.by_expert[x] = group
                q.ssd += ssd
            # by due time, which keeps `times` sorted for the age bound (`_pick` reads each head's): a requeued
            # request keeps its old due, and a new one whose predicted wait shrank (a load landed) is due earlier
            if group.times and due < group.times[-1]:
                i = bisect.bisect_right(group.times, due)
                group.requests.insert(i, request)
                group.times.insert(i, due)
            else:
                group.requests.append(request)
                group.times.append(due)
            self._set_cost(name, q, group)
            q.counts[x] = q.counts.get(x, 0) + 1
            q.n += 1
            self.decisions += 1
            self.decision_seconds += self._clock() - t0
            self._cond.notify_all()
            return name

    def able(self, expert_id: str) -> list[str]:
        """The active executors whose pool can hold `expert_id` (`costs.fits`; all, where the costs cannot say):
        a small CPU pool beside a GPU runs the classifiers it holds, and is never handed a detector it cannot
        load (every frame of that batch would fail).  Raises `NoExecutor` when none can."""
        fits = getattr(self.costs, "fits", None)
        if fits is None:
            return self.names
        names = [n for n in self.names if fits(n, expert_id)]
        if not names:
            if any(fits(n, expert_id) for n in self._q if n not in self.names):
                raise _WaitForRetired(expert_id)    # one that can is down: wait for it, as with none active
            raise NoExecutor(f"no executor's pool can hold expert {expert_id}; give an executor more memory")
        return names

    def _assign(self, expert_id: str) -> tuple[str, float, float]:
        how = self.policy.assign
        names = self.able(expert_id)
        if how == "round-robin" or len(names) == 1:
            name = names[0]
            if how == "round-robin" and len(names) > 1:
                name = next(n for n in self._rr if n in names)    # the cycle over all, skipping those unable
            return (name, *self.added_latency(name, expert_id)[1:])
        if how == "affinity":
            holders = [n for n in names if self._q[n].counts.get(expert_id)] or \
                      [n for n in names if expert_id in self.costs.resident(n)] or names
            name = min(holders, key=lambda n: self._q[n].n)
            return (name, *self.added_latency(name, expert_id)[1:])
        # cost: minimise the maximum predicted time over every executor (and, SSD-aware, the SSD);
        # ties -> smallest added latency.  `tie_seconds` widens what counts as a tie (default 0: exact).
        ests = {n: self.estimate(n) for n in self.names}
        order = sorted(((e, n) for n, e in ests.items()), reverse=True)
        top, top_name = order[0]
        second = order[1][0] if len(order) > 1 else 0.0
        backlogs: dict[str, float] = {}
        if self.policy.ssd_aware:
            for n in self.names:
                ch = self.channel(n)
                if ch not in backlogs:
                    backlogs[ch] = self.ssd_backlog(ch)
        top_ssd = max(backlogs.values(), default=0.0)
        cands = []
        for i, name in enumerate(self.names):
            if name not in names:
                continue
            added, switch, ssd = self.added_latency(name, expert_id)
            others = second if name == top_name else top
            objective = max(others, ests[name] + added)
            if self.policy.ssd_aware:   # every SSD's backlog is in the max; this one's grows by the switch's read
                objective = max(objective, top_ssd, backlogs[self.channel(name)] + ssd)
            if self.policy.work_aware:
                # the max alone is blind to work added below it: joining the top queue's group (+K) loses to a
                # switch on another queue (+load+K+B) by K, though the switch costs far more.  Every queued
                # second is run by some executor, and stealing spreads the tail, so a choice also moves the
                # executors' mean time by added / n: that is its weight, derived, not fitted.
                objective += added / len(self.names)
                # with several SSDs (boxes), the SSD max is blind the same way to a read on an SSD below the
                # busiest: charge it at its effect on the SSDs' mean.  With one SSD its max is its mean.
                if self.policy.ssd_aware and ssd and len(backlogs) > 1:
                    objective += ssd / len(backlogs)
            cands.append((objective, added, i, name, switch, ssd))
        floor = min(c[0] for c in cands) + self.tie_seconds
        _, _, _, name, switch, ssd = min((c for c in cands if c[0] <= floor + _EPS), key=lambda c: (c[1], c[0], c[2]))
        return name, switch, ssd

    # -- take -------------------------------------------------------------------------
    def next_batch(self, executor: str, timeout: float | None = None) -> Batch | None:
        """The head group of `executor`'s queue (or the oldest waiter's, past `max_wait`), split to the cap."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            q = self._q[executor]
            while True:
                while not q.groups:
                    if self.policy.steal and not q.inflight and self._steal(executor):
                        break
                    if self._closed and not self._waiting:
                        return None
                    # closed, with requests waiting for a retired executor's return (`restore` may hand some
                    # here): this executor idles on the condition until then, or `abandon_waiting`, not spins
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    self._cond.wait(left)
                    if executor not in self.names:   # retired while it waited: its queue went back for requeue
                        return None
                    q = self._q[executor]
                draining = any(g.drain > 0 for g in q.groups)
                group = self._pick(executor, q)
                wait = 0.0 if draining else self._hold(executor, q, group)
                if wait <= 0:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(wait if left is None else min(wait, left))
                if executor not in self.names:   # retired while it waited: its queue went back for requeue
                    return None
                q = self._q[executor]
            group.held = False
            x = group.expert_id
            cap = self._cap(executor, x)
            take = min(cap, len(group.requests))
            if self._lost:
                # a request already lost with an executor runs alone: a batch that kills whatever runs it is
                # narrowed to the frame that does, and the others of that batch are not given up with it
                if group.requests[0].id in self._lost:
                    take = 1
                else:                          # ... and it joins no younger request's batch either
                    take = next((i for i in range(1, take) if group.requests[i].id in self._lost), take)
            K, B = self.costs.exec_cost(executor, x)     # before anything leaves the queue: it may raise
            group.drain = max(group.drain - take, 0)
            requests = [group.requests.popleft() for _ in range(take)]
            dues = [group.times.popleft() for _ in range(take)]
            predicted = group.switch + K * take + B
            ssd = group.ssd
            q.ssd -= group.ssd
            group.switch = group.ssd = 0.0
            self._set_cost(executor, q, group)
            q.counts[x] -= take
            q.n -= take
            if not q.counts[x]:
                del q.counts[x]
            if not group.requests:
                q.groups.remove(group)
                if q.by_expert.get(x) is group:
                    del q.by_expert[x]
            batch = Batch(executor, x, requests, predicted=predicted, due=dues)
            now = self._now()
            q.inflight[batch.id] = (now, now + predicted, ssd)
            return batch

    def _steal(self, executor: str) -> bool:
        """Move to idle `executor` the waiting group that gains most by running here, if any gains.

        Assignments are predictions; when one queue runs dry while another
        still holds work, the min-max was wrong about one of them.  A group
        that has not started moves if it would finish sooner here (its switch
        here included) than where it waits, which is its queue's time ahead of
        it plus its own cost.  SSD-aware, the SSD seconds the move adds (the
        group's expert is resident or in the host tier where it waits, and
        must come from the SSD here) are charged once more, as work added to
        the shared SSD (with several boxes, at their effect on the SSDs' mean).
        Without that charge, on A2 at 11.8 frames/s (simulated), 56 of 323
        steals moved a group off an executor that held its expert onto one
        that read it (51 of them GPU to CPU), and p99 was 2.14 s against 1.92 s
        with it (`python bench/sim_rates.py --rates 11.8`).
        """
        q = self._q[executor]
        now = self._now()
        best, gain = None, 0.0
        n_ssd = len({self.channel(n) for n in self.names})
        fits = getattr(self.costs, "fits", None)
        for name, o in self._q.items():
            if name == executor or not o.groups:
                continue
            ahead = self._running(o, now)
            for g in o.groups:
                finish_there = ahead + g.cost
                ahead = finish_there
                if g.drain or g.held or not g.requests:   # a held head's expert is loading there already
                    continue
                if fits is not None and not fits(executor, g.expert_id):   # it could not load it here
                    continue
                switch, ssd = self._switch(executor, g.expert_id)
                probe = _Group(g.expert_id, switch, ssd)
                here = self._group_cost(executor, probe, len(g.requests))
                if self.policy.ssd_aware and ssd > g.ssd:
                    # a steal moves work; the SSD seconds it adds (read here, beyond what the group reads where
                    # it waits) are new work on the SSDs every switch queues for, so the gain must pay for them
                    # too.  Their weight is their effect on the SSDs' mean, as in assignment: 1 with one SSD,
                    # 1 / n with n (one per box).  Free only if nothing ever reads after it; on a line the SSD
                    # is busy most of the time (82% on A2 at 11.8 frames/s, simulated), so the next read,
                    # queued or not yet arrived, starts that much later.
                    here += (ssd - g.ssd) / n_ssd
                if finish_there - here > gain + _EPS:
                    best, gain = (name, g, switch, ssd), finish_there - here
        if best is None:
            return False
        name, g, switch, ssd = best
        o = self._q[name]
        o.groups.remove(g)
        if o.by_expert.get(g.expert_id) is g:
            del o.by_expert[g.expert_id]
        o.queued -= g.cost
        o.ssd -= g.ssd
        n = len(g.requests)
        o.counts[g.expert_id] -= n
        if not o.counts[g.expert_id]:
            del o.counts[g.expert_id]
        o.n -= n
        g.switch, g.ssd, g.cost = switch, ssd, 0.0
        q.groups.append(g)
        q.by_expert.setdefault(g.expert_id, g)
        q.ssd += ssd
        q.counts[g.expert_id] = q.counts.get(g.expert_id, 0) + n
        q.n += n
        self._set_cost(executor, q, g)
        self.stolen += 1
        return True

    def _pick(self, executor: str, q: _Queue) -> _Group:
        """The group to serve: the one being drained, else the head, else (age bound) the oldest waiter's.

        A picked group is served up to the requests it held when picked, so the
        age bound never splits a group between reloads; requests that join it
        later wait their turn, which is what stops a hot group from starving
        the rest under a continuous stream.
        """
        for g in q.groups:
            if g.drain > 0:
                return g
        pick = q.groups[0]
        if self.max_wait is not None:
            oldest = min(q.groups, key=lambda g: g.times[0])
            if oldest is not pick and self._now() - oldest.times[0] > self.max_wait:   # overdue by max_wait
                self.aged += 1
                pick = oldest
        if self.policy.fill and pick is q.groups[0]:
            filler = self._fill(executor, q, pick)
            if filler is not pick:      # one batch of it, the one that fits the wait; then the head
                filler.drain = 0        # (not drained on: however `next_batch` narrows this batch)
                return filler
        pick.drain = len(pick.requests)
        return pick

    def _overdue(self, group: _Group) -> bool:
        """True if `group`'s oldest request has waited past the age bound."""
        return self.max_wait is not None and bool(group.times) and self._now() - group.times[0] > self.max_wait

    def _loading_left(self, executor: str, group: _Group) -> float:
        """Seconds `group`'s expert still needs to load on `executor` (a load under way: the pool counts it
        present and the cost model says what is left); 0 when it is in, or its load has not started."""
        tier_of = getattr(self.costs, "tier_of", None)
        if tier_of is None or tier_of(executor, group.expert_id) != "resident":
            return 0.0
        return self.costs.switch_cost(executor, group.expert_id)

    def _hold(self, executor: str, q: _Queue, group: _Group) -> float:
        """Seconds to wait instead of taking `group` (policy `hold`): 0 to take it now.

        Fill has found nothing to run while the head's expert loads (its
        prefetch is under way), so taking the head would block this executor
        on the load, and every request arriving meanwhile, a resident hot type
        or a frame's detector step, would wait behind it.  Waiting instead
        leaves the executor free for such a filler the moment it is submitted
        (`submit` notifies), and the head still starts when its load lets it:
        the wait ends when the load lands (`refresh`, called on the pool's
        load event, notifies) or after what the cost model says it still
        needs, whichever is first.  The head is not delayed by it.  On A1-B2 at
        16.4/16.4/14.2/15.2 frames/s (simulation) the median frame latency fell
        from 0.19-0.21 s to 0.03-0.04 s.  A group being drained is never held.

        Only while the queue holds at most `max_wait` of predicted work (the
        latency the line is meant to keep to; with the age bound off, never),
        and not for a head the age bound has made due.  Deeper, the line is in a
        backlog and throughput comes first: a held executor serves each
        resident request as it comes, in batches of one, where the blocked one
        let them gather into larger batches.  Holding under every backlog cost
        a cold 2,000-type flood on 4 boxes 25 more switches (897 against 872,
        5.8% over the floor) and 3% of its throughput (simulation, A2).
        """
        if not (self.policy.fill and self.policy.hold) or group is not q.groups[0] or self.max_wait is None:
            return 0.0
        if self.estimate(executor) > self.max_wait:
            return 0.0                  # a backlog: batches grow while the load runs, so take it (throughput)
        if self._overdue(group):
            return 0.0                  # fill serves nothing ahead of it, so waiting frees nothing
        wait = self._loading_left(executor, group)
        if wait <= _EPS:
            return 0.0
        group.drain = 0                 # not picked after all: `_pick` looks again when the wait ends
        if not group.held:              # waited on now (cleared when a batch of it is taken)
            group.held = True
            self.held += 1
        return wait

    def _fill(self, executor: str, q: _Queue, head: _Group) -> _Group:
        """The head, or a group to serve while the head's expert loads (policy `fill`).

        A batch waits for its expert's load, and the executor with it.  If the
        head's expert is already loading (the executor's prefetcher took it up
        while the last batch ran) and a group among the next FILL_WINDOW is
        resident (switch 0) with a batch that ends within what that load still
        needs, that batch runs first: the executor computes in what would have
        been a wait, and the head starts about when its load lets it.  A head
        whose load has not started is not passed over, so the filled time is
        bounded by the load's.  One batch only (`_pick` does not drain the
        filler on), and never for a head the age bound has made due: an
        overdue head is served as it is.

        With no resident group that fits, a group whose expert this executor
        copies from the host tier fills too, if its copy and the whole group
        in one batch end within the wait.  On a line the slowest frames were
        rare types whose experts sat in the host tier, queued behind a head
        whose SSD read waited behind other reads (A2 at F = 0.8, simulated:
        2.5 s for a 0.02 s copy and batch).  Resident groups go first (a copy
        costs a victim); only a whole group, or the copy is made again for the
        rest of it (B1 with 500 types, flood: +41 switches, -10% throughput).
        """
        if self._overdue(head):
            return head
        wait = self._loading_left(executor, head)   # 0 when its load has not started: nothing to fill
        if wait <= 0:
            return head
        tier_of = self.costs.tier_of
        copier = None
        for g in itertools.islice(q.groups, 1, FILL_WINDOW):
            x = g.expert_id
            tier = tier_of(executor, x)
            if tier == "ssd" or (tier == "resident" and self.costs.switch_cost(executor, x) > 0):
                continue
            cap = self._cap(executor, x)
            K, B = self.costs.exec_cost(executor, x)
            if tier == "resident":
                if K * min(len(g.requests), cap) + B <= wait:
                    self.filled += 1
                    return g
            elif copier is None and len(g.requests) <= cap and \
                    self.costs.switch_cost(executor, x) + K * len(g.requests) + B <= wait:
                copier = g
        if copier is not None:
            self.filled += 1
            return copier
        return head

    def finished(self, batch: Batch, *, lost: bool = False, attempt: bool = True) -> None:
        """The executor is done with `batch`: its predicted time leaves the queue's estimate.

        `lost`: the batch died with its executor (remote executors) and its
        requests are about to be handed back with `requeue`; each counts one
        lost attempt, unless `attempt` is False (handed back unrun: its
        executor left service before sending it).  A batch that ran (outputs
        or an error) clears its requests' counts.
        """
        with self._cond:
            self._q[batch.executor].inflight.pop(batch.id, None)
            if lost:
                for i, r in enumerate(batch.requests):
                    if attempt:
                        self._lost[r.id] = self._lost.get(r.id, 0) + 1
                    if i < len(batch.due):
                        self._due[r.id] = batch.due[i]
            elif self._lost:
                for r in batch.requests:
                    self._lost.pop(r.id, None)

    def requeue(self, requests: list[Request], failed: list | None = None) -> list[Request]:
        """Hand requests back to assignment (a retired executor's queue, a lost batch); returns those given up.

        Each keeps its due time (its age), and they are assigned oldest
        first, so the age bound and the order among them hold across the
        loss.  A request whose batch was lost `max_lost` times is not
        submitted again: it is returned, for the caller to turn into an error
        result, so every frame still gets exactly one verdict.  A request
        that cannot be submitted again (a fault in assignment) is put in
        `failed` as (request, why), or with no list returned among the given
        up: the requests after it are still submitted, none is left stranded.
        """
        gone = []
        with self._cond:
            back = []
            for r in requests:
                due = self._due.pop(r.id, None)
                if self._lost.get(r.id, 0) >= self.max_lost:
                    del self._lost[r.id]
                    self.given_up += 1
                    gone.append(r)
                else:
                    back.append((float("-inf") if due is None else due, r, due))
            back.sort(key=lambda t: t[0])
            unplaced = self._submit_each([(r, due) for _, r, due in back])
        if failed is not None:
            failed.extend(unplaced)
        else:
            gone.extend(r for r, _ in unplaced)
        return gone

    def _submit_each(self, items: list[tuple[Request, float | None]]) -> list[tuple[Request, str]]:
        """Submit each (request, due); those whose submit raised, with why (logged): one fault costs one
        request, not the ones after it."""
        unplaced = []
        for r, due in items:
            try:
                self.submit(r, due=due)
            except Exception as exc:  # noqa: BLE001 - the caller gives it an error result; the rest go on
                log.exception("scheduling frame %s again failed", r.frame.frame_id)
                unplaced.append((r, f"scheduling failed: {type(exc).__name__}: {exc}"))
        return unplaced

    def lost_attempts(self, request: Request) -> int:
        """How many of `request`'s batches were lost with their executor so far."""
        with self._cond:
            return self._lost.get(request.id, 0)

    def refresh(self, expert_id: str, executor: str | None = None) -> None:
        """Recompute the switch cost of queued groups for `expert_id` (on one executor, or all).

        Called when a load or an eviction changes where the expert lives, so a
        group predicted to read from SSD is not still charged once the expert is
        resident, and a group whose expert was evicted is charged its reload.
        """
        with self._cond:
            for name in ([executor] if executor is not None else self.names):
                q = self._q[name]
                for g in q.groups:
                    if g.expert_id != expert_id:
                        continue
                    switch, ssd = self._switch(name, expert_id)
                    q.ssd += ssd - g.ssd
                    g.switch, g.ssd = switch, ssd
                    self._set_cost(name, q, g)
            self._cond.notify_all()     # an executor holding for this expert's load (`hold`) looks again

    # -- executors that come and go (remote executors, issue 15) -------------------------
    def retire(self, executor: str) -> list[Request]:
        """Take `executor` out of assignment and return its queued requests, for the caller to `requeue`.

        Their due times are kept for `requeue`.  Its batches in flight are
        the caller's (it still holds them); their predicted time leaves the
        estimate here.  The last executor is retired too: nothing is assigned
        to a down executor; requests then wait in the scheduler until
        `restore` brings one back.
        """
        with self._cond:
            if executor not in self.names:
                return []
            self.names.remove(executor)
            self._rr = itertools.cycle(self.names)
            q = self._q[executor]
            out = []
            for g in q.groups:
                for r, due in zip(g.requests, g.times):
                    self._due[r.id] = due
                    out.append(r)
            self._q[executor] = _Queue()
            self._cond.notify_all()
            return out

    def restore(self, executor: str) -> list[tuple[Request, str]]:
        """Put a retired `executor` back into assignment (in its original place in the order); the requests
        that waited for it are assigned, and those that could not be are returned with why (`requeue`), for
        the caller to give error results."""
        with self._cond:
            if executor in self.names or executor not in self._q:
                return []
            order = list(self._q)
            self.names = [n for n in order if n in self.names or n == executor]
            self._rr = itertools.cycle(self.names)
            waiting = sorted(self._waiting, key=lambda t: t[1])   # oldest first
            self._waiting.clear()
            unplaced = self._submit_each(waiting)
            self._cond.notify_all()
            return unplaced

    def abandon_waiting(self) -> int:
        """Give up the requests waiting for a retired executor, once none can come back (the caller's executors
        that restore themselves have ended); returns how many.  The others' threads then drain and end; the
        frames of those requests stay journaled and run again at the next start."""
        with self._cond:
            n = len(self._waiting)
            self._waiting.clear()
            self._cond.notify_all()
            return n

    def active(self) -> list[str]:
        """Executors requests are assigned to now."""
        with self._cond:
            return list(self.names)

    # -- queries ------------------------------------------------------------------------
    def depth(self) -> int:
        with self._cond:
            return sum(q.n for q in self._q.values()) + len(self._waiting)

    def waiting(self) -> int:
        """Requests held in the scheduler because no executor is active."""
        with self._cond:
            return len(self._waiting)

    def queued_experts(self, executor: str) -> list[str]:
        """Experts in queue order (one entry per queued request)."""
        with self._cond:
            return [g.expert_id for g in self._q[executor].groups for _ in g.requests]

    def queued_set(self, executor: str) -> set[str]:
        with self._cond:
            return set(self._q[executor].counts)

    def has_queued(self, expert_id: str, executors: Iterable[str] | None = None) -> bool:
        """Whether a request for `expert_id` waits in the queue of any of `executors` (default: all)."""
        with self._cond:
            return any(self._q[n].counts.get(expert_id) for n in (self.names if executors is None else executors))

    def next_expert(self, executor: str, current: str) -> str | None:
        """The expert of the first queued group that is not `current`: what to prefetch."""
        with self._cond:
            for g in self._q[executor].groups:
                if g.expert_id != current:
                    return g.expert_id
            return None

    def queued_groups(self, executor: str) -> list[str]:
        """The experts of `executor`'s queued groups, one entry per group, in the order they will run."""
        with self._cond:
            return [g.expert_id for g in self._q[executor].groups]

    def drained(self, executor: str) -> bool:
        """True once the scheduler is closed and `executor` has nothing left to run (nor does any request
        wait for an executor to come back)."""
        with self._cond:
            return self._closed and not self._q[executor].groups and not self._waiting

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wake every waiting executor; queued requests are still handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
