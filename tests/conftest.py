"""Shared fixtures: a tiny real line (small real models, real files, loopback sockets)."""
from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import yaml

from coe import load_spec

TINY_SPEC = {
    "name": "tiny",
    "experts": [
        *[{"id": f"cls-{c}", "arch": "torchvision/mobilenet_v3_small", "kind": "classifier",
           "classes": ["ok", "missing", "misaligned", "wrong_part"], "input_size": 32,
           "priors": {"ok": 0.7, "missing": 0.1, "misaligned": 0.1, "wrong_part": 0.1},
           "next": {"ok": "det-2term" if c != "u-soic8" else "det-ic"}}
          for c in ("r0402", "c0402", "r0603", "u-soic8")],
        {"id": "det-2term", "arch": "ultralytics/yolov8n", "kind": "detector",
         "classes": ["solder_bridge", "tombstone"], "input_size": 64},
        {"id": "det-ic", "arch": "ultralytics/yolov8n", "kind": "detector",
         "classes": ["solder_bridge", "lifted_lead"], "input_size": 64},
    ],
    "components": [
        {"name": "R0402", "classifier": "cls-r0402", "frequency": 4},
        {"name": "C0402", "classifier": "cls-c0402", "frequency": 4},
        {"name": "R0603", "classifier": "cls-r0603", "frequency": 2},
        {"name": "U-SOIC8", "classifier": "cls-u-soic8", "frequency": 2},
    ],
}


@pytest.fixture(scope="module")
def ultralytics_offline(tmp_path_factory: pytest.TempPathFactory):
    """Keep ultralytics' settings file out of the home directory, and it offline, for a module's tests
    (`pytestmark = pytest.mark.usefixtures("ultralytics_offline")`)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("YOLO_CONFIG_DIR", str(tmp_path_factory.mktemp("yolo-config")))
    mp.setenv("YOLO_OFFLINE", "1")
    yield
    mp.undo()


class SizedSource:
    """A pool source of declared sizes whose values are plain objects (policy and scheduler tests)."""

    def __init__(self, sizes):
        self.sizes = sizes

    def size(self, expert_id):
        return self.sizes[expert_id]

    def load(self, expert_id):
        return object()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_line(root: Path, *, store: Path, fixed_ports: bool = False, **extra) -> Path:
    """Write spec + config for line T under `root`; returns the config path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny.coe.yaml").write_text(yaml.safe_dump(TINY_SPEC))
    ports = (free_port(), free_port()) if fixed_ports else ("*", "*")
    cfg = {
        "line": "T", "spec": "tiny.coe.yaml", "data_dir": str(root / "data"),
        "expert_store": str(store),
        "ingest": f"router+bind:tcp://127.0.0.1:{ports[0]}", "publish": f"pub+bind:tcp://127.0.0.1:{ports[1]}",
        # the tiny zoo is ~27 MB: 20 MB forces loads and evictions
        "executors": [{"device": "cpu", "count": 1, "memory": "20MB", "threads": 1}],
        "scheduler": {"max_batch": 8}, "writer": {"flush_ms": 10}, "metrics": {"port": 0},
        "max_payload_bytes": "64KiB",
    }
    cfg.update(extra)
    path = root / "line-T.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> Path:
    """The tiny spec's experts, built once per test session (real models, generated weights)."""
    from edge_agent.demo import sample_images_for
    from edge_agent.zoo import build_zoo
    from storage.expert_store import ExpertStore
    from coe import parse_spec

    root = tmp_path_factory.mktemp("zoo")
    model = parse_spec(TINY_SPEC)
    build_zoo(model, ExpertStore(root), seed=1, sample_images=sample_images_for(model, n=24, size=32))
    return root


@pytest.fixture
def tiny_line(tmp_path, tiny_zoo):
    """Config path of a line T whose expert store is a private copy of the tiny zoo."""
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    return write_line(tmp_path / "line", store=store)


@pytest.fixture(scope="session")
def tiny_recording(tmp_path_factory) -> Path:
    from coe import parse_spec
    from storage.synthetic import record_synthetic

    out = tmp_path_factory.mktemp("rec") / "tiny-60"
    record_synthetic(parse_spec(TINY_SPEC), out, 60, line="T", seed=3, size=48, boards_components=20)
    return out


def verdict_rows(db: Path) -> list[dict]:
    import sqlite3

    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute("SELECT * FROM verdicts")]
    finally:
        con.close()


def load_json_lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.strip().startswith("{")]


__all__ = ["TINY_SPEC", "free_port", "write_line", "verdict_rows", "load_spec", "load_json_lines"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3-MoE (k = 4 of 8 experts: a wrong summation order changes the floats), saved with
    save_pretrained and imported into an expert store: (reference model, layout, store path)."""
    pytest.importorskip("transformers")
    from moe_models import build

    from storage.llm_import import import_checkpoint

    root = tmp_path_factory.mktemp("qwen3")
    ref = build("qwen3_moe", root / "hf")
    layout = import_checkpoint(root / "hf", root / "store")
    return ref, layout, root / "store"


def db_rows(db, sql: str) -> list[tuple]:
    """Rows of `sql` on the SQLite file `db`, on a connection of its own (closed after)."""
    import sqlite3

    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def frame_messages(rec, frames, prefix: str = "") -> list[tuple[str, list[bytes]]]:
    """`(frame_id, parts)` messages of recorded frames for `send_messages`, frame ids prefixed."""
    from edge_agent import protocol as P

    out = []
    for fr in frames:
        header = {**fr.header, "frame_id": prefix + fr.header["frame_id"]}
        out.append((header["frame_id"], [P.encode_header(header), rec.payload(fr)]))
    return out


def until(cond, seconds: float, what: str) -> None:
    """Poll `cond` until true; fail naming `what` after `seconds` (a guard against a hang, not a timing bound)."""
    import time

    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.02)
