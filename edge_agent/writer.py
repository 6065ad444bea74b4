"""The result writer: batches rows into SQLite transactions, then publishes verdicts.

A verdict is published only after the transaction that stores it commits, so a
subscriber never sees a verdict the database could lose.  It owns the PUB
socket from the moment its thread starts (ZeroMQ sockets are single-threaded).
"""
from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq

from storage.results import GiveUp, ResultStore, RowFault, retry_write

log = logging.getLogger(__name__)
PRUNE_SLICE_S = 0.2   # retention steps in a row while no row waits: then the loop checks its queue again


@dataclass
class _Pending:
    inferences: list[dict] = field(default_factory=list)
    verdicts: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    thumbnails: list[dict] = field(default_factory=list)
    thumb_of: dict[int, dict] = field(default_factory=dict)   # id(verdict row) -> its thumbnail

    def __len__(self) -> int:
        return len(self.inferences) + len(self.verdicts) + len(self.errors) + len(self.events) + len(self.thumbnails)


class ResultWriter:
    """Single consumer of result rows; call `put_*` from any thread."""

    def __init__(self, db_path: str, pub: zmq.Socket, line: str, *, batch_rows: int = 512,
                 flush_ms: float = 50.0, on_committed: Callable[[list[dict], set[str]], None] | None = None,
                 retention_days: float | None = None, keep_verdicts: bool = True,
                 retention_interval: float = 3600.0, keep_thumbnails: int | None = None,
                 first_prune_s: float = 5.0) -> None:
        self._db_path, self._pub, self._line = db_path, pub, line.encode()
        self._batch_rows, self._flush_s = batch_rows, flush_ms / 1000.0
        self._q: queue.Queue = queue.Queue()
        self._on_committed = on_committed or (lambda rows, stored: None)
        self._thread = threading.Thread(target=self._loop, name="result-writer", daemon=True)
        self._stop = threading.Event()
        self._retention = (retention_days, keep_verdicts, retention_interval)
        self._keep_thumbnails = keep_thumbnails
        self._next_prune = time.monotonic() + first_prune_s   # first prune soon after start, then every interval
        self.pruned: dict[str, int] = {}
        self._pruning: Iterator[tuple[str, int]] | None = None   # the retention prune under way, a step at a time
        self._pruning_got: dict[str, int] = {}
        self.failures = 0
        self.gave_up = 0
        self.set_aside = 0        # rows no write could store while the rows beside them went in (`_write_apart`)
        self.failing_since: float | None = None   # monotonic start of the current run of failed writes
        self.last_failure = ""                     # why the latest write failed (the health reason names it)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def put_inference(self, row: dict) -> None:
        self._q.put(("inferences", row))

    def put_verdict(self, row: dict, thumbnail: dict | None = None) -> None:
        """A verdict, with a defect's thumbnail (`frame_id`, `mime`, `data`, `at`) when there is one.

        Both commit in one transaction, so a verdict the page lists always has
        its thumbnail, and retention prunes the thumbnail with the other rows.
        """
        self._q.put(("verdicts", row) if thumbnail is None else ("verdict+thumbnail", (row, thumbnail)))

    def put_error(self, row: dict) -> None:
        self._q.put(("errors", row))

    def put_event(self, row: dict) -> None:
        self._q.put(("events", row))

    def stop(self, timeout: float = 30.0) -> None:
        """Flush everything queued so far, then end the thread."""
        self._stop.set()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stalled(self, now: float | None = None) -> float:
        """Seconds the writes have failed without one succeeding (0.0 while they succeed).

        Verdicts wait in memory and their frames stay journaled while it
        retries, so nothing is lost; but a database that stays unwritable (a
        full disk, a read-only mount, a corrupt file) needs an operator, and
        the agent's health says so instead of only counting retries.
        """
        since = self.failing_since
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since

    def _loop(self) -> None:
        store = None
        try:
            # opened here, inside the try: a database locked or unwritable at start is recorded as why the
            # writer stopped (the agent's health names it), not a thread that ends without a word
            store = ResultStore(self._db_path, synchronous="FULL")  # a published verdict survives a power cut
            while True:
                pending = _Pending()
                deadline = time.monotonic() + self._flush_s
                while len(pending) < self._batch_rows:
                    left = deadline - time.monotonic()
                    try:
                        kind, row = self._q.get(timeout=max(left, 0.0)) if left > 0 else self._q.get_nowait()
                    except queue.Empty:
                        break
                    if kind == "verdict+thumbnail":
                        pending.verdicts.append(row[0])
                        pending.thumbnails.append(row[1])
                        pending.thumb_of[id(row[0])] = row[1]
                    else:
                        getattr(pending, kind).append(row)
                if pending:
                    self._flush(store, pending)
                elif self._stop.is_set() and self._q.empty():
                    return
                self._maybe_prune(store)
        except BaseException as exc:
            self.error = exc
            log.exception("result writer stopped on an unexpected error")
            raise
        finally:
            if self._pruning is not None:       # each step committed on its own: nothing to undo
                self._pruning.close()
            if store is not None:
                store.close()
            self._pub.close(linger=1000)

    def _maybe_prune(self, store: ResultStore) -> None:
        """Run retention a step at a time between flushes (`ResultStore.prune_steps`).

        A prune of a large backlog takes seconds; run whole, it held every
        verdict behind it unstored and unpublished.  Here steps run only while
        no row waits, and at most one step (one short transaction) when rows do,
        so a verdict waits for at most one step.
        """
        days, keep, interval = self._retention
        if self._pruning is None:
            if days is None or time.monotonic() < self._next_prune:
                return
            self._next_prune = time.monotonic() + interval
            self._pruning = store.prune_steps(time.time() - days * 86400, keep_verdicts=keep)
            self._pruning_got = {}
        until = time.monotonic() + PRUNE_SLICE_S
        try:
            while True:
                table, n = next(self._pruning)
                if table:
                    self._pruning_got[table] = self._pruning_got.get(table, 0) + n
                    self.pruned[table] = self.pruned.get(table, 0) + n
                if not self._q.empty() or time.monotonic() >= until:
                    return
        except StopIteration:
            pass
        except Exception as exc:  # noqa: BLE001 - retention is housekeeping; serving goes on
            log.error("retention prune failed: %s", exc)
        got, self._pruning = self._pruning_got, None
        if any(got.values()):
            log.info("retention: pruned %s", ", ".join(f"{v} {k}" for k, v in got.items() if v))

    def _write(self, store: ResultStore, p: _Pending) -> set[str]:
        return set(store.write(inferences=p.inferences, verdicts=p.verdicts, errors=p.errors, events=p.events,
                               thumbnails=p.thumbnails, keep_thumbnails=self._keep_thumbnails))

    def _failed(self, exc: BaseException) -> str:
        """Count a failed write; the reason, clipped, as the health and the log give it."""
        why = _clip(f"{type(exc).__name__}: {exc}")
        if self.failing_since is None:      # set before the count: whoever sees the count sees the reason
            self.failing_since = time.monotonic()
        self.last_failure = why
        self.failures += 1
        return why

    def _flush(self, store: ResultStore, p: _Pending) -> None:
        # one verdict per frame: the store keeps a frame's first row, so only that one is written, published
        # and reported (a second row for a frame in the same flush would otherwise go out on PUB beside the first)
        first, seen = [], set()
        for v in p.verdicts:
            if v["frame_id"] not in seen:
                seen.add(v["frame_id"])
                first.append(v)
        if len(first) < len(p.verdicts):
            log.error("%d second verdict(s) for frames in one flush were not stored or published: a bug upstream",
                      len(p.verdicts) - len(first))
            keep = {id(v) for v in first}
            p.thumb_of = {k: t for k, t in p.thumb_of.items() if k in keep}
            p.thumbnails = list(p.thumb_of.values())
            p.verdicts = first
        handled = p.verdicts             # the verdicts this flush settles, each stored or not (journaled)
        try:
            stored = self._write_unit(store, p, row_tries=ROW_FAULT_TRIES)
        except GiveUp as gone:
            # stopping: the frames stay journaled without a verdict and are re-run at next start
            log.error("result write failed while stopping; giving up on %d verdict(s), they are re-run from the "
                      "journal at next start: %s", len(p.verdicts), gone)
            self.gave_up += len(p.verdicts)
            return
        except RowFault:
            stored, handled = self._write_apart(store, p)
        for v in handled:
            if v["frame_id"] not in stored:
                continue
            msg = dict(v)
            msg["chain"] = json.loads(msg["chain"]) if msg.get("chain") else []
            msg["line"] = self._line.decode()
            try:
                self._pub.send_multipart([self._line, json.dumps(msg).encode()], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # PUB never blocks; a slow subscriber misses messages, the database has them all
        try:
            self._on_committed(handled, stored)   # a verdict not in `stored` leaves the in-flight set either way
        except Exception:  # noqa: BLE001 - bookkeeping after a commit must not stop the writer
            log.exception("after-commit callback failed")

    def _write_unit(self, store: ResultStore, unit: _Pending, *, row_tries: int) -> set[str]:
        """Write `unit`, waiting out the database's own faults (`storage.results.retry_write`): `RowFault` once
        its rows failed `row_tries` times, `GiveUp` when the writer is stopping and the database still fails."""
        def failed(attempt: int, exc: BaseException) -> str:
            why = self._failed(exc)
            log.error("result write failed (attempt %d), retrying: %s", attempt, why)
            return why
        stored = retry_write(lambda: self._write(store, unit), row_tries=row_tries, stopping=self._stop.is_set,
                             failed=failed)
        self.failing_since = None
        return stored

    def _write_apart(self, store: ResultStore, p: _Pending) -> tuple[set[str], list[dict]]:
        """A batch whose rows the schema refuses, written a row at a time: (stored ids, verdicts it settles).

        The rows that go in are stored; the ones that fail on their own (a
        column or value the schema refuses: a bug upstream) are set aside,
        named in the log and the errors table, so they stop blocking every
        row queued behind them.  A verdict whose thumbnail is the bad part is
        stored without it.  A set-aside verdict is replaced by an error verdict
        naming why, so its frame still has exactly one verdict now (`p.verdicts`
        is updated in place); only if even that is refused does the frame stay
        journaled, to be re-run at the next start.  A set-aside inference,
        error or event row is dropped (bookkeeping, not journaled).  A database
        fault meanwhile is waited out on that row, never retried whole (rows
        already in would go in twice).  Stopping, the verdicts not yet written
        are left out of what it settles: they stay in flight and journaled.
        """
        units = ([_Pending(verdicts=[v], thumbnails=[p.thumb_of[id(v)]] if id(v) in p.thumb_of else [])
                  for v in p.verdicts]
                 + [_Pending(inferences=[r]) for r in p.inferences] + [_Pending(errors=[r]) for r in p.errors]
                 + [_Pending(events=[r]) for r in p.events])
        stored: set[str] = set()
        handled: list[dict] = []
        notes = []
        for n, u in enumerate(units):
            try:
                why = self._write_apart_unit(store, u, stored)
                if why is None:
                    handled += u.verdicts
                    continue
                kind = next(k for k in ("verdicts", "inferences", "errors", "events") if getattr(u, k))
                row = getattr(u, kind)[0]
                what = (f"expert {row.get('expert_id')}" if kind == "events" else f"frame {row.get('frame_id')}")
                self.set_aside += 1
                instead = "; the row is dropped"
                if kind == "verdicts":
                    notes.append({"frame_id": row.get("frame_id"), "kind": "unstorable_verdict",
                                  "message": f"its verdict row could not be stored: {why}", "at": time.time()})
                    plain = self._plain_error(store, row, why)
                    if plain is not None:
                        stored.add(plain["frame_id"])
                        p.verdicts[next(i for i, v in enumerate(p.verdicts) if v is row)] = plain
                        row = plain
                        instead = "; the frame got an error verdict naming why instead"
                    else:
                        instead = "; the frame stays journaled and is re-run at next start"
                    handled.append(row)
                log.error("%s row for %s could not be stored and was set aside (%s); the rows beside it were "
                          "stored%s", _ROW_NAMES[kind], what, why, instead)
            except GiveUp as gone:
                left = sum(len(x.verdicts) for x in units[n:])
                log.error("result write failed while stopping; giving up on %d verdict(s), they are re-run from the "
                          "journal at next start: %s", left, gone)
                self.gave_up += left
                break
        if notes:
            try:
                self._write_unit(store, _Pending(errors=notes), row_tries=1)
            except (RowFault, GiveUp):
                log.error("recording the set-aside verdicts in the errors table failed; the log above names them")
        return stored, handled

    def _write_apart_unit(self, store: ResultStore, u: _Pending, stored: set[str]) -> str | None:
        """Write one unit (a verdict without its thumbnail if that is what fails): None, or why it cannot be."""
        try:
            stored |= self._write_unit(store, u, row_tries=1)
            return None
        except RowFault as fault:
            if not u.thumbnails:
                return str(fault)
            try:
                stored |= self._write_unit(store, _Pending(verdicts=u.verdicts), row_tries=1)
            except RowFault as again:
                return str(again)
            log.error("the thumbnail of frame %s could not be stored (%s); its verdict was, without it",
                      u.verdicts[0].get("frame_id"), fault)
            return None

    def _plain_error(self, store: ResultStore, row: dict, why: str) -> dict | None:
        """An error verdict in place of `row`, of nothing but safe values; the row if it was stored, else None.

        Raises `GiveUp` when stopping (the frame then stays in flight and journaled)."""
        fid = row.get("frame_id")
        if not isinstance(fid, str):
            return None
        latency = row.get("latency_ms")
        latency = float(latency) if isinstance(latency, (int, float)) and not isinstance(latency, bool) \
            and math.isfinite(latency) else 0.0
        plain = {"frame_id": fid, "verdict": "error", "reason": _clip(f"its verdict could not be stored: {why}"),
                 "decided_at": time.time(), "latency_ms": latency, "chain": "[]"}
        try:
            return plain if fid in self._write_unit(store, _Pending(verdicts=[plain]), row_tries=1) else None
        except RowFault:
            log.exception("an error verdict for frame %s could not be stored either", fid)
            return None


ROW_FAULT_TRIES = 3    # whole-batch attempts before a row fault splits it (a unit alone: one)
_ROW_NAMES = {"verdicts": "a verdict", "inferences": "an inference", "errors": "an error", "events": "an event"}

def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."
