"""Bad input an audit found passing the checks (or reaching the user as a traceback): each now fails early, in one
line naming the file, field or option and the reason.  Real files, the real CLI, a real agent."""
from __future__ import annotations

import copy
import errno
import json
import shutil
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from coe import CoEError, SpecError, parse_spec
from conftest import TINY_SPEC, free_port, write_line
from edge_agent.cli import cli

REPO = Path(__file__).resolve().parent.parent


# -- profiles ---------------------------------------------------------------------------------------------------

def _profile() -> dict:
    return json.loads((REPO / "configs" / "profiles" / "gpu-class.json").read_text())


def _first_arch(doc: dict) -> str:
    return next(iter(doc["archs"]))


@pytest.mark.parametrize("change,match", [
    (lambda d, k: d["archs"][k].update(max_batch=2.5), r"archs\..*\.max_batch: must be a whole number >= 1, got 2.5"),
    (lambda d, k: d["archs"][k].update(K="0.1"), r"archs\..*\.K: must be a finite number of seconds >= 0, got '0.1'"),
    (lambda d, k: d["archs"][k].update(load_seconds={"ssd": "x"}), r"load_seconds\.ssd: must be a finite number"),
    (lambda d, k: d["archs"][k].update(weight_bytes=-5), r"weight_bytes: must be a whole number of bytes >= 0"),
    (lambda d, k: d["archs"][k].update(device="tpu"), r"\.device: must be 'cpu' or 'cuda', got 'tpu'"),
    (lambda d, k: d["archs"][k].update(points=[[1]]), r"points\[0\]: must be \[batch size >= 1, seconds >= 0\]"),
    (lambda d, k: d["archs"].update({"x@cpu": d["archs"].pop(k)}), r"archs\.x@cpu: the key must be '.*@"),
    (lambda d, k: d.update(devices=[]), r"devices: expected a JSON object, got list"),
    (lambda d, k: d.update(archs={"a@cpu": 3}), r"archs\.a@cpu: expected a JSON object, got int"),
    (lambda d, k: d.pop("archs"), r"malformed profile: missing 'archs'"),
    # values that passed and then failed every switch, or made every batch cost nothing, while serving
    (lambda d, k: d["archs"][k].update(load_seconds={}), r"load_seconds: has no 'ssd' time"),
    (lambda d, k: d["archs"][k].update(load_seconds={"sdd": 0.1, "ssd": 0.1}), r"load_seconds\.sdd: not a tier"),
    (lambda d, k: d["archs"][k].update(K=0, B=0), r"K and B are both 0"),
    (lambda d, k: d["archs"][k].update(weight_bytes=0), r"weight_bytes: an expert has weights: must be >= 1"),
], ids=["batch-float", "K-string", "load-string", "negative-bytes", "device", "points", "key", "devices-list",
        "arch-int", "no-archs", "no-ssd", "tier-typo", "zero-cost", "no-weights"])
def test_a_profile_value_the_agent_could_not_use_is_refused_naming_it(tmp_path, change, match):
    from executors.profile import Profile

    doc = _profile()
    change(doc, _first_arch(doc))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(CoEError, match=match) as err:
        Profile.load(path)
    assert str(path) in str(err.value)
    assert Profile.load(REPO / "configs" / "profiles" / "gpu-class.json").archs       # the shipped one loads


# -- spec ids ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["../../evil", "", ".hidden", "a/b"])
def test_a_spec_expert_id_that_cannot_name_a_store_file_is_refused_in_the_spec(bad):
    spec = copy.deepcopy(TINY_SPEC)
    old = spec["experts"][0]["id"]
    spec["experts"][0]["id"] = bad
    with pytest.raises(SpecError) as err:
        parse_spec(spec, "tiny.coe.yaml")
    assert err.value.key == "experts[0].id" and "cannot name a store file" in err.value.reason, (old, err.value)


# -- the agent ---------------------------------------------------------------------------------------------------

def test_a_cuda_executor_on_a_box_without_that_device_names_the_config_key(tmp_path, tiny_zoo):
    torch = pytest.importorskip("torch")
    from edge_agent.agent import Agent
    from edge_agent.config import load_config

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    path = write_line(tmp_path / "line", store=tiny_zoo,
                      executors=[{"device": f"cuda:{n}", "count": 1, "memory": "20MB", "threads": 1}])
    with pytest.raises(ValueError, match=rf"executors\.0\.device: cuda:{n}: this machine has {n} CUDA device"):
        Agent(load_config(path, env={}))


def test_why_a_bind_failed_points_at_a_process_only_when_the_address_is_in_use():
    from edge_agent.bind_errors import why_bind_failed

    assert "another agent" in why_bind_failed(OSError(errno.EADDRINUSE, "Address already in use"))
    for exc in (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"),
                socket.gaierror(socket.EAI_NONAME, "Name or service not known")):
        assert "another agent" not in why_bind_failed(exc)
    assert "host name or address" in why_bind_failed(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))


def test_a_metrics_bind_that_does_not_resolve_is_not_blamed_on_another_agent(tmp_path, tiny_zoo):
    from edge_agent.agent import Agent
    from edge_agent.config import load_config

    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    path = write_line(tmp_path / "line", store=store, metrics={"port": 0, "bind": "no-such-host.invalid"})
    agent = Agent(load_config(path, env={}))
    with pytest.raises(OSError) as err:
        agent.start()
    assert "metrics port no-such-host.invalid:0" in str(err.value) and "another agent" not in str(err.value)


# -- the CLI -----------------------------------------------------------------------------------------------------

def test_replay_options_out_of_range_and_a_bad_endpoint_fail_before_anything_is_sent(tiny_recording):
    rec = str(tiny_recording)
    to = ["--endpoint", f"tcp://127.0.0.1:{free_port()}"]
    for extra, msg in ((["--window", "0"], "--window"), (["--deadline", "-1"], "--deadline"),
                       (["--rate", "-5"], "--rate"), (["--endpoint", "garbage"], "expected tcp://HOST:PORT"),
                       (["--endpoint", "tcp://127.0.0.1:99999"], "port 99999 is out of range")):
        args = ["replay", rec, *(to if "--endpoint" not in extra else []), *extra]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output, (extra, res.output)


def test_replay_checks_every_image_before_it_sends_one(tmp_path, tiny_recording):
    from storage.recording import Recording

    rec_dir = tmp_path / "rec"
    shutil.copytree(tiny_recording, rec_dir)
    frames = list(Recording(rec_dir))
    (rec_dir / frames[10].file).unlink()                     # the eleventh image is gone
    sock_port = free_port()
    res = CliRunner().invoke(cli, ["replay", str(rec_dir), "--endpoint", f"tcp://127.0.0.1:{sock_port}",
                                   "--deadline", "2"])
    assert res.exit_code == 1 and "image file missing" in res.output and "nothing was sent" in res.output, res.output


def test_replay_fails_when_the_agent_accepts_nothing(tmp_path, tiny_zoo, tiny_recording):
    """A recording of another line: every frame rejected wrong_line; that is a failed replay, not exit 0."""
    from edge_agent.agent import Agent
    from edge_agent.config import load_config

    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    path = write_line(tmp_path / "line", store=store, line="U")
    agent = Agent(load_config(path, env={})).start()
    try:
        res = CliRunner().invoke(cli, ["replay", str(tiny_recording), "--endpoint", agent.endpoints["ingest"]])
    finally:
        agent.stop()
    assert res.exit_code == 1 and "accepted none of the 60 frame(s)" in res.output and "wrong_line 60" in res.output


def test_results_on_a_file_that_is_not_a_results_database_is_one_line(tmp_path):
    for name, data in (("bin.db", b"\x00\x01not sqlite at all" * 100), ("empty.db", b"")):
        (tmp_path / name).write_bytes(data)
        res = CliRunner().invoke(cli, ["results", "--db", str(tmp_path / name)])
        assert res.exit_code == 1 and "not a coe-edge results database" in res.output, res.output
    res = CliRunner().invoke(cli, ["results", "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 1 and "no results database there" in res.output


@pytest.mark.parametrize("args,option", [(["--types", "0"], "--types"), (["--requests", "-3"], "--requests"),
                                         (["--board-size", "0"], "--board-size"),
                                         (["--detector-share", "5"], "--detector-share"), (["--skew", "-1"], "--skew")])
def test_bench_workload_options_out_of_range_are_usage_errors(args, option):
    res = CliRunner().invoke(cli, ["bench", "--sim", "-w", "A1", "--load", "none", *args])
    assert res.exit_code == 2 and option in res.output and "Traceback" not in res.output


def test_compress_refuses_a_folder_that_is_not_an_expert_store(tmp_path, tiny_line):
    folder = tmp_path / "just-a-folder"
    folder.mkdir()
    res = CliRunner().invoke(cli, ["experts", "compress", "--store", str(folder), "--config", str(tiny_line)])
    assert res.exit_code == 1 and "not an expert store (no manifest.json)" in res.output
    assert list(folder.iterdir()) == []                       # nothing written into it


def test_line_against_another_lines_config_is_a_usage_error(tiny_line):
    res = CliRunner().invoke(cli, ["experts", "ls", "--line", "B", "--config", str(tiny_line)])
    assert res.exit_code == 2 and "--line B, but --config" in res.output and "line T" in res.output
    res = CliRunner().invoke(cli, ["experts", "ls", "--config", str(tiny_line)])     # --line left at its default
    assert res.exit_code == 0, res.output
