"""An executor: one thread that takes batches for its device and runs them.

Each executor owns a model pool and a set of module skeletons.  A batch pins
its expert in the pool for the length of the run, so eviction can never pull
weights out from under it; while it computes, the prefetcher loads the next
group's expert.  A failure becomes an error result for exactly the frames of
that batch; an expert whose weights cannot load is marked failed, so its later
frames get the same clear reason at once instead of retrying the disk.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from coe import CoEError, CoEModel, ExpertLoadError, StepError, StepOutput
from storage.pool import WAIT_CHECK_S

from .backends import get_backend
from .prefetch import Deferred, Prefetcher
from .scheduler import Batch, Scheduler
from .skeletons import Skeletons

log = logging.getLogger(__name__)
NEXT_BATCH_TRIES = 3   # a scheduler fault taking a batch is retried this often before the thread gives up
ROOM_WAIT_S = 60.0     # how long a batch waits for pinned experts to leave room for its own before it fails


@dataclass
class BatchResult:
    """What came of one batch: outputs per request, or one error for all of them."""

    batch: Batch
    executor: str
    device: str
    started_at: float
    seconds: float
    outputs: list[StepOutput] | None = None
    error: str | None = None
    error_kind: str = ""
    expert_version: int | None = None    # the store version of the weights that ran (None: not from a store)


def result_problem(result: BatchResult) -> str | None:
    """Why a result without an error cannot be delivered as it is (outputs missing, or not one per request), or None.

    The agent checks every result before it reads outputs request by request:
    a short list would leave the requests past its end without a verdict.
    """
    if result.error is not None:
        return None
    n = len(result.batch.requests)
    if not isinstance(result.outputs, list):
        return f"{result.executor} returned no outputs list for the {n} frame(s) of batch {result.batch.id}"
    if len(result.outputs) != n:
        return (f"{result.executor} returned {len(result.outputs)} output(s) for the {n} frame(s) of batch "
                f"{result.batch.id} (expert {result.batch.expert_id})")
    return None


# what the runtimes say when an allocation fails: torch's CPU allocator ("DefaultCPUAllocator: can't allocate
# memory"), CUDA ("out of memory"), onnxruntime (its own exception classes, not RuntimeError: "Failed to allocate
# memory", "CUDA failure 2: out of memory"), cuDNN/cuBLAS ("CUBLAS_STATUS_ALLOC_FAILED")
_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate memory",
              "_alloc_failed", "bad allocation", "bad_alloc")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says an allocation failed (a smaller batch may fit), whichever runtime raised it."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, Exception) and any(w in text for w in _OOM_WORDS)


def short(exc: BaseException) -> str:
    """An exception as one line of an error verdict: its type and its message's first line, clipped."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__


def _frame_list(batch: Batch, limit: int = 8) -> str:
    ids = [r.frame.frame_id for r in batch.requests]
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def release_device_cache(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


class FailedExperts:
    """Experts whose weights failed to load, with the reason; shared by all executors."""

    def __init__(self) -> None:
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()

    def mark(self, expert_id: str, reason: str) -> bool:
        """Record a failure; True the first time (so it is reported once)."""
        with self._lock:
            first = expert_id not in self._failed
            self._failed.setdefault(expert_id, reason)
            return first

    def reason(self, expert_id: str) -> str | None:
        with self._lock:
            return self._failed.get(expert_id)

    def all(self) -> dict[str, str]:
        with self._lock:
            return dict(self._failed)

    def forget(self, expert_id: str) -> None:
        """A new version of the expert arrived: let it be tried again."""
        with self._lock:
            self._failed.pop(expert_id, None)


class Executor:
    """Runs batches from `scheduler` for executor `name` until the scheduler closes and drains."""

    def __init__(self, name: str, device: str, pool, scheduler: Scheduler, model: CoEModel,
                 on_result: Callable[[BatchResult], None], *, failed: FailedExperts | None = None,
                 prefetch: bool = True, backend_for: Callable[[str], object] = get_backend) -> None:
        self.name, self.device, self.pool, self.scheduler, self.model = name, device, pool, scheduler, model
        self._on_result = on_result
        self.failed = failed or FailedExperts()
        self.backend_for = backend_for    # injectable: tests put a fault-injecting backend here
        self.oom_splits = 0
        self.skeletons = Skeletons(device)
        self.prefetcher = Prefetcher(pool, name) if prefetch else None
        self._thread = threading.Thread(target=self._loop, name=f"executor-{name}", daemon=True)
        self.batches = 0

    def start(self) -> None:
        self._thread.start()

    def _load_estimate(self, expert_id: str) -> float:
        """The cost model's switch time for `expert_id` here now (0 without one that can say)."""
        costs = getattr(self.scheduler, "costs", None)
        try:
            return float(costs.switch_cost(self.name, expert_id)) if costs is not None else 0.0
        except Exception:  # noqa: BLE001 - an estimate only: a prefetch goes ahead without one
            return 0.0

    def _acquire(self, expert_id: str):
        """Pin the batch's expert, and plan the next group's expert's prefetch between reserving and loading it.

        The plan is made here, when the batch is taken, so the scheduler sees the
        next expert as arriving (and its SSD read in the backlog) from now on;
        its read starts once this load has returned (`Prefetcher.go`), behind
        the reads issued before it.  The simulator does the same
        (`executors.simdevice`: `plan_prefetch`, `book_prefetch`).
        """
        pf = self.prefetcher
        since = pf.now() if pf is not None else 0.0
        mine = self._load_estimate(expert_id) if pf is not None else 0.0   # before it is reserved
        own = got = None
        deadline = time.monotonic() + ROOM_WAIT_S
        while got is None:
            own = Deferred()             # this thread loads it, once the next one is planned
            gen = self.pool.generation
            got = self.pool.acquire_async(expert_id, own)
            if got is None:  # pinned experts hold the room; wait for a release
                if time.monotonic() > deadline:   # a pin that is never released: an error verdict, not a spin
                    raise CoEError(f"{self.name}: no room for expert {expert_id} in its pool of "
                                   f"{self.pool.capacity / 1e6:.0f} MB: pinned experts held it for {ROOM_WAIT_S:.0f} s")
                self.pool.wait_changed(gen, WAIT_CHECK_S)
        try:
            if pf is not None:
                self._plan_next(expert_id, mine, since)
            own.run()
        finally:
            if own.future is not None and not own.future.done():
                own.future.cancel()      # never ran (interrupted): give the room back
            if pf is not None:
                try:
                    pf.go()
                except Exception:  # noqa: BLE001 - the batch's own load and its error come first
                    log.exception("%s: starting the prefetch after %s failed", self.name, expert_id)
        return got.result()

    def _plan_next(self, current: str, mine: float, since: float) -> None:
        """Plan the prefetch of the next queued group's expert; `mine`: this batch's own load estimate, made at
        `since`."""
        read = None
        try:
            nxt = self.scheduler.next_expert(self.name, current)
            if nxt is None:
                return
            expected = mine + self._load_estimate(nxt)
            read = self._planned_read(nxt)
            self.prefetcher.plan(nxt, expected, since=since, read=read)
        except Exception:  # noqa: BLE001 - a prefetch is only a gain; the batch goes on without one
            if read is not None:
                read.end()
            log.exception("%s: planning the prefetch after %s failed", self.name, current)

    def _planned_read(self, expert_id: str):
        """The scheduler's count of the prefetch's SSD read (None when it reads no SSD, or the scheduler
        cannot count it: a remote executor's hints)."""
        costs = getattr(self.scheduler, "costs", None)
        plan_read = getattr(self.scheduler, "plan_read", None)
        if costs is None or plan_read is None:
            return None
        try:
            seconds = float(costs.ssd_seconds(self.name, expert_id)) if hasattr(costs, "ssd_seconds") else 0.0
        except Exception:  # noqa: BLE001 - an estimate only, as `_load_estimate`: the prefetch goes ahead uncounted
            return None
        return plan_read(seconds, self.scheduler.channel(self.name)) if seconds > 0 else None

    def prefetch_remaining(self, expert_id: str) -> float:
        """Seconds this executor's prefetch of `expert_id` still needs, estimated (0: none under way)."""
        return self.prefetcher.remaining(expert_id) if self.prefetcher is not None else 0.0

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread, then close the prefetcher; one never started (a failed start) closes at once."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self.prefetcher is not None:
            self.prefetcher.close()
        return not self._thread.is_alive()

    def on_evicted(self, value) -> None:
        self.skeletons.unbind(value)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        faults = 0
        while True:
            try:
                batch = self.scheduler.next_batch(self.name, timeout=0.25)
            except Exception:  # noqa: BLE001 - nothing left the queue: `next_batch` raises only before it takes (its
                # bookkeeping after the take, `_set_cost` included, raises nothing)
                faults += 1
                if faults > NEXT_BATCH_TRIES:   # not transient: the thread ends, the agent's health says so and
                    raise                       # a restart recovers the frames from the journal
                log.exception("%s: taking the next batch failed (%d of %d tries); trying again", self.name,
                              faults, NEXT_BATCH_TRIES)
                time.sleep(0.5 * faults)
                continue
            faults = 0
            if batch is None:
                if self.scheduler.drained(self.name):
                    return
                continue
            result = self.run_batch(batch)
            try:
                self.scheduler.finished(batch)   # its predicted time leaves the queue's estimate
            except Exception:  # noqa: BLE001 - an estimate's bookkeeping: the result is delivered all the same
                log.exception("%s: the scheduler's bookkeeping for batch %d failed", self.name, batch.id)
            try:
                self._on_result(result)
            except Exception as exc:  # noqa: BLE001 - the batch's frames must still get verdicts
                log.exception("handling the result of batch %d failed; its frames get error verdicts", batch.id)
                try:
                    self._on_result(BatchResult(batch, self.name, self.device, result.started_at, result.seconds,
                                                error=f"internal error after the batch ran: {exc}",
                                                error_kind="internal"))
                except Exception:  # noqa: BLE001
                    log.exception("could not even record error verdicts for batch %d", batch.id)

    def _run_splitting(self, module, expert, images: list, top: bool = True) -> list[StepOutput | StepError]:
        """Run a batch; a failure is narrowed to the frames that cause it, which get a `StepError` each.

        Out of memory: split in halves and retry, down to single frames; a frame
        that does not fit even alone is that frame's error, and the halves that
        ran keep their outputs.  Any other error: halves are tried too, down to
        single frames, to find the frames that break the expert (a corrupt
        image, a shape it cannot take).  When every frame fails alone, the
        expert itself is failing: one error for the whole batch.  That costs up
        to 2n-1 runs of a batch of n, every batch; no shortcut is taken, since
        any guess that an expert is failing (a batch whose frames all failed)
        would also fail the good frames of a later batch of a healthy expert.
        """
        try:
            outputs = self.backend_for(expert.arch).run(module, expert, images)
        except Exception as exc:  # noqa: BLE001 - narrowed below; what cannot be narrowed propagates
            oom = is_out_of_memory(exc)
            if len(images) == 1:
                if oom:
                    return [StepError("out_of_memory", f"expert {expert.id} ran out of memory on this frame "
                                                       f"alone on {self.name}: {short(exc)}")]
                raise
            if oom:
                self.oom_splits += 1
                log.warning("%s: batch of %d on %s ran out of memory; splitting and retrying", expert.id,
                            len(images), self.name)
                release_device_cache(self.device)
            half = len(images) // 2
            outs: list[StepOutput | StepError] = []
            for part in (images[:half], images[half:]):
                try:
                    outs += self._run_splitting(module, expert, part, top=False)
                except Exception as part_exc:  # noqa: BLE001 - this half's frames fail; the other's stand
                    outs += [StepError("expert_run", f"expert {expert.id} failed on this frame on {self.name}: "
                                                     f"{short(part_exc)}")] * len(part)
            if top and not oom and all(isinstance(o, StepError) and o.kind == "expert_run" for o in outs):
                raise                             # no frame of it runs: the expert's failure, not a frame's
            return outs
        if len(outputs) != len(images):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(images)} images")
        return outputs

    def run_batch(self, batch: Batch) -> BatchResult:
        started, t0 = time.time(), time.perf_counter()
        handle = None
        try:
            expert = self.model.experts[batch.expert_id]
            known = self.failed.reason(batch.expert_id)
            if known is not None:
                raise ExpertLoadError(batch.expert_id, expert.uri or "<store>", f"marked failed earlier: {known}")
            handle = self._acquire(batch.expert_id)
            module = self.skeletons.bind(expert, handle.value)
            images = [r.frame.image for r in batch.requests]
            outputs = self._run_splitting(module, expert, images)
            for req, out in zip(batch.requests, outputs):
                if isinstance(out, StepError):    # once here, with the frame: the agent gives it its error verdict
                    log.error("batch %d on %s (%s): frame %s: %s", batch.id, self.name, batch.expert_id,
                              req.frame.frame_id, out.message)
            result = BatchResult(batch, self.name, self.device, started, time.perf_counter() - t0, outputs=outputs,
                                 expert_version=getattr(handle.value, "version", None))
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error verdict, never a lost frame
            load_failure = isinstance(exc, ExpertLoadError) or type(exc).__name__ == "PoolFullError"
            if load_failure and self.failed.mark(batch.expert_id, str(exc)):
                log.error("expert %s marked failed: %s", batch.expert_id, exc)
            elif not load_failure:
                log.error("batch %d on %s (%s) failed for its %d frame(s) %s: %s", batch.id, self.name,
                          batch.expert_id, len(batch), _frame_list(batch), exc)
                log.debug("%s", traceback.format_exc())
            result = BatchResult(batch, self.name, self.device, started, time.perf_counter() - t0,
                                 error=str(exc), error_kind="expert_load" if load_failure else "expert_run")
        finally:
            if handle is not None:
                try:
                    self.pool.release(handle)
                except Exception:  # noqa: BLE001 - a bookkeeping bug must not lose the batch's result
                    log.exception("release of %s failed", batch.expert_id)
        self.batches += 1
        return result
