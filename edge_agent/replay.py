"""The replay client: send a recording to an agent over DEALER, exactly as an AOI machine would.

It keeps a window of unacked frames, resends any frame whose ack does not come
within `ack_timeout`, and counts the first ack of each frame.  A resent frame
that the agent had already accepted comes back `duplicate`, which is still a
delivered frame: at-least-once delivery, effectively-once verdicts.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq

from storage.recording import Recording

from . import protocol as P

log = logging.getLogger(__name__)
SILENT_WARN_S = 10.0   # no answer at all for this long: one warning (the wait goes on to the deadline)


@dataclass
class ReplayReport:
    sent: int = 0
    resent: int = 0
    accepted: int = 0
    duplicate: int = 0
    rejected: int = 0
    busy: int = 0                 # 'busy' answers; those frames were resent after a backoff
    unmatched_rejects: int = 0
    reasons: Counter = field(default_factory=Counter)
    rejected_ids: list[str] = field(default_factory=list)
    unacked: list[str] = field(default_factory=list)   # every frame without an ack, the never-sent ones included
    unsent: int = 0               # frames the deadline came before they were sent at all (counted in `unacked`)
    seconds: float = 0.0
    malformed_acks: int = 0       # answers that were not (frame id, status, detail) with a known status: not counted
    malformed: list[str] = field(default_factory=list)   # the first few, described (frame id and what was wrong)

    @property
    def acked(self) -> int:
        return self.accepted + self.duplicate + self.rejected

    def to_json(self) -> dict:
        return {"sent": self.sent, "resent": self.resent, "accepted": self.accepted, "duplicate": self.duplicate,
                "rejected": self.rejected, "busy": self.busy, "reasons": dict(self.reasons), "unacked": len(self.unacked),
                "unsent": self.unsent, "malformed_acks": self.malformed_acks, "seconds": round(self.seconds, 3)}


def recording_messages(rec: Recording) -> Iterable[tuple[str, list[bytes]]]:
    for fr in rec:
        yield fr.header["frame_id"], [P.encode_header(fr.header), rec.payload(fr)]


def send_messages(messages: Iterable[tuple[str, list[bytes]]], endpoint: str, *, rate: float | None = None,
                  window: int = 256, ack_timeout: float = 10.0, deadline: float = 600.0,
                  ctx: zmq.Context | None = None, progress: Callable[[ReplayReport], None] | None = None,
                  socket_setup: Callable[[zmq.Socket], None] | None = None,
                  silent_warn_s: float = SILENT_WARN_S) -> ReplayReport:
    """Send `(frame_id, parts)` messages, wait for every ack, resend what was not acked.

    If nothing at all has answered after `silent_warn_s` (no agent at the
    endpoint, a CURVE key it refuses), one warning says so: the wait goes on
    until `deadline` (an agent may still be starting), but not in silence.
    """
    own_ctx = ctx is None
    ctx = ctx or zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if socket_setup:
        socket_setup(sock)
    sock.connect(endpoint)
    report = ReplayReport()
    source = iter(messages)
    inflight: dict[str, tuple[float, list[bytes]]] = {}
    backoff: dict[str, tuple[float, list[bytes]]] = {}   # 'busy' frames waiting for their retry
    tries: dict[str, int] = {}
    done: set[str] = set()
    repeats: dict[str, list[float]] = {}    # a repeated id's extra copies: when each stops being waited for
    t0 = time.monotonic()
    interval = 1.0 / rate if rate else 0.0
    next_send = t0
    exhausted = False
    stalled: tuple[str, list[bytes]] | None = None
    heard = warned = False
    try:
        while (not exhausted or inflight or stalled or _waiting(repeats)) and time.monotonic() - t0 < deadline:
            now = time.monotonic()
            if not heard and not warned and now - t0 > silent_warn_s:
                warned = True
                log.warning("nothing has answered at %s for %.0f s: is the agent running (and, with CURVE, is this "
                            "client's key allowed)? still trying until the deadline (%.0f s)", endpoint,
                            silent_warn_s, deadline)
            while not exhausted and len(inflight) < window and now >= next_send:
                if stalled is None:
                    try:
                        stalled = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                fid, parts = stalled
                if not _send(sock, parts):
                    break          # no agent connected (yet): keep it and poll; the deadline still applies
                stalled = None
                report.sent += 1
                if fid in inflight or fid in done:
                    # a recording with a repeated id: its first ack counts; this copy's own answer is waited for
                    # (up to the ack timeout, not resent): `id_conflict` if its bytes differ (a counter reset)
                    repeats.setdefault(fid, []).append(now + ack_timeout)
                    continue
                inflight[fid] = (now, parts)
                if interval:
                    next_send = max(next_send + interval, now - 1.0)
                    now = time.monotonic()
            wait_ms = 50 if not interval or exhausted or stalled else \
                max(0, int((next_send - time.monotonic()) * 1000))
            if sock.poll(min(wait_ms, 50) if inflight else wait_ms, zmq.POLLIN):
                while True:
                    try:
                        msg = sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    heard = True
                    if _is_busy(msg, inflight):
                        fid = msg[0].decode("utf-8", "replace")
                        tries[fid] = tries.get(fid, 0) + 1
                        backoff[fid] = (time.monotonic() + min(0.05 * 2 ** tries[fid], 2.0), inflight[fid][1])
                        report.busy += 1
                        continue
                    _count_ack(msg, inflight, done, report, repeats)
            now = time.monotonic()
            for fid, (due, parts) in list(backoff.items()):
                if fid in done:        # a stale 'busy' for a copy whose later copy has been acked since
                    del backoff[fid]
                    continue
                if now >= due and _send(sock, parts):
                    del backoff[fid]
                    report.resent += 1
                    inflight[fid] = (now, parts)
            for fid, (sent_at, parts) in list(inflight.items()):
                if fid not in backoff and now - sent_at > ack_timeout and _send(sock, parts):
                    report.resent += 1
                    inflight[fid] = (now, parts)
            if progress:
                progress(report)
        report.unacked = sorted(inflight) + ([stalled[0]] if stalled else [])
        if not exhausted:      # the deadline came first: the frames never sent are not acked either
            unsent = [fid for fid, _ in itertools.islice(source, MAX_UNSENT)
                      if fid not in done and fid not in inflight]
            report.unsent = len(unsent) + (1 if stalled else 0)
            report.unacked += unsent
    finally:
        report.seconds = time.monotonic() - t0
        sock.close(linger=0)
        if own_ctx:
            ctx.term()
    return report


def _send(sock: zmq.Socket, parts: list[bytes]) -> bool:
    """Send without blocking: a DEALER with no connected agent would otherwise block forever."""
    try:
        sock.send_multipart(parts, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def _is_busy(msg: list[bytes], inflight: dict) -> bool:
    return (len(msg) == 3 and msg[1] == P.REJECTED.encode() and P.reason_of(msg[2].decode("utf-8", "replace")) == P.BUSY
            and msg[0].decode("utf-8", "replace") in inflight)


MALFORMED_SHOWN = 10
MAX_UNSENT = 1_000_000    # never-sent frames counted at a deadline (an endless source is not read to its end)
STATUSES = (P.ACCEPTED, P.DUPLICATE, P.REJECTED)


def _malformed(report: ReplayReport, what: str) -> None:
    """An answer that is not an ack: counted and described, never taken as one (its frame stays in flight and is
    sent again, which the agent answers as a duplicate if it had taken it)."""
    report.malformed_acks += 1
    if len(report.malformed) < MALFORMED_SHOWN:
        report.malformed.append(what)


def _waiting(repeats: dict[str, list[float]]) -> bool:
    """Whether some repeated id's copy is still waited for (its ack timeout not past)."""
    now = time.monotonic()
    for fid in list(repeats):
        repeats[fid] = [t for t in repeats[fid] if t > now]
        if not repeats[fid]:
            del repeats[fid]
    return bool(repeats)


def _count_ack(msg: list[bytes], inflight: dict, done: set, report: ReplayReport,
               repeats: dict[str, list[float]] | None = None) -> None:
    if len(msg) != 3:
        first = msg[0].decode("utf-8", "replace")[:P.MAX_ID_LEN] if msg else ""
        _malformed(report, f"an answer of {len(msg)} part(s), not 3 (first part {first!r})")
        return
    fid, status, detail = (m.decode("utf-8", "replace") for m in msg)
    if status not in STATUSES:
        _malformed(report, f"frame {fid!r}: unknown status {status[:40]!r} (known: {', '.join(STATUSES)})")
        return
    if fid not in inflight and len(fid) == P.MAX_ID_LEN:  # the agent cuts long ids in its acks
        fid = next((k for k in inflight if k.startswith(fid)), fid)
    if fid not in inflight and repeats and repeats.get(fid):
        repeats[fid].pop(0)
        if status == P.REJECTED and P.reason_of(detail) == P.ID_CONFLICT:
            # a second frame under an id of the recording's (a counter that reset): counted, it was not run
            report.rejected += 1
            report.reasons[P.ID_CONFLICT] += 1
            report.rejected_ids.append(fid)
        return
    if fid not in inflight:
        if fid == "" and status == P.REJECTED:  # no id could be read; counted, but cannot be matched
            report.unmatched_rejects += 1
            report.reasons[P.reason_of(detail)] += 1
        return  # late ack of a resent frame: its first ack already counted
    del inflight[fid]
    done.add(fid)
    if status == P.ACCEPTED:
        report.accepted += 1
    elif status == P.DUPLICATE:
        report.duplicate += 1
    else:
        report.rejected += 1
        report.reasons[P.reason_of(detail)] += 1
        report.rejected_ids.append(fid)


def replay(recording: Recording, endpoint: str, **kwargs) -> ReplayReport:
    """Send a whole recording (see `send_messages` for the options)."""
    return send_messages(recording_messages(recording), endpoint, **kwargs)
