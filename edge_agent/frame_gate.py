"""Every frame runs on one version of the expert set: the one live when the agent accepted it.

A promotion replaces several experts at once (a classifier and the detector it
hands ok parts to, say).  Without care a frame whose classifier ran on version
1 could meet version 2 of its detector: each batch is consistent, the frame is
not.  When the store watcher sees a new manifest it closes this gate:

- frames accepted from then on are held (journaled and acked as usual, not yet
  scheduled);
- the frames already in flight finish on the old versions, whose files the
  store keeps for a live reader (`storage/store_readers.py`);
- once they have all committed, the watcher switches the store to the new
  manifest and opens the gate: the held frames run on the new versions.

Nothing restarts and nothing is dropped: a held frame is in the agent's
in-flight table like any other (so backpressure counts it) and in the journal
(so a crash re-runs it).  The pause is one drain of the frames in flight.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

_A = TypeVar("_A")


class FrameGate(Generic[_A]):
    """Holds newly accepted frames while the frames in flight drain.

    `lock` is the agent's condition guarding `inflight` (frame id -> its
    flight; notified whenever verdicts commit); `submit` schedules accepted
    frames and is called outside the lock.
    """

    def __init__(self, lock: threading.Condition, inflight: Mapping[str, object],
                 submit: Callable[[Sequence[_A]], None], frame_id: Callable[[_A], str]) -> None:
        self._lock, self._inflight, self._submit, self._id = lock, inflight, submit, frame_id
        self._held: list[_A] | None = None     # None: open
        self._draining: set[str] = set()       # frames in flight when the gate closed, not yet committed
        self.holds = 0                         # times closed (metrics, tests)
        self.held_total = 0                    # frames that waited behind it

    @property
    def closed(self) -> bool:
        return self._held is not None

    def admit(self, accepted: Sequence[_A]) -> Sequence[_A]:
        """Under the agent's lock: the frames to schedule now (none while closed; those are kept)."""
        if self._held is None:
            return accepted
        self._held.extend(accepted)
        self.held_total += len(accepted)
        return ()

    def close(self) -> int:
        """Hold new frames from now on; returns how many frames are in flight and must drain first."""
        with self._lock:
            if self._held is None:
                self._held = []
                self.holds += 1
                self._draining = set(self._inflight)
            return len(self._draining)

    def in_flight(self) -> int:
        """Frames accepted before the gate closed that have no committed verdict yet."""
        with self._lock:
            self._draining = {f for f in self._draining if f in self._inflight}
            return len(self._draining)

    def wait_drained(self, timeout: float) -> bool:
        """Block up to `timeout` s until every frame in flight at `close` has committed."""
        with self._lock:
            return self._lock.wait_for(lambda: not any(f in self._inflight for f in self._draining), timeout)

    def open(self) -> int:
        """Schedule the held frames and stop holding; returns how many were held."""
        with self._lock:
            held, self._held, self._draining = self._held or [], None, set()
        if held:
            self._submit(held)
        return len(held)
