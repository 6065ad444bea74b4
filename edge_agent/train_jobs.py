"""Run training jobs side by side in worker processes, with their progress shown by the parent.

Why processes: the demo's networks are small and their inputs 64 pixels, so
torch's intra-op threads scale poorly on them, and drawing a synthetic batch
is single-threaded numpy.  One job per process, with the cores shared out
between the processes, keeps every core busy: while one job draws its batch,
another computes.  Jobs are started longest first (their `cost`), so the last
one to finish is not a long one started late.

A job is a module-level function called as `fn(*args, progress=tick)`; it must
return something picklable (state dicts go back as numpy arrays, see
`to_numpy`/`from_numpy`).  Each is seeded by its own arguments, so its
result does not depend on which worker ran it or when.  One worker (or one
job) runs in this process, with no pool at all: the same code, fewer moving
parts.  A job that raises stops the run and its error is raised here, as the
job raised it.
"""
from __future__ import annotations

import logging
import os
import queue as queue_mod
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

Progress = Callable[[str, int, int], None]

log = logging.getLogger(__name__)

_QUEUE = None          # in a worker: where its jobs' progress goes
END_MARK_SECONDS = 10.0   # how long the parent waits, after the last result, for the jobs' last progress steps


@dataclass(frozen=True)
class Job:
    """One unit of training: `fn(*args, progress=...)`, shown as `name` with `total` steps."""

    name: str
    fn: Callable
    args: tuple = ()
    total: int = 0
    cost: float = 1.0               # expected core-seconds: only the start order depends on it


def plan_workers(jobs: int, cores: int | None = None, workers: int | None = None) -> tuple[int, int]:
    """(worker processes, torch threads per worker) for `jobs` jobs on `cores` cores.

    `workers` asks for a number of processes; never more than there are jobs, so the cores are
    shared among the processes that have work.
    """
    cores = max(1, cores or os.cpu_count() or 1)
    n = max(1, min(workers if workers is not None else cores, jobs))
    return n, max(1, cores // n)


def run_jobs(jobs: Sequence[Job], *, workers: int | None = None, progress: Progress | None = None,
             on_result: Callable[[int, object], None] | None = None) -> list:
    """Every job's result, in the order of `jobs`; `on_result(index, result)` runs here as each job ends."""
    if not jobs:
        return []
    n, threads = plan_workers(len(jobs), workers=workers)
    results: list = [None] * len(jobs)

    def finished(i: int, out) -> None:
        results[i] = out
        if on_result is not None:
            on_result(i, out)
    if n == 1:
        for i, job in enumerate(jobs):
            finished(i, _call(job, progress))
        return results
    import multiprocessing as mp

    ctx = mp.get_context("spawn")     # not fork: a forked child of a process that ran OpenMP threads can hang
    q = ctx.Queue()
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i].cost)
    pool = ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker,
                               initargs=(q, threads, os.getpid()))
    try:
        pending = {pool.submit(_run_in_worker, i, jobs[i].name, jobs[i].total, jobs[i].fn, jobs[i].args): i
                   for i in order}
        ended: set[int] = set()
        while pending:
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(q, progress, ended)
            for fut in done:
                finished(pending.pop(fut), fut.result())     # a job's error is raised here, as it raised it
        # a job's result can arrive before its last progress steps: a worker's queue is flushed by a feeder
        # thread of its own, so wait for each job's end mark (it follows the job's steps on the same queue)
        deadline = time.monotonic() + END_MARK_SECONDS
        while len(ended) < len(jobs) and time.monotonic() < deadline:
            _drain(q, progress, ended, block=0.05)
        if len(ended) < len(jobs):
            missing = [jobs[i].name for i in range(len(jobs)) if i not in ended]
            log.warning("training jobs %s: their last progress steps did not arrive within %.0f s; the results are "
                        "complete, the progress shown may not be", ", ".join(missing), END_MARK_SECONDS)
    except BaseException:
        # a failed job (or Ctrl-C) ends the run now: the other jobs' work is lost anyway, so their
        # workers are stopped rather than waited for
        _stop(pool)
        raise
    pool.shutdown(wait=True)
    return results


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and terminate the workers (what runs would otherwise be waited for)."""
    procs = list(getattr(pool, "_processes", {}).values())   # the executor has no public way to stop a job
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=5)
    for proc in procs:                 # one that ignored the terminate (stuck in a native call): killed
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _call(job: Job, progress: Progress | None):
    tick = (lambda step: progress(job.name, step, job.total)) if progress else None
    return job.fn(*job.args, progress=tick)


def _drain(q, progress: Progress | None, ended: set[int], block: float = 0.0) -> None:
    """Pass on the queued progress steps; a job's end mark (step None) goes into `ended`."""
    while True:
        try:
            index, name, step, total = q.get(timeout=block) if block else q.get_nowait()
        except queue_mod.Empty:
            return
        if step is None:
            ended.add(index)
        elif progress is not None:
            progress(name, step, total)


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to end this worker when the process that started it dies (Linux `PR_SET_PDEATHSIG`):
    a parent stopped by SIGTERM (systemd, `timeout`) or SIGKILL left its workers training on the line box."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:                 # the parent died before the call: nothing would signal us
        os._exit(1)


def _init_worker(q, threads: int, parent: int | None = None) -> None:
    global _QUEUE
    if parent is not None:
        _die_with_parent(parent)
    _QUEUE = q
    q.cancel_join_thread()     # unread progress must never keep a worker from exiting
    import torch

    torch.set_num_threads(threads)


def _run_in_worker(index: int, name: str, total: int, fn: Callable, args: tuple):
    try:
        return fn(*args, progress=lambda step: _QUEUE.put((index, name, step, total)))
    finally:
        _QUEUE.put((index, name, None, total))     # the end mark: every step of this job is ahead of it


def to_numpy(tensors: Mapping) -> dict:
    """A state dict as numpy arrays: they cross a process boundary as plain bytes (no shared-memory handles)."""
    return {k: v.detach().cpu().contiguous().numpy() for k, v in tensors.items()}


def from_numpy(arrays: Mapping) -> dict:
    import torch

    return {k: torch.from_numpy(v) for k, v in arrays.items()}
