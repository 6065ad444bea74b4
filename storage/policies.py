"""Eviction policies: pure functions from a pool's state to the experts to evict.

A policy never moves bytes and never mutates the state it is given; the pool
(`storage.pool`) does both.  That keeps every policy testable on hand-built
states and lets the simulated device reuse them unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Resident:
    """What a policy may know about one resident expert."""

    expert_id: str
    nbytes: int
    loaded_seq: int      # when it was loaded (pool-local counter)
    used_seq: int        # when it was last acquired
    pinned: bool = False


@dataclass(frozen=True)
class PoolState:
    capacity: int
    residents: tuple[Resident, ...]
    probabilities: dict[str, float] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return sum(r.nbytes for r in self.residents)

    @property
    def free(self) -> int:
        return self.capacity - self.used


class EvictionPolicy(Protocol):
    name: str

    def choose_victims(self, state: PoolState, need_bytes: int) -> list[str] | None:
        """Experts to evict so that `need_bytes` fit, or None if no choice of unpinned experts frees enough."""


def _evict_in_order(state: PoolState, need_bytes: int, order: list[Resident]) -> list[str] | None:
    free = state.free
    if free >= need_bytes:
        return []
    victims = []
    for r in order:
        if r.pinned:
            continue
        victims.append(r.expert_id)
        free += r.nbytes
        if free >= need_bytes:
            return victims
    return None


class LRU:
    """Least recently acquired first."""

    name = "lru"

    def choose_victims(self, state: PoolState, need_bytes: int) -> list[str] | None:
        return _evict_in_order(state, need_bytes, sorted(state.residents, key=lambda r: (r.used_seq, r.expert_id)))


class FIFO:
    """Earliest loaded first, however recently used."""

    name = "fifo"

    def choose_victims(self, state: PoolState, need_bytes: int) -> list[str] | None:
        return _evict_in_order(state, need_bytes, sorted(state.residents, key=lambda r: (r.loaded_seq, r.expert_id)))


POLICIES = {"lru": LRU, "fifo": FIFO}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called `name`; unknown names fail loudly."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy '{name}' (known: {', '.join(sorted(POLICIES))})") from None
