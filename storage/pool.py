"""A byte-budgeted pool of resident experts: the bookkeeping, not the policy.

The pool asks its source for an expert's size first, asks the policy which
residents to evict so it fits, evicts them, then loads.  It never holds more
than its capacity.  An expert acquired by a running batch is pinned until
released and is never a victim.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from coe import CoEError

from .policies import EvictionPolicy, PoolState, Resident


class ExpertSource(Protocol):
    """Where a pool loads from: the expert store (SSD) or a parent pool."""

    def size(self, expert_id: str) -> int: ...

    def load(self, expert_id: str) -> Any: ...


@dataclass(frozen=True)
class PoolEvent:
    expert_id: str
    tier: str
    event: str        # 'load' | 'evict'
    nbytes: int
    seconds: float
    at: float


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    load_seconds: float = 0.0

    @property
    def switches(self) -> int:
        """Loads into this tier: each one is an expert switch."""
        return self.misses


@dataclass
class Handle:
    expert_id: str
    value: Any
    nbytes: int


@dataclass
class _Entry:
    value: Any
    nbytes: int
    loaded_seq: int
    used_seq: int
    pins: int = 0


class PoolFullError(CoEError):
    """An expert can never fit this pool (it is larger than the whole budget)."""


class Pool:
    """Resident experts of one tier, within `capacity_bytes`."""

    def __init__(self, tier: str, capacity_bytes: int, policy: EvictionPolicy, source: ExpertSource, *,
                 on_event: Callable[[PoolEvent], None] | None = None,
                 probabilities: dict[str, float] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tier, self.capacity, self.policy, self.source = tier, int(capacity_bytes), policy, source
        self._on_event = on_event or (lambda e: None)
        self._probabilities = dict(probabilities or {})
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._seq = 0
        self._lock = threading.RLock()
        self._stats = PoolStats()

    # -- public ---------------------------------------------------------------
    def acquire(self, expert_id: str) -> Handle | None:
        """Pin `expert_id` resident, loading it (and evicting) if needed.

        Returns None when it cannot fit now because pinned experts hold the room;
        raises PoolFullError when it can never fit, and the source's error
        (e.g. ExpertLoadError) when loading fails.
        """
        with self._lock:
            self._seq += 1
            entry = self._entries.get(expert_id)
            if entry is not None:
                entry.pins += 1
                entry.used_seq = self._seq
                self._stats.hits += 1
                return Handle(expert_id, entry.value, entry.nbytes)
            need = self.source.size(expert_id)
            if need > self.capacity:
                raise PoolFullError(f"expert '{expert_id}' needs {need} bytes but the {self.tier} pool holds "
                                    f"{self.capacity}; raise the executor's memory budget")
            victims = self.policy.choose_victims(self.state(), need)
            if victims is None:
                return None
            for victim in victims:
                self._evict_locked(victim)
            t0 = self._clock()
            value = self.source.load(expert_id)
            seconds = self._clock() - t0
            self._seq += 1
            self._entries[expert_id] = _Entry(value, need, self._seq, self._seq, pins=1)
            self._stats.misses += 1
            self._stats.bytes_in += need
            self._stats.load_seconds += seconds
        self._on_event(PoolEvent(expert_id, self.tier, "load", need, seconds, time.time()))
        return Handle(expert_id, value, need)

    def release(self, handle: Handle) -> None:
        with self._lock:
            entry = self._entries.get(handle.expert_id)
            if entry is None or entry.pins <= 0:
                raise CoEError(f"release of '{handle.expert_id}' which is not acquired in the {self.tier} pool")
            entry.pins -= 1

    def evict(self, expert_id: str) -> bool:
        """Evict an unpinned resident expert; False if it was not resident."""
        with self._lock:
            entry = self._entries.get(expert_id)
            if entry is None:
                return False
            if entry.pins:
                raise CoEError(f"cannot evict '{expert_id}': a running batch holds it")
            self._evict_locked(expert_id)
            return True

    def resident(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(**vars(self._stats))

    def state(self) -> PoolState:
        with self._lock:
            return PoolState(self.capacity, tuple(
                Resident(k, e.nbytes, e.loaded_seq, e.used_seq, e.pins > 0) for k, e in self._entries.items()),
                self._probabilities)

    def close(self) -> None:
        """Drop every unpinned resident (memory comes back through the GC of the values)."""
        with self._lock:
            for k in [k for k, e in self._entries.items() if not e.pins]:
                self._evict_locked(k)

    # -- internals ----------------------------------------------------------------
    def _evict_locked(self, expert_id: str) -> None:
        entry = self._entries.pop(expert_id)
        if entry.pins:
            self._entries[expert_id] = entry
            raise CoEError(f"policy {self.policy.name} chose pinned expert '{expert_id}' as a victim")
        self._stats.evictions += 1
        self._on_event(PoolEvent(expert_id, self.tier, "evict", entry.nbytes, 0.0, time.time()))
