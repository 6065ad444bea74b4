"""The agent's HTTP side against a real agent: /metrics, the JSON API, the token, read-only, 400s.

One agent, with `metrics.token` set, serves a replayed recording for the
module; every request presents the token unless a test says otherwise.  Every
answer is checked against the results database the agent wrote.
"""
from __future__ import annotations

import base64
import json
import shutil
import sqlite3
import urllib.error
import urllib.request
from datetime import datetime, timezone
from urllib.parse import quote

import cv2
import numpy as np
import pytest
from click.testing import CliRunner

from edge_agent.agent import Agent
from edge_agent.cli import cli
from edge_agent.config import load_config
from edge_agent.replay import replay
from storage.recording import Recording

from conftest import write_line

TOKEN = "s3cret-line-token-0123456789"


def get(port: int, path: str, *, headers: dict | None = None, method: str = "GET", data: bytes | None = None,
        auth: bool = True):
    """(status, headers, body) of one request; HTTP errors are answers here, not exceptions."""
    headers = {**({"Authorization": f"Bearer {TOKEN}"} if auth else {}), **(headers or {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get_json(port: int, path: str, **kw):
    status, headers, body = get(port, path, **kw)
    return status, json.loads(body)


def rows(db, sql, args=()):
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_zoo, tiny_recording):
    """An agent that has served the whole tiny recording (every verdict committed)."""
    root = tmp_path_factory.mktemp("served")
    store = root / "experts"
    shutil.copytree(tiny_zoo, store)
    agent = Agent(load_config(write_line(root / "line", store=store), env={"COE_METRICS__TOKEN": TOKEN})).start()
    rec = Recording(tiny_recording)
    report = replay(rec, agent.endpoints["ingest"])
    assert report.accepted == len(rec)
    assert agent.wait_verdicts(len(rec), timeout=120)
    agent.status.tick()
    yield agent
    agent.stop()


def newest_first(db) -> list[str]:
    return [r[0] for r in rows(db, "SELECT frame_id FROM verdicts ORDER BY decided_at DESC, rowid DESC")]


def test_pages_of_verdicts_cover_every_row_once_and_match_the_cli(served):
    port, db = served.metrics_port, served.cfg.db_path
    seen, path, pages = [], "/api/verdicts?limit=7", []
    while path:
        status, doc = get_json(port, path)
        assert status == 200
        pages.append(doc)
        seen += [r["frame_id"] for r in doc["rows"]]
        path = doc["next_url"]
        assert (doc["next"] is None) == (path is None)
    assert seen == newest_first(db)                      # every verdict once, newest first
    assert len(pages) == -(-len(seen) // 7)
    # the CLI runs the same query: same first page, and its cursor leads to the API's second page
    out = CliRunner().invoke(cli, ["results", "--db", str(db), "--limit", "7", "--json"])
    assert out.exit_code == 0, out.output
    assert [json.loads(x) for x in out.stdout.splitlines()] == pages[0]["rows"]
    out = CliRunner().invoke(cli, ["results", "--db", str(db), "--limit", "7", "--json",
                                                   "--next", pages[0]["next"]])
    assert [json.loads(x)["frame_id"] for x in out.stdout.splitlines()] == [r["frame_id"] for r in pages[1]["rows"]]


def test_filters_match_the_database(served):
    port, db = served.metrics_port, served.cfg.db_path
    defects = [r[0] for r in rows(db, "SELECT frame_id FROM verdicts WHERE verdict='defect' "
                                      "ORDER BY decided_at DESC, rowid DESC")]
    assert defects, "the tiny recording yields defects"
    status, doc = get_json(port, "/api/verdicts?verdict=defect&limit=1000")
    assert status == 200 and [r["frame_id"] for r in doc["rows"]] == defects and doc["next"] is None
    assert all(r["verdict"] == "defect" and r["chain"] for r in doc["rows"])
    comp, board = rows(db, "SELECT component, board_id FROM frames LIMIT 1")[0]
    status, doc = get_json(port, f"/api/verdicts?component={comp}&board={board}&limit=1000")
    want = {r[0] for r in rows(db, "SELECT frame_id FROM frames WHERE component=? AND board_id=?", (comp, board))}
    assert {r["frame_id"] for r in doc["rows"]} == want and all(r["component"] == comp for r in doc["rows"])
    times = sorted(r[0] for r in rows(db, "SELECT decided_at FROM verdicts"))
    mid = times[len(times) // 2]
    at = datetime.fromtimestamp(mid, timezone.utc)
    iso = at.isoformat().replace("+00:00", "Z")                 # to the microsecond, as a person writes it
    status, doc = get_json(port, f"/api/verdicts?since={quote(iso)}&limit=1000")
    assert len(doc["rows"]) == sum(t >= at.timestamp() for t in times) > 0
    status, doc = get_json(port, f"/api/verdicts?since={mid!r}&limit=1000")
    assert len(doc["rows"]) == sum(t >= mid for t in times)


def test_a_defect_frame_has_its_chain_outputs_versions_and_thumbnail(served):
    port, db = served.metrics_port, served.cfg.db_path
    fid, chain = rows(db, "SELECT frame_id, chain FROM verdicts WHERE verdict='defect' LIMIT 1")[0]
    status, doc = get_json(port, f"/api/frames/{quote(fid, safe='')}")
    assert status == 200 and doc["frame_id"] == fid and doc["verdict"]["verdict"] == "defect"
    assert [s["expert_id"] for s in doc["steps"]] == json.loads(chain) == doc["verdict"]["chain"]
    assert all(s["output"] and s["expert_version"] == doc["verdict"]["versions"][s["expert_id"]]
               for s in doc["steps"])
    mime, b64 = doc["thumbnail"].removeprefix("data:").split(";base64,")
    img = cv2.imdecode(np.frombuffer(base64.b64decode(b64), np.uint8), cv2.IMREAD_COLOR)
    assert mime == "image/jpeg" and img is not None and max(img.shape[:2]) <= 96
    status, headers, body = get(port, doc["thumbnail_url"])
    assert status == 200 and headers["Content-Type"] == "image/jpeg" and body == base64.b64decode(b64)
    passed = rows(db, "SELECT frame_id FROM verdicts WHERE verdict='pass' LIMIT 1")[0][0]
    status, doc = get_json(port, f"/api/frames/{passed}")
    assert status == 200 and doc["thumbnail"] is None and doc["steps"]       # only defects keep an image
    assert get(port, f"/api/frames/{passed}/thumbnail")[0] == 404
    assert get(port, "/api/frames/no-such-frame")[0] == 404
    assert rows(db, "SELECT count(*) FROM thumbnails")[0][0] == rows(
        db, "SELECT count(*) FROM verdicts WHERE verdict='defect'")[0][0]


def test_status_pools_health_and_metrics_tell_what_the_agent_did(served):
    port, db = served.metrics_port, served.cfg.db_path
    n = rows(db, "SELECT count(*) FROM verdicts")[0][0]
    status, doc = get_json(port, "/api/status")
    assert status == 200 and doc["line"] == "T" and doc["health"]["ready"] is True
    assert doc["flow"]["accepted"] == doc["flow"]["received"] == n
    assert sum(doc["flow"]["verdicts"].values()) == n and doc["latency"]["count"] == n
    assert [e["name"] for e in doc["executors"]] == [e.name for e in served.executors]
    assert sum(e["batches"] for e in doc["executors"]) == rows(db, "SELECT count(DISTINCT batch_id) FROM inferences")[0][0]
    defects = {r[0] for r in rows(db, "SELECT frame_id FROM verdicts WHERE verdict='defect'")}
    assert doc["defects"] and {d["frame_id"] for d in doc["defects"]} <= defects
    assert {e["event"] for e in doc["timeline"]} >= {"load", "evict"}
    status, pools = get_json(port, "/api/pools")
    assert status == 200
    for p in pools["pools"]:
        pool = served.pools[p["name"]]
        assert {r["expert_id"] for r in p["residents"]} == set(pool.resident())
        assert p["capacity"] == pool.capacity and 0 < p["resident_bytes"] <= p["capacity"]
        assert p["declined"] == pool.stats().declined and p["admits"] == pool.stats().admits
    status, health = get_json(port, "/api/health")
    assert status == 200 and health == {"ready": True, "reasons": [], "warnings": [], "inflight": 0,
                                        "max_inflight": served.cfg.max_inflight}
    status, headers, body = get(port, "/metrics")
    assert status == 200 and f'coe_frames_received_total{{line="T"}} {float(n)}' in body.decode()
    status, headers, body = get(port, "/")
    assert status == 200 and "default-src 'none'" in headers["Content-Security-Policy"]
    assert f"/static/app.js?token={TOKEN}".encode() in body                      # the page passes its token on
    assert get(port, "/static/app.js")[0] == 200 and get(port, "/static/../agent.py")[0] == 404


@pytest.mark.parametrize("query, param", [
    ("limit=abc", "limit"), ("limit=0", "limit"), ("limit=5000", "limit"), ("verdict=maybe", "verdict"),
    ("since=yesterday", "since"), ("since=nan", "since"), ("next=garbage", "next"), ("verdicts=defect", "verdicts"),
    ("limit=5&limit=6", "limit"), ("component=", "component"),
    ("next=1.0:99999999999999999999", "next"), ("next=1.0:-1", "next"),     # past SQLite's 64-bit rowids
])
def test_malformed_parameters_get_a_400_naming_them(served, query, param):
    status, doc = get_json(served.metrics_port, f"/api/verdicts?{query}")
    assert status == 400 and doc["param"] == param and f"'{param}'" in doc["error"]


def test_too_many_query_parameters_are_a_400_even_with_the_token_among_them(served):
    query = "&".join(f"p{i}=1" for i in range(80)) + f"&token={TOKEN}"
    status, _, body = get(served.metrics_port, f"/api/verdicts?{query}", auth=False)
    assert status == 400 and "too many query parameters (at most 64)" in json.loads(body)["error"]


def test_nothing_can_be_written(served):
    port, db = served.metrics_port, served.cfg.db_path
    before = rows(db, "SELECT count(*) FROM verdicts")[0][0]
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, body = get(port, "/api/verdicts", method=method, data=b'{"verdict": "pass"}')
        assert status == 405 and headers["Allow"] == "GET, HEAD", method
    assert rows(db, "SELECT count(*) FROM verdicts")[0][0] == before


def test_a_foreign_host_name_is_refused_on_loopback(served):
    """DNS rebinding: a page elsewhere that points its own name at 127.0.0.1 reads nothing."""
    status, doc = get_json(served.metrics_port, "/api/verdicts", headers={"Host": "evil.example:9105"})
    assert status == 403
    assert get(served.metrics_port, "/api/health", headers={"Host": f"localhost:{served.metrics_port}"})[0] == 200


def test_every_request_must_present_the_token(served):
    port = served.metrics_port
    for path in ("/", "/metrics", "/api/verdicts", "/api/health", "/static/app.js", "/api/stream",
                 "/api/frames/x/thumbnail"):
        assert get(port, path, auth=False)[0] == 401, path
        assert get(port, path, headers={"Authorization": "Bearer wrong-token-wrong-token"})[0] == 401, path
        assert get(port, path + "?token=" + TOKEN[:-1] + "X", auth=False)[0] == 401, path
    status, headers, body = get(port, "/api/verdicts", auth=False)
    assert headers["WWW-Authenticate"].startswith("Bearer") and "token" in json.loads(body)["error"]
    assert get(port, f"/api/verdicts?limit=5&token={TOKEN}", auth=False)[0] == 200   # as a browser sends it
    assert get(port, "/api/verdicts", method="POST", auth=False)[0] == 401           # refused before anything


def test_health_says_why_an_agent_is_not_ready(tiny_line):
    agent = Agent(load_config(tiny_line, env={}))
    h = agent.health()
    assert not h.ready and h.reasons == ["not started"]
    agent.stop()


def test_a_server_off_loopback_without_a_token_warns_and_one_with_a_token_does_not(tmp_path, caplog):
    from prometheus_client import CollectorRegistry

    from edge_agent.status_server import StatusServer

    db = tmp_path / "r.db"
    sqlite3.connect(db).close()
    with caplog.at_level("WARNING", logger="edge_agent.status_server"):
        open_server = StatusServer("0.0.0.0", 0, registry=CollectorRegistry(), model=None, db_path=db).start()
        guarded = StatusServer("0.0.0.0", 0, registry=CollectorRegistry(), model=None, db_path=db,
                               token=TOKEN).start()
    open_server.close()
    guarded.close()
    warned = [r.getMessage() for r in caplog.records if "without metrics.token" in r.getMessage()]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]
