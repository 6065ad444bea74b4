"""An agent stopped before its frames drain: it says what is left, and the next start gives each frame exactly
one verdict.

Real agent, real ZeroMQ on loopback, real SQLite.  Expert runs hang (a stuck driver, injected by
`Faults.block`) once the first frames are in, so the later frames are accepted and journaled but cannot finish
while the drain waits, whatever the box's speed.
"""
from __future__ import annotations

import logging
import shutil
import threading

import pytest

from edge_agent.agent import Agent
from edge_agent.config import load_config
from edge_agent.replay import send_messages
from executors.faults import Faults, faulty_backends
from storage.recording import Recording

from conftest import db_rows, frame_messages, until, write_line


def _half_served(tmp_path, tiny_zoo, tiny_recording):
    """An agent that has served 20 frames, then accepted 40 more while every run hangs; and the hang's switch."""
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg_path = write_line(tmp_path / "line", store=store)
    rec = Recording(tiny_recording)
    frames = list(rec)
    release = threading.Event()
    release.set()
    agent = Agent(load_config(cfg_path, env={}), backend_for=faulty_backends(Faults(block=release))).start()
    try:
        assert send_messages(frame_messages(rec, frames[:20]), agent.endpoints["ingest"]).accepted == 20
        assert agent.wait_verdicts(20, timeout=120)
        release.clear()                                    # from now on every run hangs: none can drain
        assert send_messages(frame_messages(rec, frames[20:]), agent.endpoints["ingest"]).accepted == len(frames) - 20
    except BaseException:
        release.set()
        agent.stop()
        raise
    return agent, release, cfg_path, sorted(fr.header["frame_id"] for fr in frames)


def test_a_stop_whose_drain_times_out_loses_nothing_and_the_next_start_finishes_every_frame_once(
        tmp_path, tiny_zoo, tiny_recording, caplog):
    agent, release, cfg_path, ids = _half_served(tmp_path, tiny_zoo, tiny_recording)
    db = agent.cfg.db_path
    with caplog.at_level(logging.ERROR, logger="edge_agent.agent"):
        drained = agent.stop(timeout=0.2)
    assert agent._instance.held                            # its executors still hang: the data stays its own
    release.set()                                          # the hung threads of the stopped agent end
    assert drained is False
    said = [r.getMessage() for r in caplog.records if "still in flight" in r.getMessage()]
    assert said == [f"stopped with {len(ids) - 20} frame(s) still in flight; they are journaled and re-run at "
                    "next start"]
    assert len(db_rows(db, "SELECT frame_id FROM verdicts")) == 20
    assert len(db_rows(db, "SELECT frame_id FROM journal")) == len(ids) - 20
    # its hung executors held the results database until they ended (another agent would re-run their frames)
    until(lambda: not agent._instance.held, 30, "the stopped agent's hung threads to end and let the data go")

    again = Agent(load_config(cfg_path, env={})).start()
    try:
        assert again.wait_verdicts(len(ids) - 20, timeout=120)
        assert again.wait_idle(timeout=60)
    finally:
        assert again.stop() is True
    assert sorted(r[0] for r in db_rows(db, "SELECT frame_id FROM verdicts")) == ids   # each exactly once
    assert db_rows(db, "SELECT count(*) FROM journal") == [(0,)]


def test_a_drain_that_times_out_but_finishes_while_the_agent_closes_counts_as_drained(
        tmp_path, tiny_zoo, tiny_recording, caplog, monkeypatch):
    """The executors run their queues out after the drain's wait: frames that commit then are not 'left'."""
    agent, release, _, ids = _half_served(tmp_path, tiny_zoo, tiny_recording)
    wait_idle = agent.wait_idle

    def wait_then_release(timeout=None):
        done = wait_idle(timeout)                          # times out: every run still hangs
        release.set()                                      # ... and the runs go on while the agent closes
        return done

    monkeypatch.setattr(agent, "wait_idle", wait_then_release)
    with caplog.at_level(logging.INFO, logger="edge_agent.agent"):
        drained = agent.stop(timeout=0.2)
    assert drained is True
    assert not [r for r in caplog.records if "still in flight" in r.getMessage()]
    assert [r for r in caplog.records if "every frame committed while the agent closed" in r.getMessage()]
    assert sorted(r[0] for r in db_rows(agent.cfg.db_path, "SELECT frame_id FROM verdicts")) == ids
    assert db_rows(agent.cfg.db_path, "SELECT count(*) FROM journal") == [(0,)]


def test_a_second_agent_on_the_same_results_database_is_refused_naming_the_first(tmp_path, tiny_zoo):
    """Another config (other ports) on the same data dir: the second start fails before it binds or reads the
    journal, names the first agent's pid, and leaves the first serving; once the first stops, it starts."""
    import os

    import pytest

    from coe import CoEError

    shutil.copytree(tiny_zoo, tmp_path / "experts")
    first_cfg = write_line(tmp_path / "a", store=tmp_path / "experts", fixed_ports=True)
    data = tmp_path / "a" / "data"
    second_cfg = write_line(tmp_path / "b", store=tmp_path / "experts", fixed_ports=True, data_dir=str(data))
    first = Agent(load_config(first_cfg, env={})).start()
    try:
        second = Agent(load_config(second_cfg, env={}))
        with pytest.raises(CoEError, match=f"another agent \\(pid {os.getpid()}\\) serves the results database "
                                           f"{data / 'results.db'}"):
            second.start()
        assert first.health().ready
        assert second.stop() is True            # a start refused before anything ran: stop closes what it built
        assert second.ctx.closed and second.phase == "stopped"
    finally:
        assert first.stop() is True
    again = Agent(load_config(second_cfg, env={})).start()
    assert again.stop() is True


@pytest.mark.parametrize("part,error", [("writer", OSError("disk gone (test)")),
                                         ("ingest", RuntimeError("ingest socket wedged (test)"))])
def test_a_part_that_fails_to_stop_is_reported_after_every_other_part_closed(tmp_path, tiny_zoo, part, error):
    """`stop` tries every part whatever one before it raised, the first steps (ingest, the store watcher, the LLM
    server) included: the failure reaches the caller, and the ports, the pools and the results database are free
    for the next agent (before, the writer's first error left the journal, the status page, the sockets and the
    instance lock open; one of the first steps' left everything open)."""
    shutil.copytree(tiny_zoo, tmp_path / "experts")
    cfg_path = write_line(tmp_path / "a", store=tmp_path / "experts", fixed_ports=True)
    agent = Agent(load_config(cfg_path, env={})).start()
    real = getattr(agent, part).stop

    def failing_stop(*a, **kw):
        real(*a, **kw)
        raise error
    getattr(agent, part).stop = failing_stop
    with pytest.raises(type(error), match=str(error).replace("(", r"\(").replace(")", r"\)")):
        agent.stop()
    assert agent.phase == "stopped" and agent.ctx.closed and not agent.writer.alive()
    assert not agent.store_watch.alive()
    assert all(p.resident() == [] for p in agent._all_pools().values())    # closed: every expert let go
    again = Agent(load_config(cfg_path, env={})).start()     # the same ports and results database
    try:
        assert again.health().ready
    finally:
        assert again.stop() is True
