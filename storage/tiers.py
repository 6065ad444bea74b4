"""The tier sources: how bytes get from SSD to host memory to device memory.

SSD -> host: `StoreSource` reads an expert file sequentially into one private
buffer (pinned when a GPU will copy from it, so the copy can be asynchronous).
Host -> device: `TierSource` copies a parent tier's buffer into the device tier,
on CUDA with a non-blocking copy on a side stream, and records how many bytes
the allocator really handed out (`measured_nbytes`), which the pool accounts.
With unified memory (Jetson) the parent is the store itself: the host buffer
is only staging and is dropped after the copy, so no expert is held twice.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from .flat import FlatWeights
from .pool import Pool


class StoreSource:
    """SSD tier: the expert store, read into host memory."""

    def __init__(self, store, *, pin: bool = False) -> None:
        self.store, self.pin = store, pin

    def size(self, expert_id: str) -> int:
        return self.store.nbytes(expert_id)

    def load(self, expert_id: str) -> FlatWeights:
        return self.store.read_flat(expert_id, pin=self.pin)


class TierSource:
    """Loads into `device` memory from a parent pool (held only for the copy) or a plain source."""

    def __init__(self, parent: Pool | StoreSource, device: str, *, wait: float = 60.0) -> None:
        import torch

        self.parent, self.device, self._wait = parent, torch.device(device), wait
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.Lock()  # one copy at a time per device tier keeps the measurement honest

    def size(self, expert_id: str) -> int:
        return self.parent.source.size(expert_id) if isinstance(self.parent, Pool) else self.parent.size(expert_id)

    def load(self, expert_id: str) -> FlatWeights:
        if not isinstance(self.parent, Pool):
            return self._copy(self.parent.load(expert_id))
        deadline = time.monotonic() + self._wait
        while (handle := self.parent.acquire(expert_id)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"'{expert_id}': the {self.parent.tier} tier stayed full of pinned experts")
            time.sleep(0.002)
        try:
            return self._copy(handle.value)
        finally:
            self.parent.release(handle)

    def _copy(self, src: FlatWeights) -> FlatWeights:
        import torch

        with self._lock:
            if self._stream is None:
                return src.to(str(self.device))
            before = torch.cuda.memory_allocated(self.device)
            with torch.cuda.stream(self._stream):
                dst = torch.empty(src.nbytes, dtype=torch.uint8, device=self.device)
                dst.copy_(src.buffer, non_blocking=src.buffer.is_pinned())
                done = self._stream.record_event()
            done.synchronize()  # the parent may evict its buffer as soon as we return
            out = FlatWeights(src.layout, dst)
            out.measured_nbytes = torch.cuda.memory_allocated(self.device) - before  # type: ignore[attr-defined]
            return out


def measured_nbytes(value: Any) -> int:
    """What a pool should account for a loaded value: the allocator's figure where there is one."""
    return int(getattr(value, "measured_nbytes", 0) or getattr(value, "nbytes", 0))
