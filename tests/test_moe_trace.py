"""MoE routing traces: recorded from a real (tiny) model, saved, loaded, refused when malformed, and synthetic
ones drawn from measured popularity; then the two MoE eviction policies that read the router's statistics."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from coe import CoEError
from routing.moe_trace import TRACE_FORMAT, TRACE_VERSION, Trace, load_popularity, synthetic
from storage.policies import GateScore, LFU, PoolState, Resident, make_policy

# the packaged copy of the measured Mixtral popularity (configs/moe/; its README names the source)
POPULARITY = (Path(__file__).resolve().parents[1] / "configs" / "moe" / "mixtral-expert-popularity"
              / "international_law.json")


# -- recording from a real model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """qwen2_moe (MoE layers 0 and 2, dense layer 1): two prompts with decode steps, recorded through RouterTap,
    and the eager reference model's router logits for the same forward passes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from moe_models import VOCAB, build

    from executors.moe_model import load_pooled
    from storage.llm_import import import_checkpoint

    root = tmp_path_factory.mktemp("trace")
    ref = build("qwen2_moe", root / "hf")
    layout = import_checkpoint(root / "hf", root / "store", name="tq")
    pm = load_pooled(root / "store", memory=layout.expert_bytes, policy="lru")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (1, 6), generator=g), torch.randint(3, VOCAB, (1, 4), generator=g)]
    decode = [[11, 12, 13], [21, 22]]           # fixed next tokens: two prompts, 3 and 2 decode steps

    def run(model, **kw):
        passes = []                              # per forward pass: the model output
        for p, (x, steps) in enumerate(zip(prompts, decode)):
            if p and "tap" in kw:
                kw["tap"].next_sequence()
            res = model(input_ids=x, use_cache=True, **kw.get("extra", {}))
            passes.append(res)
            for tok in steps:
                res = model(input_ids=torch.tensor([[tok]]), past_key_values=res.past_key_values, use_cache=True,
                            **kw.get("extra", {}))
                passes.append(res)
        return passes

    with torch.no_grad():
        pm.tap.start_recording()
        got = run(pm.model, tap=pm.tap)
        trace = pm.tap.stop_recording()
        want = run(ref, extra={"output_router_logits": True})
    counts, scores = dict(pm.tap.counts), dict(pm.tap.gate_scores())
    pm.close()
    return dict(trace=trace, layout=layout, ref=ref, got=got, want=want, prompts=prompts, decode=decode,
                counts=counts, scores=scores, root=root)


def test_recorded_trace_has_the_right_shape(recorded):
    trace, layout = recorded["trace"], recorded["layout"]
    n = sum(x.shape[1] + len(d) for x, d in zip(recorded["prompts"], recorded["decode"]))
    assert trace.tokens == n == 6 + 3 + 4 + 2
    assert trace.layers == (0, 2) and trace.top_k == 4 and trace.model == "tq" and trace.scoring == "softmax"
    assert trace.probs.shape == (n, 2, 8) and trace.probs.dtype == np.float16
    assert trace.chosen.shape == (n, 2, 4) and trace.chosen.dtype == np.int16
    assert trace.seq.tolist() == [0] * 9 + [1] * 6
    assert trace.step.tolist() == [0] * 6 + [1, 2, 3] + [0] * 4 + [1, 2]
    assert np.allclose(trace.probs.astype(np.float32).sum(axis=2), 1.0, atol=1e-2)
    assert trace.ids() == layout.ids()


def test_recorded_choices_are_what_the_reference_router_picks(recorded):
    import torch

    trace = recorded["trace"]
    # the pooled model computes what the reference does (so the routers saw the same inputs) ...
    for g, w in zip(recorded["got"], recorded["want"]):
        assert torch.equal(g.logits, w.logits)
    # ... and the trace holds the reference routers' choices and probabilities, token by token
    logits = [torch.stack([lg.reshape(-1, 8) for lg in w.router_logits], dim=1) for w in recorded["want"]]
    logits = torch.cat(logits)                              # [N, MoE layers, E]
    assert logits.shape == (trace.tokens, 2, 8)
    probs = logits.float().softmax(dim=-1)
    top = probs.topk(4, dim=-1).indices
    assert np.array_equal(np.sort(trace.chosen, axis=2), np.sort(top.numpy(), axis=2))
    assert np.array_equal(trace.probs, probs.numpy().astype(np.float16))
    # the tap counted every choice, and its gate scores are the mean of the last passes' mean probabilities
    n = np.bincount(trace.chosen[:, 1, :].ravel(), minlength=8)
    for e in range(8):
        assert recorded["counts"].get(f"tq.L02.E{e:03d}", 0) == n[e]
    per_pass = [probs[rows].mean(dim=0) for _, _, rows in trace.passes()]        # 7 passes, window 8
    want = torch.stack(per_pass).mean(dim=0)                                       # [MoE layers, E]
    for j, layer in enumerate(trace.layers):
        got = np.array([recorded["scores"][f"tq.L{layer:02d}.E{e:03d}"] for e in range(8)])
        assert np.allclose(got, want[j].numpy(), atol=1e-6)


def test_passes_group_prefill_and_decode_steps(recorded):
    trace = recorded["trace"]
    passes = [(s, k, rows.tolist()) for s, k, rows in trace.passes()]
    assert passes == [(0, 0, list(range(6))), (0, 1, [6]), (0, 2, [7]), (0, 3, [8]),
                      (1, 0, list(range(9, 13))), (1, 1, [13]), (1, 2, [14])]
    acc = list(trace.accesses())
    assert [(p, layer) for p, layer, _, _ in acc] == [(p, layer) for p in range(7) for layer in (0, 2)]
    for p, layer, ids, mean in acc:
        rows = passes[p][2]
        j = trace.layers.index(layer)
        assert ids == [f"tq.L{layer:02d}.E{e:03d}" for e in np.unique(trace.chosen[rows, j])]
        assert mean.shape == (8,) and np.isclose(mean.sum(), 1.0, atol=1e-2)
    pop = trace.popularity()
    for layer in (0, 2):
        assert np.isclose(sum(v for k, v in pop.items() if f".L{layer:02d}." in k), trace.top_k)


def test_save_load_round_trip(recorded, tmp_path):
    trace = recorded["trace"]
    path = trace.save(tmp_path / "t.safetensors")
    back = Trace.load(path)
    assert (back.model, back.layers, back.top_k, back.scoring) == (trace.model, trace.layers, trace.top_k,
                                                                   trace.scoring)
    for k in ("probs", "chosen", "seq", "step"):
        a, b = getattr(trace, k), getattr(back, k)
        assert a.dtype == b.dtype and np.array_equal(a, b), k
    assert not list(tmp_path.glob(".*tmp"))


def test_next_sequence_without_passes_does_not_skip_a_sequence(recorded):
    from routing.moe_router import RouterTap

    tap = RouterTap(recorded["layout"])
    with pytest.raises(CoEError, match="stop_recording without start_recording"):
        tap.stop_recording()
    tap.start_recording()
    tap.next_sequence()
    with pytest.raises(CoEError, match="nothing was recorded"):
        tap.stop_recording()
    with pytest.raises(CoEError, match="window must be at least 1"):
        RouterTap(recorded["layout"], window=0)


# -- malformed trace files --------------------------------------------------------------------------------
def _small(n=5, layers=(0, 1), e=4, k=2) -> Trace:
    rng = np.random.default_rng(0)
    chosen = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in layers]) for _ in range(n)])
    return Trace(model="m", layers=tuple(layers), top_k=k, scoring="softmax",
                 probs=np.full((n, len(layers), e), 1 / e, dtype=np.float16), chosen=chosen.astype(np.int16),
                 seq=np.zeros(n, dtype=np.int32), step=np.arange(n, dtype=np.int32))


def _arrays(t: Trace) -> dict:
    return {"probs": t.probs, "chosen": t.chosen, "seq": t.seq, "step": t.step}


def _meta(**over) -> dict:
    info = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": "m", "layers": [0, 1], "top_k": 2,
            "scoring": "softmax"}
    info.update(over)
    return {"coe": json.dumps(info)}


def _write(path: Path, arrays: dict, meta: dict | None) -> Path:
    from safetensors.numpy import save_file

    save_file(arrays, str(path), metadata=meta)
    return path


def test_small_trace_round_trips(tmp_path):
    t = _small()
    back = Trace.load(_write(tmp_path / "ok.safetensors", _arrays(t), _meta()))
    assert np.array_equal(back.chosen, t.chosen) and back.layers == (0, 1)


def test_not_safetensors_and_truncated_and_missing(tmp_path):
    (tmp_path / "text").write_text("these are not the routing choices you are looking for\n" * 20)
    with pytest.raises(CoEError, match=r"text: not a readable trace"):
        Trace.load(tmp_path / "text")
    path = _small(50).save(tmp_path / "t.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(CoEError, match=r"t\.safetensors: not a readable trace \(truncated"):
        Trace.load(path)
    with pytest.raises(CoEError, match=r"nope\.safetensors: trace not found"):
        Trace.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("drop", ["probs", "chosen", "seq", "step"])
def test_missing_array(tmp_path, drop):
    arrays = _arrays(_small())
    del arrays[drop]
    with pytest.raises(CoEError, match=rf"trace lacks the '{drop}' array"):
        Trace.load(_write(tmp_path / "t.safetensors", arrays, _meta()))


@pytest.mark.parametrize("meta,match", [
    (None, "trace metadata is missing or not JSON"),
    ({"coe": "{not json"}, "trace metadata is missing or not JSON"),
    ({"other": "x"}, "trace metadata is missing or not JSON"),
    (_meta(format="coe-edge/something"), "not an MoE trace"),
    ({"coe": "[1, 2]"}, "not an MoE trace"),
    (_meta(version=99), "unsupported trace version 99"),
    (_meta(layers=[]), "'layers' must be a non-empty list"),
    (_meta(layers=["0", "1"]), "'layers' must be a non-empty list"),
    (_meta(layers=[0, 1, 2]), r"probs is \[5, 2, 4\], expected \[5, 3, experts\]"),
    (_meta(top_k=3), r"chosen is \[5, 2, 2\], expected \[tokens, 2, 3\]"),
    (_meta(top_k=None), r"'top_k' must be a whole number >= 1, got None"),      # was a TypeError traceback
    (_meta(top_k="abc"), r"'top_k' must be a whole number >= 1, got 'abc'"),
    (_meta(top_k=0), r"'top_k' must be a whole number >= 1, got 0"),
], ids=["none", "not-json", "no-coe-key", "format", "not-object", "version", "no-layers", "str-layers",
        "layers-vs-probs", "top-k-vs-chosen", "top-k-null", "top-k-str", "top-k-zero"])
def test_wrong_metadata(tmp_path, meta, match):
    with pytest.raises(CoEError, match=match):
        Trace.load(_write(tmp_path / "t.safetensors", _arrays(_small()), meta))


def test_shape_mismatch_and_out_of_range(tmp_path):
    t = _small()
    cases = [
        ({**_arrays(t), "probs": t.probs[:4]}, r"probs is \[4, 2, 4\], expected \[5, 2, experts\]"),
        ({**_arrays(t), "probs": t.probs[:, :, 0].copy()}, r"probs is \[5, 2\]"),
        ({**_arrays(t), "chosen": np.zeros((5, 2, 3), np.int16)}, r"chosen is \[5, 2, 3\]"),
        ({**_arrays(t), "seq": t.seq[:3]}, r"seq and step must hold one entry per token \(5\)"),
        ({**_arrays(t), "step": t.step.reshape(5, 1)}, r"seq and step must hold one entry per token"),
    ]
    for arrays, match in cases:
        with pytest.raises(CoEError, match=match):
            Trace.load(_write(tmp_path / "t.safetensors", arrays, _meta()))
    for bad in (4, -1):
        chosen = t.chosen.copy()
        chosen[2, 1, 0] = bad
        with pytest.raises(CoEError, match=r"chosen names an expert outside 0\.\.3"):
            Trace.load(_write(tmp_path / "t.safetensors", {**_arrays(t), "chosen": chosen}, _meta()))


# -- synthetic traces ---------------------------------------------------------------------------------------
def _inclusion(p: np.ndarray) -> np.ndarray:
    """P(expert e among 2 drawn without replacement, weighted by p): p_e + sum_j p_j p_e / (1 - p_j)."""
    out = p.copy()
    for e in range(len(p)):
        out[e] += sum(p[j] * p[e] / (1 - p[j]) for j in range(len(p)) if j != e)
    return out


def test_synthetic_marginals_follow_popularity():
    pop = [[8, 4, 2, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 5, 5, 0, 0, 0, 10]]
    t = synthetic(pop, tokens=4000, top_k=2, seed=3)
    t.check()
    assert t.chosen.shape == (4000, 3, 2) and t.layers == (0, 1, 2)
    assert (t.chosen[:, :, 0] != t.chosen[:, :, 1]).all()          # k distinct experts a token
    for l, row in enumerate(pop):
        p = np.asarray(row, float) / sum(row)
        got = np.bincount(t.chosen[:, l].ravel(), minlength=8) / t.tokens
        assert np.abs(got - _inclusion(p)).max() < 0.04, (l, got, _inclusion(p))
        assert got[np.asarray(row) == 0].sum() == 0                  # an expert nobody uses is never drawn
    # the gate scores agree with the choice: every chosen expert scores at least as high as every other
    p = t.probs.astype(np.float32)
    picked = np.take_along_axis(p, t.chosen.astype(np.int64), axis=2).min(axis=2)
    mask = np.ones_like(p, dtype=bool)
    np.put_along_axis(mask, t.chosen.astype(np.int64), False, axis=2)
    assert (picked >= np.where(mask, p, 0).max(axis=2)).all()
    assert np.allclose(p.sum(axis=2), 1, atol=1e-2)
    # trace popularity (its per-layer shares) tells the same story
    pop_l0 = [t.popularity()[f"mixtral.L00.E{e:03d}"] for e in range(8)]
    assert pop_l0[0] > pop_l0[1] > pop_l0[2] > max(pop_l0[3:])


def test_synthetic_is_reproducible_and_locality_increases_repeats():
    pop = [[1.0] * 8 for _ in range(4)]

    def repeats(t):
        return float((t.chosen[1:] == t.chosen[:-1]).all(axis=2).mean())
    a, b = synthetic(pop, tokens=600, seed=1), synthetic(pop, tokens=600, seed=1)
    assert np.array_equal(a.chosen, b.chosen) and np.array_equal(a.probs, b.probs)
    assert not np.array_equal(a.chosen, synthetic(pop, tokens=600, seed=2).chosen)
    base = repeats(a)                                   # 1/28 for two of eight uniform experts
    assert base < 0.1
    r5, r9 = repeats(synthetic(pop, tokens=600, locality=0.5, seed=1)), repeats(
        synthetic(pop, tokens=600, locality=0.9, seed=1))
    assert base < r5 < r9
    assert abs(r5 - (0.5 + 0.5 * base)) < 0.07 and abs(r9 - (0.9 + 0.1 * base)) < 0.05
    assert a.seq.tolist() == [0] * 600 and a.step.tolist() == list(range(600))
    assert len(list(a.passes())) == 600                 # one decode token per forward pass


def test_synthetic_refuses_bad_popularity():
    for bad in ([[1, 2, 3]], [[1, -1, 2, 2]], [[0, 0, 0, 0]], [1, 2, 3], [[[1, 2, 3]]], [[1, 2, 3], [1, 2]],
                [[1, float("inf"), 1, 1]], [[1, float("nan"), 1, 1]], [["a", "b", "c"]]):
        with pytest.raises(CoEError, match="popularity must be"):
            synthetic(bad, tokens=3, top_k=4 if bad == [[1, 2, 3]] else 2)
    with pytest.raises(CoEError, match="popularity must be"):
        synthetic([[1, 1, 1]], tokens=3, top_k=0)
    for bad in (-0.1, 1.0, 2):
        with pytest.raises(CoEError, match="locality must be in"):
            synthetic([[1, 1, 1]], tokens=3, top_k=2, locality=bad)


def test_load_popularity_of_mixtral():
    pop = load_popularity(POPULARITY)
    assert len(pop) == 32 and all(len(r) == 8 for r in pop)
    raw = json.loads(POPULARITY.read_text())["expert_popularity"]
    assert pop == [[float(x) for x in r] for r in raw]
    t = synthetic(pop, tokens=50, top_k=2, seed=0)
    assert t.chosen.shape == (50, 32, 2) and len(t.ids()) == 256


@pytest.mark.parametrize("text,match", [
    ("not json", "not a popularity file with 'expert_popularity'"),
    ('{"counts": [[1, 2]]}', "not a popularity file with 'expert_popularity'"),
    ("[1, 2]", "not a popularity file with 'expert_popularity'"),
    ('{"expert_popularity": []}', "must be a non-empty list of per-layer lists"),
    ('{"expert_popularity": [1, 2]}', "must be a non-empty list of per-layer lists"),
    ('{"expert_popularity": [[1, 2], []]}', "must be a non-empty list of per-layer lists"),
    ('{"expert_popularity": [[1, 2], [1, 2, 3]]}', "same number of non-negative counts"),
    ('{"expert_popularity": [[1, -2], [1, 2]]}', "same number of non-negative counts"),
    ('{"expert_popularity": [[1, "2"], [1, 2]]}', "same number of non-negative counts"),
    ('{"expert_popularity": [[1, Infinity], [1, 2]]}', "same number of non-negative counts"),
    ('{"expert_popularity": [[1, NaN], [1, 2]]}', "same number of non-negative counts"),
    ('{"expert_popularity": [[1, true], [1, 2]]}', "same number of non-negative counts"),
])
def test_malformed_popularity_files(tmp_path, text, match):
    path = tmp_path / "pop.json"
    path.write_text(text)
    with pytest.raises(CoEError, match=rf"pop\.json: .*{match}"):
        load_popularity(path)


def test_missing_popularity_file(tmp_path):
    with pytest.raises(CoEError, match=r"nope\.json: popularity file not found"):
        load_popularity(tmp_path / "nope.json")


# -- LFU and gate-score eviction --------------------------------------------------------------------------
def _state(spec, free=0, counts=None, scores=None) -> PoolState:
    """spec: [(id, used_seq, pinned)], every expert 10 bytes."""
    res = tuple(Resident(e, 10, i, used, pinned) for i, (e, used, pinned) in enumerate(spec))
    return PoolState(10 * len(res) + free, res, counts=counts or {}, gate_scores=scores or {})


def test_policies_are_registered():
    assert isinstance(make_policy("lfu"), LFU) and isinstance(make_policy("gate-score"), GateScore)


def test_lfu_evicts_the_least_counted_first_never_a_pinned_one():
    counts = {"a": 5, "b": 1, "c": 3, "d": 0}            # e was never counted: 0
    spec = [("a", 1, False), ("b", 2, False), ("c", 3, False), ("d", 4, True), ("e", 5, False)]
    s = _state(spec, counts=counts)
    lfu = LFU()
    assert lfu.choose_victims(s, 0) == []
    assert lfu.choose_victims(s, 10) == ["e"]                      # d has fewer uses but is pinned
    assert lfu.choose_victims(s, 30) == ["e", "b", "c"]
    assert lfu.choose_victims(s, 40) == ["e", "b", "c", "a"]
    assert lfu.choose_victims(s, 41) is None                        # only the pinned d would free more
    # equal counts: least recently used first
    tie = _state([("a", 9, False), ("b", 2, False), ("c", 5, False)], counts={"a": 2, "b": 2, "c": 2})
    assert lfu.choose_victims(tie, 20) == ["b", "c"]
    # counts change the order, recency does not override them
    assert lfu.choose_victims(_state(spec, counts={**counts, "e": 9}), 10) == ["b"]


def test_gate_score_evicts_the_lowest_score_ties_by_lru():
    scores = {"a": 0.30, "b": 0.05, "c": 0.05, "d": 0.01, "e": 0.20}
    spec = [("a", 1, False), ("b", 7, False), ("c", 3, False), ("d", 4, True), ("e", 5, False)]
    s = _state(spec, scores=scores)
    gs = GateScore()
    assert gs.choose_victims(s, 10) == ["c"]                        # b and c tie; c was used longer ago
    assert gs.choose_victims(s, 20) == ["c", "b"]
    assert gs.choose_victims(s, 40) == ["c", "b", "e", "a"]         # never d, the pinned lowest
    assert gs.choose_victims(s, 50) is None
    assert gs.choose_victims(_state(spec, free=10, scores=scores), 10) == []
    # an expert without a score counts as 0: the router has not leant towards it
    assert gs.choose_victims(_state(spec + [("f", 9, False)], scores=scores), 10) == ["f"]


@pytest.mark.parametrize("policy", [LFU(), GateScore()])
def test_pinned_experts_block(policy):
    s = _state([("a", 1, True), ("b", 2, True), ("c", 3, False)], free=5, counts={"c": 9}, scores={"c": 0.9})
    assert policy.choose_victims(s, 15) == ["c"]
    assert policy.choose_victims(s, 16) is None
    all_pinned = _state([("a", 1, True), ("b", 2, True)], counts={"a": 0}, scores={"a": 0})
    assert policy.choose_victims(all_pinned, 1) is None


def test_predicted_evicts_the_least_likely_soon_next_token_plus_popularity_ties_by_gate_score_then_lru():
    from storage.policies import Predicted

    spec = [("a", 1, False), ("b", 7, False), ("c", 3, False), ("d", 4, True), ("e", 5, False)]
    pred = {"a": 0.9, "b": 0.1, "c": 0.1, "d": 0.0, "e": 0.4}
    s = PoolState(50, tuple(Resident(e, 10, i, used, pinned) for i, (e, used, pinned) in enumerate(spec)),
                  gate_scores={"b": 0.2, "c": 0.3}, predicted=pred)
    p = make_policy("predicted")
    assert isinstance(p, Predicted)
    assert p.choose_victims(s, 10) == ["b"]                          # b and c tie on p; b's gate score is lower
    assert p.choose_victims(s, 30) == ["b", "c", "e"]                # never d, the pinned least likely
    assert p.choose_victims(s, 50) is None
    # the gate score does not override the prediction: a low-score expert the next token needs stays
    s2 = PoolState(20, (Resident("x", 10, 0, 1), Resident("y", 10, 1, 2)), gate_scores={"x": 0.0, "y": 0.9},
                   predicted={"x": 0.8, "y": 0.1})
    assert p.choose_victims(s2, 10) == ["y"]
    # no prediction yet (its layer has not run): 0, then gate score, then recency
    s3 = PoolState(20, (Resident("x", 10, 0, 5), Resident("y", 10, 1, 2)), predicted={"x": 0.3})
    assert p.choose_victims(s3, 10) == ["y"]
    # with a popularity profile the rank is q + p.  The next token leans to x, but the tokens after it ask for y
    # far more often: by q alone y would go; x was used longer ago, so recency alone would also evict x
    s4 = PoolState(20, (Resident("x", 10, 0, 1), Resident("y", 10, 1, 2)), predicted={"x": 0.3, "y": 0.2},
                   probabilities={"x": 0.05, "y": 0.5})
    assert p.choose_victims(s4, 10) == ["x"]
    # q can outweigh p: 0.6 + 0.05 > 0.1 + 0.5, so y goes although p alone would evict x and y is the more recent
    s5 = PoolState(20, (Resident("x", 10, 0, 1), Resident("y", 10, 1, 2)), predicted={"x": 0.6, "y": 0.1},
                   probabilities={"x": 0.05, "y": 0.5})
    assert p.choose_victims(s5, 10) == ["y"]
    # a sum, not the larger of the two: x (0.4 + 0.4) stays over y (0 + 0.6), which max(q, p) would keep
    s6 = PoolState(20, (Resident("x", 10, 0, 1), Resident("y", 10, 1, 2)), predicted={"x": 0.4, "y": 0.0},
                   probabilities={"x": 0.4, "y": 0.6})
    assert p.choose_victims(s6, 10) == ["y"]


def test_the_router_tap_feeds_next_token_probabilities_to_the_pools_predicted_policy():
    from coe.moe import expert_id
    from routing.moe_predictor import NextTokenScores, TokenPredictor
    from routing.moe_router import RouterTap
    from storage.pool import Pool
    from storage.tracesim import SizeSource

    pop = [[5, 4, 3, 2, 1, 1, 1, 1]] * 3
    trace = synthetic(pop, tokens=200, top_k=2, locality=0.8, seed=1)
    E = trace.num_experts
    # a predictor that ignores its input: the next token asks for expert e with probability sigmoid(b[e])
    b = np.tile(np.linspace(3, -3, E), (len(trace.layers), 1))
    pred = TokenPredictor(trace.layers, 2, np.zeros((len(trace.layers), E, E)), b)
    layout = _layout_of(trace)
    tap = RouterTap(layout)
    ids = {l: [expert_id(layout.model, l, e) for e in range(E)] for l in trace.layers}
    tap.predict_with(NextTokenScores(pred, ids))
    layer = trace.layers[0]
    uniform = np.full((1, E), 1 / E, dtype=np.float32)
    tap.observe(layer, np.full((8, E), 1 / E, dtype=np.float32), np.zeros((8, 2), dtype=np.int64))
    assert tap.context()["predicted"] == {}                          # a prefill pass is not a next-token question
    tap.observe(layer, uniform, np.array([[0, 1]]))
    got = tap.context()["predicted"]
    assert set(got) == set(ids[layer]) and got[ids[layer][0]] == pytest.approx(1 / (1 + np.exp(-3)))
    # a pool evicting by it keeps the likely expert although it was used longest ago
    pool = Pool("t", 3, make_policy("predicted"), SizeSource(dict.fromkeys(ids[layer], 1)), context=tap.context)
    for e in (0, 5, 6):
        pool.release(pool.acquire(ids[layer][e]))
    pool.release(pool.acquire(ids[layer][7]))
    assert set(pool.resident()) == {ids[layer][0], ids[layer][5], ids[layer][7]}   # 6 was the least likely


def test_replay_with_the_predicted_policy_needs_a_fitting_predictor():
    from routing.moe_predictor import TokenPredictor
    from routing.moe_replay import replay

    pop = [[5, 4, 3, 2, 1, 1, 1, 1]] * 3
    held = synthetic(pop, tokens=100, top_k=2, locality=0.8, seed=2)
    pred = TokenPredictor.train(synthetic(pop, tokens=300, top_k=2, locality=0.8, seed=1))
    got = replay(held, policy="predicted", capacity=6, expert_nbytes=1, predictor=pred)
    assert got.accesses == replay(held, policy="lru", capacity=6, expert_nbytes=1).accesses and got.loads > 0
    # a predictor that ignores its input ranks every layer's experts the same way at every token: the replay
    # must then evict exactly as the 'probability' policy with that ranking does, which it only can if the
    # scores reach the pool before each layer's loads (without them it would evict as gate-score)
    E, L = held.num_experts, len(held.layers)
    order = np.array([[e * L + j for e in range(E)] for j in range(L)], dtype=float)   # distinct across layers
    fixed = TokenPredictor(held.layers, 2, np.zeros((L, E, E)), 3 - 6 * order / (E * L))
    from coe.moe import expert_id
    ranking = {expert_id(held.model, l, e): float(E * L - order[j, e]) for j, l in enumerate(held.layers)
               for e in range(E)}
    by_pred = replay(held, policy="predicted", capacity=6, expert_nbytes=1, predictor=fixed)
    by_prob = replay(held, policy="probability", capacity=6, expert_nbytes=1, popularity=ranking)
    by_gate = replay(held, policy="gate-score", capacity=6, expert_nbytes=1)
    assert by_pred.loads == by_prob.loads != by_gate.loads
    with pytest.raises(CoEError, match="needs a token predictor"):
        replay(held, policy="predicted", capacity=6, expert_nbytes=1)
    other = TokenPredictor.train(synthetic([[1] * 4] * 3, tokens=200, top_k=2, seed=3))
    with pytest.raises(CoEError, match="does not fit"):
        replay(held, policy="predicted", capacity=6, expert_nbytes=1, predictor=other)


def test_replay_takes_a_policy_object_and_shows_the_future_only_to_an_oracle():
    from routing.moe_replay import replay
    from storage.policies import LRU

    held = synthetic([[5, 4, 3, 2, 1, 1, 1, 1]] * 3, tokens=120, top_k=2, locality=0.5, seed=4)
    seen = []

    class Spy(LRU):
        name = "spy"

        def choose_victims(self, state, need_bytes):
            seen.append(len(state.future))
            return super().choose_victims(state, need_bytes)

    plain = replay(held, policy=Spy(), capacity=6, expert_nbytes=1)
    assert plain.policy == "spy" and seen and set(seen) == {0}            # not an oracle: no future
    assert plain.loads == replay(held, policy="lru", capacity=6, expert_nbytes=1).loads
    seen.clear()
    Spy.oracle = True
    replay(held, policy=Spy(), capacity=6, expert_nbytes=1)
    assert seen and max(seen) > 0 and seen == sorted(seen, reverse=True)  # the remaining accesses, shrinking


def test_popularity_for_a_store_refuses_another_models_trace_by_name():
    trace = synthetic([[3, 2, 1, 1]] * 2, tokens=30, top_k=2, seed=5)
    assert trace.popularity_for(trace.model, "t") == trace.popularity()
    with pytest.raises(CoEError, match=r"llm.trace x.trace: a trace of model '.*', but the store holds 'other'"):
        trace.popularity_for("other", "llm.trace x.trace")


def _layout_of(trace):
    from coe.moe import MoELayout, MoELayer
    return MoELayout(model=trace.model, model_type="mixtral", top_k=trace.top_k, dtype="float32",
                     layers=tuple(MoELayer(layer=l, module=f"model.layers.{l}.mlp.experts",
                                           num_experts=trace.num_experts, hidden=8, intermediate=8, expert_nbytes=1)
                                  for l in trace.layers))


def test_batching_prompts_puts_one_token_of_each_prompt_in_each_decode_pass_and_keeps_every_rows_routing():
    from edge_agent.llm_bench import batch_prompts

    # five prompts: prefills of 3 rows, decode steps 1..4 (prompt 2 stops at step 2)
    seq, step = [], []
    for s in range(5):
        last = 2 if s == 2 else 4
        seq += [s] * (3 + last)
        step += [0, 0, 0] + list(range(1, last + 1))
    n = len(seq)
    rng = np.random.default_rng(0)
    probs = rng.random((n, 2, 6)).astype(np.float16)
    chosen = rng.integers(0, 6, (n, 2, 2)).astype(np.int16)
    tr = Trace("m", (0, 1), 2, "softmax", probs, chosen, np.array(seq, np.int32), np.array(step, np.int32))
    b = batch_prompts(tr, 2)                         # prompts (0, 1) and (2, 3); prompt 4 is left out
    passes = list(b.passes())
    assert [(s, k, len(r)) for s, k, r in passes] == [(0, 0, 6), (0, 1, 2), (0, 2, 2), (0, 3, 2), (0, 4, 2),
                                                      (1, 0, 6), (1, 1, 2), (1, 2, 2)]   # the shorter one sets it
    first = np.flatnonzero((tr.seq == 1) & (tr.step == 3))[0]          # prompt 1's step 3: second row of pass 3
    assert np.array_equal(b.chosen[passes[3][2][1]], tr.chosen[first])
    assert np.array_equal(b.probs[passes[3][2][1]], tr.probs[first])
    one = batch_prompts(tr, 1)                                          # batch 1: every row, the same passes
    assert all(np.array_equal(getattr(one, f), getattr(tr, f)) for f in ("seq", "step", "chosen", "probs"))
    with pytest.raises(ValueError, match="fewer than one batch"):
        batch_prompts(tr, 6)
    with pytest.raises(ValueError, match="at least 1"):
        batch_prompts(tr, 0)


def test_the_best_row_of_the_ablation_is_never_lru_a_wider_band_an_oracle_or_the_ceiling():
    from edge_agent import llm_bench as lb

    rows = [{"row": "LRU (baseline)", "policy": "lru", "tokens_per_second": 90.0},
            {"row": "eviction by windowed gate score", "policy": "gate-score", "tokens_per_second": 20.0},
            {"row": "eviction by next token + popularity", "policy": "predicted", "tokens_per_second": 30.0},
            {"row": lb.ALPHA_WIDER, "policy": "predicted", "tokens_per_second": 60.0},
            *({"row": name, "policy": "predicted", "tokens_per_second": 70.0} for name in lb.ORACLE_ROWS),
            {"row": lb.BEST_AGAIN, "policy": "predicted", "alpha": 0.3, "tokens_per_second": 40.0},
            {"row": lb.CEILING, "policy": None, "tokens_per_second": 99.0}]
    assert lb.best_row(rows)["row"] == "eviction by next token + popularity"


def test_the_oracle_rows_are_compared_with_the_mean_of_the_two_runs_of_what_they_prefetch_on_top_of():
    from edge_agent import llm_bench as lb

    rows = [{"row": "LRU (baseline)", "policy": "lru", "tokens_per_second": 10.0},
            {"row": "eviction by windowed gate score", "policy": "gate-score", "tokens_per_second": 15.0},
            {"row": "eviction by next token + popularity", "policy": "predicted", "alpha": 0.3,
             "tokens_per_second": 20.0},
            {"row": "+ token-wise prefetch", "policy": "predicted", "alpha": 0.3, "prefetch": "token",
             "tokens_per_second": 21.0},
            {"row": "next token + popularity, alpha 0.5", "policy": "predicted", "alpha": 0.5, "tokens_per_second": 50.0},
            {"row": lb.BEST_AGAIN, "policy": "predicted", "alpha": 0.3, "tokens_per_second": 30.0},
            {"row": lb.ORACLE_LRU, "policy": "lru", "prefetch": "token", "oracle": "all", "tokens_per_second": 18.0},
            {"row": lb.ORACLE_BEST, "policy": "predicted", "alpha": 0.3, "prefetch": "token", "oracle": "all",
             "tokens_per_second": 25.0},
            {"row": lb.ORACLE_TOP, "policy": "predicted", "alpha": 0.3, "prefetch": "token", "oracle": "top",
             "tokens_per_second": 30.0},
            {"row": lb.LRU_AGAIN, "policy": "lru", "tokens_per_second": 14.0}]
    got = lb.oracle_ratios(rows)
    assert got == {lb.ORACLE_LRU: 18.0 / 12.0, lb.ORACLE_BEST: 25.0 / 25.0, lb.ORACLE_TOP: 30.0 / 25.0}
    assert [c["row"] for c in lb.latency_cuts(rows)] == ["eviction by next token + popularity",
                                                         "next token + popularity, alpha 0.5"]   # not the rerun


def test_gate_scores_that_are_not_numbers_are_refused_and_a_0d_array_is_named(tmp_path):
    arrays = _arrays(_small())
    arrays["probs"] = np.full_like(arrays["probs"], np.nan)
    with pytest.raises(CoEError, match=r"probs holds \d+ NaN or infinite gate score"):
        Trace.load(_write(tmp_path / "nan.safetensors", arrays, _meta()))
    arrays = _arrays(_small())
    arrays["chosen"] = np.array(3, dtype=arrays["chosen"].dtype)
    with pytest.raises(CoEError, match=r"chosen and probs must be arrays of tokens"):
        Trace.load(_write(tmp_path / "0d.safetensors", arrays, _meta()))


def test_a_trace_of_another_model_under_the_same_name_is_refused_for_its_shape():
    """Two stores imported as 'tiny' (an OLMoE and a DeepSeek-V3): the name matches, the layers do not; before,
    the trace's popularity went to the wrong layers and the missing ones got 0."""
    from coe.moe import MoELayer, MoELayout

    from routing.moe_trace import synthetic

    t = synthetic([[5, 4, 3, 2, 1, 1, 1, 1]] * 2, tokens=20, model="tiny", top_k=2)

    def layout(layers, experts=8, top_k=2):
        return MoELayout(model="tiny", model_type="x", top_k=top_k, dtype="float32",
                         layers=tuple(MoELayer(l, f"m.{l}", experts, 4, 4, 96) for l in layers))
    assert len(t.popularity_for("tiny", "t", layout((0, 1)))) == 16
    for other in (layout((1, 2)), layout((0, 1), experts=16), layout((0, 1), top_k=3)):
        with pytest.raises(CoEError, match=r"t: a trace of layers \[0, 1\] with 8 experts, top-2, but the store's"):
            t.popularity_for("tiny", "t", other)


def test_router_calls_of_the_wrong_shape_are_refused_before_they_change_anything():
    """Scores one column too wide were kept and failed every later ranking (on the prefetch thread); an index
    of -1 counted as the last expert; a padding index (E) raised a bare IndexError after the listeners ran."""
    from routing.moe_router import RouterTap

    trace = synthetic([[5, 4, 3, 2, 1, 1, 1, 1]] * 2, tokens=20, top_k=2, locality=0.5, seed=1)
    E, layer = trace.num_experts, trace.layers[0]
    tap = RouterTap(_layout_of(trace))
    heard = []
    tap.listen(lambda *a: heard.append(a))
    ok = np.full((2, E), 1 / E, dtype=np.float32)
    for probs, index, words in [
        (np.full((2, E + 1), 0.1), np.array([[0, 1], [1, 2]]), f"shape [2, {E + 1}], expected [tokens, {E}]"),
        (np.full(E, 0.1), np.array([[0, 1]]), "shape [8], expected"),
        (ok, np.array([[0.0, 1.0], [1.0, 2.0]]), "expected integers [2, k]"),
        (ok, np.array([[0, 1]]), "expected integers [2, k]"),
    ]:
        with pytest.raises(CoEError, match=re.escape(words)):
            tap.observe(layer, probs, index)
    with pytest.raises(CoEError, match="no MoE layer 99"):
        tap.observe(99, ok, np.array([[0, 1], [1, 2]]))
    assert heard == [] and tap.counts == {} and tap.gate_scores() == {}
    tap.observe(layer, ok, np.array([[0, E], [-1, 2]]))            # padding / out of range: no expert counted
    assert sorted(tap.counts.values()) == [1.0, 1.0] and len(heard) == 1
    assert len(tap.gate_scores()) == E


def test_a_gate_score_mean_built_from_an_older_history_is_not_kept():
    """The prefetch thread built the mean while the layer thread appended a call: the stale mean was cached and
    the layer's next wave ranked victims on it."""
    from routing.moe_router import RouterTap

    trace = synthetic([[5, 4, 3, 2, 1, 1, 1, 1]] * 2, tokens=20, top_k=2, locality=0.5, seed=1)
    E, layer = trace.num_experts, trace.layers[0]
    tap = RouterTap(_layout_of(trace))
    first = np.zeros((1, E), dtype=np.float32)
    first[0, 0] = 1.0
    tap.observe(layer, first, np.array([[0, 1]]))
    real_stack = np.stack

    def stack_then_a_call_lands(arrays, *a, **kw):    # the layer thread's call lands mid-build
        out = real_stack(arrays, *a, **kw)
        second = np.zeros((1, E), dtype=np.float32)
        second[0, 1] = 1.0
        np.stack = real_stack
        tap.observe(layer, second, np.array([[1, 2]]))
        return out
    np.stack = stack_then_a_call_lands
    try:
        stale = tap.gate_scores()
    finally:
        np.stack = real_stack
    assert stale[tap._ids[layer][0]] == 1.0                            # built from the older history ...
    fresh = tap.gate_scores()
    assert fresh[tap._ids[layer][0]] == 0.5 and fresh[tap._ids[layer][1]] == 0.5    # ... and not kept
