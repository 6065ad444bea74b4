"""How many intra-op threads a pooled MoE model computes with while its experts load.

Why this exists.  A pooled layer's misses load on the loader threads
(`pooled_experts.loader`) while the layer computes, and a load is not free for
the CPU: the copy out of the page cache, and the sha256 when the store
verifies.  With torch's OpenMP team as wide as the box, a loader thread that
takes a core stalls the team at its next barrier, and every small op of a
decode step (an `index_add_` of one token's row) waits a scheduler slice.
Measured on this project's 2-core box with another job running: `index_add_`
took 14 ms a call instead of microseconds, and greedy decode of the 2.2 GB
generated model at a 25% pool ran at 3.9 tokens/s with two compute threads
against 11.1 with one.  So on a CPU box the computation leaves one core to the
loaders.  A GPU computes on the device; its host threads are left alone.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def compute_threads(cores: int, device_type: str, current: int) -> int:
    """Intra-op threads for pooled computation on `device_type`: one core left to the loaders on a CPU box.

    Never more than `current` (a user who asked for fewer keeps fewer), never
    fewer than one.  On a GPU box, `current` unchanged.
    """
    if device_type != "cpu":
        return current
    return max(1, min(current, cores - 1))


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the host's count: a container pinned to 2 CPUs of
    a 64-core host has 2."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def loader_friendly_threads(device_type: str) -> Iterator[int]:
    """Run the block with `compute_threads` intra-op threads on this thread; the previous count comes back after.

    torch's setting is the calling thread's under OpenMP, but it is also the
    default a thread takes at its first torch call, so a thread that starts
    computing during the block keeps the lower count.  Use it only where the
    process computes for this model alone (`generate` of a model that owns
    its pools, a benchmark's trace decode), never inside the line agent,
    whose executors' threads must keep the agent's count.
    """
    import torch

    before = torch.get_num_threads()
    n = compute_threads(usable_cores(), device_type, before)
    if n != before:
        torch.set_num_threads(n)
    try:
        yield n
    finally:
        if n != before:
            torch.set_num_threads(before)
