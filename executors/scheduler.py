"""Request scheduling onto executor queues, grouping requests by expert.

This is the simple scheduler of the first release: it assigns a request to the
executor that already has its expert (resident or queued), else to the shortest
queue, and arranges it behind the last queued request for the same expert so
that one load serves a whole batch.  `fcfs` keeps arrival order and only
batches neighbours, which is what Samba-CoE does.  The full CoServe cost model
(K*n+B, switch latency, min-max assignment) replaces `_assign` in a later issue.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


class GroupingScheduler:
    """Per-executor queues; `submit` from any thread, `next_batch` from each executor's thread."""

    def __init__(self, executors: list[str], *, max_batch: int = 16, policy: str = "grouped",
                 resident: Callable[[str], set[str]] | None = None) -> None:
        if policy not in ("grouped", "fcfs"):
            raise ValueError(f"unknown scheduler policy '{policy}' (known: fcfs, grouped)")
        if not executors:
            raise ValueError("a scheduler needs at least one executor")
        self.policy, self.max_batch = policy, max_batch
        self._queues: dict[str, list[Request]] = {e: [] for e in executors}
        self._resident = resident or (lambda name: set())
        self._cond = threading.Condition()
        self._closed = False

    def submit(self, request: Request) -> str:
        """Queue a request; returns the executor it went to."""
        with self._cond:
            name = self._assign(request)
            queue = self._queues[name]
            pos = len(queue)
            if self.policy == "grouped":
                for i in range(len(queue) - 1, -1, -1):
                    if queue[i].expert_id == request.expert_id:
                        pos = i + 1
                        break
            queue.insert(pos, request)
            self._cond.notify_all()
            return name

    def _assign(self, request: Request) -> str:
        if len(self._queues) == 1:
            return next(iter(self._queues))
        for name, queue in self._queues.items():
            if any(r.expert_id == request.expert_id for r in queue):
                return name
        holders = [n for n in self._queues if request.expert_id in self._resident(n)]
        candidates = holders or list(self._queues)
        return min(candidates, key=lambda n: len(self._queues[n]))

    def next_batch(self, executor: str, timeout: float | None = None) -> Batch | None:
        """The head group of `executor`'s queue (up to max_batch), waiting up to `timeout` for one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            queue = self._queues[executor]
            while not queue:
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            expert = queue[0].expert_id
            take = 1
            while take < len(queue) and take < self.max_batch and queue[take].expert_id == expert:
                take += 1
            requests = queue[:take]
            del queue[:take]
            return Batch(executor, expert, requests)

    def depth(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def next_expert(self, executor: str, current: str) -> str | None:
        """The expert of the first queued request that is not `current`: what to prefetch."""
        with self._cond:
            for r in self._queues[executor]:
                if r.expert_id != current:
                    return r.expert_id
            return None

    def queued_experts(self, executor: str) -> list[str]:
        with self._cond:
            return [r.expert_id for r in self._queues[executor]]

    def drained(self, executor: str) -> bool:
        """True once the scheduler is closed and `executor` has nothing left to run."""
        with self._cond:
            return self._closed and not self._queues[executor]

    def close(self) -> None:
        """Wake every waiting executor; queued requests are still handed out."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
