"""OpenAI-style `POST /v1/completions` for an MoE LLM whose experts live in the line's executor pools.

The line agent starts this when its config has an `llm:` section.  The model's
(layer, expert) entries are read through the same pool as the vision experts
of one executor (`llm.executor`), so both share one byte budget and one
eviction policy, ranked together by usage probability; the pool never learns
which expert is which.  Generation is greedy (temperature 0): the same prompt
gives the same text whether or not frames are being served at the same time.

One completion runs at a time; up to `llm.max_waiting` more wait, and beyond
that a request gets 503 busy at once rather than a timeout.  Every malformed
request gets a 4xx with an OpenAI-style error object naming the field.
Streaming (`"stream": true`) sends server-sent events, one per token, then
`data: [DONE]`.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20
BODY_TIMEOUT = 30.0     # seconds a connection may take to send what it announced: a stalled one pins a thread


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def parse_request(body: bytes, *, model: str, default_tokens: int, limit: int) -> dict:
    """A completion request's fields, checked; RequestError (400) naming the field otherwise."""
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RequestError(400, f"body is not JSON: {exc}") from None
    if not isinstance(req, dict):
        raise RequestError(400, "body must be a JSON object")
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "'prompt' must be a non-empty string", "prompt")
    if req.get("model") not in (None, model):
        raise RequestError(404, f"model '{req.get('model')}' is not served here (this agent serves '{model}')",
                           "model", "model_not_found")
    n = req.get("max_tokens", default_tokens)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= limit:
        raise RequestError(400, f"'max_tokens' must be an integer from 1 to {limit}", "max_tokens")
    temp = req.get("temperature", 0)
    if not isinstance(temp, (int, float)) or isinstance(temp, bool) or temp != 0:
        raise RequestError(400, "only greedy decoding is served: 'temperature' must be 0 (or absent)",
                           "temperature")
    stream = req.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    return {"prompt": prompt, "max_tokens": n, "stream": stream}


class LLMService:
    """The pooled model, its tokenizer and the HTTP server in front of them."""

    def __init__(self, pooled, *, bind: str, port: int, default_tokens: int, limit: int, max_waiting: int,
                 metrics=None) -> None:
        self.pm = pooled
        self.tok = pooled.tokenizer()
        self.model_name = pooled.layout.model
        self.default_tokens, self.limit, self.max_waiting = default_tokens, limit, max_waiting
        self._run = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0
        self._server = ThreadingHTTPServer((bind, port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="llm-http", daemon=True)
        # the context the model was built for: a prompt and its completion must fit it (a prompt of a megabyte
        # would otherwise run one prefill of a million tokens while every other request waits)
        config = getattr(getattr(pooled, "model", None), "config", None)
        self.context = getattr(config, "max_position_embeddings", None)

    def start(self) -> "LLMService":
        self._thread.start()
        log.info("LLM '%s' serving /v1/completions on port %d", self.model_name, self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.pm.close()

    # -- generation ---------------------------------------------------------------
    def complete(self, prompt: str, max_tokens: int, on_text=None) -> dict:
        """Greedy completion; `on_text(delta)` sees the text as it grows.  Raises RequestError(503) when busy."""
        import torch

        with self._count:
            if self._waiting > self.max_waiting:
                raise RequestError(503, f"busy: {self._waiting} completions are waiting", kind="server_busy")
            self._waiting += 1
        try:
            ids = self.tok.encode(prompt)
            if not ids:
                raise RequestError(400, "'prompt' encodes to no tokens", "prompt")
            # positions the model takes: the prompt, then every generated token but the last (never fed back)
            if self.context and len(ids) + max_tokens - 1 > self.context:
                raise RequestError(400, f"'prompt' is {len(ids)} tokens and 'max_tokens' {max_tokens}: together more "
                                   f"than the model's context of {self.context} tokens", "prompt")
            with self._run:
                out: list[int] = []
                shown = [0]

                def token(t: int) -> None:
                    out.append(t)
                    if on_text is not None:
                        text = self.tok.decode(out, skip_special_tokens=True)
                        on_text(text[shown[0]:])
                        shown[0] = len(text)

                _, stats = self.pm.generate(torch.tensor([ids], dtype=torch.long), max_tokens, on_token=token)
        finally:
            with self._count:
                self._waiting -= 1
        eos = bool(out) and len(out) < max_tokens
        return {"text": self.tok.decode(out, skip_special_tokens=True), "tokens": out, "prompt_tokens": len(ids),
                "finish_reason": "stop" if eos else "length", "stats": stats}

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
                        res = service.complete(req["prompt"], req["max_tokens"])
                        self._json(200, _completion(service.model_name, res))
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
                    res = service.complete(req["prompt"], req["max_tokens"], on_text=delta)
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
