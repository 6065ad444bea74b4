"""Read-only queries over a line's results database, shared by `coe-agent results` and the HTTP API.

One function answers "which verdicts match" for both the command line and the
status page, so the two can never disagree about what a filter means.  Paging
is keyset (Datasette-style): a page carries `next`, an opaque cursor naming
the last row's (decided_at, rowid); the next page starts strictly after it.
That stays O(limit) however deep one pages, where OFFSET would rescan.

Every filter runs on an index of `verdicts` (see `ResultStore.ensure_schema`):
each equality filter leads an index whose second column is `decided_at`, so a
query reads its rows newest first straight off one index and stops at `limit`.
Databases written before `verdicts` carried `component` and `board_id`
(opened read-only, never migrated) are still answered, through a join.

Bad input raises `QueryError` naming the parameter; the API turns it into a
400, the CLI into a one-line error.
"""
from __future__ import annotations

import base64
import json
import math
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

VERDICTS = ("pass", "defect", "error")
MAX_LIMIT = 1000
DEFAULT_LIMIT = 50
MAX_FILTER_LEN = 128


class QueryError(ValueError):
    """A malformed query parameter; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"parameter '{param}': {message}")
        self.param, self.message = param, message


@dataclass(frozen=True)
class VerdictQuery:
    """Which verdicts, newest first.  `since` is epoch seconds (inclusive); `after` is a `next` cursor."""

    verdict: str | None = None
    component: str | None = None
    board: str | None = None
    since: float | None = None
    limit: int = DEFAULT_LIMIT
    after: tuple[float, int] | None = None

    def __post_init__(self) -> None:
        for key in ("component", "board"):     # here, so the CLI and the API refuse the same filters
            v = getattr(self, key)
            if v is not None and (not v or len(v) > MAX_FILTER_LEN):
                raise QueryError(key, f"must be 1..{MAX_FILTER_LEN} characters")
        if self.verdict is not None and self.verdict not in VERDICTS:
            raise QueryError("verdict", f"must be one of {', '.join(VERDICTS)}, got '{self.verdict}'")
        if not 1 <= self.limit <= MAX_LIMIT:
            raise QueryError("limit", f"must be an integer from 1 to {MAX_LIMIT}, got {self.limit}")
        if self.since is not None and not math.isfinite(self.since):
            raise QueryError("since", "must be a finite time")

    def params(self) -> dict[str, str]:
        """The query as URL parameters (without the cursor), for building `next_url`."""
        out = {k: str(getattr(self, k)) for k in ("verdict", "component", "board") if getattr(self, k)}
        if self.since is not None:
            out["since"] = repr(self.since)
        out["limit"] = str(self.limit)
        return out


@dataclass(frozen=True)
class VerdictPage:
    rows: list[dict[str, Any]]
    next: str | None          # cursor for the following page; None when this page is the last

    def to_json(self) -> dict:
        return asdict(self)


# -- parsing ---------------------------------------------------------------------------
def parse_since(text: str) -> float:
    """Epoch seconds, or an ISO 8601 time ('2024-05-01T10:00:00Z'; without an offset: local time)."""
    text = text.strip()
    numeric = True
    try:
        value = float(text)
    except ValueError:
        numeric = False
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise QueryError("since", f"expected epoch seconds or an ISO 8601 time, got '{text[:40]}'") from None
        try:
            value = when.timestamp()
        except (OverflowError, ValueError, OSError):
            raise QueryError("since", f"'{text[:40]}' is out of the range of times this box can read") from None
        if when.tzinfo is None and 0 <= value <= SINCE_MAX and datetime.fromtimestamp(value) != when:
            # a local time that does not exist (the hour a clock springs forward): no verdict has it
            raise QueryError("since", f"'{text[:40]}' does not exist in this box's time zone (a daylight-saving "
                                      "gap); give an offset, e.g. +02:00")
    if not math.isfinite(value):
        raise QueryError("since", "must be a finite time")
    if value > SINCE_MAX:
        hint = " (milliseconds? give seconds)" if numeric and value / 1000 <= SINCE_MAX else ""
        raise QueryError("since", f"{text[:40]} is after the year 2200{hint}")
    if value < 0:
        raise QueryError("since", f"{text[:40]} is before 1970")
    return value


SINCE_MAX = 7_258_118_400.0    # 2200-01-01 UTC: later is a typo (milliseconds), not a time a verdict has


def encode_cursor(decided_at: float, rowid: int) -> str:
    return f"{decided_at!r}:{rowid}"


def parse_cursor(text: str) -> tuple[float, int]:
    at, sep, rowid = text.rpartition(":")
    try:
        if not sep:
            raise ValueError
        value = (float(at), int(rowid))
    except ValueError:
        raise QueryError("next", f"not a cursor from a previous page: '{text[:40]}'") from None
    if not math.isfinite(value[0]) or not 0 <= value[1] < 2**63:     # SQLite's rowids are 64-bit
        raise QueryError("next", f"not a cursor from a previous page: '{text[:40]}'")
    return value


def parse_verdict_params(params: Mapping[str, Sequence[str]], *, ignore: Sequence[str] = ("token",)) -> VerdictQuery:
    """URL parameters (as `urllib.parse.parse_qs` gives them) -> a checked `VerdictQuery`.

    Unknown or repeated parameters are errors rather than silently ignored: a
    typo such as `verdicts=defect` must not return every verdict.
    """
    known = ("verdict", "component", "board", "since", "limit", "next")
    one: dict[str, str] = {}
    for key, values in params.items():
        if key in ignore:
            continue
        if key not in known:
            raise QueryError(key, f"unknown parameter (known: {', '.join(known)})")
        if len(values) != 1:
            raise QueryError(key, "given more than once")
        one[key] = values[0]
    if "verdict" in one and (not one["verdict"] or len(one["verdict"]) > MAX_FILTER_LEN):
        raise QueryError("verdict", f"must be 1..{MAX_FILTER_LEN} characters")
    limit = DEFAULT_LIMIT
    if "limit" in one:
        try:
            limit = int(one["limit"])
        except ValueError:
            raise QueryError("limit", f"must be an integer from 1 to {MAX_LIMIT}, got '{one['limit'][:20]}'") from None
    return VerdictQuery(verdict=one.get("verdict"), component=one.get("component"), board=one.get("board"),
                        since=parse_since(one["since"]) if "since" in one else None, limit=limit,
                        after=parse_cursor(one["next"]) if "next" in one else None)


# -- queries -----------------------------------------------------------------------------
def _verdict_columns(conn: sqlite3.Connection) -> set[str]:
    return {r[1] for r in conn.execute("PRAGMA table_info(verdicts)")}


def verdict_sql(conn: sqlite3.Connection, q: VerdictQuery) -> tuple[str, list]:
    """The SQL and arguments `query_verdicts` runs for `q` (also for EXPLAIN QUERY PLAN in tests and bench)."""
    cols = _verdict_columns(conn)
    own = {"component", "board_id"} <= cols     # every database this version wrote; older ones join frames
    has_versions = "versions" in cols
    comp, board = ("v.component", "v.board_id") if own else ("f.component", "f.board_id")
    where, args = [], []
    for col, val in (("v.verdict", q.verdict), (comp, q.component), (board, q.board)):
        if val is not None:
            where.append(f"{col} = ?")
            args.append(val)
    if q.since is not None:
        where.append("v.decided_at >= ?")
        args.append(q.since)
    if q.after is not None:
        where.append("(v.decided_at, v.rowid) < (?, ?)")
        args.extend(q.after)
    sql = (f"SELECT v.rowid, v.frame_id, {board} AS board_id, {comp} AS component, v.verdict, v.reason, "
           f"v.latency_ms, v.decided_at, v.chain, {'v.versions' if has_versions else 'NULL'} AS versions "
           f"FROM verdicts v {'' if own else 'LEFT JOIN frames f ON f.frame_id = v.frame_id'}")
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY v.decided_at DESC, v.rowid DESC LIMIT ?"
    args.append(q.limit + 1)       # one more than asked: tells whether a next page exists
    return sql, args


def query_verdicts(conn: sqlite3.Connection, q: VerdictQuery) -> VerdictPage:
    """The page of verdicts `q` asks for, newest first (by decision time, then insertion order)."""
    cur = conn.execute(*verdict_sql(conn, q))
    names = [d[0] for d in cur.description]
    raw = [dict(zip(names, r)) for r in cur.fetchall()]
    more = len(raw) > q.limit
    raw = raw[:q.limit]
    rows = []
    for r in raw:
        rowid = r.pop("rowid")
        _decode_columns(r)
        r["_cursor"] = (r["decided_at"], rowid)
        rows.append(r)
    nxt = encode_cursor(*rows[-1]["_cursor"]) if more and rows else None
    for r in rows:
        del r["_cursor"]
    return VerdictPage(rows, nxt)


def _decode_columns(row: dict) -> None:
    """A verdict row's JSON columns (`chain`, `versions`) decoded in place.  One that is not JSON (a corrupt row)
    must not fail the whole page, nor change the field's type for API clients: it reads as empty, and
    `<column>_error` says what was stored."""
    for column, empty in (("chain", []), ("versions", {})):
        text = row.get(column)
        row[column] = type(empty)()
        if not text:
            continue
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, type(empty)):
            row[column] = value
        else:
            row[f"{column}_error"] = f"stored {column} is not a JSON {type(empty).__name__}: {str(text)[:80]!r}"


def frame_detail(conn: sqlite3.Connection, frame_id: str, *, thumbnail_url: str | None = None) -> dict | None:
    """One frame: its header fields, verdict, every expert step (chain, outputs, versions), its thumbnail.

    None when the database has no such frame.  The thumbnail is inlined as a
    data URI (and linked by `thumbnail_url` when given) only while retention
    still keeps it.
    """
    cur = conn.execute("SELECT frame_id, line, board_id, component, ts, received_at, status FROM frames "
                       "WHERE frame_id = ?", (frame_id,))
    row = cur.fetchone()
    if row is None:
        return None
    out = dict(zip([d[0] for d in cur.description], row))
    cur = conn.execute("SELECT * FROM verdicts WHERE frame_id = ?", (frame_id,))
    v = cur.fetchone()
    verdict = dict(zip([d[0] for d in cur.description], v)) if v else None
    if verdict is not None:
        _decode_columns(verdict)
        for k in ("frame_id", "component", "board_id"):
            verdict.pop(k, None)
    out["verdict"] = verdict
    cur = conn.execute("SELECT * FROM inferences WHERE frame_id = ? ORDER BY stage, id", (frame_id,))
    names = [d[0] for d in cur.description]
    steps = []
    for r in cur.fetchall():
        step = dict(zip(names, r))
        step.pop("frame_id", None)
        step.pop("id", None)
        try:
            step["output"] = json.loads(step["output"]) if step.get("output") else None
        except ValueError:
            pass   # kept as the text stored
        steps.append(step)
    out["steps"] = steps
    thumb = thumbnail(conn, frame_id)
    out["thumbnail"] = None if thumb is None else \
        f"data:{thumb[0]};base64,{base64.b64encode(thumb[1]).decode('ascii')}"
    out["thumbnail_url"] = thumbnail_url if thumb is not None else None
    return out


def thumbnail(conn: sqlite3.Connection, frame_id: str) -> tuple[str, bytes] | None:
    """(mime type, bytes) of a frame's thumbnail, or None (not a defect, or pruned by retention)."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='thumbnails'").fetchone():
        return None
    row = conn.execute("SELECT mime, data FROM thumbnails WHERE frame_id = ?", (frame_id,)).fetchone()
    return (row[0], bytes(row[1])) if row else None
