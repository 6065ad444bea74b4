"""The result store: one SQLite file per line (DESIGN.md §7), WAL mode, via sqlite-utils.

Two writers share the file, each on its own connection and thread: ingest
journals frames (and must commit before it acks), and the result writer stores
inferences, verdicts and events in batches.  WAL lets readers (the `results`
command, dashboards) run alongside both.  `synchronous=FULL` on the journal
makes an ack mean the frame survives a power cut, not only a crash.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from coe import CoEError

SCHEMA_VERSION = 1            # PRAGMA user_version of a database this code wrote (0: from before it was stamped)
RETENTION_INDEXES = (("idx_inferences_started", "inferences", "started_at"), ("idx_errors_at", "errors", "at"),
                     ("idx_expert_events_at", "expert_events", "at"), ("idx_frames_received", "frames", "received_at"))
# what an open that failed for a reason outside the file says (anything else: a foreign or damaged file)
_TRANSIENT = ("locked", "busy", "full", "readonly", "read-only", "disk i/o", "unable to open", "permission")
PRUNE_CHUNK = 5000            # rows one retention transaction deletes: ingest waits at most that long for its lock
VACUUM_PAGES = 2000           # pages one incremental vacuum step gives back

# name -> columns; each equality filter of a verdict query leads one, decision time follows (newest first)
VERDICT_INDEXES = {
    "idx_verdicts_decided": ("decided_at",),
    "idx_verdicts_verdict_decided": ("verdict", "decided_at"),
    "idx_verdicts_component_decided": ("component", "decided_at"),
    "idx_verdicts_board_decided": ("board_id", "decided_at"),
    "idx_verdicts_verdict_component_decided": ("verdict", "component", "decided_at"),
}


@dataclass(frozen=True)
class JournalEntry:
    """A frame as ingest accepted it: what is needed to re-run it after a crash."""

    frame_id: str
    line: str
    board_id: str
    component: str | None
    ts: float
    received_at: float
    header: str
    payload: bytes
    payload_sha256: str | None = None   # computed by `journal` when not given


class ResultStore:
    """Typed access to the line database.  One instance per thread."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL", readonly: bool = False) -> None:
        self.path = Path(path)
        try:
            self._open(synchronous, readonly)
        except sqlite3.DatabaseError as exc:
            text = str(exc).lower()
            if not any(w in text for w in _TRANSIENT):               # a foreign or damaged file
                raise CoEError(f"results database {self.path}: {exc} (not a results database, or a damaged one: "
                               "move it aside and the agent makes a new one; frames it journaled are then not "
                               "re-run)") from None
            # locked past the busy timeout, a full disk, a read-only mount: the file is fine, keep it
            raise CoEError(f"results database {self.path}: cannot open it: {exc} (the file is kept as it is: "
                           "free the lock, the space or the mount, and start again)") from None

    def _open(self, synchronous: str, readonly: bool) -> None:
        if readonly:
            if not self.path.is_file():
                raise FileNotFoundError(f"results database {self.path} does not exist (has the agent run?)")
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30, check_same_thread=False)
            self.db = sqlite_utils.Database(conn)
            try:
                version = conn.execute("PRAGMA user_version").fetchone()[0]
            except sqlite3.DatabaseError:
                version = 0              # not a database at all: the reader's first query says so, in its words
            try:
                self._check_version(version)       # readers too
            except CoEError:
                conn.close()
                raise
        else:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=30, check_same_thread=False)
            # new: no page yet (also a file a kill left empty between its creation and the first write)
            if conn.execute("PRAGMA page_count").fetchone()[0] == 0:
                # owner-only before WAL mode: SQLite gives the -wal and -shm files the database's mode
                os.chmod(self.path, 0o600)
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")   # lets retention give pages back
            self.db = sqlite_utils.Database(conn)
            self.db.enable_wal()
        if not readonly:
            self.db.execute(f"PRAGMA synchronous={synchronous}")
            self.db.execute("PRAGMA busy_timeout=30000")
            self.ensure_schema()

    def _check_version(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise CoEError(f"results database {self.path}: schema version {version}, written by a newer coe-edge "
                           f"(this one reads up to {SCHEMA_VERSION}); run that version, or give this agent a new "
                           "results_db")

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def _write_txn(self):
        """BEGIN IMMEDIATE: take the write lock up front.

        A deferred transaction that reads and then writes fails at once with
        SQLITE_BUSY (no busy wait) when the other writer committed in between;
        taking the lock first makes it wait its turn instead.
        """
        conn = self.db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.rollback()
            raise
        else:
            conn.commit()

    # -- schema -------------------------------------------------------------
    def ensure_schema(self) -> None:
        """Create or bring up to date the tables and indexes, in one write transaction taken up front (a
        deferred one that read the schema, then wrote, failed at once on another writer's lock: an older
        database could not be migrated while anything wrote to it).  A database a newer coe-edge wrote
        (`PRAGMA user_version` above `SCHEMA_VERSION`) is refused, naming both: its rows could not be written
        here, and frames would be acked and never given a verdict."""
        db = self.db
        with self._write_txn():
            version = db.execute("PRAGMA user_version").fetchone()[0]      # read under the lock it stamps under
            self._check_version(version)
            if "frames" not in db.table_names():
                db["frames"].create({"frame_id": str, "line": str, "board_id": str, "component": str,
                                     "ts": float, "received_at": float, "status": str}, pk="frame_id")
                db["frames"].create_index(["board_id"])
            if "journal" not in db.table_names():
                db["journal"].create({"frame_id": str, "header": str, "payload": bytes}, pk="frame_id")
            if "inferences" not in db.table_names():
                db["inferences"].create({"id": int, "frame_id": str, "stage": int, "expert_id": str,
                                         "device": str, "executor": str, "batch_id": int, "output": str,
                                         "latency_ms": float, "started_at": float, "expert_version": int},
                                        pk="id")
                db["inferences"].create_index(["frame_id"])
            if "verdicts" not in db.table_names():
                db["verdicts"].create({"frame_id": str, "verdict": str, "reason": str, "decided_at": float,
                                       "latency_ms": float, "chain": str, "versions": str, "component": str,
                                       "board_id": str}, pk="frame_id")
            # databases from before gain the columns (rows before: NULL): expert versions, and the frame's payload
            # hash that tells a resend (same bytes: a duplicate) from another frame under a reused id
            for table, column, kind in (("inferences", "expert_version", int), ("verdicts", "versions", str),
                                        ("frames", "payload_sha256", str)):
                if column not in db[table].columns_dict:
                    db[table].add_column(column, kind)
            self._denormalize_verdicts()
            # every filter of `storage.queries.query_verdicts` leads one of these, newest first after it
            for name, cols in VERDICT_INDEXES.items():
                db.execute(f"CREATE INDEX IF NOT EXISTS {name} ON verdicts ({', '.join(cols)})")
            if "thumbnails" not in db.table_names():
                db["thumbnails"].create({"id": int, "frame_id": str, "mime": str, "data": bytes, "at": float},
                                        pk="id")
                db["thumbnails"].create_index(["frame_id"], unique=True)
                db["thumbnails"].create_index(["at"])
            if "errors" not in db.table_names():
                db["errors"].create({"id": int, "frame_id": str, "kind": str, "message": str, "at": float},
                                    pk="id")
            if "expert_events" not in db.table_names():
                db["expert_events"].create({"id": int, "expert_id": str, "tier": str, "event": str,
                                            "nbytes": int, "seconds": float, "at": float}, pk="id")
            # retention deletes by these times: without an index each prune read whole tables under the lock
            for name, table, col in RETENTION_INDEXES:
                db.execute(f"CREATE INDEX IF NOT EXISTS {name} ON {table} ({col})")
            if version < SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _denormalize_verdicts(self) -> None:
        """Verdicts carry their frame's component and board, so each filter is one index range.

        A database from before gains the two columns, filled from `frames` once.
        """
        cols = self.db["verdicts"].columns_dict
        if "component" in cols and "board_id" in cols:
            return
        for column in ("component", "board_id"):
            if column not in cols:
                self.db["verdicts"].add_column(column, str)
        self.db.execute("UPDATE verdicts SET "
                        "component = (SELECT f.component FROM frames f WHERE f.frame_id = verdicts.frame_id), "
                        "board_id = (SELECT f.board_id FROM frames f WHERE f.frame_id = verdicts.frame_id)")

    # -- ingest side ----------------------------------------------------------
    def journal(self, entries: Sequence[JournalEntry], errors: Iterable[dict] = ()) -> list[bool | str]:
        """Journal accepted frames and record rejects in one committed transaction.

        Returns, per entry, True if it was new, False if its frame_id was
        already journaled with the same payload bytes (a duplicate: a resend),
        or `CONFLICT` if it was journaled with other bytes (another frame under
        a reused id; not journaled).  Within `entries` an id counts once the
        same way.  A frame journaled before payload hashes were kept cannot be
        compared: a duplicate.
        """
        errors = list(errors)
        if not entries and not errors:
            return []
        shas = [e.payload_sha256 or payload_sha256(e.payload) for e in entries]   # outside the write lock
        with self._write_txn():
            known = self.known_ids([e.frame_id for e in entries])
            fresh: list[bool | str] = []
            rows, blobs = [], []
            for e, sha in zip(entries, shas):
                if e.frame_id in known:
                    was = known[e.frame_id]
                    fresh.append(CONFLICT if was is not None and was != sha else False)
                    continue
                known[e.frame_id] = sha
                fresh.append(True)
                rows.append({"frame_id": e.frame_id, "line": e.line, "board_id": e.board_id,
                             "component": e.component, "ts": e.ts, "received_at": e.received_at,
                             "status": "accepted", "payload_sha256": sha})
                blobs.append({"frame_id": e.frame_id, "header": e.header, "payload": e.payload})
            if rows:
                self.db["frames"].insert_all(rows, batch_size=500)
                self.db["journal"].insert_all(blobs, batch_size=500)
            if errors:
                self.db["errors"].insert_all(errors, batch_size=500)
        return fresh

    def known_ids(self, ids: Sequence[str]) -> dict[str, str | None]:
        """Which of `ids` were accepted before (a frames row), each with its payload's sha256 (None for a frame
        accepted before the hash was kept): a resend has the same bytes, another frame under a reused id not."""
        found: dict[str, str | None] = {}
        for i in range(0, len(ids), 500):
            chunk = list(ids[i:i + 500])
            marks = ",".join("?" * len(chunk))
            found.update(self.db.execute(
                f"SELECT frame_id, payload_sha256 FROM frames WHERE frame_id IN ({marks})", chunk).fetchall())
        return found

    def pending(self) -> list[JournalEntry]:
        """Accepted frames that have no verdict yet (to re-run after a restart)."""
        # driven from the journal (only unfinished frames), not from `frames`, which keeps every frame ever
        # accepted: CROSS JOIN keeps SQLite from choosing the big table to satisfy an ORDER BY; sorted here
        cur = self.db.execute(
            "SELECT f.rowid, f.frame_id, f.line, f.board_id, f.component, f.ts, f.received_at, j.header, j.payload "
            "FROM journal j CROSS JOIN frames f ON f.frame_id = j.frame_id "
            "LEFT JOIN verdicts v ON v.frame_id = f.frame_id WHERE v.frame_id IS NULL")
        return [JournalEntry(*row[1:]) for row in sorted(cur.fetchall(), key=lambda r: r[0])]

    # -- result writer side -----------------------------------------------------
    def write(self, *, inferences: Sequence[dict] = (), verdicts: Sequence[dict] = (),
              errors: Sequence[dict] = (), events: Sequence[dict] = (), thumbnails: Sequence[dict] = (),
              keep_thumbnails: int | None = None) -> list[str]:
        """Store one batch of results in one transaction.

        Verdicts are idempotent by frame_id: a frame that already has one keeps
        it.  A verdict row without `component`/`board_id` gets its frame's.
        Thumbnails (`frame_id`, `mime`, `data`, `at`) are stored only with a
        verdict this call stores, and at most `keep_thumbnails` stay (the
        oldest go first), so their disk use is bounded between prunes.
        Returns the frame_ids whose verdict this call stored.
        """
        stored: list[str] = []
        with self._write_txn():
            if inferences:
                self.db["inferences"].insert_all(inferences, batch_size=500)
            if verdicts:
                have = self._verdicts_for([v["frame_id"] for v in verdicts])
                new = []
                for v in verdicts:
                    if v["frame_id"] not in have:
                        have.add(v["frame_id"])
                        new.append(v)
                self._fill_frame_fields(new)
                if new:
                    self.db["verdicts"].insert_all(new, batch_size=500)
                    stored = [v["frame_id"] for v in new]
                    for i in range(0, len(stored), 500):
                        chunk = stored[i:i + 500]
                        marks = ",".join("?" * len(chunk))
                        self.db.execute(f"UPDATE frames SET status='done' WHERE frame_id IN ({marks})", chunk)
                        self.db.execute(f"DELETE FROM journal WHERE frame_id IN ({marks})", chunk)
            if errors:
                self.db["errors"].insert_all(errors, batch_size=500)
            if events:
                self.db["expert_events"].insert_all(events, batch_size=500)
            keep = set(stored)
            thumbs = [t for t in thumbnails if t["frame_id"] in keep]
            if thumbs and keep_thumbnails != 0:
                self.db["thumbnails"].insert_all(thumbs, batch_size=500)
                if keep_thumbnails is not None:
                    self.db.execute("DELETE FROM thumbnails WHERE id <= (SELECT max(id) FROM thumbnails) - ?",
                                    (keep_thumbnails,))
        return stored

    def _fill_frame_fields(self, verdicts: list[dict]) -> None:
        """Give verdict rows that lack them their frame's component and board (the agent passes both)."""
        todo = [v for v in verdicts if "component" not in v or "board_id" not in v]
        for i in range(0, len(todo), 500):
            chunk = todo[i:i + 500]
            marks = ",".join("?" * len(chunk))
            known = {r[0]: (r[1], r[2]) for r in self.db.execute(
                f"SELECT frame_id, component, board_id FROM frames WHERE frame_id IN ({marks})",
                [v["frame_id"] for v in chunk])}
            for v in chunk:
                comp, board = known.get(v["frame_id"], (None, None))
                v.setdefault("component", comp)
                v.setdefault("board_id", board)

    def _verdicts_for(self, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            marks = ",".join("?" * len(chunk))
            found.update(r[0] for r in self.db.execute(
                f"SELECT frame_id FROM verdicts WHERE frame_id IN ({marks})", chunk).fetchall())
        return found

    # -- queries ------------------------------------------------------------------
    def query_verdicts(self, *, verdict: str | None = None, board: str | None = None,
                       component: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The first page of `storage.queries.query_verdicts` (the query the CLI and the API share)."""
        from .queries import VerdictQuery, query_verdicts

        return query_verdicts(self.db.conn, VerdictQuery(verdict=verdict, component=component, board=board,
                                                         limit=limit)).rows

    def prune(self, before: float, *, keep_verdicts: bool = True) -> dict[str, int]:
        """Delete rows older than `before` (epoch seconds), then give free pages back.

        Frames still waiting for a verdict are never pruned: retention must not
        lose an accepted frame.  With `keep_verdicts`, verdicts and their frame
        rows stay; inferences, errors, expert events and defect thumbnails go
        (thumbnails are images of the product: they never outlive `before`).
        """
        deleted: dict[str, int] = {}
        for table, n in self.prune_steps(before, keep_verdicts=keep_verdicts):
            if table:
                deleted[table] = deleted.get(table, 0) + n
        return deleted

    def prune_steps(self, before: float, *, keep_verdicts: bool = True) -> Iterator[tuple[str, int]]:
        """`prune` a step at a time: each step is one short transaction (a chunk of
        one table's rows, yielded as (table, rows deleted)) or one incremental
        vacuum step (yielded as ("", 0)).

        Why steps: a whole backlog (after downtime, or retention first turned on)
        held the write lock for seconds.  Ingest, which acks nothing until its
        journal commits, waits at most one step; the result writer runs a step
        between its flushes, so verdicts are stored and published while a long
        prune goes on.  Every table yields at least once, so the caller sees
        each table's count, 0 included.
        """
        where = {"inferences": "started_at < ?", "errors": "at < ?", "expert_events": "at < ?",
                 "thumbnails": "at < ?"}
        if not keep_verdicts:
            where["verdicts"] = "decided_at < ?"
            where["frames"] = ("received_at < ? AND status = 'done' AND frame_id NOT IN "
                               "(SELECT frame_id FROM verdicts)")
        for table, cond in where.items():
            while True:
                with self._write_txn():
                    n = self.db.conn.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} "
                                             f"WHERE {cond} LIMIT {PRUNE_CHUNK})", (before,)).rowcount
                yield table, n
                if n < PRUNE_CHUNK:
                    break
        while self.freelist() > 0:
            before_free = self.freelist()
            # executescript steps the pragma to completion (execute() would free a single page)
            self.db.conn.executescript(f"PRAGMA incremental_vacuum({VACUUM_PAGES});")
            if self.freelist() >= before_free:      # not incremental (a database from before auto_vacuum)
                break
            yield "", 0

    def freelist(self) -> int:
        return self.db.execute("PRAGMA freelist_count").fetchone()[0]

    def counts(self) -> dict[str, Any]:
        q = lambda sql: self.db.execute(sql).fetchone()[0]  # noqa: E731
        by_kind = {r[0]: r[1] for r in self.db.execute("SELECT verdict, count(*) FROM verdicts GROUP BY verdict")}
        events = {r[0]: r[1] for r in self.db.execute("SELECT event, count(*) FROM expert_events GROUP BY event")}
        return {"frames": q("SELECT count(*) FROM frames"), "verdicts": q("SELECT count(*) FROM verdicts"),
                "by_verdict": by_kind, "errors": q("SELECT count(*) FROM errors"),
                "inferences": q("SELECT count(*) FROM inferences"), "expert_events": events}


CONFLICT = "conflict"   # `journal`: this frame_id was journaled with other payload bytes


def payload_sha256(payload: bytes) -> str:
    """What tells a resend of a frame (the same bytes) from another frame under the same id."""
    import hashlib

    return hashlib.sha256(payload).hexdigest()


# SQLite's words for a fault of the database itself, not of a row: retrying later is the cure
_DB_FAULTS = ("locked", "busy", "full", "readonly", "read-only", "disk i/o", "malformed", "not a database",
              "unable to open", "no such table")


def is_database_fault(exc: BaseException) -> bool:
    """True when the database, not the row, failed the write (a row is never set aside for it)."""
    if isinstance(exc, OSError):
        return True
    if isinstance(exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError)):
        return False          # a constraint, a binding, a type: the row's
    if isinstance(exc, sqlite3.OperationalError):   # both kinds: 'database is locked', 'has no column named x'
        return any(w in str(exc).lower() for w in _DB_FAULTS)
    return isinstance(exc, sqlite3.DatabaseError)   # 'database disk image is malformed', 'file is not a database'


class RowFault(Exception):
    """The rows, not the database, failed a write (`is_database_fault` false) as often as allowed."""


class GiveUp(Exception):
    """Stopping, and the database still fails: what is left stays journaled for the next start."""


def retry_write(call: Callable[[], Any], *, row_tries: int, stopping: Callable[[], bool],
                failed: Callable[[int, BaseException], str]) -> Any:
    """`call()`, retried with backoff while the database itself fails (locked, full, read-only: waited out).

    Raises `RowFault` once the rows have failed `row_tries` times, and `GiveUp`
    when `stopping()` and three attempts failed.  `failed(attempt, exc)` is
    told of each failure and returns its description (the ingest journal and
    the result writer count and log them their own way).
    """
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - a locked or full disk must not kill the thread that writes
            attempt += 1
            why = failed(attempt, exc)
            if not is_database_fault(exc) and attempt >= row_tries:
                raise RowFault(why) from None
            if stopping() and attempt >= 3:
                raise GiveUp(why) from None
            time.sleep(min(0.1 * 2 ** attempt, 2.0))
