"""The pooled experts module: transformers' experts seam, with weights paged through `Pool`s.

It replaces a model's experts module and keeps its signature,
`forward(hidden_states, top_k_index, top_k_weights)`.  Each expert it needs is
acquired from the pool that holds its (layer, expert) store entry; the pool
loads it (SSD -> host -> device) and evicts by its policy, never knowing it
holds an LLM.

Pinning.  Every expert the layer computes with stays pinned until its
contribution is added; a pinned expert is never a victim, so a load later in
the same layer cannot evict it and refill its buffer under it (the vLLM LFRU
bug: a freshly loaded expert evicted within the same forward pass, its memory
reused, wrong weights used silently).  When the pool cannot hold all of a
layer's experts at once (a prefill touching every expert with a pool of top-k
experts), the layer runs in waves: as many as fit are pinned, computed and
released, then the next.  The misses of a wave load concurrently on loader
threads, and the layer computes expert i while the later ones still load.

Exactness.  The arithmetic is the eager transformers loop, op for op, in
ascending expert order, so logits equal the unmodified model's bit for bit in
fp32 on the CPU whatever the pool size or policy.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from coe import CoEError
from storage.pool import Handle, Pool

WAIT_SECONDS = 60.0
LOADERS = 4         # concurrent expert loads: a cold read at queue depth 2-4 moves ~1.4x the bytes of one at a time

_loader: ThreadPoolExecutor | None = None
_loader_lock = threading.Lock()


def loader() -> ThreadPoolExecutor:
    """The process's expert loader threads, shared by every pooled layer."""
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = ThreadPoolExecutor(max_workers=LOADERS, thread_name_prefix="coe-expert-load")
        return _loader


class PinnedWave:
    """Pin a layer's experts in order, loading the misses concurrently; release them all on exit.

    Room is reserved in order (`Pool.acquire_async`), so the wave is the
    longest prefix of `ids` that fits beside what is pinned, exactly what
    sequential acquires would give; the loads of that prefix run on the loader
    threads.  Iterating yields the handles in order, each as soon as its load
    is done, so the layer computes expert i while expert i+1 still loads.
    """

    def __init__(self, pool_of: Callable[[str], Pool], ids: Sequence[str], wait: float = WAIT_SECONDS,
                 submit: Callable | None = None) -> None:
        self._pool_of, self._ids, self._wait = pool_of, list(ids), wait
        self._submit = submit or loader().submit
        self._futures: list[Future] = []
        self.handles: list[Handle] = []

    def __enter__(self) -> "PinnedWave":
        deadline = time.monotonic() + self._wait
        try:
            for eid in self._ids:
                fut = self._pool_of(eid).acquire_async(eid, self._submit)
                pause = 0.001
                while fut is None and not self._futures:
                    # nothing of ours is pinned, so others hold the room (another layer or request): wait for them
                    if time.monotonic() > deadline:
                        raise CoEError(f"expert '{eid}': its pool stayed full of pinned experts for "
                                       f"{self._wait:.0f} s")
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
                    fut = self._pool_of(eid).acquire_async(eid, self._submit)
                if fut is None:
                    break
                self._futures.append(fut)
        except BaseException:
            self.__exit__(None, None, None)     # what was reserved before the error is released, not leaked
            raise
        return self

    def __len__(self) -> int:
        return len(self._futures)

    def __iter__(self):
        for fut in self._futures[len(self.handles):]:
            self.handles.append(fut.result())
            yield self.handles[-1]

    def __exit__(self, *exc) -> None:
        for fut in self._futures[len(self.handles):]:   # loads never waited for (an error cut the layer short)
            try:
                self.handles.append(fut.result())
            except Exception:  # a failed load left no entry behind; the first error already propagates
                pass
        for h in self.handles:
            self._pool_of(h.expert_id).release(h)
        self.handles, self._futures = [], []


class PooledExperts(nn.Module):
    """One MoE layer's experts, held by pools instead of parameters."""

    def __init__(self, layer: int, ids: Sequence[str], act_fn: nn.Module, pool_of: Callable[[str], Pool], *,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.layer = layer
        self.ids = list(ids)
        self.num_experts = len(self.ids)
        self.act_fn = act_fn
        self.device = torch.device(device)
        self._pool_of = pool_of

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, pooled"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        hits = [int(i) for i in expert_hit[:, 0].tolist() if int(i) < self.num_experts]
        pending = hits
        while pending:
            with PinnedWave(self._pool_of, [self.ids[e] for e in pending]) as wave:
                for e, handle in zip(pending, wave):
                    weights = handle.value.tensors()
                    gate_up_proj, down_proj = weights["gate_up_proj"], weights["down_proj"]
                    top_k_pos, token_idx = torch.where(expert_mask[e])
                    current_state = hidden_states[token_idx]
                    gate, up = nn.functional.linear(current_state, gate_up_proj).chunk(2, dim=-1)
                    current_hidden_states = self.act_fn(gate) * up
                    current_hidden_states = nn.functional.linear(current_hidden_states, down_proj)
                    current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
                    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
                done = len(wave)
            pending = pending[done:]
        return final_hidden_states
