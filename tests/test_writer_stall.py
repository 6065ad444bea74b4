"""A result writer whose writes keep failing: the health names it, a bad row blocks no other verdict, and a
database fault sets nothing aside.

Real SQLite files and a real PUB socket.  A bad row is one no schema takes (a column the table lacks), as a
bug upstream would send.  A full database is SQLite's own `max_page_count` limit on the writer's connection.
"""
from __future__ import annotations

import json
import sqlite3
import time

import pytest
import zmq

from edge_agent import writer as writer_mod
from edge_agent.writer import ResultWriter
from storage.results import JournalEntry, ResultStore

from conftest import db_rows, until


def _verdict(fid: str, **extra) -> dict:
    return {"frame_id": fid, "verdict": "pass", "reason": "", "decided_at": time.time(), "latency_ms": 1.0,
            "chain": "[]", **extra}


def _thumb(fid: str, nbytes: int = 64, **extra) -> dict:
    return {"frame_id": fid, "mime": "image/jpeg", "data": b"j" * nbytes, "at": time.time(), **extra}


class _Line:
    """A writer on a journaled database with a subscriber on its PUB socket; `reported` is what it committed."""

    def __init__(self, tmp_path, frames, name: str, **kw) -> None:
        self.db = tmp_path / "r.db"
        rs = ResultStore(self.db)
        rs.journal([JournalEntry(f, "A", "B0", "R0402", 1.0, 1.0, "{}", b"x") for f in frames])
        rs.close()
        self.ctx = zmq.Context()
        pub = self.ctx.socket(zmq.PUB)
        pub.bind(f"inproc://{name}")
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVTIMEO, 5000)
        self.sub.connect(f"inproc://{name}")
        self.reported: list[tuple[str, bool]] = []
        kw.setdefault("flush_ms", 200)
        self.w = ResultWriter(str(self.db), pub, "A", on_committed=lambda rows, stored:
                              self.reported.extend((r["frame_id"], r["frame_id"] in stored) for r in rows), **kw)

    def published(self, n: int) -> list[str]:
        """The n verdicts published, then nothing more."""
        got = [json.loads(self.sub.recv_multipart()[1])["frame_id"] for _ in range(n)]
        self.sub.setsockopt(zmq.RCVTIMEO, 300)
        with pytest.raises(zmq.Again):
            self.sub.recv_multipart()
        return got

    def close(self) -> None:
        self.w.stop()
        self.sub.close()
        self.ctx.term()


def test_a_row_no_schema_takes_is_set_aside_and_its_frame_gets_an_error_verdict_beside_the_others(tmp_path):
    line = _Line(tmp_path, ("f1", "bad", "f2"), "aside")
    line.w.put_verdict(_verdict("f1"))
    line.w.put_verdict(_verdict("bad", no_such_column=1))       # all three in the writer's first flush
    line.w.put_verdict(_verdict("f2"))
    line.w.start()
    until(lambda: len(line.reported) == 3, 30, "the flush to be reported")
    published = line.published(3)
    line.close()
    assert sorted(line.reported) == [("bad", True), ("f1", True), ("f2", True)]    # one verdict each, now
    assert sorted(published) == ["bad", "f1", "f2"]
    assert line.w.failures == 4 and line.w.set_aside == 1 and line.w.stalled() == 0.0   # 3 whole, 1 alone
    rows = dict(db_rows(line.db, "SELECT frame_id, verdict FROM verdicts"))
    assert rows == {"f1": "pass", "bad": "error", "f2": "pass"}
    (reason,) = db_rows(line.db, "SELECT reason FROM verdicts WHERE frame_id='bad'")[0]
    assert "could not be stored" in reason and "no_such_column" in reason
    assert db_rows(line.db, "SELECT count(*) FROM journal") == [(0,)]             # nothing left to re-run
    (kind, message), = db_rows(line.db, "SELECT kind, message FROM errors WHERE frame_id='bad'")
    assert kind == "unstorable_verdict" and "no_such_column" in message


def test_a_frames_second_verdict_is_never_published_in_place_of_its_unstorable_first(tmp_path):
    """The store keeps a frame's first row; when that row cannot be stored, the frame gets an error verdict
    naming why, and its second row (a bug upstream) is neither stored nor published."""
    line = _Line(tmp_path, ("x", "f2"), "second")
    line.w.put_verdict(_verdict("x", no_such_column=1))
    line.w.put_verdict(_verdict("x", verdict="defect"))
    line.w.put_verdict(_verdict("f2"))
    line.w.start()
    until(lambda: len(line.reported) == 2, 30, "the flush to be reported")
    published = line.published(2)
    line.close()
    assert sorted(published) == ["f2", "x"] and sorted(line.reported) == [("f2", True), ("x", True)]
    assert dict(db_rows(line.db, "SELECT frame_id, verdict FROM verdicts")) == {"x": "error", "f2": "pass"}
    assert db_rows(line.db, "SELECT count(*) FROM journal") == [(0,)]


def test_a_verdict_whose_thumbnail_no_schema_takes_is_stored_without_it(tmp_path):
    line = _Line(tmp_path, ("d1", "f2"), "thumb")
    line.w.put_verdict(_verdict("d1", verdict="defect"), _thumb("d1", no_such_column=1))
    line.w.put_verdict(_verdict("f2"))
    line.w.start()
    until(lambda: len(line.reported) == 2, 30, "the flush to be reported")
    published = line.published(2)
    line.close()
    assert sorted(published) == ["d1", "f2"] and line.w.set_aside == 0
    assert sorted(r[0] for r in db_rows(line.db, "SELECT frame_id FROM verdicts")) == ["d1", "f2"]
    assert db_rows(line.db, "SELECT count(*) FROM thumbnails") == [(0,)]
    assert db_rows(line.db, "SELECT count(*) FROM journal") == [(0,)]


def test_a_full_database_sets_nothing_aside_and_every_row_goes_in_once_there_is_room(tmp_path, monkeypatch):
    """A database fault fails every row alike; setting rows aside for it would drop live verdicts.  The batch
    waits whole, the stall grows from its first failure, and it all commits once the database has room."""
    made: list[ResultStore] = []

    class Capped(ResultStore):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            pages = self.db.execute("PRAGMA page_count").fetchone()[0]
            self.db.execute(f"PRAGMA max_page_count = {pages}")   # not one page more: SQLITE_FULL
            made.append(self)

    monkeypatch.setattr(writer_mod, "ResultStore", Capped)
    line = _Line(tmp_path, ("d1", "f2", "f3"), "full", flush_ms=5)
    line.w.put_verdict(_verdict("d1", verdict="defect"), _thumb("d1", 200_000))
    line.w.put_verdict(_verdict("f2"))
    line.w.put_verdict(_verdict("f3"))
    line.w.start()
    until(lambda: line.w.failing_since is not None, 30, "a failed write")
    since = line.w.failing_since
    until(lambda: line.w.failures >= 4, 30, "four failed attempts")    # past the third, where rows may split
    assert "full" in line.w.last_failure and line.w.failing_since == since and line.w.stalled() > 0
    assert line.w.set_aside == 0 and line.reported == []
    made[0].db.execute("PRAGMA max_page_count = 1073741823")           # room again
    until(lambda: len(line.reported) == 3, 30, "the batch to commit")
    published = line.published(3)
    line.close()
    assert sorted(published) == ["d1", "f2", "f3"] and all(ok for _, ok in line.reported)
    assert line.w.stalled() == 0.0 and line.w.set_aside == 0
    assert db_rows(line.db, "SELECT count(*) FROM verdicts") == [(3,)]
    assert db_rows(line.db, "SELECT frame_id FROM thumbnails") == [("d1",)]
    assert db_rows(line.db, "SELECT count(*) FROM journal") == [(0,)]


def test_a_lone_row_no_schema_takes_is_set_aside_too(tmp_path):
    """Alone in its flush, a row the schema refuses (not a database fault) is still set aside after its
    attempts: it must not block the rows queued behind it on a quiet line."""
    line = _Line(tmp_path, ("bad", "f2"), "lone", flush_ms=5)
    line.w.put_verdict(_verdict("bad", no_such_column=1))
    line.w.start()
    until(lambda: len(line.reported) == 1, 30, "the bad row to be settled")
    line.w.put_verdict(_verdict("f2"))                      # queued behind it: goes in
    until(lambda: len(line.reported) == 2, 30, "the next verdict")
    published = line.published(2)
    line.close()
    assert published == ["bad", "f2"] and line.w.set_aside == 1 and line.w.gave_up == 0
    assert dict(db_rows(line.db, "SELECT frame_id, verdict FROM verdicts")) == {"bad": "error", "f2": "pass"}


def test_the_agent_is_not_ready_while_its_result_writes_keep_failing(tiny_line, monkeypatch):
    """A database with no room left (SQLite's own page limit on the writer's connection): writes fail and are
    retried, the health names the database and the error, and once there is room the agent is ready again."""
    from edge_agent import agent as agent_mod
    from edge_agent.agent import Agent
    from edge_agent.config import load_config

    made: list[ResultStore] = []

    class Capped(ResultStore):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            pages = self.db.execute("PRAGMA page_count").fetchone()[0]
            self.db.execute(f"PRAGMA max_page_count = {pages}")
            made.append(self)

    monkeypatch.setattr(writer_mod, "ResultStore", Capped)
    monkeypatch.setattr(agent_mod, "WRITER_STALL_S", 0.0)
    agent = Agent(load_config(tiny_line, env={})).start()
    try:
        until(lambda: made, 30, "the writer to open its database")
        agent.writer.put_verdict(_verdict("big", verdict="defect"), _thumb("big", 200_000))
        until(lambda: agent.writer.failing_since is not None, 30, "a failed write")
        h = agent.health()
        assert not h.ready
        (reason,) = [r for r in h.reasons if "result database" in r]
        assert str(agent.cfg.db_path) in reason and "full" in reason
        made[0].db.execute("PRAGMA max_page_count = 1073741823")
        until(lambda: agent.writer.failing_since is None, 30, "the write to go in")
        assert agent.health().ready and agent.writer.set_aside == 0
    finally:
        agent.stop()


def test_sqlites_own_faults_are_the_databases_and_a_rows_faults_are_the_rows():
    from storage.results import is_database_fault as fault
    assert fault(sqlite3.OperationalError("database is locked"))
    assert fault(sqlite3.OperationalError("database or disk is full"))
    assert fault(sqlite3.OperationalError("attempt to write a readonly database"))
    assert fault(sqlite3.DatabaseError("database disk image is malformed"))
    assert fault(OSError(28, "No space left on device"))
    assert not fault(sqlite3.OperationalError("table verdicts has no column named no_such_column"))
    assert not fault(sqlite3.IntegrityError("NOT NULL constraint failed: verdicts.verdict"))
    assert not fault(KeyError("frame_id"))


def test_a_database_fault_while_rows_are_written_apart_is_waited_out_on_that_row(tmp_path, monkeypatch):
    """A batch split for a bad row, and the database full by the time the third row goes in: the rows already in
    stay in once (published, reported as stored), the full row waits for room, and nothing is written twice."""
    made: list[ResultStore] = []

    class Capped(ResultStore):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            pages = self.db.execute("PRAGMA page_count").fetchone()[0]
            self.db.execute(f"PRAGMA max_page_count = {pages + 8}")      # room for small rows, not a thumbnail
            made.append(self)

    monkeypatch.setattr(writer_mod, "ResultStore", Capped)
    line = _Line(tmp_path, ("g1", "bad", "big"), "apart-full")
    line.w.put_verdict(_verdict("g1"))
    line.w.put_verdict(_verdict("bad", no_such_column=1))
    line.w.put_verdict(_verdict("big", verdict="defect"), _thumb("big", 200_000))
    line.w.start()
    until(lambda: "full" in line.w.last_failure, 30, "the database to be full while rows go in apart")
    made[0].db.execute("PRAGMA max_page_count = 1073741823")
    until(lambda: len(line.reported) == 3, 30, "the flush to be settled")
    published = line.published(3)
    line.close()
    assert sorted(published) == ["bad", "big", "g1"] and all(ok for _, ok in line.reported)
    assert dict(db_rows(line.db, "SELECT frame_id, verdict FROM verdicts")) == {"g1": "pass", "bad": "error",
                                                                                 "big": "defect"}
    assert db_rows(line.db, "SELECT frame_id FROM thumbnails") == [("big",)]
    assert db_rows(line.db, "SELECT count(*) FROM errors") == [(1,)]             # the unstorable_verdict note, once


def test_the_agent_is_not_ready_while_ingest_cannot_journal_a_frame(tiny_line, tiny_recording, monkeypatch):
    """Another process holds the results database locked: no frame can be journaled, so none is acked (the
    clients resend) and the result writer, with nothing to write, never fails.  The health must say so."""
    import threading

    from edge_agent import agent as agent_mod
    from edge_agent.agent import Agent
    from edge_agent.config import load_config
    from edge_agent.replay import send_messages
    from storage.recording import Recording

    from conftest import frame_messages

    monkeypatch.setattr(agent_mod, "WRITER_STALL_S", 0.5)   # a normal journal write takes milliseconds
    agent = Agent(load_config(tiny_line, env={})).start()
    locker = sqlite3.connect(agent.cfg.db_path, timeout=30, isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")
        rec = Recording(tiny_recording)
        done = {}
        sender = threading.Thread(target=lambda: done.setdefault("r", send_messages(
            frame_messages(rec, list(rec)[:10]), agent.endpoints["ingest"], window=10, ack_timeout=1.0,
            deadline=120)), daemon=True)
        sender.start()
        until(lambda: agent.ingest.stalled() > 1.0, 30, "a journal write to wait for the lock")
        h = agent.health()
        assert not h.ready
        (reason,) = [r for r in h.reasons if "journal writes failing" in r]
        assert str(agent.cfg.db_path) in reason and "locked" in reason and "no frame is accepted" in reason
        locker.execute("ROLLBACK")
        sender.join(120)
        assert done["r"].accepted == 10
        until(lambda: agent.health().ready, 30, "the agent to be ready once the journal takes frames again")
    finally:
        locker.close()
        agent.stop()
