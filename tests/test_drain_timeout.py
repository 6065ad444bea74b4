"""An agent stopped before its frames drain: it says so, and the next start gives each frame exactly one verdict.

Real agent, real ZeroMQ on loopback, real SQLite.  Every expert run hangs (a stuck driver, injected) once the
first frames are in, so the later frames are accepted and journaled but none can finish: the drain is bound to
time out, whatever the box's speed.
"""
from __future__ import annotations

import logging
import shutil
import threading
import sqlite3

from edge_agent.agent import Agent
from edge_agent.config import load_config
from edge_agent.replay import send_messages
from executors.faults import Faults, faulty_backends
from storage.recording import Recording

from conftest import write_line


def _messages(rec: Recording, frames):
    from edge_agent import protocol as P
    return [(fr.header["frame_id"], [P.encode_header(fr.header), rec.payload(fr)]) for fr in frames]


def _rows(db, sql):
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_a_stop_whose_drain_times_out_loses_nothing_and_the_next_start_finishes_every_frame_once(
        tmp_path, tiny_zoo, tiny_recording, caplog):
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg = load_config(write_line(tmp_path / "line", store=store), env={})
    rec = Recording(tiny_recording)
    frames = list(rec)
    first, held = frames[:20], frames[20:]
    release = threading.Event()
    release.set()
    agent = Agent(cfg, backend_for=faulty_backends(Faults(block=release))).start()
    try:
        assert send_messages(_messages(rec, first), agent.endpoints["ingest"]).accepted == len(first)
        assert agent.wait_verdicts(len(first), timeout=120)
        release.clear()                                    # from now on every run hangs: none can drain
        assert send_messages(_messages(rec, held), agent.endpoints["ingest"]).accepted == len(held)
    finally:
        with caplog.at_level(logging.ERROR, logger="edge_agent.agent"):
            drained = agent.stop(timeout=0.2)
    release.set()                                          # the hung threads of the stopped agent end
    assert drained is False
    said = [r.getMessage() for r in caplog.records if "still in flight" in r.getMessage()]
    assert said == [f"stopped with {len(held)} frame(s) still in flight; they are journaled and re-run at next start"]
    assert len(_rows(cfg.db_path, "SELECT frame_id FROM verdicts")) == len(first)
    assert len(_rows(cfg.db_path, "SELECT frame_id FROM journal")) == len(held)

    again = Agent(load_config(write_line(tmp_path / "line", store=store), env={})).start()
    try:
        assert again.wait_verdicts(len(held), timeout=120)
        assert again.wait_idle(timeout=60)
    finally:
        assert again.stop() is True
    ids = sorted(fr.header["frame_id"] for fr in frames)
    assert sorted(r[0] for r in _rows(cfg.db_path, "SELECT frame_id FROM verdicts")) == ids   # each exactly once
    assert _rows(cfg.db_path, "SELECT count(*) FROM journal") == [(0,)]
