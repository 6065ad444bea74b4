"""Pre-built module skeletons: switching experts re-points a module, it never constructs one.

An executor keeps one module per architecture layout.  Binding it to a
resident expert assigns the expert's tensors (views into the tier's flat
buffer) as its parameters: no weight copy, no model construction.  The first
expert of a layout pays for building the skeleton once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coe import Expert, ExpertLoadError

from .backends import get_backend

if TYPE_CHECKING:
    from storage.flat import FlatWeights


@dataclass
class _Slot:
    module: Any
    bound: Any   # the FlatWeights the module currently points into (None: unbound)
    expert_id: str | None


class Skeletons:
    """Per-executor cache of runnable modules, one per (arch, classes, layout)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._slots: dict[tuple, _Slot] = {}
        self._lock = threading.Lock()
        self.builds = 0
        self.rebinds = 0

    def bind(self, expert: Expert, weights: "FlatWeights"):
        """A module running `expert`, pointing into `weights` (which the caller keeps pinned)."""
        key = (expert.arch, len(expert.classes), weights.layout.signature)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                module = get_backend(expert.arch).build(expert, weights.tensors(), self.device)
                self._slots[key] = _Slot(module, weights, expert.id)
                self.builds += 1
                return module
            if slot.bound is not weights:
                self._assign(slot, weights.tensors(), expert)
                slot.bound, slot.expert_id = weights, expert.id
                self.rebinds += 1
            return slot.module

    def unbind(self, expert_id: str) -> None:
        """Point slots bound to an evicted expert at nothing (meta tensors), so its memory really goes back."""
        import torch

        with self._lock:
            for slot in self._slots.values():
                if slot.expert_id == expert_id and slot.bound is not None:
                    empty = {k: torch.empty_like(v, device="meta") for k, v in slot.bound.tensors().items()}
                    slot.module.load_state_dict(empty, strict=True, assign=True)
                    slot.bound, slot.expert_id = None, None

    @staticmethod
    def _assign(slot: "_Slot", tensors, expert: Expert) -> None:
        try:
            slot.module.load_state_dict(tensors, strict=True, assign=True)
        except RuntimeError as exc:
            raise ExpertLoadError(expert.id, expert.uri or "<tier>", f"cannot bind weights: {exc}") from None
