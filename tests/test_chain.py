"""Chain semantics with fixed expert outputs: the detector runs exactly when the spec says."""
from __future__ import annotations

import json
import re
import sqlite3
from collections import defaultdict

import torch

from coe import parse_spec
from edge_agent.agent import Agent
from edge_agent.config import load_config
from edge_agent.replay import replay
from executors.backends import get_backend
from storage.expert_store import ExpertStore
from storage.recording import Recording

from conftest import TINY_SPEC


def force_label(store: ExpertStore, expert, label: str) -> None:
    """Zero the classifier head and bias it to `label`: its output is then fixed."""
    t = dict(store.read(expert.id))
    bias_key = get_backend(expert.arch).head_bias_key(expert)
    weight_key = bias_key[: -len("bias")] + "weight"
    t[weight_key] = torch.zeros_like(t[weight_key])
    bias = torch.full_like(t[bias_key], -10.0)
    bias[expert.classes.index(label)] = 10.0
    t[bias_key] = bias
    store.write(expert, {k: v.clone().contiguous() for k, v in t.items()})


def force_boxes(store: ExpertStore, expert) -> None:
    """Push every class-score bias of a YOLO head up: it then finds boxes on every image."""
    t = {k: v.clone().contiguous() for k, v in store.read(expert.id).items()}
    keys = [k for k in t if re.search(r"\.cv3\.\d+\.2\.bias$", k)]
    assert keys, "no YOLO class-score biases found"
    for k in keys:
        t[k] = torch.full_like(t[k], 10.0)
    store.write(expert, t)


def test_detector_runs_exactly_when_the_classifier_says_so(tiny_line, tiny_recording):
    cfg = load_config(tiny_line, env={})
    model = parse_spec(TINY_SPEC)
    store = ExpertStore(cfg.store_path)
    force_label(store, model.experts["cls-r0402"], "ok")          # -> det-2term on every R0402
    force_label(store, model.experts["cls-c0402"], "missing")     # -> defect, no detector
    force_label(store, model.experts["cls-u-soic8"], "ok")        # -> det-ic, which always finds boxes
    force_boxes(store, model.experts["det-ic"])

    rec = Recording(tiny_recording)
    agent = Agent(cfg).start()
    try:
        report = replay(rec, agent.endpoints["ingest"])
        assert report.accepted == len(rec)
        assert agent.wait_verdicts(len(rec), timeout=120)
    finally:
        agent.stop()

    con = sqlite3.connect(cfg.db_path)
    comp = dict(con.execute("SELECT frame_id, component FROM frames"))
    steps = defaultdict(list)
    first_label = {}
    for fid, stage, expert, out in con.execute("SELECT frame_id, stage, expert_id, output FROM inferences "
                                               "ORDER BY stage"):
        steps[fid].append((stage, expert))
        if stage == 0:
            first_label[fid] = json.loads(out)["label"]
    verdicts = {fid: (v, r) for fid, v, r in con.execute("SELECT frame_id, verdict, reason FROM verdicts")}
    con.close()
    seen = defaultdict(int)
    for fid, c in comp.items():
        seen[c] += 1
        if c == "R0402":
            assert steps[fid] == [(0, "cls-r0402"), (1, "det-2term")]
        elif c == "C0402":
            assert steps[fid] == [(0, "cls-c0402")]
            assert verdicts[fid] == ("defect", "cls-c0402: missing (1.00)")
        elif c == "U-SOIC8":
            assert steps[fid] == [(0, "cls-u-soic8"), (1, "det-ic")]
            assert verdicts[fid][0] == "defect" and "box(es)" in verdicts[fid][1]
        else:  # R0603 keeps its generated weights: the detector runs iff the classifier said ok
            expect = [(0, "cls-r0603")] + ([(1, "det-2term")] if first_label[fid] == "ok" else [])
            assert steps[fid] == expect
    assert seen["R0402"] > 0 and seen["C0402"] > 0 and seen["U-SOIC8"] > 0
