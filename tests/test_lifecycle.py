"""The agent as a process: SIGTERM drains every accepted frame, flushes SQLite and exits 0."""
from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import yaml

from edge_agent.replay import replay
from storage.recording import Recording

from conftest import write_line

REPO = Path(__file__).resolve().parent.parent


def test_sigterm_drains_and_exits_cleanly(tmp_path, tiny_zoo, tiny_recording):
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg_path = write_line(tmp_path / "line", store=store, fixed_ports=True)
    cfg = yaml.safe_load(cfg_path.read_text())
    endpoint = cfg["ingest"].split(":", 1)[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "-v", "run", "--config", str(cfg_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rec = Recording(tiny_recording)
        report = replay(rec, endpoint, ack_timeout=20, deadline=120)
        assert report.accepted == len(rec), proc.poll()
        proc.send_signal(signal.SIGTERM)   # right after the last ack: most frames are still in flight
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "draining" in out
    con = sqlite3.connect(Path(cfg["data_dir"]) / "results.db")
    n_verdicts = con.execute("SELECT count(*) FROM verdicts").fetchone()[0]
    pending = con.execute("SELECT count(*) FROM journal").fetchone()[0]
    status = dict(con.execute("SELECT status, count(*) FROM frames GROUP BY status").fetchall())
    con.close()
    assert n_verdicts == len(rec) and pending == 0 and status == {"done": len(rec)}
    # the WAL was checkpointed on close, or at least the database opens read-only with everything in it
    ro = sqlite3.connect(f"file:{Path(cfg['data_dir']) / 'results.db'}?mode=ro", uri=True)
    assert ro.execute("SELECT count(*) FROM verdicts").fetchone()[0] == len(rec)
    ro.close()


def test_restart_reruns_accepted_frames_without_verdict(tmp_path, tiny_zoo, tiny_recording):
    """A frame journaled by a run that died before its verdict is re-run at the next start."""
    from edge_agent.agent import Agent
    from edge_agent.config import load_config
    from edge_agent.protocol import encode_header
    from storage.results import JournalEntry, ResultStore

    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    cfg = load_config(write_line(tmp_path / "line", store=store), env={})
    rec = Recording(tiny_recording)
    frames = list(rec)[:7]
    rs = ResultStore(cfg.db_path)
    accepted = time.time() - 3600.0          # accepted an hour ago by a run that died
    rs.journal([JournalEntry(f.header["frame_id"], "T", f.header["board_id"], f.header["component"],
                             f.header["ts"], accepted, encode_header(f.header).decode(), rec.payload(f))
                for f in frames])
    rs.close()
    agent = Agent(cfg).start()
    try:
        assert agent.wait_verdicts(7, timeout=60)
    finally:
        agent.stop()
    con = sqlite3.connect(cfg.db_path)
    assert con.execute("SELECT count(*) FROM verdicts").fetchone()[0] == 7
    assert con.execute("SELECT count(*) FROM journal").fetchone()[0] == 0
    # a recovered frame's latency counts from its first accept, the hour the line was down included
    assert con.execute("SELECT min(latency_ms) FROM verdicts").fetchone()[0] >= 3600e3
    con.close()
