"""Bench and profile inputs a second audit found accepted or reaching the user as a traceback: each is now refused
in one line naming the option, file or field and the reason, and the tables say what each system gets."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from coe import CoEError
from edge_agent.cli import cli
from executors.profile import Profile
from executors.systems import DEFAULT

REPO = Path(__file__).resolve().parent.parent
GPU_CLASS = REPO / "configs" / "profiles" / "gpu-class.json"
SMALL = ["-w", "A1", "--requests", "60", "--types", "20", "--board-size", "30"]


def _doc() -> dict:
    return json.loads(GPU_CLASS.read_text())


def _bench(*args: str, env: dict | None = None):
    return CliRunner().invoke(cli, ["bench", *args], env=env)


def _refused(res, *words: str, code: int = 2) -> None:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    for w in words:
        assert w in res.output, (w, res.output)


# -- the profile loader ------------------------------------------------------------------------------------------

def _cuda(d: dict) -> dict:
    return d["devices"]["cuda:0"]


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(devices={}), r"devices: empty"),                                      # was StopIteration
    (lambda d: d.update(storage=[1, 2]), r"storage: expected a JSON object, got list"),       # was IndexError
    (lambda d: d.update(storage="abc"), r"storage: expected a JSON object, got str"),
    (lambda d: d.update(storage={"decode_bps": 1e9, "decode_threads": True}), r"storage\.decode_threads: must be"),
    (lambda d: d.update(storage={"decode_bps": 1e9, "sorce": "x"}), r"storage\.sorce: not a field"),
    (lambda d: d.update(storage={"decode_bps": 1e9, "source": 3}), r"storage\.source: must be a string"),
    (lambda d: _cuda(d).update(name="cuda:1"), r"devices\.cuda:0\.name: must be the entry's key 'cuda:0'"),
    (lambda d: _cuda(d).pop("name"), r"devices\.cuda:0: missing 'name'"),
    (lambda d: _cuda(d).update(concurrency=[True, "1.1"]), r"devices\.cuda:0\.concurrency: must be a list of numb"),
    (lambda d: _cuda(d).update(concurrency=["a"]), r"devices\.cuda:0\.concurrency"),
    (lambda d: _cuda(d).update(concurrency_source=7), r"devices\.cuda:0\.concurrency_source: must be a string"),
    (lambda d: _cuda(d).update(split_points=["xy", "z"]), r"devices\.cuda:0\.split_points\[0\]"),
    (lambda d: _cuda(d).update(count_points=[1, 2]), r"devices\.cuda:0\.count_points\[0\]"),
    (lambda d: _cuda(d).update(colour="red"), r"devices\.cuda:0\.colour: not a field"),
    (lambda d: d["archs"]["torchvision/resnet101@cuda"].update(points=[1]), r"archs\.torchvision/resnet101@cuda"),
    (lambda d: d["archs"]["torchvision/resnet101@cuda"].pop("K"), r"archs\.torchvision/resnet101@cuda: missing 'K'"),
    (lambda d: d["archs"]["ultralytics/yolov8m@cpu"]["load_seconds"].pop("host"),
     r"archs\.ultralytics/yolov8m@cpu\.load_seconds: has no 'host' time, and devices\.cuda:0 has a host tier"),
    (lambda d: d.update(notes="hello"), r"notes: must be a list of strings"),
    (lambda d: d.update(notes={"a": 1}), r"notes: must be a list of strings"),
    (lambda d: d.update(source=None), r"source: must be a string"),
    (lambda d: d.update(storge={"decode_bps": 1e9}), r"storge: not a profile field"),
], ids=["no-devices", "storage-list", "storage-str", "threads-bool", "storage-typo", "storage-source",
        "name-key", "no-name", "conc-bool", "conc-str", "conc-source", "split-str", "count-int", "device-typo",
        "points-int", "no-K", "no-host", "notes-str", "notes-dict", "source-null", "top-typo"])
def test_a_profile_field_that_was_accepted_or_crashed_is_refused_naming_it(tmp_path, change, match):
    doc = _doc()
    change(doc)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CoEError, match=f"malformed profile: {match}") as err:
        Profile.load(path)
    assert str(path) in str(err.value)


def test_the_shipped_and_the_measured_profiles_still_load_and_a_cpu_host_tier_is_not():
    """The committed profiles and one `coe-agent profile` wrote on a GPU box load as before; a host tier on a CPU
    device (documented GPU only: CoServe got it, Samba-CoE did not on a CPU-only box) is refused."""
    paths = [*sorted((REPO / "configs" / "profiles").glob("*.json")), REPO / "docs/gpu-runs/2026-11-27/call5/line-A.json"]
    for path in paths:
        prof = Profile.load(path)
        assert prof.devices and prof.archs and Profile.from_json(prof.to_json(), str(path)) == prof
    doc = _doc()
    doc["devices"]["cpu"]["host_tier"] = 4_000_000_000
    with pytest.raises(CoEError, match=r"devices\.cpu\.host_tier: a host tier is for a GPU device only"):
        Profile.from_json(doc, "p.json")


def test_a_profile_without_devices_built_in_code_is_a_clear_error():
    from executors.systems import build_system

    prof = Profile.load(GPU_CLASS)
    prof.devices = {}
    with pytest.raises(ValueError, match="has no devices"):
        build_system("samba", prof)


# -- bench: the sustained rate -------------------------------------------------------------------------------------

def test_one_request_has_no_sustained_rate_and_the_bisection_stops_at_a_floor(monkeypatch):
    import edge_agent.bench as B
    from coe.workload import task
    from executors.systems import build_system

    res = _bench("--sim", "-w", "A1", "--requests", "1", "--policies", "coserve")
    _refused(res, "--requests 1", "--load none")
    prof = Profile.load(GPU_CLASS)
    system = build_system("coserve", prof)
    with pytest.raises(ValueError, match="at least 2"):
        B.sustains(task("A1", requests=1), prof, system, 10.0)
    monkeypatch.setattr(B, "sustains", lambda *a, **k: False)       # a system that sustains nothing
    with pytest.raises(ValueError, match="sustains no steady arrival rate"):
        B.sustained_rate(task("A1", requests=40), prof, system, 80.0)


# -- bench: options ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["", ",", " , "])
def test_an_empty_workload_is_a_usage_error(value):
    _refused(_bench("--sim", "-w", value, "--load", "none"), "--workload", "at least one task")
    _refused(_bench("--sim", "-w", value, "--boxes", "1"), "--workload")


@pytest.mark.parametrize("args,option", [
    (["--sim", "-w", "A1", "--detector-share", "nan"], "--detector-share"),
    (["--sim", "-w", "A1", "--skew", "nan"], "--skew"),
    (["--sim", "-w", "A1", "--compression-ratio", "nan"], "--compression-ratio"),
    (["--real", "--arrival-ms", "nan"], "--arrival-ms"), (["--real", "--arrival-ms", "inf"], "--arrival-ms"),
    (["--sim", "-w", "A1", "--boxes", "1", "--link-ms", "inf"], "--link-ms"),
    (["--sim", "-w", "A1", "--boxes", "1", "--link-gbps", "nan"], "--link-gbps")])
def test_a_float_option_refuses_nan_and_inf(args, option, tmp_path):
    res = _bench(*args, env={"COE_DATA_DIR": str(tmp_path)})
    _refused(res, option, "is not a finite number")
    assert not list(tmp_path.iterdir())


def test_profile_concurrency_seconds_refuses_nan(tmp_path):
    res = CliRunner().invoke(cli, ["profile", "--concurrency-seconds", "nan", "--out", str(tmp_path / "p.json")])
    _refused(res, "--concurrency-seconds", "is not a finite number")
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args,named", [
    (["--real", "-w", "A1", "--policies", "coserve", "--profile", "x.json"], "--workload, --profile, --policies"),
    (["--real", "--skew", "1", "--types", "9", "--board-size", "9", "--detector-share", "0.1", "--requests", "9"],
     "--skew, --types, --board-size, --detector-share, --requests"),
    (["--real", "--load", "none", "--init", "cold", "--compression-ratio", "0.5", "--decode-rate", "1e9"],
     "--init, --load, --compression-ratio, --decode-rate"),
    (["--real", "--boxes", "2", "--out", "x"], "--boxes, --out"),
    (["--real", "--link-ms", "1"], "--link-ms"),
    (["--sim", "--boxes", "1", "--load", "0.5", "--compression-ratio", "0.5", "--decode-rate", "1e9",
      "--decode-threads", "2"], "--load, --compression-ratio, --decode-rate, --decode-threads"),
    (["--sim", "--boxes", "1", "--repeats", "2"], "--repeats"),
    (["--sim", "--repeats", "2"], "--repeats"),
    (["--sim", "--link-gbps", "1", "--link-ms", "1", "--frame-bytes", "9"], "--link-gbps, --link-ms, --frame-bytes"),
])
def test_an_option_the_mode_would_ignore_is_refused_naming_it(args, named, tmp_path):
    res = _bench(*args, env={"COE_DATA_DIR": str(tmp_path)})
    _refused(res, named, "not apply")
    assert not list(tmp_path.iterdir())                       # refused before anything ran


# -- bench: what the output records ---------------------------------------------------------------------------------

def test_boxes_record_frame_bytes_and_init_and_the_full_default_policy_list_runs_every_system():
    res = _bench("--sim", "--boxes", "1", *SMALL, "--init", "cold", "--frame-bytes", "1000",
                 "--policies", ",".join(DEFAULT))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert doc["frame_bytes"] == 1000 and doc["init"] == "cold"
    assert [r["system"] for r in doc["tasks"]["A1"]] == list(DEFAULT)      # not coserve alone
    assert "init: cold" in res.output and "1000 bytes a frame" in res.output
    res = _bench("--sim", "--boxes", "1", *SMALL, "--json")
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert [r["system"] for r in doc["tasks"]["A1"]] == ["coserve"] and doc["frame_bytes"] == 150528
    _refused(_bench("--sim", "--boxes", "1", *SMALL, "--policies", ","), "--policies", "at least one system")


def test_the_sim_table_says_how_the_pools_started(tmp_path):
    res = _bench("--sim", *SMALL, "--policies", "coserve", "--load", "none", "--init", "cold", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "init: cold (pools empty at the start), for every system" in res.output.splitlines()


def test_the_compression_what_if_survives_a_profile_without_ssd_load_times(tmp_path):
    """Every arch's SSD load 0: no load factor to quote; `min()` of none was a one-line crash."""
    doc = _doc()
    for a in doc["archs"].values():
        a["load_seconds"]["ssd"] = 0
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    res = _bench("--sim", *SMALL, "--policies", "coserve", "--load", "none", "--profile", str(path), "--out",
                 str(tmp_path), "--compression-ratio", "0.66", "--decode-rate", "1e9")
    assert res.exit_code == 0, res.output
    assert "1.00x the plain one" in res.output


# -- bench/sim_*.py --------------------------------------------------------------------------------------------------

def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / name), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


@pytest.mark.parametrize("name,args,says", [
    ("sim_rates.py", ["--rates", "0"], "--rates"), ("sim_rates.py", ["--rates", "abc"], "--rates"),
    ("sim_rates.py", ["--rates", "-5"], "--rates"), ("sim_rates.py", ["--rates", "nan"], "--rates"),
    ("sim_rates.py", ["--systems", "bogus"], "unknown system 'bogus'"),
    ("sim_rates.py", ["--profile", "/nope.json"], "profile does not exist"),
    ("sim_rates.py", ["-w", "Z1"], "unknown workload 'Z1'"),
    ("sim_shapes.py", ["--systems", "bogus"], "unknown system 'bogus'"),
    ("sim_shapes.py", ["--profile", "/nope.json"], "profile does not exist"),
    ("sim_shapes.py", ["--compression-ratio", "0.8", "--decode-rate", "-1"], "--decode-rate must be positive"),
    ("sim_shapes.py", ["--compression-ratio", "2", "--decode-rate", "1e9"], "--compression-ratio must be in (0, 1]"),
    ("sim_shapes.py", ["--compression-ratio", "0.8", "--decode-rate", "1e9", "--decode-threads", "0"],
     "--decode-threads must be at least 1"),
    ("sim_shapes.py", ["--load", "0"], "--load must be in (0, 1]"),
    ("sim_shapes.py", ["--load", "1.5"], "--load must be in (0, 1]"),
])
def test_the_sim_scripts_refuse_bad_input_in_one_line(name, args, says):
    r = _script(name, *args)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr and not r.stdout


def test_the_sim_scripts_state_each_systems_resources():
    from executors.systems import build_system

    prof = Profile.load(GPU_CLASS)
    want = {s: build_system(s, prof).resources() for s in ("coserve", "samba")}
    for name, args in (("sim_rates.py", ["--rates", "50", "-w", "A1", "--systems", "coserve,samba"]),
                       ("sim_seeds.py", ["--rate", "50", "-w", "A1", "--seeds", "0", "--systems", "coserve,samba"])):
        r = _script(name, *args)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        assert doc["resources"] == want
        lines = r.stdout.splitlines()
        at = lines.index("resources (every system gets the same machine):")
        assert [ln.split(None, 1) for ln in lines[at + 1:at + 3]] == [[s, want[s]] for s in want]


def test_sim_shapes_states_each_systems_resources():
    from executors.systems import build_system

    r = _script("sim_shapes.py", "--boards", "0", "--systems", "coserve")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["resources"] == {"coserve": build_system("coserve", Profile.load(GPU_CLASS)).resources()}
    assert "resources (every system gets the same machine):" in r.stdout
