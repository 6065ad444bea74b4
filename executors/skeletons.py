"""Pre-built module skeletons: switching experts re-points a module, it never constructs one.

An executor keeps one module per architecture layout.  Binding it to a
resident expert points each parameter and buffer at the expert's tensors
(views into the tier's flat buffer): no weight copy, no model construction,
no `load_state_dict` walk, just one attribute swap per tensor.  The first
expert of a layout pays for building the skeleton once.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coe import Expert, ExpertLoadError

from .backends import get_backend

if TYPE_CHECKING:
    from storage.flat import FlatWeights


@dataclass
class _Slot:
    module: Any
    bound: Any                 # the FlatWeights the module points into (None: unbound)
    expert_id: str | None
    targets: dict[str, tuple[Any, str, bool]] = field(default_factory=dict)  # key -> (submodule, name, is_param)


def _targets(module) -> dict[str, tuple[Any, str, bool]]:
    """Where each state-dict tensor lives, so a rebind is a dictionary walk, not a module traversal."""
    keys = set(module.state_dict().keys())
    out = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in sub._parameters.items():
            if p is not None and pre + name in keys:
                out[pre + name] = (sub, name, True)
        for name, b in sub._buffers.items():
            if b is not None and pre + name in keys:
                out[pre + name] = (sub, name, False)
    return out


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
        backend = get_backend(expert.arch)
        if getattr(backend, "builds_per_switch", False):     # one session per expert, dropped on eviction
            return self._rebuild(backend, (expert.id, *key), expert, weights)
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                module = get_backend(expert.arch).build(expert, weights.tensors(), self.device)
                slot = _Slot(module, weights, expert.id, _targets(module))
                if set(slot.targets) != set(weights.tensors()):
                    raise ExpertLoadError(expert.id, expert.uri or "<tier>", "skeleton and weights disagree on keys")
                self._slots[key] = slot
                self.builds += 1
                return module
            if slot.bound is not weights:
                self._point(slot, weights.tensors())
                slot.bound, slot.expert_id = weights, expert.id
                self.rebinds += 1
            return slot.module

    def _rebuild(self, backend, key: tuple, expert: Expert, weights: "FlatWeights"):
        """A runtime with no skeleton to re-point (ONNX Runtime): a switch builds a new session."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.bound is weights and slot.module is not None:
                return slot.module
        module = backend.build(expert, weights.tensors(), self.device)    # outside the lock: it takes a while
        with self._lock:
            self._slots[key] = _Slot(module, weights, expert.id)
            self.builds += 1
        return module

    def unbind(self, weights) -> None:
        """Point slots bound to these evicted weights at nothing, so their memory really goes back.

        Matching the weights object (not the expert id) means a late eviction
        event can never empty a slot that meanwhile was bound to a fresh load.
        """
        import torch

        with self._lock:
            for slot in self._slots.values():
                if slot.bound is weights and weights is not None and not slot.targets:
                    slot.module, slot.bound, slot.expert_id = None, None, None   # a session: let it go
                    continue
                if slot.bound is weights and weights is not None:
                    self._point(slot, {k: torch.empty(0, dtype=t.dtype, device=t.device)
                                       for k, t in slot.bound.tensors().items()})
                    slot.bound, slot.expert_id = None, None

    @staticmethod
    def _point(slot: _Slot, tensors) -> None:
        for key, (sub, name, is_param) in slot.targets.items():
            t = tensors[key]
            if is_param:
                sub._parameters[name].data = t
            else:
                sub._buffers[name] = t
