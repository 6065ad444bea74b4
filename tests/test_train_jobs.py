"""Training jobs side by side in real worker processes: results in order, progress forwarded, errors raised."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from coe import CoEError
from edge_agent.train_jobs import Job, from_numpy, plan_workers, run_jobs, to_numpy


def _count(n: int, progress=None):
    """A job: ticks n steps and says which process ran it and with how many torch threads."""
    for i in range(n):
        if progress is not None:
            progress(i + 1)
    return n * n, os.getpid(), torch.get_num_threads()


def _fail(name: str, progress=None):
    raise CoEError(f"expert '{name}': cannot train")


def _chatty_then_slow(marker: str, progress=None):
    """Floods the progress queue (more than a pipe holds), then works long: it must be stopped, not awaited."""
    import time

    for i in range(5000):
        progress(i + 1)
    time.sleep(60)
    open(marker, "w").close()


def _fail_later(name: str, progress=None):
    import time

    time.sleep(1.0)
    raise CoEError(f"expert '{name}': cannot train")


def test_plan_gives_each_worker_its_share_of_the_cores():
    assert plan_workers(6, cores=2) == (2, 1)
    assert plan_workers(1, cores=16) == (1, 16)       # one job: one process with every core
    assert plan_workers(6, cores=16) == (6, 2)
    assert plan_workers(0, cores=4) == (1, 4)
    assert plan_workers(2, cores=16, workers=8) == (2, 8)     # no more processes than jobs
    assert plan_workers(6, cores=2, workers=1) == (1, 2)


def test_jobs_run_in_other_processes_and_come_back_in_order_with_their_progress():
    seen: list[tuple[str, int, int]] = []
    finished: list[int] = []
    jobs = [Job(f"job{n}", _count, (n,), total=n, cost=n) for n in (3, 5, 2, 4)]
    out = run_jobs(jobs, workers=2, progress=lambda *a: seen.append(a), on_result=lambda i, _r: finished.append(i))
    assert [r[0] for r in out] == [9, 25, 4, 16]                  # the order of `jobs`, not of completion
    assert {r[1] for r in out} - {os.getpid()} == {r[1] for r in out}   # none ran in this process
    assert all(r[2] == max(1, (os.cpu_count() or 1) // 2) for r in out)
    assert sorted(finished) == [0, 1, 2, 3]
    for job in jobs:                                            # every step of every job reached the parent
        assert [s for name, s, _ in seen if name == job.name] == list(range(1, job.total + 1))


def test_one_worker_runs_the_jobs_here():
    seen = []
    out = run_jobs([Job("a", _count, (2,), total=2), Job("b", _count, (1,), total=1)], workers=1,
                   progress=lambda *a: seen.append(a))
    assert [r[0] for r in out] == [4, 1] and {r[1] for r in out} == {os.getpid()}
    assert seen == [("a", 1, 2), ("a", 2, 2), ("b", 1, 1)]


def test_a_failing_job_raises_its_own_error_here():
    jobs = [Job("ok", _count, (2,)), Job("bad", _fail, ("det-ic",))]
    with pytest.raises(CoEError, match="expert 'det-ic': cannot train"):
        run_jobs(jobs, workers=2)


def test_a_failure_stops_the_other_workers_instead_of_waiting_for_them(tmp_path):
    marker = tmp_path / "finished"
    jobs = [Job("chatty", _chatty_then_slow, (str(marker),), total=5000, cost=2), Job("bad", _fail_later, ("x",))]
    with pytest.raises(CoEError, match="expert 'x': cannot train"):
        run_jobs(jobs, workers=2)               # 5,000 ticks: more than the pipe holds once nobody reads
    assert not marker.exists()                  # the long job was stopped, not run to its end


def test_state_dicts_cross_as_numpy_and_come_back_equal():
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    state = net.state_dict()
    arrays = to_numpy(state)
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    back = from_numpy(arrays)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def _burst(n: int, progress=None) -> int:
    for step in range(1, n + 1):
        progress(step)
    return n


def test_every_progress_step_arrives_though_the_result_comes_back_first():
    """A worker's queue is flushed by its own feeder thread, so a result can beat its job's last steps home.

    Forty thousand steps just before returning make that race likely (the old drain lost some about every
    other run); none of them may be lost."""
    seen: list[tuple[str, int, int]] = []
    jobs = [Job(f"burst{n}", _burst, (40000,), total=40000, cost=1) for n in range(2)]
    out = run_jobs(jobs, workers=2, progress=lambda *a: seen.append(a))
    assert out == [40000, 40000]
    for job in jobs:
        assert [s for name, s, _ in seen if name == job.name] == list(range(1, 40001)), job.name


def _note_pid_then_sleep(pidfile: str, progress=None):
    """A job: writes its worker's pid, then works long (it must end with its parent, not run on)."""
    import time

    with open(pidfile, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(60)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_end_with_a_parent_stopped_by_sigterm(tmp_path):
    """A parent stopped by SIGTERM (systemd, `timeout`) left its workers training on the line box, re-parented
    to init, until their jobs ended."""
    import signal
    import subprocess
    import sys
    import time

    pids = [tmp_path / "a.pid", tmp_path / "b.pid"]
    tests = os.path.dirname(os.path.abspath(__file__))
    script = ("import sys; sys.path.insert(0, %r)\n"
              "from edge_agent.train_jobs import Job, run_jobs\n"
              "from test_train_jobs import _note_pid_then_sleep\n"
              "if __name__ == '__main__':\n"
              "    run_jobs([Job('a', _note_pid_then_sleep, (%r,)), Job('b', _note_pid_then_sleep, (%r,))], "
              "workers=2)\n") % (tests, str(pids[0]), str(pids[1]))
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], cwd=os.path.dirname(tests))
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.read_text() for p in pids):
            assert time.monotonic() < deadline and parent.poll() is None, "the workers never started"
            time.sleep(0.1)
        workers = [int(p.read_text()) for p in pids]
        parent.send_signal(signal.SIGTERM)
        parent.wait(30)

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            try:       # a zombie (exited, not yet reaped by init) has ended too
                with open(f"/proc/{pid}/stat") as fh:
                    return fh.read().split(")")[-1].split()[0] != "Z"
            except OSError:
                return False
        deadline = time.monotonic() + 30
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if alive(w)]
    finally:
        parent.kill()
        for p in pids:
            if p.exists() and p.read_text():
                try:
                    os.kill(int(p.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
