"""ONNX Runtime experts: export parity, the store and pools, import/export commands, and a line that runs one."""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from coe import CoEError, ExpertLoadError, parse_spec
from edge_agent.cli import cli
from executors.onnx_export import max_output_difference
from executors.backends import get_backend
from executors.backends.onnx_backend import MODEL_KEY, OnnxModule
from executors.onnx_export import export_onnx, onnx_expert, onnx_tensors
from executors.skeletons import Skeletons
from storage.expert_store import ExpertStore
from storage.tiers import StoreSource

from conftest import TINY_SPEC, write_line

MODEL = parse_spec(TINY_SPEC)


def _images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (40 + 3 * i, 48, 3), dtype=np.uint8) for i in range(n)]


@pytest.fixture(scope="module")
def exports(tiny_zoo):
    store = ExpertStore(tiny_zoo)
    out = {}
    for eid in ("cls-r0402", "det-2term"):
        tensors = store.read(eid)
        out[eid] = (tensors, export_onnx(MODEL.experts[eid], tensors))
    return out


@pytest.mark.parametrize("eid", ["cls-r0402", "det-2term"])
def test_exports_match_their_torch_expert_within_1e4(exports, eid):
    expert = MODEL.experts[eid]
    tensors, blob = exports[eid]
    assert max_output_difference(expert, tensors, blob, batch=8) <= 1e-4
    twin = onnx_expert(expert, f"{eid}-onnx")
    module = get_backend(twin.arch).build(twin, onnx_tensors(blob))
    assert isinstance(module, OnnxModule) and module.meta["source_arch"] == expert.arch
    got = get_backend(twin.arch).run(module, twin, _images(5))
    want = get_backend(expert.arch).run(get_backend(expert.arch).build(expert, tensors), expert, _images(5))
    assert len(got) == len(want) == 5
    if expert.kind == "detector":                  # the same boxes after NMS (coordinates rounded to 0.01 px)
        for g, w in zip(got, want):
            assert len(g.boxes) == len(w.boxes)
            for gb, wb in zip(g.boxes, w.boxes):
                assert gb[5] == wb[5] and all(abs(a - b) <= 0.02 for a, b in zip(gb[:5], wb[:5]))
    else:                                          # same scores (labels of a random demo net sit 1e-10 apart)
        assert all(abs(g.score - w.score) < 1e-4 for g, w in zip(got, want))


def test_an_onnx_expert_pages_through_the_store_and_a_switch_builds_a_session(tmp_path, exports):
    store = ExpertStore(tmp_path)
    twins = []
    for eid in ("cls-r0402", "det-2term"):
        twin = onnx_expert(MODEL.experts[eid], f"{eid}-onnx")
        store.write(twin, onnx_tensors(exports[eid][1]))
        twins.append(twin)
    assert store.entry("cls-r0402-onnx").arch == "onnx/mobilenet_v3_small"
    assert store.entry("cls-r0402-onnx").dtype == "uint8" and store.nbytes("cls-r0402-onnx") > 1e5
    src, skel = StoreSource(store), Skeletons("cpu")
    first = src.load(twins[0].id)
    m1 = skel.bind(twins[0], first)
    assert skel.bind(twins[0], first) is m1 and skel.builds == 1          # same weights: no rebuild
    m2 = skel.bind(twins[1], src.load(twins[1].id))
    assert skel.builds == 2 and m2 is not m1
    again = src.load(twins[0].id)                                          # evicted and loaded again
    assert skel.bind(twins[0], again) is not m1 and skel.builds == 3
    skel.unbind(again)
    assert all(s.module is None for s in skel._slots.values() if s.bound is None)
    out = get_backend("onnx").run(m2, twins[1], _images(2))
    assert len(out) == 2 and all(o.boxes is not None for o in out)


def test_bad_onnx_experts_fail_with_the_expert_named(tmp_path, exports):
    twin = onnx_expert(MODEL.experts["cls-r0402"], "cls-onnx")
    backend = get_backend("onnx")
    with pytest.raises(ExpertLoadError, match=r"cls-onnx.*onnxruntime cannot load"):
        backend.build(twin, {MODEL_KEY: torch.frombuffer(bytearray(b"not a model at all"), dtype=torch.uint8)})
    with pytest.raises(ExpertLoadError, match=r"cls-onnx.*exactly one tensor"):
        backend.build(twin, {"w": torch.zeros(3)})
    as_detector = dataclasses.replace(twin, kind="detector")
    with pytest.raises(ExpertLoadError, match="the model is a logits, the spec says detector"):
        backend.build(as_detector, onnx_tensors(exports["cls-r0402"][1]))
    with pytest.raises(CoEError, match="not generated; import one"):
        backend.init_weights(twin, 0)
    with pytest.raises(CoEError, match="must be 1-64"):
        get_backend("onnx/bad name!")


def _onnx_line(tmp_path: Path, tiny_zoo: Path) -> Path:
    """Line T with det-2term served by ONNX Runtime (arch onnx/yolov8n), its store a copy of the tiny zoo."""
    spec = copy.deepcopy(TINY_SPEC)
    for e in spec["experts"]:
        if e["id"] == "det-2term":
            e["arch"] = "onnx/yolov8n"
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    config = write_line(tmp_path / "line", store=store)
    (config.parent / "tiny.coe.yaml").write_text(yaml.safe_dump(spec))
    return config


def test_export_import_and_a_line_that_serves_an_onnx_detector(tmp_path, tiny_zoo, tiny_recording):
    from edge_agent.config import load_config
    from storage.recording import Recording

    config = _onnx_line(tmp_path, tiny_zoo)
    run = CliRunner().invoke
    # the plain line's torch detector is exported (det-ic keeps torch) and imported as the spec's onnx det-2term
    res = run(cli, ["experts", "export-onnx", "det-ic", "--config", str(config), "--out", str(tmp_path / "d.onnx")])
    assert res.exit_code == 0, res.output
    assert "max |torch - onnxruntime|" in res.output and (tmp_path / "d.onnx").stat().st_size > 1e5
    bad = run(cli, ["experts", "import", "cls-r0402", str(tmp_path / "d.onnx"), "--config", str(config)])
    assert bad.exit_code != 0 and "onnx/<name> arch" in bad.output
    src = ExpertStore(tiny_zoo).read("det-2term")
    (tmp_path / "det2.onnx").write_bytes(export_onnx(MODEL.experts["det-2term"], src))
    res = run(cli, ["experts", "import", "det-2term", str(tmp_path / "det2.onnx"), "--config", str(config)])
    assert res.exit_code == 0, res.output
    store = ExpertStore(yaml.safe_load(config.read_text())["expert_store"])
    assert store.entry("det-2term").arch == "onnx/yolov8n"

    from test_compression import _verdicts_through_agent

    verdicts, _ = _verdicts_through_agent(config, tiny_recording)
    assert len(verdicts) == len(Recording(tiny_recording)) and set(verdicts.values()) <= {"pass", "defect"}
    # the same line with det-2term in torch, from the same weights, gives every frame the same verdict
    shutil.copytree(tiny_zoo, tmp_path / "plain" / "experts")
    plain = write_line(tmp_path / "plain" / "line", store=tmp_path / "plain" / "experts")
    assert _verdicts_through_agent(plain, tiny_recording)[0] == verdicts
    import sqlite3

    con = sqlite3.connect(load_config(config, env={}).db_path)
    try:
        ran = con.execute("SELECT count(*) FROM inferences WHERE expert_id='det-2term'").fetchone()[0]
    finally:
        con.close()
    assert ran > 0                               # the ONNX detector really ran on the line


def test_auto_picks_onnx_only_when_it_is_clearly_faster():
    from executors.runtime_choice import choose_runtime

    assert choose_runtime({1: (2.0, 1.0), 8: (10.0, 6.0)}) == "onnx"
    assert choose_runtime({1: (2.0, 1.99), 8: (10.0, 9.9)}) == "torch"           # within the margin: a tie
    assert choose_runtime({1: (1.0, 2.0), 16: (20.0, 9.0)}) == "onnx"            # the totals decide
    with pytest.raises(ValueError, match="at least one"):
        choose_runtime({})
    with pytest.raises(ValueError, match="positive"):
        choose_runtime({1: (0.0, 1.0)})


def test_the_profiler_measures_an_onnx_experts_switch(tmp_path, tiny_zoo, monkeypatch):
    """The switch of an ONNX expert (a session build) goes into the profile the scheduler reads.

    Every session build is slowed by a known delay and counted: a timed switch
    that skipped the build (a cached session, a bind that only reads the file)
    would measure a load well under that delay, and build fewer sessions.
    """
    import json
    import time

    from executors.backends.onnx_backend import OnnxBackend

    config = _onnx_line(tmp_path, tiny_zoo)
    store = ExpertStore(yaml.safe_load(config.read_text())["expert_store"])
    twin = onnx_expert(MODEL.experts["det-2term"], "det-2term")
    store.write(twin, onnx_tensors(export_onnx(MODEL.experts["det-2term"], store.read("det-2term"))), version=2)
    delay, repeats, builds = 0.25, 2, []
    real_build = OnnxBackend.build

    def slow_build(self, expert, tensors, device="cpu"):
        time.sleep(delay)
        builds.append(expert.id)
        return real_build(self, expert, tensors, device)

    monkeypatch.setattr(OnnxBackend, "build", slow_build)
    res = CliRunner().invoke(cli, ["profile", "--config", str(config), "--batch-sizes", "1,2",
                                   "--repeats", str(repeats), "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    made_for = json.loads((tmp_path / "p.json").read_text())["made_for"]     # what it was measured for
    assert made_for["line"] == "T" and len(made_for["spec"]) == 64 and made_for["box"]["cpu"].endswith("cores")
    archs = json.loads((tmp_path / "p.json").read_text())["archs"]
    onnx = next(a for a in (archs.values() if isinstance(archs, dict) else archs) if a["arch"] == "onnx/yolov8n")
    # one untimed build, then a session per timed switch: `repeats` from ssd and `repeats` from host
    assert builds.count("det-2term") >= 1 + 2 * repeats, builds
    assert onnx["load_seconds"]["host"] >= delay and onnx["load_seconds"]["ssd"] >= delay
    assert onnx["weight_bytes"] == store.nbytes("det-2term")      # the pool holds the model file's bytes


def test_resident_onnx_experts_keep_their_sessions_between_switches(tmp_path, exports):
    store = ExpertStore(tmp_path)
    blob = exports["cls-r0402"][1]
    twins = [onnx_expert(MODEL.experts["cls-r0402"], f"cls-{i}-onnx") for i in range(2)]   # same bytes, same size
    for t in twins:
        store.write(t, onnx_tensors(blob))
    src, skel = StoreSource(store), Skeletons("cpu")
    flats = [src.load(t.id) for t in twins]
    for _ in range(3):
        for t, f in zip(twins, flats):
            skel.bind(t, f)
    assert skel.builds == 2                                  # one session each, not one per switch
    skel.unbind(flats[0])
    assert skel.bind(twins[0], flats[0]) is not None and skel.builds == 3


def test_a_model_that_does_not_fit_the_spec_fails_at_import(exports):
    twin = onnx_expert(MODEL.experts["cls-r0402"], "cls-onnx")
    blob = onnx_tensors(exports["cls-r0402"][1])
    three = dataclasses.replace(twin, classes=("ok", "missing", "misaligned"))
    with pytest.raises(ExpertLoadError, match="outputs 4 classes, the spec's 3 classes need 3"):
        get_backend("onnx").build(three, blob)
    bigger = dataclasses.replace(twin, input_size=96)
    with pytest.raises(ExpertLoadError, match=r"takes input \[.*32, 32\], the spec needs \[batch, 3, 96, 96\]"):
        get_backend("onnx").build(bigger, blob)
    det = onnx_expert(MODEL.experts["det-2term"], "det-onnx")
    more = dataclasses.replace(det, classes=("a", "b", "c"))
    module = get_backend("onnx").build(more, onnx_tensors(exports["det-2term"][1]))   # the graph does not say
    with pytest.raises(ExpertLoadError, match="outputs 6 box \\+ class channels, the spec's 3 classes need 7"):
        get_backend("onnx").check_fits(module, more)                                 # one zero image does


def test_tensorrt_sessions_cache_their_engines_where_configured(tmp_path, monkeypatch):
    from executors.backends.onnx_backend import providers_for, trt_cache_options

    monkeypatch.setenv("COE_TRT_CACHE", str(tmp_path / "trt"))
    opts = trt_cache_options()
    assert opts["trt_engine_cache_enable"] and opts["trt_engine_cache_path"] == str(tmp_path / "trt")
    assert (tmp_path / "trt").is_dir()
    # engines are named by graph and shapes, not weights: each model's go in a folder of their own
    a, b = trt_cache_options(b"model a"), trt_cache_options(b"model b")
    assert a["trt_engine_cache_path"] != b["trt_engine_cache_path"] == trt_cache_options(b"model b")[
        "trt_engine_cache_path"]
    assert a["trt_timing_cache_path"] == b["trt_timing_cache_path"] == str(tmp_path / "trt")     # shared
    assert a["trt_engine_cache_path"].startswith(str(tmp_path / "trt")) and os.path.isdir(a["trt_engine_cache_path"])
    assert providers_for("cpu") == ["CPUExecutionProvider"]
    import onnxruntime as ort

    if not {"TensorrtExecutionProvider", "CUDAExecutionProvider"} & set(ort.get_available_providers()):
        with pytest.raises(CoEError, match="device cuda:0: this onnxruntime has no CUDA or TensorRT"):
            providers_for("cuda:0")


def test_a_trained_classifier_exports_within_1e4():
    """Parity on weights that training moved (not only the generated, near-constant nets above)."""
    from edge_agent.zoo_train import train_group

    e = MODEL.experts["cls-r0402"]
    comps = [c.name for c in MODEL.components.values() if MODEL.experts[c.classifier].arch == e.arch]
    net, _, _ = train_group(e.arch, e.classes, e.input_size, comps, steps=30, batch=16, seed=0)
    tensors = {k: v.detach() for k, v in net.state_dict().items()}
    start = get_backend(e.arch).init_weights(e, 0)
    moved = max(float((tensors[k].float() - start[k].float()).abs().max()) for k in start
                if start[k].is_floating_point() and "running" not in k)
    assert moved > 1e-2                                  # the weights really are trained ones
    assert max_output_difference(e, tensors, export_onnx(e, tensors), batch=8) <= 1e-4



def _shifted(blob: bytes, row: int, delta: float, rows: int) -> bytes:
    """The exported model with `delta` added to one row of its raw output (all anchors, every image)."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load_from_string(blob)
    out = m.graph.output[0].name
    for node in m.graph.node:
        node.output[:] = ["raw" if o == out else o for o in node.output]
    shift = np.zeros((1, rows, 1), dtype=np.float32)
    shift[0, row, 0] = delta
    m.graph.initializer.append(numpy_helper.from_array(shift, "shift"))
    m.graph.node.append(helper.make_node("Add", ["raw", "shift"], [out]))
    return m.SerializeToString()


def test_a_detectors_boxes_are_compared_as_fractions_of_its_input(exports):
    """A YOLO box is in pixels: 3e-3 px at 64 px is 5e-5 of the crop, within a logit's 1e-4; a score is not."""
    e = MODEL.experts["det-2term"]
    tensors, blob = exports["det-2term"]
    rows = 4 + len(e.classes)
    assert max_output_difference(e, tensors, blob) <= 1e-4
    assert max_output_difference(e, tensors, _shifted(blob, 0, 3e-3, rows)) == pytest.approx(3e-3 / e.input_size,
                                                                                             rel=0.05)
    assert max_output_difference(e, tensors, _shifted(blob, 4, 3e-3, rows)) == pytest.approx(3e-3, rel=0.05)


@pytest.mark.parametrize("meta,says", [
    ("not json", "unreadable coe-edge metadata"),
    ('{"format": "someone-else/v1"}', "unreadable coe-edge metadata: format 'someone-else/v1'"),
    ('{"format": "coe-edge/onnx-expert", "task": "logits", "preprocess": "sepia"}', "unknown preprocess 'sepia'"),
    ('{"format": "coe-edge/onnx-expert", "task": "logits", "preprocess": "imagenet", '
     '"activation_bytes_per_sample": "x"}', "activation_bytes_per_sample must be a whole number"),
])
def test_an_onnx_files_coe_edge_metadata_is_checked_naming_the_expert(tmp_path, meta, says):
    """The metadata `export_onnx` writes, rewritten as a foreign or hand-edited file might carry it."""
    import onnx
    import onnxruntime as ort

    from executors.backends.onnx_backend import META_KEY, model_meta

    cls = MODEL.experts["cls-r0402"]
    model = onnx.load_from_string(export_onnx(cls, get_backend(cls.arch).init_weights(cls, 0)))
    for prop in model.metadata_props:
        if prop.key == META_KEY:
            prop.value = meta
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ExpertLoadError, match=f"cls-r0402.*{re.escape(says)}"):
        model_meta(session, cls)


def _graph(inputs, output_shape, *, in_type=None, batch="batch") -> bytes:
    """A one-node ONNX graph (a constant output of the given shape) with coe-edge logits metadata."""
    import json as _json

    from onnx import TensorProto, helper

    from executors.backends.onnx_backend import META_KEY

    in_type = in_type or TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(n, in_type, [batch, 3, 32, 32]) for n in inputs]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)
    const = helper.make_node("Constant", [], ["y"], value=helper.make_tensor(
        "v", TensorProto.FLOAT, dims := [d if isinstance(d, int) else 1 for d in output_shape],
        [0.0] * math.prod(dims)))
    g = helper.make_graph([const], "g", ins, [out])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    meta = model.metadata_props.add()
    meta.key, meta.value = META_KEY, _json.dumps({"format": "coe-edge/onnx-expert", "task": "logits",
                                                   "preprocess": "imagenet"})
    return model.SerializeToString()


@pytest.mark.parametrize("blob_args,says", [
    ((["x", "extra"], ["batch", 4]), "has 2 inputs (x, extra)"),
    ((["x"], ["batch", 4], "uint8"), "input is tensor(uint8)"),
    ((["x"], ["batch", 4, 4]), "a logits expert's must have 2 dimensions"),
    ((["x"], [1, 4], "batch 1"), "takes a fixed batch of 1 (input [1, 3, 32, 32]); export it with a dynamic batch"),
], ids=["two-inputs", "uint8-input", "output-rank", "fixed-batch"])
def test_a_model_that_would_fail_every_batch_fails_at_import_instead(blob_args, says):
    from onnx import TensorProto

    names, shape, *kind = blob_args
    blob = _graph(names, shape, in_type=TensorProto.UINT8 if kind == ["uint8"] else None,
                  batch=1 if kind == ["batch 1"] else "batch")
    twin = onnx_expert(MODEL.experts["cls-r0402"], "cls-onnx")
    with pytest.raises(ExpertLoadError, match=re.escape(says)):
        module = get_backend("onnx").build(twin, onnx_tensors(blob))
        get_backend("onnx").check_fits(module, twin)          # import's check (the fixed batch is refused there)


def test_export_as_checks_the_spec_entry_and_nan_is_never_within_tolerance(tmp_path, tiny_zoo):
    spec = copy.deepcopy(TINY_SPEC)
    spec["experts"].append({**next(e for e in spec["experts"] if e["id"] == "cls-r0402"), "id": "cls-onnx",
                            "arch": "onnx/mobilenet_v3_small"})
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)
    config = write_line(tmp_path / "line", store=store)
    (config.parent / "tiny.coe.yaml").write_text(yaml.safe_dump(spec))
    run = CliRunner().invoke
    # a detector's graph stored as the spec's classifier would be an expert no load can build
    res = run(cli, ["experts", "export-onnx", "det-2term", "--config", str(config), "--out", str(tmp_path / "d.onnx"),
                    "--as", "cls-onnx"])
    assert res.exit_code == 1 and "cls-onnx" in res.output and not ExpertStore(store).has("cls-onnx"), res.output
    # a NaN weight: every difference is NaN, which is not within any tolerance
    s = ExpertStore(store)
    tensors = dict(s.read("cls-r0603"))
    bias = next(k for k in tensors if k.endswith("bias") and tensors[k].is_floating_point())
    tensors[bias] = tensors[bias].clone()
    tensors[bias][0] = float("nan")
    s.write(MODEL.experts["cls-r0603"], tensors, version=2)
    res = run(cli, ["experts", "export-onnx", "cls-r0603", "--config", str(config), "--out", str(tmp_path / "n.onnx")])
    assert res.exit_code == 1 and "nothing written" in res.output and not (tmp_path / "n.onnx").exists()
    (tmp_path / "empty.onnx").write_bytes(b"")
    res = run(cli, ["experts", "import", "cls-onnx", str(tmp_path / "empty.onnx"), "--config", str(config)])
    assert res.exit_code == 1 and "cls-onnx" in res.output and "empty.onnx is empty" in res.output


def test_a_fixed_batch_model_a_store_already_holds_still_loads():
    """Refused at import (check_fits), not at every load: a store imported before keeps serving it."""
    blob = _graph(["x"], [1, 4], batch=1)
    twin = onnx_expert(MODEL.experts["cls-r0402"], "cls-onnx")
    module = get_backend("onnx").build(twin, onnx_tensors(blob))
    assert module.session.get_inputs()[0].shape[0] == 1
