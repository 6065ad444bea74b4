"""Ingest: the ROUTER socket loop.  Validate, journal, ack, then hand frames on.

The order is the guarantee: a frame is acked `accepted` only after the
transaction that journals it commits.  A frame that fails any check is acked
`rejected` with a reason code and leaves a row in `errors`; nothing about it
touches any other frame of the same read.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from coe import Frame
from routing import RouteError
from storage.results import CONFLICT, JournalEntry, RowFault, payload_sha256, retry_write

from . import protocol as P
from .metrics import Metrics

log = logging.getLogger(__name__)

MAX_READ = 256
ROW_FAULT_TRIES = 3    # whole-read journal attempts before a row fault splits the read frame by frame


@dataclass
class Accepted:
    """A frame that passed every check, with where its chain starts."""

    frame: Frame
    expert_id: str | None      # None until a learned router has looked at the image
    header_json: str
    payload: bytes


def check_frame(parts: list[bytes], *, line: str, router, max_payload: int) -> Accepted:
    """All checks on one `[header, payload]` message; raises protocol.Reject.

    A rule router routes here, from the header, before the image is decoded.
    A learned router (`needs_image`) routes later, one batch per ingest read.
    """
    if len(parts) != 2:
        fid = _sniff_frame_id(parts[0]) if parts else ""
        raise P.Reject(P.BAD_FRAMING, f"expected 2 message parts [header, payload], got {len(parts)}", fid)
    raw_header, payload = parts
    learned = getattr(router, "needs_image", False)
    header = P.parse_header(raw_header, require_component=not learned)
    if len(payload) > max_payload:
        raise P.Reject(P.OVERSIZE, f"payload is {len(payload)} bytes, limit {max_payload}", header.frame_id)
    if header.line != line:
        raise P.Reject(P.WRONG_LINE, f"frame is for line '{header.line}', this agent serves line '{line}'",
                       header.frame_id)
    expert_id = None
    if not learned:
        try:
            expert_id = router.route(header.component).expert_id
        except RouteError as exc:
            raise P.Reject(exc.reason, exc.detail, header.frame_id) from None
    image = P.decode_image(header, payload)
    frame = Frame(frame_id=header.frame_id, line=header.line, board_id=header.board_id,
                  component=header.component or "", ts=header.ts, image=image, received_at=time.time())
    return Accepted(frame, expert_id, json.dumps(header.to_json()), payload)


def route_learned(router, checked: list) -> None:
    """Route every not-yet-routed frame of a read in one forward pass; misroutes become rejects."""
    todo = [i for i, (_, c) in enumerate(checked) if isinstance(c, Accepted) and c.expert_id is None]
    if not todo:
        return
    frames = [checked[i][1].frame for i in todo]
    try:
        routes = router.route_batch([f.component or None for f in frames], [f.image for f in frames])
    except Exception as exc:  # noqa: BLE001 - a router failure rejects this read's frames, never loses them
        log.exception("learned router failed on a read of %d frames; routing them one by one", len(todo))
        routes = _route_alone(router, frames, exc)
    for i, frame, route in zip(todo, frames, routes):
        identity, acc = checked[i]
        if isinstance(route, RouteError):
            checked[i] = (identity, P.Reject(route.reason, route.detail, frame.frame_id))
        else:
            acc.expert_id = route.expert_id
            header = router.model.components.get(acc.frame.component or "")
            if header is None or header.classifier != route.expert_id:
                # no header type, or the network, sure enough, overrode it: the records name the type whose
                # classifier judged the frame (for queries, probabilities and recovery); a header type whose
                # classifier was used (shared by several types, say) stays as the header said
                routed = getattr(route, "component", None) or _component_of(router.model, route.expert_id)
                if header is not None:
                    log.debug("frame %s: the header says %s, the learned router (%.2f) says %s", frame.frame_id,
                              acc.frame.component, route.confidence, routed)
                if routed:
                    acc.frame.component = routed


def _route_alone(router, frames: list, exc: BaseException) -> list:
    """Each frame routed on its own after the read's pass failed: one frame that breaks the router is rejected as
    a bad image; if every frame fails, the router is at fault, not the frames, and all get 'busy' (retryable)."""
    routes, failed = [], []
    for f in frames:
        try:
            routes.append(router.route_batch([f.component or None], [f.image])[0])
        except Exception as one:  # noqa: BLE001 - decided below: this frame's fault, or the router's
            routes.append(None)
            failed.append(f"{type(one).__name__}: {one}")
    if len(failed) == len(frames):
        return [RouteError(P.BUSY, f"the learned router failed ({type(exc).__name__}: {exc}); retry with backoff")
                for _ in frames]
    it = iter(failed)
    return [r if r is not None else RouteError(P.BAD_IMAGE, f"the learned router cannot take this image ({next(it)})")
            for r in routes]


def _component_of(model, expert_id: str) -> str:
    return next((c.name for c in model.components.values() if c.classifier == expert_id), "")


def _conflict(fid: str, sha: str | None, parts: list[bytes]) -> P.Reject | None:
    """A reject when `fid` was accepted with other payload bytes than this message's (a reused id: an AOI
    counter reset); None for a resend (the same bytes, or a frame accepted before hashes were kept)."""
    if sha is None or len(parts) != 2 or payload_sha256(parts[1]) == sha:
        return None
    return _id_conflict(fid)


def _id_conflict(fid: str) -> P.Reject:
    return P.Reject(P.ID_CONFLICT, f"frame_id '{fid}' was accepted before with other image bytes: this is another "
                                   "frame, send it under a new frame_id", fid)


def _sniff_frame_id(raw: bytes) -> str:
    """The header's frame_id if it is one a frame could have been accepted with, else "" (for naming and lookup).

    Bytes past the header limit are not parsed: a message of any size would
    otherwise be JSON-decoded here before its checks refuse it."""
    if len(raw) > P.MAX_HEADER_BYTES:
        return ""
    try:
        obj = json.loads(raw.decode("utf-8"))
        fid = obj.get("frame_id") if isinstance(obj, dict) else None
        if not isinstance(fid, str) or not 0 < len(fid) <= P.MAX_ID_LEN:
            return ""
        fid.encode("utf-8")
        return fid
    except (UnicodeError, ValueError, RecursionError):
        return ""


SLOW_WRITE_S = 1.0   # a journal write still waiting after this long counts as stalled (normal ones take ms)


class Ingest:
    """Owns the ROUTER socket from `start()` on; everything else talks to it through callbacks."""

    def __init__(self, sock: zmq.Socket, store, *, line: str, router, max_payload: int, metrics: Metrics,
                 on_accepted: Callable[[list[Accepted]], None], free_slots: Callable[[], int]) -> None:
        self.sock, self.store, self.line, self.router = sock, store, line, router
        self.max_payload, self.metrics = max_payload, metrics
        self._on_accepted, self._free_slots = on_accepted, free_slots
        self._stop = threading.Event()
        self.failing_since: float | None = None   # monotonic start of the current run of failed journal writes
        self._writing_since: float | None = None  # a journal write under way since (`stalled`)
        self.last_failure = ""
        self._thread = threading.Thread(target=self._loop, name="ingest", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                msgs = []
                while len(msgs) < MAX_READ:
                    try:
                        msgs.append(self.sock.recv_multipart(flags=zmq.NOBLOCK))
                    except zmq.Again:
                        break
                self.handle(msgs)
        except Exception as exc:  # noqa: BLE001 - record why ingest died; the agent reports it
            self.error = exc
            log.exception("ingest stopped on an unexpected error")
        finally:
            self.sock.close(linger=1000)

    def handle(self, msgs: list[list[bytes]]) -> None:
        """Check, journal and ack one read of messages."""
        now = time.time()
        self.metrics.frames_received.inc(len(msgs))
        # a frame already accepted (a resend after a lost ack, maybe across a restart or a config change) is a
        # duplicate before anything else: not decoded, routed or answered with a check it might fail now
        sniffed = [_sniff_frame_id(m[1]) if len(m) > 1 else "" for m in msgs]
        known = self._known(sniffed)
        checked: list[tuple[bytes, Accepted | P.Reject | str]] = []
        for msg, fid in zip(msgs, sniffed):
            identity, parts = msg[0], msg[1:]
            if fid and fid in known:
                conflict = _conflict(fid, known[fid], parts)
                checked.append((identity, conflict or fid))     # a str: the id of a frame accepted before
                continue
            try:
                checked.append((identity, check_frame(parts, line=self.line, router=self.router,
                                                      max_payload=self.max_payload)))
            except P.Reject as rej:
                checked.append((identity, rej))
            except Exception as exc:  # noqa: BLE001 - a message we failed to foresee is still only a reject
                log.exception("unexpected error checking a message; rejecting it")
                checked.append((identity, P.Reject(P.BAD_FIELD, f"unreadable message ({type(exc).__name__})", fid)))
        if getattr(self.router, "needs_image", False):
            route_learned(self.router, checked)
        # backpressure: frames beyond the free in-flight slots are not journaled but acked 'busy',
        # so memory stays bounded and the client knows to retry with backoff (docs/protocol.md)
        slots = self._free_slots()
        for i, (identity, c) in enumerate(checked):
            if isinstance(c, Accepted):
                if slots > 0:
                    slots -= 1
                else:
                    checked[i] = (identity, P.Reject(P.BUSY, f"agent saturated ({self._free_slots()} free "
                                                             "in-flight slots); retry with backoff", c.frame.frame_id))
        good = [c for _, c in checked if isinstance(c, Accepted)]
        errors = [{"frame_id": c.frame_id or None, "kind": f"reject:{c.reason}", "message": c.detail, "at": now}
                  for _, c in checked if isinstance(c, P.Reject)]
        entries = [JournalEntry(a.frame.frame_id, a.frame.line, a.frame.board_id, a.frame.component or None,
                                a.frame.ts, a.frame.received_at, a.header_json, a.payload) for a in good]
        fresh = self._journal(entries, errors)
        accepted = [a for a, f in zip(good, fresh) if f is True]   # journaled: the agent's from here, whatever follows
        conflicts = [{"frame_id": a.frame.frame_id, "kind": f"reject:{P.ID_CONFLICT}", "at": now,
                      "message": _id_conflict(a.frame.frame_id).detail}
                     for a, f in zip(good, fresh) if f == CONFLICT]
        if conflicts:          # found by the journal itself (the same read, or a lookup that failed): on record too
            self._journal_apart([], conflicts)
        try:
            fresh_of = {id(a): f for a, f in zip(good, fresh)}
            for identity, c in checked:
                if isinstance(c, str):
                    kind, ack = P.DUPLICATE, P.ack(c, P.DUPLICATE, "frame_id already accepted")
                elif isinstance(c, P.Reject):
                    kind, ack = c.reason, P.ack(c.frame_id, P.REJECTED, c.ack_detail)
                elif fresh_of[id(c)] is None:
                    rej = P.Reject(P.BAD_FIELD, "the journal cannot store this frame (see the agent's log)",
                                   c.frame.frame_id)
                    kind, ack = rej.reason, P.ack(rej.frame_id, P.REJECTED, rej.ack_detail)
                elif fresh_of[id(c)] == CONFLICT:     # the journal found the id taken by other bytes
                    rej = _id_conflict(c.frame.frame_id)
                    kind, ack = rej.reason, P.ack(rej.frame_id, P.REJECTED, rej.ack_detail)
                elif fresh_of[id(c)]:
                    kind, ack = P.ACCEPTED, P.ack(c.frame.frame_id, P.ACCEPTED, "")
                else:
                    kind, ack = P.DUPLICATE, P.ack(c.frame.frame_id, P.DUPLICATE, "frame_id already accepted")
                if kind == P.ACCEPTED:
                    self.metrics.frames_accepted.inc()
                elif kind == P.DUPLICATE:
                    self.metrics.duplicates.inc()
                else:
                    self.metrics.reject(kind)
                self._send(identity, ack)
        finally:   # journaled frames go to the agent whatever an ack's send or a metric did: none waits for a restart
            if accepted:
                self._on_accepted(accepted)

    def _known(self, ids: list[str]) -> dict[str, str | None]:
        """Which of `ids` the journal has accepted before, with their payload hashes (empty if it cannot say:
        the journal decides then)."""
        ids = [i for i in ids if i]
        if not ids:
            return {}
        try:
            return self.store.known_ids(ids)
        except Exception as exc:  # noqa: BLE001 - a busy database: the journal's own check still catches duplicates
            log.warning("looking up %d frame id(s) before checking them failed: %s", len(ids), exc)
            return {}

    def _journal(self, entries, errors) -> list[bool | str | None]:
        """Journal with retries: nothing is acked until this commits, so waiting is always safe.

        Per entry: True (fresh), False (a duplicate), `CONFLICT`, or None: a
        frame no write can store while the database itself is fine (a row
        fault three times running), which is rejected by name instead of
        blocking every client behind it.
        """
        try:
            return self._retrying(lambda: self.store.journal(entries, errors), ROW_FAULT_TRIES,
                                  "journal write failed (attempt %d), retrying; no frame of this read is acked: %s")
        except RowFault:
            return self._journal_apart(entries, errors)

    def _retrying(self, call, row_tries: int, message: str):
        def failed(attempt: int, exc: BaseException) -> str:
            log.error(message, attempt, exc)
            why = f"{type(exc).__name__}: {exc}"
            if self.failing_since is None:   # from when the write began: a lock waited out 30 s before it failed
                self.failing_since = self._writing_since or time.monotonic()
            self.last_failure = why[:300]
            return why
        self._writing_since = time.monotonic()
        try:
            got = retry_write(call, row_tries=row_tries, stopping=self._stop.is_set, failed=failed)
        finally:
            self._writing_since = None
        self.failing_since = None
        return got

    def stalled(self) -> float:
        """Seconds the journal has not taken a read's frames: failed writes without one succeeding, or one write
        still waiting (a lock another process holds keeps a write waiting out SQLite's busy timeout before it
        even fails).  0.0 while writes go in.  No frame is acked meanwhile, and with nothing accepted the
        result writer has nothing to fail on, so the agent's health asks here too."""
        now = time.monotonic()
        if self.failing_since is not None:
            return now - self.failing_since
        writing = self._writing_since
        waited = 0.0 if writing is None else now - writing
        return waited if waited >= SLOW_WRITE_S else 0.0

    def stall_reason(self) -> str:
        return self.last_failure or "a write is still waiting for the database (locked by another process?)"

    def _journal_apart(self, entries, errors) -> list[bool | str | None]:
        """A read the journal keeps refusing on its rows: each frame alone, each errors row alone.

        A database fault meanwhile is waited out on that one row (never a whole
        retry: frames journaled already would then read as duplicates, acked
        but never handed to the agent)."""
        out: list[bool | str | None] = []
        for entry in entries:
            out.append(self._journal_one([entry], [], f"frame {P.printable(entry.frame_id)}"))
        for row in errors:
            self._journal_one([], [row], f"the errors row for frame {P.printable(str(row.get('frame_id')))}")
        return out

    def _journal_one(self, entries, errors, what: str) -> bool | str | None:
        try:
            got = self._retrying(lambda: self.store.journal(entries, errors), 1,
                                 f"{what}: journal write failed (attempt %d): %s")
            return got[0] if got else True
        except RowFault as fault:
            log.error("%s cannot be journaled (%s); %s", what, fault, "it is rejected" if entries else
                      "the row is dropped")
            if entries:     # its reject is on record too, as every reject is (docs/protocol.md)
                self._journal_one([], [{"frame_id": P.printable(entries[0].frame_id),
                                        "kind": f"reject:{P.BAD_FIELD}", "at": time.time(),
                                        "message": P.printable(f"the journal cannot store this frame: {fault}")}],
                                  what + "'s reject")
            return None

    def _send(self, identity: bytes, ack: list[bytes]) -> None:
        try:
            self.sock.send_multipart([identity, *ack], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("ack for %s dropped: client not reading; it will resend and get 'duplicate'", ack[0])
