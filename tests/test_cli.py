"""The CLI over real files: help with examples everywhere, clear one-line errors, results queries."""
from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from edge_agent.cli import cli

from conftest import TINY_SPEC


def all_commands(group: click.Group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from all_commands(cmd, prefix + (name,))


def test_every_command_has_help_with_an_example():
    runner = CliRunner()
    for path, cmd in all_commands(cli):
        res = runner.invoke(cli, [*path, "--help"])
        assert res.exit_code == 0, path
        if not isinstance(cmd, click.Group):
            assert "Example:" in res.output and "coe-agent " + path[0] in res.output, path


def test_bad_config_is_one_clear_line(tmp_path):
    p = tmp_path / "line-T.yaml"
    p.write_text("line: T\nspec: none.yaml\nexecutors: [{memory: lots}]\n")
    res = CliRunner().invoke(cli, ["run", "--config", str(p)])
    assert res.exit_code == 1
    assert "key 'executors.0.memory'" in res.output and "Traceback" not in res.output


def test_missing_zoo_tells_what_to_run(tiny_line, tmp_path):
    import yaml
    cfg = yaml.safe_load(tiny_line.read_text())
    cfg["expert_store"] = str(tmp_path / "empty-store")
    tiny_line.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(cli, ["run", "--config", str(tiny_line)])
    assert res.exit_code == 1 and "coe-agent zoo build" in res.output


def test_record_then_results_roundtrip(tiny_line, tmp_path, tiny_recording):
    runner = CliRunner()
    out = tmp_path / "rec"
    res = runner.invoke(cli, ["record", "--synthetic", "--config", str(tiny_line), "--frames", "7",
                              "--out", str(out), "--size", "32"])
    assert res.exit_code == 0, res.output
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 7
    res = runner.invoke(cli, ["record", "--synthetic", "--config", str(tiny_line), "--frames", "7", "--out", str(out)])
    assert res.exit_code == 1 and "Error" in res.output   # refuses to overwrite silently

    from edge_agent.agent import Agent
    from edge_agent.config import load_config
    from edge_agent.replay import replay
    from storage.recording import Recording

    agent = Agent(load_config(tiny_line, env={})).start()
    try:
        assert replay(Recording(out), agent.endpoints["ingest"]).accepted == 7
        assert agent.wait_verdicts(7, timeout=60)
    finally:
        agent.stop()
    res = runner.invoke(cli, ["results", "--config", str(tiny_line), "--json", "--limit", "100"])
    rows = [json.loads(x) for x in res.output.splitlines()]
    assert len(rows) == 7 and {r["verdict"] for r in rows} <= {"pass", "defect"}
    board = rows[0]["board_id"]
    res = runner.invoke(cli, ["results", "--config", str(tiny_line), "--board", board])
    assert res.exit_code == 0 and board in res.output and "frame_id" in res.output.splitlines()[0]
    res = runner.invoke(cli, ["results", "--config", str(tiny_line), "--verdict", "bogus"])
    assert res.exit_code == 2


def test_replay_to_nobody_fails_clearly(tiny_recording):
    from conftest import free_port
    res = CliRunner().invoke(cli, ["replay", str(tiny_recording), "--endpoint", f"tcp://127.0.0.1:{free_port()}",
                                   "--ack-timeout", "0.2", "--window", "4", "--deadline", "1.5"])
    # with no agent nothing is acked; the client must say so rather than hang or claim success
    assert res.exit_code == 1 and "never acked" in res.output and "is the agent running" in res.output


def test_line_and_config_given_before_the_command_are_the_commands(tiny_line, tmp_path):
    """`coe-agent --line B experts ls` ran on line A (the top-level option was dropped): a promotion given that
    way went into line A's live store.  Given on both sides and different, it is a usage error."""
    runner = CliRunner()
    before = runner.invoke(cli, ["--config", str(tiny_line), "experts", "ls"])
    after = runner.invoke(cli, ["experts", "ls", "--config", str(tiny_line)])
    assert before.exit_code == 0 and after.exit_code == 0, before.output + after.output
    assert before.output == after.output and "cls-r0402" in before.output
    missing = runner.invoke(cli, ["--line", "NOSUCHLINE", "experts", "ls"])
    assert missing.exit_code != 0 and "NOSUCHLINE" in missing.output
    both = runner.invoke(cli, ["--line", "B", "experts", "ls", "--line", "C"])
    assert both.exit_code == 2 and "--line B before the command and --line C after it" in both.output


def test_replay_to_nobody_says_so_early_not_only_at_the_deadline(tiny_recording, caplog):
    """With the default 600 s deadline, the bar sat at 0 for ten minutes before 'never acked'."""
    from conftest import free_port
    from edge_agent.replay import send_messages

    with caplog.at_level("WARNING", logger="edge_agent.replay"):
        report = send_messages([("f1", [b"{}", b"x"])], f"tcp://127.0.0.1:{free_port()}", ack_timeout=0.2,
                               deadline=1.5, silent_warn_s=0.3)
    assert report.unacked == ["f1"]
    said = [r.getMessage() for r in caplog.records if "nothing has answered" in r.getMessage()]
    assert len(said) == 1 and "is the agent running" in said[0] and "deadline (2 s)" in said[0]
