"""Progress bars for long work: one bar per named job, closed however the work ends."""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator

PLAIN_EVERY_S = 15.0   # without a terminal: a job's plain progress line at most this often


@contextlib.contextmanager
def step_bars(disable: bool = False) -> Iterator[Callable[[str, int, int], None]]:
    """A progress callback (name, step, total) drawing one tqdm bar per name; the bars close on exit.

    Where stderr is no terminal (a pipe, `| tee`, CI, nohup) tqdm draws
    nothing; there each job gets plain lines instead (its start, every
    `PLAIN_EVERY_S`, its end), so minutes of training are not minutes of
    silence.
    """
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}
    plain = not disable and not sys.stderr.isatty()
    said: dict[str, float] = {}

    def line(name: str, step: int, total: int) -> None:
        now = time.monotonic()
        if name in said and step < total and now - said[name] < PLAIN_EVERY_S:
            return
        said[name] = now
        # the end says done, not a count: a job that stops early (its target met) fills its bar to the total
        print(f"training {name}: " + ("done" if step >= total else f"step {step} of {total}"), file=sys.stderr,
              flush=True)

    def tick(name: str, step: int, total: int) -> None:
        if name not in bars:           # not setdefault: that would build (and draw) a bar on every step
            bars[name] = tqdm(total=total, desc=f"training {name}", unit="step", disable=disable or None)
        bars[name].update(step - bars[name].n)
        if plain:
            line(name, step, total)
    try:
        yield tick
    finally:
        for bar in bars.values():
            bar.close()
