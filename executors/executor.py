"""An executor: one thread that takes batches for its device and runs them.

Each executor owns a model pool.  A batch pins its expert in the pool for the
length of the run, so eviction can never pull weights out from under it.  A
failure (corrupt weights, an exception in the model) becomes an error result
for exactly the frames of that batch; the executor keeps serving.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from coe import CoEModel, StepOutput

from .backends import get_backend
from .scheduler import Batch, GroupingScheduler

log = logging.getLogger(__name__)


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


class ModuleSource:
    """Pool source that reads an expert from the store and builds a ready-to-run module."""

    def __init__(self, store, model: CoEModel, device: str) -> None:
        self.store, self.model, self.device = store, model, device

    def size(self, expert_id: str) -> int:
        return self.store.nbytes(expert_id)

    def load(self, expert_id: str):
        expert = self.model.experts[expert_id]
        tensors = self.store.read(expert_id)
        return get_backend(expert.arch).build(expert, tensors, self.device)


class Executor:
    """Runs batches from `scheduler` for executor `name` until the scheduler closes and drains."""

    def __init__(self, name: str, device: str, pool, scheduler: GroupingScheduler, model: CoEModel,
                 on_result: Callable[[BatchResult], None]) -> None:
        self.name, self.device, self.pool, self.scheduler, self.model = name, device, pool, scheduler, model
        self._on_result = on_result
        self._thread = threading.Thread(target=self._loop, name=f"executor-{name}", daemon=True)
        self.batches = 0

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            batch = self.scheduler.next_batch(self.name, timeout=0.25)
            if batch is None:
                if self.scheduler.drained(self.name):
                    return
                continue
            self._on_result(self.run_batch(batch))

    def run_batch(self, batch: Batch) -> BatchResult:
        started, t0 = time.time(), time.perf_counter()
        expert = self.model.experts[batch.expert_id]
        handle = None
        try:
            while handle is None:
                handle = self.pool.acquire(batch.expert_id)
                if handle is None:  # pinned experts hold the room; wait for a release
                    time.sleep(0.005)
            images = [r.frame.image for r in batch.requests]
            outputs = get_backend(expert.arch).run(handle.value, expert, images)
            if len(outputs) != len(images):
                raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(images)} images")
            result = BatchResult(batch, self.name, self.device, started, time.perf_counter() - t0, outputs=outputs)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error verdict, never a lost frame
            kind = "expert_load" if type(exc).__name__ in ("ExpertLoadError", "PoolFullError") else "expert_run"
            log.error("batch %d on %s (%s) failed: %s", batch.id, self.name, batch.expert_id, exc)
            log.debug("%s", traceback.format_exc())
            result = BatchResult(batch, self.name, self.device, started, time.perf_counter() - t0,
                                 error=f"{batch.expert_id}: {exc}", error_kind=kind)
        finally:
            if handle is not None:
                self.pool.release(handle)
        self.batches += 1
        return result
