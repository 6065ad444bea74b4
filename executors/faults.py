"""Fault injection for the backends: the real backend, with chosen failures in front of it.

Tests and the soak benchmark wrap the registry with `FaultyBackends` and hand
it to the agent (`Agent(..., backend_for=...)`): an expert that always
raises, or a batch larger than N that runs "out of memory".  Nothing here is
reachable from a config file; production code never injects faults.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .backends import get_backend


@dataclass
class Faults:
    raise_for: set[str] = field(default_factory=set)       # expert ids whose run always raises
    oom_above: dict[str, int] = field(default_factory=dict)  # expert id -> largest batch that fits
    delay: float = 0.0                                        # seconds added to every run (overload)
    block: threading.Event | None = None                      # while clear, every run hangs (a stuck driver)
    garble_for: set[str] = field(default_factory=set)          # expert ids whose run returns outputs no one can read
    # (expert id, predicate on one image): a batch holding an image it is true for raises in that expert, as a
    # frame that breaks the expert does (a shape it cannot take); `oom_image` the same as an out-of-memory error
    raise_image: tuple[str, Callable] | None = None
    oom_image: tuple[str, Callable] | None = None
    calls: list[tuple[str, int]] = field(default_factory=list)


class _Faulty:
    def __init__(self, inner, faults: Faults) -> None:
        self.inner, self.faults = inner, faults

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, module, expert, images):
        self.faults.calls.append((expert.id, len(images)))
        if self.faults.delay:
            import time
            time.sleep(self.faults.delay)
        if self.faults.block is not None:
            self.faults.block.wait()
        if expert.id in self.faults.raise_for:
            raise ValueError(f"injected fault in {expert.id}")
        if expert.id in self.faults.garble_for:
            return [f"garbled output {i} (injected)" for i in range(len(images))]   # one per frame, each unusable
        for which, exc in ((self.faults.raise_image, ValueError), (self.faults.oom_image, RuntimeError)):
            if which is not None and which[0] == expert.id and any(which[1](img) for img in images):
                word = "cannot take this frame" if exc is ValueError else "CUDA out of memory"
                raise exc(f"{word} (injected in {expert.id}, batch of {len(images)})")
        limit = self.faults.oom_above.get(expert.id)
        if limit is not None and len(images) > limit:
            raise RuntimeError(f"CUDA out of memory (injected: batch {len(images)} > {limit})")
        return self.inner.run(module, expert, images)


def faulty_backends(faults: Faults) -> Callable[[str], object]:
    return lambda arch: _Faulty(get_backend(arch), faults)
