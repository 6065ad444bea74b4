"""Cache admission: a miss worth less than what it would push out is computed beside the pool, never resident.

`Pool.admissions` asks the pool's own policy; the MoE layer computes a
declined expert straight over its file's memory map (`load_pooled(admission=True)`,
`ExpertStore.map_flat`), and the trace replay counts it as a miss that moved its bytes.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_pool import Source

from coe import CoEError
from storage.policies import make_policy
from storage.pool import Pool


PROBS = {"a": 0.5, "b": 0.4, "c": 0.3, "d": 0.1, "e": 0.9, "f": 0.35}


def _full(policy="probability", probs=PROBS):
    p = Pool("cpu", 3, make_policy(policy), Source(dict.fromkeys("abcdef", 1)), probabilities=probs)
    for e in "abc":
        p.release(p.acquire(e))
    return p


def test_a_miss_worth_less_than_its_victim_is_declined_and_one_worth_more_is_admitted():
    p = _full()
    assert p.admissions(["d"]) == [False]       # 0.1 would push out c (0.3)
    assert p.admissions(["e"]) == [True]        # 0.9 beats c
    assert p.admissions(["f"]) == [True]        # 0.35 beats c (0.3) alone
    assert p.admissions(["a"]) == [True]        # resident: nothing to decide
    assert sorted(p.resident()) == ["a", "b", "c"] and p.source.loads == list("abc")   # asking changes nothing


def test_admissions_are_weighed_in_turn():
    """After e takes c's place, f (0.35) would push out b (0.4): declined, though alone it would be admitted."""
    p = _full()
    assert p.admissions(["e", "f"]) == [True, False]
    assert p.admissions(["f", "e"]) == [True, True]     # f takes c's place, e then beats b


def test_the_layers_own_experts_are_not_weighed_as_victims():
    """c (0.3) is the layer's own hit, pinned beside f: f (0.35) would push out b (0.4), so it is declined."""
    p = _full()
    assert p.admissions(["f"]) == [True]                   # alone, f would take c's place
    assert p.admissions(["f"], keep=["c"]) == [False]
    assert p.admissions(["e"], keep=["c"]) == [True]       # e (0.9) beats b


def test_a_miss_past_a_full_wave_is_weighed_against_the_released_wave():
    """Pool of 2; the layer holds a (kept) and admits e: the wave is full, so f is weighed as in the next wave."""
    p = Pool("cpu", 2, make_policy("probability"), Source(dict.fromkeys("abcdef", 1)), probabilities=PROBS)
    for x in "ab":
        p.release(p.acquire(x))
    assert p.admissions(["e", "f", "d"], keep=["a"]) == [True, False, False]   # f, d lose to a .5 (then e .9)
    assert p.admissions(["e", "f"], keep=["a", "b"]) == [True, False]


def test_free_room_pinned_room_and_recency_only_policies_admit():
    p = Pool("cpu", 3, make_policy("probability"), Source(dict.fromkeys("abcd", 1)), probabilities=PROBS)
    held = [p.acquire("a")]
    assert p.admissions(["d"]) == [True]        # room is free: nothing is pushed out
    held += [p.acquire(e) for e in "bc"]
    assert p.admissions(["d"]) == [True]        # only pinned experts hold the room: the caller's wait decides
    p.release(held.pop())
    assert p.admissions(["d"]) == [False]       # c (0.3) is free to go, and worth more than d
    for h in held:
        p.release(h)
    assert _full("lru").admissions(["d"]) == [True]      # a newcomer never outranks anything by recency alone
    assert _full("fifo").admissions(["d"]) == [True]


def test_bypass_counts_a_declined_miss_and_its_bytes():
    p = _full()
    p.bypass("d")
    s = p.stats()
    assert (s.bypassed, s.bypassed_bytes, s.misses) == (1, 1, 3)
    assert "d" not in p.resident()


def _sweep_trace():
    """One prompt: a prefill that asks for every expert of each layer, then decode tokens that reuse two."""
    from routing.moe_trace import Trace

    L, E, k, prompt = 2, 8, 2, 4
    rows = prompt + 12
    probs = np.full((rows, L, E), 1.0 / E, dtype=np.float16)
    chosen = np.zeros((rows, L, k), dtype=np.int16)
    for t in range(prompt):                 # the prompt's four tokens ask for all eight experts
        chosen[t] = [[2 * t, 2 * t + 1]] * L
    for t in range(prompt, rows):
        chosen[t] = [[0, 1]] * L if t % 3 else [[t % E, (t + 3) % E]] * L
    seq = np.zeros(rows, dtype=np.int32)
    step = np.concatenate([np.zeros(prompt), np.arange(1, rows - prompt + 1)]).astype(np.int32)
    return Trace(model="m", layers=(0, 1), top_k=k, scoring="softmax", probs=probs, chosen=chosen, seq=seq, step=step)


def test_the_replay_counts_declined_misses_and_their_bytes():
    from routing.moe_replay import replay

    tr = _sweep_trace()
    pop = {f"m.L{l:02d}.E{e:03d}": (1.0 if e < 2 else 0.01) for l in tr.layers for e in range(8)}
    plain = replay(tr, policy="probability", capacity=12, expert_nbytes=3, popularity=pop)
    adm = replay(tr, policy="probability", capacity=15, expert_nbytes=3, popularity=pop, admission=True)
    assert adm.accesses == plain.accesses and adm.capacity == 15 and plain.capacity == 12   # the same pools
    assert adm.bypassed > 0 and adm.misses == adm.loads + adm.bypassed
    assert adm.hits + adm.misses == adm.accesses and adm.bytes_loaded == 3 * adm.misses
    assert adm.misses < plain.misses        # the prompt's sweep no longer pushes out the two popular experts
    # one expert (3 bytes) of the capacity is set aside for the declined one: one token's top-2 (6 bytes) fit in 9
    # with admission and in 6 without it, not in 8 with it
    assert replay(tr, policy="probability", capacity=9, expert_nbytes=3, popularity=pop, admission=True).accesses
    assert replay(tr, policy="probability", capacity=6, expert_nbytes=3, popularity=pop).accesses
    with pytest.raises(CoEError, match="cannot hold"):
        replay(tr, policy="probability", capacity=8, expert_nbytes=3, popularity=pop, admission=True)
    with pytest.raises(CoEError, match="quota 'shared'"):
        replay(tr, policy="probability", capacity=30, expert_nbytes=3, popularity=pop, quota="per-layer",
               admission=True)
    lru = replay(tr, policy="lru", capacity=15, expert_nbytes=3, admission=True)
    assert lru.bypassed == 0 and lru.loads == replay(tr, policy="lru", capacity=15, expert_nbytes=3).loads


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from moe_models import build

    from storage.llm_import import import_checkpoint

    root = tmp_path_factory.mktemp("admission")
    ref = build("mixtral", root / "hf")
    layout = import_checkpoint(root / "hf", root / "store")
    return ref, layout, root / "store"


def _inputs(seed):
    from moe_models import VOCAB

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, 11), generator=g)


@pytest.mark.parametrize("policy", ["probability", "lfu"])
def test_declined_experts_leave_the_logits_and_the_generation_exact(mixtral, policy, caplog):
    from coe.moe import parse_expert_id
    from executors.moe_model import load_pooled

    ref, layout, store = mixtral
    per = layout.layers[0].expert_nbytes
    # the low-numbered experts are the popular ones: the prompt's sweep over the rest is declined
    popularity = {eid: 1.0 / (1 + parse_expert_id(eid)[2]) for eid in layout.ids()}
    x = _inputs(21)
    with torch.no_grad():
        want = ref(x).logits
    pm = load_pooled(store, memory=per * (layout.top_k + 3), policy=policy, popularity=popularity, admission=True)
    assert sum(p.capacity for p in pm.pools) == per * (layout.top_k + 2)      # one expert is set aside
    assert "0.67-0.74x" not in caplog.text       # the CUDA measurement's warning is not for the CPU, where it pays
    with torch.no_grad():
        got = pm.model(x).logits
    assert torch.equal(got, want)
    s = pm.stats()
    assert s.bypassed > 0                                   # the prompt's sweep over unpopular experts, declined
    reads = pm.in_place.weights.reads
    assert reads.from_file == s.bypassed and s.bypassed_bytes == reads.file_bytes == s.bypassed * per
    pm.close()
    gen = ref.generate(x, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, x.shape[1]:].tolist()
    pm = load_pooled(store, memory=per * (layout.top_k + 3), policy=policy, popularity=popularity, admission=True)
    out, stats = pm.generate(x, 8)
    pm.close()
    assert out == gen and stats.bypassed > 0 and stats.hit_rate < stats.hits / (stats.hits + stats.misses)


def test_admission_keeps_the_residents_a_sweep_would_push_out(mixtral):
    """The same prompt twice: with admission its second prefill finds every popular expert still resident."""
    from coe.moe import parse_expert_id
    from executors.moe_model import load_pooled

    _, layout, store = mixtral
    per = layout.layers[0].expert_nbytes
    x = _inputs(22)
    full = load_pooled(store, memory=layout.expert_bytes, policy="lfu")
    with torch.no_grad():
        full.model(x)
    counts = full.tap.context()["counts"]
    full.close()
    popular = {e for l in layout.layers for e in sorted((e for e in layout.ids(l.layer) if counts.get(e)),
                                                         key=lambda e: -counts[e])[:2]}
    asked = {e for e in layout.ids() if counts.get(e)}
    assert len(popular) == 2 * len(layout.layers) and len(asked) > len(popular) + 1      # a sweep past the pool
    popularity = {eid: (1.0 if eid in popular else 0.01 / (1 + parse_expert_id(eid)[2])) for eid in layout.ids()}
    second = {}
    for admission in (False, True):
        pm = load_pooled(store, memory=per * (len(popular) + admission), policy="probability", popularity=popularity,
                         admission=admission)
        with torch.no_grad():
            pm.model(x)
            before = pm.stats()
            pm.model(x)
        second[admission] = (pm.stats().misses - before.misses, pm.stats().bypassed - before.bypassed)
        pm.close()
    assert second[True] == (0, len(asked) - len(popular))     # the popular ones hit; the rest declined again
    assert second[False][0] > 0                               # without it the sweep loads, and pushes out


def test_a_mapped_expert_is_the_files_bytes_and_a_corrupt_file_is_named(mixtral, tmp_path):
    import shutil

    from coe import ExpertLoadError
    from executors.moe_fiddler import HostWeights
    from storage.expert_store import ExpertStore

    _, layout, store = mixtral
    eid = layout.ids()[1]
    w = HostWeights(ExpertStore(store))
    got, handle = w.open(eid)
    want = ExpertStore(store).read(eid)
    assert handle is None and all(torch.equal(got[k], want[k]) for k in want)
    w.close(None, eid)
    assert w._maps == {} and w.reads.from_file == 1
    # a view kept past close (an error's traceback may hold one) still reads the file's bytes: the map lives on
    assert all(torch.equal(got[k], want[k]) for k in want)
    del got
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    path = ExpertStore(copy).path(eid)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF                                             # one flipped bit in the last weight
    path.write_bytes(bytes(raw))
    with pytest.raises(ExpertLoadError, match=f"{eid}.*sha256 mismatch"):
        ExpertStore(copy).map_flat(eid)
    path.write_bytes(bytes(raw[:-100]))                         # truncated, and not verified
    with pytest.raises(ExpertLoadError, match=f"{eid}.*truncated"):
        ExpertStore(copy, verify="never").map_flat(eid)


def test_admission_sets_one_expert_aside_and_needs_its_own_pools(mixtral):
    from executors.moe_model import load_pooled

    _, layout, store = mixtral
    per = layout.layers[0].expert_nbytes
    with pytest.raises(CoEError, match="set aside for admission"):
        load_pooled(store, memory=per * layout.top_k, policy="lfu", admission=True)    # nothing left for a token
    load_pooled(store, memory=per * layout.top_k, policy="lfu").close()
    lru = load_pooled(store, memory=per * layout.top_k, policy="lru", admission=True)  # LRU never declines
    assert lru.pools[0].capacity == per * layout.top_k and lru.in_place is None
    lru.close()
    with pytest.raises(CoEError, match="quota shared"):
        load_pooled(store, memory=per * 8, policy="lfu", quota="per-layer", admission=True)
    pool = Pool("cpu", layout.layers[0].expert_nbytes * 4, make_policy("lru"), Source({}))
    with pytest.raises(CoEError, match="shared pool"):
        load_pooled(store, memory=0, shared_pool=pool, admission=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_cuda_box_declined_experts_run_on_the_cpu_beside_the_gpu_pool_and_the_logits_match(mixtral, caplog):
    """Fiddler's path for admission (`llm bench --part b --device cuda`, row predicted+admission): a declined miss
    is computed on the CPU, over the host tier's copy or its file's map, one CPU read per declined use; the
    expert set aside comes out of the host memory, not the GPU budget."""
    from coe.moe import parse_expert_id
    from executors.moe_model import load_pooled

    ref, layout, store = mixtral
    per = layout.layers[0].expert_nbytes
    popularity = {eid: 1.0 / (1 + parse_expert_id(eid)[2]) for eid in layout.ids()}
    pm = load_pooled(store, memory=per * (layout.top_k + 2), policy="probability", popularity=popularity,
                     admission=True, device="cuda", host_memory=per * (layout.top_k + 3))
    try:
        assert "0.67-0.74x" in caplog.text                  # measured not to pay on an H200: said when asked for
        assert sum(p.capacity for p in pm.pools) == per * (layout.top_k + 2)
        assert pm.host.capacity == per * (layout.top_k + 2)
        with torch.no_grad():
            for seed in (21, 23, 24):
                x = _inputs(seed)
                torch.testing.assert_close(pm.model(x.cuda()).logits.cpu(), ref(x).logits, rtol=1e-4, atol=1e-4)
        s = pm.stats()
        reads = pm.in_place.weights.reads
        assert s.bypassed > 0 and reads.from_file + reads.from_host == s.bypassed
    finally:
        pm.close()
