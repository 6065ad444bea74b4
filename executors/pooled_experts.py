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
released, then the next.

Exactness.  The arithmetic is the eager transformers loop, op for op, in
ascending expert order, so logits equal the unmodified model's bit for bit in
fp32 on the CPU whatever the pool size or policy.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from coe import CoEError
from storage.pool import Handle, Pool

if TYPE_CHECKING:
    pass

WAIT_SECONDS = 60.0


class PinnedWave:
    """Acquire experts in order until the pool is full of pinned ones; release them all on exit."""

    def __init__(self, pool_of: Callable[[str], Pool], ids: Sequence[str], wait: float = WAIT_SECONDS) -> None:
        self._pool_of, self._ids, self._wait = pool_of, list(ids), wait
        self.handles: list[Handle] = []

    def __enter__(self) -> list[Handle]:
        deadline = time.monotonic() + self._wait
        for eid in self._ids:
            handle = self._pool_of(eid).acquire(eid)
            while handle is None and not self.handles:
                # nothing of ours is pinned, so others hold the room (another layer or request): wait for them
                if time.monotonic() > deadline:
                    raise CoEError(f"expert '{eid}': its pool stayed full of pinned experts for {self._wait:.0f} s")
                time.sleep(0.001)
                handle = self._pool_of(eid).acquire(eid)
            if handle is None:
                break
            self.handles.append(handle)
        return self.handles

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            self._pool_of(h.expert_id).release(h)
        self.handles = []


class PooledExperts(nn.Module):
    """One MoE layer's experts, held by pools instead of parameters."""

    def __init__(self, layer: int, ids: Sequence[str], act_fn: nn.Module, pool_of: Callable[[str], Pool], *,
                 device: torch.device | str = "cpu", on_hits: Callable[[int, list[int]], None] | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.ids = list(ids)
        self.num_experts = len(self.ids)
        self.act_fn = act_fn
        self.device = torch.device(device)
        self._pool_of = pool_of
        self._on_hits = on_hits

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
        if self._on_hits is not None:
            self._on_hits(self.layer, hits)
        pending = hits
        while pending:
            with PinnedWave(self._pool_of, [self.ids[e] for e in pending]) as held:
                for e, handle in zip(pending, held):
                    weights = handle.value.tensors()
                    gate_up_proj, down_proj = weights["gate_up_proj"], weights["down_proj"]
                    top_k_pos, token_idx = torch.where(expert_mask[e])
                    current_state = hidden_states[token_idx]
                    gate, up = nn.functional.linear(current_state, gate_up_proj).chunk(2, dim=-1)
                    current_hidden_states = self.act_fn(gate) * up
                    current_hidden_states = nn.functional.linear(current_hidden_states, down_proj)
                    current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
                    final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
                done = len(held)
            pending = pending[done:]
        return final_hidden_states
