"""Exponent-zstd compression: bit-exact round trips, corrupt chunks caught, the store's plumbing."""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coe import CoEError, Expert, ExpertLoadError
from storage import exponent_codec as codec
from storage.compressed import CHUNK_BYTES, compress_file, read_header
from storage.expert_store import ExpertStore
from storage.tiers import StoreSource

SPECIALS = {
    # NaN (quiet and signalling payloads), +-Inf, +-0, the smallest subnormals, the largest finite values
    "bf16": [0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x7F7F, 0xFF7F],
    "fp16": [0x7E00, 0x7C01, 0xFE01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x7BFF, 0xFBFF],
    "fp32": [0x7FC00000, 0x7F800001, 0xFFC00001, 0x7F800000, 0xFF800000, 0x0, 0x80000000, 0x1, 0x80000001,
             0x007FFFFF, 0x7F7FFFFF, 0xFF7FFFFF],
}
UINT = {"bf16": np.uint16, "fp16": np.uint16, "fp32": np.uint32}


def _bits(kind: str):
    width = 16 if kind != "fp32" else 32
    anything = st.integers(0, 2**width - 1)
    return st.lists(st.one_of(anything, st.sampled_from(SPECIALS[kind])), min_size=1, max_size=3000)


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp32"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip_is_bit_exact_for_every_bit_pattern(kind: str, data) -> None:
    values = np.array(data.draw(_bits(kind)), dtype=UINT[kind]).view(np.uint8)
    enc = codec.encode(values, kind)
    out = np.empty_like(values)
    codec.decode_into(out, kind, enc.zplane, enc.raw)
    assert out.tobytes() == values.tobytes()


def test_specials_survive_and_trained_like_weights_compress_near_their_bound() -> None:
    w = (torch.randn(1 << 18) * 0.02).to(torch.bfloat16)
    w[:12] = torch.tensor(SPECIALS["bf16"], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    raw = w.view(torch.uint8).numpy()
    enc = codec.encode(raw, "bf16")
    out = np.empty_like(raw)
    codec.decode_into(out, "bf16", enc.zplane, enc.raw)
    assert out.tobytes() == raw.tobytes()
    ratio = enc.nbytes / raw.size
    bound = codec.bound_ratio("bf16", codec.exponent_histogram(raw, "bf16"))
    assert 0.6 < bound < 0.7          # N(0, 0.02) has ~2.5 bits of exponent entropy
    assert bound <= ratio < bound + 0.02


def test_bound_formulas_follow_the_raw_bits_of_each_type() -> None:
    hist = np.array([1, 1, 1, 1])     # two bits of entropy
    assert codec.bound_ratio("bf16", hist) == pytest.approx((8 + 2) / 16)
    assert codec.bound_ratio("fp32", hist) == pytest.approx((24 + 2) / 32)
    assert codec.bound_ratio("fp16", hist) == pytest.approx((8 + 2) / 16)   # H of the coded high byte
    fp16 = torch.tensor([1.0, -1.0, 2.0, 0.5]).half().view(torch.uint8).numpy()
    assert len(codec.exponent_histogram(fp16, "fp16")) == 256
    assert codec.codec_for("int64") == "raw" and codec.codec_for("bfloat16") == "bf16"


def test_a_corrupt_or_mis_sized_plane_is_a_codec_error() -> None:
    raw = (torch.randn(4096) * 0.1).to(torch.bfloat16).view(torch.uint8).numpy()
    enc = codec.encode(raw, "bf16")
    out = np.empty_like(raw)
    bad = bytearray(enc.zplane)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(codec.CodecError, match="exponent plane"):
        codec.decode_into(out, "bf16", bytes(bad), enc.raw)
    with pytest.raises(codec.CodecError, match="raw plane"):
        codec.decode_into(out, "bf16", enc.zplane, enc.raw[:-1])


def _expert(eid: str = "e1") -> Expert:
    return Expert(id=eid, arch="torchvision/resnet18", kind="classifier", classes=("ok", "bad"), input_size=32)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": (torch.randn(600, 1000, generator=g) * 0.05).to(torch.bfloat16),   # > one chunk
            "h": torch.randn(300, generator=g).half(),
            "f": torch.randn(1000, generator=g),
            "n": torch.tensor(7)}


@pytest.fixture()
def zstore(tmp_path: Path) -> ExpertStore:
    store = ExpertStore(tmp_path, verify="always")
    store.set_compression("exponent-zstd")
    store.write(_expert(), _tensors())
    return store


def test_a_compressed_store_reads_back_bit_exact_with_the_plain_files_hash(tmp_path: Path, zstore) -> None:
    entry = zstore.entry("e1")
    plain = ExpertStore(tmp_path / "plain").write(_expert(), _tensors())
    assert entry.compression == "exponent-zstd" and entry.file == "e1.coez"
    assert entry.sha256 == plain.sha256 and entry.plain_nbytes == plain.stored_nbytes
    assert entry.stored_nbytes == (tmp_path / "e1.coez").stat().st_size
    assert 0.5 < entry.ratio < 0.9 and entry.bound is not None and entry.bound <= entry.ratio
    assert len(read_header(tmp_path / "e1.coez", "e1").chunks) > 2
    for got in (zstore.read("e1"), zstore.read_flat("e1").tensors()):
        assert {k: got[k].dtype for k in got} == {k: v.dtype for k, v in _tensors().items()}
        assert all(torch.equal(got[k], v) for k, v in _tensors().items())
    reopened = ExpertStore(tmp_path)
    assert reopened.compression == "exponent-zstd"
    assert json.loads((tmp_path / "manifest.json").read_text())["compression"] == "exponent-zstd"


def test_recompress_both_ways_keeps_the_bytes_and_removes_the_old_file(tmp_path: Path, zstore) -> None:
    zstore.set_compression("none")
    entry = zstore.recompress("e1")
    assert entry.file == "e1.safetensors" and entry.ratio == 1.0
    assert not (tmp_path / "e1.coez").exists()
    assert all(torch.equal(zstore.read("e1")[k], v) for k, v in _tensors().items())
    zstore.set_compression("exponent-zstd")
    assert zstore.recompress("e1").file == "e1.coez" and not (tmp_path / "e1.safetensors").exists()


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_corrupt_exponent_chunk_names_the_expert_file_and_chunk(tmp_path: Path, zstore) -> None:
    path = tmp_path / "e1.coez"
    chunk = read_header(path, "e1").chunks[1]
    _flip(path, chunk.offset + chunk.zlen // 2)
    with pytest.raises(ExpertLoadError, match=r"e1.*e1\.coez.*corrupt chunk 1") as info:
        ExpertStore(tmp_path, verify="never").read_flat("e1")
    assert "zstd" in str(info.value) or "exponent plane" in str(info.value)


def test_a_corrupt_raw_plane_fails_the_decoded_sha256(tmp_path: Path, zstore) -> None:
    path = tmp_path / "e1.coez"
    chunk = max(read_header(path, "e1").chunks, key=lambda c: c.rlen)
    _flip(path, chunk.offset + chunk.zlen + 10)
    with pytest.raises(ExpertLoadError, match=r"e1\.coez.*sha256"):
        ExpertStore(tmp_path, verify="always").read_flat("e1")
    with pytest.raises(ExpertLoadError, match=r"sha256"):
        ExpertStore(tmp_path, verify="always").read_flat("e1", dtype="float32")


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[:-7], "truncated"),
    (lambda b: b"NOTCOEZ!" + b[8:], "bad magic"),
    (lambda b: b[:8] + struct.pack("<Q", 2**40) + b[16:], "header claims"),
    (lambda b: b[:16] + b"x" + b[17:], "corrupt compressed header"),
])
def test_malformed_compressed_files_are_named_errors(tmp_path: Path, zstore, damage, reason: str) -> None:
    path = tmp_path / "e1.coez"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ExpertLoadError, match=reason) as info:
        ExpertStore(tmp_path, verify="never").read_flat("e1")
    assert "e1.coez" in str(info.value)


def test_cpu_pools_cast_to_their_compute_dtype_while_loading(tmp_path: Path, zstore) -> None:
    plain = ExpertStore(tmp_path / "plain")
    plain.write(_expert(), _tensors())
    for store in (zstore, plain):
        src = StoreSource(store, dtype="float32")
        flat = src.load("e1")
        got = flat.tensors()
        assert src.size("e1") == flat.nbytes == flat.buffer.numel()      # the pool accounts what it holds
        assert all(got[k].dtype == torch.float32 for k in ("w", "h", "f")) and got["n"].dtype == torch.int64
        assert all(torch.equal(got[k], v.float() if v.is_floating_point() else v) for k, v in _tensors().items())
        assert StoreSource(store, dtype=None).size("e1") == store.nbytes("e1")   # None: exactly as stored
        uniform = StoreSource(store).load("e1").tensors()                          # default: one dtype per module
        assert {uniform[k].dtype for k in ("w", "h", "f")} == {torch.bfloat16} and uniform["n"].dtype == torch.int64


def test_store_settings_and_manifest_fields_are_checked(tmp_path: Path, zstore) -> None:
    with pytest.raises(CoEError, match="compression must be one of none, exponent-zstd"):
        zstore.set_compression("gzip")
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc["experts"][0]["compression"] = "lz4"
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CoEError, match=r"experts\[0\].compression"):
        ExpertStore(tmp_path)


def test_version_1_manifests_still_read_as_plain_stores(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(_expert(), _tensors())
    doc = json.loads((tmp_path / "manifest.json").read_text())
    doc["version"] = 1
    del doc["compression"]
    for e in doc["experts"]:
        for k in ("compression", "stored_nbytes", "plain_nbytes", "bound_nbytes"):
            del e[k]
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    old = ExpertStore(tmp_path)
    assert old.compression == "none" and old.entry("e1").ratio == 1.0
    assert torch.equal(old.read("e1")["w"], _tensors()["w"])


def test_chunks_span_same_dtype_tensors_but_never_mix_codecs(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "x.safetensors"
    parts = {"a": torch.randn(CHUNK_BYTES // 4 + 3), "b": torch.randn(7), "c": torch.randn(5).to(torch.bfloat16),
             "d": torch.tensor([1, 2, 3]), "e": torch.randn(9)}
    save_file(parts, str(src))
    compress_file(src, tmp_path / "x.coez", "x")
    header = read_header(tmp_path / "x.coez", "x")
    for c in header.chunks:
        inside = [s for s in header.layout.specs if s.start < c.end and s.end > c.start]
        assert {codec.codec_for(s.dtype) for s in inside} == {c.codec}
        assert (c.end - c.start) % codec.element_size(c.codec) == 0
    assert any(len([s for s in header.layout.specs if s.start < c.end and s.end > c.start]) > 1
               for c in header.chunks)                     # a and b share the tail chunk
    store = ExpertStore(tmp_path / "st", verify="always")
    store.set_compression("exponent-zstd")
    store.write(_expert("x"), parts)
    for got in (store.read_flat("x").tensors(), store.read_flat("x", dtype="float32").tensors()):
        for k, v in parts.items():
            want = v.float() if v.is_floating_point() and got[k].dtype == torch.float32 else v
            assert torch.equal(got[k], want), k


def _verdicts_through_agent(config: Path, recording: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Replay `recording` through a real agent on `config`: verdict per frame, expert events by kind."""
    import sqlite3

    from edge_agent.agent import Agent
    from edge_agent.config import load_config
    from edge_agent.replay import replay
    from storage.recording import Recording

    from conftest import verdict_rows

    agent = Agent(load_config(config, env={})).start()
    try:
        rec = Recording(recording)
        report = replay(rec, agent.endpoints["ingest"], window=16)
        assert report.accepted == len(rec) and agent.wait_verdicts(len(rec), timeout=120)
    finally:
        agent.stop()
    con = sqlite3.connect(load_config(config, env={}).db_path)
    try:
        events = dict(con.execute("SELECT event, count(*) FROM expert_events GROUP BY event").fetchall())
    finally:
        con.close()
    return {r["frame_id"]: r["verdict"] for r in verdict_rows(load_config(config, env={}).db_path)}, events


def test_the_agent_serves_a_compressed_half_precision_store_like_the_plain_fp32_one(tmp_path, tiny_zoo,
                                                                                   tiny_recording):
    """fp16 on disk, compressed, cast to fp32 in the CPU pool while loading: the same verdicts."""
    import shutil

    from storage.dtypes import cast_floating

    from conftest import write_line

    plain_root, half_root = tmp_path / "plain", tmp_path / "half"
    shutil.copytree(tiny_zoo, plain_root)
    src = ExpertStore(plain_root)
    half = ExpertStore(half_root)
    half.set_compression("exponent-zstd")
    for e in src.entries():
        spec = Expert(e.id, e.arch, e.kind, ("ok", "bad"), 32)
        half.write(spec, cast_floating(src.read(e.id), "float16"))
    assert all(e.compression == "exponent-zstd" and e.dtype == "float16" for e in half.entries())
    want, _ = _verdicts_through_agent(write_line(tmp_path / "line-plain", store=plain_root), tiny_recording)
    got, events = _verdicts_through_agent(write_line(tmp_path / "line-half", store=half_root), tiny_recording)
    assert set(got) == set(want)                           # every frame, once
    agree = sum(got[f] == want[f] for f in want) / len(want)
    assert agree >= 0.98, agree
    assert events.get("load", 0) >= 3 and events.get("evict", 0) > 0   # the pool paged the compressed experts


@pytest.mark.parametrize("compression", ["none", "exponent-zstd"])
def test_uniform_sources_give_a_half_expert_one_dtype_and_leave_pure_ones_untouched(tmp_path: Path,
                                                                                    compression: str) -> None:
    """What a GPU tier loads: the fp32 tensors an fp16 expert kept are cast to fp16 too.  Compressed, the
    padding of the many fp16 tensors outweighs the one that narrows (the target is not smaller), which took
    the widen-in-place path and failed every load ('cast_in_place only widens')."""
    from storage.dtypes import cast_floating

    store = ExpertStore(tmp_path)
    store.set_compression(compression)
    tensors = {f"n{i}": torch.randn(37 + i) * 0.05 for i in range(10)}       # odd lengths: padding
    tensors |= {"w": torch.randn(64, 64) * 0.05, "b": torch.full((4,), 1e-10)}
    mixed = cast_floating(tensors, "fp16")
    assert mixed["w"].dtype == torch.float16 and mixed["b"].dtype == torch.float32   # fp16 would flush b
    store.write(_expert("mixed"), mixed)
    store.write(_expert("pure"), {"w": (torch.randn(64, 64) * 0.05).half()})
    src = StoreSource(store, dtype=StoreSource.UNIFORM)
    flat = src.load("mixed")
    got = flat.tensors()
    assert {t.dtype for t in got.values()} == {torch.float16} and src.size("mixed") == flat.nbytes
    assert torch.equal(got["w"], mixed["w"]) and all(torch.equal(got[f"n{i}"], mixed[f"n{i}"]) for i in range(10))
    pure = src.load("pure")
    assert src.size("pure") == store.nbytes("pure") == pure.nbytes


def test_a_compressed_llm_store_gives_bit_exact_logits(tmp_path: Path) -> None:
    """MoE experts through compressed files: the pooled model's logits equal the reference model's."""
    pytest.importorskip("transformers")
    from executors.moe_model import load_pooled
    from storage.llm_import import import_checkpoint

    from moe_models import VOCAB, build

    ref = build("mixtral", tmp_path / "hf", dtype=torch.bfloat16)
    layout = import_checkpoint(tmp_path / "hf", tmp_path / "store")
    store = ExpertStore(tmp_path / "store")
    store.set_compression("exponent-zstd")
    for e in store.entries():
        assert store.recompress(e.id).ratio < 0.8          # bf16: about 2/3 of the bytes
    x = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    pm = load_pooled(tmp_path / "store", memory=layout.layers[0].expert_nbytes * layout.top_k * 2, policy="lru")
    with torch.no_grad():
        assert torch.equal(pm.model(x).logits, ref(x).logits)
    assert pm.stats().misses > 0


def test_the_pipelined_and_serial_decoders_agree_and_both_name_a_corrupt_chunk(tmp_path: Path) -> None:
    from storage.compressed import _BLOCK_BYTES, decode_to

    big = {"w": (torch.randn(4 << 20, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)}
    store = ExpertStore(tmp_path, verify="always")
    store.set_compression("exponent-zstd")
    entry = store.write(_expert("big"), big)
    path = tmp_path / entry.file
    header = read_header(path, "big")
    assert entry.stored_nbytes > 2 * _BLOCK_BYTES                    # several reads: the pipelined path
    outs = []
    for threads in (None, 1):
        out = np.empty(header.layout.nbytes, np.uint8)
        decode_to(path, header, "big", out, expect_sha256=entry.sha256, threads=threads)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    assert torch.equal(store.read_flat("big").tensors()["w"], big["w"])
    last = len(header.chunks) - 1
    _flip(path, header.chunks[last].offset + header.chunks[last].zlen // 2)
    for threads in (None, 1):
        with pytest.raises(ExpertLoadError, match=rf"big\.coez.*corrupt chunk {last}"):
            decode_to(path, header, "big", np.empty(header.layout.nbytes, np.uint8), threads=threads)


def test_casts_follow_layouts_not_sizes_and_a_renamed_file_is_found_again(tmp_path: Path) -> None:
    """A cast whose padding makes the sizes equal still casts; a file `experts compress` renamed still loads."""
    store = ExpertStore(tmp_path)
    # fp16 w (64x64), a 30-element fp32 bias and an int64 scalar: the fp16 layout pads back to the same size
    tensors = {"w": (torch.randn(64, 64) * 0.05).half(), "b": torch.full((30,), 1e-10), "n": torch.tensor(1)}
    store.write(_expert("m"), tensors)
    got = StoreSource(store, dtype=StoreSource.UNIFORM).load("m").tensors()
    assert got["b"].dtype == torch.float16 and got["w"].dtype == torch.float16 and got["n"].dtype == torch.int64
    running = ExpertStore(tmp_path)                  # an agent's view, taken before the rewrite
    other = ExpertStore(tmp_path)
    other.set_compression("exponent-zstd")
    other.recompress("m")                            # m.safetensors -> m.coez behind the agent's back
    assert torch.equal(running.read_flat("m").tensors()["w"], tensors["w"])
    assert running.entry("m").file == "m.coez"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float16", "bfloat16", "float32", "int64"]), st.integers(0, 700)),
                min_size=1, max_size=6))
def test_casting_in_place_equals_casting_each_tensor(specs) -> None:
    """Any mix of tensor dtypes and sizes, widened to fp32 inside one buffer from its tail."""
    from storage.convert import cast_in_place, converted_layout
    from storage.flat import Layout, TensorSpec

    gen = torch.Generator().manual_seed(len(specs))
    tensors, layout_specs, pos = [], [], 0
    for i, (dt, n) in enumerate(specs):
        t = (torch.randint(-9, 9, (n,), generator=gen) if dt == "int64"
             else torch.randn(n, generator=gen).to(getattr(torch, dt)))
        nbytes = t.numel() * t.element_size()
        tensors.append(t)
        layout_specs.append(TensorSpec(f"t{i}", dt, (n,), pos, pos + nbytes))
        pos += nbytes
    stored = Layout(tuple(layout_specs), 0, pos)
    target = converted_layout(stored, "float32")
    buf = torch.zeros(max(target.nbytes, stored.nbytes), dtype=torch.uint8)
    offset = target.nbytes - stored.nbytes
    if offset < 0:
        return
    for s, t in zip(stored.specs, tensors):
        buf[offset + s.start:offset + s.end] = t.view(torch.uint8) if t.numel() else buf[:0]
    cast_in_place(stored, target, buf, offset, piece=96)       # small pieces: many overlapping ones
    for s, t in zip(target.specs, tensors):
        got = buf[s.start:s.end].clone().view(getattr(torch, s.dtype)) if s.end > s.start else None
        if got is not None:
            assert torch.equal(got, t.float() if t.is_floating_point() else t), s.name


def test_a_read_racing_a_promotion_retries_with_the_new_entry_and_names_its_version(tmp_path: Path) -> None:
    reader = ExpertStore(tmp_path, verify="always")
    reader.write(_expert(), {"w": torch.zeros(64)})
    writer = ExpertStore(tmp_path)
    writer.write(_expert(), {"w": torch.ones(64)}, version=2)           # same file name, new bytes
    flat = reader.read_flat("e1")                                      # the reader's manifest still says v1
    assert torch.equal(flat.tensors()["w"], torch.ones(64)) and flat.version == 2


def _rewrite_chunk_table(path: Path, edit) -> None:
    """Rewrite a compressed file's header JSON with `edit(doc)` (the payload stays)."""
    from storage.compressed import MAGIC

    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[len(MAGIC):len(MAGIC) + 8])
    doc = json.loads(b[len(MAGIC) + 8:len(MAGIC) + 8 + n])
    edit(doc)
    head = json.dumps(doc).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head + b[len(MAGIC) + 8 + n:])


def test_a_compressed_header_cannot_claim_more_than_its_payload_decodes_to(tmp_path: Path) -> None:
    """A 221-byte file claiming 2**40 decoded bytes passed `read_header`; the load then died in the allocator with
    no expert named (or, under a pinned host tier, really committed the memory)."""
    from storage.compressed import FORMAT, MAGIC, VERSION

    store = ExpertStore(tmp_path, verify="never")
    store.set_compression("exponent-zstd")
    store.write(_expert(), {"w": torch.randn(1000).to(torch.bfloat16)})
    n = 1 << 40
    hdr = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    hdr += b" " * (-len(hdr) % 8)
    prefix = struct.pack("<Q", len(hdr)) + hdr
    head = json.dumps({"format": FORMAT, "version": VERSION, "prefix": len(prefix),
                       "chunks": [[0, n, "raw", 0, 0]]}).encode()
    path = tmp_path / store.entry("e1").file
    path.write_bytes(MAGIC + struct.pack("<Q", len(head)) + head + prefix)
    with pytest.raises(ExpertLoadError, match=r"e1.*chunk 0.*do not fit 1099511627776 bytes of raw"):
        read_header(path, "e1")
    with pytest.raises(ExpertLoadError, match="e1"):
        ExpertStore(tmp_path, verify="never").read_flat("e1")


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["chunks"][0].__setitem__(2, "fp16"), "chunk 0 is fp16, but tensor 'w' (bfloat16) is bf16"),
    (lambda d: d["chunks"][0].__setitem__(4, 2.5), "not an integer"),
    (lambda d: d["chunks"][0].__setitem__(3, 0), "do not fit"),
])
def test_a_chunk_table_that_would_decode_into_wrong_weights_is_refused_without_a_hash(tmp_path: Path, edit,
                                                                                        words) -> None:
    """The chunk table has no checksum of its own: a bf16 chunk relabelled fp16 decoded without an error into
    weights ~1e34 under `verify: never` (or `first` after the first load)."""
    store = ExpertStore(tmp_path, verify="never")
    store.set_compression("exponent-zstd")
    store.write(_expert(), {"w": (torch.randn(4096) * 0.05).to(torch.bfloat16)})
    _rewrite_chunk_table(tmp_path / store.entry("e1").file, edit)
    with pytest.raises(ExpertLoadError, match=re.escape(words)):
        ExpertStore(tmp_path, verify="never").read_flat("e1")


def test_a_rewrite_that_cannot_write_names_the_expert_and_the_store_and_leaves_it_as_it_was(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    import storage.compressed as compressed

    store = ExpertStore(tmp_path)
    w = {"w": (torch.randn(4096) * 0.02).to(torch.bfloat16)}
    store.write(_expert(), w)
    store.set_compression("exponent-zstd")

    def full(src, dst, eid, **kw):
        Path(dst).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compressed, "compress_file", full)
    with pytest.raises(CoEError, match=r"expert 'e1': cannot rewrite it in .*No space left on device; is the disk"):
        store.recompress("e1")
    again = ExpertStore(tmp_path)
    assert again.entry("e1").compression == "none" and torch.equal(again.read("e1")["w"], w["w"])
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")
                and "tmp" in p.name]


@pytest.mark.parametrize("dtype", [torch.uint16, torch.complex64, torch.float8_e4m3fn])
def test_a_tensor_dtype_the_store_cannot_read_back_is_refused_at_write_naming_it(tmp_path: Path, dtype) -> None:
    """Written, it was refused at every read as 'corrupt safetensors header entry', and `experts compress` stopped
    on it with that reason."""
    store = ExpertStore(tmp_path)
    with pytest.raises(CoEError, match=rf"expert 'e1': unsupported tensor dtype: odd \({str(dtype)[6:]}\)"):
        store.write(_expert(), {"w": torch.zeros(4), "odd": torch.zeros(4).to(dtype)})
    assert not store.entries()


@pytest.mark.parametrize("field, value", [("shape", [2.9]), ("shape", [True]), ("data_offsets", [0, 1e309])])
def test_a_header_number_that_is_not_an_integer_is_a_corrupt_entry_not_a_crash(tmp_path: Path, field, value):
    """`Infinity` escaped as an OverflowError naming nothing; 2.9 was silently read as 2."""
    from storage.flat import parse_layout

    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    entry[field] = value
    raw = json.dumps({"w": entry}).encode()
    with pytest.raises(ExpertLoadError, match="corrupt safetensors header entry for 'w'"):
        parse_layout(raw, 8, 8 + len(raw), "e1", "e1.safetensors")


def test_rewriting_the_same_weights_into_a_store_written_before_the_aligned_files_is_not_new_weights(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """Expert files are written 64-byte aligned now; the same tensors in a file `save_file` wrote hash otherwise,
    and a re-import logged 'already holds other weights' for every expert and stored each as version 2."""
    import storage.expert_store as es
    from safetensors.torch import save_file

    def old_writer(path, tensors, metadata, expert_id):     # a header 8 bytes off 16, as files once had
        for k in range(64):
            save_file(dict(tensors), str(path), metadata={**metadata, "pad": "x" * k})
            if (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 16 == 8:
                return es._sha256(path)
        raise AssertionError("no padding gave an unaligned header")

    w = {"w": torch.randn(37, 5), "b": torch.arange(7, dtype=torch.int64)}
    with monkeypatch.context() as m:
        m.setattr(es, "_write_safetensors", old_writer)
        ExpertStore(tmp_path).write(_expert(), w)
    before = ExpertStore(tmp_path).entry("e1")
    with caplog.at_level("WARNING", logger="storage.expert_store"):
        again = ExpertStore(tmp_path).write(_expert(), w)
    assert again.version == before.version == 1 and again.sha256 != before.sha256
    assert "other weights" not in caplog.text
    changed = ExpertStore(tmp_path).write(_expert(), {"w": w["w"] + 1, "b": w["b"]})
    assert changed.version == 2                          # other weights at the same version still move up
