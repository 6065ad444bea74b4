"""`coe-agent bench --sim`: one JSON line with every system's resources, the sustained rate and the latency
at F x that rate; bad --load values are refused with a clear message (issue 9)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from coe.workload import make_workload, task
from edge_agent.bench import sustained_rate, sustains
from edge_agent.cli import cli
from executors.profile import Profile
from executors.simdevice import simulate
from executors.systems import build_system

SMALL = ["--requests", "240", "--types", "40"]


def test_bench_sim_reports_resources_sustained_rate_and_latency_under_load(tmp_path):
    res = CliRunner().invoke(cli, ["bench", "--sim", "-w", "A1", *SMALL, "--policies", "coserve,coserve-paper",
                                   "--load", "0.5,0.8", "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    rows = {r["system"]: r for r in out["tasks"]["A1"]}
    assert set(rows) == {"coserve", "coserve-paper", "samba"}          # the baseline is always added
    assert rows["samba"]["speedup"] == 1.0 and rows["coserve-paper"]["vs_paper"] == 1.0
    for r in rows.values():
        assert "GB experts" in r["resources"] and r["frames"] == 240
        assert r["lower_bound"] <= r["makespan"]
        assert 0 < r["sustained_rate"] <= r["throughput"]
        assert set(r["latency"]) == {"0.5", "0.8"}
        assert abs(r["latency"]["0.8"]["rate"] - 0.8 * r["sustained_rate"]) < 2e-3
    assert out["loads"] == [0.5, 0.8] and (tmp_path / "bench-throughput.png").is_file()


def test_bench_refuses_a_load_outside_zero_to_one():
    res = CliRunner().invoke(cli, ["bench", "--sim", "-w", "A1", *SMALL, "--load", "1.5"])
    assert res.exit_code == 2 and "each F must be in (0, 1]" in res.output


def test_the_sustained_rate_is_sustained_and_below_the_flood():
    prof = Profile.load("configs/profiles/gpu-class.json")
    spec = task("B1", requests=240, types=40)
    system = build_system("coserve", prof)
    flood = simulate(make_workload(spec), prof, system).throughput
    rate = sustained_rate(spec, prof, system, flood)
    assert 0 < rate <= flood
    assert sustains(spec, prof, system, rate)
    assert not sustains(spec, prof, system, 2 * flood)   # twice what it does flat out cannot drain


def _report(system: str, throughput: float, switches: int, floor: int = 0):
    from executors.simdevice import SimReport
    return SimReport(system=system, frames=100, makespan=100 / throughput, throughput=throughput, switches=switches,
                     ssd_loads=switches, host_loads=0, p50_ms=1.0, p99_ms=2.0, batches=10, mean_batch=10.0,
                     lower_bound=1.0, efficiency=0.5, decision_us=1.0, busy_fraction=0.5, switch_floor=floor)


def test_the_tables_and_summary_survive_a_baseline_that_never_switched():
    # a board that fits Samba-CoE's pool: 0 switches, so there is no reduction to divide by
    from edge_agent.bench import format_table, summary, table
    rows = table([_report("coserve", 20.0, 0), _report("samba", 10.0, 0)])
    assert rows[0]["switch_reduction"] is None and rows[0]["speedup"] == 2.0
    text = format_table("t", rows)
    assert text.splitlines()[2].split()[:2] == ["coserve", "20.00"]
    line = summary([rows[0]])[0]
    assert "2.00x to 2.00x" in line and "no switch" in line


def test_the_summary_floor_is_against_the_baselines_switches():
    from edge_agent.bench import summary, table
    rows = table([_report("coserve", 20.0, 30, floor=10), _report("samba", 10.0, 200)])
    line = summary([rows[0]])[0]
    assert "switches -85.0% to -85.0%" in line and "would be -95.0% to -95.0%" in line   # 1 - 10/200


def test_real_run_options_are_checked_before_anything_runs(tmp_path):
    """--arrival-ms must be positive; --device cuda on a box without CUDA is a clear error, not a traceback."""
    import torch
    from click.testing import CliRunner

    from edge_agent.cli import cli

    env = {"COE_DATA_DIR": str(tmp_path / "data")}
    res = CliRunner().invoke(cli, ["bench", "--real", "--arrival-ms", "0"], env=env)
    assert res.exit_code == 2 and "--arrival-ms" in res.output
    res = CliRunner().invoke(cli, ["bench", "--real", "--device", "gpu"], env=env)
    assert res.exit_code == 2 and "give cpu, cuda or cuda:N" in res.output
    res = CliRunner().invoke(cli, ["bench", "--sim", "--device", "cuda", "-w", "A1"], env=env)
    assert res.exit_code == 1 and "--device and --arrival-ms are for --real runs" in res.output
    if not torch.cuda.is_available():
        res = CliRunner().invoke(cli, ["bench", "--real", "--device", "cuda"], env=env)
        assert res.exit_code == 1 and "--device cuda: no CUDA device here" in res.output
        assert "Traceback" not in res.output and not (tmp_path / "data" / "bench-real").exists()
