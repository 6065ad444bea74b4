"""Run n threads that start their timed part together; the first error is re-raised in the caller.

Both concurrency measurements (executors sharing a device, decoders sharing
the cores) need the same harness: every thread does its own set-up, waits at
a barrier so the timed parts overlap, and a failure in one thread aborts the
barrier so the others stop waiting instead of hanging.
"""
from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_lockstep(body: Callable[[int, Callable[[], None]], None], n: int, name: str) -> None:
    """Run `body(i, start)` on `n` threads; `start()` returns once all have reached it."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            body(i, barrier.wait)
        except threading.BrokenBarrierError:
            pass   # another thread failed: its error is the one reported
        except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
