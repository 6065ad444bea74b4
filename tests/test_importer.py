"""Importing trained weights into the store: safetensors freely, pickles only with trust, checked before writing."""
from __future__ import annotations

import copy
import dataclasses
import os
import shlex
from pathlib import Path

import pytest
import torch

from coe import CoEError, ExpertLoadError, parse_spec
from executors.backends import get_backend
from storage.expert_store import ExpertStore
from executors.expert_import import import_expert

from conftest import TINY_SPEC

MODEL = parse_spec(TINY_SPEC)
CLS = MODEL.experts["cls-r0402"]   # torchvision/mobilenet_v3_small, 4 classes, input 32
DET = MODEL.experts["det-2term"]   # ultralytics/yolov8n, 2 classes, input 64


@pytest.fixture(scope="module")
def cls_weights() -> dict[str, torch.Tensor]:
    return get_backend(CLS.arch).init_weights(CLS, seed=11)


def store_files(store: ExpertStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir() if not p.name.startswith(".manifest.lock"))


def assert_stored_equal(store: ExpertStore, expert_id: str, want: dict[str, torch.Tensor]) -> None:
    got = store.read(expert_id)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_pickle_is_refused_without_trust_and_accepted_with_it(tmp_path, cls_weights):
    src = tmp_path / "r0402.pt"
    torch.save(cls_weights, src)
    store = ExpertStore(tmp_path / "store")
    with pytest.raises(CoEError, match=r"is a pickle file; pickles can run code when loaded; pass --trust"):
        import_expert(store, CLS, src)
    assert store_files(store) == [] and not store.has(CLS.id)

    entry = import_expert(store, CLS, src, trust=True)
    assert (entry.id, entry.arch, entry.version, entry.dtype) == (CLS.id, CLS.arch, 1, "float32")
    assert_stored_equal(store, CLS.id, cls_weights)
    assert ExpertStore(store.root).entry(CLS.id) == entry  # the manifest on disk says the same


@pytest.mark.parametrize("wrap", [
    pytest.param(lambda sd: {f"module.{k}": v for k, v in sd.items()}, id="dataparallel-prefix"),
    pytest.param(lambda sd: {"state_dict": sd, "epoch": 7}, id="state_dict-key"),
    pytest.param(lambda sd: {"model_state_dict": {f"module.{k}": v for k, v in sd.items()},
                             "optimizer": {"lr": 0.1}}, id="model_state_dict-key-prefixed"),
])
def test_common_checkpoint_layouts_import(tmp_path, cls_weights, wrap):
    src = tmp_path / "ckpt.pth"
    torch.save(wrap(cls_weights), src)
    store = ExpertStore(tmp_path / "store")
    import_expert(store, CLS, src, trust=True)
    assert_stored_equal(store, CLS.id, cls_weights)


def test_wrong_class_count_is_refused_naming_expert_and_file_and_store_is_unchanged(tmp_path, cls_weights):
    store = ExpertStore(tmp_path / "store")
    good = tmp_path / "good.pt"
    torch.save(cls_weights, good)
    before = import_expert(store, CLS, good, trust=True)
    manifest = store.manifest_path.read_bytes()

    three = dataclasses.replace(CLS, classes=("ok", "missing", "misaligned"))
    bad = tmp_path / "three-classes.pt"
    torch.save(get_backend(CLS.arch).init_weights(three, seed=1), bad)
    with pytest.raises(ExpertLoadError) as info:
        import_expert(store, CLS, bad, trust=True)
    assert info.value.expert_id == CLS.id and info.value.path == str(bad)
    assert "mis-shaped" in str(info.value) and str(bad) in str(info.value)
    assert store.manifest_path.read_bytes() == manifest and store.entry(CLS.id) == before
    assert_stored_equal(store, CLS.id, cls_weights)


def test_weights_of_another_arch_are_refused(tmp_path):
    shuffle = dataclasses.replace(CLS, arch="torchvision/shufflenet_v2_x0_5")
    src = tmp_path / "shufflenet.pt"
    torch.save(get_backend(shuffle.arch).init_weights(shuffle, seed=0), src)
    store = ExpertStore(tmp_path / "store")
    with pytest.raises(ExpertLoadError, match="missing keys"):
        import_expert(store, CLS, src, trust=True)
    assert store_files(store) == []


def test_ultralytics_checkpoint_imports_with_trust_only(tmp_path):
    backend = get_backend(DET.arch)  # pins ultralytics offline before it is imported below
    model = copy.deepcopy(backend.skeleton(DET))
    model.load_state_dict(backend.init_weights(DET, seed=5))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    src = tmp_path / "best.pt"
    # how ultralytics saves a trained model: the whole module object, in half precision
    torch.save({"epoch": -1, "model": model.half(), "ema": None, "optimizer": None}, src)
    store = ExpertStore(tmp_path / "store")
    with pytest.raises(CoEError, match="pass --trust"):
        import_expert(store, DET, src)
    assert store_files(store) == []

    entry = import_expert(store, DET, src, trust=True)
    assert entry.dtype == "float32"
    got = store.read(DET.id)
    assert sorted(got) == sorted(want)
    for k, v in want.items():  # the float32 values survive the half-precision round trip closely
        if v.is_floating_point():
            assert torch.allclose(got[k], v, rtol=1e-3, atol=1e-3), k
        else:
            assert torch.equal(got[k], v), k


def test_an_ultralytics_checkpoint_trained_on_other_classes_is_refused(tmp_path):
    """Its head's i-th class becomes the spec's i-th label in every box: classes in another order (or others)
    would label every defect wrongly.  A model built from its YAML alone ('0', '1') says nothing and imports."""
    backend = get_backend(DET.arch)
    model = copy.deepcopy(backend.skeleton(DET))
    store = ExpertStore(tmp_path / "store")
    for names, ok in (({0: "tombstone", 1: "solder_bridge"}, False), ({0: "solder_bridge", 1: "tombstone"}, True),
                      (["Solder bridge", "tombstone"], True)):     # spelled otherwise: the same class
        model.names = names
        src = tmp_path / "best.pt"
        torch.save({"model": model, "ema": None}, src)
        if ok:
            assert import_expert(store, DET, src, trust=True).id == DET.id
        else:
            with pytest.raises(CoEError, match=r"was trained on 2 classes, the spec's det-2term has 2, and they "
                                               r"differ at index 0: 'tombstone' against 'solder_bridge'"):
                import_expert(store, DET, src, trust=True)
            assert store_files(store) == []


def test_safetensors_imports_without_trust_and_version_increments(tmp_path, cls_weights):
    from safetensors.torch import save_file

    src = tmp_path / "r0402.safetensors"
    save_file(cls_weights, str(src))
    store = ExpertStore(tmp_path / "store")
    assert import_expert(store, CLS, src).version == 1
    second = {k: v + 1 if v.is_floating_point() else v for k, v in cls_weights.items()}
    save_file(second, str(src))
    entry = import_expert(store, CLS, src)
    assert entry.version == 2 and ExpertStore(store.root).entry(CLS.id).version == 2
    assert_stored_equal(store, CLS.id, second)


class _Payload:
    """Unpickling this runs a shell command: the attack a pickled 'weights' file can carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_malicious_pickle_never_runs(tmp_path, cls_weights):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    torch.save({**cls_weights, "evil": _Payload(marker)}, src)
    store = ExpertStore(tmp_path / "store")

    with pytest.raises(CoEError, match="pass --trust"):
        import_expert(store, CLS, src)
    assert not marker.exists()
    # trusted, but a torchvision expert only ever gets the weights_only loader, which refuses the call
    with pytest.raises(CoEError, match="holds Python objects"):
        import_expert(store, CLS, src, trust=True)
    assert not marker.exists()
    assert store_files(store) == []

    torch.load(src, weights_only=False)  # control: the payload is live, so the checks above meant something
    assert marker.exists()


def test_missing_and_unknown_files_are_clear_errors(tmp_path):
    store = ExpertStore(tmp_path / "store")
    with pytest.raises(CoEError, match="does not exist"):
        import_expert(store, CLS, tmp_path / "nope.pt", trust=True)
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"\0" * 16)
    with pytest.raises(CoEError, match=r"ONNX model but the spec says torchvision/.*onnx/<name> arch"):
        import_expert(store, CLS, onnx, trust=True)
    odd = tmp_path / "model.tflite"
    odd.write_bytes(b"\0" * 16)
    with pytest.raises(CoEError, match=r"unknown weights format '\.tflite'"):
        import_expert(store, CLS, odd, trust=True)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(CoEError, match="cannot read .*junk.pt with torch.load"):
        import_expert(store, CLS, junk, trust=True)
    for name, data in (("garbage.safetensors", b"\x80\x04 not safetensors at all"),
                       ("short.safetensors", b"\x10\x00")):            # a header length, then nothing
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(CoEError, match=f"expert 'cls-r0402': cannot read .*{name} as safetensors"):
            import_expert(store, CLS, bad)
    assert store_files(store) == []                                       # nothing half-written is left


def test_dtype_casts_floating_weights_before_the_check_and_keeps_integer_buffers(tmp_path, cls_weights):
    from safetensors.torch import save_file

    src = tmp_path / "r0402.safetensors"
    save_file(cls_weights, str(src))
    store = ExpertStore(tmp_path / "store")
    entry = import_expert(store, CLS, src, dtype="bf16")
    assert entry.dtype == "bfloat16" == ExpertStore(store.root).entry(CLS.id).dtype
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in cls_weights.items()}
    assert any(v.dtype == torch.int64 for v in want.values())     # BatchNorm counters: the case that matters
    assert_stored_equal(store, CLS.id, want)
    again = import_expert(store, CLS, src)                         # no dtype: the file's own
    assert again.dtype == "float32" and again.version == 2


def test_a_weight_too_large_for_fp16_is_refused_naming_expert_file_and_tensor(tmp_path, cls_weights):
    from safetensors.torch import save_file

    key = next(k for k, v in cls_weights.items() if v.is_floating_point() and v.numel() > 1)
    big = dict(cls_weights)
    big[key] = big[key].clone()
    big[key].view(-1)[0] = 1.0e6
    src = tmp_path / "big.safetensors"
    save_file(big, str(src))
    store = ExpertStore(tmp_path / "store")
    with pytest.raises(CoEError) as err:
        import_expert(store, CLS, src, dtype="fp16")
    msg = str(err.value)
    assert f"expert '{CLS.id}'" in msg and str(src) in msg and f"'{key}'" in msg and "1e+06" in msg
    assert not store.has(CLS.id)
    assert import_expert(store, CLS, src, dtype="bf16").dtype == "bfloat16"
