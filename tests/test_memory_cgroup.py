"""The memory cgroup that bounds each `llm bench` (c) process: RSS and page cache, on this box's kernel.

Runs only where this process may make memory cgroups (root with a v1 memory
hierarchy or a v2 root with the memory controller delegated); elsewhere the
bench itself says the page cache was not bounded.
"""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from edge_agent.memory_cgroup import MemoryCgroup

pytestmark = pytest.mark.skipif(MemoryCgroup.hierarchy() is None, reason="no writable memory cgroup here")

ALLOC = "b = bytearray({} << 20); print(len(b))"


def _child(cg: MemoryCgroup, mib: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ALLOC.format(mib)], preexec_fn=cg.enter, capture_output=True,
                          text=True, timeout=60)


def test_a_child_in_an_unbounded_cgroup_runs_and_its_peak_is_charged_there():
    cg = MemoryCgroup.create(f"coe-test-{os.getpid()}-free", 1 << 50)
    assert cg is not None
    try:
        res = _child(cg, 64)
        assert res.returncode == 0 and res.stdout.strip() == str(64 << 20)
        assert cg.peak() >= 64 << 20            # the child's bytearray was charged to this cgroup
        assert cg.failcnt() == 0
    finally:
        cg.remove()
    assert not cg.path.exists()


@pytest.mark.skipif(psutil.swap_memory().total > 0, reason="with swap, a process over the bound swaps instead")
def test_a_child_over_the_bound_is_killed_and_the_failures_are_counted():
    cg = MemoryCgroup.create(f"coe-test-{os.getpid()}-tight", 40 << 20)
    assert cg is not None
    try:
        res = _child(cg, 200)
        assert res.returncode in (-9, 137), res.stderr[-300:]    # killed by the bound, not by Python
        assert cg.failcnt() > 0
        assert cg.peak() <= 41 << 20
    finally:
        cg.remove()


def test_a_cgroup_the_kernel_refuses_is_none_and_leaves_no_directory():
    # a limit the kernel cannot parse: create gives up and removes what it made
    name = f"coe-test-{os.getpid()}-bad"
    assert MemoryCgroup.create(name, -5) is None
    root, _ = MemoryCgroup.hierarchy()
    assert not (root / name).exists()


def test_end_to_end_runs_every_system_bounded_and_each_generates_the_reference_tokens(tmp_path):
    """(c) on a tiny Mixtral: every system in its own process, each bounded by its own cgroup, same tokens."""
    sys.path.insert(0, os.path.dirname(__file__))
    from moe_models import build

    from edge_agent.llm_bench import E2E_POLICIES, run_e2e
    from storage.llm_import import import_checkpoint

    hf = tmp_path / "hf"
    build("mixtral", hf)
    import_checkpoint(hf, tmp_path / "store", name="tiny")
    # a tiny model's 15% is under the allocator's noise: 64 MiB of headroom on every bound
    runs, mem = run_e2e(hf, tmp_path / "store", [5, 9, 14, 3], 4, share=0.25, headroom=64 << 20)
    assert mem["bounded"] and "memory cgroup" in mem["note"]
    assert [(r["system"], r.get("policy")) for r in runs] == (
        [("coe", p) for p in E2E_POLICIES] + [("coe-resident", "lru"), ("accelerate", None), ("ram", None)])
    ram = runs[-1]["output"]
    assert len(ram) == 4
    for r in runs:
        assert "failed" not in r, r
        assert r["output"] == ram, r["system"]                          # pooled and offloaded decode are exact
        if r["system"] not in ("ram", "coe-resident"):
            assert r["cgroup_limit"] == mem["limit"]
        else:
            assert "cgroup_limit" not in r                              # the references are not bounded
        if r["system"].startswith("coe"):                               # decode alone: the steps after the first
            assert r["decode_tokens"] == 3 and 0 < r["decode_seconds"] < r["seconds"]
    resident = runs[len(E2E_POLICIES)]
    assert resident["warm"] and resident["bytes_in"] == 0 and resident["hit_rate"] == 1.0   # nothing left to load
    assert all(r["bytes_in"] > 0 for r in runs[:len(E2E_POLICIES)])     # at 25% the bounded runs load
    assert mem["limit"] >= mem["limit_baseline"] + (64 << 20) and mem["ram_host_rss"] is None   # on the CPU


@pytest.mark.skipif(psutil.swap_memory().total > 0, reason="with swap, a process over the bound swaps instead")
def test_a_child_lowered_below_its_own_memory_stops_and_is_reported_as_stopped_at_the_bound():
    """`lower_limit` in a child holding 200 MiB, limit 64 MiB: v1 refuses (EBUSY), v2 kills; both read the same."""
    from edge_agent.llm_bench import failure
    from edge_agent.memory_cgroup import OVER_THE_BOUND

    cg = MemoryCgroup.create(f"coe-test-{os.getpid()}-lower", 1 << 50)
    assert cg is not None
    code = ("import psutil; from edge_agent.memory_cgroup import lower_limit; b = bytearray(200 << 20); "
            f"lower_limit({str(cg.path)!r}, 64 << 20, psutil.Process().memory_info().rss); print('survived')")
    try:
        res = subprocess.run([sys.executable, "-c", code], preexec_fn=cg.enter, capture_output=True, text=True,
                             timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    finally:
        cg.remove()
    assert res.returncode in (-9, OVER_THE_BOUND), res.stderr[-500:]
    assert "survived" not in res.stdout
    said = failure(res.returncode, res.stderr)
    assert said.startswith("killed at the memory bound (bounded at 67 MB with ") and "MB resident" in said
    assert failure(1, "Traceback ...\nValueError: bad prompt").endswith("ValueError: bad prompt")   # its own error
    assert failure(-9, "loading ...").startswith("killed (SIGKILL) before its memory bound applied")
