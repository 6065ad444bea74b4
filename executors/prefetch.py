"""The background loader: the next group's expert loads while the current batch computes.

Loading is file reads and copies, computing is torch kernels; both release the
GIL, so a thread overlaps them.  Only the latest hint matters: if the executor
moves on, a stale hint is dropped.  A failed prefetch is not an error here: the
executor will meet the same failure when it needs the expert, and report it
against the frames that needed it.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, pool, name: str, *, clock=time.monotonic) -> None:
        self.pool, self.name, self._clock = pool, name, clock
        self._hint: tuple[str, float] | None = None   # (expert, expected load seconds)
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._loading: tuple[str, float, float] | None = None   # (expert, started, expected seconds)
        self.loaded = 0
        self._thread = threading.Thread(target=self._loop, name=f"prefetch-{name}", daemon=True)
        self._thread.start()

    def hint(self, expert_id: str | None, expected: float = 0.0) -> None:
        """Load `expert_id` next; `expected` is the cost model's load time for it now (see `remaining`)."""
        if expert_id is None:
            return
        with self._cond:
            self._hint = (expert_id, expected)
            self._cond.notify()

    def remaining(self, expert_id: str) -> float:
        """Seconds the load of `expert_id` under way here still needs, by the cost model's estimate made when
        it was hinted (0 when it is not loading here, or has run past the estimate).  The scheduler's `fill`
        reads it through the cost model's `arriving`: a head whose expert is still loading is a wait."""
        with self._cond:
            if self._loading is None or self._loading[0] != expert_id:
                return 0.0
            _, started, expected = self._loading
        if self.pool.contains(expert_id):   # in already: the pool's load event runs before this clears
            return 0.0
        return max(expected - (self._clock() - started), 0.0)

    def idle(self, timeout: float = 5.0) -> bool:
        """Wait until no hint is pending or loading (tests and benchmarks use this)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._hint is None and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(5)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._hint is not None or self._stop)
                if self._stop:
                    return
                (eid, expected), self._hint, self._busy = self._hint, None, True
            try:
                if not self.pool.contains(eid):
                    with self._cond:
                        self._loading = (eid, self._clock(), expected)
                    handle = self.pool.acquire(eid)
                    if handle is not None:
                        self.pool.release(handle)
                        self.loaded += 1
            except Exception as exc:  # noqa: BLE001 - the executor reports it when it needs the expert
                log.debug("prefetch of %s on %s failed: %s", eid, self.name, exc)
            finally:
                with self._cond:
                    self._busy, self._loading = False, None
                    self._cond.notify_all()
