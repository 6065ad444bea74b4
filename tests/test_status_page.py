"""The status page in a real browser: headless Chromium (Debian's package) driven by Playwright.

The page is opened on an agent with `metrics.token` set while a recording is
replayed into it, so the token's way through the page (script, style sheet,
event stream, thumbnails) is exercised too.  No browser is downloaded: the
system Chromium is used.  Without one the test is skipped, except in CI
(CI=true), where a missing browser is a failure: `.ci/run` installs it.
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from edge_agent.agent import Agent
from edge_agent.config import load_config
from edge_agent import protocol as P
from edge_agent.replay import send_messages
from storage.recording import Recording

TOKEN = "page-token-0123456789abcdef"


def _chromium() -> str:
    path = os.environ.get("COE_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    why = None
    if path is None:
        why = "no chromium on PATH (Debian: apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            why = "playwright is not installed (pip install -e '.[test]')"
    if why is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"browser tests must run in CI: {why}")
        pytest.skip(why)
    return path


@pytest.fixture
def browser():
    exe = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def number(page, selector: str) -> int:
    text = page.inner_text(selector).replace(",", "").strip()
    return int(text) if text.isdigit() else -1


def until(page, cond, what: str, timeout_s: float = 60.0):
    """Poll `cond()` through the browser's event loop until it is truthy (the page's CSP forbids eval, so
    Playwright's string predicates cannot run in it); fail naming `what`."""
    for _ in range(int(timeout_s * 10)):
        got = cond()
        if got:
            return got
        page.wait_for_timeout(100)
    pytest.fail(f"the page never showed {what}")


def test_the_page_follows_a_replay_live(browser, tiny_line, tiny_recording, tmp_path):
    agent = Agent(load_config(tiny_line, env={"COE_METRICS__TOKEN": TOKEN})).start()
    rec = Recording(tiny_recording)
    replayed = {}
    try:
        base = f"http://127.0.0.1:{agent.metrics_port}"
        other = browser.new_page()                                          # (its 401 is logged as an error)
        assert other.goto(base + "/").status == 401                         # no token, no page
        other.close()
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        problems: list[str] = []
        thumbs: list[tuple[int, str]] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
                else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}")
                if "/api/stream" not in r.url else None)   # the stream is cut when the browser closes
        page.on("response", lambda r: thumbs.append((r.status, r.headers.get("content-type", "")))
                if r.url.split("?")[0].endswith("/thumbnail") else None)

        page.goto(f"{base}/?token={TOKEN}")
        until(page, lambda: page.inner_text("#health") == "READY", "the agent ready")
        assert number(page, "#c-received") == 0

        # the counters rise while frames come: the first half, then (once the page shows some) the rest, so the
        # page is seen to follow the line without a reload however slowly the browser polls
        msgs = [(f.header["frame_id"], [P.encode_header(f.header), rec.payload(f)]) for f in rec]
        half = len(msgs) // 2
        assert send_messages(msgs[:half], agent.endpoints["ingest"], window=8).accepted == half
        first = until(page, lambda: max(0, number(page, "#c-received")), "frames received")
        assert first <= half
        sender = threading.Thread(target=lambda: replayed.update(r=send_messages(msgs[half:], agent.endpoints["ingest"],
                                                                                  rate=12, window=8)), daemon=True)
        sender.start()
        until(page, lambda: number(page, "#c-received") > first, "the received count rising")
        assert first < number(page, "#c-received") <= len(rec)
        # a defect's thumbnail appears (fetched with the token, a JPEG) with its chain
        until(page, lambda: page.locator("#defects img.thumb").count() > 0, "a defect thumbnail")
        until(page, lambda: (200, "image/jpeg") in thumbs, "a thumbnail loaded")
        assert all(t == (200, "image/jpeg") for t in thumbs)
        card = page.locator("#defects .defect").first
        assert card.locator(".chain").inner_text().startswith("cls-")
        # the pool view lists resident experts, and they are the spec's
        until(page, lambda: page.locator("#pools .chip.resident").count() > 0, "resident experts")
        listed = set(page.locator("#pools .chip.resident").all_inner_texts())
        assert listed and listed <= set(agent.model.experts)
        sender.join(120)
        assert half + replayed["r"].accepted == len(rec) and agent.wait_verdicts(len(rec), timeout=120)
        until(page, lambda: number(page, "#c-accepted") == len(rec), "every frame accepted")
        # settled: the page shows exactly what each pool holds, and the defects the agent counted
        for name, pool in agent.pools.items():
            chips = page.locator(f"#pools .pool[data-pool='{name}'] .chip.resident")
            until(page, lambda: sorted(chips.all_inner_texts()) == sorted(pool.resident()), f"pool {name}'s residents")
        defects = agent.status.snapshot()["flow"]["verdicts"].get("defect", 0)
        until(page, lambda: page.inner_text("#k-defects .num") == str(defects), f"{defects} defects")
        assert page.inner_text("#conn-text") == "live"
        shot = tmp_path / "status-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
        out = os.environ.get("COE_SCREENSHOT_DIR")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(out) / "status-page.png")
        page.close()
        assert problems == []
    finally:
        agent.stop()


def test_the_page_polls_when_every_event_stream_slot_is_taken(browser, tmp_path):
    """A 503 from /api/stream ends an EventSource for good (it fires one error): the page must poll instead."""
    import socket

    from edge_agent.metrics import Metrics
    from edge_agent.status_model import Health, StatusModel, StatusSources
    from edge_agent.status_server import MAX_STREAMS, StatusServer
    from storage.results import ResultStore

    ResultStore(tmp_path / "r.db").close()
    metrics = Metrics("L")
    model = StatusModel(StatusSources(line="L", registry=metrics.registry, pools=dict, queue_depths=dict,
                                      executors={}, health=lambda: Health(True))).start(interval=0.2)
    server = StatusServer("127.0.0.1", 0, registry=metrics.registry, model=model, db_path=tmp_path / "r.db",
                          health=lambda: Health(True)).start()
    held = []
    try:
        for _ in range(MAX_STREAMS):                 # other viewers hold every stream slot
            c = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            c.sendall(b"GET /api/stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert c.recv(64).startswith(b"HTTP/1.1 200")
            held.append(c)
        page = browser.new_page()
        stream_answers: list[int] = []
        page.on("response", lambda r: stream_answers.append(r.status) if "/api/stream" in r.url else None)
        page.goto(f"http://127.0.0.1:{server.port}/")
        until(page, lambda: page.inner_text("#health") == "READY", "the status (from /api/status)")
        assert stream_answers and set(stream_answers) == {503}
        metrics.frames_received.inc(5)               # the page keeps following the line: live, by polling
        until(page, lambda: number(page, "#c-received") == 5, "the received count rising")
        assert page.inner_text("#conn-text") == "live"
        page.close()
    finally:
        for c in held:
            c.close()
        server.close()
