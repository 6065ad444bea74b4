"""Stored dtypes: parsing --dtype, and casting weights without changing integer buffers or storing inf."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coe import CoEError
from storage.dtypes import STORED_DTYPES, cast_floating, parse_dtype


@pytest.mark.parametrize("name,want", [("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16"),
                                       ("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                                       ("half", "float16"), ("BF16", "bfloat16")])
def test_parse_dtype_accepts_short_and_torch_names(name, want):
    assert parse_dtype(name) == want
    assert getattr(torch, parse_dtype(name)).is_floating_point


@pytest.mark.parametrize("bad", ["fp8", "int8", "", "float64"])
def test_parse_dtype_rejects_others_naming_the_option_and_the_choices(bad):
    with pytest.raises(CoEError) as err:
        parse_dtype(bad)
    msg = str(err.value)
    assert msg.startswith("--dtype:") and repr(bad) in msg and "fp32, fp16, bf16" in msg
    with pytest.raises(CoEError, match=r"^llm\.json dtype:"):
        parse_dtype(bad, where="llm.json dtype")


def test_stored_dtypes_are_the_three_the_issue_names():
    assert STORED_DTYPES == ("fp32", "fp16", "bf16")


def test_cast_floating_casts_floats_and_keeps_integer_and_bool_buffers():
    g = torch.Generator().manual_seed(0)
    src = {"w": torch.randn(4, 5, generator=g), "b64": torch.randn(3, dtype=torch.float64, generator=g),
           "bn.num_batches_tracked": torch.tensor(123456789, dtype=torch.int64),
           "mask": torch.tensor([True, False])}
    for dtype, want in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        out = cast_floating(src, dtype)
        assert sorted(out) == sorted(src)
        assert out["w"].dtype == out["b64"].dtype == want
        assert torch.equal(out["w"], src["w"].to(want)) and torch.equal(out["b64"], src["b64"].to(want))
        assert out["bn.num_batches_tracked"] is src["bn.num_batches_tracked"]   # not 123456792.0 in bf16
        assert out["mask"] is src["mask"]
    back = cast_floating({"h": torch.ones(2, dtype=torch.bfloat16)}, "fp32")
    assert back["h"].dtype == torch.float32


def test_cast_to_the_same_dtype_returns_the_tensor_itself():
    t = torch.zeros(3, dtype=torch.float16)
    assert cast_floating({"t": t}, "float16")["t"] is t


def test_fp16_overflow_is_an_error_naming_the_tensor_and_its_largest_value():
    src = {"ok": torch.ones(3), "head.weight": torch.tensor([1.0, -7.0e4, 3.0e5, 60000.0])}
    with pytest.raises(CoEError) as err:
        cast_floating(src, "fp16")
    msg = str(err.value)
    assert "'head.weight'" in msg and "2 value(s)" in msg and "300000" in msg and "65504" in msg
    assert "'ok'" not in msg
    # bf16 has fp32's range: the same weights cast without inf
    assert torch.isfinite(cast_floating(src, "bf16")["head.weight"]).all()
    # 65504 itself and values that round down to it are fine; an inf already in the source is not our overflow
    edge = cast_floating({"e": torch.tensor([65504.0, -65510.0, float("inf")])}, "fp16")["e"]
    assert edge.tolist() == [65504.0, -65504.0, float("inf")]


def test_importing_the_module_does_not_import_torch():
    root = Path(__file__).resolve().parents[1]
    # load the file alone, not through storage/__init__, whose other modules are not this test's subject
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('dtypes', 'storage/dtypes.py'); "
            "d = u.module_from_spec(s); s.loader.exec_module(d); d.parse_dtype('bf16'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_fp16_keeps_a_tensor_it_would_flush_to_zero_in_its_source_dtype(caplog):
    import torch

    from storage.dtypes import cast_floating, fp16_underflows

    src = {"bias": torch.tensor([2.5e-10, -1e-10, 3e-10, 0.0]),          # a calibrated demo bias
           "w": torch.randn(1000) * 0.02,                                 # a few values near zero: fine
           "half_gone": torch.cat([torch.full((50,), 1e-9), torch.ones(950)])}   # 5% flushed
    with caplog.at_level("WARNING"):
        out = cast_floating(src, "fp16")
    assert out["bias"].dtype == torch.float32 and torch.equal(out["bias"], src["bias"])
    assert out["half_gone"].dtype == torch.float32
    assert out["w"].dtype == torch.float16
    assert "bias" in caplog.text and "half_gone" in caplog.text
    assert not fp16_underflows(torch.zeros(3), torch.zeros(3, dtype=torch.float16))
    assert cast_floating(src, "bf16")["bias"].dtype == torch.bfloat16      # bf16 has fp32's range


def test_a_store_of_one_dtype_refuses_what_fp16_would_flush():
    import torch

    from storage.dtypes import cast_floating

    with pytest.raises(CoEError, match=r"tensor 'bias'.*flush.*bf16 or fp32"):
        cast_floating({"bias": torch.tensor([1e-10, 2e-10])}, "fp16", keep_underflow=False)


def test_zoo_build_with_a_dtype_casts_the_stored_weights_and_training_keeps_the_cast(tiny_zoo, tmp_path):
    """`zoo build --dtype fp16` after training regenerated every expert with untrained random weights; the next
    demo then trained again and wrote fp32, so the dtype asked for was lost too."""
    import shutil

    from coe import parse_spec
    from edge_agent.zoo import build_zoo
    from edge_agent.zoo_train import _read_marker, _write_marker, in_stored_dtype
    from storage.expert_store import ExpertStore

    from conftest import TINY_SPEC

    shutil.copytree(tiny_zoo, tmp_path / "experts")
    store = ExpertStore(tmp_path / "experts")
    model = parse_spec(TINY_SPEC)
    before = {k: v.clone() for k, v in store.read("cls-r0402").items()}
    path, marker = _read_marker(store)
    marker["cls-r0402"] = {"sha256": store.entry("cls-r0402").sha256, "recipe": {"as": "trained"}}
    _write_marker(path, marker)
    build_zoo(model, store, dtype="fp16")
    after = store.read("cls-r0402")
    assert store.entry("cls-r0402").dtype == "float16"
    assert all(torch.equal(after[k], cast_floating(before, "fp16")[k]) for k in before)    # cast, not regenerated
    assert _read_marker(store)[1]["cls-r0402"]["sha256"] == store.entry("cls-r0402").sha256
    trained_again = in_stored_dtype(store, "cls-r0402", {k: v.float() for k, v in before.items()
                                                          if v.is_floating_point()})
    assert {v.dtype for v in trained_again.values()} <= {torch.float16, torch.float32}
    assert trained_again[next(k for k in trained_again if k.endswith("weight"))].dtype == torch.float16
