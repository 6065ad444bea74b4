"""The offline profiler on the tiny zoo: real models, real files, real timings (kept small and fast)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from coe import CoEError, load_spec
from edge_agent.cli import cli
from edge_agent.config import load_config
from executors.profile import DeviceProfile, Profile, fit_latency, max_useful_batch
from executors import storage_profiler
from executors.profiler import (concurrency_plan, executor_threads, plan_targets, plot_profile, profile_line,
                                step_count)
from storage.expert_store import ExpertStore

from conftest import TINY_SPEC, write_line

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONCURRENCY_SECONDS = 0.05   # per point of the concurrency curve: small, the tests check its shape, not its values
ARCHS = {"torchvision/mobilenet_v3_small", "ultralytics/yolov8n"}
DECODE_BYTES = 2 << 20        # the decode-rate sample: small, the tests check the figures exist, not their values


@pytest.fixture(autouse=True)
def small_decode_sample(monkeypatch):
    monkeypatch.setattr(storage_profiler, "DECODE_SAMPLE_BYTES", DECODE_BYTES)


def open_line(config: Path):
    cfg = load_config(config)
    return cfg, load_spec(cfg.spec_path), ExpertStore(cfg.store_path)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, tiny_zoo) -> Path:
    """Line T on the shared tiny zoo (profiling only reads the store)."""
    return write_line(tmp_path_factory.mktemp("profile-line"), store=tiny_zoo)


@pytest.fixture(scope="module")
def measured(tiny_config) -> tuple[Profile, list[str], tuple[int, int]]:
    cfg, model, store = open_line(tiny_config)
    before = torch.get_num_threads()
    steps: list[str] = []
    prof = profile_line(cfg, model, store, batch_sizes=(1, 2, 4), repeats=1, progress=steps.append,
                        concurrency_seconds=CONCURRENCY_SECONDS, decode_bytes=DECODE_BYTES)
    return prof, steps, (before, torch.get_num_threads())


def test_profile_line_measures_each_arch_once_per_device(measured, tiny_config):
    prof, steps, (threads_before, threads_after) = measured
    cfg, model, store = open_line(tiny_config)
    assert threads_after == threads_before  # the config's 1 thread was only for the measurement
    assert set(prof.archs) == {Profile.key(a, "cpu") for a in ARCHS}
    for key, a in prof.archs.items():
        assert a.device == "cpu" and key == Profile.key(a.arch, "cpu")
        assert [n for n, _ in a.points] == [1, 2, 4] and all(s > 0 for _, s in a.points)
        # the stored figures are the ones the stored points give, not defaults or another fit
        assert a.max_batch == max_useful_batch(list(a.points))
        assert (a.K, a.B) == pytest.approx(fit_latency(list(a.points)), rel=1e-12, abs=1e-15)
        assert a.K >= 0 and a.B >= 0        # the fit is constrained; how well it fits is timing, not asserted
        same_arch = [e for e in model.experts.values() if e.arch == a.arch]
        assert same_arch and all(a.weight_bytes == store.nbytes(e.id) for e in same_arch)
        assert a.activation_bytes > 0
        assert a.load_seconds["ssd"] > 0 and a.load_seconds["host"] > 0
    cpu = prof.devices["cpu"]
    cores = os.cpu_count() or 1
    assert executor_threads(cfg) == 1                       # the config's threads: 1 ...
    assert cpu.profiled_executors == cores                  # ... is the thread share of `cores` executors
    k_max = min(cores, max(4, cores))
    assert concurrency_plan(cfg) == {"cpu": k_max}
    assert len(cpu.concurrency) == k_max and cpu.concurrency[0] == 1.0
    assert all(c > 0 and c == c for c in cpu.concurrency)
    assert cpu.concurrency_source.startswith("measured on ")
    assert "torchvision/mobilenet_v3_small at batch" in cpu.concurrency_source   # the most used arch
    assert f"{CONCURRENCY_SECONDS:g} s per point" in cpu.concurrency_source
    assert prof.devices == {"cpu": DeviceProfile(name="cpu", kind="cpu", memory=20_000_000, executors=1,
                                                 concurrency=cpu.concurrency,
                                                 concurrency_source=cpu.concurrency_source,
                                                 profiled_executors=cores)}
    assert prof.source.startswith("measured on ") and "1 threads" in prof.source  # the config's threads: 1
    assert len(steps) == step_count(plan_targets(cfg, model, store), (1, 2, 4), 1, cfg)
    assert sum(s.startswith("cpu: ") and "concurrent executor(s)" in s for s in steps) == k_max
    # the storage: disk and decode rates; the plain tiny zoo's fp32 stand-ins compressed to measure their decode
    st = prof.storage
    assert st is not None and st.disk_bps > 0 and st.decode_bps > 0 and st.decode_bps_alone > 0
    assert st.decode_threads == storage_profiler.loader_decode_threads()
    assert 0.75 < st.ratio < 0.9                         # fp32: (24 + ~3 bits) / 32
    assert st.load_decode_bps > 0 and st.decode_total_bps == st.load_decode_bps
    assert st.compression_pays == (st.load_decode_bps > st.disk_bps)
    assert st.source.startswith("measured on ") and "2 MB" in st.source
    assert all(a.ssd_stored_bytes == 0 for a in prof.archs.values())
    assert sum(s.startswith("storage: ") for s in steps) == storage_profiler.STEPS

def test_profile_round_trips_through_save_and_load(measured, tmp_path):
    prof = measured[0]
    path = prof.save(tmp_path / "profile.json")
    assert Profile.load(path) == prof


def test_slow_batches_cap_the_sweep_but_keep_two_sizes(tiny_config):
    cfg, model, store = open_line(tiny_config)
    steps: list[str] = []
    prof = profile_line(cfg, model, store, batch_sizes=(1, 2, 4, 8), repeats=1, progress=steps.append,
                        cap_seconds=0.0, concurrency_seconds=CONCURRENCY_SECONDS)
    for a in prof.archs.values():
        assert [n for n, _ in a.points] == [1, 2]
    assert sum("skipped" in s for s in steps) == 2 * len(prof.archs)
    assert len(steps) == step_count(plan_targets(cfg, model, store), (1, 2, 4, 8), 1, cfg)
    assert any("batch sizes above 2 skipped" in n for n in prof.notes)


def test_bad_batch_sizes_and_missing_experts_are_clear_errors(tiny_config, tmp_path):
    cfg, model, store = open_line(tiny_config)
    with pytest.raises(CoEError, match="two distinct positive"):
        profile_line(cfg, model, store, batch_sizes=(4, 4))
    with pytest.raises(CoEError, match="concurrency seconds must be positive"):
        profile_line(cfg, model, store, concurrency_seconds=0)
    with pytest.raises(CoEError, match="no expert of arch torchvision/mobilenet_v3_small.*zoo build"):
        plan_targets(cfg, model, ExpertStore(tmp_path / "empty"))


def test_plot_profile_writes_pngs(measured, tmp_path):
    prof = measured[0]
    written = plot_profile(prof, tmp_path / "plain")
    assert [p.name for p in written] == ["latency_vs_batch.png", "concurrency.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000 for p in written)
    untimed = dataclasses.replace(prof, devices={"cpu": dataclasses.replace(prof.devices["cpu"], concurrency=())})
    assert [p.name for p in plot_profile(untimed, tmp_path / "no-curve")] == ["latency_vs_batch.png"]

    cpu = dataclasses.replace(prof.devices["cpu"], split_points=((15, 80.0), (28, 120.0), (39, 121.0)),
                              count_points=((1, 100.0), (2, 150.0), (3, 140.0)), executors=2)
    tuned = dataclasses.replace(prof, devices={"cpu": cpu})
    written = plot_profile(tuned, tmp_path / "tuned")
    assert sorted(p.name for p in written) == ["concurrency.png", "latency_vs_batch.png",
                                               "throughput_vs_executors.png", "throughput_vs_experts.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written)


def _table_row(output: str, arch: str) -> list[str]:
    rows = [line.split() for line in output.splitlines() if line.split()[:1] == [arch]]
    assert len(rows) == 1, output
    return rows[0]


def test_cli_writes_profile_json_plots_and_table(tiny_line, tmp_path, monkeypatch):
    import edge_agent.profile_cli as profile_cli

    monkeypatch.setattr(profile_cli, "_tuner", lambda: None)
    out = tmp_path / "out" / "profile.json"
    res = CliRunner().invoke(cli, ["profile", "--config", str(tiny_line), "--batch-sizes", "1,2",
                                   "--repeats", "1", "--concurrency-seconds", "0.05", "--out", str(out)])
    assert res.exit_code == 0, res.output
    prof = Profile.load(out)
    assert set(prof.archs) == {Profile.key(a, "cpu") for a in ARCHS}
    assert "arch" in res.output and "K ms" in res.output and "SSD load ms" in res.output
    for a in prof.archs.values():
        row = _table_row(res.output, a.arch)
        assert row[1] == "cpu" and row[4] == str(a.max_batch) and row[5] == f"{a.weight_bytes / 1e6:.1f}"
        assert row[7] == f"{a.load_seconds['ssd'] * 1e3:.2f}"
    assert "searches skipped" in res.output
    assert storage_profiler.verdict(prof.storage) in res.output.splitlines()
    assert any(line.startswith("compression: ") and "GB/s" in line for line in res.output.splitlines())
    cpu = prof.devices["cpu"]
    curve = " ".join(f"{c:.2f}" for c in cpu.concurrency)
    assert f"cpu concurrency: {curve} ({cpu.concurrency_source})" in res.output.splitlines()
    assert "cpu: 1 executor(s), experts - of 20 MB" in res.output.splitlines()
    for name in ("latency_vs_batch.png", "concurrency.png"):
        png = out.parent / name
        assert png.read_bytes()[:8] == PNG_MAGIC and str(png) in res.output


def test_cli_profile_keeps_the_searches_outcome(tiny_line, tmp_path):
    out = tmp_path / "profile.json"
    res = CliRunner().invoke(cli, ["profile", "--config", str(tiny_line), "--batch-sizes", "1,2",
                                   "--repeats", "1", "--concurrency-seconds", "0.05", "--out", str(out)])
    assert res.exit_code == 0, res.output
    cpu = Profile.load(out).devices["cpu"]
    assert [n for n, _ in cpu.count_points] == [1, 2, 3, 4]
    assert cpu.executors == max(cpu.count_points, key=lambda p: (p[1], -p[0]))[0]
    assert cpu.expert_memory is not None and 0 < cpu.expert_memory < cpu.memory
    mb = f"{cpu.expert_memory / 1e6:.0f} MB"
    assert f"cpu: {cpu.executors} executor(s), experts {mb} of 20 MB" in res.output.splitlines()
    assert any(line.startswith("note: tune: cpu: ") and f"{cpu.executors} executor(s)" in line
               for line in res.output.splitlines())


def test_cli_runs_the_searches_when_tuning_exists(tiny_line, tmp_path, monkeypatch):
    import edge_agent.profile_cli as profile_cli

    calls, sizes = [], []

    def fake_tune(prof: Profile, model, cfg) -> Profile:
        calls.append((model.name, cfg.line))
        sizes.append({e: x.nbytes for e, x in model.experts.items()})
        cpu = dataclasses.replace(prof.devices["cpu"], split_points=((2, 10.0), (4, 12.0)), expert_memory=12_000_000)
        return dataclasses.replace(prof, devices={"cpu": cpu})

    monkeypatch.setattr(profile_cli, "_tuner", lambda: fake_tune)
    out = tmp_path / "profile.json"
    res = CliRunner().invoke(cli, ["profile", "--config", str(tiny_line), "--batch-sizes", "1,2",
                                   "--repeats", "1", "--concurrency-seconds", "0.05", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert calls == [(TINY_SPEC["name"], "T")] and "skipped" not in res.output
    # the searches count a split in experts' bytes: the model they get has the store's sizes (a spec has none)
    from storage.expert_store import ExpertStore
    assert sizes == [{e.id: e.nbytes for e in ExpertStore(tiny_line.parent.parent / "experts").entries()}]
    assert all(n > 0 for n in sizes[0].values())
    assert Profile.load(out).devices["cpu"].expert_memory == 12_000_000
    assert (tmp_path / "throughput_vs_experts.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(tiny_zoo, tmp_path):
    config = write_line(tmp_path / "line", store=tiny_zoo,
                        executors=[{"device": "cpu", "memory": "20MB"}, {"device": "cuda:1", "memory": "1GB"}])
    res = CliRunner().invoke(cli, ["profile", "--config", str(config), "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 1, res.output
    assert "'cuda:1' is not available" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "p.json").exists()


def test_batch_sizes_option_is_validated(tiny_line):
    res = CliRunner().invoke(cli, ["profile", "--config", str(tiny_line), "--batch-sizes", "4,x"])
    assert res.exit_code == 2 and "comma-separated integers" in res.output
    res = CliRunner().invoke(cli, ["profile", "--config", str(tiny_line), "--batch-sizes", "8"])
    assert res.exit_code == 2 and "two distinct" in res.output


def test_profile_help_has_an_example():
    res = CliRunner().invoke(cli, ["profile", "--help"])
    assert res.exit_code == 0 and "Example:" in res.output and "coe-agent profile --line A" in res.output
    assert res.output.index("--line") < res.output.index("--out")


def test_importing_profile_cli_first_has_no_cycle():
    code = ("import edge_agent.profile_cli as m, edge_agent.cli as c; "
            "assert c.cli.commands['profile'] is m.profile; "
            "assert {'line', 'config_path', 'out'} <= {p.name for p in m.profile.params}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_lockstep_threads_start_together_and_the_first_error_reaches_the_caller():
    import threading

    from executors.lockstep import run_in_lockstep

    seen, lock = [], threading.Lock()

    def body(i, start):
        start()
        with lock:
            seen.append(i)
    run_in_lockstep(body, 3, "t")
    assert sorted(seen) == [0, 1, 2]

    def failing(i, start):
        if i == 1:
            raise ValueError("thread 1 broke")
        start()                               # the others would wait forever without the abort
    with pytest.raises(ValueError, match="thread 1 broke"):
        run_in_lockstep(failing, 3, "t")


def test_profile_refuses_a_store_missing_a_spec_expert_before_profiling(tiny_line, tmp_path):
    """The searches need every expert's size from the store: a missing one is named before minutes of timing."""
    import json

    manifest = tiny_line.parent.parent / "experts" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["experts"] = [e for e in doc["experts"] if e["id"] != "det-ic"]
    manifest.write_text(json.dumps(doc))
    out = tmp_path / "p.json"
    res = CliRunner().invoke(cli, ["profile", "--config", str(tiny_line), "--out", str(out)])
    assert res.exit_code == 1 and "det-ic" in res.output and "not in" in res.output, res.output
    assert "profiling line" not in res.output and not out.exists()
