"""Building the expert zoo of a spec into a real store."""
from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from coe import CoEError, CoEModel, parse_spec
from edge_agent.zoo import build_zoo
from executors.backends import get_backend
from storage.expert_store import ExpertStore

SPEC = {
    "name": "tiny",
    "experts": [
        {"id": "cls-r", "arch": "torchvision/shufflenet_v2_x0_5", "kind": "classifier",
         "classes": ["ok", "missing", "misaligned"], "input_size": 32,
         "priors": {"ok": 0.7, "missing": 0.2, "misaligned": 0.1}, "next": {"ok": "det-a"}},
        {"id": "cls-c", "arch": "torchvision/mobilenet_v3_small", "kind": "classifier",
         "classes": ["ok", "missing"], "input_size": 32, "next": {"ok": "det-a"}},
        {"id": "det-a", "arch": "ultralytics/yolov8n", "kind": "detector",
         "classes": ["solder_bridge", "tombstone"], "input_size": 64},
    ],
    "components": [
        {"name": "R0402", "classifier": "cls-r", "frequency": 3},
        {"name": "C0402", "classifier": "cls-c", "frequency": 1},
    ],
}


pytestmark = pytest.mark.usefixtures("ultralytics_offline")


@pytest.fixture(scope="module")
def model() -> CoEModel:
    return parse_spec(SPEC, "tiny.coe.yaml")


def samples(expert_id: str) -> list[np.ndarray]:
    rng = np.random.default_rng(len(expert_id))
    return [rng.integers(0, 256, (40, 40, 3), dtype=np.uint8) for _ in range(40)]


def safetensors_header(path: Path) -> dict:
    """Parse the file as safetensors by hand: u64 header length, JSON header, raw bytes."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends) != len(data):
        raise AssertionError(f"{path}: header does not account for every byte")
    return header


def test_builds_every_expert_and_skips_existing_ones(tmp_path: Path, model: CoEModel) -> None:
    store = ExpertStore(tmp_path)
    said: list[str] = []
    entries = build_zoo(model, store, seed=1, progress=said.append)
    assert [e.id for e in entries] == ["cls-r", "cls-c", "det-a"]
    assert [(e.arch, e.kind) for e in entries] == [(x.arch, x.kind) for x in model.experts.values()]
    assert all(e.nbytes > 100_000 and e.dtype == "float32" for e in entries)
    assert sum("wrote" in m for m in said) == 3

    mtimes = {e.id: store.path(e.id).stat().st_mtime_ns for e in entries}
    said.clear()
    again = build_zoo(model, store, seed=1, progress=said.append)
    assert again == entries
    assert sum("kept" in m for m in said) == 3
    assert {e.id: store.path(e.id).stat().st_mtime_ns for e in again} == mtimes


def test_force_rebuilds_and_the_same_seed_gives_the_same_files(tmp_path: Path, model: CoEModel) -> None:
    store = ExpertStore(tmp_path)
    first = build_zoo(model, store, seed=1)
    said: list[str] = []
    rebuilt = build_zoo(model, store, seed=1, force=True, progress=said.append)
    assert sum("wrote" in m for m in said) == 3
    assert [e.sha256 for e in rebuilt] == [e.sha256 for e in first]
    other = build_zoo(model, store, seed=2, force=True)
    assert all(a.sha256 != b.sha256 for a, b in zip(first, other))
    assert len({e.sha256 for e in first}) == 3  # experts do not share a seed


def test_an_expert_whose_arch_changed_is_rebuilt(tmp_path: Path, model: CoEModel) -> None:
    store = ExpertStore(tmp_path)
    build_zoo(model, store)
    raw = json.loads(json.dumps(SPEC))
    raw["experts"][1]["arch"] = "torchvision/shufflenet_v2_x0_5"
    changed = build_zoo(parse_spec(raw), store)
    assert store.entry("cls-c").arch == "torchvision/shufflenet_v2_x0_5" == changed[1].arch
    assert changed[0] == store.entry("cls-r")


def test_files_are_safetensors_never_pickle_and_load_into_their_backend(tmp_path: Path, model: CoEModel) -> None:
    store = ExpertStore(tmp_path)
    for entry in build_zoo(model, store):
        path = store.path(entry.id)
        raw = path.read_bytes()
        assert not raw.startswith((b"\x80", b"PK"))  # neither a pickle nor a torch.save zip
        header = safetensors_header(path)
        assert json.loads(header["__metadata__"]["coe"])["expert_id"] == entry.id
        expert = model.experts[entry.id]
        backend = get_backend(expert.arch)
        module = backend.build(expert, store.read(entry.id))
        out = backend.run(module, expert, samples(entry.id)[:2])
        assert len(out) == 2


def test_sample_images_calibrate_classifiers_only(tmp_path: Path, model: CoEModel) -> None:
    asked: list[str] = []

    def sample_images(expert_id: str) -> list[np.ndarray]:
        asked.append(expert_id)
        return samples(expert_id)

    store = ExpertStore(tmp_path)
    build_zoo(model, store, sample_images=sample_images)
    assert asked == ["cls-r", "cls-c"]
    expert = model.experts["cls-r"]
    backend = get_backend(expert.arch)
    counts = Counter(o.label for o in backend.run(backend.build(expert, store.read("cls-r")), expert,
                                                  samples("cls-r")))
    assert counts["ok"] / 40 == pytest.approx(0.7, abs=0.1)


def test_unknown_arch_fails_before_anything_is_written(tmp_path: Path) -> None:
    raw = json.loads(json.dumps(SPEC))
    raw["experts"][2]["arch"] = "ultralytics/yolov8q"
    store = ExpertStore(tmp_path)
    with pytest.raises(CoEError, match="yolov8q"):
        build_zoo(parse_spec(raw), store)
    assert store.entries() == []


# -- stored dtype (--dtype) --------------------------------------------------------------------------
def test_fp16_zoo_holds_the_fp32_zoos_weights_cast_once(tmp_path: Path, model: CoEModel) -> None:
    import torch

    fp32 = ExpertStore(tmp_path / "fp32")
    fp16 = ExpertStore(tmp_path / "fp16")
    wide = build_zoo(model, fp32, seed=1)
    half = build_zoo(model, fp16, seed=1, dtype="fp16")
    assert [e.dtype for e in half] == ["float16"] * 3
    assert [e.dtype for e in fp16.entries()] == ["float16"] * 3            # what the manifest on disk says
    for a, b in zip(wide, half):
        assert b.nbytes < 0.55 * a.nbytes                                  # 2 bytes an element, not 4
        want, got = fp32.read(a.id), fp16.read(b.id)
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            cast = v.to(torch.float16) if v.is_floating_point() else v       # num_batches_tracked stays int64
            assert got[k].dtype == cast.dtype and torch.equal(got[k], cast), (a.id, k)
        header = safetensors_header(fp16.path(b.id))
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} <= {"F16", "I64"}
        expert = model.experts[b.id]
        backend = get_backend(expert.arch)                                 # an fp16 expert still serves on CPU
        assert len(backend.run(backend.build(expert, got), expert, samples(b.id)[:2])) == 2


def test_an_expert_stored_in_another_dtype_is_cast_only_when_a_dtype_is_asked_for(tmp_path: Path,
                                                                                   model: CoEModel) -> None:
    store = ExpertStore(tmp_path)
    build_zoo(model, store, dtype="bf16")
    said: list[str] = []
    kept = build_zoo(model, store, progress=said.append)                   # no dtype: keep what is there
    assert sum("kept" in m for m in said) == 3 and {e.dtype for e in kept} == {"bfloat16"}
    said.clear()
    rebuilt = build_zoo(model, store, dtype="fp32", progress=said.append)
    assert sum("cast from bfloat16 to float32" in m for m in said) == 3
    assert {e.dtype for e in rebuilt} == {e.dtype for e in store.entries()} == {"float32"}


def test_a_bad_dtype_fails_before_anything_is_written(tmp_path: Path, model: CoEModel) -> None:
    store = ExpertStore(tmp_path)
    with pytest.raises(CoEError, match="fp8.*fp32, fp16, bf16"):
        build_zoo(model, store, dtype="fp8")
    assert store.entries() == []


def test_zoo_build_cli_dtype_option(tmp_path: Path) -> None:
    import yaml
    from click.testing import CliRunner

    from conftest import write_line
    from edge_agent.cli import cli

    config = write_line(tmp_path / "line", store=tmp_path / "experts")
    one = {"name": "one", "experts": [SPEC["experts"][1] | {"next": {}}],
           "components": [{"name": "C0402", "classifier": "cls-c", "frequency": 1}]}
    (tmp_path / "line" / "tiny.coe.yaml").write_text(yaml.safe_dump(one))
    runner = CliRunner()
    res = runner.invoke(cli, ["zoo", "build", "--config", str(config), "--dtype", "bf16"])
    assert res.exit_code == 0, res.output
    assert ExpertStore(tmp_path / "experts").entry("cls-c").dtype == "bfloat16"
    res = runner.invoke(cli, ["zoo", "build", "--config", str(config), "--dtype", "fp16"])
    assert res.exit_code == 0, res.output
    assert ExpertStore(tmp_path / "experts").entry("cls-c").dtype == "float16"
    res = runner.invoke(cli, ["zoo", "build", "--config", str(config), "--dtype", "fp8"])
    assert res.exit_code == 2 and "fp32" in res.output and "bf16" in res.output
    help_text = runner.invoke(cli, ["zoo", "build", "--help"]).output
    assert "--dtype [fp32|fp16|bf16]" in help_text and "coe-agent zoo build --line A --dtype fp16" in help_text
