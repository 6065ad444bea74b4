"""`coe-agent llm import`: a Hugging Face MoE checkpoint split into one store entry per (layer, expert).

Checkpoints are built from transformers configs with generated weights
(`moe_models.build`), in every form the importer meets: what `save_pretrained`
writes (legacy per-expert keys), the model's own fused `state_dict()`, sharded
with an index, bf16 and fp16.  Then every way a checkpoint, a model and an
`llm.json` can be wrong, each with the clear error it must give.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_models import VOCAB, build, configs  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from coe import CoEError  # noqa: E402
from coe.moe import (LAYOUT_FORMAT, LAYOUT_VERSION, MoELayout, check_model_name, expert_id,  # noqa: E402
                     parse_expert_id)
from executors.moe_model import load_pooled  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from storage.llm_import import import_checkpoint  # noqa: E402
from storage.moe_structure import find_experts, why_not_servable  # noqa: E402
from storage.safetensors_io import ShardReader, StreamWriter  # noqa: E402

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


# -- checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (reference model, legacy save_pretrained dir, fused state_dict dir), built once."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"ckpt-{family}")
            ref = build(family, root / "legacy")
            fused = root / "fused"
            fused.mkdir()
            shutil.copy(root / "legacy" / "config.json", fused / "config.json")
            save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(fused / "model.safetensors"))
            cache[family] = (ref, root / "legacy", fused)
        return cache[family]
    return get


def _expert_keys(ref) -> dict[str, tuple[str, int]]:
    """model key of each fused expert parameter -> (param name, layer)."""
    sites = find_experts(ref)
    return {f"{s.path}.{p}": (p, s.layer) for s in sites for p in EXPERT_PARAMS}


def _saved_keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _assert_experts_match_reference(ref, layout: MoELayout, store_root: Path) -> None:
    store = ExpertStore(store_root)
    sites = {s.layer: s for s in find_experts(ref)}
    assert [l.layer for l in layout.layers] == sorted(sites)
    for l in layout.layers:
        experts = ref.get_submodule(sites[l.layer].path)
        for e in range(l.num_experts):
            got = store.read(expert_id(layout.model, l.layer, e))
            assert sorted(got) == sorted(EXPERT_PARAMS)
            for p in EXPERT_PARAMS:
                want = getattr(experts, p)[e].detach()
                assert got[p].dtype == want.dtype and torch.equal(got[p], want), \
                    f"layer {l.layer} expert {e} {p} differs from the model's fused parameter slice"


# -- what imports ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_legacy_and_fused_checkpoints_import_to_identical_experts(built, tmp_path, family):
    ref, legacy, fused = built(family)
    # the two checkpoints really are in the two layouts
    assert not any(k.endswith("gate_up_proj") for k in _saved_keys(legacy / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in _saved_keys(fused / "model.safetensors"))

    a = import_checkpoint(legacy, tmp_path / "a", name="m")
    b = import_checkpoint(fused, tmp_path / "b", name="m")
    assert a.layers == b.layers and a.dtype == b.dtype == "float32" and a.top_k == configs()[family].num_experts_per_tok
    sa, sb = ExpertStore(tmp_path / "a"), ExpertStore(tmp_path / "b")
    assert sorted(e.id for e in sa.entries()) == sorted(a.ids()) == sorted(b.ids())
    for eid in a.ids():
        ta, tb = sa.read(eid), sb.read(eid)
        assert all(torch.equal(ta[p], tb[p]) for p in EXPERT_PARAMS), eid
        assert sa.entry(eid).sha256 == sb.entry(eid).sha256
    # the resident weights carry the model's names in both cases, so the files are byte-identical
    assert a.resident_sha256 == b.resident_sha256
    _assert_experts_match_reference(ref, a, tmp_path / "a")
    _assert_experts_match_reference(ref, b, tmp_path / "b")


def test_layout_records_the_models_moe_shape(built, tmp_path):
    ref, legacy, _ = built("qwen2_moe")
    cfg = ref.config
    seen = []
    layout = import_checkpoint(legacy, tmp_path / "s", name="tiny-qwen", progress=lambda *a: seen.append(a))
    assert [n for stage, n in seen if stage == "experts"] == list(range(1, 17))
    assert [n for stage, n in seen if stage == "resident"] == list(range(1, len(ref.state_dict()) - 4 + 1))
    # layer 1 is dense (mlp_only_layers=[1]): only layers 0 and 2 are MoE
    assert [l.layer for l in layout.layers] == [0, 2]
    for l in layout.layers:
        assert (l.num_experts, l.hidden, l.intermediate) == (cfg.num_experts, cfg.hidden_size,
                                                             cfg.moe_intermediate_size)
        assert l.module == f"model.layers.{l.layer}.mlp.experts"
        assert l.expert_nbytes == 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    assert layout.model_type == "qwen2_moe" and layout.scoring == "softmax"
    assert layout.extra["norm_topk_prob"] is False
    assert MoELayout.load(tmp_path / "s") == layout
    assert layout.ids(2)[0] == "tiny-qwen.L02.E000" and parse_expert_id(layout.ids(2)[-1]) == ("tiny-qwen", 2, 7)
    assert (tmp_path / "s" / "model" / "config.json").is_file()


def test_sharded_checkpoint_imports(tmp_path):
    ref = build("mixtral", tmp_path / "hf", max_shard_size="60KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 2
    layout = import_checkpoint(tmp_path / "hf", tmp_path / "store", name="sharded")
    _assert_experts_match_reference(ref, layout, tmp_path / "store")
    # the index is a weight file, not a model file to copy
    assert not (tmp_path / "store" / "model" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_half_precision_checkpoints_keep_their_dtype(tmp_path, dtype, name):
    ref = build("mixtral", tmp_path / "hf", dtype=dtype)
    layout = import_checkpoint(tmp_path / "hf", tmp_path / "store", name="half")
    assert layout.dtype == name
    store = ExpertStore(tmp_path / "store")
    assert {e.dtype for e in store.entries()} == {name}
    full = 3 * ref.config.intermediate_size * ref.config.hidden_size
    assert all(e.nbytes == full * 2 for e in store.entries())           # 2 bytes an element, not 4
    _assert_experts_match_reference(ref, layout, tmp_path / "store")
    with safe_open(str(tmp_path / "store" / "resident.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == dtype


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_dtype_bf16_import_equals_importing_a_bf16_checkpoint_and_generates(built, tmp_path, family):
    """--dtype bf16 of an fp32 checkpoint gives the store a bf16 checkpoint gives: experts, resident, config."""
    _, legacy, _ = built(family)
    ref16 = build(family, tmp_path / "hf16", dtype=torch.bfloat16)        # the same seed, saved in bf16
    cast = import_checkpoint(legacy, tmp_path / "cast", name="m", dtype="bf16")
    native = import_checkpoint(tmp_path / "hf16", tmp_path / "native", name="m")
    assert cast.dtype == native.dtype == "bfloat16"
    assert json.loads((tmp_path / "cast" / "llm.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "cast" / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    sc, sn = ExpertStore(tmp_path / "cast"), ExpertStore(tmp_path / "native")
    assert {e.dtype for e in sc.entries()} == {"bfloat16"}
    assert all(sc.entry(eid).sha256 == sn.entry(eid).sha256 for eid in native.ids())
    assert cast.layers == native.layers
    _assert_experts_match_reference(ref16, cast, tmp_path / "cast")
    # what transformers keeps in fp32 when it loads in bf16 (DeepSeek-V3's router) stays fp32 here too: cast
    # from the fp32 checkpoint it is the fp32 weight, from the bf16 checkpoint the bf16 one widened, so the two
    # stores' resident files differ there, each as transformers' own loading of its checkpoint has it
    kept = bool(getattr(ref16, "_keep_in_fp32_modules_strict", None))
    assert (cast.resident_sha256 == native.resident_sha256) is not kept
    assert cast.resident_nbytes == native.resident_nbytes
    ref = ref16 if not kept else AutoModelForCausalLM.from_pretrained(
        legacy, experts_implementation="eager", dtype=torch.bfloat16).eval()     # the fp32 checkpoint, in bf16

    x = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    for store, reference in (("cast", ref), ("native", ref16)):
        layout = cast if store == "cast" else native
        pm = load_pooled(tmp_path / store, memory=layout.layers[0].expert_nbytes * (layout.top_k + 1), policy="lru")
        got, stats = pm.generate(x, 5)
        want = reference.generate(x, max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, x.shape[1]:].tolist()
        assert got == want and stats.tokens == 5
        with torch.no_grad():
            logits = pm.model(x).logits
        assert logits.dtype == torch.bfloat16 and torch.equal(logits, reference(x).logits), store
        pm.close()


def test_dtype_fp16_refuses_a_weight_it_would_store_as_inf(built, tmp_path):
    _, legacy, _ = built("mixtral")
    hf = tmp_path / "hf"
    shutil.copytree(legacy, hf)
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    sd["model.norm.weight"][3] = -1.0e5
    save_file(sd, str(hf / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CoEError) as err:
        import_checkpoint(hf, tmp_path / "out", dtype="fp16")
    msg = str(err.value)
    assert str(hf) in msg and "'model.norm.weight'" in msg and "100000" in msg and "overflow fp16" in msg
    assert not (tmp_path / "out" / "llm.json").exists()
    assert import_checkpoint(hf, tmp_path / "bf", dtype="bf16").dtype == "bfloat16"   # bf16 has the range
    with pytest.raises(CoEError, match=r"^dtype: unknown stored dtype 'int8'"):
        import_checkpoint(hf, tmp_path / "bad", dtype="int8")
    assert not (tmp_path / "bad").exists()


def test_fused_checkpoint_is_read_one_expert_slice_at_a_time(built, tmp_path, monkeypatch):
    ref, _, fused = built("mixtral")
    cfg = ref.config
    slice_bytes = 2 * cfg.intermediate_size * cfg.hidden_size * 4       # one expert's gate_up_proj, fp32
    whole = cfg.num_local_experts * slice_bytes
    reads: list[tuple[str, int | None, int]] = []
    orig = ShardReader.read

    def spy(self, name, index=None):
        out = orig(self, name, index)
        reads.append((name, index, out.numel() * out.element_size()))
        return out
    monkeypatch.setattr(ShardReader, "read", spy)
    import_checkpoint(fused, tmp_path / "store", name="stream")

    expert_reads = [r for r in reads if ".experts." in r[0]]
    n_layers = cfg.num_hidden_layers
    assert len(expert_reads) == n_layers * cfg.num_local_experts * 2    # one read per expert tensor
    assert all(index is not None for _, index, _ in expert_reads)       # always a slice
    assert max(n for _, _, n in expert_reads) == slice_bytes < whole    # never more than one expert's tensor
    assert sum(n for _, _, n in expert_reads) == n_layers * cfg.num_local_experts * 3 * slice_bytes // 2
    # the resident weights are read once each
    resident = [r[0] for r in reads if ".experts." not in r[0]]
    assert len(resident) == len(set(resident)) == len(ref.state_dict()) - 2 * n_layers


def test_shard_reader_reads_slices_and_whole_tensors(tmp_path):
    t = torch.arange(4 * 3 * 5, dtype=torch.float32).reshape(4, 3, 5)
    h = torch.arange(6, dtype=torch.float16)
    save_file({"t": t, "h": h}, str(tmp_path / "x.safetensors"))
    with ShardReader(tmp_path / "x.safetensors") as r:
        assert set(r.tensors) == {"t", "h"}
        assert torch.equal(r.read("t"), t) and torch.equal(r.read("h"), h)
        for i in range(4):
            assert torch.equal(r.read("t", i), t[i])
        with pytest.raises(CoEError, match="has no slice 4"):
            r.read("t", 4)


def test_stream_writer_writes_what_safetensors_reads(tmp_path):
    a, b = torch.randn(3, 4), torch.arange(5, dtype=torch.int64)
    w = StreamWriter(tmp_path / "o.safetensors", [("a", "float32", (3, 4)), ("b", "int64", (5,))], {"k": "v"})
    with pytest.raises(CoEError, match="out of order"):
        w.write("b", b)
    w.write("a", a)
    w.write("b", b)
    sha = w.close()
    assert sha == hashlib.sha256((tmp_path / "o.safetensors").read_bytes()).hexdigest()
    with safe_open(str(tmp_path / "o.safetensors"), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        assert torch.equal(f.get_tensor("a"), a) and torch.equal(f.get_tensor("b"), b)
    w = StreamWriter(tmp_path / "p.safetensors", [("a", "float32", (3, 4)), ("b", "int64", (5,))])
    w.write("a", a)
    with pytest.raises(CoEError, match="1 tensors were never written"):
        w.close()
    assert not (tmp_path / "p.safetensors").exists() and not list(tmp_path.glob(".p.safetensors*"))


def test_resident_file_holds_every_non_expert_weight_under_model_names(built, tmp_path):
    ref, legacy, _ = built("qwen2_moe")
    layout = import_checkpoint(legacy, tmp_path / "s", name="res")
    path = tmp_path / "s" / layout.resident_file
    assert layout.resident_file == "resident.safetensors"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == layout.resident_sha256
    llm = json.loads((tmp_path / "s" / "llm.json").read_text())
    assert llm["resident_sha256"] == layout.resident_sha256

    sd = ref.state_dict()
    experts = _expert_keys(ref)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        assert keys == set(sd) - set(experts)
        for k in keys:
            assert torch.equal(f.get_tensor(k), sd[k]), k
    assert layout.resident_nbytes == sum(sd[k].numel() * sd[k].element_size() for k in keys)
    assert not any("experts." in k for k in keys)
    for must in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.2.post_attention_layernorm.weight", "model.layers.1.mlp.down_proj.weight"):
        assert must in keys, must


def test_mixtral_router_lands_under_the_models_name(built, tmp_path):
    _, legacy, _ = built("mixtral")
    assert "model.layers.0.block_sparse_moe.gate.weight" in _saved_keys(legacy / "model.safetensors")
    layout = import_checkpoint(legacy, tmp_path / "s", name="mx")
    keys = set(_saved_keys(tmp_path / "s" / layout.resident_file))
    assert "model.layers.0.mlp.gate.weight" in keys
    assert not any("block_sparse_moe" in k for k in keys)


# -- malformed checkpoints ---------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("field,value", [("num_local_experts", "eight"), ("hidden_size", 0.5),
                                         ("num_experts_per_tok", None)])
def test_a_config_field_of_the_wrong_type_is_named_not_a_traceback(built, tmp_path, field, value):
    _, legacy, _ = built("mixtral")
    hf = _copy(legacy, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg[field] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CoEError, match=rf"config.json: transformers cannot read it: .*'{field}'"):
        import_checkpoint(hf, tmp_path / "out")
    assert not (tmp_path / "out" / "llm.json").exists()


def test_no_config_json(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(CoEError, match=r"hf: no config.json"):
        import_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _Canary:
    """Unpickling this creates a file: proof a pickle was (or was not) loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_only_checkpoint_is_refused_never_loaded(built, tmp_path, monkeypatch):
    import pickle

    _, legacy, _ = built("mixtral")
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(legacy / "config.json", hf / "config.json")
    canary = tmp_path / "unpickled"
    (hf / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Canary(canary)}))

    def no_load(*a, **k):
        raise AssertionError("torch.load called on an untrusted checkpoint")
    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(CoEError) as err:
        import_checkpoint(hf, tmp_path / "out")
    msg = str(err.value)
    assert "no safetensors weights" in msg and "pytorch_model.bin" in msg and "never loaded" in msg
    assert not canary.exists()
    assert not (tmp_path / "out").exists()


def test_truncated_shard(built, tmp_path):
    _, legacy, _ = built("mixtral")
    hf = _copy(legacy, tmp_path / "hf")
    shard = hf / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CoEError, match=r"model\.safetensors: tensor '.*' runs past the end of the file \(truncated"):
        import_checkpoint(hf, tmp_path / "out")
    shard.write_bytes(data[:5])
    with pytest.raises(CoEError, match=r"model\.safetensors: truncated safetensors file \(5 bytes"):
        import_checkpoint(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupt_header(built, tmp_path):
    _, legacy, _ = built("mixtral")
    hf = _copy(legacy, tmp_path / "hf")
    shard = hf / "model.safetensors"
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    bad = data[:]
    bad[8:12] = b"!!!!"                                      # the JSON's opening brace and more
    shard.write_bytes(bytes(bad))
    with pytest.raises(CoEError, match=r"model\.safetensors: corrupt safetensors header"):
        import_checkpoint(hf, tmp_path / "out")
    bad = data[:]
    bad[:8] = struct.pack("<Q", len(data) + 1)                # a header longer than the file
    shard.write_bytes(bytes(bad))
    with pytest.raises(CoEError, match=r"model\.safetensors: corrupt safetensors header \(claims"):
        import_checkpoint(hf, tmp_path / "out")
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["dtype"] = "Q9"                # a dtype nobody reads: named as such
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    assert len(raw) == n
    shard.write_bytes(bytes(data[:8]) + raw + bytes(data[8 + n:]))
    with pytest.raises(CoEError, match=r"tensor 'model\.norm\.weight' is Q9, which coe-edge does not read"):
        import_checkpoint(hf, tmp_path / "out")
    header["model.norm.weight"]["dtype"] = 7                   # an entry that is not a tensor description
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    shard.write_bytes(bytes(data[:8]) + raw + bytes(data[8 + n:]))
    with pytest.raises(CoEError, match=r"corrupt safetensors header entry for 'model\.norm\.weight'"):
        import_checkpoint(hf, tmp_path / "out")
    header["model.norm.weight"]["dtype"] = "F32"
    shape = header["model.norm.weight"]["shape"]
    header["model.norm.weight"]["shape"] = [-1, -shape[0]] if len(shape) == 1 else [-d for d in shape]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    shard.write_bytes(bytes(data[:8]) + raw + bytes(data[8 + n:]))
    with pytest.raises(CoEError, match=r"corrupt safetensors header entry for 'model\.norm\.weight': negative shape"):
        import_checkpoint(hf, tmp_path / "out")
    header["model.norm.weight"]["shape"] = [s + 0.5 for s in shape]    # not integers (Infinity: an OverflowError)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    shard.write_bytes(bytes(data[:8]) + raw + bytes(data[8 + n:]))
    with pytest.raises(CoEError, match=r"corrupt safetensors header entry for 'model\.norm\.weight'$"):
        import_checkpoint(hf, tmp_path / "out")


def _rewrite_without(src: Path, dst: Path, drop: set[str]) -> None:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    assert len(kept) == len(_saved_keys(src / "model.safetensors")) - len(drop)
    save_file(kept, str(dst / "model.safetensors"))


def test_checkpoint_missing_one_experts_tensor_names_it(built, tmp_path):
    _, legacy, fused = built("mixtral")
    _rewrite_without(legacy, tmp_path / "a", {"model.layers.1.block_sparse_moe.experts.5.w2.weight"})
    with pytest.raises(CoEError, match=r"lacks down_proj of experts \[5\] in 'model\.layers\.1\.mlp\.experts' "
                                       r"\(layer 1\)"):
        import_checkpoint(tmp_path / "a", tmp_path / "out")
    # half of gate_up_proj (the up projection, w3) is as much missing as all of it
    _rewrite_without(legacy, tmp_path / "b", {"model.layers.0.block_sparse_moe.experts.3.w3.weight"})
    with pytest.raises(CoEError, match=r"lacks gate_up_proj of experts \[3\] in 'model\.layers\.0\.mlp\.experts' "
                                       r"\(layer 0\)"):
        import_checkpoint(tmp_path / "b", tmp_path / "out")
    _rewrite_without(fused, tmp_path / "c", {"model.layers.1.mlp.experts.gate_up_proj"})
    with pytest.raises(CoEError, match=r"lacks gate_up_proj of experts \[0, 1, 2, 3, 4\] in "
                                       r"'model\.layers\.1\.mlp\.experts'"):
        import_checkpoint(tmp_path / "c", tmp_path / "out")
    assert not (tmp_path / "out").exists()          # refused before anything is written


def test_expert_of_the_wrong_shape_is_refused(built, tmp_path):
    _, legacy, _ = built("mixtral")
    src = legacy / "model.safetensors"
    dst = tmp_path / "hf"
    dst.mkdir()
    shutil.copy(legacy / "config.json", dst / "config.json")
    key = "model.layers.0.block_sparse_moe.experts.2.w2.weight"
    with safe_open(str(src), framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    sd[key] = sd[key][:, :-1].contiguous()
    save_file(sd, str(dst / "model.safetensors"))
    with pytest.raises(CoEError, match=r"expert 2 of 'model\.layers\.0\.mlp\.experts': .*experts\.2\.w2\.weight are "
                                       r"\[\[64, 95\]\], which do not make down_proj \[64, 96\]"):
        import_checkpoint(dst, tmp_path / "out")


def test_index_listing_a_missing_shard(tmp_path):
    build("olmoe", tmp_path / "hf", max_shard_size="60KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "hf" / gone).unlink()
    with pytest.raises(CoEError, match=rf"model\.safetensors\.index\.json: lists shards that are missing: .*{gone}"):
        import_checkpoint(tmp_path / "hf", tmp_path / "out")
    for bad in ('{"weight_map": 3}', '{"weight_map": {"a": 1}}', '{"metadata": {}}', '{"weight_map": ',
                '{"weight_map": {}}'):
        (tmp_path / "hf" / "model.safetensors.index.json").write_text(bad)
        with pytest.raises(CoEError, match=r"model\.safetensors\.index\.json: malformed shard index"):
            import_checkpoint(tmp_path / "hf", tmp_path / "out")
    # a shard outside the model directory is never opened
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tmp_path / "hf" / sorted(set(index["weight_map"].values()))[0], outside)
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(CoEError, match=r"shard '\.\./elsewhere\.safetensors' is not a file name in"):
        import_checkpoint(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["../evil", "a b", "", "-lead", "x" * 65, "a/b"])
def test_bad_name(built, tmp_path, bad):
    _, legacy, _ = built("mixtral")
    with pytest.raises(CoEError, match="model name .* must be 1-64 letters"):
        import_checkpoint(legacy, tmp_path / "out", name=bad)
    assert not (tmp_path / "out").exists()


def test_default_name_comes_from_the_directory(built, tmp_path):
    _, legacy, _ = built("mixtral")
    hf = _copy(legacy, tmp_path / "My Model (v2)")
    layout = import_checkpoint(hf, tmp_path / "out")
    check_model_name(layout.model)
    assert layout.model == "My-Model--v2-"


# -- models that cannot be pooled ---------------------------------------------------------------------
def _meta(make):
    with torch.device("meta"):
        return make()


def _gpt_oss():
    from transformers import AutoModelForCausalLM, GptOssConfig

    return AutoModelForCausalLM.from_config(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2))


def _llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1))


def _switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1))


@pytest.mark.parametrize("make,path,reason", [
    (_gpt_oss, r"'model\.layers\.0\.mlp\.experts' \(GptOssExperts\)",
     r"its forward takes \(hidden_states, router_indices, routing_weights\)"),
    (_llama4, r"'model\.layers\.0\.feed_forward\.experts' \(Llama4TextExperts\)",
     r"its forward takes \(hidden_states\), not \(hidden_states, top_k_index, top_k_weights\)"),
    (_switch, r"'encoder\.block\.1\.layer\.1\.mlp\.experts' \(SwitchTransformersExperts\)",
     r"its forward takes \(hidden_states, selected_experts, routing_weights\)"),
], ids=["gpt-oss", "llama4", "switch"])
def test_other_experts_layouts_are_refused_with_path_and_reason(make, path, reason):
    model = _meta(make)
    with pytest.raises(CoEError, match=rf"cannot pool these experts modules: .*{path}: {reason}") as err:
        find_experts(model)
    assert str(err.value).startswith(type(model).__name__ + ":")


def test_dense_model_has_no_experts():
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = _meta(lambda: AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)))
    with pytest.raises(CoEError, match=r"^LlamaForCausalLM: no MoE experts module found"):
        find_experts(model)


def _mixtral_meta():
    from moe_models import configs
    from transformers import AutoModelForCausalLM

    return _meta(lambda: AutoModelForCausalLM.from_config(configs()["mixtral"]))


def test_find_experts_on_a_servable_model():
    model = _mixtral_meta()
    sites = find_experts(model)
    assert [(s.path, s.layer, s.num_experts, s.hidden, s.intermediate, s.router) for s in sites] == [
        (f"model.layers.{i}.mlp.experts", i, 8, 64, 96, f"model.layers.{i}.mlp.gate") for i in range(2)]


def _with_bias(m):
    m.register_parameter("gate_up_proj_bias", torch.nn.Parameter(torch.empty(8, 192, device="meta")))


def _transposed(m):
    m.is_transposed = True


def _swapped(m):
    m.down_proj = torch.nn.Parameter(torch.empty(8, 96, 64, device="meta"))


def _sub_module(m):
    m.extra = torch.nn.Linear(4, 4, device="meta")


@pytest.mark.parametrize("mutate,reason", [
    (_with_bias, "it has parameters beyond gate_up_proj and down_proj: gate_up_proj_bias"),
    (_transposed, r"its weights are laid out with is_transposed=True \(coe-edge serves is_transposed=False\)"),
    (_swapped, r"gate_up_proj \[8, 192, 64\] and down_proj \[8, 96, 64\] do not fit"),
    (_sub_module, r"it holds a sub-module with weights \('extra'\)"),
], ids=["bias", "transposed", "shapes", "submodule"])
def test_experts_module_with_a_different_layout_is_refused(mutate, reason):
    model = _mixtral_meta()
    experts = model.get_submodule("model.layers.1.mlp.experts")
    assert why_not_servable(experts) is None
    mutate(experts)
    assert why_not_servable(experts) is not None
    with pytest.raises(CoEError, match=rf"'model\.layers\.1\.mlp\.experts' \(MixtralExperts\): {reason}"):
        find_experts(model)


# -- llm.json -------------------------------------------------------------------------------------------
def _layout_doc() -> dict:
    return {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "model": "tiny", "model_type": "mixtral",
            "top_k": 2, "dtype": "float32", "resident_file": "resident.safetensors", "resident_sha256": "ab",
            "resident_nbytes": 10, "scoring": "softmax", "extra": {},
            "layers": [{"layer": 0, "module": "model.layers.0.mlp.experts", "num_experts": 8, "hidden": 64,
                        "intermediate": 96, "expert_nbytes": 73728},
                       {"layer": 1, "module": "model.layers.1.mlp.experts", "num_experts": 8, "hidden": 64,
                        "intermediate": 96, "expert_nbytes": 73728}]}


def test_layout_round_trip(tmp_path):
    layout = MoELayout.from_dict(_layout_doc())
    assert layout.expert_bytes == 2 * 8 * 73728
    assert len(layout.ids()) == 16 and layout.ids(1)[3] == "tiny.L01.E003"
    assert [e.id for e in layout.experts()] == layout.ids()
    assert layout.layer(1).module == "model.layers.1.mlp.experts"
    with pytest.raises(CoEError, match="has no MoE layer 5"):
        layout.layer(5)
    layout.save(tmp_path)
    assert MoELayout.load(tmp_path) == layout
    import dataclasses
    fewer = dataclasses.replace(layout.layers[1], num_experts=4)
    uneven = dataclasses.replace(layout, layers=(layout.layers[0], fewer))
    with pytest.raises(CoEError, match="num_experts"):
        uneven.save(tmp_path / "uneven")          # refused before it is written: no store a load refuses
    assert not (tmp_path / "uneven" / "llm.json").exists()
    with pytest.raises(CoEError, match="llm.json: not found"):
        MoELayout.load(tmp_path / "nowhere")
    (tmp_path / "llm.json").write_text('{"format": ')
    with pytest.raises(CoEError, match="llm.json: cannot read the MoE layout"):
        MoELayout.load(tmp_path)


def _set(path, value):
    def apply(doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return apply


def _drop(path):
    def apply(doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return apply


def _dup_layer(doc):
    doc["layers"][1]["layer"] = 0


@pytest.mark.parametrize("edit,match", [
    (_set(["format"], "something-else"), r"not an MoE layout \(expected an object with format"),
    (_set(["version"], 2), r"unsupported MoE layout version 2"),
    (_drop(["top_k"]), r"llm\.json: missing 'top_k'"),
    (_drop(["layers", 1, "expert_nbytes"]), r"llm\.json\.layers\[1\]: missing 'expert_nbytes'"),
    (_set(["top_k"], "2"), r"llm\.json\.top_k: must be int, got str"),
    (_set(["top_k"], True), r"llm\.json\.top_k: must be int, got bool"),
    (_set(["layers"], {}), r"llm\.json\.layers: must be list, got dict"),
    (_set(["layers", 0, "hidden"], 64.0), r"llm\.json\.layers\[0\]\.hidden: must be int, got float"),
    (_set(["layers", 0], 3), r"llm\.json\.layers\[0\]: expected an object"),
    (_set(["top_k"], 9), r"llm\.json\.layers\[0\]\.num_experts: 8 is fewer than top_k 9"),
    (_set(["top_k"], 0), r"llm\.json\.top_k: must be at least 1"),
    (_set(["layers", 1, "intermediate"], 0), r"llm\.json\.layers\[1\]\.intermediate: must be positive"),
    (_dup_layer, r"llm\.json\.layers\[1\]\.layer: layer index 0 appears twice"),
    (_set(["layers", 0, "layer"], -1), r"llm\.json\.layers\[0\]\.layer: must not be negative"),
    (_set(["dtype"], "int8"), r"llm\.json\.dtype: must be one of float32, float16, bfloat16, got 'int8'"),
    (_set(["dtype"], 16), r"llm\.json\.dtype: must be str, got int"),
    (_set(["resident_nbytes"], -5), r"llm\.json\.resident_nbytes: must not be negative"),
    (_set(["resident_file"], ".."), r"llm\.json\.resident_file: must be a plain file name"),
    (_set(["resident_file"], ""), r"llm\.json\.resident_file: must be a plain file name"),
    (_set(["resident_file"], "sub\\r.safetensors"), r"llm\.json\.resident_file: must be a plain file name"),
    (_set(["resident_file"], "/abs/resident.safetensors"), r"llm\.json\.resident_file: must be a plain file"),
    (_set(["layers"], []), r"llm\.json\.layers: an MoE layout needs at least one layer"),
    (_set(["resident_file"], "../resident.safetensors"), r"llm\.json\.resident_file: must be a plain file name"),
    (_set(["resident_file"], "sub/resident.safetensors"), r"llm\.json\.resident_file: must be a plain file name"),
    (_set(["scoring"], "relu"), r"llm\.json\.scoring: must be 'softmax' or 'sigmoid'"),
    (_set(["model"], "bad name"), r"model name 'bad name'"),
    (_set(["extra"], []), r"llm\.json\.extra: must be an object"),
])
def test_malformed_layout_names_the_field(edit, match):
    MoELayout.from_dict(_layout_doc())          # the unedited document is fine
    doc = _layout_doc()
    edit(doc)
    with pytest.raises(CoEError, match=match):
        MoELayout.from_dict(doc, "llm.json")


def test_layout_that_is_not_an_object():
    for raw in ([], "x", None):
        with pytest.raises(CoEError, match="not an MoE layout"):
            MoELayout.from_dict(raw)


@pytest.mark.parametrize("bad", ["tiny.L1.E001", "tiny.L01.E01", "L01.E001", "tiny.L01.E001x", "tiny"])
def test_parse_expert_id_refuses_other_ids(bad):
    with pytest.raises(CoEError, match="is not an MoE expert id"):
        parse_expert_id(bad)


def test_expert_id_round_trip():
    assert expert_id("m.x", 3, 7) == "m.x.L03.E007"
    assert parse_expert_id(expert_id("m.x", 12, 130)) == ("m.x", 12, 130)


def test_overlapping_tensors_and_a_key_in_two_shards_are_refused(tmp_path):
    head = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    bad = tmp_path / "overlap.safetensors"
    bad.write_bytes(struct.pack("<Q", len(head)) + head + bytes(12))
    with pytest.raises(CoEError, match="overlaps"):
        ShardReader(bad)

    src = tmp_path / "hf"
    build("mixtral", src)
    one = sorted(src.glob("*.safetensors"))[0]
    save_file({"lm_head.weight": torch.zeros(320, 64)}, str(src / "extra.safetensors"))
    assert one.name == "model.safetensors"
    with pytest.raises(CoEError, match="in two shards"):
        import_checkpoint(src, tmp_path / "store")


def test_every_non_expert_weight_is_covered_exactly_once(tmp_path):
    from safetensors.torch import load_file

    src = tmp_path / "hf"
    build("mixtral", src)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CoEError, match="lacks 1 non-expert weights the model needs: model.norm.weight"):
        import_checkpoint(src, tmp_path / "s1")

    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.block_sparse_moe.gate.weight"].clone()
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CoEError, match="both map to the model's 'model.layers.0.mlp.gate.weight'"):
        import_checkpoint(src, tmp_path / "s2")


def test_a_reimport_killed_part_way_leaves_a_store_that_refuses_to_load_not_a_mix(built, tmp_path):
    """Re-importing into a store that has a model, stopped after three experts: its layout went first, so the
    store must not load at all; the experts land in groups, so none of the stopped group replaced an old one;
    and a full import makes it whole again."""
    _, legacy, _ = built("mixtral")
    out = tmp_path / "store"
    first = import_checkpoint(legacy, out, name="m")
    load_pooled(out, memory=first.layers[0].expert_nbytes * (first.top_k + 1), policy="lru").close()

    def killed(stage, n):
        if stage == "experts" and n == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        import_checkpoint(legacy, out, name="m", dtype="bf16", progress=killed)
    assert {e.dtype for e in ExpertStore(out).entries()} == {"float32"}     # the stopped group landed none
    with pytest.raises(CoEError, match="llm.json: not found; is .* a store written by 'coe-agent llm import'"):
        load_pooled(out, memory=first.layers[0].expert_nbytes * (first.top_k + 1), policy="lru")
    again = import_checkpoint(legacy, out, name="m", dtype="bf16")
    assert {e.dtype for e in ExpertStore(out).entries()} == {"bfloat16"} and again.dtype == "bfloat16"
    load_pooled(out, memory=again.layers[0].expert_nbytes * (again.top_k + 1), policy="lru").close()


def _variant(src: Path, dst: Path, *, config: dict | None = None, tensors=None) -> Path:
    """A copy of the checkpoint `src`, its config.json updated by `config`, its tensors passed through `tensors`."""
    dst.mkdir()
    doc = json.loads((src / "config.json").read_text())
    doc.update(config or {})
    (dst / "config.json").write_text(json.dumps(doc))
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors(sd) if tensors else sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_reimport_that_fails_its_checks_leaves_the_model_already_there_working(built, tmp_path):
    """Every shape is known from the headers: a checkpoint that fails on its last expert is refused before the
    store's layout goes or any expert is replaced (before, 15 experts were replaced and llm.json was gone)."""
    _, legacy, _ = built("mixtral")
    out = tmp_path / "store"
    first = import_checkpoint(legacy, out, name="m")
    key = "model.layers.1.block_sparse_moe.experts.7.w2.weight"

    def bad(sd):
        sd[key] = sd[key].t().contiguous()
        return sd
    broken = _variant(legacy, tmp_path / "broken", tensors=bad)
    before = {e.id: e.sha256 for e in ExpertStore(out).entries()}
    with pytest.raises(CoEError, match=r"experts\.7\.w2\.weight are \[\[\d+, \d+\]\], which do not make down_proj"):
        import_checkpoint(broken, out, name="m")
    assert {e.id: e.sha256 for e in ExpertStore(out).entries()} == before
    load_pooled(out, memory=first.layers[0].expert_nbytes * (first.top_k + 1), policy="lru").close()   # still loads


@pytest.mark.parametrize("config,tensors,says", [
    ({"vocab_size": 640}, None, r"'(lm_head|model\.embed_tokens)\.weight' is \[\d+, \d+\], the model's "
                                r"'(lm_head|model\.embed_tokens)\.weight' is \[640, \d+\]"),
    ({"num_local_experts": 4}, None, r"experts\.4\.w\d\.weight' is expert 4 of '.*', which the config gives 4 experts"),
    ({"num_local_experts": 0}, None, r"has 0 experts|num_experts"),
    ({"num_experts_per_tok": 9}, None, r"each token asks for 9 experts .* has 8"),
    (None, lambda sd: {**sd, "model.norm.weight": sd["model.norm.weight"].to(torch.int32)},
     r"'model\.norm\.weight' is int32, the model's 'model\.norm\.weight' is floating point"),
], ids=["vocab", "fewer-experts", "no-experts", "top-k", "int-norm"])
def test_a_checkpoint_its_config_does_not_describe_is_refused_at_import(built, tmp_path, config, tensors, says):
    _, legacy, _ = built("mixtral")
    src = _variant(legacy, tmp_path / "v", config=config, tensors=tensors)
    with pytest.raises(CoEError, match=says):
        import_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out" / "llm.json").exists()


def test_a_bf16_checkpoint_with_an_fp32_router_imports_in_one_dtype_and_generates_as_transformers(built, tmp_path):
    """transformers loads such a checkpoint in its config's dtype; a resident file of two dtypes made every
    matmul of the router fail ('expected m1 and m2 to have the same dtype')."""
    ref = build("mixtral", tmp_path / "hf16", dtype=torch.bfloat16)

    def fp32_router(sd):
        return {k: (v.float() if k.endswith("block_sparse_moe.gate.weight") else v) for k, v in sd.items()}
    mixed = _variant(tmp_path / "hf16", tmp_path / "mixed", tensors=fp32_router)
    layout = import_checkpoint(mixed, tmp_path / "store", name="m")
    with safe_open(str(tmp_path / "store" / "resident.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    want_ref = AutoModelForCausalLM.from_pretrained(mixed, experts_implementation="eager", dtype=torch.bfloat16).eval()
    x = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    pm = load_pooled(tmp_path / "store", memory=layout.layers[0].expert_nbytes * (layout.top_k + 1), policy="lru")
    try:
        got, _ = pm.generate(x, 5)
    finally:
        pm.close()
    assert got == want_ref.generate(x, max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, x.shape[1]:].tolist()
    assert ref is not None


def test_out_inside_the_checkpoint_is_refused_and_unused_tensors_are_named(built, tmp_path, caplog):
    import logging

    _, legacy, _ = built("mixtral")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(legacy, ckpt)
    for out in (ckpt, ckpt / "store"):
        with pytest.raises(CoEError, match=r"inside the checkpoint"):
            import_checkpoint(ckpt, out)
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "model").write_text("a file where the config folder goes")
    with pytest.raises(CoEError, match=r"model is a file"):
        import_checkpoint(ckpt, tmp_path / "o2")
    assert list((tmp_path / "o2").iterdir()) == [tmp_path / "o2" / "model"]          # refused before writing
    one_layer = _variant(legacy, tmp_path / "one", config={"num_hidden_layers": 1})
    with caplog.at_level(logging.WARNING, logger="storage.llm_import"):
        layout = import_checkpoint(one_layer, tmp_path / "o3")
    assert len(layout.layers) == 1
    assert any("has no place for are left out" in r.getMessage() and "layers.1." in r.getMessage()
               for r in caplog.records)
