"""Fuzz a live agent's ingest with malformed messages (issue #6): the target is 0 crashes.

Real run: an agent (tiny real models) in this process; a seeded generator
mutates valid frames (bit flips, truncation, splices, wrong part counts,
hostile JSON, huge numbers, image bombs) and sends them.  A crash is any of:
an ingest/executor/writer thread dying, a message left without an ack, or a
good frame sent between fuzz cases failing to get its verdict.

Usage: python bench/fuzz_ingest.py [--cases 10000] [--seed 0]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import zmq  # noqa: E402

from coe import parse_spec  # noqa: E402
from conftest import TINY_SPEC, write_line  # noqa: E402
from edge_agent import protocol as P  # noqa: E402
from edge_agent.agent import Agent  # noqa: E402
from edge_agent.config import load_config  # noqa: E402
from edge_agent.demo import sample_images_for  # noqa: E402
from edge_agent.zoo import build_zoo  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from storage.recording import Recording  # noqa: E402
from storage.synthetic import record_synthetic  # noqa: E402


def png_bomb(w: int, h: int) -> bytes:
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))  # noqa: E731
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def mutate(rng: random.Random, header: dict, payload: bytes, i: int) -> list[bytes]:
    h = dict(header, frame_id=f"fz-{i}")
    kind = rng.randrange(12)
    raw = json.dumps(h).encode()
    if kind == 0:
        b = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return [bytes(b), payload]
    if kind == 1:
        return [raw[:rng.randrange(len(raw))], payload]
    if kind == 2:
        k = rng.choice(list(h))
        h[k] = rng.choice([None, 10 ** rng.randint(1, 500), -1, "", [], {}, True, 1e308, "x" * 300])
        return [json.dumps(h).encode(), payload]
    if kind == 3:
        return [raw, payload[:rng.randrange(len(payload))]]
    if kind == 4:
        b = bytearray(payload)
        for _ in range(rng.randint(1, 30)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return [raw, bytes(b)]
    if kind == 5:
        return [raw] * rng.choice([0, 1, 3, 4]) if rng.random() < 0.9 else []
    if kind == 6:
        return [b"[" * rng.randint(1000, 60000) + b"]", payload]
    if kind == 7:
        return [raw, png_bomb(rng.randint(9000, 70000), rng.randint(9000, 70000))]
    if kind == 8:
        return [raw, bytes(rng.randrange(256) for _ in range(rng.randint(0, 2000)))]
    if kind == 9:
        h["encoding"] = "raw"
        h["shape"] = [rng.randint(-3, 9000), rng.randint(-3, 9000), rng.choice([1, 3, 4])]
        return [json.dumps(h).encode(), payload]
    if kind == 10:
        return [rng.randbytes(rng.randint(0, 300)), rng.randbytes(rng.randint(0, 300))]
    return [raw, payload + rng.randbytes(rng.randint(1, 100))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="coe-fuzz-"))
    try:
        model = parse_spec(TINY_SPEC)
        build_zoo(model, ExpertStore(root / "experts"), seed=1, sample_images=sample_images_for(model, n=16, size=32))
        rec = Recording(record_synthetic(model, root / "rec", 50, line="T", seed=2, size=48))
        base = [(f.header, rec.payload(f)) for f in rec]
        cfg = load_config(write_line(root / "line", store=root / "experts"), env={})
        agent = Agent(cfg).start()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(agent.endpoints["ingest"])
        t0 = time.monotonic()
        sent = acks = good_sent = 0
        reasons: dict[str, int] = {}
        for i in range(args.cases):
            header, payload = base[i % len(base)]
            parts = mutate(rng, header, payload, i)
            if not parts:
                continue
            sock.send_multipart(parts)
            sent += 1
            if i % 100 == 99:   # a good frame among the fuzz: it must still be served
                sock.send_multipart([P.encode_header(dict(header, frame_id=f"good-{i}")), payload])
                sent += 1
                good_sent += 1
            # drain acks; every 50 cases let the agent catch up so the socket queues stay short
            catch_up = time.monotonic() + 10 if i % 50 == 49 else 0
            while sock.poll(0) or (acks < sent and time.monotonic() < catch_up and sock.poll(100)):
                msg = sock.recv_multipart()
                acks += 1
                if len(msg) == 3 and msg[1] == b"rejected":
                    r = P.reason_of(msg[2].decode("utf-8", "replace"))
                    reasons[r] = reasons.get(r, 0) + 1
        deadline = time.monotonic() + 60
        while acks < sent and time.monotonic() < deadline:
            if sock.poll(200):
                msg = sock.recv_multipart()
                acks += 1
                if len(msg) == 3 and msg[1] == b"rejected":
                    r = P.reason_of(msg[2].decode("utf-8", "replace"))
                    reasons[r] = reasons.get(r, 0) + 1
        dead = agent.dead_threads()
        agent.wait_idle(60)
        import sqlite3
        con = sqlite3.connect(cfg.db_path)
        good_verdicts = con.execute("SELECT count(*) FROM verdicts WHERE frame_id LIKE 'good-%'").fetchone()[0]
        con.close()
        agent.stop()
        seconds = time.monotonic() - t0
        crashes = len(dead) + (sent - acks) + (good_sent - good_verdicts)
        print(f"fuzz_ingest: real run, live agent, seed {args.seed}, {seconds:.1f} s")
        print(f"{'cases':>7} {'messages':>9} {'acks':>7} {'good sent':>10} {'good verdicts':>14} {'dead threads':>13} "
              f"{'crashes':>8}")
        print(f"{args.cases:7d} {sent:9d} {acks:7d} {good_sent:10d} {good_verdicts:14d} {len(dead):13d} {crashes:8d}")
        print("rejects by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
        print(json.dumps({"bench": "fuzz_ingest", "real_run": True, "cases": args.cases, "messages": sent,
                          "acks": acks, "good_sent": good_sent, "good_verdicts": good_verdicts, "dead_threads": dead,
                          "crashes": crashes, "reasons": reasons, "seconds": round(seconds, 1)}))
        return 0 if crashes == 0 else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
