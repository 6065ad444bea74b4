"""Parser boundaries found wanting by an audit: each test names the input that got through (or crashed) before.

Specs, MoE layouts, usage probabilities, recordings, traces, token predictors, synthetic footprints and the
results queries: bad input is refused with an error naming the file, the frame or the field.
"""
from __future__ import annotations

import json
import os
import re
import sqlite3
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from coe import CoEError, SpecError, load_spec, parse_spec
from coe import probabilities as P
from coe.moe import MoELayout, check_model_name, parse_expert_id


# -- coe/spec.py ----------------------------------------------------------------------------------------------
def one_expert(**over):
    raw = {"experts": [{"id": "a", "arch": "x/y", "kind": "classifier", "classes": ["ok", "bad"]}],
           "components": [{"name": "c", "classifier": "a"}]}
    raw["experts"][0].update(over)
    return raw


def alias_bomb(depth: int) -> str:
    """YAML of a list of 10**(depth+1) 'x' built from aliases: a few hundred bytes."""
    items = ["&a0 [x,x,x,x,x,x,x,x,x,x]"] + [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]"
                                             for i in range(1, depth + 1)]
    return "[" + ", ".join(items) + "]"


SPEC_TAIL = """experts:
  - {id: c, arch: torchvision/resnet18, kind: classifier, classes: [ok, bad]}
components:
  - {name: R1, classifier: c}
"""


def test_a_spec_name_built_of_yaml_aliases_is_refused_not_expanded(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"name: {alias_bomb(4)}\n" + SPEC_TAIL)      # 400 bytes; str() of it: megabytes
    assert len(bomb.read_bytes()) < 600
    with pytest.raises(SpecError, match=r"key 'name': must be a string, got list"):
        load_spec(bomb)
    with pytest.raises(SpecError, match=r"key 'name': must be 1 to 128 characters"):
        parse_spec({**one_expert(), "name": "n" * 129})
    assert parse_spec({**one_expert(), "name": 2024}).name == "2024"     # YAML reads `name: 2024` as a number
    with pytest.raises(SpecError, match=r"key 'name': must be a string, got bool"):
        parse_spec({**one_expert(), "name": True})


def test_an_error_message_shows_an_aliased_value_cut_short(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(SPEC_TAIL.replace("{name: R1, classifier: c}", f"{{name: R1, classifier: c, "
                                      f"frequency: {alias_bomb(4)}}}"))
    with pytest.raises(SpecError, match=r"components\[0\].frequency': must be a positive finite number") as err:
        load_spec(bomb)
    assert len(str(err.value)) < 500


@pytest.mark.parametrize("weights,says", [
    (None, "must be a string, got NoneType"),
    (["a", "b"], "must be a string, got list"),
    ("w" * 5000, "must be 0 to 4096 characters"),
])
def test_expert_weights_must_be_a_string(weights, says):
    with pytest.raises(SpecError, match=rf"key 'experts\[0\].weights': {says}"):
        parse_spec(one_expert(weights=weights))
    assert parse_spec(one_expert(weights="store://a")).experts["a"].uri == "store://a"
    assert parse_spec(one_expert()).experts["a"].uri == ""


@pytest.mark.parametrize("over,key,says", [
    ({"priors": {"ok": True, "bad": False}}, "experts[0].priors.ok", "must be a probability"),
    ({"pass_labels": ["ok", "ok"]}, "experts[0].pass_labels", "duplicate labels"),
    ({"classes": ["ok", ""]}, "experts[0].classes", "non-empty strings"),
])
def test_odd_expert_fields_are_refused(over, key, says):
    with pytest.raises(SpecError, match=f"key '{re.escape(key)}': .*{says}"):
        parse_spec(one_expert(**over))


@pytest.mark.parametrize("nxt", [0, ["a"], "a", True])
def test_next_that_is_not_a_mapping_is_refused_where_it_was_read_as_none(nxt):
    with pytest.raises(SpecError, match=r"key 'experts\[0\].next': must map an output label to an expert id"):
        parse_spec(one_expert(next=nxt))
    for empty in (None, [], ""):      # `next:`, `next: []`, `next: ""`: no next step, as specs have written it
        assert parse_spec(one_expert(next=empty)).experts["a"].next == {}


def test_an_empty_component_name_is_refused():
    raw = one_expert()
    raw["components"][0]["name"] = ""
    with pytest.raises(SpecError, match=r"key 'components\[0\].name': must be 1 to 128 characters, got 0"):
        parse_spec(raw)


def chain(n: int, labels: dict[str, float], onward: tuple[str, ...]) -> dict:
    """n classifiers e0 -> e1 -> ... ; each sends the labels in `onward` to the next one."""
    ex = [{"id": f"e{i}", "arch": "torchvision/resnet18", "kind": "classifier", "classes": list(labels),
           "priors": labels, "next": {l: f"e{i + 1}" for l in onward} if i < n - 1 else {}} for i in range(n)]
    return {"experts": ex, "components": [{"name": "c", "classifier": "e0"}]}


def test_expected_uses_is_linear_in_the_chain_not_in_its_paths():
    """60 levels of two edges each: 2**59 paths to the last expert.  Walking every path (the old algorithm)
    does not finish; accumulating in topological order is instant."""
    m = parse_spec(chain(60, {"ok": 0.5, "meh": 0.3, "bad": 0.2}, ("ok", "meh")))
    uses = m.expected_uses()
    assert [uses[f"e{i}"] for i in range(60)] == pytest.approx([0.8 ** i for i in range(60)])
    assert sum(m.usage_probabilities().values()) == pytest.approx(1.0)


def test_a_chain_longer_than_the_recursion_limit_loads_and_is_walked():
    m = parse_spec(chain(1200, {"ok": 1.0}, ("ok",)))        # recursed once per expert before
    assert list(m.usage_probabilities().values()) == pytest.approx([1 / 1200] * 1200)
    raw = chain(1200, {"ok": 1.0}, ("ok",))
    raw["experts"][-1]["next"] = {"ok": "e600"}
    with pytest.raises(SpecError, match=r"key 'experts.e1199.next': chain cycle through 'e600'"):
        parse_spec(raw)


def test_a_spec_nested_too_deeply_is_a_spec_error(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("experts: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(SpecError, match=r"deep.yaml: key '<file>': nested too deeply"):
        load_spec(deep)


def test_a_spec_that_cannot_be_read_is_a_spec_error(tmp_path, monkeypatch):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC_TAIL)

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(SpecError, match=r"spec.yaml: key '<file>': cannot read: Permission denied"):
        load_spec(spec)


# -- coe/moe.py -------------------------------------------------------------------------------------------------
def layout_doc(**over) -> dict:
    doc = {"format": "coe-edge/moe-layout", "version": 1, "model": "tiny", "model_type": "mixtral", "top_k": 2,
           "dtype": "float32", "resident_file": "resident.safetensors", "resident_sha256": "", "resident_nbytes": 0,
           "scoring": "softmax", "extra": {"norm_topk_prob": True, "routed_scaling_factor": 1.0},
           "layers": [{"layer": l, "module": f"model.layers.{l}.mlp.experts", "num_experts": 8, "hidden": 16,
                       "intermediate": 32, "expert_nbytes": 100} for l in (0, 1)]}
    doc.update(over)
    return doc


@pytest.mark.parametrize("name", ["tiny\n", "a..b"])
def test_a_model_name_with_a_trailing_newline_or_dotdot_is_refused(name):
    with pytest.raises(CoEError, match="model name"):
        check_model_name(name)
    with pytest.raises(CoEError, match="model name"):
        MoELayout.from_dict(layout_doc(model=name))
    assert check_model_name("tiny-mixtral.v1") == "tiny-mixtral.v1"


def test_an_expert_id_with_a_trailing_newline_is_not_one():
    assert parse_expert_id("tiny.L01.E002") == ("tiny", 1, 2)
    with pytest.raises(CoEError, match="not an MoE expert id"):
        parse_expert_id("tiny.L01.E002\n")


def test_layout_layers_must_fit_what_readers_assume():
    doc = layout_doc()
    doc["layers"][0]["num_experts"] = 40000
    doc["layers"][1]["num_experts"] = 40000
    with pytest.raises(CoEError, match=r"layers\[0\].num_experts: at most 32767"):
        MoELayout.from_dict(doc)
    doc = layout_doc()
    doc["layers"].reverse()
    with pytest.raises(CoEError, match=r"layers\[1\].layer: layers must be in ascending order"):
        MoELayout.from_dict(doc)
    doc = layout_doc()
    doc["layers"][1]["num_experts"] = 16
    with pytest.raises(CoEError, match=r"layers\[1\].num_experts: 16, but layer 0 has 8"):
        MoELayout.from_dict(doc)


@pytest.mark.parametrize("extra,says", [
    ({"routed_scaling_factor": "abc"}, r"extra.routed_scaling_factor: must be a finite number"),
    ({"routed_scaling_factor": float("nan")}, r"extra.routed_scaling_factor: must be a finite number"),
    ({"routed_scaling_factor": True}, r"extra.routed_scaling_factor: must be a finite number"),
    ({"norm_topk_prob": "yes"}, r"extra.norm_topk_prob: must be bool, got str"),
    ({"norm_topk_prob": None}, r"extra.norm_topk_prob: must be bool, got NoneType"),   # bool(None) is False
    ({"source": 3}, r"extra.source: must be str, got int"),
])
def test_layout_extra_fields_are_checked(extra, says):
    with pytest.raises(CoEError, match=says):
        MoELayout.from_dict(layout_doc(extra=extra))


@pytest.mark.parametrize("text,says", [
    (lambda t: t[:-1] + ', "top_k": 3}', r"key 'top_k' appears twice"),
    (lambda t: t.replace('"resident_nbytes": 0', '"resident_nbytes": ' + "9" * 5000), r"cannot read the MoE layout"),
    (lambda t: t[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}", r"nested too deeply"),
])
def test_an_unreadable_layout_file_is_a_coe_error(tmp_path, text, says):
    (tmp_path / "llm.json").write_text(text(json.dumps(layout_doc())))
    with pytest.raises(CoEError, match=rf"llm.json: .*{says}"):
        MoELayout.load(tmp_path)


# -- coe/probabilities.py -----------------------------------------------------------------------------------------
def test_usage_probabilities_with_a_key_twice_are_refused(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"probabilities": {"a": 0.5, "a": 0.5, "b": 0.5}}')
    with pytest.raises(CoEError, match=r"p.json: unreadable usage probabilities: key 'a' appears twice"):
        P.load(p)
    p.write_text('{"probabilities": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(CoEError, match=r"p.json: unreadable usage probabilities: nested too deeply"):
        P.load(p)


# -- storage/recording.py ------------------------------------------------------------------------------------------
HEADER = {"v": 1, "frame_id": "f1", "line": "L", "board_id": "B", "ts": 1.0, "encoding": "png", "file": "frames/f1.png"}


def recording(tmp_path: Path, *lines: str) -> Path:
    (tmp_path / "frames").mkdir(exist_ok=True)
    (tmp_path / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_a_symlink_loop_in_a_recording_is_a_recording_error(tmp_path):
    from storage.recording import Recording, RecordingError

    root = recording(tmp_path, json.dumps(dict(HEADER, file="frames/loop1")))
    os.symlink("loop2", root / "frames" / "loop1")
    os.symlink("loop1", root / "frames" / "loop2")
    with pytest.raises(RecordingError, match=r"manifest.jsonl: line 1: field 'file': cannot resolve 'frames/loop1'"):
        Recording(root)


def test_a_fifo_in_place_of_an_image_is_refused_not_read_forever(tmp_path):
    """The old reader blocked in open() until a writer came and in read() until it left; the thread below
    plays that writer so the test ends either way."""
    from storage.recording import Recording, RecordingError

    root = recording(tmp_path, json.dumps(HEADER))
    (root / "frames" / "f1.png").write_bytes(b"png")
    rec = Recording(root)
    (root / "frames" / "f1.png").unlink()
    fifo = root / "frames" / "f1.png"
    os.mkfifo(fifo)

    def writer():
        try:
            with open(fifo, "wb") as w:     # waits for a reader
                w.write(b"x")
        except OSError:
            pass
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        with pytest.raises(RecordingError, match=r"field 'file': frame 'f1': frames/f1.png is not a regular file"):
            rec.payload(rec.frames[0])
    finally:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))     # lets the writer's open() return
        t.join(10)


def test_a_manifest_line_with_a_key_twice_or_nested_too_deeply_is_refused(tmp_path):
    from storage.recording import Recording, RecordingError

    line = json.dumps(HEADER)[:-1] + ', "frame_id": "f2"}'
    with pytest.raises(RecordingError, match=r"line 1: field 'frame_id': written twice in one line"):
        Recording(recording(tmp_path, line))
    line = json.dumps(HEADER)[:-1] + ', "truth": ' + "[" * 100000 + "]" * 100000 + "}"
    with pytest.raises(RecordingError, match=r"line 1: field '<line>': not valid JSON: nested too deeply"):
        Recording(recording(tmp_path, line))


def test_a_writer_extension_with_a_trailing_newline_is_refused(tmp_path):
    from storage.recording import RecordingError, RecordingWriter

    header = {k: v for k, v in HEADER.items() if k != "file"}
    with RecordingWriter(tmp_path / "r") as w:
        with pytest.raises(RecordingError, match="extension must be 1-8 letters/digits"):
            w.add(header, b"x", "png\n")


def test_the_writer_flushes_images_before_the_manifest_and_the_directory_after(tmp_path, monkeypatch):
    from storage import recording
    from storage.recording import RecordingWriter

    header = {k: v for k, v in HEADER.items() if k != "file"}
    events = []
    real_fsync, real_replace, real_sync = os.fsync, os.replace, recording.sync_files
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    monkeypatch.setattr(recording, "sync_files", lambda root, paths: (
        events.append(("sync", tuple(str(Path(p).resolve()) for p in paths))), real_sync(root, paths))[1])
    root = tmp_path / "r"
    with RecordingWriter(root) as w:
        frame = w.add(header, b"x", "png")
    image, manifest = str((root / frame.file).resolve()), str(root / "manifest.jsonl")
    assert events.index(("sync", (image,))) < events.index(("replace", manifest))
    assert ("fsync", str(root.resolve())) in events[events.index(("replace", manifest)):]


def test_sync_files_flushes_each_file_where_there_is_no_syncfs(tmp_path, monkeypatch):
    import ctypes.util

    from coe.files import sync_files

    files = [tmp_path / f"f{i}" for i in range(3)]
    for f in files:
        f.write_bytes(b"x")
    flushed = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)     # no libc to ask for syncfs
    sync_files(tmp_path, files)
    assert flushed == [str(f.resolve()) for f in files]


def test_a_writer_that_cannot_write_its_manifest_says_so_and_leaves_no_temp_file(tmp_path, monkeypatch):
    from storage.recording import RecordingError, RecordingWriter

    header = {k: v for k, v in HEADER.items() if k != "file"}
    w = RecordingWriter(tmp_path / "r")
    w.add(header, b"x", "png")

    def full(a, b):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(RecordingError, match=r"manifest.jsonl: cannot write the manifest: No space left on device"):
        w.close()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["frames"]


# -- routing/moe_trace.py ------------------------------------------------------------------------------------------
def trace_file(path: Path, arrays: dict | None = None, meta: dict | None = None, raw_meta: str | None = None) -> Path:
    from safetensors.numpy import save_file

    N = 4
    a = {"probs": np.full((N, 2, 4), 0.25, np.float16), "chosen": np.tile(np.array([0, 1], np.int16), (N, 2, 1)),
         "seq": np.zeros(N, np.int32), "step": np.arange(N, dtype=np.int32)}
    a.update(arrays or {})
    m = {"format": "coe-edge/moe-trace", "version": 1, "model": "tiny", "layers": [0, 1], "top_k": 2,
         "scoring": "softmax"}
    m.update(meta or {})
    save_file(a, str(path), metadata={"coe": raw_meta if raw_meta is not None else json.dumps(m)})
    return path


def _nan_chosen():
    ch = np.tile(np.array([0, 1], np.float32), (4, 2, 1))
    ch[0, 0, 0] = np.nan
    return ch


@pytest.mark.parametrize("arrays,says", [
    ({"chosen": _nan_chosen()}, "chosen must hold integers, got float32"),
    ({"seq": np.array([0, 0.5, np.nan, 1], np.float32)}, "seq must hold integers, got float32"),
    ({"step": np.zeros(4, np.float64)}, "step must hold integers, got float64"),
    ({"probs": np.ones((4, 2, 4), np.int8)}, "probs must hold floats, got int8"),
    ({"probs": np.ones((4, 2, 4), bool)}, "probs must hold floats, got bool"),
    ({"probs": np.full((4, 2, 4), -7, np.float16)}, r"probs holds gate scores outside \[0, 1\]"),
])
def test_trace_arrays_of_the_wrong_kind_are_refused(tmp_path, arrays, says):
    from routing.moe_trace import Trace

    with pytest.raises(CoEError, match=says):
        Trace.load(trace_file(tmp_path / "t.trace", arrays))


@pytest.mark.parametrize("meta,says", [
    ({"layers": [0, 0]}, "'layers' must be a non-empty list of distinct layer indices"),
    ({"layers": [1, 0]}, "'layers' must be a non-empty list of distinct layer indices"),
    ({"layers": [True, False]}, "'layers' must be a non-empty list of distinct layer indices"),
    ({"layers": [-1, 0]}, "'layers' must be a non-empty list of distinct layer indices"),
    ({"model": None}, "'model': model name None"),
    ({"model": "../x"}, "'model': model name '../x'"),
    ({"scoring": "relu"}, "'scoring' must be one of softmax, sigmoid, got 'relu'"),
])
def test_trace_metadata_is_checked(tmp_path, meta, says):
    from routing.moe_trace import Trace

    t = Trace.load(trace_file(tmp_path / "ok.trace"))
    assert t.layers == (0, 1) and t.model == "tiny" and t.scoring == "softmax"
    with pytest.raises(CoEError, match=f"t.trace: trace metadata {says}"):
        Trace.load(trace_file(tmp_path / "t.trace", meta=meta))


@pytest.mark.parametrize("raw,says", [
    ('{"format": "coe-edge/moe-trace", "version": 1, "version": 1}', "key 'version' appears twice"),
    ("[" * 100000, "nested too deeply"),
])
def test_trace_metadata_that_is_not_plain_json_is_refused(tmp_path, raw, says):
    from routing.moe_trace import Trace

    with pytest.raises(CoEError, match=f"trace metadata is missing or not JSON .*{says}"):
        Trace.load(trace_file(tmp_path / "t.trace", raw_meta=raw))


def bf16_file(path: Path, tensors: dict[str, tuple[str, list[int]]], meta: dict) -> Path:
    """A safetensors file written by hand: numpy has no bfloat16 to write one with."""
    hdr, at = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape)) * {"BF16": 2, "F16": 2, "I16": 2, "I32": 4, "F32": 4}[dtype]
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    hdr["__metadata__"] = {"coe": json.dumps(meta)}
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + bytes(at))
    return path


@pytest.fixture(params=["numpy alone", "ml_dtypes imported"])
def numpy_bf16(request):
    """With and without ml_dtypes imported (transformers and onnx import it), which gives numpy a bfloat16: the
    full suite read BF16 arrays where a test alone could not."""
    if request.param == "ml_dtypes imported":
        pytest.importorskip("ml_dtypes")


def test_a_bf16_trace_is_refused_naming_the_array(tmp_path, numpy_bf16):
    from routing.moe_trace import Trace

    p = bf16_file(tmp_path / "t.trace", {"probs": ("BF16", [4, 2, 4]), "chosen": ("I16", [4, 2, 2]),
                                         "seq": ("I32", [4]), "step": ("I32", [4])},
                  {"format": "coe-edge/moe-trace", "version": 1, "model": "tiny", "layers": [0, 1], "top_k": 2})
    with pytest.raises(CoEError, match=r"t.trace: array 'probs' is stored as BF16, which numpy cannot read"):
        Trace.load(p)


def test_a_synthetic_trace_of_negative_length_is_refused():
    from routing.moe_trace import synthetic

    with pytest.raises(CoEError, match="tokens must be a whole number >= 0, got -1"):
        synthetic([[1, 1, 1]], tokens=-1)
    assert synthetic([[1, 1, 1]], tokens=np.int64(3)).tokens == 3


# -- routing/moe_predictor.py --------------------------------------------------------------------------------------
def predictor_file(path: Path, arrays: dict | None = None, meta: dict | None = None, raw_meta: str | None = None,
                   ) -> Path:
    from safetensors.numpy import save_file

    a = {"W": np.zeros((2, 4, 4), np.float32), "b": np.zeros((2, 4), np.float32)}
    a.update(arrays or {})
    m = {"format": "coe-edge/moe-token-predictor", "layers": [0, 1], "top_k": 2, "features": "same-layer"}
    m.update(meta or {})
    m = {k: v for k, v in m.items() if v is not ...}
    save_file(a, str(path), metadata={"coe": raw_meta if raw_meta is not None else json.dumps(m)})
    return path


NO_LAYERS = {"W": np.zeros((0, 4, 4), np.float32), "b": np.zeros((0, 4), np.float32)}


@pytest.mark.parametrize("arrays,meta,says", [
    ({}, {"layers": [3, 3]}, r"metadata 'layers' must be a list of layer numbers \(distinct"),
    ({}, {"layers": [-1, 0]}, r"metadata 'layers' must be a list of layer numbers \(distinct"),
    (NO_LAYERS, {"layers": []}, r"metadata 'layers' must be a list of layer numbers"),
    (NO_LAYERS, {"layers": 0}, r"metadata 'layers' must be a list of layer numbers"),
    (NO_LAYERS, {"layers": ...}, r"metadata 'layers' must be a list of layer numbers"),
    ({}, {"top_k": 9}, r"W \[2, 4, 4\] scores 4 experts, fewer than top_k 9"),
    ({"W": np.zeros((2, 0, 0), np.float32), "b": np.zeros((2, 0), np.float32)}, {}, "fewer than top_k 2"),
])
def test_predictor_layers_and_top_k_are_checked(tmp_path, arrays, meta, says):
    from routing.moe_predictor import TokenPredictor

    TokenPredictor.load(predictor_file(tmp_path / "ok.pred"))
    with pytest.raises(CoEError, match=says):
        TokenPredictor.load(predictor_file(tmp_path / "p.pred", arrays, meta))


def test_predictor_metadata_with_a_key_twice_or_nested_too_deeply_is_refused(tmp_path):
    from routing.moe_predictor import TokenPredictor

    with pytest.raises(CoEError, match=r"p.pred: not a token predictor file: key 'top_k' appears twice"):
        TokenPredictor.load(predictor_file(tmp_path / "p.pred", raw_meta=(
            '{"format": "coe-edge/moe-token-predictor", "layers": [0, 1], "top_k": 2, "top_k": 1}')))
    with pytest.raises(CoEError, match=r"p.pred: not a token predictor file: its metadata is nested too deeply"):
        TokenPredictor.load(predictor_file(tmp_path / "p.pred", raw_meta="[" * 100000))


def test_a_bf16_predictor_is_refused_naming_the_array(tmp_path, numpy_bf16):
    from routing.moe_predictor import TokenPredictor

    p = bf16_file(tmp_path / "p.pred", {"W": ("BF16", [1, 2, 2]), "b": ("F32", [1, 2])},
                  {"format": "coe-edge/moe-token-predictor", "layers": [0], "top_k": 1})
    with pytest.raises(CoEError, match=r"p.pred: array 'W' is stored as BF16, which numpy cannot read"):
        TokenPredictor.load(p)


def test_save_info_cannot_replace_the_keys_load_reads(tmp_path):
    from routing.moe_predictor import TokenPredictor
    from routing.moe_trace import synthetic

    pred = TokenPredictor.train(synthetic([[5, 3, 1, 1], [1, 1, 5, 3]], tokens=200, top_k=2, locality=0.5, seed=1),
                                features="same-layer", epochs=20)
    p = pred.save(tmp_path / "p.pred", {"layers": [7, 8], "format": "x", "recall": 0.5})
    back = TokenPredictor.load(p)
    assert back.layers == pred.layers and back.top_k == pred.top_k


# -- storage/synthetic.py ------------------------------------------------------------------------------------------
def test_an_ic_draws_at_most_max_pins_leads_whatever_its_name_says():
    from storage.synthetic import MAX_PINS, draw_component, footprint

    assert MAX_PINS == 256
    assert len(footprint("U-SOIC8").pads) == 8
    assert len(footprint("U-SOIC20000").pads) == MAX_PINS        # 20000 leads before
    assert len(footprint("U-SOIC" + "9" * 5000).pads) == MAX_PINS   # int() of 5000 digits: ValueError before
    assert draw_component("U-SOIC20000", "ok", np.random.default_rng(0)).size


# -- storage/queries.py --------------------------------------------------------------------------------------------
def test_a_corrupt_chain_in_the_results_reads_empty_with_what_was_stored_not_a_failed_page():
    from storage.queries import VerdictQuery, frame_detail, query_verdicts

    c = sqlite3.connect(":memory:")
    c.execute("CREATE TABLE verdicts (frame_id TEXT, component TEXT, board_id TEXT, verdict TEXT, reason TEXT, "
              "latency_ms REAL, decided_at REAL, chain TEXT, versions TEXT)")
    c.execute("CREATE TABLE frames (frame_id TEXT, line TEXT, board_id TEXT, component TEXT, ts REAL, "
              "received_at REAL, status TEXT)")
    c.execute("CREATE TABLE inferences (id INTEGER, frame_id TEXT, stage INTEGER, output TEXT)")
    c.execute("INSERT INTO verdicts VALUES ('f1','c','b','pass','r',1.0,10.0,'[\"a\"','{')")
    c.execute("INSERT INTO verdicts VALUES ('f2','c','b','pass','r',1.0,11.0,'[\"a\"]','{\"a\": 1}')")
    c.execute("INSERT INTO frames VALUES ('f1','L','b','c',1.0,1.0,'done')")
    rows = {r["frame_id"]: r for r in query_verdicts(c, VerdictQuery()).rows}
    assert (rows["f1"]["chain"], rows["f1"]["versions"]) == ([], {})     # the fields keep their types
    assert rows["f1"]["chain_error"] == "stored chain is not a JSON list: '[\"a\"'"
    assert rows["f1"]["versions_error"] == "stored versions is not a JSON dict: '{'"
    assert (rows["f2"]["chain"], rows["f2"]["versions"]) == (["a"], {"a": 1}) and "chain_error" not in rows["f2"]
    detail = frame_detail(c, "f1")["verdict"]
    assert detail["chain"] == [] and "chain_error" in detail


def test_the_milliseconds_hint_is_for_numbers_only():
    from storage.queries import QueryError, parse_since

    with pytest.raises(QueryError, match=r"after the year 2200 \(milliseconds\? give seconds\)"):
        parse_since("1714557600000")
    with pytest.raises(QueryError, match="after the year 2200") as err:
        parse_since("9999-12-31T23:59:59+00:00")
    assert "milliseconds" not in str(err.value)
