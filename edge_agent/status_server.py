"""The agent's HTTP side on `metrics.bind:metrics.port`: `/metrics`, the status page and a read-only JSON API.

One small threaded `http.server`, because Prometheus, the page and the API
must share one port (a line box opens one port to the plant network, not
three).  Routes (GET and HEAD only; every other method is 405; HEAD answers
what GET would, without the body):

    /                        the status page (static HTML/CSS/JS from edge_agent/web, no CDN)
    /static/<file>           its script and style sheet
    /metrics                 Prometheus text, from the agent's own registry
    /api/status              the live status document (`StatusModel.snapshot`)
    /api/stream              the same document as server-sent events, one per sample (about 1 s)
    /api/verdicts?verdict=&component=&board=&since=&limit=&next=
                             verdict rows newest first, with `next` for the following page
                             (the query `coe-agent results` runs: `storage.queries`)
    /api/frames/<id>         one frame: chain, each step's output and expert version, thumbnail
    /api/frames/<id>/thumbnail   the defect thumbnail itself (while retention keeps it)
    /api/pools               memory tiers: residents, bytes against capacity, hits, recent loads and evictions
    /api/health              ready or not, and why (200 when ready, 503 when not)
    /api/cluster             a line on several boxes: nodes, their executors, residency, health (404 on one box)

Security: it binds where metrics bind (127.0.0.1 by default).  It never writes:
the database is opened read-only and no route changes anything.  With
`metrics.token` set, every request (the Prometheus scrape included) must
present it as `Authorization: Bearer <token>` or `?token=<token>` (the page
passes the one it was opened with on to its own requests); tokens are compared
in constant time.  Bound to a loopback address, a request must also name a
loopback host, so a web page elsewhere cannot reach it by DNS rebinding.
Malformed query parameters get a 400 whose JSON names the parameter.
Request lines are logged (at debug) with any `token=` value redacted.

`close()` ends everything it started: the listening socket, every open
connection (kept-alive ones too, so no thread answers after it) and the
database readers; a request that races it gets a 503 saying the agent is
stopping.  Loopback means any loopback address, IPv4 or IPv6 (`::1`).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import queue
import re
import socket
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from storage.queries import QueryError, frame_detail, parse_verdict_params, query_verdicts, thumbnail
from storage.results import ResultStore

from .status_model import StatusModel

log = logging.getLogger(__name__)

STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
MAX_STREAMS = 16
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
LOOPBACK_NAMES = ("localhost",)   # besides any loopback IP literal and the bind address itself
# a burst of connects (a page opening its script, style sheet, stream and API calls, a scrape, a few viewers) must
# not overflow the listen backlog: the default 5 makes the rest wait for a SYN retry (a second or more)
LISTEN_BACKLOG = 128
_TOKEN_PARAM = re.compile(r"(token=)[^&;\s\"']*", re.IGNORECASE)

MAX_QUERY_FIELDS = 64
TOO_MANY = None     # the key `_parse` answers with when parse_qs found more fields than the limit (never a name)


@dataclass(frozen=True)
class HttpError(Exception):
    status: int
    message: str
    param: str | None = None


def web_files() -> dict[str, bytes]:
    """The page's static files, read once from the installed package."""
    root = resources.files("edge_agent") / "web"
    return {name: (root / name).read_bytes() for name in STATIC if (root / name).is_file()}


class _Readers:
    """A few read-only connections to the results database, reused across requests.

    Once closed it opens none again (a request still running when the agent
    stops would otherwise open a reader nobody closes): `run` answers 503, and
    a reader handed back after `close` is closed, not kept.
    """

    def __init__(self, path: Path, keep: int = 4) -> None:
        self.path, self._free = path, queue.LifoQueue(maxsize=keep)
        self._lock = threading.Lock()
        self._closed = False

    def run(self, fn):
        """`fn(connection)` on a free reader (a new one when all are busy); at most `keep` are kept open."""
        rs = self._take()
        try:
            return fn(rs.db.conn)
        finally:
            self._give_back(rs)

    def _take(self) -> ResultStore:
        with self._lock:
            if self._closed:
                raise HttpError(503, "the agent is stopping: the results database is closed")
            try:
                return self._free.get_nowait()
            except queue.Empty:
                pass
        return self._open()

    def _open(self) -> ResultStore:
        """A new reader; a database the agent has not made yet is a 503 (it comes with the first verdict), not a
        server error with a traceback in the log."""
        try:
            return ResultStore(self.path, readonly=True)
        except FileNotFoundError:
            raise HttpError(503, f"results database {self.path} does not exist yet (no verdict stored so far: "
                                 "has the agent run?)") from None

    def _give_back(self, rs: ResultStore) -> None:
        with self._lock:
            if not self._closed:
                try:
                    self._free.put_nowait(rs)
                    return
                except queue.Full:
                    pass
        rs.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        while True:
            try:
                self._free.get_nowait().close()
            except queue.Empty:
                return


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer that knows its open connections, so `end_connections()` can end kept-alive ones
    (`shutdown()` only stops accepting), logs what goes wrong instead of printing to stderr, takes a burst of
    connects, and binds IPv6 addresses too (its base class is IPv4 only)."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    label = "status http"          # how its log lines begin (the LLM server is another)
    log = log                      # and the logger they go to: a subclass names its own module's

    def __init__(self, address: tuple[str, int], handler) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._ended = False
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        with self._open_lock:
            if self._ended:             # accepted as close() ran: answer nothing
                super().shutdown_request(request)
                return
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._open_lock:           # out of the set before it is closed, so end_connections never meets a
            self._open.discard(request)  # closed socket
        super().shutdown_request(request)

    def end_connections(self) -> None:
        """Shut down every open connection: a handler waiting for the next kept-alive request reads EOF and ends,
        one writing an answer gets a broken pipe."""
        with self._open_lock:
            self._ended = True
            for conn in self._open:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass                # the client went first

    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-answer is routine (debug); anything else is a bug worth a traceback in the
        log.  Never stderr, which is what the base class prints to."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            self.log.debug("%s: client %s went away: %s", self.label, client_address[0], exc)
        else:
            self.log.exception("%s: request from %s failed", self.label, client_address[0])


HardenedHTTPServer = _Server     # what the agent's other HTTP servers (the LLM's) are built on


class StatusServer:
    """`start()` binds and serves on a daemon thread; `close()` stops it and ends open event streams."""

    def __init__(self, bind: str, port: int, *, registry, model: StatusModel | None, db_path: str | Path,
                 token: str | None = None, health=None) -> None:
        self.registry, self.model, self.token = registry, model, token
        self.health = health
        self.bind = bind.lower()
        self.readers = _Readers(Path(db_path))
        self.files = web_files()
        self._closing = threading.Event()
        self._streams = threading.BoundedSemaphore(MAX_STREAMS)
        self.loopback_only = _is_loopback(bind)
        if not self.loopback_only and not token:
            # off loopback the Host check is off too: a page on the plant network could be DNS-rebound here
            log.warning("status page and API on %s:%s without metrics.token: anyone who can reach this address "
                        "can read every verdict and frame thumbnail; set metrics.token", bind, port)
        self._server = _Server((bind, port), self._handler())
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="status-http", daemon=True)

    def start(self) -> "StatusServer":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, end open connections (kept-alive and streams), then close the database readers."""
        self._closing.set()
        if self.model is not None:
            self.model.stop()       # wakes every event stream waiting for a sample
        if self._thread.is_alive():  # shutdown() waits for serve_forever, forever if it never ran
            self._server.shutdown()
        self._server.server_close()
        self._server.end_connections()
        if self._thread.is_alive():
            self._thread.join(5)
        self.readers.close()

    # -- routes ---------------------------------------------------------------------------
    def route(self, path: str, params: dict[str, list[str]]) -> tuple[int, str, bytes, dict[str, str]]:
        """(status, content type, body, extra headers) for a GET; raises HttpError."""
        if path in ("/", "/index.html"):
            return self._static("index.html")
        if path.startswith("/static/"):
            return self._static(path[len("/static/"):])
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry), {}
        if path == "/api/status":
            return 200, "application/json", self._model().snapshot_bytes(), {}
        if path == "/api/pools":
            model = self._model()
            doc = {"pools": model.pools(), "timeline": model.timeline()}
            return _json(200, doc)
        if path == "/api/cluster":
            doc = self._model().cluster()
            if doc is None:
                raise HttpError(404, "this line runs on one box: no cluster: section")
            return _json(200, doc)
        if path == "/api/health":
            return self._health()
        if path == "/api/verdicts":
            return self._verdicts(params)
        if path.startswith("/api/frames/"):
            return self._frame(path[len("/api/frames/"):])
        raise HttpError(404, f"no such path: {unquote(path)[:100]}")

    def _health(self):
        if self.health is None:
            raise HttpError(503, "health is not reported: this status server was started without the agent's "
                                 "health check")
        h = self.health()
        return _json(200 if h.ready else 503, h.to_json())

    def _model(self) -> StatusModel:
        if self.model is None:
            raise HttpError(503, "status model not running")
        return self.model

    def _static(self, name: str):
        if name not in self.files:
            raise HttpError(404, f"no such file: {name[:60]}")
        body = self.files[name]
        if name == "index.html":   # the page's own script and style sheet carry the token it was opened with
            body = body.replace(b"{{query}}", ("?token=" + quote(self.token, safe="")).encode() if self.token else b"")
        return 200, STATIC[name], body, {"Cache-Control": "no-cache"}

    def _verdicts(self, params: dict[str, list[str]]):
        try:
            q = parse_verdict_params(params)
        except QueryError as exc:
            raise HttpError(400, str(exc), exc.param) from None
        page = self.readers.run(lambda conn: query_verdicts(conn, q))
        doc: dict[str, Any] = {"rows": page.rows, "next": page.next, "filters": q.params(),
                               "next_url": None}
        if page.next is not None:
            doc["next_url"] = "/api/verdicts?" + urlencode({**q.params(), "next": page.next})
        return _json(200, doc)

    def _frame(self, rest: str):
        want_thumb = rest.endswith("/thumbnail")
        if want_thumb:
            rest = rest[: -len("/thumbnail")]
        frame_id = unquote(rest)
        if not frame_id or len(frame_id) > 256:
            raise HttpError(400, "frame id must be 1..256 characters", "id")
        if want_thumb:
            got = self.readers.run(lambda conn: thumbnail(conn, frame_id))
            if got is None:
                raise HttpError(404, f"no thumbnail for frame '{frame_id[:60]}' (not a defect, or pruned)")
            # a thumbnail never changes once written, but retention may delete it: cache it only briefly
            return 200, got[0], got[1], {"Cache-Control": "private, max-age=300"}
        url = f"/api/frames/{quote(frame_id, safe='')}/thumbnail"
        doc = self.readers.run(lambda conn: frame_detail(conn, frame_id, thumbnail_url=url))
        if doc is None:
            raise HttpError(404, f"no frame '{frame_id[:60]}' in the results database")
        return _json(200, doc)

    # -- checks ----------------------------------------------------------------------------
    def authorized(self, headers, params: dict[str, list[str]]) -> bool:
        if not self.token:
            return True
        want = self.token.encode()
        given = []
        auth = headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:].strip())
        given += params.get("token", [])
        ok = False
        for g in given:        # every candidate compared, each in constant time
            ok |= hmac.compare_digest(g.encode("utf-8", "surrogateescape"), want)
        return ok

    def host_ok(self, host: str | None) -> bool:
        """Bound to loopback, the Host must be a loopback name: `localhost`, any loopback IP literal (127.0.0.2,
        `[::1]`) or the bind address itself.  A DNS-rebound page names its own host and is refused."""
        if not self.loopback_only:
            return True
        if not host:
            return False
        name = _host_name(host)
        return name in LOOPBACK_NAMES or name == self.bind or _is_loopback_ip(name)

    def redact(self, text: str) -> str:
        """`text` with every `token=` value, and the token itself wherever it appears, replaced: request lines
        go to the log, and the log is no place for the secret."""
        text = _TOKEN_PARAM.sub(r"\1<redacted>", text)
        if self.token:
            for form in {self.token, quote(self.token, safe="")}:
                text = text.replace(form, "<redacted>")
        return text

    # -- HTTP ------------------------------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "coe-edge"
            sys_version = ""
            timeout = 30
            # headers and body leave in separate writes: with Nagle on, a kept-alive client's delayed ACK
            # holds every small answer back ~40 ms
            disable_nagle_algorithm = True

            def log_message(self, fmt: str, *args: Any) -> None:   # through logging, not stderr; no token
                log.debug("status http: %s", server.redact(fmt % args))

            def _send(self, status: int, ctype: str, body: bytes, headers: dict[str, str] | None = None,
                      *, head: bool = False) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Referrer-Policy", "no-referrer")
                if ctype.startswith("text/html"):
                    self.send_header("Content-Security-Policy", CSP)
                    self.send_header("X-Frame-Options", "DENY")
                headers = dict(headers or {})
                headers.setdefault("Cache-Control", "no-store")
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, err: HttpError, *, head: bool = False, headers: dict[str, str] | None = None) -> None:
                doc = {"error": err.message, "status": err.status}
                if err.param is not None:
                    doc["param"] = err.param
                self._send(err.status, "application/json", json.dumps(doc).encode(), headers, head=head)

            def _parse(self) -> tuple[str, dict[str, list[str]]]:
                parts = urlsplit(self.path)
                try:
                    params = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False,
                                      max_num_fields=MAX_QUERY_FIELDS)
                except ValueError:
                    params = {TOO_MANY: []}     # answered 400 once the host is checked, before the token
                return parts.path, params

            def _gate(self, params: dict[str, list[str]], *, head: bool = False) -> bool:
                """Host and token checks, for every method; False when refused (the answer is sent)."""
                if not server.host_ok(self.headers.get("Host")):
                    self._error(HttpError(403, "this agent answers only to a loopback host name"), head=head)
                    return False
                if TOO_MANY in params:          # its token, if any, was never read: say what is wrong instead
                    self._error(HttpError(400, f"too many query parameters (at most {MAX_QUERY_FIELDS})"), head=head)
                    return False
                if not server.authorized(self.headers, params):
                    self._error(HttpError(401, "a token is required: 'Authorization: Bearer <token>' or "
                                               "'?token=<token>'"), head=head,
                                headers={"WWW-Authenticate": 'Bearer realm="coe-edge"'})
                    return False
                return True

            def _get(self, head: bool) -> None:
                path, params = self._parse()
                if not self._gate(params, head=head):
                    return
                if server._closing.is_set():     # raced close(): say so rather than answer from a closing agent
                    self.close_connection = True
                    self._error(HttpError(503, "the agent is stopping"), head=head)
                    return
                if path == "/api/stream":
                    self._stream(head)
                    return
                try:
                    status, ctype, body, headers = server.route(path, params)
                except HttpError as err:
                    self._error(err, head=head)
                    return
                except Exception as exc:  # noqa: BLE001 - a failed read answers 500, the agent goes on
                    log.exception("status request %s failed", path)
                    self._error(HttpError(500, f"{type(exc).__name__}: {exc}"[:300]), head=head)
                    return
                self._send(status, ctype, body, headers, head=head)

            def do_GET(self) -> None:
                self._get(False)

            def do_HEAD(self) -> None:
                self._get(True)

            def _refuse(self) -> None:
                # a body the client sent is not read: close rather than parse it as the next request
                self.close_connection = True
                _, params = self._parse()
                if not self._gate(params):
                    return
                self._error(HttpError(405, f"{self.command} is not served here: this API is read-only"),
                            headers={"Allow": "GET, HEAD"})

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

            def _stream_headers(self) -> None:
                """The event stream's head: it has no length, so the connection closes when it ends."""
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-store")
                self.send_header("Connection", "close")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.end_headers()

            def _stream(self, head: bool = False) -> None:
                model = server.model
                if model is None:
                    self._error(HttpError(503, "status model not running"), head=head)
                    return
                if head:                         # what GET would start with, holding no stream slot
                    self._stream_headers()
                    return
                if not server._streams.acquire(blocking=False):
                    self._error(HttpError(503, f"too many open event streams (limit {MAX_STREAMS}); "
                                               "poll /api/status instead"))
                    return
                try:
                    self._stream_headers()
                    self.wfile.write(b"retry: 2000\n\n")
                    version = -1
                    while not server._closing.is_set() and not model.stopped:
                        version = model.wait_tick(version, timeout=15.0)
                        if server._closing.is_set() or model.stopped:
                            break
                        self.wfile.write(b"data: " + model.snapshot_bytes() + b"\n\n")
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
                    pass   # the page went away
                finally:
                    server._streams.release()

        return Handler


def _json(status: int, doc: Any):
    return status, "application/json", json.dumps(doc, separators=(",", ":")).encode(), {}


def _is_loopback(bind: str) -> bool:
    return bind.lower() in LOOPBACK_NAMES or _is_loopback_ip(bind)


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """The name in a Host header, lower case, without its port or an IPv6 literal's brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1: host.index("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
