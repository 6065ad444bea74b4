"""OpenAI-style `POST /v1/completions` for an MoE LLM whose experts live in the line's executor pools.

The line agent starts this when its config has an `llm:` section.  The model's
(layer, expert) entries are read through the same pool as the vision experts
of one executor (`llm.executor`), so both share one byte budget and one
eviction policy, ranked together by usage probability; the pool never learns
which expert is which.  Generation is greedy (temperature 0): the same prompt
gives the same text whether or not frames are being served at the same time.

One completion runs at a time, in arrival order; up to `llm.max_waiting` more
wait, and beyond that a request gets 503 busy at once rather than a timeout.
A client that leaves is not generated for (streaming: at its next write;
otherwise at its turn and every few tokens).  Every malformed
request gets a 4xx with an OpenAI-style error object naming the field.
Streaming (`"stream": true`) sends server-sent events, one per token, then
`data: [DONE]`.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

from .bind_errors import why_bind_failed
from .status_server import HardenedHTTPServer

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
ALIVE_EVERY = 8         # tokens between checks that a non-streaming client still waits
BODY_TIMEOUT = 30.0     # seconds a connection may take to send what it announced: a stalled one pins a thread


class _LLMServer(HardenedHTTPServer):
    """The status server's base (a listen backlog for bursts, IPv6 binds, a dropped client a debug line, not a
    traceback on stderr), logging as the LLM's."""

    label = "llm http"
    log = log


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


# fields a client may send; each one this server cannot honour must be absent, null or its neutral value, else
# the request gets a 400 naming it: a silently ignored field would be a wrong answer with a 200
_NEUTRAL = {"top_p": (1, 1.0), "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",), "logprobs": (),
            "logit_bias": ({},), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0)}
_IGNORED = {"seed", "user", "stream_options"}   # no effect on greedy decoding, or always honoured (usage is sent)
_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stream", "stop", *_NEUTRAL, *_IGNORED}
MAX_STOP = 4


def parse_request(body: bytes, *, model: str, default_tokens: int, limit: int) -> dict:
    """A completion request's fields, checked; RequestError (400) naming the field otherwise.

    A field given as null means its default, as in OpenAI's API.  Returns the
    prompt, max_tokens, stream and the stop strings (a list, maybe empty).
    """
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(400, f"body is not JSON: {exc}") from None
    except RecursionError:
        raise RequestError(400, "body is not JSON this server reads: nested too deeply") from None
    if not isinstance(req, dict):
        raise RequestError(400, "body must be a JSON object")
    for key in req:
        if key not in _FIELDS:
            raise RequestError(400, f"unknown field '{key}' (fields served: {', '.join(sorted(_FIELDS))})", key)
    for key, neutral in _NEUTRAL.items():
        value = req.get(key)
        if value is not None and not any(_same(value, v) for v in neutral):
            raise RequestError(400, f"'{key}' is not served here: it must be absent" + (
                f", null or {' / '.join(json.dumps(v) for v in neutral)}" if neutral else " or null")
                + " (greedy decoding, one choice)", key)
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "'prompt' must be a non-empty string", "prompt")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(400, f"'prompt' is not valid Unicode: {exc.reason} at character {exc.start}",
                           "prompt") from None
    if req.get("model") not in (None, model):
        raise RequestError(404, f"model '{req.get('model')}' is not served here (this agent serves '{model}')",
                           "model", "model_not_found")
    n = _default(req, "max_tokens", default_tokens)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= limit:
        raise RequestError(400, f"'max_tokens' must be an integer from 1 to {limit}", "max_tokens")
    temp = _default(req, "temperature", 0)
    if not isinstance(temp, (int, float)) or isinstance(temp, bool) or temp != 0:
        raise RequestError(400, "only greedy decoding is served: 'temperature' must be 0 (or absent)",
                           "temperature")
    stream = _default(req, "stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    stop = _default(req, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", "stop")
    return {"prompt": prompt, "max_tokens": n, "stream": stream, "stop": stop}


def _same(value, neutral) -> bool:
    """`value` is `neutral` as JSON means it: 1 and 1.0 alike, but true is not 1 and "" is not 0."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool) \
        and (type(value) is type(neutral) or isinstance(value, (int, float)) and isinstance(neutral, (int, float)))


def _default(req: dict, key: str, default):
    value = req.get(key)
    return default if value is None else value


class _StopSequence(Exception):
    """A stop string appeared in the text: generation ends there (raised from the token callback)."""


def _held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` not to stream yet: a partly decoded character (a byte-level tokenizer's
    U+FFFD until the rest of its bytes come), or the start of a stop string that may still complete."""
    settled = text.rstrip("\ufffd")
    partial = len(text) - len(settled)
    if partial:      # what decodes so far may still turn into a stop string's characters: hold that too
        return partial + max((k for x in stop for k in range(min(len(x), len(settled)), 0, -1)
                              if settled.endswith(x[:k])), default=0)
    return max((k for x in stop for k in range(min(len(x) - 1, len(settled)), 0, -1) if settled.endswith(x[:k])),
               default=0)


class LLMService:
    """The pooled model, its tokenizer and the HTTP server in front of them."""

    def __init__(self, pooled, *, bind: str, port: int, default_tokens: int, limit: int, max_waiting: int,
                 metrics=None) -> None:
        self.pm = pooled
        self.tok = pooled.tokenizer()
        self.model_name = pooled.layout.model
        self.default_tokens, self.limit, self.max_waiting = default_tokens, limit, max_waiting
        self._turn = threading.Condition()        # completions run one at a time, in arrival order
        self._queue: collections.deque = collections.deque()
        self._count = threading.Lock()
        self._waiting = 0
        try:
            self._server = _LLMServer((bind, port), self._handler())
        except OSError as exc:
            raise OSError(f"llm.port {bind}:{port}: {why_bind_failed(exc, f'{bind}:{port}')}") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="llm-http", daemon=True)
        # the context the model was built for: a prompt and its completion must fit it (a prompt of a megabyte
        # would otherwise run one prefill of a million tokens while every other request waits)
        config = getattr(getattr(pooled, "model", None), "config", None)
        self.context = getattr(config, "max_position_embeddings", None)
        from executors.moe_model import _eos_ids

        self._eos = _eos_ids(pooled.model)
        self._closing = False

    def start(self) -> "LLMService":
        self._thread.start()
        log.info("LLM '%s' serving /v1/completions on port %d", self.model_name, self.port)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new completions, end the running one at its next token, then close the model.

        The running completion's client gets a 503 (or, streaming, an error
        event and `[DONE]`); those waiting get a 503 when their turn comes.
        Waits up to `timeout` s for the running one, so the pools it pins are
        not closed under it.
        """
        self._closing = True
        self._server.shutdown()
        self._server.server_close()
        with self._turn:     # the running one ends at its next token, the waiting ones at their turn
            if not self._turn.wait_for(lambda: not self._queue, timeout):
                log.error("the running completion did not end within %.0f s of stopping", timeout)
        self.pm.close()

    # -- generation ---------------------------------------------------------------
    @contextlib.contextmanager
    def _my_turn(self) -> Iterator[None]:
        """Wait for the completions that came before this one (first come, first served)."""
        ticket = object()
        with self._turn:
            self._queue.append(ticket)
            self._turn.wait_for(lambda: self._queue[0] is ticket)
        try:
            yield
        finally:
            with self._turn:
                self._queue.popleft()
                self._turn.notify_all()

    def complete(self, prompt: str, max_tokens: int, on_text=None, stop: list[str] | tuple = (),
                 alive: Callable[[], bool] | None = None) -> dict:
        """Greedy completion, ending at EOS, `max_tokens` or the first stop string (not included).

        `on_text(delta)` sees the text as it grows: a partly decoded
        character, or what may be the start of a stop string, is sent only
        once it is known.  `alive()` says whether the client still waits: one
        that left is not generated for (checked at its turn and every
        `ALIVE_EVERY` tokens; ConnectionError).  Raises RequestError(503) when
        busy or stopping.
        """
        import torch

        with self._count:
            if self._closing:
                raise RequestError(503, "the agent is shutting down", kind="server_busy")
            if self._waiting > self.max_waiting:
                raise RequestError(503, f"busy: {self._waiting} completions are waiting", kind="server_busy")
            self._waiting += 1
        try:
            ids = self.tok.encode(prompt)
            if not ids:
                raise RequestError(400, "'prompt' encodes to no tokens", "prompt")
            # positions the model takes: the prompt, then every generated token but the last (never fed back)
            if self.context and len(ids) + max_tokens - 1 > self.context:
                param = "max_tokens" if len(ids) < self.context else "prompt"
                raise RequestError(400, f"'prompt' is {len(ids)} tokens and 'max_tokens' {max_tokens}: together more "
                                   f"than the model's context of {self.context} tokens", param)
            with self._my_turn():
                out: list[int] = []
                shown = [0]
                cut: list[int] = []          # where a stop string begins, once one appears

                def token(t: int) -> None:
                    if self._closing:
                        raise RequestError(503, "the agent is shutting down", kind="server_busy")
                    out.append(t)
                    if alive is not None and len(out) % ALIVE_EVERY == 0 and not alive():
                        raise ConnectionError("the client left mid-completion")
                    if on_text is None and not stop:
                        return
                    text = self.tok.decode(out, skip_special_tokens=True)
                    at = min((i for i in (text.find(x, max(shown[0] - len(x), 0)) for x in stop) if i >= 0),
                             default=-1)
                    end = at if at >= 0 else len(text) - _held_back(text, stop)
                    if on_text is not None and end > shown[0]:
                        on_text(text[shown[0]:end])
                        shown[0] = end
                    if at >= 0:
                        cut.append(at)
                        raise _StopSequence

                if self._closing:
                    raise RequestError(503, "the agent is shutting down", kind="server_busy")
                if alive is not None and not alive():
                    raise ConnectionError("the client left while its completion waited")
                try:
                    self.pm.generate(torch.tensor([ids], dtype=torch.long), max_tokens, on_token=token)
                except _StopSequence:
                    pass
        finally:
            with self._count:
                self._waiting -= 1
        text = self.tok.decode(out, skip_special_tokens=True)
        text = text[:cut[0]] if cut else text
        if on_text is not None and len(text) > shown[0]:      # what was held back: the text is complete now
            on_text(text[shown[0]:])
        ended = bool(cut) or bool(out) and out[-1] in self._eos
        return {"text": text, "tokens": out, "prompt_tokens": len(ids), "finish_reason": "stop" if ended else "length"}

    # -- HTTP -------------------------------------------------------------------------
    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = BODY_TIMEOUT      # the socket's: a request line, headers or body that stalls ends the connection

            def log_message(self, fmt: str, *args: Any) -> None:  # route through logging, not stderr
                log.debug("llm http: " + fmt, *args)

            def _json(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _client_waits(self) -> bool:
                """False once the client has closed its end (its socket reads as ended, without blocking)."""
                try:
                    if not select.select([self.connection], [], [], 0)[0]:
                        return True                    # nothing to read: still connected, waiting
                    return bool(self.connection.recv(1, socket.MSG_PEEK))
                except OSError:
                    return False

            def _error(self, err: RequestError) -> None:
                self._json(err.status, {"error": {"message": err.message, "type": err.kind, "param": err.param}})

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                                                 "owned_by": "coe-edge"}]})
                elif self.path == "/v1/completions":
                    self._error(RequestError(405, "use POST for /v1/completions"))
                else:
                    self._error(RequestError(404, f"no such endpoint: {self.path}", kind="not_found"))

            def _not_allowed(self) -> None:
                self.close_connection = True      # whatever body came with it is not read
                self._error(RequestError(405, f"{self.command} is not served; use POST /v1/completions or "
                                              f"GET /v1/models"))

            do_PUT = do_DELETE = do_PATCH = _not_allowed

            def do_POST(self) -> None:
                if self.path != "/v1/completions":
                    self.close_connection = True
                    self._error(RequestError(404, f"no such endpoint: {self.path}", kind="not_found"))
                    return
                if self.headers.get("Transfer-Encoding"):     # a chunked body is not read: the connection ends
                    self.close_connection = True
                    self._error(RequestError(411, "a Content-Length header is required (no Transfer-Encoding)"))
                    return
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self.close_connection = True
                    self._error(RequestError(411, "a Content-Length header is required"))
                    return
                if length < 0:
                    self.close_connection = True
                    self._error(RequestError(400, f"Content-Length must not be negative, got {length}"))
                    return
                if length > MAX_BODY:
                    self.close_connection = True
                    self._error(RequestError(413, f"body of {length} bytes exceeds {MAX_BODY}"))
                    return
                body = b""
                deadline = time.monotonic() + BODY_TIMEOUT    # for the whole body, not per read: a client that
                try:                                          # dribbles a byte now and then is cut off too
                    while len(body) < length:         # piece by piece, so a stall still says how far it came
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self.connection.settimeout(left)
                        piece = self.rfile.read1(length - len(body))
                        if not piece:
                            break
                        body += piece
                except OSError:                   # the socket's timeout: it announced more than it sent
                    pass
                finally:
                    self.connection.settimeout(BODY_TIMEOUT)
                if len(body) < length:
                    self.close_connection = True
                    self._error(RequestError(400, f"the body ended after {len(body)} of its {length} bytes "
                                                  f"(Content-Length), or stalled for {BODY_TIMEOUT:g} s"))
                    return
                try:
                    req = parse_request(body, model=service.model_name, default_tokens=service.default_tokens,
                                        limit=service.limit)
                    if req["stream"]:
                        self._stream(req)
                    else:
                        res = service.complete(req["prompt"], req["max_tokens"], stop=req["stop"],
                                               alive=self._client_waits)
                        self._json(200, _completion(service.model_name, res))
                except ConnectionError:        # the client left: nobody to answer
                    self.close_connection = True
                    log.info("a completion's client disconnected before its answer")
                except RequestError as err:
                    self._error(err)
                except Exception as exc:  # a failing expert load: the client learns why, the agent goes on
                    log.exception("completion failed")
                    self._error(RequestError(500, f"completion failed: {exc}", kind="server_error"))

            def _stream(self, req: dict) -> None:
                cid = f"cmpl-{uuid.uuid4().hex[:24]}"
                started = []

                def send(doc: dict | str) -> None:
                    if not started:
                        self.send_response(200)
                        self.send_header("Content-Type", "text/event-stream")
                        self.send_header("Cache-Control", "no-cache")
                        self.send_header("Connection", "close")
                        self.end_headers()
                        self.close_connection = True
                        started.append(True)
                    data = doc if isinstance(doc, str) else json.dumps(doc)
                    self.wfile.write(f"data: {data}\n\n".encode())
                    self.wfile.flush()

                def delta(text: str) -> None:
                    send({"id": cid, "object": "text_completion", "created": int(time.time()),
                          "model": service.model_name, "choices": [{"text": text, "index": 0,
                                                                    "finish_reason": None}]})
                try:
                    res = service.complete(req["prompt"], req["max_tokens"], on_text=delta, stop=req["stop"])
                except ConnectionError:
                    if not started:
                        raise
                    log.info("a streamed completion's client disconnected; its generation ended")
                    return
                except Exception as exc:
                    if not started:
                        raise
                    # the headers are gone: the error goes into the stream, never a second HTTP response
                    err = exc if isinstance(exc, RequestError) else RequestError(
                        500, f"completion failed: {exc}", kind="server_error")
                    log.error("streamed completion failed: %s", exc)
                    send({"error": {"message": err.message, "type": err.kind, "param": err.param}})
                    send("[DONE]")
                    return
                send({"id": cid, "object": "text_completion", "created": int(time.time()),
                      "model": service.model_name,
                      "choices": [{"text": "", "index": 0, "finish_reason": res["finish_reason"]}],
                      "usage": _usage(res)})
                send("[DONE]")
        return Handler


def _usage(res: dict) -> dict:
    n = len(res["tokens"])
    return {"prompt_tokens": res["prompt_tokens"], "completion_tokens": n, "total_tokens": res["prompt_tokens"] + n}


def _completion(model: str, res: dict) -> dict:
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"text": res["text"], "index": 0, "finish_reason": res["finish_reason"],
                                         "logprobs": None}], "usage": _usage(res)}
