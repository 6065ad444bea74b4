"""The prefill balance rule and its two-buffer mechanism (issue 11 item 4).

The rule is pure and tested on exact cases (the boundary of the inequality,
resident or not, ties).  The mechanism runs on a CPU pool with the CPU
playing the GPU (plain copies instead of streams), so placement, the
staging buffers, the host tier's copies and the CPU thread are checked bit
for bit against transformers' eager model; on CUDA, within a tolerance.
"""
from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.moe_prefill import LinearCost, PrefillCosts, fit_linear, goes_to_gpu, place, place_balanced

COSTS = PrefillCosts(cpu=LinearCost(2.0, 1.0), gpu=LinearCost(1.0, 0.0), load=3.0)


def test_the_rule_at_its_boundary_a_tie_stays_on_the_cpu():
    # T_CPU(n) = 2n + 1, T_GPU(n) = n, T_load = 3
    assert not goes_to_gpu(2, False, COSTS)      # 5 > 2 + 3 is false: the tie stays on the CPU
    assert goes_to_gpu(3, False, COSTS)          # 7 > 3 + 3
    assert not goes_to_gpu(1, False, COSTS)      # 3 > 1 + 3 is false
    assert goes_to_gpu(1, True, COSTS)           # resident: no load to pay, 3 > 1
    even = PrefillCosts(cpu=LinearCost(1.0, 0.5), gpu=LinearCost(1.0, 0.5), load=0.0)
    assert not goes_to_gpu(7, True, even)        # equal costs, resident: still a tie, still the CPU
    with pytest.raises(ValueError):
        goes_to_gpu(0, True, COSTS)


def test_place_splits_in_ascending_order_and_only_residency_changes_the_answer():
    tokens = {7: 2, 5: 1, 2: 3, 0: 2}
    assert place(tokens, resident={5}, costs=COSTS) == ([2, 5], [0, 7])
    assert place(tokens, resident={0, 5, 7}, costs=COSTS) == ([0, 2, 5, 7], [])
    assert place(tokens, resident=set(), costs=COSTS) == ([2], [0, 5, 7])
    assert place({}, resident=set(), costs=COSTS) == ([], [])


def test_balanced_placement_weighs_the_two_sides_as_queues():
    """Four experts the per-expert rule all sends to the CPU (3 < 0 + 4 each): 12 s there, against 8 s balanced."""
    flat = PrefillCosts(cpu=LinearCost(0.0, 3.0), gpu=LinearCost(0.0, 0.0), load=4.0)
    tokens = {0: 5, 1: 5, 2: 5, 3: 5}
    assert place(tokens, resident=set(), costs=flat) == ([], [0, 1, 2, 3])
    gpu, cpu = place_balanced(tokens, resident=set(), in_host=set(), costs=flat)
    assert len(gpu) == 2 and len(cpu) == 2 and gpu == sorted(gpu) and cpu == sorted(cpu)
    # resident experts are the GPU's biggest wins: they go first, and the rest balance behind them
    assert place_balanced(tokens, resident={3}, in_host=set(), costs=flat) == ([0, 3], [1, 2])
    assert place_balanced({}, resident=set(), in_host=set(), costs=flat) == ([], [])


def _instance(experts, kc, bc, kg, load, read):
    from executors.moe_prefill import READ_AHEAD

    costs = PrefillCosts(cpu=LinearCost(kc, bc), gpu=LinearCost(kg, 0.0), load=load, read=read)
    tokens = {e: n for e, (n, _, _) in enumerate(experts)}
    resident = {e for e, (_, r, _) in enumerate(experts) if r}
    in_host = {e for e, (_, _, h) in enumerate(experts) if h}
    each = {e: (costs.gpu(n) + (0 if e in resident else load + (0 if e in in_host else read / READ_AHEAD)),
                costs.cpu(n)) for e, n in tokens.items()}

    def span(gpu, cpu):
        return max(sum(each[e][0] for e in gpu), sum(each[e][1] for e in cpu))

    def best():
        from itertools import combinations

        return min(span(g, [e for e in tokens if e not in g])
                   for k in range(len(tokens) + 1) for g in combinations(tokens, k))
    return costs, tokens, resident, in_host, each, span, best


_EXPERTS = st.tuples(st.integers(1, 64), st.booleans(), st.booleans())
_COSTS = (st.floats(0, 5), st.floats(0, 5), st.floats(0, 5), st.floats(0, 5), st.floats(0, 20))


@settings(max_examples=150, deadline=None)
@given(st.lists(_EXPERTS, max_size=9), *_COSTS)
def test_balanced_placement_of_a_few_experts_is_the_best_one(experts, kc, bc, kg, load, read):
    """Up to EXACT_UP_TO experts every placement is tried: the longer queue is the shortest possible."""
    costs, tokens, resident, in_host, _, span, best = _instance(experts, kc, bc, kg, load, read)
    gpu, cpu = place_balanced(tokens, resident, in_host, costs)
    assert sorted(gpu + cpu) == sorted(tokens) and not set(gpu) & set(cpu)
    assert span(gpu, cpu) == pytest.approx(best(), abs=1e-9)
    assert span(gpu, cpu) <= span(*place(tokens, resident, costs)) + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.lists(_EXPERTS, min_size=11, max_size=13), *_COSTS)
def test_balanced_placement_of_many_experts_is_within_one_expert_of_the_best(experts, kc, bc, kg, load, read):
    """Beyond EXACT_UP_TO: never longer than the per-expert rule, and at most the best placement plus the
    largest of the experts' cheaper costs (the ratio order's prefix rounds one expert of the fractional optimum)."""
    from executors.moe_prefill import EXACT_UP_TO

    assert len(experts) > EXACT_UP_TO
    costs, tokens, resident, in_host, each, span, best = _instance(experts, kc, bc, kg, load, read)
    gpu, cpu = place_balanced(tokens, resident, in_host, costs)
    assert sorted(gpu + cpu) == sorted(tokens) and not set(gpu) & set(cpu)
    assert span(gpu, cpu) <= span(*place(tokens, resident, costs)) + 1e-9
    assert span(gpu, cpu) <= best() + max(min(g, c) for g, c in each.values()) + 1e-9


def test_balanced_placement_adds_the_file_read_where_host_memory_lacks_the_expert():
    """Streaming an expert the host tier lacks costs a read (10 s, shared by READ_AHEAD at once): 4 + 2.5 on
    the GPU; the CPU thread computes on the memory map, 3 s.  So that expert is the one the CPU takes."""
    from executors.moe_prefill import READ_AHEAD

    assert READ_AHEAD == 4
    slow = PrefillCosts(cpu=LinearCost(0.0, 3.0), gpu=LinearCost(0.0, 0.0), load=4.0, read=10.0)
    # in host memory: 4 against 3 each, as without a read: two and two
    assert place_balanced({0: 1, 1: 1, 2: 1, 3: 1}, set(), {0, 1, 2, 3}, slow) == ([0, 1], [2, 3])
    for missing in (0, 3):          # whichever it is, the expert only in its file goes to the CPU
        gpu, cpu = place_balanced({0: 1, 1: 1, 2: 1, 3: 1}, set(), {0, 1, 2, 3} - {missing}, slow)
        assert missing in cpu and len(gpu) == 2 and len(cpu) == 2
    with pytest.raises(ValueError, match="nothing to place"):
        place_balanced({0: 0}, set(), set(), slow)


def test_fit_linear_recovers_a_line_and_needs_two_token_counts():
    got = fit_linear([(1, 3.0), (3, 7.0), (5, 11.0)])
    assert got.per_token == pytest.approx(2.0) and got.fixed == pytest.approx(1.0) and got(10) == pytest.approx(21.0)
    noisy = fit_linear([(2, 1.0), (2, 3.0), (4, 4.0), (4, 6.0)])      # means (2, 2) and (4, 5)
    assert noisy.per_token == pytest.approx(1.5) and noisy.fixed == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="two token counts"):
        fit_linear([(8, 1.0), (8, 2.0)])


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_models import VOCAB  # noqa: E402

from coe import CoEError  # noqa: E402
from executors.moe_model import load_pooled  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")




def _prompt(seed, n=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


# resident: always the "GPU" (n > 0); not resident: streamed when n > 3.5, on the CPU thread when n <= 3
MIXED = PrefillCosts(cpu=LinearCost(1.0, 0.0), gpu=LinearCost(0.0, 0.0), load=3.5, source="test")


@pytest.mark.parametrize("host,queues", [(False, False), (True, False), (True, True)])
def test_prefill_balance_on_a_cpu_pool_is_bit_exact_and_streams_around_the_pool(qwen3, host, queues):
    ref, layout, store = qwen3
    per = layout.layers[0].expert_nbytes
    pm = load_pooled(store, memory=per * (layout.top_k + 2), policy="lru", prefill=MIXED,
                     host_memory=layout.expert_bytes if host else 0)
    pm.prefill.balanced = queues        # the queue-balanced placement runs the same mechanism
    with torch.no_grad():
        for seed in range(3):                       # decode-sized passes fill the pool (and the host tier)
            x = _prompt(100 + seed, 2)
            assert torch.equal(pm.model(x).logits, ref(x).logits)
        before = pm.stats()
        resident = sorted(pm.pools[0].resident())
        host_hits = pm.host.stats().hits if host else 0
        for seed in range(3):
            x = _prompt(seed)
            assert torch.equal(pm.model(x).logits, ref(x).logits), f"prompt {seed}: logits differ"
    st = pm.prefill.stats
    assert st.resident > 0 and st.streamed > 0 and st.cpu > 0
    after = pm.stats()
    assert after.misses == before.misses and sorted(pm.pools[0].resident()) == resident    # nothing entered
    assert st.bytes_streamed == st.streamed * per and pm.prefill.staging_bytes == 2 * per  # two buffers, no more
    if host:        # what the host tier held was streamed or computed from its copy, not read again
        assert pm.host.stats().hits > host_hits and pm.prefill.weights.reads.from_host > 0
    pm.close()


def test_a_wrong_buffer_is_caught(qwen3):
    """The check can fail: computing expert i+1 from expert i's buffer changes the logits."""
    from executors import moe_prefill as mp

    ref, layout, store = qwen3
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * (layout.top_k + 2), policy="lru",
                     prefill=MIXED)
    x = _prompt(0)
    orig = mp.PrefillBalance._fill

    def stale(self, slot):          # the computation finds the other slot's (the previous expert's) bytes
        orig(self, slot)
        other = self._slots[1] if slot is self._slots[0] else self._slots[0]
        if other.device is not None:
            slot.device.copy_(other.device)
    mp.PrefillBalance._fill = stale
    try:
        with torch.no_grad():
            assert not torch.equal(pm.model(x).logits, ref(x).logits)
    finally:
        mp.PrefillBalance._fill = orig
    pm.close()


def _streaming(pm):
    """Every non-resident expert streams (costs that never send one to the CPU): the stream's own case."""
    pm.prefill.costs = PrefillCosts(cpu=LinearCost(10.0, 10.0), gpu=LinearCost(0.0, 0.0), load=0.0, source="test")


def test_the_stream_reads_experts_ahead_on_loader_threads_at_once(qwen3):
    """Two file reads of one layer's streamed experts meet at a barrier: read one at a time, they never do."""
    ref, layout, store = qwen3
    pm = load_pooled(store, memory=layout.layers[0].expert_nbytes * (layout.top_k + 2), policy="lru",
                     prefill=MIXED)
    _streaming(pm)
    barrier = threading.Barrier(2, timeout=5)
    calls, lock = [], threading.Lock()
    load = pm.prefill.source.load

    def meet(eid, reuse=None):
        with lock:
            calls.append((eid, threading.current_thread().name))
            first_two = len(calls) <= 2
        if first_two:
            barrier.wait()
        return load(eid, reuse)
    pm.prefill.source.load = meet
    try:
        with torch.no_grad():
            assert torch.equal(pm.model(_prompt(0)).logits, ref(_prompt(0)).logits)
    finally:
        pm.close()
    assert len(calls) >= 2 and all(name.startswith("coe-prefill-read") for _, name in calls)
    assert pm.prefill.stats.streamed == len(calls)          # each streamed expert read once, none twice


def test_a_read_that_fails_midway_unpins_the_host_copies_read_ahead_and_the_next_prompt_is_exact(qwen3):
    ref, layout, store = qwen3
    per = layout.layers[0].expert_nbytes
    pm = load_pooled(store, memory=per * (layout.top_k + 2), policy="lru", prefill=MIXED,
                     host_memory=per * layout.layers[0].num_experts)      # one layer's worth of experts
    _streaming(pm)
    host, holds = pm.host, []
    hold, release = host.hold, host.release
    host.hold = lambda eid: (lambda h: (holds.append(h) if h is not None else None, h)[1])(hold(eid))
    host.release = lambda h: ([holds.remove(x) for x in holds if x is h], release(h))[1]
    with torch.no_grad():
        pm.model(_prompt(5, 2))                             # fills the host tier a little: held copies ahead
        load, n = pm.prefill.source.load, [0]

        def fail_third(eid, reuse=None):
            n[0] += 1
            if n[0] == 3:
                raise OSError(f"{eid}: injected read error")
            return load(eid, reuse)
        pm.prefill.source.load = fail_third
        taken = []
        spy = pm.prefill._fetch
        pm.prefill._fetch = lambda eid: (taken.append(eid), spy(eid))[1]
        with pytest.raises(OSError, match="injected read error"):
            pm.model(_prompt(1))
        assert taken and not holds          # every hold the stream (or the CPU thread) took was given back
        assert not any(r.pinned for r in pm.host.state().residents)
        pm.prefill.source.load = load
        assert torch.equal(pm.model(_prompt(2)).logits, ref(_prompt(2)).logits)
    pm.close()


def test_balance_on_a_cpu_box_says_it_reduces_to_batching(qwen3):
    _, layout, store = qwen3
    with pytest.raises(CoEError, match="batching"):
        load_pooled(store, memory=layout.expert_bytes, prefill="balance")
    with pytest.raises(CoEError, match="prefill must be"):
        load_pooled(store, memory=layout.expert_bytes, prefill="greedy")


def test_profile_costs_times_this_box(monkeypatch):
    import types

    from torch import nn

    from executors import moe_prefill
    from executors.moe_prefill import profile_costs

    w = {"gate_up_proj": torch.randn(64, 32), "down_proj": torch.randn(32, 32)}
    c = profile_costs(w, nn.SiLU(), torch.device("cpu"), ns=(1, 64), repeats=2)
    assert c.load > 0 and c.cpu(64) > 0 and c.gpu(64) > 0
    assert c.cpu.per_token >= 0 and c.cpu.fixed >= 0 and "profiled" in c.source
    # on a clock that moves 2 ms per reading every timed run takes 2 ms: the fits are flat at 2 ms, from `repeats`
    # points at each token count on each device, and the load is one timed copy
    now, fitted = [0.0], []

    def tick() -> float:
        now[0] += 0.002
        return now[0]
    real_fit = moe_prefill.fit_linear

    def spy(points):
        fitted.append(sorted(n for n, _ in points))
        return real_fit(points)
    monkeypatch.setattr(moe_prefill, "time", types.SimpleNamespace(perf_counter=tick))
    monkeypatch.setattr(moe_prefill, "fit_linear", spy)
    c = profile_costs(w, nn.SiLU(), torch.device("cpu"), ns=(1, 64), repeats=3)
    assert fitted == [[1, 1, 1, 64, 64, 64]] * 2                     # the CPU's points, then the device's
    for cost in (c.cpu, c.gpu):
        assert cost.per_token == pytest.approx(0.0, abs=1e-12) and cost.fixed == pytest.approx(0.002)
    assert c.load == pytest.approx(0.002)


def test_generate_help_documents_the_new_options():
    from click.testing import CliRunner

    from edge_agent.cli import cli

    res = CliRunner().invoke(cli, ["llm", "generate", "--help"])
    assert res.exit_code == 0
    for text in ("--prefill", "balance", "T_CPU(n) > T_GPU(n) + T_load", "--host-memory", "Fiddler"):
        assert text in res.output


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("costs", ["balance", "queues", MIXED])
def test_prefill_balance_on_cuda_matches_the_reference_within_tolerance(qwen3, costs):
    ref, layout, store = qwen3
    per = layout.layers[0].expert_nbytes
    pm = load_pooled(store, memory=per * (layout.top_k + 2), policy="lru", device="cuda", prefill=costs,
                     host_memory=layout.expert_bytes // 2)
    with torch.no_grad():
        for seed in range(3):
            x = _prompt(100 + seed, 2)
            torch.testing.assert_close(pm.model(x.cuda()).logits.cpu(), ref(x).logits, rtol=1e-4, atol=1e-4)
        for seed in range(3):
            x = _prompt(seed)
            torch.testing.assert_close(pm.model(x.cuda()).logits.cpu(), ref(x).logits, rtol=1e-4, atol=1e-4)
    st = pm.prefill.stats
    assert st.resident + st.streamed + st.cpu > 0
    if costs is MIXED:
        assert st.streamed > 0 and st.cpu > 0
    pm.close()


def _decode_after_prefill(qwen3, offer: bool) -> tuple:
    """(experts the host tier kept from the stream, host-tier misses of the decode passes after the prefill)."""
    ref, layout, store = qwen3
    per = layout.layers[0].expert_nbytes
    pm = load_pooled(store, memory=per * (layout.top_k + 2), policy="lru", prefill=MIXED,
                     host_memory=per * layout.layers[0].num_experts * 2)
    _streaming(pm)
    if not offer:
        pm.prefill._offer = lambda expert_id, flat: False
    kept = []
    admit = pm.host.admit
    pm.host.admit = lambda eid, produce=None, **kw: (lambda ok: (kept.append(eid) if ok else None, ok)[1])(
        admit(eid, produce, **kw))
    try:
        with torch.no_grad():
            x = _prompt(3, 16)
            assert torch.equal(pm.model(x).logits, ref(x).logits)
            for eid in kept:
                assert pm.host.contains(eid)                 # the streamed bytes stayed, under the host's policy
            before = pm.host.stats().misses
            for t in range(4):                              # decode-sized passes go through the pools
                y = x[:, : 12 + t]
                assert torch.equal(pm.model(y[:, -2:]).logits, ref(y[:, -2:]).logits)
            return kept, pm.host.stats().misses - before, pm.prefill.stats
    finally:
        pm.close()


def test_streamed_experts_read_from_their_files_stay_in_the_host_tier_for_the_decode(qwen3):
    kept, misses, stats = _decode_after_prefill(qwen3, offer=True)
    assert kept and stats.admitted == len(kept) and stats.streamed >= len(kept)
    never_kept, misses_without, _ = _decode_after_prefill(qwen3, offer=False)
    assert never_kept == []
    assert misses < misses_without          # the decode found in the host tier what the prefill had streamed
