"""The status server's edges, over real sockets on loopback: closing, logging, binding, HEAD, missing parts.

Each test serves a `Metrics` registry and a `StatusModel` (no agent) from a
`StatusServer` on an ephemeral port, and talks to it with `http.client` or raw
sockets, so what is checked is what a browser, Prometheus or a dropped client
meets on the wire.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import select
import socket
import time

import pytest

from edge_agent.metrics import Metrics
from edge_agent.status_model import Health, StatusModel, StatusSources
from edge_agent.status_server import MAX_STREAMS, HttpError, StatusServer
from storage.results import ResultStore

TOKEN = "hardening-token-0123456789abcdef"
LOG = "edge_agent.status_server"


def model_for(metrics: Metrics, **kw) -> StatusModel:
    health = kw.pop("health", lambda: Health(True))
    return StatusModel(StatusSources(line="L", registry=metrics.registry, pools=dict, queue_depths=dict,
                                     executors={}, health=health), **kw)


def results_db(tmp_path):
    path = tmp_path / "results.db"
    ResultStore(path).close()
    return path


@contextlib.contextmanager
def serving(tmp_path, *, bind="127.0.0.1", model=None, metrics=None, db=None, **kw):
    metrics = metrics or Metrics("L")
    server = StatusServer(bind, 0, registry=metrics.registry, model=model,
                          db_path=db if db is not None else results_db(tmp_path), **kw).start()
    try:
        yield server
    finally:
        server.close()


def request(port: int, path: str, *, method="GET", host="127.0.0.1", headers=None):
    """(status, headers, body) of one request on a new connection."""
    c = http.client.HTTPConnection(host, port, timeout=10)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.headers, r.read()
    finally:
        c.close()


def wait_for(cond, what: str, timeout_s: float = 20.0):
    """Poll `cond()` until truthy; fail naming `what` (a bound on waiting, never a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    pytest.fail(f"never saw {what}")


def read_event(resp) -> dict:
    """The next `data:` event of an event stream, as JSON."""
    while True:
        line = resp.fp.readline()
        assert line, "the event stream ended"
        if line.startswith(b"data: "):
            return json.loads(line[6:])


# -- 1: gauges read at scrape time ------------------------------------------------------------------------------
def test_inflight_and_queue_depth_gauges_follow_their_sources_between_scrapes(tmp_path):
    metrics, now = Metrics("L"), {"inflight": 3, "queued": 7}
    metrics.inflight.set(99)                         # what a last ingest message left behind
    metrics.watch_flow(inflight=lambda: now["inflight"], queue_depth=lambda: now["queued"])

    def scraped() -> dict[str, float]:
        body = request(server.port, "/metrics")[2].decode()
        return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
                if ln.startswith(("coe_frames_inflight{", "coe_queue_depth{"))}

    with serving(tmp_path, metrics=metrics) as server:
        assert scraped() == {"coe_frames_inflight": 3.0, "coe_queue_depth": 7.0}
        now.update(inflight=0, queued=0)             # the line went quiet: nothing sets the gauges now
        assert scraped() == {"coe_frames_inflight": 0.0, "coe_queue_depth": 0.0}


# -- 3: close() ends kept-alive connections and opens no reader after ------------------------------------------
def _open_fds_under(path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(path)):
                out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_close_ends_kept_alive_connections_and_leaves_no_database_reader_open(tmp_path):
    db = results_db(tmp_path)
    server = StatusServer("127.0.0.1", 0, registry=Metrics("L").registry, model=None, db_path=db,
                          health=lambda: Health(True)).start()
    kept = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    kept.request("GET", "/api/verdicts")
    r = kept.getresponse()
    assert r.status == 200 and r.getheader("Connection") != "close"
    r.read()
    server.close()
    with pytest.raises((http.client.HTTPException, ConnectionError)):   # no answer after close, not a 200
        kept.request("GET", "/api/verdicts")
        kept.getresponse()
    kept.close()
    with pytest.raises(HttpError) as refused:
        server.readers.run(lambda conn: conn.execute("SELECT 1").fetchone())
    assert refused.value.status == 503 and "stopping" in refused.value.message
    assert _open_fds_under(db) == []


# -- 4: the token stays out of the log -------------------------------------------------------------------------
def test_logged_request_lines_carry_no_token(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=LOG)
    with serving(tmp_path, token=TOKEN, health=lambda: Health(True)) as server:
        assert request(server.port, f"/api/health?token={TOKEN}")[0] == 200
        assert request(server.port, f"/nope?x=1&token={TOKEN}")[0] == 404
        assert request(server.port, "/api/health?token=a-wrong-guess")[0] == 401
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:   # a malformed request line
            raw.sendall(f"GET /?token={TOKEN} HTTP/1.1 extra\r\nHost: localhost\r\n\r\n".encode())
            assert b"400" in raw.recv(4096)         # (answered as HTTP/0.9: the version was not understood)
    logged = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert sum("token=<redacted>" in m for m in logged) >= 4
    assert not [m for m in logged if TOKEN in m or "a-wrong-guess" in m]


# -- 5: errors go to the log, never raw to stderr --------------------------------------------------------------
def test_a_client_that_drops_mid_answer_is_a_debug_line_not_a_traceback(tmp_path, caplog, capfd):
    """What the server does with a reset or a broken pipe raised while it answers (the base class prints a
    traceback to stderr): driven directly, as socketserver calls it, so no race with a real reset is needed."""
    caplog.set_level(logging.DEBUG, logger=LOG)
    with serving(tmp_path) as server:
        for exc in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe")):
            try:
                raise exc
            except OSError:
                server._server.handle_error(None, ("127.0.0.1", 40000))
    went_away = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(went_away) == 2 and all(r.levelno == logging.DEBUG for r in went_away)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err


def test_an_unexpected_error_in_a_handler_is_logged_with_its_traceback_not_printed(tmp_path, caplog, capfd):
    def broken_health():
        raise RuntimeError("health source broke")
    metrics = Metrics("L")
    model = model_for(metrics, health=broken_health).start(interval=0.05)
    with serving(tmp_path, model=model, metrics=metrics) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as c:   # the stream builds a document
            c.sendall(b"GET /api/stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
            while c.recv(65536):
                pass
        failed = wait_for(lambda: [r for r in caplog.records if r.name == LOG and r.levelno == logging.ERROR],
                          "the failure logged")
    assert failed[0].exc_info and "health source broke" in str(failed[0].exc_info[1])
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err


# -- 6: a burst of connects fits the listen backlog -----------------------------------------------------------
def test_forty_simultaneous_connects_all_wait_in_the_listen_queue(tmp_path):
    # never started: nothing accepts, so what the kernel queued is exactly what the listen backlog admits
    server = StatusServer("127.0.0.1", 0, registry=Metrics("L").registry, model=None, db_path=results_db(tmp_path))
    clients = []
    try:
        for _ in range(40):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", server.port))
            clients.append(c)
        pending, deadline = list(clients), time.monotonic() + 3.0
        while pending and time.monotonic() < deadline:     # handshakes done (or dropped: the queue was full)
            _, done, _ = select.select([], pending, [], 0.1)
            pending = [c for c in pending if c not in done]
        listener = server._server.socket
        listener.setblocking(False)
        queued = []
        with contextlib.suppress(BlockingIOError):
            while True:
                queued.append(listener.accept()[0])
        for q in queued:
            q.close()
        assert len(queued) == 40
    finally:
        for c in clients:
            c.close()
        server.start().close()


# -- 7: every tick gets its own document -----------------------------------------------------------------------
def test_the_event_stream_sends_the_new_sample_even_when_a_poll_built_a_document_just_before(tmp_path):
    metrics = Metrics("L")
    model = model_for(metrics, clock=lambda: 1000.0, min_interval=1.0)   # time stands still: only ticks move
    model.tick()
    with serving(tmp_path, model=model, metrics=metrics) as server:
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        c.request("GET", "/api/stream")
        stream = c.getresponse()
        assert read_event(stream)["flow"]["received"] == 0
        for n in (1, 2, 3):
            assert request(server.port, "/api/status")[0] == 200      # another viewer polls between ticks
            metrics.frames_received.inc()
            model.tick()
            assert read_event(stream)["flow"]["received"] == n
        c.close()


# -- 8, 9: loopback binds beyond 127.0.0.1 ----------------------------------------------------------------------
def test_a_server_on_another_loopback_address_answers_loopback_hosts_only(tmp_path):
    with serving(tmp_path, bind="127.0.0.2", health=lambda: Health(True)) as server:
        assert request(server.port, "/api/health", host="127.0.0.2")[0] == 200          # Host: 127.0.0.2:<port>
        assert request(server.port, "/api/health", host="127.0.0.2", headers={"Host": "127.0.0.5"})[0] == 200
        assert request(server.port, "/api/health", host="127.0.0.2",
                       headers={"Host": f"localhost:{server.port}"})[0] == 200
        status, _, body = request(server.port, "/api/health", host="127.0.0.2", headers={"Host": "evil.example"})
        assert status == 403 and "loopback" in json.loads(body)["error"]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_server_bound_to_ipv6_loopback_serves_and_checks_the_host(tmp_path):
    with serving(tmp_path, bind="::1", health=lambda: Health(True)) as server:
        assert server.loopback_only
        assert request(server.port, "/api/health", host="::1")[0] == 200                # Host: [::1]:<port>
        assert request(server.port, "/api/health", host="::1", headers={"Host": "evil.example"})[0] == 403


# -- 10: HEAD on every route ------------------------------------------------------------------------------------
def test_head_on_the_event_stream_answers_its_headers_and_holds_no_slot(tmp_path):
    metrics = Metrics("L")
    model = model_for(metrics)
    model.tick()
    with serving(tmp_path, model=model, metrics=metrics) as server:
        for _ in range(MAX_STREAMS + 1):             # more HEADs than stream slots: none is held
            status, headers, body = request(server.port, "/api/stream", method="HEAD")
            assert (status, headers["Content-Type"], body) == (200, "text/event-stream", b"")
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        c.request("GET", "/api/stream")
        assert c.getresponse().status == 200
        c.close()


# -- 11: missing parts are 503 with a reason --------------------------------------------------------------------
def test_a_server_without_health_or_a_database_yet_answers_503_saying_why(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=LOG)
    missing = tmp_path / "not-yet.db"
    with serving(tmp_path, db=missing, health=None) as server:
        status, _, body = request(server.port, "/api/health")
        assert status == 503 and "health" in json.loads(body)["error"]
        for path in ("/api/verdicts", "/api/frames/x", "/api/frames/x/thumbnail"):
            status, _, body = request(server.port, path)
            assert status == 503, path
            assert str(missing) in json.loads(body)["error"] and "does not exist" in json.loads(body)["error"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not missing.exists()                     # a reader never makes the database


def test_the_llm_servers_log_lines_go_to_its_own_logger_not_the_status_pages(caplog):
    """The LLM server is built on the status server's base; its errors are the LLM's (its logger, its label)."""
    from edge_agent.llm_service import _LLMServer

    caplog.set_level(logging.DEBUG, logger="edge_agent.llm_service")   # its own level: another test may set it
    server = _LLMServer(("127.0.0.1", 0), None)
    try:
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except OSError:
            server.handle_error(None, ("127.0.0.1", 40000))
        try:
            raise RuntimeError("a handler broke")
        except RuntimeError:
            server.handle_error(None, ("127.0.0.1", 40000))
    finally:
        server.server_close()
    mine = [r for r in caplog.records if "llm http" in r.getMessage()]
    assert [r.levelno for r in mine] == [logging.DEBUG, logging.ERROR]
    assert all(r.name == "edge_agent.llm_service" for r in mine), [r.name for r in mine]
