"""The batch channel to a remote executor's actor, on real ZeroMQ sockets on loopback (no Ray needed)."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from executors.remote_channel import ChannelClient, ChannelError, ChannelServer


def _never_dead() -> None:
    pass


def test_a_request_gets_its_own_answer():
    server = ChannelServer(lambda b: bytes(b)[::-1], "127.0.0.1")
    client = ChannelClient(server.endpoint)
    try:
        assert client.call(b"abc", timeout=5, alive=_never_dead) == b"cba"
        assert client.call(b"", timeout=5, alive=_never_dead) == b""
    finally:
        client.close()
        server.close()


def test_the_handlers_own_failure_comes_back_as_a_channel_error_naming_it():
    def fail(b):
        raise ValueError(f"cannot run {bytes(b)!r}")

    server = ChannelServer(fail, "127.0.0.1")
    client = ChannelClient(server.endpoint)
    try:
        with pytest.raises(ChannelError, match=r"ValueError: cannot run b'x'"):
            client.call(b"x", timeout=5, alive=_never_dead)
    finally:
        client.close()
        server.close()


def test_a_late_answer_to_a_request_given_up_is_dropped_not_taken_for_the_next():
    slow = threading.Event()

    def handler(b):
        if bytes(b) == b"slow":
            slow.wait(5)
        return b"answer to " + bytes(b)

    server = ChannelServer(handler, "127.0.0.1")
    client = ChannelClient(server.endpoint)
    try:
        with pytest.raises(TimeoutError, match=r"no answer from tcp://127\.0\.0\.1:\d+ in 0.2 s"):
            client.call(b"slow", timeout=0.2, alive=_never_dead)
        slow.set()                                       # its answer now arrives, after it was given up
        assert client.call(b"next", timeout=5, alive=_never_dead) == b"answer to next"
        assert client.stale == 1
    finally:
        client.close()
        server.close()


def test_a_dead_actor_ends_the_wait_through_the_liveness_check():
    server = ChannelServer(lambda b: time.sleep(5) or b"", "127.0.0.1")
    client = ChannelClient(server.endpoint)
    checks = []

    def alive():
        checks.append(time.monotonic())
        if len(checks) == 2:
            raise RuntimeError("ActorDiedError: the actor died")

    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="ActorDiedError"):
            client.call(b"x", timeout=30, alive=alive, check_s=0.05)
        assert len(checks) == 2 and time.monotonic() - t0 < 5   # not the 30 s timeout, not the handler's 5 s
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("parts", [[b"only-one"], [b"id", b"x", b"y", b"z"]])
def test_a_malformed_request_is_dropped_and_the_server_keeps_answering(parts):
    server = ChannelServer(lambda b: b"ok", "127.0.0.1")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    client = ChannelClient(server.endpoint)
    try:
        raw.send_multipart(parts)
        assert client.call(b"x", timeout=5, alive=_never_dead) == b"ok"
        assert not raw.poll(200)                         # the malformed request got no answer
    finally:
        raw.close(0)
        ctx.term()
        client.close()
        server.close()
