"""An MoE LLM served by the line agent next to the vision line, through the same executor pool.

Real agent, real loopback ZeroMQ replay, real HTTP on loopback, a tiny Mixtral
built from its config and imported; the reference text is transformers' own
greedy generation.
"""
from __future__ import annotations

import http.client
import json
import shutil
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_models import build  # noqa: E402

from coe import SpecError  # noqa: E402
from conftest import until, verdict_rows, write_line  # noqa: E402
from edge_agent.agent import Agent  # noqa: E402
from edge_agent.config import load_config  # noqa: E402
from edge_agent.llm_models import byte_tokenizer  # noqa: E402
from edge_agent.llm_service import RequestError, parse_request  # noqa: E402
from edge_agent.replay import replay  # noqa: E402
from storage.llm_import import import_checkpoint  # noqa: E402
from storage.recording import Recording  # noqa: E402

PROMPTS = ["def main(", "import sys\n"]
TOKENS = 8


@pytest.fixture(scope="module")
def llm_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    ref = build("mixtral", root / "hf", seed=3)
    byte_tokenizer().save_pretrained(root / "hf")
    import_checkpoint(root / "hf", root / "store", name="tiny")
    tok = byte_tokenizer()
    want = {}
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        out = ref.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)[0, ids.shape[1]:]
        want[p] = tok.decode(out.tolist(), skip_special_tokens=True)
    return root / "store", want


def _line(tmp_path, tiny_zoo, llm_store, name):
    store = tmp_path / f"experts-{name}"
    shutil.copytree(tiny_zoo, store)
    return write_line(tmp_path / name, store=store, llm={"store": str(llm_store), "port": 0})


def _post(port: int, body: bytes | dict, path: str = "/v1/completions") -> tuple[int, bytes]:
    con = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    con.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    res = con.getresponse()
    out = res.status, res.read()
    con.close()
    return out


def _most_held(events) -> int:
    """The most bytes (expert_id, event, nbytes) rows in time order ever hold at once."""
    held, most = {}, 0
    for eid, event, nbytes in events:
        if event in ("load", "admit"):
            held[eid] = nbytes
        elif event == "evict":
            held.pop(eid, None)
        most = max(most, sum(held.values()))
    return most


def _verdicts(db) -> dict:
    return {r["frame_id"]: (r["verdict"], r["reason"]) for r in verdict_rows(db)}


def test_replay_and_completions_at_once_match_each_alone_within_one_budget(tmp_path, tiny_zoo, tiny_recording,
                                                                          llm_store):
    store, want = llm_store
    rec = Recording(tiny_recording)

    alone = Agent(load_config(_line(tmp_path, tiny_zoo, store, "alone"), env={})).start()
    try:
        assert replay(rec, alone.endpoints["ingest"], window=16).accepted == len(rec)
        assert alone.wait_verdicts(len(rec), timeout=120)
        port = alone.llm.port
        texts_alone = {p: json.loads(_post(port, {"prompt": p, "max_tokens": TOKENS})[1])["choices"][0]["text"]
                       for p in PROMPTS}
    finally:
        alone.stop()
    verdicts_alone = _verdicts(alone.cfg.db_path)
    assert texts_alone == want            # the pooled LLM in the agent is exact

    agent = Agent(load_config(_line(tmp_path, tiny_zoo, store, "both"), env={})).start()
    pool = next(iter(agent.pools.values()))
    peak, stop = [0], threading.Event()

    def watch():                          # a sample of the pool's use; the events' replay below is the exact bound
        while not stop.wait(0.002):
            peak[0] = max(peak[0], pool.used_bytes())
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    texts, errors = {}, []

    def complete():
        try:
            for _ in range(3):
                for p in PROMPTS:
                    status, body = _post(agent.llm.port, {"prompt": p, "max_tokens": TOKENS, "model": "tiny"})
                    assert status == 200, body
                    texts.setdefault(p, set()).add(json.loads(body)["choices"][0]["text"])
        except BaseException as exc:     # an assertion in this thread must fail the test, not vanish
            errors.append(exc)
    try:
        worker = threading.Thread(target=complete)
        worker.start()
        assert replay(rec, agent.endpoints["ingest"], window=16).accepted == len(rec)
        worker.join(120)
        assert not worker.is_alive() and not errors, errors
        assert agent.wait_verdicts(len(rec), timeout=120)
    finally:
        stop.set()
        watcher.join(5)
        agent.stop()
    assert {p: t for p, (t,) in ((p, tuple(v)) for p, v in texts.items())} == want
    assert _verdicts(agent.cfg.db_path) == verdicts_alone
    assert 0 < peak[0] <= pool.capacity
    import sqlite3

    con = sqlite3.connect(agent.cfg.db_path)
    llm_loads, vision_loads = con.execute(
        "SELECT sum(expert_id LIKE 'tiny.%'), sum(expert_id NOT LIKE 'tiny.%') FROM expert_events "
        "WHERE event='load'").fetchone()
    events = con.execute("SELECT expert_id, event, nbytes FROM expert_events ORDER BY at, id").fetchall()
    con.close()
    # the recorded loads and evictions, replayed in time order, never hold more than the budget: an account
    # kept apart from the pool's own ledger (an eviction is stamped when the room is reserved, a load when
    # it completes, so time order never shows a load before the eviction that made its room)
    most = _most_held(events)
    assert 0 < most <= pool.capacity
    # one pool's bookkeeping: the LLM's loads are recorded beside the vision experts' (and the pool evicted)
    assert llm_loads > 0 and vision_loads > 0 and pool.stats().evictions > 0


def test_streaming_and_malformed_requests(tmp_path, tiny_zoo, llm_store):
    store, want = llm_store
    agent = Agent(load_config(_line(tmp_path, tiny_zoo, store, "http"), env={})).start()
    try:
        port = agent.llm.port
        con = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        con.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPTS[0], "max_tokens": TOKENS,
                                                                "stream": True}))
        res = con.getresponse()
        assert res.status == 200 and res.getheader("Content-Type") == "text/event-stream"
        events = [ln[len("data: "):] for ln in res.read().decode().split("\n\n") if ln.startswith("data: ")]
        con.close()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want[PROMPTS[0]]
        assert len(chunks) >= 2 and chunks[-1]["usage"]["completion_tokens"] == TOKENS

        for body, status, needle in ((b"{nope", 400, "not JSON"), (b"[1]", 400, "JSON object"),
                                     ({"max_tokens": 3}, 400, "prompt"),
                                     ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
                                     ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
                                     ({"prompt": "x", "temperature": 0.7}, 400, "temperature"),
                                     ({"prompt": "x", "stream": "yes"}, 400, "stream"),
                                     ({"prompt": "x", "model": "gpt-4"}, 404, "not served")):
            got, text = _post(port, body)
            err = json.loads(text)["error"]
            assert got == status and needle in err["message"], (body, got, text)
        assert _post(port, {"prompt": "x"}, path="/v1/chat")[0] == 404
        # a completion that fails after the stream started: an error event and [DONE], not a second response
        real = agent.llm.pm.generate

        def failing(ids, n, on_token=None):
            on_token(5)
            raise RuntimeError("expert file vanished")
        agent.llm.pm.generate = failing
        try:
            con = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            con.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "stream": True}))
            res = con.getresponse()
            raw = res.read().decode()
            con.close()
        finally:
            agent.llm.pm.generate = real
        events = [ln[len("data: "):] for ln in raw.split("\n\n") if ln.startswith("data: ")]
        assert res.status == 200 and "HTTP/1" not in raw and events[-1] == "[DONE]"
        assert "expert file vanished" in json.loads(events[-2])["error"]["message"]
        con = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        con.request("GET", "/v1/models")
        assert json.loads(con.getresponse().read())["data"][0]["id"] == "tiny"
        con.close()
        # the server survived every bad request
        assert json.loads(_post(port, {"prompt": PROMPTS[1], "max_tokens": TOKENS})[1])["choices"][0]["text"] \
            == want[PROMPTS[1]]
    finally:
        agent.stop()


def _raw(port: int, data: bytes, *, read_timeout: float = 30.0) -> bytes:
    """Send `data` as it is on a fresh connection; return everything the server answers until it closes."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got


def test_http_framing_that_is_not_served_is_refused_and_a_stalled_body_does_not_pin_the_server(tmp_path, tiny_zoo,
                                                                                                llm_store,
                                                                                                monkeypatch):
    """Raw HTTP the OpenAI client would never send: each gets a JSON error and the connection is closed (a body
    left unread would be parsed as the next request), a body that stalls ends after the server's timeout, and a
    prompt past the model's context is refused before it holds the model."""
    from edge_agent import llm_service

    store, want = llm_store
    monkeypatch.setattr(llm_service, "BODY_TIMEOUT", 0.5)      # the handler reads it when the server is made
    agent = Agent(load_config(_line(tmp_path, tiny_zoo, store, "raw"), env={})).start()
    try:
        port = agent.llm.port
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        cases = [
            (head + "Content-Length: 100\r\n\r\n" + '{"prompt": "x"', "400", "ended after 14 of its 100 bytes"),
            (head + "Content-Length: -5\r\n\r\n", "400", "must not be negative"),
            (head + "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "411", "no Transfer-Encoding"),
            (head + "\r\n" + '{"prompt": "x"}', "411", "Content-Length header is required"),
            ("PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", "405", "PUT is not served"),
            ("DELETE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", "405", "DELETE is not served")]
        for text, status, needle in cases:
            raw = _raw(port, text.encode())          # returns only once the server has closed the connection
            status_line, _, rest = raw.partition(b"\r\n")
            assert status_line.split()[1].decode() == status, (text, raw)
            doc = json.loads(rest.split(b"\r\n\r\n", 1)[1])
            assert needle in doc["error"]["message"], (text, doc)
        # a client that dribbles a byte now and then: the timeout is for the whole body, not per read
        import socket
        import time as _time

        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall((head + "Content-Length: 100\r\n\r\n").encode())
            try:
                for _ in range(20):                             # 4 s of dribble if nobody stopped it
                    sock.sendall(b" ")
                    _time.sleep(0.2)
            except OSError:                                      # the server answered and closed
                pass
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        assert raw.split()[1] == b"400" and b"of its 100 bytes" in raw
        got = int(raw.split(b"ended after ")[1].split(b" ")[0])
        assert got < 20                  # cut off mid-dribble (a per-read timeout would have waited for all 20)
        context = agent.llm.context
        assert context == 256                                   # the test model's max_position_embeddings
        got, text = _post(port, {"prompt": "a" * (context - 3), "max_tokens": TOKENS})
        err = json.loads(text)["error"]      # the prompt fits: what it asks for past it is the fault
        assert got == 400 and err["param"] == "max_tokens" and f"context of {context} tokens" in err["message"]
        got, text = _post(port, {"prompt": "a" * (context + 1), "max_tokens": 1})
        err = json.loads(text)["error"]      # the prompt alone does not fit
        assert got == 400 and err["param"] == "prompt" and f"context of {context} tokens" in err["message"]
        # the server survived every one of them
        assert json.loads(_post(port, {"prompt": PROMPTS[0], "max_tokens": TOKENS})[1])["choices"][0]["text"] \
            == want[PROMPTS[0]]
    finally:
        agent.stop()


def test_a_max_share_keeps_the_llms_experts_within_it_and_the_text_exact(tmp_path, tiny_zoo, llm_store):
    import sqlite3

    from coe.moe import MoELayout

    store, want = llm_store
    layout = MoELayout.load(store)
    biggest = max(l.expert_nbytes for l in layout.layers)
    capacity = 20 * 10**6                                 # write_line's executor memory
    cap_bytes = (layout.top_k + 1) * biggest              # one token's experts and one more: the LLM must evict
    assert cap_bytes < layout.expert_bytes
    share = cap_bytes / capacity
    path = write_line(tmp_path / "share", store=shutil.copytree(tiny_zoo, tmp_path / "experts-share"),
                      llm={"store": str(store), "port": 0, "max_share": share})
    agent = Agent(load_config(path, env={})).start()
    try:
        pool = next(iter(agent.pools.values()))
        for p in PROMPTS:
            status, body = _post(agent.llm.port, {"prompt": p, "max_tokens": TOKENS})
            assert status == 200, body
            assert json.loads(body)["choices"][0]["text"] == want[p]     # exact within the share
        assert 0 < pool.share_bytes() <= int(capacity * share)
    finally:
        agent.stop()
    con = sqlite3.connect(agent.cfg.db_path)
    events = con.execute("SELECT expert_id, event, nbytes FROM expert_events WHERE expert_id LIKE 'tiny.%' "
                         "ORDER BY at, id").fetchall()
    con.close()
    most = _most_held(events)                             # the LLM's own loads and evictions, replayed
    assert biggest * layout.top_k <= most <= int(capacity * share)
    assert sum(e == "evict" for _, e, _ in events) > 0   # it made room among its own experts

    # a share too small for one token's experts fails the start, naming the setting
    path = write_line(tmp_path / "share2", store=tiny_zoo,
                      llm={"store": str(store), "port": 0, "max_share": (layout.top_k * biggest - 1) / capacity})
    with pytest.raises(ValueError, match="llm.max_share .* cannot hold one token's"):
        Agent(load_config(path, env={})).start()


def test_llm_config_errors(tmp_path, tiny_zoo, llm_store):
    store, _ = llm_store
    path = write_line(tmp_path / "bad", store=tiny_zoo, llm={"store": str(store), "port": 70000})
    with pytest.raises(SpecError, match="llm.port"):
        load_config(path, env={})
    path = write_line(tmp_path / "bad2", store=tiny_zoo, llm={"store": str(store), "colour": "red"})
    with pytest.raises(SpecError, match="llm.colour"):
        load_config(path, env={})
    path = write_line(tmp_path / "bad3", store=tiny_zoo, llm={"store": str(store), "executor": "cuda-7"})
    with pytest.raises(ValueError, match="llm.executor"):
        Agent(load_config(path, env={}))
    path = write_line(tmp_path / "bad4", store=tiny_zoo, llm={"store": str(tmp_path / "nowhere")})
    with pytest.raises(Exception, match="llm.json"):
        Agent(load_config(path, env={}))
    path = write_line(tmp_path / "bad5", store=tiny_zoo, llm={"store": str(store), "max_tokens": 300,
                                                               "max_tokens_limit": 200})
    with pytest.raises(SpecError, match="max_tokens_limit"):
        load_config(path, env={})
    remote = {"device": "cpu", "count": 1, "memory": "20MB", "threads": 1, "node": "box-2"}
    local = {"device": "cpu", "count": 1, "memory": "20MB", "threads": 1}
    cluster = {"address": "127.0.0.1:1"}
    path = write_line(tmp_path / "bad6", store=tiny_zoo, executors=[remote, local], cluster=cluster,
                      llm={"store": str(store), "executor": "box-2/cpu-0.0"})
    with pytest.raises(ValueError, match="llm.executor: 'box-2/cpu-0.0' runs on node 'box-2'"):
        Agent(load_config(path, env={}))
    path = write_line(tmp_path / "ok7", store=tiny_zoo, executors=[remote, local], cluster=cluster,
                      llm={"store": str(store)})
    agent = Agent(load_config(path, env={}))        # by default the first executor on this box, not the node's
    try:
        assert agent.llm_slot.ex.node is None
    finally:
        agent.stop()


def test_parse_request_limits():
    ok = parse_request(b'{"prompt": ["hi"], "max_tokens": 4}', model="m", default_tokens=16, limit=8)
    assert ok == {"prompt": "hi", "max_tokens": 4, "stream": False, "stop": []}
    assert parse_request(b'{"prompt": "hi"}', model="m", default_tokens=16, limit=32)["max_tokens"] == 16
    with pytest.raises(RequestError, match="1 to 8"):
        parse_request(b'{"prompt": "hi", "max_tokens": 9}', model="m", default_tokens=4, limit=8)
    with pytest.raises(RequestError, match="not JSON"):
        parse_request(b"\xff", model="m", default_tokens=4, limit=8)


def test_unserved_fields_are_refused_by_name_and_null_means_the_default():
    def parse(doc):
        return parse_request(json.dumps(doc).encode(), model="m", default_tokens=4, limit=8)

    for doc, param in (({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "best_of": 3}, "best_of"),
                       ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "logprobs": 5}, "logprobs"),
                       ({"prompt": "x", "logprobs": 0}, "logprobs"),    # 0 still asks for the chosen token's
                       ({"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias"), ({"prompt": "x", "top_p": 0.9}, "top_p"),
                       ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
                       ({"prompt": "x", "frequency_penalty": 1}, "frequency_penalty"),
                       ({"prompt": "x", "suffix": "}"}, "suffix"), ({"prompt": "x", "n": True}, "n"),
                       ({"prompt": "x", "max_token": 5}, "max_token"),       # a typo is not the default of 4
                       ({"prompt": "x", "stop": [""]}, "stop"), ({"prompt": "x", "stop": ["a"] * 5}, "stop"),
                       ({"prompt": "x", "stop": 7}, "stop")):
        with pytest.raises(RequestError) as err:
            parse(doc)
        assert err.value.status == 400 and err.value.param == param, doc
    neutral = {"prompt": "x", "n": 1, "best_of": 1, "echo": False, "logprobs": None, "logit_bias": {}, "top_p": 1.0,
               "presence_penalty": 0, "frequency_penalty": 0.0, "suffix": "", "seed": 7, "user": "line-A",
               "max_tokens": None, "temperature": None, "stream": None, "stop": None}
    assert parse(neutral) == {"prompt": "x", "max_tokens": 4, "stream": False, "stop": []}
    assert parse({"prompt": "x", "stop": "\n"})["stop"] == ["\n"]
    with pytest.raises(RequestError, match="not valid Unicode") as err:
        parse_request(b'{"prompt": "\\ud800"}', model="m", default_tokens=4, limit=8)     # a lone surrogate
    assert err.value.param == "prompt"
    with pytest.raises(RequestError, match="nested too deeply"):
        parse_request(b"[" * 100_000 + b"]" * 100_000, model="m", default_tokens=4, limit=8)


def _stream(port: int, doc: dict) -> list[str]:
    con = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    con.request("POST", "/v1/completions", body=json.dumps({**doc, "stream": True}))
    res = con.getresponse()
    assert res.status == 200
    events = [ln[len("data: "):] for ln in res.read().decode().split("\n\n") if ln.startswith("data: ")]
    con.close()
    return events


def test_streamed_text_is_the_complete_text_even_where_a_character_spans_tokens_and_stop_strings_end_it(
        tmp_path, tiny_zoo, llm_store):
    """The byte tokenizer sends a multi-byte character as several tokens; a delta must never carry the U+FFFD a
    half-decoded character shows.  A stop string ends the completion just before it, streamed or not."""
    store, _ = llm_store
    agent = Agent(load_config(_line(tmp_path, tiny_zoo, store, "utf8"), env={})).start()
    try:
        port = agent.llm.port
        found = None
        for prompt in ("\u00ff", "def main(", "é", "日本", "ü\n", "x = "):   # \u00ff: its text has U+04CA
            status, body = _post(port, {"prompt": prompt, "max_tokens": 48})
            assert status == 200, body
            text = json.loads(body)["choices"][0]["text"]
            if any(ord(c) > 127 and c != "\ufffd" for c in text):
                found = prompt, text
                break
        assert found, "no prompt gave the random model's text a multi-byte character"
        prompt, text = found
        events = _stream(port, {"prompt": prompt, "max_tokens": 48})
        assert events[-1] == "[DONE]"
        deltas = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
        assert "".join(deltas) == text
        assert not any(d.endswith("\ufffd") and not text.endswith(d) for d in deltas if d)

        stop = text[len(text) // 2: len(text) // 2 + 2]
        at = text.index(stop)
        status, body = _post(port, {"prompt": prompt, "max_tokens": 48, "stop": [stop, "\x00never"]})
        choice = json.loads(body)["choices"][0]
        assert status == 200 and choice["text"] == text[:at] and choice["finish_reason"] == "stop"
        events = _stream(port, {"prompt": prompt, "max_tokens": 48, "stop": stop})
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text[:at]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        status, body = _post(port, {"prompt": prompt, "max_tokens": 48})
        assert json.loads(body)["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        agent.stop()


def test_stopping_the_agent_ends_the_running_completion_and_refuses_the_waiting_one(tmp_path, tiny_zoo, llm_store):
    """The running stream gets an error event and [DONE], the waiting request a 503, and stop() returns only
    once the model is free (so the pools are not closed under it).  The generation is paused after its second
    token (its own token callback waits), so the order does not depend on the box's speed."""
    store, _ = llm_store
    agent = Agent(load_config(_line(tmp_path, tiny_zoo, store, "stop"), env={})).start()
    port, service = agent.llm.port, agent.llm
    reached, go = threading.Event(), threading.Event()
    real = service.pm.generate

    def paused(ids, n, on_token=None):
        seen = []

        def tok(t):
            on_token(t)
            seen.append(t)
            if len(seen) == 2:
                reached.set()
                go.wait(30)
        return real(ids, n, on_token=tok)
    service.pm.generate = paused
    got = {}
    streaming = threading.Thread(target=lambda: got.setdefault("stream", _stream(port, {"prompt": "x",
                                                                                        "max_tokens": 100})))
    streaming.start()
    assert reached.wait(60)
    waiting = threading.Thread(target=lambda: got.setdefault("waiting", _post(port, {"prompt": "y"})))
    waiting.start()
    until(lambda: service._waiting == 2, 30, "the second request to wait for the model")
    stopper = threading.Thread(target=agent.stop)
    stopper.start()
    until(lambda: service._closing, 30, "the service to be closing")
    go.set()
    for t in (streaming, waiting, stopper):
        t.join(60)
        assert not t.is_alive()
    events = got["stream"]
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert len(events) <= 4                      # two tokens' deltas at most, the error, [DONE]
    status, body = got["waiting"]
    assert status == 503 and "shutting down" in json.loads(body)["error"]["message"]


def test_an_llm_port_already_taken_fails_the_start_naming_it_and_leaves_nothing_running(tmp_path, tiny_zoo,
                                                                                         llm_store):
    import socket

    import zmq

    store, _ = llm_store
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    shutil.copytree(tiny_zoo, tmp_path / "experts")
    cfg = load_config(write_line(tmp_path / "busy", store=tmp_path / "experts", fixed_ports=True,
                                 llm={"store": str(store), "port": port}), env={})
    agent = Agent(cfg)
    try:
        with pytest.raises(OSError, match=f"llm.port 127.0.0.1:{port}"):
            agent.start()
    finally:
        taken.close()
    assert agent.phase == "stopped" and not agent.writer.alive() and not any(e.alive() for e in agent.executors)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(cfg.ingest.split(":", 1)[1])       # the ingest port is free again
        sock.close(linger=0)
    finally:
        ctx.term()
    done = threading.Thread(target=agent.stop)      # and stop() after the failed start returns
    done.start()
    done.join(10)
    assert not done.is_alive()


def test_completions_run_in_arrival_order_and_one_whose_client_left_is_not_generated(tmp_path, tiny_zoo, llm_store):
    """The first completion is paused after its first token; then B (whose client hangs up while it waits), C
    and D queue behind it.  B is never generated for, and C runs before D."""
    import socket

    store, want = llm_store
    agent = Agent(load_config(_line(tmp_path, tiny_zoo, store, "fifo"), env={})).start()
    service = agent.llm
    port = service.port
    reached, go = threading.Event(), threading.Event()
    real = service.pm.generate
    ran: list[list[int]] = []

    def paused(ids, n, on_token=None):
        ran.append(ids[0].tolist())
        seen = []

        def tok(t):
            on_token(t)
            seen.append(t)
            if len(ran) == 1 and len(seen) == 1:
                reached.set()
                go.wait(30)
        return real(ids, n, on_token=tok)
    service.pm.generate = paused
    got = {}

    def ask(key, prompt):
        got[key] = _post(port, {"prompt": prompt, "max_tokens": TOKENS})
    try:
        threads = [threading.Thread(target=ask, args=("A", "first"))]
        threads[0].start()
        assert reached.wait(60)
        body = json.dumps({"prompt": "gone", "max_tokens": TOKENS}).encode()
        leaver = socket.create_connection(("127.0.0.1", port), timeout=30)
        leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        until(lambda: len(service._queue) == 2, 30, "B to queue")
        leaver.close()                                             # B's client hangs up while B waits
        for key, prompt in (("C", PROMPTS[0]), ("D", PROMPTS[1])):
            threads.append(threading.Thread(target=ask, args=(key, prompt)))
            threads[-1].start()
            until(lambda n=len(threads) + 1: len(service._queue) == n, 30, f"{key} to queue")
        go.set()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
    finally:
        go.set()
        agent.stop()
    tok = byte_tokenizer()
    assert ran == [tok.encode(p) for p in ("first", PROMPTS[0], PROMPTS[1])]     # B skipped, then C before D
    assert [got[k][0] for k in "ACD"] == [200, 200, 200]
    assert [json.loads(got[k][1])["choices"][0]["text"] for k in "CD"] == [want[PROMPTS[0]], want[PROMPTS[1]]]


def test_what_a_stream_holds_back_is_a_partial_character_and_any_stop_string_it_may_start():
    from edge_agent.llm_service import _held_back

    assert _held_back("abc", []) == 0
    assert _held_back("abc\ufffd", []) == 1                  # half a character: its bytes are still coming
    assert _held_back("hello wor", ["world"]) == 3            # may become the stop string
    assert _held_back("hello world!", ["world"]) == 0         # past it (the caller cuts at a found stop string)
    assert _held_back("x\n\ufffd", ["\né"]) == 2             # the partial character may finish the stop string
    assert _held_back("x\ufffd", ["\n"]) == 1
