"""The shared verdict query (keyset pages, filters on indexes, old databases) and thumbnail retention."""
from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import time

import pytest
import zmq

from edge_agent.writer import ResultWriter
from storage.queries import QueryError, VerdictQuery, parse_verdict_params, query_verdicts, verdict_sql
from storage.results import VERDICT_INDEXES, JournalEntry, ResultStore


def fill(rs: ResultStore, n: int, *, at=lambda i: 1000.0 + i // 7, comps=("R0402", "C0402", "U-SOIC8")) -> None:
    """n frames with verdicts; many share a decision time, so paging must break ties by insertion order."""
    rs.journal([JournalEntry(f"f{i:05d}", "A", f"B{i // 20}", comps[i % len(comps)], 1.0, at(i), "{}", b"x")
                for i in range(n)])
    rs.write(verdicts=[{"frame_id": f"f{i:05d}", "verdict": "defect" if i % 9 == 0 else "pass", "reason": "",
                        "decided_at": at(i), "latency_ms": 1.0, "chain": json.dumps(["cls"])} for i in range(n)])


def all_pages(conn, **filters) -> list[str]:
    out, after = [], None
    while True:
        page = query_verdicts(conn, VerdictQuery(limit=13, after=after, **filters))
        out += [r["frame_id"] for r in page.rows]
        if page.next is None:
            return out
        after = parse_verdict_params({"next": [page.next]}).after


def test_keyset_pages_return_every_row_once_in_order_despite_tied_times(tmp_path):
    rs = ResultStore(tmp_path / "r.db")
    fill(rs, 500)
    want = [r[0] for r in rs.db.execute("SELECT frame_id FROM verdicts ORDER BY decided_at DESC, rowid DESC")]
    assert all_pages(rs.db.conn) == want
    defects = [f for f in want if int(f[1:]) % 9 == 0]
    assert all_pages(rs.db.conn, verdict="defect") == defects
    assert all_pages(rs.db.conn, verdict="defect", component="R0402") == [f for f in defects if int(f[1:]) % 3 == 0]
    assert all_pages(rs.db.conn, board="B3") == [f for f in want if int(f[1:]) // 20 == 3]
    assert all_pages(rs.db.conn, since=1050.0) == [f for f in want if 1000 + int(f[1:]) // 7 >= 1050]


@pytest.mark.parametrize("filters", [{}, {"verdict": "defect"}, {"component": "R0402"}, {"board": "B3"},
                                     {"verdict": "defect", "component": "R0402"}, {"since": 1010.0},
                                     {"verdict": "pass", "after": (1040.0, 200)}])
def test_every_filter_reads_an_index_newest_first_without_sorting(tmp_path, filters):
    rs = ResultStore(tmp_path / "r.db")
    fill(rs, 50)
    sql, args = verdict_sql(rs.db.conn, VerdictQuery(**filters))
    plan = " | ".join(r[3] for r in rs.db.execute("EXPLAIN QUERY PLAN " + sql, args))
    assert "USING INDEX idx_verdicts_" in plan or "USING COVERING INDEX idx_verdicts_" in plan, plan
    assert "TEMP B-TREE" not in plan, plan           # the index gives the order: no sort of the matches


def test_a_database_from_before_gains_frame_fields_and_indexes_and_read_only_ones_still_answer(tmp_path):
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE frames (frame_id TEXT PRIMARY KEY, line TEXT, board_id TEXT, component TEXT, ts REAL, "
                "received_at REAL, status TEXT)")
    con.execute("CREATE TABLE verdicts (frame_id TEXT PRIMARY KEY, verdict TEXT, reason TEXT, decided_at REAL, "
                "latency_ms REAL, chain TEXT)")
    for i, comp in enumerate(["R0402", "C0402", "R0402"]):
        con.execute("INSERT INTO frames VALUES (?, 'A', 'B1', ?, 0, 0, 'done')", (f"f{i}", comp))
        con.execute("INSERT INTO verdicts VALUES (?, 'pass', '', ?, 1, '[]')", (f"f{i}", float(i)))
    con.commit()
    con.close()
    ro = ResultStore(path, readonly=True)       # never migrated: answered through a join with frames
    assert [r["frame_id"] for r in query_verdicts(ro.db.conn, VerdictQuery(component="R0402")).rows] == ["f2", "f0"]
    ro.close()
    rs = ResultStore(path)
    assert rs.db.execute("SELECT component, board_id FROM verdicts WHERE frame_id='f1'").fetchone() == ("C0402", "B1")
    assert set(VERDICT_INDEXES) <= {i.name for i in rs.db["verdicts"].indexes}
    assert [r["frame_id"] for r in query_verdicts(rs.db.conn, VerdictQuery(component="R0402")).rows] == ["f2", "f0"]


@pytest.mark.parametrize("params, param", [
    ({"limit": ["x"]}, "limit"), ({"limit": ["1001"]}, "limit"), ({"verdict": ["ok"]}, "verdict"),
    ({"since": ["31/01/2025"]}, "since"), ({"since": ["inf"]}, "since"), ({"next": ["12"]}, "next"),
    ({"next": ["nan:3"]}, "next"), ({"board": ["x" * 200]}, "board"), ({"sort": ["frame_id"]}, "sort"),
    ({"verdict": ["pass", "defect"]}, "verdict"),
])
def test_malformed_parameters_raise_naming_them(params, param):
    with pytest.raises(QueryError) as err:
        parse_verdict_params(params)
    assert err.value.param == param and f"'{param}'" in str(err.value)


def test_parameters_parse_times_and_ignore_the_token():
    q = parse_verdict_params({"since": ["2025-01-31T06:00:00Z"], "limit": ["5"], "token": ["t" * 20],
                              "next": ["1738303200.5:42"]})
    assert q.since == 1738303200.0 and q.limit == 5 and q.after == (1738303200.5, 42)


def thumb(fid: str, at: float) -> dict:
    return {"frame_id": fid, "mime": "image/jpeg", "data": b"\xff\xd8" + fid.encode() * 50, "at": at}


def test_thumbnails_are_stored_with_new_defect_verdicts_capped_and_pruned_with_retention(tmp_path):
    rs = ResultStore(tmp_path / "r.db")
    old, new = 1000.0, time.time()
    rs.journal([JournalEntry(f"f{i}", "A", "B", "C", 1.0, 1.0, "{}", b"x") for i in range(12)])
    v = lambda i, at: {"frame_id": f"f{i}", "verdict": "defect", "reason": "", "decided_at": at,  # noqa: E731
                       "latency_ms": 1.0, "chain": "[]"}
    rs.write(verdicts=[v(i, old) for i in range(4)], thumbnails=[thumb(f"f{i}", old) for i in range(4)])
    # a thumbnail without a verdict stored in the same call (a duplicate verdict) is not kept
    rs.write(verdicts=[v(0, new)], thumbnails=[thumb("f0", new)])
    assert rs.db.execute("SELECT count(*), min(at) FROM thumbnails").fetchone() == (4, old)
    rs.write(verdicts=[v(i, new) for i in range(4, 12)], thumbnails=[thumb(f"f{i}", new) for i in range(4, 12)],
             keep_thumbnails=6)
    assert [r[0] for r in rs.db.execute("SELECT frame_id FROM thumbnails ORDER BY id")] == \
        [f"f{i}" for i in range(6, 12)]            # the newest 6 stay
    rs.write(verdicts=[], thumbnails=[])
    rs.db.execute("UPDATE thumbnails SET at = ? WHERE frame_id IN ('f6', 'f7')", (old,))
    rs.db.conn.commit()
    got = rs.prune(time.time() - 86400, keep_verdicts=True)
    assert got["thumbnails"] == 2 and rs.db.execute("SELECT count(*) FROM verdicts").fetchone()[0] == 12
    assert {r[0] for r in rs.db.execute("SELECT frame_id FROM thumbnails")} == {f"f{i}" for i in range(8, 12)}


def test_the_result_writer_prunes_thumbnails_under_the_retention_policy(tmp_path):
    db = tmp_path / "r.db"
    rs = ResultStore(db)
    rs.journal([JournalEntry(f"f{i}", "A", "B", "C", 1.0, 1.0, "{}", b"x") for i in range(3)])
    rs.close()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("inproc://thumbs")
    committed = []
    w = ResultWriter(str(db), pub, "A", flush_ms=5, retention_days=1.0, keep_thumbnails=100,
                     first_prune_s=0.3, on_committed=lambda rows, stored: committed.extend(stored))
    w.start()
    old = time.time() - 3 * 86400
    for i, at in enumerate([old, old, time.time()]):
        w.put_verdict({"frame_id": f"f{i}", "verdict": "defect", "reason": "", "decided_at": at, "latency_ms": 1.0,
                       "chain": "[]"}, thumb(f"f{i}", at))
    deadline = time.time() + 20
    while w.pruned.get("thumbnails", 0) < 2 and time.time() < deadline:
        time.sleep(0.05)
    w.stop()
    ctx.term()
    assert sorted(committed) == ["f0", "f1", "f2"] and w.pruned.get("thumbnails") == 2
    con = sqlite3.connect(db)
    assert [r[0] for r in con.execute("SELECT frame_id FROM thumbnails")] == ["f2"]
    assert con.execute("SELECT count(*) FROM verdicts").fetchone()[0] == 3     # keep_verdicts: they stay
    con.close()


def test_two_verdicts_for_one_frame_in_one_flush_publish_and_report_only_the_stored_first(tmp_path):
    """The store keeps a frame's first verdict; the writer must publish and report that one alone (a second row
    in the same flush went out on PUB beside it)."""
    import json as _json

    import zmq

    from edge_agent.writer import ResultWriter

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("inproc://dupes")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://dupes")
    reported = []
    w = ResultWriter(str(tmp_path / "r.db"), pub, "A", flush_ms=200,
                     on_committed=lambda rows, stored: reported.extend((r["frame_id"], r["verdict"]) for r in rows
                                                                       if r["frame_id"] in stored))
    row = {"frame_id": "f1", "reason": "", "decided_at": time.time(), "latency_ms": 1.0, "chain": "[]"}
    w.put_verdict({**row, "verdict": "pass"})             # both queued before the writer's first flush
    w.put_verdict({**row, "verdict": "error"})
    w.start()
    w.stop()
    got = []
    while sub.poll(200):
        got.append(_json.loads(sub.recv_multipart()[1])["verdict"])
    sub.close(linger=0)
    pub.close(linger=0)
    ctx.term()
    assert got == ["pass"] and reported == [("f1", "pass")]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the writer re-raises
def test_a_result_writer_whose_database_cannot_be_opened_says_why_it_stopped(tmp_path):
    """The agent's health names a dead writer by `writer.error`: a database that cannot be opened at start must be
    recorded there, not end the thread without a word."""
    import zmq

    from edge_agent.writer import ResultWriter

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("inproc://nodb")
    (tmp_path / "adir").mkdir()                      # a directory where the database file should be
    w = ResultWriter(str(tmp_path / "adir"), pub, "A")
    w.start()
    w._thread.join(10)
    ctx.destroy(linger=0)                            # not term(): a writer that never closed its socket must not hang us
    assert not w.alive() and w.error is not None


def test_a_results_file_that_is_not_a_database_is_named_and_an_empty_one_is_made_new(tmp_path):
    import os
    import stat

    from coe import CoEError

    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not sqlite " * 500)
    with pytest.raises(CoEError, match=f"results database {bad}: file is not a database .*move it aside"):
        ResultStore(bad)
    assert bad.read_bytes() == b"not sqlite " * 500            # left as it was, for whoever looks at it
    empty = tmp_path / "empty.db"                               # a kill between its creation and the first write
    empty.write_bytes(b"")
    rs = ResultStore(empty)
    assert rs.db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2          # incremental: prune gives pages back
    rs.close()
    assert stat.S_IMODE(os.stat(empty).st_mode) == 0o600


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    import os

    from coe.files import write_bytes_atomic, write_json_atomic

    path = tmp_path / "profile.json"
    write_json_atomic(path, {"v": 1})
    real = os.fsync

    def failing(fd):                                            # the disk fails while the new bytes go down
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        write_bytes_atomic(path, b'{"v": 2}')
    monkeypatch.setattr(os, "fsync", real)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def test_a_frame_the_journal_cannot_store_is_rejected_and_the_frames_beside_it_are_journaled(tmp_path):
    """A row fault (here a frame id SQLite cannot encode, past the header checks) three times running: the read
    is journaled frame by frame, the bad frame is answered rejected, and the good ones are accepted."""
    from conftest import db_rows
    from edge_agent.ingest import Ingest
    from edge_agent.metrics import Metrics

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    rs = ResultStore(tmp_path / "r.db")
    ingest = Ingest(sock, rs, line="A", router=None, max_payload=1 << 20, metrics=Metrics("A"),
                    on_accepted=lambda a: None, free_slots=lambda: 100)
    entries = [JournalEntry(fid, "A", "B0", "R0402", 1.0, 1.0, "{}", b"x") for fid in ("g1", "\ud800", "g2", "g1")]
    errors = [{"frame_id": "r1", "kind": "reject:bad_field", "message": "m", "at": 1.0}]
    try:
        assert ingest._journal(entries, errors) == [True, None, True, False]     # the repeat of g1 counts once
    finally:
        rs.close()
        sock.close(linger=0)
        ctx.term()
    assert [r[0] for r in db_rows(tmp_path / "r.db", "SELECT frame_id FROM journal ORDER BY frame_id")] \
        == ["g1", "g2"]
    assert sorted(db_rows(tmp_path / "r.db", "SELECT frame_id, kind FROM errors")) == [
        ("\\ud800", "reject:bad_field"), ("r1", "reject:bad_field")]     # its reject is on record, escaped


def test_a_database_from_before_payload_hashes_gains_the_column_and_its_frames_stay_duplicates(tmp_path):
    """Frames accepted before the hash was kept have none: a resend of theirs is a duplicate whatever its bytes
    (nothing to compare with), and new frames get their hash."""
    from edge_agent import protocol as P
    from edge_agent.ingest import _conflict

    db = tmp_path / "old.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE frames (frame_id TEXT PRIMARY KEY, line TEXT, board_id TEXT, component TEXT, "
                "ts FLOAT, received_at FLOAT, status TEXT)")
    con.execute("INSERT INTO frames VALUES ('old', 'A', 'B0', 'R0402', 1.0, 1.0, 'done')")
    con.commit()
    con.close()
    rs = ResultStore(db)
    rs.journal([JournalEntry("new", "A", "B0", "R0402", 1.0, 1.0, "{}", b"image")])
    known = rs.known_ids(["old", "new", "never"])
    rs.close()
    assert known == {"old": None, "new": hashlib.sha256(b"image").hexdigest()}
    assert _conflict("old", known["old"], [b"{}", b"other"]) is None
    assert _conflict("new", known["new"], [b"{}", b"image"]) is None
    assert _conflict("new", known["new"], [b"{}", b"other"]).reason == P.ID_CONFLICT


def test_the_journal_itself_tells_a_resend_from_another_frame_under_the_same_id(tmp_path):
    """Whatever ingest looked up before (a lookup that failed, or both copies in one read), the journal decides:
    the same bytes are a duplicate, other bytes a conflict that is not journaled."""
    from conftest import db_rows
    from storage.results import CONFLICT

    rs = ResultStore(tmp_path / "r.db")

    def entry(fid, payload):
        return JournalEntry(fid, "A", "B0", "R0402", 1.0, 1.0, "{}", payload)
    assert rs.journal([entry("a", b"one"), entry("a", b"one"), entry("a", b"two")]) == [True, False, CONFLICT]
    assert rs.journal([entry("a", b"one"), entry("a", b"three")]) == [False, CONFLICT]
    assert db_rows(tmp_path / "r.db", "SELECT payload FROM journal") == [(b"one",)]
    rs.close()


def test_since_refuses_milliseconds_out_of_range_times_and_a_local_time_that_does_not_exist(monkeypatch):
    from storage.queries import parse_since

    assert parse_since("1714557600") == 1714557600.0 and parse_since("2024-05-01T10:00:00Z") == 1714557600.0
    for text, says in (("1714557600000", "after the year 2200 (milliseconds? give seconds)"),
                       ("1e18", "after the year 2200"), ("-5", "before 1970"),
                       ("0001-01-01T00:00:00+00:00", "before 1970")):
        with pytest.raises(QueryError, match=re.escape(says)):
            parse_since(text)
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        with pytest.raises(QueryError, match="does not exist in this box's time zone"):
            parse_since("2024-03-31T02:30:00")            # the hour the clocks spring forward
        assert parse_since("2024-03-31T03:30:00") == parse_since("2024-03-31T03:30:00+02:00")
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_the_cli_and_the_api_refuse_the_same_filters():
    for board in ("", "b" * 300):
        with pytest.raises(QueryError, match=r"parameter 'board': must be 1\.\.128 characters"):
            VerdictQuery(board=board)
        with pytest.raises(QueryError, match=r"parameter 'board': must be 1\.\.128 characters"):
            parse_verdict_params({"board": [board]})


def test_a_foreign_sqlite_file_is_called_foreign_not_locked(tmp_path):
    from coe import CoEError

    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE verdicts (x INTEGER)")          # another application's table of the same name
    con.commit()
    con.close()
    with pytest.raises(CoEError, match=r"not a results database, or a damaged one"):
        ResultStore(path)


def test_the_result_writer_stores_and_publishes_verdicts_between_the_steps_of_a_long_prune(tmp_path, monkeypatch):
    """A prune of a large backlog used to run whole on the writer's thread: every verdict waited behind it,
    unstored and unpublished, for seconds.  Now a verdict that arrives mid-prune waits for one step."""
    import storage.results as results_mod

    monkeypatch.setattr(results_mod, "PRUNE_CHUNK", 5)
    db = tmp_path / "r.db"
    rs = ResultStore(db)
    rs.journal([JournalEntry("late", "A", "B", "C", 1.0, time.time(), "{}", b"x")])
    rs.write(errors=[{"frame_id": None, "kind": "k", "message": "m", "at": 1000.0} for _ in range(50)])
    rs.close()
    events: list[str] = []
    real_steps = ResultStore.prune_steps
    holder = {}

    def steps(self, before, *, keep_verdicts=True):
        for i, step in enumerate(real_steps(self, before, keep_verdicts=keep_verdicts)):
            events.append("step")
            if i == 0:          # a verdict arrives while the prune is under way
                holder["w"].put_verdict({"frame_id": "late", "verdict": "pass", "reason": "",
                                         "decided_at": time.time(), "latency_ms": 1.0, "chain": "[]"})
            yield step

    monkeypatch.setattr(ResultStore, "prune_steps", steps)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("inproc://prune-steps")
    w = ResultWriter(str(db), pub, "A", flush_ms=5, retention_days=1.0, first_prune_s=0.0,
                     on_committed=lambda rows, stored: events.extend(f"commit {f}" for f in stored))
    holder["w"] = w
    w.start()
    deadline = time.time() + 20
    while w.pruned.get("errors", 0) < 50 and time.time() < deadline:
        time.sleep(0.02)
    w.stop()
    ctx.term()
    assert w.pruned.get("errors") == 50 and events.count("commit late") == 1
    # the verdict went in right after the step it arrived in, not after the prune's 10+ other steps
    assert events.index("commit late") == 1 and events.count("step") > 10, events
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM errors").fetchone()[0] == 0
    assert con.execute("SELECT frame_id FROM verdicts").fetchall() == [("late",)]
    con.close()
