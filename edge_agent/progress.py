"""Progress bars for long work: one bar per named job, closed however the work ends."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def step_bars(disable: bool = False) -> Iterator[Callable[[str, int, int], None]]:
    """A progress callback (name, step, total) drawing one tqdm bar per name; the bars close on exit."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def tick(name: str, step: int, total: int) -> None:
        if name not in bars:           # not setdefault: that would build (and draw) a bar on every step
            bars[name] = tqdm(total=total, desc=f"training {name}", unit="step", disable=disable or None)
        bars[name].update(step - bars[name].n)
    try:
        yield tick
    finally:
        for bar in bars.values():
            bar.close()
