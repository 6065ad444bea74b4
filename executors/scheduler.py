"""Request scheduling onto executor queues (CoServe paper §4.2, DESIGN.md §4).

One `Scheduler` class runs every policy, so the baselines and ablations use the
same code as CoServe:

- assigning: `cost` puts a request on the queue that minimises the maximum
  predicted queue time over all executors (ties: the smallest added latency),
  where adding a request costs K (joining a batch) or K+B (starting one) plus
  the switch latency (0 if the expert is resident there or already queued
  there, else the load time from the tier where it lives); `round-robin`
  cycles; `affinity` prefers an executor that holds or queues the expert.
- arranging: a request goes right behind the last queued request for the same
  expert (`arrange=True`); otherwise arrival order, and only neighbours batch.
- splitting: a batch is capped at the cost model's max batch, which is
  min(profiled max batch, what fits in free memory now) when `split=True`.

The scheduler decides; costs come from a `CostModel`; the clock is injected,
so the simulated device drives this same code on virtual time.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from coe import Request

_batch_ids = itertools.count(1)


@dataclass
class Batch:
    """Requests for one expert, run together on one executor."""

    executor: str
    expert_id: str
    requests: list[Request]
    id: int = field(default_factory=lambda: next(_batch_ids))

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class SchedulerPolicy:
    name: str
    assign: str          # 'cost' | 'round-robin' | 'affinity'
    arrange: bool
    split: bool


POLICIES = {
    "coserve": SchedulerPolicy("coserve", "cost", True, True),
    "em+ra": SchedulerPolicy("em+ra", "round-robin", True, True),      # ablation: no cost-based assigning
    "em": SchedulerPolicy("em", "round-robin", False, True),           # ablation: expert management only
    "none": SchedulerPolicy("none", "round-robin", False, True),
    "fcfs": SchedulerPolicy("fcfs", "round-robin", False, False),      # Samba-CoE: arrival order
    "round-robin": SchedulerPolicy("round-robin", "round-robin", False, False),
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
        """(K, B) in seconds for this expert's architecture on this executor's device."""

    def switch_cost(self, executor: str, expert_id: str) -> float:
        """0 if resident in the executor's pool, else the load time from where the expert lives."""

    def max_batch(self, executor: str, expert_id: str, *, memory: bool = True) -> int:
        """Profiled max batch; with `memory`, also capped by what fits in free memory now."""

    def resident(self, executor: str) -> set[str]:
        """Experts resident in the executor's pool."""


class FixedCosts:
    """A cost model with one K, B, load time and max batch for everything (tests, no profile)."""

    def __init__(self, K: float = 1.0, B: float = 1.0, load: float = 10.0, max_batch: int = 16,
                 resident: Callable[[str], set[str]] | None = None) -> None:
        self.K, self.B, self.load, self.mb = K, B, load, max_batch
        self._resident = resident or (lambda name: set())

    def exec_cost(self, executor: str, expert_id: str) -> tuple[float, float]:
        return self.K, self.B

    def switch_cost(self, executor: str, expert_id: str) -> float:
        return 0.0 if expert_id in self._resident(executor) else self.load

    def max_batch(self, executor: str, expert_id: str, *, memory: bool = True) -> int:
        return self.mb

    def resident(self, executor: str) -> set[str]:
        return self._resident(executor)


class _Group:
    __slots__ = ("expert_id", "requests", "switch")

    def __init__(self, expert_id: str, switch: float) -> None:
        self.expert_id, self.requests, self.switch = expert_id, deque(), switch


class _Queue:
    """One executor's queue as a sequence of expert groups, with its predicted total time."""

    def __init__(self) -> None:
        self.groups: deque[_Group] = deque()
        self.by_expert: dict[str, _Group] = {}   # the group new requests of an expert join (arranging)
        self.counts: dict[str, int] = {}          # queued requests per expert
        self.est = 0.0
        self.n = 0


class Scheduler:
    """Per-executor queues; `submit` from any thread, `next_batch` from each executor's thread."""

    def __init__(self, executors: list[str], policy: SchedulerPolicy | str = "coserve", *,
                 costs: CostModel | None = None, clock: Callable[[], float] = time.perf_counter,
                 tie_seconds: float = 0.0) -> None:
        if not executors:
            raise ValueError("a scheduler needs at least one executor")
        self.policy = make_scheduler_policy(policy) if isinstance(policy, str) else policy
        self.costs = costs or FixedCosts()
        self.tie_seconds = tie_seconds
        self.names = list(executors)
        self._q = {e: _Queue() for e in executors}
        self._rr = itertools.cycle(self.names)
        self._cond = threading.Condition()
        self._closed = False
        self._clock = clock
        self.decisions = 0
        self.decision_seconds = 0.0

    # -- submit ---------------------------------------------------------------------
    def submit(self, request: Request) -> str:
        """Assign, arrange and queue a request; returns the executor it went to."""
        with self._cond:
            t0 = self._clock()
            name, added, switch = self._assign(request.expert_id)
            q = self._q[name]
            x = request.expert_id
            group = q.by_expert.get(x) if self.policy.arrange else (
                q.groups[-1] if q.groups and q.groups[-1].expert_id == x else None)
            if group is None:
                group = _Group(x, switch)
                q.groups.append(group)
                q.by_expert[x] = group
            group.requests.append(request)
            q.counts[x] = q.counts.get(x, 0) + 1
            q.est += added
            q.n += 1
            self.decisions += 1
            self.decision_seconds += self._clock() - t0
            self._cond.notify_all()
            return name

    def added_latency(self, executor: str, expert_id: str) -> tuple[float, float]:
        """(added seconds, switch seconds) if a request for `expert_id` joins `executor`'s queue."""
        q = self._q[executor]
        K, B = self.costs.exec_cost(executor, expert_id)
        n = q.counts.get(expert_id, 0)
        if n and (self.policy.arrange or (q.groups and q.groups[-1].expert_id == expert_id)):
            mb = self.costs.max_batch(executor, expert_id, memory=False)
            return K + (B if n % mb == 0 else 0.0), 0.0
        switch = 0.0 if n else self.costs.switch_cost(executor, expert_id)
        return K + B + switch, switch

    def _assign(self, expert_id: str) -> tuple[str, float, float]:
        how = self.policy.assign
        if how == "round-robin" or len(self.names) == 1:
            name = next(self._rr) if how == "round-robin" else self.names[0]
            return (name, *self.added_latency(name, expert_id))
        if how == "affinity":
            holders = [n for n in self.names if self._q[n].counts.get(expert_id)] or \
                      [n for n in self.names if expert_id in self.costs.resident(n)] or self.names
            name = min(holders, key=lambda n: self._q[n].n)
            return (name, *self.added_latency(name, expert_id))
        # cost: minimise the maximum total queue time; ties -> smallest added latency.  Predicted
        # makespans within `tie_seconds` of the best count as ties: the predictions are not that exact.
        ests = sorted(((self._q[n].est, n) for n in self.names), reverse=True)
        top, top_name = ests[0][0], ests[0][1]
        second = ests[1][0] if len(ests) > 1 else 0.0
        cands = []
        for i, name in enumerate(self.names):
            added, switch = self.added_latency(name, expert_id)
            others = second if name == top_name else top
            cands.append((max(others, self._q[name].est + added), added, i, name, switch))
        floor = min(c[0] for c in cands) + self.tie_seconds
        _, added, _, name, switch = min((c for c in cands if c[0] <= floor), key=lambda c: (c[1], c[0], c[2]))
        return name, added, switch

    # -- take -------------------------------------------------------------------------
    def next_batch(self, executor: str, timeout: float | None = None) -> Batch | None:
        """The head group of `executor`'s queue, split to the max executable batch."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            q = self._q[executor]
            while not q.groups:
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            group = q.groups[0]
            x = group.expert_id
            cap = max(1, self.costs.max_batch(executor, x, memory=self.policy.split))
            take = min(cap, len(group.requests))
            requests = [group.requests.popleft() for _ in range(take)]
            K, B = self.costs.exec_cost(executor, x)
            q.est = max(0.0, q.est - (K * take + B + group.switch))
            group.switch = 0.0
            q.counts[x] -= take
            q.n -= take
            if not q.counts[x]:
                del q.counts[x]
            if not group.requests:
                q.groups.popleft()
                if q.by_expert.get(x) is group:
                    del q.by_expert[x]
            return Batch(executor, x, requests)

    # -- queries ------------------------------------------------------------------------
    def depth(self) -> int:
        with self._cond:
            return sum(q.n for q in self._q.values())

    def queued_experts(self, executor: str) -> list[str]:
        """Experts in queue order (one entry per queued request)."""
        with self._cond:
            return [g.expert_id for g in self._q[executor].groups for _ in g.requests]

    def queued_set(self, executor: str) -> set[str]:
        with self._cond:
            return set(self._q[executor].counts)

    def next_expert(self, executor: str, current: str) -> str | None:
        """The expert of the first queued group that is not `current`: what to prefetch."""
        with self._cond:
            for g in self._q[executor].groups:
                if g.expert_id != current:
                    return g.expert_id
            return None

    def drained(self, executor: str) -> bool:
        """True once the scheduler is closed and `executor` has nothing left to run."""
        with self._cond:
            return self._closed and not self._q[executor].groups

    def close(self) -> None:
        """Wake every waiting executor; queued requests are still handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
