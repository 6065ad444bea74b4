"""The replay client against a scripted peer on real ZeroMQ (loopback): each frame is counted once, and a deadline
that comes first leaves no frame out of the report."""
from __future__ import annotations

import json
import threading
import time

import zmq

from edge_agent import protocol as P
from edge_agent.replay import send_messages

HEADER = {"v": 1, "line": "T", "board_id": "b", "component": "R0402", "ts": 0.0, "encoding": "raw",
          "shape": [1, 1, 3]}


def _messages(n: int) -> list[tuple[str, list[bytes]]]:
    return [(f"f{i}", [P.encode_header({**HEADER, "frame_id": f"f{i}"}), b"\0\0\0"]) for i in range(n)]


class _Peer:
    """A ROUTER on a random loopback port whose `answer(fid, copy, reply)` decides what each copy gets."""

    def __init__(self, answer) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.copies: dict[str, int] = {}
        self._stop = threading.Event()
        self._answer = answer
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(10):
                self._answer(None, 0, None)
                continue
            peer, *parts = self.router.recv_multipart()
            fid = json.loads(parts[0])["frame_id"]
            self.copies[fid] = self.copies.get(fid, 0) + 1
            self._answer(fid, self.copies[fid], lambda f, status, detail="": self.router.send_multipart(
                [peer, f.encode(), status.encode(), detail.encode()]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.router.close(linger=0)
        self.ctx.term()


def test_a_stale_busy_for_a_copy_whose_next_copy_was_accepted_sends_the_frame_no_more():
    """f0's first copy is answered 'busy' only after its resend was: then the resend's 'accepted' comes.  The
    frame is done; the client must not send it a third time (which the agent would answer 'duplicate', and the
    report would count twice).  f1's answer comes late, so the client is still running when the backoff is due."""
    held = {}
    start = time.monotonic()

    def answer(fid, copy, reply):
        if fid == "f0" and copy == 1:
            held["f0"] = reply                                  # no answer yet
        elif fid == "f0" and copy == 2:
            reply("f0", P.REJECTED, "busy: agent saturated")      # the first copy's answer, late
            reply("f0", P.ACCEPTED)
        elif fid == "f0":
            reply("f0", P.DUPLICATE)
        elif fid == "f1":
            held["f1"] = reply
        if "f1" in held and time.monotonic() - start > 2.5:
            held.pop("f1")("f1", P.ACCEPTED)

    peer = _Peer(answer)
    try:
        report = send_messages(_messages(2), peer.endpoint, ack_timeout=0.5, deadline=30)
    finally:
        peer.close()
    assert report.accepted == 2 and report.duplicate == 0 and report.unacked == []
    assert peer.copies["f0"] == 2


def test_frames_the_deadline_came_before_are_reported_unacked_and_unsent():
    peer = _Peer(lambda fid, copy, reply: reply(fid, P.ACCEPTED) if fid else None)
    try:
        report = send_messages(_messages(50), peer.endpoint, rate=10, deadline=2.0)
    finally:
        peer.close()
    assert 0 < report.accepted < 50
    assert report.accepted + len(report.unacked) == 50 and report.unsent == 50 - report.sent > 0
    assert report.to_json()["unsent"] == report.unsent
