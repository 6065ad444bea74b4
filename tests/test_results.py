"""The SQLite result store: schema, journaling with duplicate detection, idempotent verdicts, WAL."""
import json
import os
import stat

import pytest

from storage.results import JournalEntry, ResultStore


def entry(fid, board="B1"):
    return JournalEntry(fid, "A", board, "R0402", 1.0, 2.0, json.dumps({"frame_id": fid}), b"\x89PNG")


def test_schema_wal_and_owner_only(tmp_path):
    rs = ResultStore(tmp_path / "r.db")
    assert set(rs.db.table_names()) >= {"frames", "inferences", "verdicts", "errors", "expert_events", "journal"}
    assert rs.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert stat.S_IMODE(os.stat(tmp_path / "r.db").st_mode) == 0o600
    rs.close()


def test_journal_reports_duplicates_within_and_across_batches(tmp_path):
    rs = ResultStore(tmp_path / "r.db")
    assert rs.journal([entry("a"), entry("b"), entry("a")]) == [True, True, False]
    assert rs.journal([entry("b"), entry("c")], [{"frame_id": None, "kind": "reject:x", "message": "m", "at": 1}]) \
        == [False, True]
    assert rs.counts()["frames"] == 3 and rs.counts()["errors"] == 1
    assert [p.frame_id for p in rs.pending()] == ["a", "b", "c"]


def test_verdicts_are_idempotent_and_clear_the_journal(tmp_path):
    rs = ResultStore(tmp_path / "r.db")
    rs.journal([entry("a"), entry("b")])
    v = {"frame_id": "a", "verdict": "pass", "reason": "ok", "decided_at": 3.0, "latency_ms": 1.0, "chain": "[]"}
    assert rs.write(verdicts=[v, dict(v, verdict="defect")]) == ["a"]
    assert rs.write(verdicts=[dict(v, verdict="error")]) == []
    rows = rs.query_verdicts()
    assert len(rows) == 1 and rows[0]["verdict"] == "pass"
    assert [p.frame_id for p in rs.pending()] == ["b"]
    assert rs.db.execute("SELECT status FROM frames WHERE frame_id='a'").fetchone()[0] == "done"
    assert rs.db.execute("SELECT count(*) FROM journal").fetchone()[0] == 1


def test_query_filters(tmp_path):
    rs = ResultStore(tmp_path / "r.db")
    rs.journal([entry("a", "B1"), entry("b", "B2"), entry("c", "B2")])
    rs.write(verdicts=[{"frame_id": f, "verdict": k, "reason": "", "decided_at": i, "latency_ms": 1.0,
                        "chain": json.dumps(["cls"])} for i, (f, k) in enumerate([("a", "pass"), ("b", "defect"),
                                                                                 ("c", "defect")])])
    assert [r["frame_id"] for r in rs.query_verdicts(verdict="defect")] == ["c", "b"]
    assert [r["frame_id"] for r in rs.query_verdicts(board="B1")] == ["a"]
    assert rs.query_verdicts(limit=1)[0]["chain"] == ["cls"]
    rs.close()
    ro = ResultStore(tmp_path / "r.db", readonly=True)
    assert ro.counts()["by_verdict"] == {"pass": 1, "defect": 2}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ResultStore(tmp_path / "none.db", readonly=True)


def test_an_older_database_gains_the_expert_version_columns(tmp_path):
    import sqlite3

    from storage.results import ResultStore

    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE inferences (id INTEGER PRIMARY KEY, frame_id TEXT, stage INTEGER, expert_id TEXT, "
                "device TEXT, executor TEXT, batch_id INTEGER, output TEXT, latency_ms REAL, started_at REAL)")
    con.execute("CREATE TABLE verdicts (frame_id TEXT PRIMARY KEY, verdict TEXT, reason TEXT, decided_at REAL, "
                "latency_ms REAL, chain TEXT)")
    con.execute("INSERT INTO verdicts VALUES ('f1', 'pass', '', 0, 1, '[]')")
    con.commit()
    con.close()
    rs = ResultStore(path)
    try:
        assert "expert_version" in rs.db["inferences"].columns_dict and "versions" in rs.db["verdicts"].columns_dict
        assert rs.db.execute("SELECT versions FROM verdicts WHERE frame_id='f1'").fetchone() == (None,)
    finally:
        rs.close()
