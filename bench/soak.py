"""Soak under sustained overload: resident memory must stay flat (issue #6).

Real run: a live agent (tiny real models, in this process) with a small
`max_inflight`, and a client that offers frames far faster than the agent can
serve, for a bounded time.  The agent answers `busy` to what it cannot take;
we sample this process's RSS and report the start and end.

Usage: python bench/soak.py [--seconds 60] [--max-inflight 64]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import psutil  # noqa: E402
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-inflight", type=int, default=64)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="coe-soak-"))
    try:
        model = parse_spec(TINY_SPEC)
        build_zoo(model, ExpertStore(root / "experts"), seed=1, sample_images=sample_images_for(model, n=16, size=32))
        rec = Recording(record_synthetic(model, root / "rec", 200, line="T", seed=2, size=48))
        msgs = [[P.encode_header(f.header), rec.payload(f)] for f in rec]
        cfg = load_config(write_line(root / "line", store=root / "experts", max_inflight=args.max_inflight,
                                     retention={"days": 1, "interval_s": 5}), env={})
        agent = Agent(cfg).start()
        proc = psutil.Process(os.getpid())
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(agent.endpoints["ingest"])
        counts = {"sent": 0, "accepted": 0, "busy": 0, "other": 0}
        samples = []
        stop = threading.Event()

        def read_acks():
            while not stop.is_set():
                if sock.poll(50):
                    while True:
                        try:
                            _, status, detail = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if status == b"accepted":
                            counts["accepted"] += 1
                        elif detail.startswith(b"busy"):
                            counts["busy"] += 1
                        else:
                            counts["other"] += 1

        reader = threading.Thread(target=read_acks, daemon=True)
        t0 = time.monotonic()
        warm = t0 + min(10.0, args.seconds / 4)   # RSS 'start' is taken after warm-up (models, caches)
        i = 0
        next_sample = t0
        started_reader = False
        while time.monotonic() - t0 < args.seconds:
            if not started_reader:
                reader.start()
                started_reader = True
            parts = list(msgs[i % len(msgs)])
            header = json.loads(parts[0])
            header["frame_id"] = f"soak-{i}"
            parts[0] = P.encode_header(header)
            try:
                sock.send_multipart(parts, zmq.NOBLOCK)
                counts["sent"] += 1
            except zmq.Again:
                time.sleep(0.001)
            i += 1
            if i % 50 == 0:
                time.sleep(0.01)   # ~4-5k offered frames/s: far beyond what 2 cores serve
            now = time.monotonic()
            if now >= next_sample:
                samples.append((round(now - t0, 1), proc.memory_info().rss))
                next_sample = now + 1.0
        stop.set()
        reader.join(2)
        sock.close(linger=0)
        agent.stop(timeout=120)
        after_warm = [s for s in samples if s[0] >= warm - t0] or samples
        start_rss, end_rss = after_warm[0][1], after_warm[-1][1]
        peak = max(s[1] for s in after_warm)
        print(f"soak: real run, {args.seconds:.0f} s of overload on {os.cpu_count()} cores, max_inflight "
              f"{args.max_inflight}")
        print(f"{'offered':>8} {'accepted':>9} {'busy':>7} {'verdicts':>9} {'rss start MB':>13} {'rss end MB':>11} "
              f"{'peak MB':>8} {'growth':>7}")
        growth = (end_rss - start_rss) / start_rss
        print(f"{counts['sent']:8d} {counts['accepted']:9d} {counts['busy']:7d} {agent.verdicts_total:9d} "
              f"{start_rss / 1e6:13.1f} {end_rss / 1e6:11.1f} {peak / 1e6:8.1f} {growth * 100:6.1f}%")
        print(json.dumps({"bench": "soak", "real_run": True, "seconds": args.seconds, **counts,
                          "verdicts": agent.verdicts_total, "rss_start": start_rss, "rss_end": end_rss,
                          "rss_peak": peak, "growth": round(growth, 4), "samples": samples}))
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
