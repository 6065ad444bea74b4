"""Where a missing expert is computed in place: the memory map on a CPU box, a CPU thread on a GPU box (Fiddler).

Issue 11 item 3 (importance paper Alg. 2; Fiddler, Kamahori et al. 2024).
`moe_split` decides which of a layer's misses to load (`choose_split`, a
pure rule over measured costs per source); this module is the mechanism that computes
the others where their weights already are, without entering the pool and
without evicting anything.

- `HostWeights` finds an expert's weights in host memory: the host tier's
  copy when the host tier holds it (pinned there until the computation is
  done, so a host-tier load cannot refill that buffer under the matmul),
  else the expert file's memory map (the page cache).
- `MappedInPlace` (a CPU pool): the matmul runs on the calling thread
  before the layer's loads start, as the CPU split always did.
- `ThreadInPlace` (a CUDA pool, Fiddler): the matmul runs on a CPU thread of
  its own, started before the layer's loads, so it overlaps the loader
  threads' host-to-GPU copies and the GPU's computation of the loaded
  experts.  Its inputs are the layer's hidden states copied to the host
  once; its result (a few tokens' rows) is copied to the device and added
  in ascending expert order with the other parts, as the eager loop adds
  them.  With a CPU pool the same code runs with the CPU playing the
  device, which is how the tests check it bit for bit.

The costs the split rule reads are measured here and by the layer: C_other
is all the time one in-place expert holds its thread (taking its weights and
the matmuls), filed under its source (the host tier's copy or the file);
C_load is the layer's wall time until its last load finished, per load
(`PooledExperts.forward`), filed under a source only when all of the
layer's loads came from one.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from storage.pool import Handle, Pool
from storage.tiers import uniform_dtype

from .moe_split import FILE, HOST

if TYPE_CHECKING:
    import torch

    from storage.expert_store import ExpertStore

    from .moe_split import LoadComputeSplit

# expert index, its weights, hidden states, expert mask, top-k weights -> (top-k positions, token rows, contribution)
ExpertFn = Callable[[int, dict, "torch.Tensor", "torch.Tensor", "torch.Tensor"], tuple]


def host_tier_of(pool: Pool) -> Pool | None:
    """The host-tier pool a device pool loads through (`TierSource` over a `Pool`), or None."""
    from storage.tiers import TierSource

    source = pool.source
    return source.parent if isinstance(source, TierSource) and isinstance(source.parent, Pool) else None


@dataclass
class HostReads:
    from_host: int = 0      # computed on the host tier's copy
    from_file: int = 0      # computed on the file's memory map (the host tier did not hold it)
    file_bytes: int = 0     # bytes of the experts computed from their files (read from disk when cold)


class HostWeights:
    """An expert's weights in host memory, taken without loading it into any pool."""

    def __init__(self, store: "ExpertStore", host: Pool | None = None, *, drop_after_read: bool = False) -> None:
        self.store, self.host = store, host
        # as the pools' `drop_after_read`: a box whose RAM is the budget has no page cache to keep the files
        # in, so an in-place expert is dropped from it once computed and the next one reads the disk again
        self.drop_after_read = drop_after_read
        # a file's tensors are views of its memory map (`ExpertStore.map_flat`), not a copy in fresh memory: the
        # page cache holds the expert while it is computed (with admission, that much memory is set aside)
        self._maps: dict[int, object] = {}   # thread -> the MappedFlat it holds between open and close
        self.reads = HostReads()
        self._lock = threading.Lock()

    def open(self, expert_id: str) -> tuple[dict, Handle | None]:
        """(tensors, handle): the handle pins the host tier's copy until `close`; None for a file's bytes."""
        handle = self.host.hold(expert_id) if self.host is not None else None
        with self._lock:
            if handle is not None:
                self.reads.from_host += 1
            else:
                self.reads.from_file += 1
                self.reads.file_bytes += self.store.nbytes(expert_id)
        if handle is not None:
            return handle.value.tensors(), handle
        dtype = uniform_dtype(self.store, expert_id)        # what the pools load it in, so the arithmetic is theirs
        mapped = self.store.map_flat(expert_id, dtype=dtype)
        # compressed, cast on the way in, or off 64 bytes (an older file): no plain bytes to map as a pool's buffer
        # holds them; a private copy instead, one expert's size (what
        # admission sets aside; its file's pages pass through the page cache on the way, as a pool load's do)
        if mapped is None:
            return self.store.read_flat(expert_id, dtype=dtype).tensors(), None
        self._maps[threading.get_ident()] = mapped
        return mapped.tensors(), None

    def close(self, handle: Handle | None, expert_id: str | None = None) -> None:
        """Unpin the host tier's copy, unmap a mapped file; a file's pages leave the cache with `drop_after_read`."""
        mapped = self._maps.pop(threading.get_ident(), None)
        if mapped is not None:
            mapped.close()
        if handle is not None:
            self.host.release(handle)
        elif self.drop_after_read and expert_id is not None:
            from storage.pagecache import drop_from_page_cache

            try:
                drop_from_page_cache(self.store.path(expert_id))
            except OSError:   # a promotion removed the file meanwhile: nothing of it is left to drop
                pass


class InPlaceParts:
    """The in-place parts of one layer: started before its loads, collected after its loaded experts."""

    def __init__(self, parts: dict[int, "Future | tuple"], device: "torch.device") -> None:
        self._parts, self._device = parts, device

    def __len__(self) -> int:
        return len(self._parts)

    def results(self) -> dict[int, tuple]:
        """{expert: (top-k positions, token rows, contribution)} on the layer's device; raises a job's error."""
        out = {}
        for e, part in self._parts.items():
            pos, tok, contrib = part.result() if isinstance(part, Future) else part
            if contrib.device != self._device:
                pos, tok, contrib = pos.to(self._device), tok.to(self._device), contrib.to(self._device)
            out[e] = (pos, tok, contrib)
        return out


class MappedInPlace:
    """A CPU pool: each in-place expert computed on the calling thread, from host memory, before the loads."""

    threaded = False

    def __init__(self, weights: HostWeights, split: "LoadComputeSplit") -> None:
        self.weights, self.split = weights, split

    def _one(self, compute: ExpertFn, e: int, expert_id: str, hidden_states, expert_mask, top_k_weights) -> tuple:
        # the in-place cost the split weighs is all the time this expert holds its thread: taking its weights
        # (a file read when neither the host tier nor the page cache holds it) and the matmuls; timing the
        # matmuls alone left the read out
        from .pooled_experts import DECODE_TOKENS, _demand_add

        t0 = time.perf_counter()
        _demand_add(1)          # a layer waits for this expert: a prefetch's read gives way to its file's pages
        counted = True
        try:
            tensors, handle = self.weights.open(expert_id)
            if handle is not None:          # the host tier's copy: no disk involved
                _demand_add(-1)
                counted = False
            try:
                part = compute(e, tensors, hidden_states, expert_mask, top_k_weights)
                if len(hidden_states) <= DECODE_TOKENS:  # a prefill's (a declined expert's) cost is not a step's
                    self.split.measured(compute=time.perf_counter() - t0, source=FILE if handle is None else HOST)
                return part
            finally:
                del tensors   # the views into the memory map go before its pages are dropped
                self.weights.close(handle, expert_id)
        finally:
            if counted:
                _demand_add(-1)

    def start(self, compute: ExpertFn, experts: Sequence[tuple[int, str]], hidden_states, expert_mask,
              top_k_weights) -> InPlaceParts:
        parts = {e: self._one(compute, e, eid, hidden_states, expert_mask, top_k_weights) for e, eid in experts}
        return InPlaceParts(parts, hidden_states.device)

    def close(self) -> None:
        pass


class ThreadInPlace(MappedInPlace):
    """Fiddler: in-place experts computed on a CPU thread while the device pool's loads proceed.

    One thread by default: it shares the cores with torch's own intra-op
    threads, and a decode step's in-place experts are few (`choose_loads`
    balances their count against the loads').
    """

    threaded = True

    def __init__(self, weights: HostWeights, split: "LoadComputeSplit", *, threads: int = 1) -> None:
        super().__init__(weights, split)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coe-inplace-cpu")

    def start(self, compute: ExpertFn, experts: Sequence[tuple[int, str]], hidden_states, expert_mask,
              top_k_weights) -> InPlaceParts:
        import torch

        cpu = torch.device("cpu")
        # one device-to-host copy per layer: the hidden rows, the routing mask and the gate weights
        h, mask, w = (t.to(cpu) for t in (hidden_states, expert_mask, top_k_weights))
        parts = {e: self._pool.submit(self._one, compute, e, eid, h, mask, w) for e, eid in experts}
        return InPlaceParts(parts, hidden_states.device)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
