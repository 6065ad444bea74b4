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
    per, total = layout.layers[0].expert_nbytes, sum(l.num_experts for l in layout.layers)
    # its kept buffers come out of the host memory it was given: the same host memory as an inclusive tier's
    assert pm.host.capacity + source.spares.limit * per == per * (total // 2) and source.spares.limit > 0
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
        assert pm.file_bytes() == reads[mode] * layout.layers[0].expert_nbytes    # what the bench reports
        assert pm.file_bytes() < pm.stats().bytes_in        # the rest of the pool's loads were host-tier copies
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
    assert admits > 0 and pm.host.stats().admits == admits
    per = layout.layers[0].expert_nbytes
    with pytest.raises(CoEError, match="host_mode must be one of inclusive, exclusive, got 'victim'"):
        load_pooled(store, memory=per * 8, host_memory=per * 8, host_mode="victim")
    with pytest.raises(CoEError, match="exclusive.*give it host memory"):
        load_pooled(store, memory=per * 8, host_mode="exclusive")


def test_the_cli_says_which_host_mode_it_cannot_honour(tmp_path):
    from click.testing import CliRunner

    from edge_agent.cli import cli

    r = CliRunner().invoke(cli, ["llm", "bench", "--work", str(tmp_path), "--part", "b", "--host-mode", "exclusive"])
    assert r.exit_code != 0 and "--host-mode exclusive" in r.output and "--device cuda" in r.output
    r = CliRunner().invoke(cli, ["llm", "generate", "--model", str(tmp_path), "--prompt", "x", "--host-mode", "lru"])
    assert r.exit_code != 0 and "'lru' is not one of 'inclusive', 'exclusive'" in r.output


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


def test_spare_buffers_hand_back_only_an_exact_size_and_keep_at_most_their_limit():
    from storage.tiers import SpareBuffers

    class V:        # a tier value: only its buffer matters here
        def __init__(self, n):
            self.buffer = torch.empty(n, dtype=torch.uint8)
    spares = SpareBuffers(2)
    a, b, c = V(8), V(16), V(8)
    for v in (a, b, c, None):
        spares.put(v)
    assert spares.held() == 2                                    # c found no room, None is ignored
    assert spares.take(8, torch.device("cpu"), False) is a
    assert spares.take(8, torch.device("cpu"), False) is None    # b is 16 bytes: never handed out for 8
    assert spares.take(16, torch.device("cpu"), True) is None    # nor as pinned when it is not
    assert spares.take(16, torch.device("cpu"), False) is b and spares.held() == 0 and spares.reused == 2


def test_an_exclusive_tier_reuses_a_promoted_buffer_only_once_nobody_holds_it(mixtral):
    from storage.expert_store import ExpertStore
    from storage.policies import make_policy
    from storage.pool import Pool

    _, layout, store = mixtral
    ids = layout.ids()
    per = layout.layers[0].expert_nbytes
    host = Pool("cpu", per * 4, make_policy("lru"), StoreSource(ExpertStore(store)))
    for eid in ids[:2]:
        host.release(host.acquire(eid))
    tier = TierSource(host, "cpu", exclusive=True, spares=2)
    other = host.hold(ids[0])                     # someone else computes on the host copy (the Fiddler thread)
    first = tier.load(ids[0])
    assert tier.promoted == 1 and host.contains(ids[0]) and tier.spares.held() == 0   # still theirs: not reused
    host.release(other)
    kept = host.peek(ids[1])
    tier.load(ids[1])
    assert not host.contains(ids[1]) and tier.spares.held() == 1                      # promoted, its buffer kept
    staged = tier.load(ids[2])                    # not in the host tier: read around it into the kept buffer
    assert tier.staged == 1 and tier.spares.reused == 1 and tier.spares.held() == 1
    assert not host.contains(ids[2])
    assert torch.equal(staged.buffer, ExpertStore(store).read_flat(ids[2]).buffer)   # the right bytes
    back = tier.spares.take(kept.buffer.numel(), torch.device("cpu"), False)
    assert back.buffer.data_ptr() == kept.buffer.data_ptr()      # the staging read went into the promoted buffer
    assert first.buffer.data_ptr() != kept.buffer.data_ptr()     # and the device copies are their own


def test_an_exclusive_llm_tier_recycles_its_host_buffers(mixtral):
    ref, layout, store = mixtral
    pm = _pooled(store, layout, "exclusive")
    with torch.no_grad():
        for x in _batches(8):
            assert torch.equal(pm.model(x).logits, ref(x).logits)
    spares = pm.pools[0].source.spares
    assert spares is not None and spares.reused > 0          # staged reads and demotions took kept buffers
    pm.close()


def test_a_device_tier_without_a_host_tier_stages_through_kept_buffers(mixtral):
    """On CUDA with no host tier each load is staged through a host buffer (pinned there): kept and reused,
    not a fresh one each load; the device copies are the files' bytes and their own memory."""
    from storage.expert_store import ExpertStore

    _, layout, store = mixtral
    ids = layout.ids()[:3]
    tier = TierSource(StoreSource(ExpertStore(store)), "cpu", spares=2)
    got = [tier.load(eid) for eid in ids]
    assert tier.spares.reused == 2 and tier.spares.held() == 1      # one staging buffer served all three reads
    for eid, g in zip(ids, got):
        assert torch.equal(g.buffer, ExpertStore(store).read_flat(eid).buffer), eid
    assert len({g.buffer.data_ptr() for g in got}) == 3              # each copy has its own memory
    plain = TierSource(StoreSource(ExpertStore(store)), "cpu")
    plain.load(ids[0])
    assert plain.spares is None                                      # off unless asked for (vision experts vary in size)
