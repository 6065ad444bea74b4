"""Pooled MoE experts: logits equal the unmodified transformers model's, bit for bit, in fp32 on the CPU.

The reference is transformers' own eager experts loop on a model built from
each family's config (Mixtral, Qwen2-MoE with its shared expert, OLMoE,
Qwen3-MoE, DeepSeek-V3 with shared experts and grouped routing), saved with
`save_pretrained` and imported through `coe-agent llm import`'s code.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_models import VOCAB, build, configs  # noqa: E402

from coe import CoEError  # noqa: E402
from coe.moe import parse_expert_id  # noqa: E402
from executors.moe_model import load_pooled  # noqa: E402
from executors.pooled_experts import PinnedWave  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from storage.llm_import import import_checkpoint  # noqa: E402
from storage.policies import make_policy  # noqa: E402
from storage.pool import Pool  # noqa: E402
from storage.tiers import StoreSource  # noqa: E402

FAMILIES = sorted(configs())
POLICIES = ("lru", "lfu", "gate-score", "probability", "fifo", "belady")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            ref = build(family, root / "hf")
            layout = import_checkpoint(root / "hf", root / "store")
            cache[family] = (ref, layout, root / "store")
        return cache[family]
    return get


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2, 11), generator=g)


def _profile_and_decode(store, layout, steps: int):
    """A trace of four prompts on the full model, split as llm bench splits it: (profile, decode)."""
    from edge_agent import llm_bench as lb
    from executors.moe_model import record_trace

    pm = load_pooled(store, memory=layout.expert_bytes, policy="lru")
    trace = record_trace(pm, [_inputs(s)[0] for s in (3, 4, 5, 6)], steps)
    pm.close()
    return lb.split_trace(trace)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_decode_steps_logits_are_bit_exact_with_the_kv_cache(imported, family):
    """Generation, not one forward: each decode step's logits, with the KV cache, at the smallest pool.  The
    reference's weights are copied to 64-byte-aligned memory first, as `_load_resident` copies ours: transformers
    computes on the checkpoint's memory map, and a CPU kernel on unaligned data rounds differently (OLMoE's
    decode drifted by 1e-7 on the unaligned reference, with the same tokens)."""
    ref, layout, store = imported(family)
    aligned = copy.deepcopy(ref)
    with torch.no_grad():
        for p in aligned.parameters():
            if p.data_ptr() % 64:
                p.data = p.data.clone()
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * layout.top_k, policy="lru")
    try:
        x = _inputs(7)[:1]
        kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
        want, got = aligned.generate(x, **kw), pm.model.generate(x, **kw)
    finally:
        pm.close()
    assert torch.equal(want.sequences, got.sequences) and len(got.logits) == 8
    assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits)), family


def _aligned_reference(ref):
    aligned = copy.deepcopy(ref)
    with torch.no_grad():
        for p in aligned.parameters():
            if p.data_ptr() % 64:
                p.data = p.data.clone()
    return aligned


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["mapped", "admission"])
def test_experts_computed_in_place_from_the_file_keep_every_decode_step_bit_exact(imported, family, how):
    """In place, an expert is computed on its file's memory map.  Files padded their header to 8 bytes only, so
    DeepSeek-V3's tensors sat 8 bytes off a 16-byte boundary there (in a pool's buffer they do not), the CPU
    kernels rounded differently, and which misses ran in place (a timing decision) changed the logits from run
    to run.  Files start their data on 64 bytes now, and one that does not is read, not mapped."""
    ref, layout, store = imported(family)
    assert all(ExpertStore(store).layout(e).data_offset % 64 == 0 for e in layout.ids())
    per = layout.layers[0].expert_nbytes
    # admission: the low-numbered experts are the popular ones, so the sweep over the rest is declined
    popularity = {eid: 1.0 / (1 + parse_expert_id(eid)[2]) for eid in layout.ids()}
    pm = load_pooled(store, **(
        {"memory": per * (layout.top_k + 1), "policy": "lru", "split": "mapped"} if how == "mapped" else
        {"memory": per * (layout.top_k + 3), "policy": "probability", "popularity": popularity, "admission": True}))
    if how == "mapped":
        pm.split.stats.load_seconds = pm.split.stats.compute_seconds = 1.0     # half the misses in place
    try:
        x = _inputs(9)[:1]
        kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
        want, got = _aligned_reference(ref).generate(x, **kw), pm.model.generate(x, **kw)
        in_place = pm.split.stats.in_place if how == "mapped" else pm.stats().bypassed
    finally:
        pm.close()
    assert in_place > 0, "nothing was computed in place: the test checks nothing"
    assert all(torch.equal(a, b) for a, b in zip(want.logits, got.logits)), (family, how)


def test_a_file_whose_data_is_off_the_64_byte_boundary_is_read_not_mapped(imported, monkeypatch):
    """A store written before files were padded to 64 bytes (its layout's data offset, 72, stands in for one):
    `map_flat` declines, so the in-place path reads the expert into aligned memory (`HostWeights.open`)."""
    _, layout, store = imported("qwen3_moe")
    s = ExpertStore(store)
    eid = layout.ids()[0]
    mapped = s.map_flat(eid)
    assert mapped is not None
    mapped.close()
    real = s._layout
    monkeypatch.setattr(s, "_layout", lambda e, entry=None: dataclasses.replace(real(e, entry), data_offset=72))
    assert s.map_flat(eid) is None


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_bit_exact_under_every_policy_and_pool_size(imported, family, policy):
    ref, layout, store = imported(family)
    x = _inputs()
    with torch.no_grad():
        want = ref(x).logits
    per = layout.layers[0].expert_nbytes
    total = sum(l.num_experts for l in layout.layers)
    popularity = {eid: 1.0 / (1 + parse_expert_id(eid)[2]) for eid in layout.ids()}
    future = tuple(layout.ids()) * 2
    for n in range(layout.top_k, total + 1):          # every pool size from one token's experts to all of them
        pm = load_pooled(store, memory=per * n, policy=policy, popularity=popularity,
                         context=(lambda: {"future": future}) if policy == "belady" else None)
        with torch.no_grad():
            got = pm.model(x).logits
        assert torch.equal(got, want), f"{family}/{policy} with a pool of {n} experts: logits differ"
        s = pm.stats()
        assert s.misses >= 1 and all(p.resident_bytes <= p.capacity for p in s.pools)
        if n < total:
            assert s.pools[0].evictions > 0      # the small pools really paged experts out and back
        pm.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_per_layer_quota_is_exact_too(imported, family):
    ref, layout, store = imported(family)
    x = _inputs(1)
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * layout.top_k * len(layout.layers),
                     policy="lru", quota="per-layer")
    assert len(pm.pools) == len(layout.layers)
    with torch.no_grad():
        assert torch.equal(pm.model(x).logits, ref(x).logits)
    assert all(p.stats().misses > 0 for p in pm.pools)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_greedy_generation_matches_transformers_generate(imported, family):
    ref, layout, store = imported(family)
    x = _inputs(2)[:1]
    want = ref.generate(x, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, x.shape[1]:].tolist()
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * (layout.top_k + 1), policy="lfu")
    seen = []
    got, stats = pm.generate(x, 12, on_token=seen.append)
    assert got == want[:len(got)] and got == seen
    assert stats.tokens == len(got) and stats.misses > 0 and 0 <= stats.hit_rate <= 1


def test_freshly_loaded_expert_is_not_evicted_within_the_layer(imported):
    """The vLLM LFRU bug: a load later in the same forward pass evicted an expert in use and reused its memory."""
    _, layout, store_root = imported("mixtral")
    store = ExpertStore(store_root)
    a, b, c = layout.ids(0)[:3]
    per = layout.layers[0].expert_nbytes
    pool = Pool("cpu", 2 * per, make_policy("lru"), StoreSource(store))
    want_a = {k: v.clone() for k, v in store.read(a).items()}
    with PinnedWave(lambda _: pool, [a, b, c]) as wave:
        # the pool holds two experts: a and b stay pinned, c waits for the next wave instead of evicting a
        held = list(wave)
        assert [h.expert_id for h in held] == [a, b]
        assert not pool.contains(c)
        for k, v in held[0].value.tensors().items():
            assert torch.equal(v, want_a[k])
    # the hazard is real: once a is released, loading c reuses a's buffer, so an unpinned holder would read c
    h = pool.acquire(a)
    buf = h.value.buffer
    pool.release(h)
    pool.release(pool.acquire(b))
    hc = pool.acquire(c)
    assert hc.value.buffer.data_ptr() == buf.data_ptr()
    assert not torch.equal(h.value.tensors()["down_proj"], want_a["down_proj"])
    pool.release(hc)


def test_a_layer_larger_than_the_pool_runs_in_waves_and_stays_exact(imported):
    ref, layout, store = imported("olmoe")
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * layout.top_k, policy="lru")
    waves = []
    orig = PinnedWave.__enter__

    def spy(self):
        wave = orig(self)
        waves.append(len(wave))
        return wave
    PinnedWave.__enter__ = spy
    try:
        x = _inputs(3)
        with torch.no_grad():
            assert torch.equal(pm.model(x).logits, ref(x).logits)
    finally:
        PinnedWave.__enter__ = orig
    assert max(waves) == layout.top_k and len(waves) > len(layout.layers)


def test_budget_below_one_tokens_experts_is_a_clear_error(imported):
    _, layout, store = imported("mixtral")
    with pytest.raises(CoEError, match="cannot hold one token's 2 experts"):
        load_pooled(store, memory=layout.layers[0].expert_nbytes, policy="lru")
    with pytest.raises(CoEError, match="per layer"):
        load_pooled(store, memory=layout.layers[0].expert_nbytes * 3, policy="lru", quota="per-layer")
    with pytest.raises(CoEError, match="popularity"):
        load_pooled(store, memory=layout.layers[0].expert_nbytes * 4, policy="probability")


def test_a_waves_misses_load_concurrently_but_fit_in_call_order(imported):
    """Room is reserved in order (what sequential acquires decide); the loads themselves overlap."""
    import threading

    _, layout, store_root = imported("mixtral")
    store = ExpertStore(store_root)
    ids = layout.ids(0)[:4]
    inflight, peak, gate = [0], [0], threading.Barrier(3, timeout=10)
    lock = threading.Lock()

    class SlowSource(StoreSource):
        def load(self, expert_id, reuse=None):
            with lock:
                inflight[0] += 1
                peak[0] = max(peak[0], inflight[0])
            try:
                gate.wait()         # the first three loads must all be in flight at once to pass this
                return super().load(expert_id, reuse)
            finally:
                with lock:
                    inflight[0] -= 1

    per = layout.layers[0].expert_nbytes
    pool = Pool("cpu", 3 * per, make_policy("lru"), SlowSource(store))
    with PinnedWave(lambda _: pool, ids) as wave:
        got = [h.expert_id for h in wave]
    assert got == ids[:3] and peak[0] == 3          # the fourth did not fit beside three pinned ones
    assert not pool.contains(ids[3]) and pool.stats().misses == 3


def test_a_wave_that_fails_midway_releases_what_it_reserved(imported):
    from coe import ExpertLoadError

    _, layout, store_root = imported("mixtral")
    a = layout.ids(0)[0]
    pool = Pool("cpu", 4 * layout.layers[0].expert_nbytes, make_policy("lru"), StoreSource(ExpertStore(store_root)))
    with pytest.raises(ExpertLoadError):
        with PinnedWave(lambda _: pool, [a, "mixtral.L00.E999"]):
            pass
    assert pool.evict(a)          # not left pinned by the failed wave


def test_reversed_expert_order_is_caught_at_k_above_two(imported):
    """The exactness test can fail: summing the same experts in another order changes the floats at k >= 3."""
    ref, layout, store = imported("qwen3_moe")
    assert layout.top_k >= 3
    x = _inputs(5)
    pm = load_pooled(store, memory=layout.expert_bytes, policy="lru")
    with torch.no_grad():
        want = ref(x).logits
        assert torch.equal(pm.model(x).logits, want)
        from executors import pooled_experts as px
        orig = px.PooledExperts.forward

        def reversed_forward(self, h, idx, w):      # same experts, reversed accumulation order
            out = torch.zeros_like(h)
            for j in reversed(range(idx.shape[1])):
                out += orig(self, h, idx[:, j:j + 1], w[:, j:j + 1])
            return out
        px.PooledExperts.forward = reversed_forward
        try:
            assert not torch.equal(pm.model(x).logits, want)
        finally:
            px.PooledExperts.forward = orig


def test_trace_driven_decode_counts_decode_tokens_and_seeds_lfu_from_the_prefill(imported):
    from executors.moe_decode import future_accesses, trace_decode
    from executors.moe_model import record_trace

    _, layout, store = imported("mixtral")
    pm = load_pooled(store, memory=layout.expert_bytes, policy="lru")
    trace = record_trace(pm, [_inputs(6)[0], _inputs(7)[0]], 4)
    pm.close()
    decode = int((trace.step > 0).sum())
    lfu = load_pooled(store, memory=layout.layers[0].expert_nbytes * 3, policy="lfu")
    r = trace_decode(lfu, trace, prefill=False)
    assert r.tokens == decode == 6 and r.stats.tokens == decode
    # every token's choices reached the tap (prefill included), but only decode passes asked the pool
    assert sum(lfu.tap.counts.values()) == trace.tokens * len(trace.layers) * trace.top_k
    assert r.stats.hits + r.stats.misses == len(future_accesses(trace, prefill=False))
    assert len(future_accesses(trace)) > len(future_accesses(trace, prefill=False))


def test_the_ablations_ceiling_row_decodes_with_no_miss_after_a_warm_pass(imported):
    """(d)'s ceiling: the same decode with every expert already in the pool, what no technique can pass."""
    from coe.moe import MoELayout
    from edge_agent.llm_bench import CEILING, _ceiling
    from executors.moe_model import record_trace

    _, layout, store = imported("mixtral")
    pm = load_pooled(store, memory=layout.expert_bytes, policy="lru")
    trace = record_trace(pm, [_inputs(6)[0], _inputs(7)[0]], 4)
    pm.close()
    seen = []
    row = _ceiling(store, MoELayout.load(store), trace, seen.append)
    assert seen == [CEILING] and row["row"] == CEILING and row["policy"] is None
    assert row["hit_rate"] == 1.0 and row["gib_read"] == 0.0          # the timed pass reads nothing
    assert row["tokens"] == int((trace.step > 0).sum()) and row["tokens_per_second"] > 0


def test_substitution_asks_the_pool_for_fewer_missing_experts_and_alpha_zero_is_exact(imported, caplog):
    ref, layout, store = imported("olmoe")
    x = _inputs(8)[:1]
    mem = layout.layers[0].expert_nbytes * (layout.top_k + 2)
    exact = load_pooled(store, memory=mem, policy="gate-score", alpha=0.0)
    toks0, s0 = exact.generate(x, 10)
    with torch.no_grad():
        assert torch.equal(exact.model(x).logits, ref(x).logits) and exact.tap.substituted == 0
    import routing.substitution as rs

    rs._warned = False
    with caplog.at_level("WARNING"):
        approx = load_pooled(store, memory=mem, policy="gate-score", alpha=0.5)
        load_pooled(store, memory=mem, policy="gate-score", alpha=0.5)
    assert caplog.text.count("generation is approximate") == 1      # said once, not per model or token
    toks1, s1 = approx.generate(x, 10)
    assert approx.tap.substituted > 0
    assert s1.misses < s0.misses                  # substitutes are resident: fewer loads for the same text
    with pytest.raises(CoEError, match="alpha"):
        load_pooled(store, memory=mem, policy="lru", alpha=1.5)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_next_layer_prefetch_is_exact_and_scores_its_guesses(imported, family):
    ref, layout, store = imported(family)
    x = _inputs(9)[:1]
    want = ref.generate(x, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, x.shape[1]:].tolist()
    mem = layout.layers[0].expert_nbytes * (layout.top_k * len(layout.layers) + 2)
    pm = load_pooled(store, memory=mem, policy="lru", prefetch="next-layer")
    got, stats = pm.generate(x, 8)
    pm.prefetcher.drain()                   # every queued guess ends read in, given way or dropped
    pm.close()
    assert got == want[:len(got)]                                   # prefetch never changes the arithmetic
    st = pm.prefetcher.stats
    # guesses were made, scored and acted on (read in before their layer, or given way to its own loads)
    assert st.predicted > 0 and st.actual > 0 and st.issued + st.yielded + st.dropped > 0
    assert 0 <= st.precision <= 1 and 0 <= st.recall <= 1 and st.true_positive <= min(st.predicted, st.actual)
    with pytest.raises(CoEError, match="prefetch"):
        load_pooled(store, memory=mem, policy="lru", prefetch="psychic")


def test_token_prefetch_is_exact_and_trace_decode_substitutes(imported, tmp_path):
    from executors.moe_decode import trace_decode
    from executors.moe_model import record_trace
    from routing.moe_predictor import TokenPredictor

    ref, layout, store = imported("mixtral")
    full = load_pooled(store, memory=layout.expert_bytes, policy="lru")
    trace = record_trace(full, [_inputs(s)[0] for s in (10, 11, 12)], 6)
    full.close()
    pred = TokenPredictor.train(trace)
    pred.save(tmp_path / "p")
    x = _inputs(13)[:1]
    want = ref.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, x.shape[1]:].tolist()
    mem = layout.layers[0].expert_nbytes * (layout.top_k * len(layout.layers) + 2)
    pm = load_pooled(store, memory=mem, policy="gate-score", prefetch="token", predictor=tmp_path / "p")
    got, _ = pm.generate(x, 6)
    pm.prefetcher.drain()
    pm.close()
    st = pm.prefetcher.stats
    assert got == want[:len(got)] and st.predicted > 0 and st.issued + st.yielded + st.dropped > 0
    with pytest.raises(CoEError, match="predictor"):
        load_pooled(store, memory=mem, policy="lru", prefetch="token")

    plain = load_pooled(store, memory=layout.layers[0].expert_nbytes * 3, policy="gate-score")
    r0 = trace_decode(plain, trace, prefill=False)
    sub = load_pooled(store, memory=layout.layers[0].expert_nbytes * 3, policy="gate-score", alpha=0.9)
    r1 = trace_decode(sub, trace, prefill=False)
    assert sub.tap.substituted > 0 and r1.stats.misses < r0.stats.misses and r1.tokens == r0.tokens


def test_load_compute_split_computes_low_score_misses_in_place_and_stays_exact(imported):
    from executors.moe_split import choose_loads

    assert choose_loads(4, 1.0, 1.0) == 2 and choose_loads(4, 1.0, 3.0) == 3 and choose_loads(3, 5.0, 1.0) == 0 and choose_loads(3, 1.0, 5.0) == 3
    assert choose_loads(0, 1.0, 1.0) == 0
    ref, layout, store = imported("qwen3_moe")
    x = _inputs(14)[:1]
    want = ref.generate(x, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, x.shape[1]:].tolist()
    mem = layout.layers[0].expert_nbytes * (layout.top_k + 1)
    pm = load_pooled(store, memory=mem, policy="lru", split=True)
    got, stats = pm.generate(x, 10)
    assert got == want[:len(got)]                                  # both paths do the eager arithmetic
    s = pm.split.stats
    assert s.in_place > 0 and s.loaded > 0 and s.compute_seconds > 0 and s.load_seconds > 0
    plain = load_pooled(store, memory=mem, policy="lru")
    _, plain_stats = plain.generate(x, 10)
    assert stats.misses < plain_stats.misses                       # in-place experts never entered the pool


def test_prefill_batching_reads_each_expert_once_per_pass(imported):
    """Item 4 on a CPU box: a prompt's tokens batched per expert, against the same prompt token by token."""
    from edge_agent.llm_bench import prefill_batching

    _, layout, store = imported("mixtral")
    got = prefill_batching(store, _inputs(15)[0].tolist())
    batched, single = got["batched"], got["token-by-token"]
    assert batched["gib_read"] <= layout.expert_bytes / 2**30 + 1e-12       # at most every expert once
    assert single["gib_read"] > batched["gib_read"] and got["speedup"] > 0


def test_the_predicted_policy_is_exact_and_needs_a_predictor(imported):
    from executors.moe_model import record_trace
    from routing.moe_predictor import TokenPredictor

    ref, layout, store = imported("mixtral")
    full = load_pooled(store, memory=layout.expert_bytes, policy="lru")
    trace = record_trace(full, [_inputs(s)[0] for s in (10, 11, 12)], 6)
    full.close()
    x = _inputs(13)[:1]
    want = ref.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, x.shape[1]:].tolist()
    mem = layout.layers[0].expert_nbytes * (layout.top_k + 1)        # tight: evictions every layer
    pm = load_pooled(store, memory=mem, policy="predicted", predictor=TokenPredictor.train(trace))
    got, _ = pm.generate(x, 6)
    pm.close()
    assert got == want[:len(got)] and len(got) == 6
    assert pm.tap.context()["predicted"] and pm.pools[0].stats().evictions > 0   # scored, and it had to evict
    with pytest.raises(CoEError, match="needs a token predictor"):
        load_pooled(store, memory=mem, policy="predicted")


def test_the_ablation_runs_every_row_and_gives_predicted_rows_the_profiles_predictor_and_popularity(imported,
                                                                                                   monkeypatch):
    """(d): each row decodes the trace for real; `predicted` eviction gets a predictor and popularity learnt from
    the profile (other prompts), the gate-score rows neither unless they prefetch."""
    import numpy as np

    import executors.moe_model as moe_model
    from edge_agent import llm_bench as lb
    from executors.moe_decode import remap
    from routing.moe_predictor import TokenPredictor

    _, layout, store = imported("mixtral")
    profile, decode = _profile_and_decode(store, layout, 4)
    calls = []
    real = moe_model.load_pooled

    def spy(root, **kw):
        calls.append(kw)
        return real(root, **kw)
    monkeypatch.setattr(moe_model, "load_pooled", spy)
    ended = []
    rows = lb.run_ablation(store, profile, decode, share=0.5,
                           on_row=lambda r: ended.append((r["row"], len(calls))))
    assert [r["row"] for r in rows] == [name for _, name, _ in lb.ABLATION] + [lb.CEILING]
    # each row is handed over as it ends, before the next row's pool is made (a run cut short keeps them)
    assert ended == [(name, i + 1) for i, (_, name, _) in enumerate(lb.ABLATION)] + [(lb.CEILING, len(calls))]
    assert all(r["tokens"] == int((decode.step > 0).sum()) for r in rows)
    from_profile = TokenPredictor.train(remap(profile, layout.model))
    from_decoded = TokenPredictor.train(remap(decode, layout.model))
    assert not np.allclose(from_profile.W, from_decoded.W)          # the check below can tell them apart
    seen = set()
    for (policy, _, extra), kw in zip(lb.ABLATION, calls):
        assert kw["policy"] == policy and kw["memory"] == calls[0]["memory"]      # one budget for every row
        assert kw["device"] == "cpu" and kw["host_memory"] == 0                     # the defaults: no host tier
        assert all(kw.get(k) == v for k, v in extra.items() if k != "oracle"), (policy, extra)   # its own settings
        if policy == "predicted" or extra.get("prefetch") == "token":
            assert np.array_equal(kw["predictor"].W, from_profile.W)             # learnt on the profile only
        else:
            assert kw["predictor"] is None
        if policy == "predicted":
            assert kw["popularity"] == remap(profile, layout.model).popularity()
        else:
            assert kw["popularity"] is None
        seen.add(policy)
    assert seen == {"lru", "gate-score", "predicted"}
    assert rows[0]["policy"] == rows[-2]["policy"] == "lru" and rows[-2]["row"] == lb.LRU_AGAIN   # first and last
    by_name = {r["row"]: r for r in rows}
    for name in (lb.ORACLE_LRU, lb.ORACLE_TOP):         # the trace's own next token: every guess is asked for
        assert by_name[name]["prefetch_precision"] == 1.0 and by_name[name]["prefetch_recall"] > 0, name
    assert by_name[lb.ORACLE_LRU]["prefetch_recall"] == 1.0     # and without substitution, all it asks for
    assert lb.lru_baseline(rows) == pytest.approx((rows[0]["tokens_per_second"] + rows[-2]["tokens_per_second"]) / 2)
    for r in rows[:-1]:     # no host tier: every byte into the pool (and computed in place) was read from its file
        assert r["gib_from_files"] == pytest.approx(r["gib_read"]) and r["gib_read"] > 0, r["row"]
    assert rows[-1]["gib_from_files"] == 0.0


def test_the_ablation_runs_the_rows_it_is_given_then_the_ceiling(imported):
    """bench/moe_prefetch_gates.py: other rows than (d)'s, each with its own settings, in the order given."""
    from edge_agent import llm_bench as lb

    _, layout, store = imported("mixtral")
    profile, decode = _profile_and_decode(store, layout, 4)
    mine = (("lru", "plain", {}), ("lru", "gated", {"prefetch": "token", "prefetch_min_prob": 0.7}),
            ("lru", "plain", {}))
    rows = lb.run_ablation(store, profile, decode, share=0.5, rows_to_run=mine)
    assert [r["row"] for r in rows] == ["plain", "gated", "plain", lb.CEILING]
    assert "prefetch_precision" in rows[1] and "prefetch_precision" not in rows[0]
    assert rows[1]["prefetch_min_prob"] == 0.7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_token_prefetch_into_a_cuda_pool_behind_a_pinned_host_tier_leaves_the_tokens_as_without_it(imported, tmp_path):
    """(d) on a GPU box (`llm bench --part d --device cuda`): guesses are read into the GPU pool from the prefetch
    thread, through the pinned host tier; the arithmetic is the same kernels' as without prefetch."""
    from executors.moe_model import record_trace
    from routing.moe_predictor import TokenPredictor

    _, layout, store = imported("mixtral")
    full = load_pooled(store, memory=layout.expert_bytes, policy="lru")
    trace = record_trace(full, [_inputs(s)[0] for s in (10, 11, 12)], 6)
    full.close()
    pred = TokenPredictor.train(trace)
    x = _inputs(13)[:1].cuda()
    mem = layout.layers[0].expert_nbytes * (layout.top_k * len(layout.layers) + 2)
    out = {}
    for mode in (None, "token"):
        pm = load_pooled(store, memory=mem, policy="lru", device="cuda", host_memory=layout.expert_bytes // 2,
                         prefetch=mode, predictor=pred if mode else None, prefetch_min_prob=0.0 if mode else None)
        out[mode] = pm.generate(x, 6)[0]
        if mode:
            pm.prefetcher.drain()
            st = pm.prefetcher.stats
            assert st.predicted > 0 and st.issued + st.yielded + st.dropped > 0     # guesses were acted on
        pm.close()
    assert out["token"] == out[None]


def test_the_trace_oracle_guesses_the_next_decode_token_of_the_same_prompt_and_its_top_score_experts_alone():
    """`TraceGuesses`: one answer per decode-sized router call, in trace order; none across prompts."""
    import numpy as np

    from executors.moe_decode import TraceGuesses
    from routing.moe_trace import Trace

    E = 4
    # prompt 0: a prefill of 6 rows (not a call), decode 1..3; prompt 1: a prefill of 2 rows (a call), decode 1..2
    seq = np.array([0] * 9 + [1] * 4, dtype=np.int32)
    step = np.array([0] * 6 + [1, 2, 3] + [0, 0, 1, 2], dtype=np.int32)
    chosen = np.zeros((13, 2, 1), dtype=np.int16)
    chosen[6:9, 0, 0], chosen[11:13, 0, 0] = [1, 2, 3], [0, 1]
    chosen[6:9, 1, 0], chosen[11:13, 1, 0] = [3, 2, 1], [2, 3]
    probs = np.full((13, 2, E), 0.1, dtype=np.float32)
    for r in range(13):
        for j in range(2):
            probs[r, j, chosen[r, j, 0]] = 0.7                      # far above the second score: top-score
    probs[7, 0, 2], probs[7, 0, 0] = 0.4, 0.35                      # prompt 0's decode 2 at layer 0: 0.4 <= 1.3 x 0.35
    trace = Trace(model="m", layers=(0, 1), top_k=1, scoring="softmax", probs=probs, chosen=chosen, seq=seq, step=step)
    exact, top = TraceGuesses(trace), TraceGuesses(trace, top_alpha=0.3)
    assert [exact(0) for _ in range(6)] == [[2], [3], [], [0], [1], []]
    assert [exact(1) for _ in range(6)] == [[2], [1], [], [2], [3], []]
    assert [top(0) for _ in range(6)] == [[], [3], [], [0], [1], []]    # decode 2's expert is not top-score at 0.3
    assert exact(0) == [] and top(1) == [2]                            # past the end: nothing; layers count apart


def test_part_b_decodes_every_policy_with_lru_first_and_last_and_belady_hits_most(imported):
    """(b): each policy decodes the same trace for real; LRU runs again last (the box's drift), reading the same."""
    from edge_agent import llm_bench as lb

    _, layout, store = imported("mixtral")
    profile, decode = _profile_and_decode(store, layout, 5)
    rows = lb.run_decode(store, profile, decode, share=0.5)
    assert [r.policy for r in rows] == list(lb.DECODE_POLICIES)
    assert rows[0].policy == rows[-1].policy == "lru"
    assert (rows[0].hit_rate, rows[0].gib_read) == (rows[-1].hit_rate, rows[-1].gib_read)     # same decode twice
    assert all(r.tokens == int((decode.step > 0).sum()) and r.tokens_per_second > 0 for r in rows)
    belady = next(r for r in rows if r.policy == "belady")
    # the oracle is never beaten by a policy that admits every miss (it bounds those; admission declines some)
    assert all(belady.hit_rate >= r.hit_rate for r in rows if "+admission" not in r.policy)
    adm = next(r for r in rows if r.policy == "predicted+admission")
    pred = next(r for r in rows if r.policy == "predicted")
    assert adm.tokens == belady.tokens and adm.gib_read > 0
    assert adm.declined > 0 and pred.declined == 0             # it declined some misses; the plain policy none
    # no host tier: every byte into the pool is a file read
    assert all(r.gib_from_files == pytest.approx(r.gib_read) and r.gib_read > 0 for r in rows)
    host = lb.run_decode(store, profile, decode, share=0.25, host_share=0.5, host_mode="exclusive")
    # a host tier behind the pool: fewer bytes from the files than into the pool, for every policy
    assert all(0 < r.gib_from_files < r.gib_read for r in host), [(r.policy, r.gib_from_files, r.gib_read) for r in host]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_generate_is_bit_exact_with_the_reference_at_its_own_thread_count(imported, family):
    """`generate` leaves a core to the loads (fewer compute threads), and CPU kernels round by thread count: its
    logits differed from a reference run at the default count by ~1e-7.  At the same count they are equal."""
    from executors.moe_threads import loader_friendly_threads

    ref, layout, store = imported(family)
    aligned = _aligned_reference(ref)
    x = _inputs(5)[:1]
    steps = 6
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * layout.top_k, policy="lru")
    got: list = []
    try:
        tokens, _ = pm.generate(x, steps, on_logits=lambda t: got.append(t.clone()))
    finally:
        pm.close()
    want, past, nxt = [], None, x
    with torch.no_grad(), loader_friendly_threads("cpu"):
        for _ in range(steps):
            res = aligned(input_ids=nxt, past_key_values=past, use_cache=True)
            past = res.past_key_values
            want.append(res.logits[0, -1].clone())
            nxt = res.logits[0, -1].argmax().reshape(1, 1)
    assert len(got) == len(tokens) == steps
    assert all(torch.equal(a, b) for a, b in zip(want, got)), family


def test_min_new_tokens_masks_the_end_token_as_transformers_does(imported, tmp_path):
    """An end-of-sequence token ends generation, except within `min_new_tokens`, where it cannot be chosen.

    (c) of `llm bench` forces every system to the same length; transformers does it by masking the end tokens'
    scores, so coe-edge must mask them too (stopping later would give other tokens than transformers').
    """
    ref, layout, root = imported("mixtral")
    x = torch.tensor([[5, 6, 7, 8]])
    free = ref.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, x.shape[1]:].tolist()
    at = next(i for i in range(1, len(free)) if free[i] not in free[:i])   # a token first chosen after the first
    eos, old = free[at], ref.generation_config.eos_token_id
    ref.generation_config.eos_token_id = eos
    pm = load_pooled(root, memory=layout.layers[0].expert_nbytes * (layout.top_k + 1), policy="lru")
    try:
        want = ref.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, x.shape[1]:].tolist()
        pm.model.generation_config.eos_token_id = eos
        stopped, stats = pm.generate(x, 6)
        assert stopped == free[:at + 1] and stats.tokens == at + 1   # ends at the end token, which it returns
        forced, stats = pm.generate(x, 6, min_new_tokens=6)
        assert eos not in forced and stats.tokens == 6
        assert forced == want                                        # the tokens transformers gives
        assert forced[:at] == free[:at]
    finally:
        ref.generation_config.eos_token_id = old
        pm.close()


def test_deepseek_substitution_ranks_as_its_router_picks(imported, monkeypatch):
    """The rank the hook hands substitution reproduces DeepSeek-V3's own selection (sigmoid + correction bias,
    within its best groups): its top-k is exactly the router's top-k, token by token, and every substitute is an
    expert the router could have picked (finite rank)."""
    import numpy as np

    import routing.moe_router as mr

    ref, layout, store = imported("deepseek_v3")
    seen = []
    real = mr.substitute

    def spy(scores, chosen, resident, alpha, rule, rank=None):
        got = real(scores, chosen, resident, alpha, rule, rank)
        seen.append((np.asarray(chosen).copy(), rank, got))
        return got
    monkeypatch.setattr(mr, "substitute", spy)
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * (layout.top_k + 1), policy="gate-score",
                     alpha=0.6)
    try:
        for name, mod in pm.model.named_modules():    # a bias that changes the picks, as a trained model has
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, mod.e_score_correction_bias.numel()))
        pm.generate(_inputs(5)[:1], 6)
    finally:
        pm.close()
    assert seen and all(rank is not None for _, rank, _ in seen)
    k = layout.top_k
    for chosen, rank, got in seen:
        assert np.isinf(rank).any()                   # groups left out: -inf there
        picked = np.argsort(-rank, axis=1, kind="stable")[:, :k]
        assert [set(r) for r in picked.tolist()] == [set(r) for r in chosen.tolist()]
        rows = np.flatnonzero(got.changed)
        assert np.isfinite(np.take_along_axis(rank[rows], got.chosen[rows], 1)).all()
    assert sum(g.substituted for _, _, g in seen) > 0


def test_substitution_is_refused_for_a_family_whose_router_it_does_not_know(imported):
    """ERNIE-4.5, LFM2, Jamba ... import and run exactly, but their gate scores or weight rules are not the ones
    substitution computes: alpha > 0 is refused naming the model type, before anything loads."""
    import dataclasses

    from executors.moe_model import SUBSTITUTION_FAMILIES, check_substitution

    _, layout, _ = imported("mixtral")
    for family in sorted(configs()):
        assert family in SUBSTITUTION_FAMILIES
        check_substitution(dataclasses.replace(layout, model_type=family))
    with pytest.raises(CoEError, match=r"\(ernie4_5_moe\): substitution \(alpha > 0\) knows the routers of"):
        check_substitution(dataclasses.replace(layout, model_type="ernie4_5_moe"))


def test_load_pooled_refuses_substitution_for_an_unknown_router_before_loading(imported, monkeypatch):
    import dataclasses

    from coe.moe import MoELayout

    _, layout, store = imported("mixtral")
    real = MoELayout.load.__func__
    monkeypatch.setattr(MoELayout, "load", classmethod(
        lambda cls, root: dataclasses.replace(real(cls, root), model_type="ernie4_5_moe")))
    with pytest.raises(CoEError, match=r"\(ernie4_5_moe\): substitution \(alpha > 0\) knows the routers of .*run "
                                       r"this model with alpha 0"):
        load_pooled(store, memory=layout.expert_bytes, policy="lru", alpha=0.3)
    load_pooled(store, memory=layout.expert_bytes, policy="lru", alpha=0.0).close()     # exact: served


def test_trace_driven_substitution_is_refused_on_a_router_that_selects_on_biased_scores(imported):
    """A trace holds gate scores, not DeepSeek-V3's biased, grouped ranking: trace-driven decode would substitute
    from groups its router excluded.  Live generation has the ranking (previous test); the trace path refuses."""
    from executors.moe_decode import trace_decode

    _, layout, store = imported("deepseek_v3")
    _, decode = _profile_and_decode(store, layout, 2)
    pm = load_pooled(store, memory=layout.expert_bytes, policy="gate-score", alpha=0.3)
    try:
        with pytest.raises(CoEError, match="selects on biased scores a trace does not hold"):
            trace_decode(pm, decode)
    finally:
        pm.close()
    exact = load_pooled(store, memory=layout.expert_bytes, policy="gate-score")
    try:
        assert trace_decode(exact, decode).tokens > 0          # alpha 0: the trace path serves it
    finally:
        exact.close()
