"""The agent end to end: real loopback ZeroMQ, real SQLite, real (tiny) models."""
from __future__ import annotations

import json
import sqlite3
import threading
import time
import urllib.request
from collections import Counter

import cv2
import numpy as np
import pytest
import zmq

from edge_agent import protocol as P
from edge_agent.agent import Agent
from edge_agent.config import load_config
from edge_agent.replay import replay, send_messages
from storage.recording import Recording

from conftest import verdict_rows


@pytest.fixture
def agent(tiny_line):
    a = Agent(load_config(tiny_line, env={})).start()
    yield a
    a.stop()


def db_rows(agent, sql):
    con = sqlite3.connect(agent.cfg.db_path)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def subscribe(endpoint: str, got: list, stop: threading.Event) -> threading.Thread:
    """A SUB socket on the agent's verdicts: returns once its connection's handshake is done (a PUB drops what it
    sends before a subscriber joins), then a short wait for the subscription itself to reach the agent."""
    from zmq.utils.monitor import recv_monitor_message

    ready = threading.Event()

    def loop():
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(endpoint)
        if mon.poll(30_000):
            recv_monitor_message(mon)
            ready.set()
        sub.disable_monitor()
        mon.close(linger=0)
        while not stop.is_set():
            if sub.poll(50):
                got.append(sub.recv_multipart())
        sub.close(linger=0)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    assert ready.wait(30), f"no handshake with {endpoint}"
    time.sleep(0.3)
    return t


def _until(cond, seconds: float = 30.0) -> bool:
    """Poll `cond` until true or `seconds` pass (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_every_frame_gets_exactly_one_verdict(agent, tiny_recording):
    rec = Recording(tiny_recording)
    got, stop = [], threading.Event()
    t = subscribe(agent.endpoints["publish"], got, stop)
    report = replay(rec, agent.endpoints["ingest"], window=16)
    assert (report.accepted, report.rejected, report.unacked) == (len(rec), 0, [])
    assert agent.wait_verdicts(len(rec), timeout=120)
    assert _until(lambda: len(got) >= len(rec))          # the last verdicts published may still be on their way
    stop.set()
    t.join(10)
    rows = verdict_rows(agent.cfg.db_path)
    ids = [r["frame_id"] for r in rows]
    assert sorted(ids) == sorted(f.header["frame_id"] for f in rec)
    assert all(r["verdict"] in ("pass", "defect") for r in rows), Counter(r["reason"] for r in rows)
    published = [json.loads(m[1]) for m in got]
    assert sorted(p["frame_id"] for p in published) == sorted(ids)
    assert all(m[0] == b"T" for m in got)
    # batching by expert happened, and the 20 MB budget forced loads and evictions
    batches = db_rows(agent, "SELECT count(DISTINCT batch_id), count(*) FROM inferences")[0]
    assert batches[0] < batches[1]
    events = dict(db_rows(agent, "SELECT event, count(*) FROM expert_events GROUP BY event"))
    used = db_rows(agent, "SELECT count(DISTINCT expert_id) FROM inferences")[0][0]
    loaded = db_rows(agent, "SELECT sum(nbytes) FROM expert_events WHERE event='load'")[0][0]
    assert events.get("load", 0) >= used >= 3 and events.get("evict", 0) > 0
    assert loaded > 20_000_000  # more bytes went through the pool than its budget holds
    # the metrics endpoint tells the same story, read when scraped (the in-flight gauge was only set when ingest
    # next received a message: it showed frames long finished)
    assert _until(lambda: agent._inflight_count() == 0), "frames still in flight"
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5).read().decode()
    assert f'coe_frames_inflight{{line="T"}} 0.0' in text and f'coe_queue_depth{{line="T"}} 0.0' in text
    assert f'coe_frames_received_total{{line="T"}} {float(len(rec))}' in text
    assert "coe_expert_evictions_total" in text and "coe_queue_depth" in text
    assert f'coe_scheduler_aged_total{{line="T"}} {float(agent.scheduler.aged)}' in text
    assert f'coe_scheduler_filled_total{{line="T"}} {float(agent.scheduler.filled)}' in text
    assert f'coe_scheduler_held_total{{line="T"}} {float(agent.scheduler.held)}' in text
    assert "coe_read_ahead_reads" not in text          # a CPU-only line has no host tier to read ahead into


def test_duplicates_are_acked_and_not_rerun(agent, tiny_recording):
    rec = Recording(tiny_recording)
    first = replay(rec, agent.endpoints["ingest"])
    assert first.accepted == len(rec)
    assert agent.wait_verdicts(len(rec), timeout=120)
    steps = db_rows(agent, "SELECT count(*) FROM inferences")[0][0]
    again = replay(rec, agent.endpoints["ingest"])
    assert (again.accepted, again.duplicate) == (0, len(rec))
    time.sleep(0.5)
    assert agent.wait_idle(10)
    assert db_rows(agent, "SELECT count(*) FROM inferences")[0][0] == steps
    assert db_rows(agent, "SELECT count(*) FROM verdicts")[0][0] == len(rec)


def _png(seed: int) -> bytes:
    img = np.random.default_rng(seed).integers(0, 255, (40, 40, 3), dtype=np.uint8)
    return cv2.imencode(".png", img)[1].tobytes()


def _header(fid: str, **over) -> bytes:
    h = {"v": 1, "frame_id": fid, "line": "T", "board_id": "B1", "component": "R0402", "ts": 1.0,
         "encoding": "png"}
    h.update(over)
    return json.dumps({k: v for k, v in h.items() if v is not None}).encode()


BAD_CASES = {
    "bad-json": ([b'{"frame_id": "bad-json", ', _png(1)], P.MALFORMED_JSON),
    "bad-missing": ([_header("bad-missing", board_id=None), _png(2)], P.MISSING_FIELD),
    "bad-type": ([_header("bad-type", ts="noon"), _png(3)], P.BAD_FIELD),
    "bad-version": ([_header("bad-version", v=9), _png(4)], P.UNKNOWN_VERSION),
    "bad-line": ([_header("bad-line", line="Z"), _png(5)], P.WRONG_LINE),
    "bad-comp": ([_header("bad-comp", component="FLUX-CAPACITOR"), _png(6)], P.UNKNOWN_COMPONENT),
    "bad-image": ([_header("bad-image"), b"\x89PNG\r\n\x1a\nnot really a png IEND\xaeB`\x82"], P.BAD_IMAGE),
    "bad-trunc": ([_header("bad-trunc"), _png(7)[:60]], P.BAD_IMAGE),
    "bad-big": ([_header("bad-big", encoding="raw", shape=[200, 200, 3]), bytes(200 * 200 * 3)], P.OVERSIZE),
    "bad-parts": ([_header("bad-parts"), _png(8), b"extra"], P.BAD_FRAMING),
    # a JSON escape of half a surrogate pair: no SQLite row or ack can hold it (it blocked ingest once)
    "bad-surrogate": ([_header("bad-surrogate", board_id="\ud800"), _png(9)], P.BAD_FIELD),
    "bad-one-part": ([_header("bad-one-part")], P.BAD_FRAMING),
}


def test_bad_input_is_rejected_with_reason_and_good_frames_still_served(agent):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(agent.endpoints["ingest"])
    good = [f"good-{i}" for i in range(12)]
    plan = []
    for i, fid in enumerate(good):
        plan.append((fid, [_header(fid, component=["R0402", "C0402", "U-SOIC8"][i % 3]), _png(100 + i)]))
        bad = list(BAD_CASES)[i % len(BAD_CASES)] if i < len(BAD_CASES) else None
        if bad:
            plan.append((bad, BAD_CASES[bad][0]))
    for name in list(BAD_CASES)[len(good):]:
        plan.append((name, BAD_CASES[name][0]))
    for _, parts in plan:
        sock.send_multipart(parts)
    acks = {}
    deadline = time.time() + 30
    while len(acks) < len(plan) and time.time() < deadline:
        if sock.poll(200):
            fid, status, detail = (x.decode() for x in sock.recv_multipart())
            acks[fid] = (status, detail)
    sock.close(linger=0)
    for name, (_, reason) in BAD_CASES.items():
        status, detail = acks["" if name == "bad-json" else name]  # no frame_id can be read from bad JSON
        assert status == "rejected" and detail.startswith(reason + ":"), (name, detail)
    assert all(acks[g][0] == "accepted" for g in good)
    assert agent.wait_verdicts(len(good), timeout=60)
    assert {r["frame_id"] for r in verdict_rows(agent.cfg.db_path)} == set(good)
    kinds = Counter(k for (k,) in db_rows(agent, "SELECT kind FROM errors"))
    for name, (_, reason) in BAD_CASES.items():
        assert kinds[f"reject:{reason}"] >= 1, reason
    named = {fid for (fid,) in db_rows(agent, "SELECT frame_id FROM errors WHERE frame_id IS NOT NULL")}
    assert {"bad-missing", "bad-line", "bad-comp", "bad-image", "bad-parts"} <= named


def test_resend_after_lost_ack_is_a_duplicate_not_a_second_verdict(agent, tiny_recording):
    rec = Recording(tiny_recording)
    frames = list(rec)[:5]
    msgs = [(f.header["frame_id"], [P.encode_header(f.header), rec.payload(f)]) for f in frames]
    # the same frames twice in one stream: the second copy stands for a resend after a lost ack
    report = send_messages(msgs + msgs, agent.endpoints["ingest"])
    assert report.accepted == 5
    assert agent.wait_verdicts(5, timeout=60)
    time.sleep(0.3)
    assert db_rows(agent, "SELECT count(*) FROM verdicts")[0][0] == 5
    assert db_rows(agent, "SELECT count(*) FROM frames")[0][0] == 5


def _png_bomb() -> bytes:
    """A valid-looking PNG header claiming 60000 x 60000 pixels: must be refused before decoding."""
    import struct
    import zlib
    ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 1000)) + \
        chunk(b"IEND", b"")


def test_hostile_messages_are_rejected_and_ingest_survives(agent):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(agent.endpoints["ingest"])
    deep = b'{"frame_id": "deep", "x": ' + b"[" * 30000 + b"]" * 30000 + b"}"
    cases = [
        ([deep, _png(1)], P.MALFORMED_JSON),
        ([_header("huge-ts", ts=10 ** 400), _png(2)], P.BAD_FIELD),
        ([_header("bomb"), _png_bomb()], P.BAD_IMAGE),
    ]
    for parts, _ in cases:
        sock.send_multipart(parts)
    sock.send_multipart([_header("after"), _png(3)])
    acks = []
    deadline = time.time() + 30
    while len(acks) < 4 and time.time() < deadline:
        if sock.poll(200):
            acks.append([x.decode() for x in sock.recv_multipart()])
    sock.close(linger=0)
    got = {a[0]: a for a in acks}
    assert got["huge-ts"][1] == "rejected" and got["huge-ts"][2].startswith(P.BAD_FIELD)
    assert got["bomb"][1] == "rejected" and got["bomb"][2].startswith(P.BAD_IMAGE) and "60000" in got["bomb"][2]
    assert any(a[1] == "rejected" and a[2].startswith(P.MALFORMED_JSON) for a in acks)
    assert got["after"][1] == "accepted"
    assert agent.wait_verdicts(1, timeout=60)
    assert agent.dead_threads() == []


def test_a_result_with_fewer_outputs_than_frames_gives_every_frame_a_verdict(tiny_line, tiny_recording, monkeypatch):
    """An executor (or a node on another version) that answers a batch with one output short: the frames past the
    end of its list must not be left without a verdict; the whole batch gets error verdicts naming the fault."""
    from executors.executor import Executor

    run_batch = Executor.run_batch
    short = []

    def one_short(self, batch):
        result = run_batch(self, batch)
        if result.error is None and len(result.outputs) >= 2 and not short:
            short.append(batch.id)
            result.outputs = result.outputs[:-1]
        return result
    monkeypatch.setattr(Executor, "run_batch", one_short)
    rec = Recording(tiny_recording)
    agent = Agent(load_config(tiny_line, env={})).start()
    try:
        report = replay(rec, agent.endpoints["ingest"], window=16)
        assert report.accepted == len(rec)
        assert agent.wait_verdicts(len(rec), timeout=120)
        rows = verdict_rows(agent.cfg.db_path)
        assert sorted(r["frame_id"] for r in rows) == sorted(f.header["frame_id"] for f in rec)   # one each
        assert short, "no batch of two or more frames ran"
        failed = [r for r in rows if r["verdict"] == "error"]
        assert len(failed) >= 2 and all("output(s) for the" in r["reason"] and f"batch {short[0]}" in r["reason"]
                                        for r in failed)
    finally:
        agent.stop()


def test_the_replay_client_counts_answers_that_are_not_acks_and_still_gets_every_frame_acked():
    """A peer on the ingest port that answers the first send of each frame with something that is not an ack (two
    parts, or an unknown status): those are counted and described, never taken as acks, and the frames are sent
    again until a real ack comes."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen, stop = {}, threading.Event()

    def serve():
        while not stop.is_set():
            if not router.poll(20):
                continue
            peer, *parts = router.recv_multipart()
            fid = json.loads(parts[0])["frame_id"]
            seen[fid] = seen.get(fid, 0) + 1
            if seen[fid] == 1:       # first send: a malformed answer, by frame
                bad = [fid.encode(), b"accepted"] if fid.endswith("0") else [fid.encode(), b"acceptd", b""]
                router.send_multipart([peer, *bad])
            else:
                router.send_multipart([peer, fid.encode(), b"accepted", b""])
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    header = {"v": 1, "line": "T", "board_id": "b", "component": "R0402", "image": {"encoding": "raw", "height": 1,
                                                                                     "width": 1, "channels": 3}}
    msgs = [(f"f{i}", [P.encode_header({**header, "frame_id": f"f{i}"}), b"\0\0\0"]) for i in range(4)]
    try:
        report = send_messages(msgs, f"tcp://127.0.0.1:{port}", ack_timeout=0.3, deadline=30)
    finally:
        stop.set()
        t.join(10)
        router.close(linger=0)
    assert report.accepted == 4 and report.rejected == 0 and report.unacked == []
    assert report.malformed_acks == 4 and report.resent >= 4 and all(n >= 2 for n in seen.values())
    assert any("1 part(s), not 3" in m or "2 part(s), not 3" in m for m in report.malformed)
    assert any("unknown status 'acceptd'" in m for m in report.malformed)
    assert report.to_json()["malformed_acks"] == 4


def test_a_payload_far_past_the_limit_is_refused_before_it_is_held_and_the_agent_serves_on(agent, tiny_recording):
    """64 KiB limit (the test line): a payload a little over it is read and rejected by name; one past the ingest
    socket's hard cap (4x + 1 MiB) is dropped by ZeroMQ, its sender disconnected, unacked; a good frame after it
    from another client is served."""
    from edge_agent.agent import ingest_hard_cap

    limit = agent.cfg.max_payload_bytes
    cap = ingest_hard_cap(limit)
    assert limit == 64 * 1024 and cap == 4 * limit + (1 << 20)
    near = [("near", [_header("near", encoding="raw", shape=[300, 300, 3]), bytes(300 * 300 * 3)])]   # 270 KB
    rep = send_messages(near, agent.endpoints["ingest"], ack_timeout=5, deadline=30)
    assert rep.rejected == 1 and rep.reasons[P.OVERSIZE] == 1
    huge = [("huge", [_header("huge", encoding="raw", shape=[1, cap, 1]), bytes(cap + 1)])]
    rep = send_messages(huge, agent.endpoints["ingest"], ack_timeout=1, deadline=3)
    assert rep.acked == 0 and rep.unacked == ["huge"]              # never read: no ack to give
    rec = Recording(tiny_recording)
    f = next(iter(rec))
    good = [(f.header["frame_id"], [P.encode_header(f.header), rec.payload(f)])]
    rep = send_messages(good, agent.endpoints["ingest"], ack_timeout=5, deadline=30)
    assert rep.accepted == 1 and agent.wait_verdicts(1, timeout=60)


def test_one_frames_output_that_cannot_be_handled_costs_that_frame_alone(tiny_line, tiny_recording):
    """A decision that raises for one frame of a batch: that frame gets an error verdict naming the failure; the
    frames beside it in the batch keep their own verdicts (finished or handed on), and every frame is published
    exactly once (a batch-wide fallback used to give them all a second, 'error' verdict)."""
    rec = Recording(tiny_recording)
    ids = [f.header["frame_id"] for f in rec]
    victim = ids[len(ids) // 2]
    calls = {"n": 0}
    agent = Agent(load_config(tiny_line, env={})).start()
    # which frame a decision is for is known in `_on_output`: fail there for the victim, first stage only
    real_on_output = agent._on_output

    def on_output(result, req, out, latency_ms, handed):
        if req.frame.frame_id == victim and req.stage == 0:
            calls["n"] += 1
            raise ValueError("a box tuple of the wrong length")
        return real_on_output(result, req, out, latency_ms, handed)
    agent._on_output = on_output
    got, stop = [], threading.Event()
    try:
        t = subscribe(agent.endpoints["publish"], got, stop)
        report = replay(rec, agent.endpoints["ingest"], window=16)
        assert report.accepted == len(rec)
        assert agent.wait_verdicts(len(rec), timeout=120)
        assert _until(lambda: len(got) >= len(rec))
        time.sleep(0.5)                                          # a second verdict would be published by now
        stop.set()
        t.join(10)
        rows = {r["frame_id"]: r for r in verdict_rows(agent.cfg.db_path)}
    finally:
        agent.stop()
    assert calls["n"] == 1 and sorted(rows) == sorted(ids)
    assert rows[victim]["verdict"] == "error" and "a box tuple of the wrong length" in rows[victim]["reason"]
    others = [r for fid, r in rows.items() if fid != victim]
    assert all(r["verdict"] in ("pass", "defect") for r in others)        # its batch mates kept their verdicts
    published = Counter(json.loads(m[1])["frame_id"] for m in got)
    assert set(published) == set(ids) and max(published.values()) == 1   # each frame published once


def test_a_journaled_frame_whose_ack_cannot_be_sent_still_gets_its_verdict(tiny_line, tiny_recording, monkeypatch):
    """Ingest commits a frame to the journal, then fails to send its ack (a ZeroMQ error, say): the frame is handed
    to the agent anyway and gets its verdict, rather than waiting in the journal for a restart."""
    from edge_agent import ingest as ingest_mod

    real_send = ingest_mod.Ingest._send
    failed = []

    def send(self, identity, ack):
        if ack[1] == P.ACCEPTED.encode() and not failed:
            failed.append(ack[0].decode())
            raise RuntimeError("the socket went away")
        return real_send(self, identity, ack)
    monkeypatch.setattr(ingest_mod.Ingest, "_send", send)
    rec = Recording(tiny_recording)
    f = next(iter(rec))
    agent = Agent(load_config(tiny_line, env={})).start()
    try:
        send_messages([(f.header["frame_id"], [P.encode_header(f.header), rec.payload(f)])],
                      agent.endpoints["ingest"], ack_timeout=1, deadline=2)
        assert failed == [f.header["frame_id"]]
        assert agent.wait_verdicts(1, timeout=60)
        assert [r["frame_id"] for r in verdict_rows(agent.cfg.db_path)] == failed
    finally:
        agent.stop()


def test_a_frame_the_scheduler_cannot_take_gets_an_error_verdict_and_the_rest_are_scheduled(tiny_line,
                                                                                             tiny_recording):
    """A scheduler fault on one frame's first step (a cost estimate that raises, say): that frame gets an error
    verdict naming it, and the frames accepted after it in the same read are still scheduled and served."""
    rec = Recording(tiny_recording)
    msgs = [(f.header["frame_id"], [P.encode_header(f.header), rec.payload(f)]) for f in list(rec)[:6]]
    victim = msgs[2][0]
    agent = Agent(load_config(tiny_line, env={})).start()
    real = agent.scheduler.submit

    def submit(req):
        if req.frame.frame_id == victim and req.stage == 0:
            raise RuntimeError("negative estimate")
        return real(req)
    agent.scheduler.submit = submit
    try:
        rep = send_messages(msgs, agent.endpoints["ingest"], window=16)
        assert rep.accepted == 6
        assert agent.wait_verdicts(6, timeout=60)
        rows = {r["frame_id"]: r for r in verdict_rows(agent.cfg.db_path)}
    finally:
        agent.stop()
    assert sorted(rows) == sorted(fid for fid, _ in msgs)
    assert rows[victim]["verdict"] == "error" and "scheduling failed: RuntimeError: negative estimate" in \
        rows[victim]["reason"]
    assert all(r["verdict"] in ("pass", "defect") for fid, r in rows.items() if fid != victim)


def test_a_resend_after_a_config_change_is_still_a_duplicate_not_a_reject(tmp_path, tiny_zoo, tiny_recording):
    """Frames accepted, then the agent restarted with a payload limit they now exceed: their resends (the first
    acks were lost) are `duplicate`, not `rejected oversize`, and nothing runs twice."""
    import shutil

    from conftest import write_line

    shutil.copytree(tiny_zoo, tmp_path / "experts")
    rec = Recording(tiny_recording)
    frames = list(rec)[:6]
    msgs = [(f.header["frame_id"], [P.encode_header(f.header), rec.payload(f)]) for f in frames]
    first = Agent(load_config(write_line(tmp_path / "a", store=tmp_path / "experts"), env={})).start()
    try:
        assert send_messages(msgs, first.endpoints["ingest"]).accepted == len(msgs)
        assert first.wait_verdicts(len(msgs), timeout=60)
    finally:
        first.stop()
    smaller = min(len(parts[1]) for _, parts in msgs) - 1
    again = Agent(load_config(write_line(tmp_path / "a", store=tmp_path / "experts", max_payload_bytes=smaller),
                              env={})).start()
    try:
        report = send_messages(msgs, again.endpoints["ingest"])
        assert (report.duplicate, report.rejected, report.accepted) == (len(msgs), 0, 0)
        assert again.wait_idle(10) and again.verdicts_total == 0
    finally:
        again.stop()


def test_a_reused_frame_id_with_other_bytes_is_an_id_conflict_not_a_silent_duplicate(agent):
    """An AOI counter that reset sends a new image under an id accepted before: answered `id_conflict` (that
    frame would otherwise never be inspected), while a resend of the same bytes is still `duplicate`.  The same
    inside one read: the second image under one id is the conflict."""
    ctx = zmq.Context.instance()
    first = [("reuse-1", [_header("reuse-1"), _png(201)])]
    assert send_messages(first, agent.endpoints["ingest"]).accepted == 1
    again = [("reuse-1", [_header("reuse-1"), _png(201)])]
    report = send_messages(again, agent.endpoints["ingest"])
    assert (report.duplicate, report.rejected) == (1, 0)
    other = [("reuse-1", [_header("reuse-1"), _png(202)])]
    report = send_messages(other, agent.endpoints["ingest"])
    assert report.rejected == 1 and report.reasons == {P.ID_CONFLICT: 1}
    sock = ctx.socket(zmq.DEALER)                         # two images under one new id, in one read
    sock.connect(agent.endpoints["ingest"])
    sock.send_multipart([_header("reuse-2"), _png(203)])
    sock.send_multipart([_header("reuse-2"), _png(204)])
    acks = []
    deadline = time.time() + 30
    while len(acks) < 2 and time.time() < deadline:
        if sock.poll(200):
            acks.append(tuple(x.decode() for x in sock.recv_multipart()))
    sock.close(linger=0)
    assert [a[1] for a in acks] == ["accepted", "rejected"] and acks[1][2].startswith(P.ID_CONFLICT + ":")
    # the replay client, sending a recording whose counter reset: the second frame under the id is reported
    reset = [("reuse-3", [_header("reuse-3"), _png(205)]), ("reuse-3", [_header("reuse-3"), _png(206)])]
    report = send_messages(reset, agent.endpoints["ingest"])
    assert (report.accepted, report.rejected, report.reasons) == (1, 1, {P.ID_CONFLICT: 1})
    assert report.rejected_ids == ["reuse-3"]
    assert agent.wait_verdicts(3, timeout=60)
    assert db_rows(agent, "SELECT count(*) FROM errors WHERE kind='reject:id_conflict'") == [(3,)]
