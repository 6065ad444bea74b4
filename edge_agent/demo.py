"""`coe-agent demo`: the whole job in one command, on an embedded default line.

Builds the expert zoo and a synthetic recording if they are absent, starts the
agent in this process on loopback, replays the recording through the real
ZeroMQ protocol, waits for every verdict, and prints a summary from the
database.  Its exit code says whether every frame got exactly one verdict.
"""
from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq
from tqdm import tqdm

from coe import CoEError, CoEModel
from storage.expert_store import ExpertStore
from storage.recording import Recording
from storage.synthetic import draw_component, record_synthetic

from .agent import Agent
from .config import LineConfig
from .instance_lock import InstanceLock
from .replay import replay
from .zoo_train import SOLDER_RATE
from .zoo import build_zoo


def sample_images_for(model: CoEModel, n: int = 48, seed: int = 0, size: int = 64):
    """Calibration images for a classifier: its components, labels drawn by its priors."""
    def sample(expert_id: str) -> list[np.ndarray]:
        expert = model.experts[expert_id]
        comps = [c.name for c in model.components.values() if c.classifier == expert_id]
        if not comps:
            return []
        rng = np.random.default_rng([seed, 7, sum(map(ord, expert_id))])
        labels = [lb for lb in expert.classes]
        p = np.array([expert.prior(lb) for lb in labels])
        p = p / p.sum() if p.sum() > 0 else None
        out = []
        for i in range(n):
            label = labels[int(rng.choice(len(labels), p=p))]
            look = label if label in ("ok", "missing", "misaligned", "wrong_part") else "ok"
            out.append(draw_component(comps[i % len(comps)], look, rng, size))
        return out
    return sample


def stage(msg: str, quiet: bool = False) -> None:
    """One plain progress line on stderr: visible in logs where a progress bar is not."""
    if not quiet:
        tqdm.write(f"[demo] {msg}", file=sys.stderr)


def ensure_zoo(cfg: LineConfig, model: CoEModel, *, seed: int = 0, quiet: bool = False) -> ExpertStore:
    store = ExpertStore(cfg.store_path, verify=cfg.expert_verify)
    # missing, or stored for another architecture (the spec changed since): built again
    todo = [eid for eid, e in model.experts.items()
            if not store.has(eid) or (store.entry(eid).arch, store.entry(eid).kind) != (e.arch, e.kind)]
    stage(f"expert zoo: {len(model.experts) - len(todo)} of {len(model.experts)} experts present in "
          f"{cfg.store_path}" + (f", building {len(todo)}" if todo else ""), quiet)
    if todo:
        bar = tqdm(total=len(model.experts), desc="building expert zoo", unit="expert", disable=quiet or None)
        bar.update(len(model.experts) - len(todo))
        build_zoo(model, store, seed=seed, sample_images=sample_images_for(model, seed=seed),
                  progress=lambda eid: bar.update(1))
        bar.close()
    return store


def ensure_recording(cfg: LineConfig, model: CoEModel, frames: int, seed: int, *, quiet: bool = False) -> Path:
    out = Path(cfg.data_dir) / "recordings" / f"synthetic-{frames}-s{seed}-solder{round(100 * SOLDER_RATE)}"
    if (out / "manifest.jsonl").is_file():
        stage(f"recording: reusing {out}", quiet)
        return out
    stage(f"recording: drawing {frames} synthetic frames into {out}", quiet)
    bar = tqdm(total=frames, desc="recording synthetic frames", unit="frame", disable=quiet or None)
    done = [0]

    def tick(n: int) -> None:
        bar.update(n - done[0])
        done[0] = n
    record_synthetic(model, out, frames, line=cfg.line, seed=seed, overwrite=True, solder_rate=SOLDER_RATE,
                     progress=tick)
    bar.close()
    return out


def demo_db_path(cfg: LineConfig) -> Path:
    """Where the demo's agent writes: apart from the line's own database, which a demo never touches."""
    return Path(cfg.data_dir) / "demo" / "results.db"


def results_command(cfg: LineConfig, config_path: str | None = None) -> str:
    """The exact `coe-agent results` command that lists the demo's verdicts.

    Without --db while the line's own database does not exist yet (`results`
    then falls back to the demo's); with it once the line has run.
    """
    cmd = f"coe-agent results --line {cfg.line}" + (f" --config {config_path}" if config_path else "")
    if Path(cfg.results_db).is_file():
        cmd += f" --db {demo_db_path(cfg)}"
    return cmd + " --verdict defect --limit 10"


@dataclass
class DemoResult:
    summary: dict
    ok: bool


def ensure_trained(cfg: LineConfig, model: CoEModel, *, quiet: bool = False) -> None:
    """Train the classifiers and detectors on synthetic frames unless the store already holds this training."""
    from .progress import step_bars
    from .zoo_train import train_zoo

    store = ExpertStore(cfg.store_path, verify=cfg.expert_verify)
    stage("training the classifiers and detectors on synthetic frames (a first run takes minutes: about 2.5 on "
          "2 cores; later runs reuse what is stored)", quiet)
    with step_bars(disable=quiet) as tick:
        results, detectors = train_zoo(model, store, progress=tick)
    trained = [f"{r.arch} {100 * r.heldout_accuracy:.1f}% held-out, {r.steps} steps in {r.seconds:.0f} s"
               for r in results if not r.skipped]
    stage(f"classifiers: {sum(len(r.experts) for r in results)} trained on synthetic frames"
          + (f" (this run: {'; '.join(trained)})" if trained else " (reused)"), quiet)
    fresh = [d for d in detectors if not d.skipped]
    stage(f"detectors: {len(detectors)} trained on drawn soldering defects" + (" (reused)" if not fresh else ""), quiet)
    for d in fresh:
        stage("  " + d.describe(), quiet)


def check_writable(directory: Path, what: str) -> None:
    """Fail now, naming `directory` and the real reason, rather than after minutes of training whose results
    cannot be stored (the first write then blamed a full disk for a permission)."""
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".coe-write-check-"):
            pass
    except OSError as exc:
        raise CoEError(f"{what} {directory} is not writable: {exc.strerror or exc}") from None


def demo_lock(cfg: LineConfig) -> InstanceLock:
    """One demo per data dir: a second one deleted the first's live database and rewrote its recording."""
    try:
        return InstanceLock(Path(cfg.data_dir) / "demo").acquire()
    except CoEError:
        raise CoEError(f"another 'coe-agent demo' runs on {cfg.data_dir}; wait for it, or give this one another "
                       "data_dir") from None


def run_demo(cfg: LineConfig, model: CoEModel, *, frames: int = 600, seed: int = 0, rate: float | None = None,
             recording: Path | None = None, quiet: bool = False, train: bool = True) -> DemoResult:
    if frames < 1:
        raise CoEError(f"the demo needs at least 1 frame, got {frames}")
    rec = Recording(recording) if recording is not None else None   # a bad --recording: before minutes of training
    check_writable(Path(cfg.store_path), "the expert store")
    check_writable(Path(cfg.data_dir), "the data dir")
    lock = demo_lock(cfg)
    try:
        return _run_demo(cfg, model, frames=frames, seed=seed, rate=rate, rec=rec, quiet=quiet, train=train)
    finally:
        lock.release()


def _run_demo(cfg: LineConfig, model: CoEModel, *, frames: int, seed: int, rate: float | None,
              rec: Recording | None, quiet: bool, train: bool) -> DemoResult:
    if train:                  # first: what training writes, the zoo need not generate
        ensure_trained(cfg, model, quiet=quiet)
    ensure_zoo(cfg, model, seed=seed, quiet=quiet)
    if rec is None:
        rec = Recording(ensure_recording(cfg, model, frames, seed, quiet=quiet))
    rec_dir = rec.root
    demo_db = demo_db_path(cfg)
    if demo_db.parent.exists():
        shutil.rmtree(demo_db.parent)  # each demo run starts from an empty database
    cfg = cfg.model_copy(update={
        "results_db": str(demo_db),
        "ingest": "router+bind:tcp://127.0.0.1:*",
        "publish": "pub+bind:tcp://127.0.0.1:*",
        "metrics": cfg.metrics.model_copy(update={"port": 0}),
    })
    agent = Agent(cfg, model).start()
    stage(f"agent up: ingest {agent.endpoints['ingest']}, publish {agent.endpoints['publish']}, "
          f"status page http://127.0.0.1:{agent.metrics_port}/ (metrics at /metrics)", quiet)
    published = [0]
    stop_sub = threading.Event()
    sub_ready = threading.Event()
    sub_thread = threading.Thread(target=_count_published,
                                  args=(agent.endpoints["publish"], cfg.line, published, stop_sub, sub_ready),
                                  daemon=True)
    sub_thread.start()
    sub_ready.wait(5)
    t0 = time.time()
    try:
        stage(f"replaying {len(rec)} frames " + (f"at {rate:g} frames/s" if rate else "as fast as they are acked"),
              quiet)
        bar = tqdm(total=len(rec), desc="replaying (acked)", unit="frame", disable=quiet or None)
        report = replay(rec, agent.endpoints["ingest"], rate=rate,
                        progress=lambda r: bar.update(r.acked - bar.n))
        bar.close()
        stage(f"{report.accepted} accepted; waiting for their verdicts", quiet)
        vbar = tqdm(total=report.accepted, desc="verdicts", unit="frame", disable=quiet or None)
        while not agent.wait_verdicts(report.accepted, timeout=0.2):
            vbar.update(agent.verdicts_total - vbar.n)
        vbar.update(agent.verdicts_total - vbar.n)
        vbar.close()
    finally:
        drained = agent.stop()
        time.sleep(0.2)
        stop_sub.set()
        sub_thread.join(2)
    summary = summarize(Path(cfg.results_db), t0)
    summary.update(correctness(model, rec, Path(cfg.results_db)))
    summary.update({"sent": report.sent, "accepted": report.accepted, "duplicate": report.duplicate,
                    "rejected": report.rejected, "resent": report.resent, "published": published[0],
                    "recording": str(rec_dir), "line": cfg.line, "metrics_port": agent.metrics_port,
                    "executors": [f"{e.device} x{e.count} {e.memory / 1e6:.0f} MB" for e in cfg.executors],
                    "zoo_bytes": sum(e.nbytes for e in agent.model.experts.values()), "drained": drained,
                    "replay_rate": rate})
    ok = (drained and report.accepted == len(rec) and summary["verdicts"] == len(rec)
          and summary["frames"] == len(rec))
    return DemoResult(summary, ok)


def _count_published(endpoint: str, line: str, counter: list, stop: threading.Event, ready: threading.Event) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, line.encode())
    sub.connect(endpoint)
    time.sleep(0.2)  # let the subscription reach the publisher before frames flow
    ready.set()
    try:
        while not stop.is_set():
            if sub.poll(100):
                sub.recv_multipart()
                counter[0] += 1
    finally:
        sub.close()


def summarize(db_path: Path, t0: float) -> dict:
    """The demo's figures, computed from the database the agent wrote."""
    from storage.results import ResultStore

    rs = ResultStore(db_path, readonly=True)
    try:
        c = rs.counts()
        lat = np.array([r[0] for r in rs.db.execute("SELECT latency_ms FROM verdicts")], dtype=float)
        span = rs.db.execute("SELECT min(received_at) FROM frames").fetchone()[0]
        end = rs.db.execute("SELECT max(decided_at) FROM verdicts").fetchone()[0]
        batches = rs.db.execute("SELECT count(DISTINCT batch_id), count(*) FROM inferences").fetchone()
    finally:
        rs.close()
    seconds = (end - span) if span and end else 0.0
    return {
        "frames": c["frames"], "verdicts": c["verdicts"], "by_verdict": c["by_verdict"],
        "errors": c["errors"], "inferences": c["inferences"],
        "batches": batches[0], "mean_batch": round(batches[1] / batches[0], 2) if batches[0] else 0.0,
        "seconds": round(seconds, 3), "throughput_fps": round(c["verdicts"] / seconds, 1) if seconds else 0.0,
        "p50_ms": round(float(np.percentile(lat, 50)), 1) if lat.size else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 1) if lat.size else None,
        "expert_loads": c["expert_events"].get("load", 0), "evictions": c["expert_events"].get("evict", 0),
        "database": str(db_path),
    }


def correctness(model: CoEModel, rec: Recording, db: Path) -> dict:
    """Whether the verdicts were right: accuracy against the recording's truth, recall per defect label."""
    from .judge import judge, true_verdict

    j = judge(model, rec, db, show=5)
    # a defect label: one whose frames should get a defect verdict (the judge's own truth mapping)
    defect_labels = {f.truth for f in rec
                     if true_verdict(model, f.header.get("component") or f.truth_component, f.truth) == "defect"}
    recall, frames = {}, {}
    for label, counts in sorted(j.confusion_by_label.items()):
        total = sum(counts.values())
        if total and label in defect_labels:
            recall[label] = round(counts.get("defect", 0) / total, 4)
            frames[label] = total
    return {"accuracy": round(j.accuracy, 4), "judged": j.judged, "recall": recall, "defect_frames": frames, "wrong_frames": j.wrong}


def format_summary(s: dict) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["by_verdict"].items())) or "none"
    rows = [
        ("line", s["line"]),
        ("recording", s["recording"]),
        ("frames sent / accepted", f"{s['sent']} / {s['accepted']} (duplicate {s['duplicate']}, "
                                   f"rejected {s['rejected']}, resent {s['resent']})"),
        ("frames in database", s["frames"]),
        ("verdicts", f"{s['verdicts']} ({kinds})"),
        ("verdicts published", s["published"]),
        ("replay", f"{s['replay_rate']:g} frames/s" if s.get("replay_rate") else
                   "as fast as acked (latency includes queueing)"),
        ("throughput", f"{s['throughput_fps']} frames/s over {s['seconds']} s"),
        ("frame latency p50 / p99", f"{s['p50_ms']} ms / {s['p99_ms']} ms"),
        ("expert steps / batches", f"{s['inferences']} in {s['batches']} batches (mean {s['mean_batch']})"),
        ("expert loads / evictions", f"{s['expert_loads']} / {s['evictions']}"),
        ("executors", "; ".join(s["executors"]) + f" for a {s['zoo_bytes'] / 1e6:.0f} MB zoo"),
        ("verdict accuracy", f"{100 * s['accuracy']:.1f}% of {s['judged']} frames with a recorded truth"
                             if s.get("judged") else "no truth in the recording"),
        ("recall per defect label", ", ".join(f"{k} {100 * v:.1f}% of {s.get('defect_frames', {}).get(k, '?')}"
                                              for k, v in s.get("recall", {}).items()) or "-"),
        ("frames it got wrong", ", ".join(s.get("wrong_frames", [])[:5]) or "none"),
        ("errors table rows", s["errors"]),
        ("database", s["database"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def summary_json(s: dict) -> str:
    return json.dumps(s, sort_keys=True)
