"""The pooled LLM's host tier: inclusive (a copy of each load) or exclusive (a victim cache of the device pools).

On a CUDA box the host tier is pinned memory between the SSD and the GPU
pool.  Exclusive, GPU and host memory together hold more distinct experts, so
fewer misses reach the SSD.  These tests run the same code with the CPU
playing the device (a CPU device pool behind a host tier): the tier logic,
the promotion out of the host tier and the demotion into it are the same.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_models import VOCAB, build  # noqa: E402

from coe import CoEError  # noqa: E402
from executors.moe_model import load_pooled  # noqa: E402
from storage.llm_import import import_checkpoint  # noqa: E402
from storage.tiers import StoreSource, TierSource  # noqa: E402


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    ref = build("mixtral", root / "hf")
    layout = import_checkpoint(root / "hf", root / "store")
    return ref, layout, root / "store"


def _batches(n: int) -> list:
    out = []
    for seed in range(n):
        g = torch.Generator().manual_seed(100 + seed)
        out.append(torch.randint(3, VOCAB, (1, 5), generator=g))
    return out


@pytest.fixture()
def store_reads(monkeypatch):
    """Counts every expert file read (the SSD), whichever tier asked for it."""
    reads: list[str] = []
    real = StoreSource.load

    def counted(self, expert_id, reuse=None):
        reads.append(expert_id)
        return real(self, expert_id, reuse)
    monkeypatch.setattr(StoreSource, "load", counted)
    return reads


def _pooled(store, layout, mode: str, policy: str = "lru"):
    per = layout.layers[0].expert_nbytes
    total = sum(l.num_experts for l in layout.layers)
    # a device pool of a quarter of the experts (at least one token's), a host tier of half
    dev_n = max(layout.top_k, total // 4)
    return load_pooled(store, memory=per * dev_n, policy=policy, host_memory=per * (total // 2), host_mode=mode)


@pytest.mark.parametrize("policy", ["lru", "gate-score"])
def test_an_exclusive_host_tier_is_bit_exact_and_never_holds_what_the_device_pool_holds(mixtral, store_reads, policy):
    ref, layout, store = mixtral
    pm = _pooled(store, layout, "exclusive", policy)
    source = pm.pools[0].source
    assert isinstance(source, TierSource) and source.exclusive and source.parent is pm.host
    with torch.no_grad():
        for i, x in enumerate(_batches(8)):
            assert torch.equal(pm.model(x).logits, ref(x).logits), f"pass {i}: logits differ"
            on_device, in_host = set(pm.pools[0].resident()), set(pm.host.resident())
            assert on_device and not on_device & in_host, f"pass {i}: {sorted(on_device & in_host)} held twice"
            assert pm.pools[0].used_bytes() <= pm.pools[0].capacity and pm.host.used_bytes() <= pm.host.capacity
    host = pm.host.stats()
    assert host.admits > 0                       # device victims moved down
    assert source.promoted > 0                   # and later misses were served from there, not from the SSD
    assert source.staged == len(store_reads)     # every SSD read went around the host tier (none kept a copy)
    pm.close()


def test_an_exclusive_host_tier_reads_fewer_files_than_an_inclusive_one_of_the_same_size(mixtral, store_reads):
    ref, layout, store = mixtral
    reads, logits = {}, {}
    for mode in ("inclusive", "exclusive"):
        store_reads.clear()
        pm = _pooled(store, layout, mode)
        with torch.no_grad():
            logits[mode] = [pm.model(x).logits for x in _batches(8)]
        on_device, in_host = set(pm.pools[0].resident()), set(pm.host.resident())
        if mode == "inclusive":
            assert on_device <= in_host          # a copy of each load: the host tier duplicates the device pool
        else:
            assert not on_device & in_host
        reads[mode] = len(store_reads)
        pm.close()
    assert all(torch.equal(a, b) for a, b in zip(logits["inclusive"], logits["exclusive"]))
    # inclusive holds half the experts in memory, exclusive three quarters: the same passes read fewer files
    assert reads["exclusive"] < reads["inclusive"], reads


def test_closing_moves_no_victim_down_and_a_bad_host_mode_is_a_clear_error(mixtral):
    _, layout, store = mixtral
    pm = _pooled(store, layout, "exclusive")
    with torch.no_grad():
        pm.model(_batches(1)[0])
    admits = pm.host.stats().admits
    pm.close()                                   # the device pool's residents are dropped, not copied down
    assert pm.host.stats().admits == admits and not pm.host.resident()
    per = layout.layers[0].expert_nbytes
    with pytest.raises(CoEError, match="host_mode must be one of inclusive, exclusive, got 'victim'"):
        load_pooled(store, memory=per * 8, host_memory=per * 8, host_mode="victim")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_exclusive_pinned_host_tier_behind_a_cuda_pool_gives_the_inclusive_tiers_tokens(mixtral, store_reads):
    """On a GPU box: victims are copied down from GPU memory into pinned host buffers and promoted back."""
    _, layout, store = mixtral
    per = layout.layers[0].expert_nbytes
    total = sum(l.num_experts for l in layout.layers)
    x = _batches(1)[0].cuda()
    out, reads = {}, {}
    for mode in ("inclusive", "exclusive"):
        store_reads.clear()
        pm = load_pooled(store, memory=per * max(layout.top_k, total // 4), policy="lru", device="cuda",
                         host_memory=per * (total // 2), host_mode=mode)
        out[mode] = pm.generate(x, 8)[0]
        reads[mode] = len(store_reads)
        if mode == "exclusive":
            assert pm.host.stats().admits > 0 and pm.pools[0].source.promoted > 0
            assert not set(pm.pools[0].resident()) & set(pm.host.resident())
            held = [pm.host.peek(e) for e in pm.host.resident()]
            assert held and all(w.buffer.is_pinned() for w in held)     # async copies back up need pinned bytes
        pm.close()
    assert out["exclusive"] == out["inclusive"]
    assert reads["exclusive"] <= reads["inclusive"], reads
