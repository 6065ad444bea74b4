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
    never = threading.Event()                            # the handler never answers: only the liveness check ends it
    server = ChannelServer(lambda b: never.wait(60) and b"", "127.0.0.1")
    client = ChannelClient(server.endpoint)
    checks = []

    def alive():
        checks.append(time.monotonic())
        if len(checks) == 2:
            raise RuntimeError("ActorDiedError: the actor died")

    try:
        with pytest.raises(RuntimeError, match="ActorDiedError"):
            client.call(b"x", timeout=30, alive=alive, check_s=0.05)
        assert len(checks) == 2                          # ended by the second check, not by the 30 s timeout
    finally:
        never.set()
        client.close()
        server.close()


@pytest.mark.parametrize("parts", [[b"only-one"], [b"id", b"x", b"y", b"z"], [b"id", b"not-echo", b"x"]])
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


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_echo_is_answered_by_the_server_itself_not_the_handler():
    seen = []
    server = ChannelServer(lambda b: seen.append(bytes(b)) or b"ran", "127.0.0.1")
    client = ChannelClient(server.endpoint)
    try:
        assert 0 < client.echo(5) < 5
        assert seen == []                                # the handler (a batch) never saw it
        assert client.call(b"x", timeout=5, alive=_never_dead) == b"ran" and seen == [b"x"]
        assert client.echo(5) > 0 and client.stale == 0
    finally:
        client.close()
        server.close()


def test_an_echo_nobody_answers_times_out_naming_the_endpoint():
    """Nothing listens on the port (a ZeroMQ connect does not fail: it retries), and a TCP port that accepts
    but never speaks (a blocked or wrong service): both end within the timeout, naming the endpoint."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    for port in (_free_port(), silent.getsockname()[1]):
        client = ChannelClient(f"tcp://127.0.0.1:{port}")
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=rf"no answer from tcp://127\.0\.0\.1:{port} to an echo in 0.3 s"):
                client.echo(0.3)
            assert time.monotonic() - t0 > 0.25         # it waited its 0.3 s (an upper bound would be timing)
        finally:
            client.close()
    silent.close()


def test_the_connect_handshake_names_the_executor_node_address_and_port():
    """What `RemoteExecutor._connect` does with the actor's endpoint (executors/remote.py, no Ray needed)."""
    from coe import CoEError
    from executors.remote import channel_handshake

    port = _free_port()
    with pytest.raises(CoEError) as err:
        channel_handshake(f"tcp://127.0.0.1:{port}", name="box-2/cpu-1.0", node="box-2", timeout=0.3)
    msg = str(err.value)
    for part in ("executor box-2/cpu-1.0 on node box-2", "address 127.0.0.1", f"port {port}",
                 "did not answer an echo", "cluster.channel: ray"):
        assert part in msg, msg
    server = ChannelServer(lambda b: b"", "127.0.0.1")
    try:
        client, rtt = channel_handshake(server.endpoint, name="x", node="box-2", timeout=5)
        assert rtt > 0 and client.call(b"", timeout=5, alive=_never_dead) == b""
        client.close()
    finally:
        server.close()


@pytest.mark.parametrize("reply,why", [
    (["not", "a", "dict"], "a list, not a dict"),
    ({"outputs": [1, 2]}, "missing error, error_kind, started_at, seconds, version, report"),
    ({"outputs": [1], "error": None, "error_kind": "", "started_at": 0.0, "seconds": 0.1, "version": 1,
      "report": None}, "1 outputs for 2 frames"),
    ({"outputs": None, "error": None, "error_kind": "", "started_at": 0.0, "seconds": 0.1, "version": 1,
      "report": None}, "outputs NoneType, not a list"),
    ({"outputs": None, "error": 3, "error_kind": "", "started_at": 0.0, "seconds": 0.1, "version": 1,
      "report": None}, "error int, not a string")])
def test_a_nodes_malformed_answer_is_named_before_it_is_read(reply, why):
    """`RemoteExecutor._serve` checks a node's answer before reading it key by key (executors/remote.py)."""
    from executors.remote import reply_problem

    assert reply_problem(reply, 2) == why


def test_a_nodes_well_formed_answers_pass():
    from executors.remote import reply_problem

    ok = {"outputs": [1, 2], "error": None, "error_kind": "", "started_at": 0.0, "seconds": 0.1, "version": 1,
          "report": None}
    assert reply_problem(ok, 2) is None
    assert reply_problem({**ok, "outputs": None, "error": "node box-2: out of memory"}, 2) is None   # an error result


def test_an_answer_with_an_unknown_status_is_an_error_not_a_result():
    ctx = zmq.Context.instance()
    peer = ctx.socket(zmq.ROUTER)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    client = ChannelClient(f"tcp://127.0.0.1:{port}")

    def answer():
        ident, rid, _payload = peer.recv_multipart()
        peer.send_multipart([ident, rid, b"?", b"not-a-result"])   # neither OK nor ERROR
    t = threading.Thread(target=answer)
    t.start()
    try:
        with pytest.raises(ChannelError, match=r"unknown status b'\?'"):
            client.call(b"x", timeout=10, alive=_never_dead)
    finally:
        t.join(10)
        client.close()
        peer.close(0)


_REPORT = {"seq": 1, "resident": [["cls-a", 10]], "stats": {"hits": 1, "misses": 2}, "host": None,
           "host_resident": [], "events": [["cls-a", "cpu", "load", 10, 0.1, 1.0]]}


@pytest.mark.parametrize("report,why", [
    ("x", "report: a str, not a dict"),
    ({k: v for k, v in _REPORT.items() if k != "events"}, "report: missing events"),
    ({**_REPORT, "stats": {"hits": 1, "new_field": 3}}, "report: stats with unknown fields new_field"),
    ({**_REPORT, "stats": [1]}, "report: stats not a dict"),
    ({**_REPORT, "resident": [["cls-a"]]}, "report: resident is not a list of (expert, bytes) pairs"),
    ({**_REPORT, "events": [["cls-a", "cpu", "load"]]}, "report: events is not a list of 6-field events"),
    ({**_REPORT, "host_resident": None}, "report: host_resident is not a list")])
def test_a_nodes_report_of_another_shape_is_named_before_it_is_applied(report, why):
    """A node on another coe-edge version: before, `PoolStats(**stats)` raised in the serving thread, which took
    it for a lost node and killed a healthy actor (and leaked one per rejoin)."""
    from executors.remote import reply_problem, report_problem

    assert report_problem(report) == why
    ok = {"outputs": [1], "error": None, "error_kind": "", "started_at": 0.0, "seconds": 0.1, "version": 1}
    assert reply_problem({**ok, "report": report}, 1) == why
    assert report_problem(_REPORT) is None and report_problem(None) is None


def test_the_front_applies_a_nodes_residency_only_from_its_newest_report():
    """A heartbeat's answer read after a batch's (or the other way round) must not roll residency back."""
    from coe import parse_spec
    from conftest import TINY_SPEC
    from executors.remote import RemotePool

    pool = RemotePool("box-2/cpu-0.0", "cpu", 100, parse_spec(TINY_SPEC), "box-2")
    newer = {**_REPORT, "seq": 5, "resident": [["det-2term", 30]]}
    pool.update(newer)
    pool.update({**_REPORT, "seq": 4})                      # older: ignored
    assert pool.resident() == ["det-2term"]
    pool.update({**_REPORT, "seq": 6})
    assert pool.resident() == ["cls-a"]
    pool.forget()                                           # a new actor counts from 1 again
    pool.update({**_REPORT, "seq": 1, "resident": [["det-2term", 30]]})
    assert pool.resident() == ["det-2term"]
