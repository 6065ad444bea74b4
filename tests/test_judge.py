"""Replay that judges: truth joins, confusion, baseline diffs, the gate, and a worse candidate caught end to end."""
from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from coe import CoEError, parse_spec
from edge_agent.judge import failed_conditions, judge, parse_gate, true_verdict, write_report
from storage.recording import Recording

from conftest import TINY_SPEC, write_line

MODEL = parse_spec(TINY_SPEC)


def _db(path: Path, verdicts: dict[str, str]) -> Path:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE verdicts (frame_id TEXT PRIMARY KEY, verdict TEXT, reason TEXT, decided_at REAL, "
                "latency_ms REAL, chain TEXT)")
    con.executemany("INSERT INTO verdicts VALUES (?, ?, '', 0, ?, '')",
                    [(f, v, 10.0 + i) for i, (f, v) in enumerate(verdicts.items())])
    con.commit()
    con.close()
    return path


def test_truth_labels_become_true_verdicts_through_the_classifier_pass_labels():
    assert true_verdict(MODEL, "R0402", "ok") == "pass"
    assert true_verdict(MODEL, "R0402", "missing") == "defect"
    assert true_verdict(MODEL, "NOPE", "ok") is None and true_verdict(MODEL, "R0402", None) is None


def test_judge_counts_confusion_and_splits_baseline_changes(tmp_path, tiny_recording):
    rec = Recording(tiny_recording)
    frames = list(rec)
    truth = {f.header["frame_id"]: true_verdict(MODEL, f.header.get("component") or f.truth_component, f.truth)
             for f in frames}
    ids = list(truth)
    flip = {"pass": "defect", "defect": "pass"}
    base = {f: truth[f] for f in ids}
    base[ids[0]] = flip[truth[ids[0]]]                      # wrong in the baseline, right now: fixed
    now = {f: truth[f] for f in ids[:-1]}                   # the last frame never got a verdict
    now[ids[1]] = flip[truth[ids[1]]]                       # right before, wrong now: broken
    j = judge(MODEL, rec, _db(tmp_path / "now.db", now), baseline_db=_db(tmp_path / "base.db", base))
    assert (j.frames, j.missing, j.judged) == (len(frames), 1, len(frames) - 1)
    assert j.correct == j.judged - 1 and j.wrong == [ids[1]]
    assert (j.fixed, j.broken, j.changed) == ([ids[0]], [ids[1]], [])
    assert sum(sum(c.values()) for c in j.confusion_by_label.values()) == j.judged
    assert j.p50_ms is not None and j.p99_ms >= j.p50_ms
    md = write_report(j, tmp_path / "report", parse_gate("accuracy>=0.5,regressions<=0"))
    text = md.read_text()
    assert "accuracy" in text and "FAILED" in text and "regressions<=0 (got 1)" in text
    assert (tmp_path / "report" / "confusion.png").stat().st_size > 1000
    doc = json.loads((tmp_path / "report" / "report.json").read_text())
    # the frame without a verdict fails the gate too, unless the gate says how many may be missing
    assert doc["broken"]["count"] == 1 and doc["gate_failed"] == ["regressions<=0 (got 1)", "missing<=0 (got 1)"]
    assert failed_conditions(j, parse_gate("accuracy>=0.5,missing<=1")) == []


@pytest.mark.parametrize("gate, message", [
    ("accuracy=>0.9", "cannot read"), ("speed>=3", "unknown metric 'speed'"), ("", "no conditions"),
    ("accuracy>=high", "cannot read"), ("accuracy>=97", "accuracy is a fraction in 0..1.*accuracy>=0.97"),
])
def test_bad_gates_are_named(gate, message):
    with pytest.raises(CoEError, match=message):
        parse_gate(gate)


def test_a_missing_or_foreign_database_is_a_clear_error(tmp_path, tiny_recording):
    with pytest.raises(CoEError, match="no results database"):
        judge(MODEL, Recording(tiny_recording), tmp_path / "nope.db")
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 10)
    with pytest.raises(CoEError, match="not a coe-edge results database"):
        judge(MODEL, Recording(tiny_recording), tmp_path / "junk.db")


def _run_line(config: Path, recording: Path, *extra: str):
    """Start the line's agent, replay through the CLI with a report, stop; returns the CLI result."""
    from edge_agent.agent import Agent
    from edge_agent.cli import cli
    from edge_agent.config import load_config

    agent = Agent(load_config(config, env={})).start()
    try:
        return CliRunner().invoke(cli, ["replay", str(recording), "--config", str(config),
                                        "--endpoint", agent.endpoints["ingest"].replace("*", "127.0.0.1"),
                                        "--window", "16", *extra])
    finally:
        agent.stop()


def test_the_gate_catches_a_worse_candidate_and_passes_an_identical_one(tmp_path, tiny_zoo, tiny_recording):
    from edge_agent.config import load_config
    from storage.expert_store import ExpertStore

    stores = {}
    for name in ("base", "same", "worse"):
        stores[name] = tmp_path / f"store-{name}"
        shutil.copytree(tiny_zoo, stores[name])
    worse = ExpertStore(stores["worse"])
    tensors = dict(worse.read("cls-r0402"))
    bias = next(k for k in tensors if k.endswith("classifier.3.bias"))
    tensors[bias] = torch.tensor([0.0, 50.0, 0.0, 0.0])          # says 'missing' whatever it sees
    worse.write(MODEL.experts["cls-r0402"], tensors, version=2)
    configs = {n: write_line(tmp_path / f"line-{n}", store=s) for n, s in stores.items()}
    db = {n: load_config(c, env={}).db_path for n, c in configs.items()}

    res = _run_line(configs["base"], tiny_recording, "--report", str(tmp_path / "r-base"))
    assert res.exit_code == 0, res.output
    assert "accuracy" in res.output and (tmp_path / "r-base" / "report.md").is_file()
    gate = "regressions<=0,missing<=0"
    ok = _run_line(configs["same"], tiny_recording, "--report", str(tmp_path / "r-same"),
                   "--baseline", str(db["base"]), "--gate", gate)
    assert ok.exit_code == 0, ok.output
    assert "broken 0" in ok.output
    bad = _run_line(configs["worse"], tiny_recording, "--report", str(tmp_path / "r-worse"),
                    "--baseline", str(db["base"]), "--gate", gate)
    assert bad.exit_code == 3, bad.output
    report = json.loads((tmp_path / "r-worse" / "report.json").read_text())
    assert report["broken"]["count"] > 0
    assert set(report["expert_versions"]["cls-r0402"]) == {"2"}          # the rows name the version that ran
    assert set(report["expert_versions"]["det-2term"]) == {"1"}
    con = sqlite3.connect(db["worse"])
    try:
        chains = [json.loads(v) for (v,) in con.execute("SELECT versions FROM verdicts")]
    finally:
        con.close()
    assert chains and all(c and all(isinstance(x, int) for x in c.values()) for c in chains)
    assert any(g.startswith("regressions<=0") for g in report["gate_failed"])


def test_the_demo_summary_says_whether_it_was_right(tmp_path, tiny_recording):
    from edge_agent.demo import correctness, format_summary

    rec = Recording(tiny_recording)
    truth = {f.header["frame_id"]: true_verdict(MODEL, f.header.get("component") or f.truth_component, f.truth)
             for f in rec}
    perfect = correctness(MODEL, rec, _db(tmp_path / "right.db", truth))
    assert perfect["accuracy"] == 1.0 and perfect["judged"] == len(rec) and perfect["wrong_frames"] == []
    assert perfect["recall"] and set(perfect["recall"]) <= {"missing", "misaligned", "wrong_part"}
    assert all(v == 1.0 for v in perfect["recall"].values())
    lazy = correctness(MODEL, rec, _db(tmp_path / "pass.db", {f: "pass" for f in truth}))
    assert all(v == 0.0 for v in lazy["recall"].values()) and len(lazy["wrong_frames"]) == 5
    assert lazy["accuracy"] == pytest.approx(sum(v == "pass" for v in truth.values()) / len(truth), abs=1e-4)
    base = {"line": "T", "recording": "r", "sent": 1, "accepted": 1, "duplicate": 0, "rejected": 0, "resent": 0,
            "frames": 1, "verdicts": 1, "by_verdict": {}, "published": 1, "throughput_fps": 1, "seconds": 1,
            "p50_ms": 1, "p99_ms": 1, "inferences": 1, "batches": 1, "mean_batch": 1, "expert_loads": 0,
            "evictions": 0, "executors": [], "zoo_bytes": 0, "errors": 0, "database": "d"}
    text = format_summary({**base, **lazy})
    assert "verdict accuracy" in text and "recall per defect label" in text and lazy["wrong_frames"][0] in text


def test_a_second_replay_into_the_same_database_refuses_to_judge_old_verdicts(tmp_path, tiny_zoo, tiny_recording):
    shutil.copytree(tiny_zoo, tmp_path / "store")
    config = write_line(tmp_path / "line", store=tmp_path / "store")
    assert _run_line(config, tiny_recording, "--report", str(tmp_path / "r1")).exit_code == 0
    again = _run_line(config, tiny_recording, "--report", str(tmp_path / "r2"))
    assert again.exit_code != 0 and "already in the results database" in again.output
    assert not (tmp_path / "r2" / "report.md").exists()


def test_gates_on_what_was_not_measured_fail(tmp_path, tiny_recording):
    rec = Recording(tiny_recording)
    j = judge(MODEL, rec, _db(tmp_path / "v.db", {f.header["frame_id"]: "pass" for f in rec}))
    failed = failed_conditions(j, parse_gate("regressions<=0,accuracy>=0"))
    assert failed == ["regressions<=0 (not measured: no --baseline)"]


def _truths(rec: Recording) -> dict[str, str]:
    return {f.header["frame_id"]: true_verdict(MODEL, f.header.get("component") or f.truth_component, f.truth)
            for f in rec}


def test_a_baseline_that_does_not_cover_the_run_fails_every_gate_on_the_baseline(tmp_path, tiny_recording):
    """A baseline of another recording (or one that lost frames) compared nothing: it must not pass regressions<=0."""
    rec = Recording(tiny_recording)
    truth = _truths(rec)
    n = len(truth)
    now = _db(tmp_path / "now.db", truth)
    other = judge(MODEL, rec, now, baseline_db=_db(tmp_path / "other.db", {f"other-{f}": v for f, v in truth.items()}))
    assert failed_conditions(other, parse_gate("regressions<=0,fixed>=0,changed<=0")) == [
        f"{m} (not measured: baseline covers 0 of {n} frames)" for m in ("regressions<=0", "fixed>=0", "changed<=0")]
    assert other.compared == 0 and other.metrics()["compared"] == 0
    assert failed_conditions(other, parse_gate("compared>=0")) == []
    md = write_report(other, tmp_path / "r-other", parse_gate("regressions<=0"))
    assert f"compared 0 of {n} frames" in md.read_text() and "does not cover this run" in md.read_text()
    doc = json.loads((tmp_path / "r-other" / "report.json").read_text())
    assert (doc["compared"], doc["with_verdict"], doc["baseline_coverage"]) == (0, n, f"compared 0 of {n} frames")
    assert doc["gate_failed"] == [f"regressions<=0 (not measured: baseline covers 0 of {n} frames)"]

    first = next(iter(truth))
    partial = judge(MODEL, rec, now, baseline_db=_db(tmp_path / "part.db", {f: v for f, v in truth.items()
                                                                             if f != first}))
    assert partial.compared == n - 1
    assert failed_conditions(partial, parse_gate("regressions<=0,compared>=" + str(n))) == [
        f"regressions<=0 (not measured: baseline covers {n - 1} of {n} frames)", f"compared>={n} (got {n - 1})"]

    full = judge(MODEL, rec, now, baseline_db=_db(tmp_path / "full.db", truth))
    assert full.compared == n and failed_conditions(full, parse_gate(f"regressions<=0,compared>={n}")) == []
    assert f"compared {n} of {n} frames" in write_report(full, tmp_path / "r-full").read_text()


def test_the_report_draws_latency_with_its_percentiles(tmp_path, tiny_recording):
    from PIL import Image

    rec = Recording(tiny_recording)
    j = judge(MODEL, rec, _db(tmp_path / "v.db", _truths(rec)))
    md = write_report(j, tmp_path / "r")
    png = tmp_path / "r" / "latency.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    with Image.open(png) as im:
        im.verify()
        assert im.format == "PNG" and im.size[0] > 100
    assert "](latency.png)" in md.read_text() and "](confusion.png)" in md.read_text()
    assert len(j.latencies_ms) == len(rec)
    assert "latencies_ms" not in json.loads((tmp_path / "r" / "report.json").read_text())   # in the figure only


def test_the_gate_help_names_every_metric():
    from edge_agent.cli import cli
    from edge_agent.judge import GATE_METRICS

    text = " ".join(CliRunner().invoke(cli, ["replay", "--help"]).output.split())
    gate_help = text[text.index("--gate TEXT"):text.index("--candidate DIRECTORY")]
    assert [m for m in GATE_METRICS if m not in gate_help] == []


def _with_images(db: Path, images: dict[str, str]) -> Path:
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE frames (frame_id TEXT PRIMARY KEY, payload_sha256 TEXT)")
    con.executemany("INSERT INTO frames VALUES (?, ?)", list(images.items()))
    con.commit()
    con.close()
    return db


def test_a_baseline_of_another_recording_under_the_same_frame_ids_is_refused(tmp_path, tiny_recording):
    """Synthetic recordings of other seeds share frame ids: compared frame by frame, their 'regressions' are
    about other images.  The baseline's own image hashes tell."""
    import hashlib

    from storage.synthetic import record_synthetic

    rec = Recording(tiny_recording)
    other = Recording(record_synthetic(MODEL, tmp_path / "other", 60, line="T", seed=4, size=48,
                                       boards_components=20))
    assert [f.header["frame_id"] for f in other] == [f.header["frame_id"] for f in rec]
    verdicts = {f.header["frame_id"]: "pass" for f in rec}
    now = _db(tmp_path / "now.db", verdicts)
    foreign = _with_images(_db(tmp_path / "foreign.db", verdicts),
                           {f.header["frame_id"]: hashlib.sha256(other.payload(f)).hexdigest() for f in other})
    with pytest.raises(CoEError, match=r"foreign\.db is a run of another recording: \d+ frame\(s\) under the same ids"):
        judge(MODEL, rec, now, baseline_db=foreign)
    same = _with_images(_db(tmp_path / "same.db", verdicts),
                        {f.header["frame_id"]: hashlib.sha256(rec.payload(f)).hexdigest() for f in rec})
    assert judge(MODEL, rec, now, baseline_db=same).compared == len(rec)


def test_a_verdict_turned_into_an_error_is_broken_and_nothing_is_rounded_before_the_gate(tmp_path, tiny_recording):
    rec = Recording(tiny_recording)
    ids = [f.header["frame_id"] for f in rec]
    before = _db(tmp_path / "before.db", {f: "pass" for f in ids})
    now = {f: "pass" for f in ids}
    now[ids[0]] = "error"
    con_path = _db(tmp_path / "now.db", now)
    con = sqlite3.connect(con_path)
    con.execute("UPDATE verdicts SET latency_ms = 50.004")
    con.commit()
    con.close()
    j = judge(MODEL, rec, con_path, baseline_db=before)
    assert ids[0] in j.broken                                    # was 'changed' where the frame had no truth
    assert failed_conditions(j, parse_gate("regressions<=0,p99_ms<=50")) == [
        f"regressions<=0 (got {len(j.broken)})", "p99_ms<=50 (got 50.004)"]     # 50.004 was shown, and gated, as 50.0


def test_accuracy_is_not_measured_when_no_frame_has_a_truth(tmp_path, tiny_recording):
    from storage.recording import Recording as R

    rec = R(tiny_recording)
    j = judge(parse_spec({**TINY_SPEC, "components": [{**c, "name": c["name"] + "-x"}
                                                      for c in TINY_SPEC["components"]]}),
              rec, _db(tmp_path / "now.db", {f.header["frame_id"]: "pass" for f in rec}))
    assert j.judged == 0
    md = write_report(j, tmp_path / "report")
    assert json.loads((tmp_path / "report" / "report.json").read_text())["accuracy"] is None
    assert "accuracy: not measured" in md.read_text()


def test_candidate_checks_fail_before_anything_runs_and_a_failed_start_leaves_the_report_dir_reusable(
        tmp_path, tiny_zoo, tiny_recording):
    from edge_agent.cli import cli
    from storage.expert_store import ExpertStore

    config = write_line(tmp_path / "line", store=tiny_zoo)
    run = lambda *extra: CliRunner().invoke(cli, ["replay", str(tiny_recording), "--config", str(config), *extra])
    # a baseline that is not a results database: refused before the candidate agent starts or a frame is sent
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite" * 50)
    res = run("--candidate", str(tiny_zoo), "--report", str(tmp_path / "r1"), "--baseline", str(junk))
    assert res.exit_code == 1 and "not a coe-edge results database" in res.output
    assert not (tmp_path / "r1" / "results.db").exists()
    # a candidate store that cannot start: a clear error, and no database left to block the next try
    broken = tmp_path / "broken"
    shutil.copytree(tiny_zoo, broken)
    path = Path(ExpertStore(broken).path("det-2term"))
    path.write_bytes(path.read_bytes()[:100])
    res = run("--candidate", str(broken), "--report", str(tmp_path / "r2"))
    assert res.exit_code == 1 and "det-2term" in res.output, res.output
    assert not (tmp_path / "r2" / "results.db").exists()
    # a line with executors on other nodes: their nodes would run the line's own store, not the candidate
    remote = write_line(tmp_path / "remote", store=tiny_zoo, cluster={"address": "127.0.0.1:1"},
                        executors=[{"device": "cpu", "count": 1, "memory": "20MB", "threads": 1, "node": "box-2"}])
    res = CliRunner().invoke(cli, ["replay", str(tiny_recording), "--config", str(remote), "--candidate",
                                   str(tiny_zoo), "--report", str(tmp_path / "r3")])
    assert res.exit_code == 2 and "executors.0 runs on node 'box-2'" in res.output


def test_frames_the_agent_rejects_are_not_waited_for_and_count_as_missing(tmp_path, tiny_zoo, tiny_recording):
    from edge_agent.cli import cli

    rec_dir = tmp_path / "rec"
    shutil.copytree(tiny_recording, rec_dir)
    lines = (rec_dir / "manifest.jsonl").read_text().splitlines()
    doc = json.loads(lines[4])
    (doc["header"] if "header" in doc else doc)["component"] = "NOPE"       # a part type the line has no expert for
    lines[4] = json.dumps(doc)
    (rec_dir / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    config = write_line(tmp_path / "line", store=tiny_zoo)
    res = CliRunner().invoke(cli, ["replay", str(rec_dir), "--config", str(config), "--candidate", str(tiny_zoo),
                                   "--report", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "1 frame(s) the agent rejected have no verdict and count as missing" in res.output
    assert "still have no verdict" not in res.output                  # nothing was waited for in vain
    assert json.loads((tmp_path / "r" / "report.json").read_text())["missing"] == 1
