"""A byte-budgeted pool of resident experts: the bookkeeping, not the policy.

The pool asks its source for an expert's size, asks the policy which residents
to evict so it fits, evicts them, reserves the room, and loads *outside* its
lock, so a background prefetch never blocks an executor's hit on another
expert.  It never holds more than its capacity.  An expert acquired by a
running batch (or still loading) is pinned and is never a victim.  Two threads
asking for the same expert share one load (an in-flight set, as Ray Serve's
multiplexer does), and a failed load clears its reservation.
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
    """Where a pool loads from: the expert store (SSD) or a parent tier.

    A source with `reuses_memory = True` accepts `load(expert_id, reuse=[...])`:
    the values just evicted to make room, whose memory it may fill instead of
    allocating.
    """

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
    value: Any = field(default=None, repr=False, compare=False)  # the evicted value, for whoever points into it


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    load_seconds: float = 0.0
    resident_bytes: int = 0
    capacity: int = 0
    manage_seconds: float = 0.0   # bookkeeping and eviction decisions, loads excluded

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
    loading: bool = False


class PoolFullError(CoEError):
    """An expert can never fit this pool (it is larger than the whole budget)."""


class Pool:
    """Resident experts of one tier, within `capacity_bytes`."""

    def __init__(self, tier: str, capacity_bytes: int, policy: EvictionPolicy, source: ExpertSource, *,
                 on_event: Callable[[PoolEvent], None] | None = None,
                 probabilities: dict[str, float] | None = None,
                 preliminaries: dict[str, tuple[str, ...]] | None = None,
                 context: Callable[[], dict] | None = None,
                 measure: Callable[[Any], int] | None = None, name: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tier, self.capacity, self.policy, self.source = tier, int(capacity_bytes), policy, source
        self.name = name or tier
        self._on_event = on_event or (lambda e: None)
        self._probabilities = dict(probabilities or {})
        self._preliminaries = dict(preliminaries or {})
        self._context = context or dict  # live scheduler knowledge: {'queued': set, 'future': tuple}
        self._measure = measure
        self._reuses = bool(getattr(source, "reuses_memory", False))
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._seq = 0
        self._cond = threading.Condition()
        self._stats = PoolStats()

    # -- public ---------------------------------------------------------------
    def acquire(self, expert_id: str) -> Handle | None:
        """Pin `expert_id` resident, loading it (and evicting) if needed.

        Returns None when it cannot fit now because pinned experts hold the room;
        raises PoolFullError when it can never fit, and the source's error
        (e.g. ExpertLoadError) when loading fails.
        """
        entered = time.perf_counter()
        ctx = self._context()
        with self._cond:
            while True:
                self._seq += 1
                entry = self._entries.get(expert_id)
                if entry is None:
                    break
                if entry.loading:           # someone else is loading it: share that load
                    w0 = time.perf_counter()
                    self._cond.wait()
                    entered += time.perf_counter() - w0   # waiting is not management work
                    continue
                entry.pins += 1
                entry.used_seq = self._seq
                self._stats.hits += 1
                self._stats.manage_seconds += time.perf_counter() - entered
                return Handle(expert_id, entry.value, entry.nbytes)
            need = self.source.size(expert_id)
            if need > self.capacity:
                raise PoolFullError(f"expert '{expert_id}' needs {need} bytes but the {self.tier} pool holds "
                                    f"{self.capacity}; raise the executor's memory budget")
            victims = self.policy.choose_victims(self._state_locked(ctx), need)
            if victims is None:
                return None
            evicted = [self._evict_locked(v) for v in victims]
            self._entries[expert_id] = _Entry(None, need, self._seq, self._seq, pins=1, loading=True)
        t0 = self._clock()
        load_started = time.perf_counter()
        try:
            for e in evicted:
                self._on_event(e)
            e = None
            # the victims' memory may become the new expert's (a switch between same-sized experts
            # then costs one read or copy into warm memory); the source takes what it reuses and
            # clears the list, so everything else is freed before the load allocates
            reuse = [e.value for e in evicted if e.value is not None] if self._reuses else []
            evicted = []
            value = self.source.load(expert_id, reuse=reuse) if reuse else self.source.load(expert_id)
            reuse.clear()
            seconds = self._clock() - t0
            load_wall = time.perf_counter() - load_started
            measured = self._measure(value) if self._measure else need
        except BaseException:
            with self._cond:
                del self._entries[expert_id]
                self._cond.notify_all()
            raise
        with self._cond:
            entry = self._entries[expert_id]
            entry.value, entry.loading, entry.nbytes = value, False, max(measured, need)
            self._stats.misses += 1
            self._stats.bytes_in += entry.nbytes
            self._stats.load_seconds += seconds
            self._stats.manage_seconds += time.perf_counter() - entered - load_wall
            self._cond.notify_all()
        self._on_event(PoolEvent(expert_id, self.tier, "load", entry.nbytes, seconds, time.time()))
        return Handle(expert_id, value, entry.nbytes)

    def release(self, handle: Handle) -> None:
        with self._cond:
            entry = self._entries.get(handle.expert_id)
            if entry is None or entry.pins <= 0 or entry.loading:
                raise CoEError(f"release of '{handle.expert_id}' which is not acquired in the {self.tier} pool")
            entry.pins -= 1
            self._cond.notify_all()

    def evict(self, expert_id: str) -> bool:
        """Evict an unpinned resident expert; False if it was not resident."""
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is None:
                return False
            if entry.pins:
                raise CoEError(f"cannot evict '{expert_id}': a running batch holds it")
            ev = self._evict_locked(expert_id)
        self._on_event(ev)
        return True

    def contains(self, expert_id: str) -> bool:
        with self._cond:
            e = self._entries.get(expert_id)
            return e is not None and not e.loading

    def resident(self) -> list[str]:
        with self._cond:
            return [k for k, e in self._entries.items() if not e.loading]

    def used_bytes(self) -> int:
        with self._cond:
            return sum(e.nbytes for e in self._entries.values())

    def stats(self) -> PoolStats:
        with self._cond:
            s = PoolStats(**vars(self._stats))
            s.resident_bytes = sum(e.nbytes for e in self._entries.values() if not e.loading)
            s.capacity = self.capacity
            return s

    def state(self) -> PoolState:
        ctx = self._context()
        with self._cond:
            return self._state_locked(ctx)

    def close(self) -> None:
        """Drop every unpinned resident; their memory goes back with the last reference."""
        with self._cond:
            evs = [self._evict_locked(k) for k in [k for k, e in self._entries.items() if not e.pins]]
        for ev in evs:
            self._on_event(ev)

    # -- internals ----------------------------------------------------------------
    def _state_locked(self, ctx: dict) -> PoolState:
        return PoolState(self.capacity, tuple(
            Resident(k, e.nbytes, e.loaded_seq, e.used_seq, e.pins > 0 or e.loading) for k, e in self._entries.items()),
            self._probabilities, self._preliminaries, frozenset(ctx.get("queued", ())), tuple(ctx.get("future", ())))

    def _evict_locked(self, expert_id: str) -> PoolEvent:
        entry = self._entries.get(expert_id)
        if entry is None or entry.pins or entry.loading:
            raise CoEError(f"policy {self.policy.name} chose '{expert_id}', which is pinned or absent, as a victim")
        del self._entries[expert_id]
        self._stats.evictions += 1
        return PoolEvent(expert_id, self.tier, "evict", entry.nbytes, 0.0, time.time(), entry.value)


def initialize(pools: list[Pool], order: list[str]) -> dict[str, list[str]]:
    """CoServe's initialisation: experts in `order` (descending usage probability) go round-robin
    across `pools`, each into the next pool with free room, until no pool has room left.
    Nothing is evicted.  Returns what each pool received."""
    got: dict[str, list[str]] = {p.name: [] for p in pools}
    if not pools:
        return got
    turn = 0
    for expert_id in order:
        size = pools[0].source.size(expert_id)
        for k in range(len(pools)):
            pool = pools[(turn + k) % len(pools)]
            if pool.contains(expert_id) or pool.capacity - pool.used_bytes() < size:
                continue
            pool.release(pool.acquire(expert_id))
            got[pool.name].append(expert_id)
            turn = (turn + k + 1) % len(pools)
            break
        if all(p.capacity - p.used_bytes() <= 0 for p in pools):
            break
    return got
