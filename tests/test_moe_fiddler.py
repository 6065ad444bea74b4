"""The in-place path of the load/compute split (issue 11 item 3): the Fiddler mechanism.

On a CPU pool the Fiddler thread runs with the CPU playing the device, so its
real code (the CPU thread, the host tier's copies, the copy back and the
ascending sum) is checked here bit for bit against transformers' eager model.
The CUDA tests run where CUDA is present and compare within a tolerance (the
CPU's and the GPU's sums round differently).
"""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moe_models import VOCAB, build  # noqa: E402

from coe import CoEError  # noqa: E402
from executors.moe_fiddler import HostWeights, MappedInPlace, ThreadInPlace  # noqa: E402
from executors.moe_model import _split_mode, load_pooled  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from storage.policies import make_policy  # noqa: E402
from storage.pool import Pool  # noqa: E402
from storage.tiers import StoreSource  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")




def _decode_batch(seed):
    """Two sequences of two tokens: four rows per layer, a decode-sized pass (the split's case)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2, 2), generator=g)


def test_split_true_picks_fiddler_on_cuda_and_the_memory_map_on_a_cpu():
    assert _split_mode(True, torch.device("cuda")) == "fiddler"
    assert _split_mode(True, torch.device("cpu")) == "mapped"
    assert _split_mode("fiddler", torch.device("cpu")) == "fiddler"
    assert _split_mode(False, torch.device("cuda")) is None
    with pytest.raises(CoEError, match="fiddler"):
        _split_mode("mapped", torch.device("cuda"))
    with pytest.raises(CoEError, match="split must be"):
        _split_mode("gpu", torch.device("cpu"))


def test_fiddler_thread_is_bit_exact_and_computes_from_the_host_tier_and_the_file(qwen3):
    ref, layout, store = qwen3
    per = layout.layers[0].expert_nbytes
    pm = load_pooled(store, memory=per * (layout.top_k + 1), policy="lru", split="fiddler",
                     host_memory=layout.expert_bytes)
    assert isinstance(pm.in_place, ThreadInPlace) and pm.in_place.weights.host is pm.host
    threads = []
    open_ = pm.in_place.weights.open

    def spy(eid):
        threads.append(threading.current_thread().name)
        return open_(eid)
    pm.in_place.weights.open = spy
    with torch.no_grad():
        for seed in range(12):
            x = _decode_batch(seed)
            assert torch.equal(pm.model(x).logits, ref(x).logits), f"pass {seed}: logits differ"
    s, reads = pm.split.stats, pm.in_place.weights.reads
    assert s.in_place > 0 and s.loaded > 0 and s.compute_seconds > 0 and s.load_seconds > 0
    assert threads and all(t.startswith("coe-inplace-cpu") for t in threads)     # never the layer's own thread
    assert reads.from_host + reads.from_file == s.in_place == len(threads)
    assert reads.from_host > 0          # an expert the device pool evicted was computed on the host tier's copy
    # each in-place cost is filed under its source, and loads of one source per layer under theirs
    assert ("other", "host") in s.by_source and ("load", "file") in s.by_source
    assert (("other", "file") in s.by_source) == (reads.from_file > 0)
    assert pm.host.stats().misses > 0 and pm.stats().misses > 0
    pm.close()


def test_fiddler_in_place_runs_while_the_layers_loads_are_in_flight(qwen3):
    """A load and an in-place computation of the same layer meet at a barrier: run in turn, they never do."""
    ref, layout, store = qwen3
    per = layout.layers[0].expert_nbytes

    def run(split):
        pm = load_pooled(store, memory=per * (layout.top_k + 1), policy="lru", split=split)
        barrier = threading.Barrier(2, timeout=5)
        first = {"load": True, "open": True}
        lock = threading.Lock()

        def once(what):
            with lock:
                go, first[what] = first[what], False
            if go:
                barrier.wait()
        source, weights = pm.pools[0].source, pm.in_place.weights
        load, open_ = source.load, weights.open
        source.load = lambda eid, reuse=None: (once("load"), load(eid, reuse))[1]
        weights.open = lambda eid: (once("open"), open_(eid))[1]
        pm.split.stats.load_seconds = pm.split.stats.compute_seconds = 1.0    # equal costs: 2 of 4 misses in place
        try:
            with torch.no_grad():
                return pm.model(_decode_batch(20)).logits
        finally:
            pm.close()
    with torch.no_grad():
        want = ref(_decode_batch(20)).logits
    assert torch.equal(run("fiddler"), want)
    with pytest.raises(threading.BrokenBarrierError):       # the memory-map path computes before the loads start
        run("mapped")


def test_host_weights_pin_the_host_copy_until_closed(qwen3):
    """The LFRU hazard one tier up: a host-tier load must not refill the buffer the CPU is reading."""
    _, layout, store_root = qwen3
    store = ExpertStore(store_root)
    a, b = layout.ids(0)[:2]
    host = Pool("cpu", layout.layers[0].expert_nbytes, make_policy("lru"), StoreSource(store))
    host.release(host.acquire(a))
    w = HostWeights(store, host)
    tensors, handle = w.open(a)
    assert handle is not None and w.reads.from_host == 1
    with pytest.raises(CoEError, match="holds it"):
        host.evict(a)
    assert host.acquire(b) is None              # no room while a is pinned: b cannot take a's buffer
    want = store.read(a)
    assert all(torch.equal(tensors[k], want[k]) for k in want)
    w.close(handle)
    assert host.evict(a)
    tensors, handle = w.open(a)                 # not in the host tier any more: the file's memory map
    assert handle is None and w.reads.from_file == 1 and torch.equal(tensors["down_proj"], want["down_proj"])


def test_an_in_place_job_that_fails_raises_and_unpins(qwen3):
    from executors.moe_split import LoadComputeSplit

    _, layout, store_root = qwen3
    store = ExpertStore(store_root)
    a = layout.ids(0)[0]
    host = Pool("cpu", layout.layers[0].expert_nbytes, make_policy("lru"), StoreSource(store))
    host.release(host.acquire(a))
    runner = ThreadInPlace(HostWeights(store, host), LoadComputeSplit())

    def broken(*args):
        raise RuntimeError("kernel failed")
    h = torch.zeros(1, 64)
    parts = runner.start(broken, [(0, a)], h, torch.zeros(9, 1, 1, dtype=torch.long), torch.ones(1, 1))
    with pytest.raises(RuntimeError, match="kernel failed"):
        parts.results()
    runner.close()
    assert host.evict(a)                        # the failed job released its pin
    assert MappedInPlace.threaded is False and ThreadInPlace.threaded is True


def test_the_gpu_bench_runs_its_rows_with_the_cpu_playing_the_device(qwen3):
    from edge_agent.llm_bench import gpu_split_bench

    _, _, store = qwen3
    rows = gpu_split_bench(store, list(range(40, 52)), 4, device="cpu", share=0.75,
                           rows=((False, "batched"), ("fiddler", "batched")))
    assert [(r["split"], r["prefill"]) for r in rows] == [("off", "batched"), ("fiddler", "batched")]
    assert all(r["decode_tokens_per_second"] > 0 and r["prefill_tokens_per_second"] > 0 for r in rows)
    assert "in_place" not in rows[0] and rows[1]["in_place"] + rows[1]["loaded"] > 0
    for r in rows:      # decode alone: the generation's first token (its prefill) left out
        assert r["decode_only_tokens_per_second"] > 0 and 0 <= r["decode_only_misses"]
        assert r["decode_only_host_misses"] <= r["host_misses"]


@pytest.mark.gpu
@cuda
def test_fiddler_on_cuda_matches_the_reference_within_tolerance(qwen3):
    ref, layout, store = qwen3
    per = layout.layers[0].expert_nbytes
    pm = load_pooled(store, memory=per * (layout.top_k + 1), policy="lru", device="cuda", split=True,
                     host_memory=layout.expert_bytes)
    assert isinstance(pm.in_place, ThreadInPlace)
    with torch.no_grad():
        for seed in range(12):
            x = _decode_batch(seed)
            got = pm.model(x.cuda()).logits.cpu()
            torch.testing.assert_close(got, ref(x).logits, rtol=1e-4, atol=1e-4)
    s = pm.split.stats
    assert s.in_place > 0 and s.loaded > 0
    assert pm.in_place.weights.reads.from_host > 0      # computed on the pinned host tier's copy
    pm.close()


def test_llm_generate_split_with_a_host_tier_and_prefill_balance_refused_on_a_cpu(tmp_path):
    from click.testing import CliRunner

    from edge_agent.cli import cli
    from edge_agent.llm_models import byte_tokenizer

    ref = build("mixtral", tmp_path / "hf")
    byte_tokenizer().save_pretrained(tmp_path / "hf")
    store = tmp_path / "store"
    run = CliRunner().invoke
    assert run(cli, ["llm", "import", str(tmp_path / "hf"), "--out", str(store)]).exit_code == 0
    res = run(cli, ["llm", "generate", "-m", str(store), "-p", "def ", "-n", "8", "--memory", "25%",
                    "--host-memory", "100%", "--split"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    tok = byte_tokenizer()
    ids = torch.tensor([tok.encode("def ")])
    want = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert res.output.startswith("def " + tok.decode(want, skip_special_tokens=True))
    assert "[gate-score, shared" in res.output                 # the default policy
    assert "computed in place from the memory map" in res.output and "from the host tier" in res.output
    res = run(cli, ["llm", "generate", "-m", str(store), "-p", "def ", "-n", "2", "--prefill", "balance"])
    assert res.exit_code != 0 and "reduces to batching" in res.output


def test_an_in_place_expert_leaves_the_page_cache_when_the_box_has_none_to_spare(qwen3):
    """The bench's `drop_after_read`: an in-place expert's file is read from disk each time, not kept in the
    page cache beyond the pool's budget (which would make the split look free); its bytes are counted."""
    from executors.moe_split import LoadComputeSplit
    from storage.pagecache import resident_fraction

    _, layout, store_root = qwen3
    store = ExpertStore(store_root)
    a = layout.ids(0)[0]
    path = store.path(a)
    h = torch.zeros(1, 64)

    def compute(e, tensors, *rest):
        return (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), tensors["down_proj"].sum())
    for drop in (False, True):
        store.read(a)                                  # warm: the file is in the page cache
        weights = HostWeights(store, drop_after_read=drop)
        MappedInPlace(weights, LoadComputeSplit()).start(compute, [(0, a)], h, None, None)
        after = resident_fraction(path)
        if after is None:
            pytest.skip("mincore is not available here")
        assert weights.reads.from_file == 1 and weights.reads.file_bytes == store.nbytes(a)
        assert (after == 0.0) if drop else (after > 0.5)


def test_the_in_place_cost_includes_taking_the_weights():
    """C_other is the time an in-place expert holds its thread: a slow file read counts, not only the matmuls.

    (Timing the matmuls alone made in-place experts look 10x cheaper than they were on a GPU box, and the
    split sent nearly every miss to the CPU.)
    """
    import time

    import torch

    from executors.moe_fiddler import MappedInPlace, ThreadInPlace
    from executors.moe_split import LoadComputeSplit

    class SlowRead:                      # a disk that takes 50 ms to hand over an expert's weights
        def open(self, expert_id):
            time.sleep(0.05)
            return {"w": torch.ones(2)}, None

        def close(self, handle, expert_id=None):
            pass

    def compute(e, tensors, hidden, mask, weights):
        return torch.tensor([0]), torch.tensor([0]), hidden * tensors["w"].sum()

    for kind in (MappedInPlace, ThreadInPlace):
        split = LoadComputeSplit()
        runner = kind(SlowRead(), split)
        try:
            parts = runner.start(compute, [(0, "e0"), (1, "e1")], torch.ones(1, 2), torch.ones(1), torch.ones(1))
            assert len(parts.results()) == 2
        finally:
            runner.close()
        assert split.stats.in_place == 2 and split.stats.compute_seconds >= 0.05, kind.__name__


def test_the_load_cost_is_the_layers_wall_time_per_load_not_one_loads_duration(qwen3, monkeypatch):
    """C_load is what n loads cost together: (when the last one finished − when the layer's loads began) / n.

    (Adding up each load's own duration made four concurrent 9.5 ms loads weigh 38 ms against one 14.5 ms
    in-place expert on the H200 box, and the split computed 89 misses on the CPU against 27 layers that loaded.)
    A fake clock makes each layer's loads, however many, all finish one second after the layer began them.
    """
    import time
    import types
    from collections import Counter

    from coe.moe import parse_expert_id
    from executors import pooled_experts

    ref, layout, store = qwen3
    position = {spec.layer: i for i, spec in enumerate(layout.layers)}
    clock = {"t": 0.0}
    monkeypatch.setattr(pooled_experts, "time", types.SimpleNamespace(
        perf_counter=lambda: clock["t"], monotonic=time.monotonic, sleep=time.sleep))
    pm = load_pooled(store, memory=layout.expert_bytes, policy="lru", split="mapped")
    source = pm.pools[0].source
    load, loads = source.load, Counter()

    def one_second(eid, reuse=None):        # layer at position p begins its loads at p and they all end at p + 1
        p = position[parse_expert_id(eid)[1]]
        loads[p] += 1
        out = load(eid, reuse)
        clock["t"] = p + 1.0
        return out
    source.load = one_second
    try:
        with torch.no_grad():
            assert torch.equal(pm.model(_decode_batch(3)).logits, ref(_decode_batch(3)).logits)
        s = pm.split.stats
        assert s.loaded == len(layout.layers) == 2 and loads[0] >= 2 and loads[1] >= 2
        # one measure per layer (the second computes its lowest-score miss in place, to learn C_other)
        assert s.load_seconds == pytest.approx(0.7 * (1 / loads[0]) + 0.3 * (1 / loads[1]))
    finally:
        pm.close()


def test_the_split_weighs_each_miss_at_the_costs_of_its_own_source():
    """A file-only miss costs a disk read either way; a host-tier miss is a copy or a matmul on RAM.

    The means over both sources mislead: after cheap host-tier matmuls the mean in-place cost falls below
    the mean load, and a file-only miss went to the CPU although its own in-place cost was the larger.
    """
    from executors.moe_split import FILE, HOST, LoadComputeSplit, choose_loads, choose_split

    assert choose_split([(3, 1), (3, 1)]) == 0                  # cheap in place: both on the CPU
    assert choose_split([(3, 1), (16, 20)]) == 2                # 19 ms loading both beats 20 ms for the file's
    assert choose_split([(1, 9), (1, 9), (5, 1)]) == 2 and choose_split([]) == 0
    split = LoadComputeSplit()
    split.measured(load=0.016, source=FILE)
    split.measured(load=0.002, source=HOST)
    split.measured(compute=0.020, source=FILE)
    for _ in range(3):
        split.measured(compute=0.003, source=HOST)
    s = split.stats
    assert choose_loads(1, s.load_seconds, s.compute_seconds) == 0      # the means' verdict: in place
    assert split.split([7], [FILE]) == ([7], [])                        # its own costs: 16 ms load < 20 ms
    assert split.split([7], [HOST]) == ([7], [])                        # 2 ms copy < 3 ms matmul
    assert split.split([7, 8], [FILE, FILE]) == ([7], [8])              # 16 + 16 > max(16, 20)
    assert split.cost("other", HOST) == pytest.approx(0.003) and split.cost("load", FILE) == pytest.approx(0.016)
    assert "C_cpu[file] 20.0" in split.summary() and "C_load[host] 2.0" in split.summary()
    # host-tier costs only so far (a 10 ms copy, a 2 ms matmul): four file-only misses weighed at those means
    # would all be computed in place, each a whole disk read; the lowest-score one is, to learn the file's cost
    fresh = LoadComputeSplit()
    fresh.measured(load=0.010, source=HOST)
    fresh.measured(compute=0.002, source=HOST)
    assert fresh.split([1, 2, 3, 4], [FILE] * 4) == ([1, 2, 3], [4])
    assert fresh.split([1, 2], [HOST, HOST]) == ([], [1, 2])            # its own source: the rule as before
    fresh.measured(compute=0.005, source=FILE)                          # learnt: the rule weighs it now
    assert fresh.split([1, 2, 3, 4], [FILE] * 4) == ([1], [2, 3, 4])    # max(10, 15) ms beats loading more
