"""A result writer whose writes keep failing: the health names it, and one bad row blocks no other verdict.

Real SQLite files and a real PUB socket.  The bad row is one no schema takes (a column the table lacks), as a
bug upstream would send; the verdicts queued beside it must still be stored, published and reported.
"""
from __future__ import annotations

import json
import sqlite3
import time

import zmq

from edge_agent.writer import ResultWriter
from storage.results import JournalEntry, ResultStore


def _verdict(fid: str, **extra) -> dict:
    return {"frame_id": fid, "verdict": "pass", "reason": "", "decided_at": time.time(), "latency_ms": 1.0,
            "chain": "[]", **extra}


def _until(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_row_no_schema_takes_is_set_aside_and_the_verdicts_beside_it_are_stored_and_published(tmp_path):
    db = tmp_path / "r.db"
    rs = ResultStore(db)
    rs.journal([JournalEntry(f, "A", "B0", "R0402", 1.0, 1.0, "{}", b"x") for f in ("f1", "bad", "f2")])
    rs.close()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("inproc://stall")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://stall")
    reported: list[tuple[str, bool]] = []
    w = ResultWriter(str(db), pub, "A", flush_ms=200,
                     on_committed=lambda rows, stored: reported.extend((r["frame_id"], r["frame_id"] in stored)
                                                                       for r in rows))
    w.put_verdict(_verdict("f1"))
    w.put_verdict(_verdict("bad", no_such_column=1))       # all three in the writer's first flush
    w.put_verdict(_verdict("f2"))
    w.start()
    _until(lambda: len(reported) == 3, 30, "the flush to be reported")
    published = [json.loads(sub.recv_multipart()[1])["frame_id"] for _ in range(2)]
    w.stop()
    sub.close()
    ctx.term()
    assert sorted(reported) == [("bad", False), ("f1", True), ("f2", True)]   # all three leave the in-flight set
    assert sorted(published) == ["f1", "f2"]
    assert w.failures == 3 and w.set_aside == 1 and w.stalled() == 0.0
    con = sqlite3.connect(db)
    assert sorted(r[0] for r in con.execute("SELECT frame_id FROM verdicts")) == ["f1", "f2"]
    assert [r[0] for r in con.execute("SELECT frame_id FROM journal")] == ["bad"]       # re-run at next start
    (kind, message), = con.execute("SELECT kind, message FROM errors WHERE frame_id='bad'")
    assert kind == "unstorable_verdict" and "no_such_column" in message
    con.close()


def test_a_lone_row_that_keeps_failing_is_retried_and_the_stall_is_measured(tmp_path):
    """One row alone cannot say whether it or the database is at fault, so it is not set aside: it is retried,
    and `stalled` grows, which the agent's health turns into a reason."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    w = ResultWriter(str(tmp_path / "r.db"), pub, "A", flush_ms=5)
    w.put_verdict(_verdict("bad", no_such_column=1))
    w.start()
    _until(lambda: w.failures >= 4, 30, "four failed attempts")
    assert w.set_aside == 0 and w.stalled() > 0 and "no_such_column" in w.last_failure
    assert w.stalled(now=time.monotonic() + 60) >= 60
    w.stop()
    ctx.term()
    assert w.gave_up == 1    # given up only while stopping: its frame stays journaled for the next start


def test_the_agent_is_not_ready_while_its_result_writes_keep_failing(tiny_line, monkeypatch):
    from edge_agent import agent as agent_mod
    from edge_agent.agent import Agent
    from edge_agent.config import load_config

    monkeypatch.setattr(agent_mod, "WRITER_STALL_S", 0.0)
    agent = Agent(load_config(tiny_line, env={})).start()
    try:
        assert agent.health().ready
        agent.writer.put_verdict(_verdict("bad", no_such_column=1))
        _until(lambda: agent.writer.failures >= 1, 30, "a failed write")
        h = agent.health()
        assert not h.ready
        (reason,) = [r for r in h.reasons if "result database" in r]
        assert str(agent.cfg.db_path) in reason and "no_such_column" in reason
    finally:
        agent.stop()
