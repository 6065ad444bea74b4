"""The background loader: the next group's expert loads while the current batch computes.

Loading is file reads and copies, computing is torch kernels; both release the
GIL, so a thread overlaps them.  A failed prefetch is not an error here: the
executor will meet the same failure when it needs the expert, and report it
against the frames that needed it.

When the prefetch is decided and when it reads are two moments (`plan`, `go`).
The executor decides it when it takes a batch, before the batch's own load:
the room is reserved then, so the pool's books and the scheduler's cost model
(`remaining`) see the expert as arriving on this executor from that moment,
and the scheduler does not send its next frames to read it somewhere else.
The read itself waits for `go`, which the executor gives once its own load
has returned: a prefetch never goes ahead of its own batch's load, nor of the
demand reads other executors issued before it (the simulator books the SSD in
the same order, `executors/simdevice.py`).  A plan not yet released is dropped
when a newer one comes; released plans are read in order.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

log = logging.getLogger(__name__)


class Deferred:
    """A submit for `Pool.acquire_async` that keeps the load, to run later in whichever thread calls `run`.

    The room is reserved when `acquire_async` returns; cancelling `future`
    before `run` gives it back (the pool drops a cancelled reservation)."""

    def __init__(self) -> None:
        self.load = None
        self.future: Future | None = None
        self.read = None      # the scheduler's count of its SSD read, if any (`Scheduler.plan_read`)

    def __call__(self, load) -> Future:
        self.load, self.future = load, Future()
        return self.future

    def run(self):
        """Run the kept load; its handle, or None if it was cancelled.  A failed load raises (the future
        holds the same error)."""
        if self.future is None or not self.future.set_running_or_notify_cancel():
            return None
        try:
            handle = self.load()
        except BaseException as exc:
            self.future.set_exception(exc)
            raise
        self.future.set_result(handle)
        return handle


class Prefetcher:
    def __init__(self, pool, name: str, *, clock=time.monotonic) -> None:
        self.pool, self.name, self._clock = pool, name, clock
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._planned: tuple[str, Deferred] | None = None   # reserved, waiting for `go`
        self._ready: deque[tuple[str, Deferred]] = deque()  # released by `go`, not yet taken by the thread
        self._reports: deque[tuple[str, Deferred]] = deque()   # plans whose victims this thread reports next
        self._loading: dict[str, tuple[Deferred, float, float]] = {}   # expert -> (its plan, from, expected s)
        self.loaded = 0
        self.dropped = 0      # plans given up before they read (a newer plan came, or the prefetcher closed)
        self._thread = threading.Thread(target=self._loop, name=f"prefetch-{name}", daemon=True)
        self._thread.start()

    def plan(self, expert_id: str | None, expected: float = 0.0, *, since: float | None = None,
             read=None) -> bool:
        """Reserve room for `expert_id` now; its read waits for `go`.  `expected`: seconds until it is in,
        by the cost model (the batch's own load included), counted from `since` on this prefetcher's clock
        (default now), which `remaining` counts down.  The reservation's victims are reported by this
        prefetcher's thread as soon as it is free, ahead of any read (a GPU victim's copy down into the
        host tier runs there, not in the caller's thread, and not only when the read starts).  False when there is
        nothing to do: no expert, already present or loading, closed, or no room next to pinned experts
        now (the batch that needs it will load it).  `read`: the scheduler's count of this read in its SSD
        backlog (`Scheduler.plan_read`), started when the read starts and ended when it is over or dropped."""
        ok = self._plan(expert_id, expected, since, read)
        if not ok and read is not None:
            read.end()
        return ok

    def _plan(self, expert_id: str | None, expected: float, since: float | None, read) -> bool:
        """`plan` without ending `read` when it returns False."""
        if expert_id is None or self.pool.present(expert_id):
            return False
        with self._cond:
            stale, self._planned = self._planned, None
            stop = self._stop
        self._drop(stale)
        if stop:
            return False
        held = Deferred()                 # the read waits for `go`
        held.read = read
        try:
            got = self.pool.acquire_async(expert_id, held)
        except Exception as exc:  # noqa: BLE001 - the batch that needs it meets the same error
            log.debug("prefetch of %s on %s not planned: %s", expert_id, self.name, exc)
            return False
        if got is None:
            return False
        if held.future is None:           # a hit after all: nothing to read
            self.pool.release(got.result())
            return False
        with self._cond:
            if not self._stop:
                self._planned = (expert_id, held)
                self._loading[expert_id] = (held, self._clock() if since is None else since, expected)
                self._reports.append((expert_id, held))   # its victims move down on this thread, not the caller's
                self._cond.notify_all()
                return True
        self._drop((expert_id, held))     # closed meanwhile: no thread will read it
        return False

    def now(self) -> float:
        """This prefetcher's clock (what `plan`'s `since` is read on)."""
        return self._clock()

    def go(self) -> None:
        """The batch's own load has returned: the planned read may start.  Released plans are read in
        order, each after the one before: its room is taken and its victims are gone already, and the
        simulator reads every plan too."""
        with self._cond:
            plan, self._planned = self._planned, None
            if plan is None:
                return
            if not self._stop:
                self._ready.append(plan)
                self._cond.notify_all()
                return
        self._drop(plan)

    def hint(self, expert_id: str | None, expected: float = 0.0) -> None:
        """Load `expert_id` now: `plan` and `go` at once."""
        if self.plan(expert_id, expected):
            self.go()

    def remaining(self, expert_id: str) -> float:
        """Seconds until `expert_id`, planned or loading here, is in, by the cost model's estimate made when it
        was planned (0 when it is neither, or has run past the estimate).  The scheduler's `fill` reads it
        through the cost model's `arriving`: a head whose expert is still coming is a wait; its `hold`
        waits that long at most for the load (the pool's load event wakes it sooner)."""
        with self._cond:
            got = self._loading.get(expert_id)
        if got is None or self.pool.contains(expert_id):   # in already: the pool's load event runs before this clears
            return 0.0
        _, started, expected = got
        return max(expected - (self._clock() - started), 0.0)

    def idle(self, timeout: float = 5.0) -> bool:
        """Wait until nothing released is pending or loading, and every plan's victims are reported (tests and
        benchmarks use this)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._ready and not self._reports and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            stale = [self._planned, *self._ready]
            self._planned = None
            self._ready.clear()
            self._cond.notify_all()
        for s in stale:
            self._drop(s)
        self._thread.join(5)

    def _drop(self, plan: tuple[str, Deferred] | None) -> None:
        """A plan that will never read: cancelling its future gives the pool its room back (`acquire_async`)."""
        if plan is None:
            return
        eid, held = plan
        self._forget(eid, held)
        if held.read is not None:
            held.read.end()
        if held.future.cancel():
            self.dropped += 1

    def _forget(self, eid: str, held: Deferred) -> None:
        """Stop counting `eid` down, unless a newer plan of the same expert has replaced this one."""
        with self._cond:
            if self._loading.get(eid, (None,))[0] is held:
                del self._loading[eid]

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._ready or self._reports or self._stop)
                if self._stop:
                    return
                self._busy = True
                report = self._reports.popleft() if self._reports else None
                if report is None:
                    eid, held = self._ready.popleft()
                else:
                    eid, held = report
            try:
                if report is not None:
                    # only while the plan stands: a dropped plan's report must not take a newer reservation's
                    if not held.future.done():
                        self.pool.report_victims(eid, held.future)
                else:
                    self._read(eid, held)
            except Exception:  # noqa: BLE001 - nothing here may stop the prefetches
                log.exception("prefetch %s: handling %s failed", self.name, eid)
            finally:
                held = report = None       # a failed load's traceback must not keep its victims' memory
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _read(self, eid: str, held: Deferred) -> None:
        """Run a released plan's load; whatever happens, its reservation is filled or given back."""
        try:
            if held.read is not None:
                try:
                    held.read.start()
                except Exception:  # noqa: BLE001 - only the backlog's count: the read goes on
                    log.exception("prefetch %s: counting the read of %s failed", self.name, eid)
            handle = held.run()
            if handle is not None:
                self.pool.release(handle)
                self.loaded += 1
        except Exception as exc:  # noqa: BLE001 - the executor reports it when it needs the expert
            log.debug("prefetch of %s on %s failed: %s", eid, self.name, exc)
        finally:
            if not held.future.done():
                held.future.cancel()           # never ran: give the room back, no entry stays loading
            if held.read is not None:
                held.read.end()
            self._forget(eid, held)
