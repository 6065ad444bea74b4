"""The batch channel between the front box and a remote executor's actor: ZeroMQ, beside Ray.

Ray places the actor, starts it, warms it, checks its health and says when
it died; batches do not need its task path.  A Ray call that waits on compute
costs 1.5-2 ms on loopback between processes that went idle (the reply goes
through the node's core worker and the caller's), which is most of a remote
executor's added latency (bench/cluster_overhead.py).  So the actor binds a
ZeroMQ ROUTER on its node's address, and the front sends each batch there as
one pickle and gets one pickle back: a request id, then the bytes.

Framing (the DEALER's parts; the ROUTER sees the peer's identity first):
a batch is `[id, payload]`, answered `[id, status, bytes]`; an echo is
`[id, ECHO, bytes]`, answered `[id, OK, the same bytes]` by the server's
thread itself, without the handler.  A ZeroMQ connect never fails (it
retries in the background), so the front echoes once when it connects
(`ChannelClient.echo`): a port the front cannot reach is named at start,
not found later as batches lost.

Failure stays Ray's to tell: while a batch is out, the client asks the actor
for a ping through Ray every `check_s`; a dead actor or node fails that ping
(ActorDiedError, node removed), which the caller treats as the batch lost, as
before.  A reply that comes after its request was given up (a timeout) has
an old id and is dropped, so a requeued batch's frames are never answered twice.

The channel has no authentication of its own, like Ray's ports: run the
cluster on the line's private network.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

ERROR = b"E"    # reply status: the handler raised; the payload is the message
OK = b"K"
ECHO = b"echo"  # a request's middle part: answer the payload as it came (the connect handshake)


class ChannelError(RuntimeError):
    """The actor answered with an error of its own (its handler raised): treated like a failed Ray call."""


class ChannelServer:
    """On the node: a thread answering each request with `handler(payload)`."""

    def __init__(self, handler: Callable[[bytes], bytes], host: str) -> None:
        self._handler = handler
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Serve until `close`; the socket is this thread's alone, so it is closed here, after the last answer
        (a handler still running when `close` gives up waiting finishes first, and its answer is dropped)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                parts = self._sock.recv_multipart(copy=False)
                if len(parts) == 4 and parts[2].bytes == ECHO:
                    ident, rid, _, payload = parts
                    self._sock.send_multipart([ident, rid, OK, payload], copy=False)
                    continue
                if len(parts) != 3:
                    log.warning("batch channel: dropped a malformed request of %d part(s)", len(parts))
                    continue
                ident, rid, payload = parts
                try:
                    status, out = OK, self._handler(payload.buffer)
                except Exception as exc:  # noqa: BLE001 - the front must hear why, not wait for a timeout
                    log.exception("batch channel: the request failed")
                    status, out = ERROR, f"{type(exc).__name__}: {exc}".encode()
                if not self._stop.is_set():
                    self._sock.send_multipart([ident, rid, status, out], copy=False)
        finally:
            self._sock.close(0)
            self._ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class ChannelClient:
    """On the front: one request at a time (an executor runs one batch at a time)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._next = 0
        self.stale = 0          # replies dropped because their request had been given up

    def echo(self, timeout: float) -> float:
        """One echo over the channel (the handshake when connecting): the round trip's seconds.

        Raises `TimeoutError` naming the endpoint when no answer comes within
        `timeout` (nothing listens there, or the port is blocked between the
        boxes: a ZeroMQ connect never says so), `ChannelError` when what comes
        back is not the echo.
        """
        self._next += 1
        rid = self._next.to_bytes(8, "big")
        nonce = os.urandom(8)
        start = time.monotonic()
        self._sock.send_multipart([rid, ECHO, nonce])
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0 or not self._sock.poll(max(1, int(1000 * left)), zmq.POLLIN):
                raise TimeoutError(f"no answer from {self.endpoint} to an echo in {timeout:g} s")
            parts = self._sock.recv_multipart()
            if len(parts) != 3 or parts[0] != rid:
                self.stale += 1
                continue
            if parts[1] != OK or parts[2] != nonce:
                raise ChannelError(f"{self.endpoint} answered the echo with something else "
                                   f"(status {parts[1]!r}, {len(parts[2])} B)")
            return time.monotonic() - start

    def call(self, payload: bytes, *, timeout: float, alive: Callable[[], None], check_s: float = 1.0) -> bytes:
        """Send `payload`, return the reply's bytes.

        `alive()` is called every `check_s` while waiting: it raises when the
        actor is known dead, and that exception ends the call.  Past `timeout`
        a `TimeoutError`.  A `ChannelError` carries the handler's own failure.
        """
        self._next += 1
        rid = self._next.to_bytes(8, "big")
        self._sock.send_multipart([rid, payload], copy=False)
        start = time.monotonic()
        last_check = start
        while True:
            now = time.monotonic()
            left = timeout - (now - start)
            if left <= 0:
                raise TimeoutError(f"no answer from {self.endpoint} in {timeout:g} s")
            if self._sock.poll(int(1000 * min(left, check_s)), zmq.POLLIN):
                parts = self._sock.recv_multipart(copy=False)
                if len(parts) != 3 or parts[0].bytes != rid:
                    self.stale += 1     # an answer to a request given up earlier, or garbage: not ours
                    continue
                if parts[1].bytes == ERROR:
                    raise ChannelError(parts[2].bytes.decode(errors="replace"))
                if parts[1].bytes != OK:   # not a result: a peer speaking another protocol, or garbage
                    raise ChannelError(f"an answer with unknown status {parts[1].bytes[:8]!r} from {self.endpoint}")
                return parts[2].bytes
            if time.monotonic() - last_check >= check_s:
                last_check = time.monotonic()
                alive()

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
