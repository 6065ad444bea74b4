"""Issue 12, parts 3 and 4: what a compressed expert's switch costs, whether compression pays on a box,
and what it does to the paper tasks in simulation."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from coe import CoEError, CoEModel, Component, Expert
from edge_agent.bench import SimCompression, run_sim, sim_compression
from edge_agent.cli import cli
from executors.costs import (ExecutorInfo, ProfileCosts, StoredForm, compressed_load_seconds, ssd_load_seconds,
                             store_forms, uniform_forms)
from executors.profile import ArchProfile, Profile, StorageProfile
from executors.simdevice import SimExecutor, SimSystem, simulate
from executors.storage_profiler import (measure_decode_contended, measure_disk_rate, measure_expert_decode,
                                       verdict)
from storage.expert_store import ExpertStore
from storage.pool import Pool
from storage.policies import make_policy

from conftest import SizedSource
from test_simdevice import ARCH, DeviceProfile, one_arch_model, toy_workload

GPU_CLASS = "configs/profiles/gpu-class.json"
GB = 1e9
rates = st.floats(1e6, 1e11)
sizes = st.floats(1.0, 1e10)


# -- compressed_load_seconds -------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(decoded=sizes, ratio=st.floats(0.05, 1.0), disk=rates, decode=rates)
def test_a_compressed_load_is_the_slower_of_read_and_decode_never_less(decoded, ratio, disk, decode):
    stored = decoded * ratio
    t = compressed_load_seconds(stored, decoded, disk, decode)
    assert t >= stored / disk and t >= decoded / decode           # never below either term ...
    assert t == pytest.approx(max(stored / disk, decoded / decode))  # ... and no sum: the reader overlaps them
    if decode > disk:                                              # decode outruns the disk: never slower than plain
        assert t <= decoded / disk * (1 + 1e-12)


def test_disk_bound_costs_the_stored_bytes_and_decode_bound_the_decoded_ones():
    # 0.5 GB/s disk, 2 GB/s decode: 66 MB stored of 100 MB take 0.132 s, decode would take 0.05 s
    assert compressed_load_seconds(66e6, 100e6, 0.5 * GB, 2 * GB) == pytest.approx(66e6 / 0.5e9)
    # 7 GB/s NVMe, 1 GB/s decode: the decoder sets the pace, 0.1 s, slower than the plain 100 MB / 7 GB/s
    assert compressed_load_seconds(66e6, 100e6, 7 * GB, 1 * GB) == pytest.approx(0.1)
    assert compressed_load_seconds(66e6, 100e6, 7 * GB, 1 * GB) > 100e6 / (7 * GB)
    with pytest.raises(ValueError, match="positive"):
        compressed_load_seconds(1, 1, 0, 1)


# -- the cost model ----------------------------------------------------------------------------------

def _arch(load: float = 0.2, nbytes: int = 100_000_000, stored: int = 0) -> ArchProfile:
    return ArchProfile(ARCH, "cpu", 0.01, 0.001, 8, nbytes, 10, {"ssd": load, "host": load / 10},
                       ssd_stored_bytes=stored)


def test_plain_experts_keep_their_profiled_load_and_compressed_ones_read_fewer_bytes():
    a = _arch(load=0.25)                                        # 100 MB in 0.25 s: 0.2 s read at 0.5 GB/s + 0.05 rest
    fast = StorageProfile(disk_bps=0.5 * GB, decode_bps=1 * GB, decode_threads=2)
    slow = StorageProfile(disk_bps=0.5 * GB, decode_bps=0.1 * GB, decode_threads=2)
    packed = StoredForm(66_000_000, 100_000_000)
    assert ssd_load_seconds(a, None, fast) == 0.25              # plain: exactly the profiled load
    assert ssd_load_seconds(a, packed, fast) == pytest.approx(0.05 + 0.132)   # the rest stays, the read shrinks
    assert ssd_load_seconds(a, packed, slow) == pytest.approx(0.05 + 0.5)     # 0.2 GB/s of decode: slower
    assert ssd_load_seconds(a, packed, None) == 0.25            # no decode rate known: the profiled load stands
    assert ssd_load_seconds(a, packed, StorageProfile()) == 0.25
    # no measured disk: the arch's own rate, all of its load transfer (100 MB / 0.25 s = 0.4 GB/s)
    assert ssd_load_seconds(a, packed, StorageProfile(decode_bps=1 * GB)) == pytest.approx(0.66 * 0.25)


def test_a_load_timed_on_a_compressed_file_is_unpicked_for_plain_experts():
    # the stand-in was compressed at 0.66 when timed: 0.132 s read (disk-bound) + 0.05 s rest
    a = _arch(load=0.182, stored=66_000_000)
    st_ = StorageProfile(disk_bps=0.5 * GB, decode_bps=1 * GB, decode_threads=2)
    assert ssd_load_seconds(a, None, st_) == pytest.approx(0.05 + 0.2)            # plain: the full read
    assert ssd_load_seconds(a, StoredForm(66_000_000, 100_000_000), st_) == pytest.approx(0.182)


def test_the_scheduler_sees_a_compressed_expert_switch_faster_when_decode_outruns_the_disk(tmp_path):
    store = ExpertStore(tmp_path / "store", verify="never")
    tensors = {"w": (torch.randn(400, 1000, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)}
    store.write(Expert("plain", ARCH, "classifier", ("ok", "bad"), 32), tensors)
    store.set_compression("exponent-zstd")
    store.write(Expert("packed", ARCH, "classifier", ("ok", "bad"), 32), tensors)
    e = store.entry("packed")
    assert e.compression == "exponent-zstd" and e.stored_nbytes < e.nbytes == store.entry("plain").nbytes
    forms = store_forms(store)
    assert forms("plain") is None and forms("absent") is None
    assert forms("packed") == StoredForm(e.stored_nbytes, e.nbytes)

    model = CoEModel("toy", {k: Expert(k, ARCH, "classifier", ("ok", "bad"), 32, nbytes=e.nbytes)
                             for k in ("plain", "packed")},
                     {f"c-{k}": Component(f"c-{k}", k, 1.0) for k in ("plain", "packed")})
    pool = Pool("cpu", 10 * e.nbytes, make_policy("lru"), SizedSource({"plain": e.nbytes, "packed": e.nbytes}))
    base = Profile("test", {}, {Profile.key(ARCH, "cpu"): _arch(load=e.nbytes / 0.5e9, nbytes=e.nbytes)})

    def costs(storage):
        return ProfileCosts(model, {"x": ExecutorInfo("cpu", 100 * e.nbytes, pool)}, replace(base, storage=storage),
                            stored=forms)
    fast = costs(StorageProfile(disk_bps=0.5 * GB, decode_bps=2 * GB))
    assert fast.switch_cost("x", "packed") == pytest.approx(e.stored_nbytes / 0.5e9)
    assert fast.switch_cost("x", "packed") < fast.switch_cost("x", "plain") == pytest.approx(e.nbytes / 0.5e9)
    assert fast.ssd_seconds("x", "packed") == fast.switch_cost("x", "packed")
    slow = costs(StorageProfile(disk_bps=0.5 * GB, decode_bps=0.1 * GB))
    assert slow.switch_cost("x", "packed") > slow.switch_cost("x", "plain")
    old = costs(None)                                              # an old profile: no decode cost known
    assert old.switch_cost("x", "packed") == old.switch_cost("x", "plain")


# -- the profile -------------------------------------------------------------------------------------

def test_the_storage_figures_round_trip_and_old_profiles_still_load(tmp_path):
    old = Profile.load(GPU_CLASS)
    assert old.storage is None and "storage" not in old.to_json()
    assert "unknown" in verdict(old.storage) and "rerun" in verdict(old.storage)
    st_ = StorageProfile(disk_bps=1.9e9, decode_bps=1.3e9, decode_threads=2, decode_bps_alone=1.5e9, ratio=0.66,
                         source="measured on test")
    arch = replace(next(iter(old.archs.values())), arch="x", device="cpu", ssd_stored_bytes=123)   # key x@cpu
    prof = replace(old, storage=st_, archs={**old.archs, "x@cpu": arch})
    raw = prof.to_json()
    assert raw["storage"]["compression_pays"] is True and raw["storage"]["decode_bps"] == 1.3e9
    back = Profile.load(prof.save(tmp_path / "p.json"))
    assert back == prof and back.storage.decode_total_bps == 2.6e9 and back.archs["x@cpu"].ssd_stored_bytes == 123
    raw["storage"]["decode_threads"] = 0
    with pytest.raises(CoEError, match="storage.decode_threads"):
        Profile.from_json(raw)
    raw["storage"].update(decode_threads=1, disk_bps=-1)
    with pytest.raises(CoEError, match="storage.disk_bps"):
        Profile.from_json(raw)


def test_compression_pays_when_decoding_outruns_the_disk_and_the_verdict_gives_the_figures():
    sata = StorageProfile(disk_bps=0.53e9, decode_bps=0.8e9, decode_threads=2, ratio=0.66)
    assert sata.compression_pays is True and sata.load_factor(0.66) == pytest.approx(0.66)
    line = verdict(sata)
    assert line.startswith("compression: pays on this box") and "0.53 GB/s" in line and "1.60 GB/s" in line
    assert "0.66x the plain one" in line
    nvme = StorageProfile(disk_bps=7e9, decode_bps=0.8e9, decode_threads=2)
    assert nvme.compression_pays is False and nvme.load_factor(0.66) == pytest.approx(7 / 1.6)
    assert "does not pay" in verdict(nvme) and "compression: none" in verdict(nvme)
    assert StorageProfile(disk_bps=1e9).compression_pays is None


def test_the_line_s_own_experts_decode_rate_wins_over_the_sample_and_is_measured_plain_or_packed(tmp_path):
    st_ = StorageProfile(disk_bps=1e9, decode_bps=1e9, decode_threads=2, load_decode_bps=0.5e9, ratio=0.82)
    assert st_.decode_total_bps == 0.5e9 and st_.compression_pays is False   # the sample alone would say it pays
    assert "the line's experts" in verdict(st_) and "does not pay" in verdict(st_)
    g = torch.Generator().manual_seed(0)
    tensors = {"w": (torch.randn(600, 1000, generator=g) * 0.02).to(torch.bfloat16), "b": torch.randn(1000, generator=g)}
    store = ExpertStore(tmp_path / "s", verify="never")
    store.write(Expert("plain", ARCH, "classifier", ("ok", "bad"), 32), tensors)
    store.set_compression("exponent-zstd")
    store.write(Expert("packed", ARCH, "classifier", ("ok", "bad"), 32), tensors)
    for eid in ("plain", "packed"):
        rate, ratio = measure_expert_decode(store, [eid], repeats=1)
        assert rate > 0 and 0.6 < ratio < 0.75                    # mostly bf16: about two thirds
    assert store.entry("plain").compression == "none" and not list((tmp_path / "s").glob("plain.coez"))
    prof = replace(Profile.load(GPU_CLASS), storage=st_)
    comp = sim_compression(prof, 0.66, None, None)                  # the profile's figures, the what-if's ratio
    assert comp.storage.decode_total_bps == 0.5e9 and comp.ratio == comp.storage.ratio == 0.66


def test_the_measured_rates_are_the_bytes_over_the_timed_span(tmp_path, monkeypatch):
    import types

    from executors import storage_profiler

    f = tmp_path / "blob"
    f.write_bytes(b"\x01" * (4 << 20))
    disk, _cold = measure_disk_rate([f], repeats=1)
    assert disk > 0
    assert measure_decode_contended(2, 2 << 20, repeats=1) > 0
    with pytest.raises(ValueError, match="threads must be at least 1"):
        measure_decode_contended(0)
    # on a clock that moves 0.25 s per reading, each timed read or decode takes exactly 0.25 s: the rates are the
    # bytes over that (a rate over the wrong bytes, or not over the timed span, fails)
    now = [0.0]

    def tick() -> float:
        now[0] += 0.25
        return now[0]
    monkeypatch.setattr(storage_profiler, "time", types.SimpleNamespace(perf_counter=tick))
    disk, _cold = measure_disk_rate([f], repeats=1)
    assert disk == pytest.approx((4 << 20) / 0.25)
    decoded = storage_profiler._bf16_sample(2 << 20).size
    assert measure_decode_contended(1, 2 << 20, repeats=1) == pytest.approx(decoded / 0.25)


# -- the simulation ----------------------------------------------------------------------------------

def test_uniform_forms_scale_every_expert():
    model = one_arch_model(3, nbytes=1000)
    assert uniform_forms(model, 1.0)("e0") is None
    assert uniform_forms(model, 0.5)("e1") == StoredForm(500, 1000)
    with pytest.raises(ValueError, match="ratio"):
        uniform_forms(model, 1.5)


def test_an_ssd_bound_toy_gains_in_proportion_to_the_bytes_saved():
    """One executor that holds one expert, every request a different one: all loads, little compute."""
    model = one_arch_model(20, nbytes=1000)
    dev = DeviceProfile("cpu", "cpu", 10_000)
    prof = Profile("test: toy", {"cpu": dev},
                   {Profile.key(ARCH, "cpu"): ArchProfile(ARCH, "cpu", 0.001, 0.0, 4, 1000, 10,
                                                          {"ssd": 0.5, "host": 0.05})})
    system = SimSystem("t", (SimExecutor("cpu#0", "cpu", 2000, 1000),), "coserve", "lru", init="cold")
    w = toy_workload(model, [f"c{i}" for i in range(20)])
    plain = simulate(w, prof, system)
    fast = simulate(w, replace(prof, storage=StorageProfile(decode_bps=1e6)), system, stored=uniform_forms(model, 0.6))
    slow = simulate(w, replace(prof, storage=StorageProfile(decode_bps=1e3)), system, stored=uniform_forms(model, 0.6))
    assert fast.ssd_busy == pytest.approx(0.6 * plain.ssd_busy)
    assert fast.throughput / plain.throughput == pytest.approx(1 / 0.6, rel=0.02)
    assert slow.throughput < plain.throughput                     # decode-bound: compression costs time
    for r in (plain, fast, slow):
        assert r.lower_bound <= r.makespan + 1e-9


def test_the_paper_tasks_gain_throughput_where_the_ssd_is_the_bottleneck():
    prof = Profile.load(GPU_CLASS)
    comp = SimCompression(0.66, StorageProfile(decode_bps=1e9, decode_threads=2))
    args = (["A1"], prof, ["coserve", "samba"])
    kw = {"overrides": {"requests": 400}}   # all 352 types: most experts start on SSD
    plain = {r.system: r for r in run_sim(*args, **kw)["A1"]}
    packed = {r.system: r for r in run_sim(*args, **kw, compression=comp)["A1"]}
    for name in ("coserve", "samba"):
        assert packed[name].throughput > plain[name].throughput
        assert packed[name].ssd_busy < plain[name].ssd_busy
        assert packed[name].lower_bound <= packed[name].makespan
    # samba is all SSD: its gain comes close to the bytes saved (1 / 0.66 = 1.52x)
    assert packed["samba"].throughput / plain["samba"].throughput > 1.3


def test_bench_sim_compression_reports_both_side_by_side(tmp_path):
    # 200 types: the SSD is most of the run for both (with 80 the tiers hold nearly every expert from the start)
    args = ["bench", "--sim", "-w", "A1", "--requests", "400", "--types", "200", "--policies", "coserve",
            "--load", "none", "--out", str(tmp_path), "--compression-ratio", "0.66"]
    res = CliRunner().invoke(cli, [*args, "--decode-rate", "1e9", "--decode-threads", "2"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    comp = out["compression"]
    assert comp["ratio"] == 0.66 and comp["decode_bps_per_thread"] == 1e9 and comp["decode_threads"] == 2
    assert set(comp["load_factor"].values()) == {0.66}        # 530 MB/s disk vs 2 GB/s decode: disk-bound
    gains = {r["system"]: r for r in out["compression_gain"]["A1"]}
    assert set(gains) == {"coserve", "samba"}
    for r in gains.values():
        assert r["ssd_share"] > 0.5
        assert r["compressed"] > r["plain"] and r["gain"] == pytest.approx(r["compressed"] / r["plain"], abs=1e-3)
    text = res.output
    assert "task A1: plain store vs compressed at ratio 0.66" in text and "GB experts" in text
    assert "simulation (virtual clock, profiled costs)" in text and "ceiling if wholly SSD-bound: 1.52x" in text

    res = CliRunner().invoke(cli, args)                           # the GPU-class profile has no decode rate
    assert res.exit_code == 2 and "--decode-rate" in res.output
    res = CliRunner().invoke(cli, [*args[:-2], "--decode-rate", "1e9"])
    assert res.exit_code == 2 and "only apply with --compression-ratio" in res.output
    res = CliRunner().invoke(cli, [*args, "--decode-rate", "fast"])
    assert res.exit_code == 2 and "'here'" in res.output


def test_a_pool_fits_an_expert_at_the_size_its_source_loads_it_at(tmp_path):
    """The scheduler's `fits` compared the file's size: an fp16 expert takes twice that in an fp32 CPU pool,
    so the pool refused it while serving (and marked it failed for every executor)."""
    import torch

    from coe import CoEModel, Component, Expert
    from executors.costs import ExecutorInfo, ProfileCosts
    from storage.expert_store import ExpertStore
    from storage.policies import make_policy
    from storage.pool import Pool
    from storage.tiers import StoreSource

    store = ExpertStore(tmp_path)
    e = Expert(id="cls-h", arch="torchvision/resnet18", kind="classifier", classes=("ok", "bad"), input_size=32)
    store.write(e, {"w": torch.randn(1000, 100).half()})
    stored = store.nbytes("cls-h")
    model = CoEModel("m", {e.id: e}, {"C": Component("C", e.id, 1.0)}).with_sizes({e.id: stored})
    cap = int(stored * 1.5)
    as_fp32 = Pool("cpu", cap, make_policy("lru"), StoreSource(store, dtype="float32"))
    as_stored = Pool("cpu", cap, make_policy("lru"), StoreSource(store, dtype=None))
    costs = ProfileCosts(model, {"f32": ExecutorInfo("cpu", cap, as_fp32), "f16": ExecutorInfo("cpu", cap, as_stored)})
    assert not costs.fits("f32", "cls-h") and costs.fits("f16", "cls-h")


def test_a_cpu_executors_speed_is_its_thread_share_not_the_count_of_cpu_executors():
    """The agent splits the cores among every executor, GPU ones included; the cost model counted the CPU
    executors only: one CPU executor beside a GPU on 16 cores runs at the 8 threads it was profiled at, and was
    predicted 1.25x faster."""
    from coe import CoEModel, Component, Expert
    from executors.costs import ExecutorInfo, ProfileCosts
    from executors.profile import DeviceProfile, Profile

    e = Expert(id="c", arch="torchvision/resnet18", kind="classifier", classes=("ok", "bad"), input_size=32)
    model = CoEModel("m", {"c": e}, {"C": Component("C", "c", 1.0)}).with_sizes({"c": 1000})
    cpu = DeviceProfile("cpu", "cpu", 10**9, concurrency=(1.0, 1.6), profiled_executors=2)
    prof = Profile("assumed: test", {"cpu": cpu}, {})
    pool = type("P", (), {"capacity": 10**9})()
    shared = ProfileCosts(model, {"cpu0": ExecutorInfo("cpu", 10**9, pool, device="cpu", thread_share=2)}, prof)
    alone = ProfileCosts(model, {"cpu0": ExecutorInfo("cpu", 10**9, pool, device="cpu")}, prof)
    assert shared._speed["cpu0"] == pytest.approx(1.0)          # it runs at the share it was profiled at
    assert alone._speed["cpu0"] == pytest.approx(2 / 1.6)       # without it: the count of CPU executors (one)
