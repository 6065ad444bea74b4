"""The token-wise expert predictor: it learns what a trace's next tokens ask for, and its files are checked."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from coe import CoEError
from edge_agent.cli import cli
from routing.moe_predictor import LiveInputs, TokenPredictor, inputs
from routing.moe_trace import Trace, synthetic

POP = [[5, 4, 3, 2, 1, 1, 1, 1]] * 3


def test_learns_locality_and_beats_chance():
    train = synthetic(POP, tokens=600, top_k=2, locality=0.8, seed=1)
    held = synthetic(POP, tokens=300, top_k=2, locality=0.8, seed=2)
    pred = TokenPredictor.train(train)
    got = pred.evaluate(held, 2)
    assert got["recall"] > 0.7 and got["recall"] > 2 * 2 / 8           # chance is k/E = 0.25
    none = TokenPredictor.train(synthetic(POP, tokens=600, top_k=2, locality=0.0, seed=1))
    assert none.evaluate(synthetic(POP, tokens=300, top_k=2, locality=0.0, seed=2), 2)["recall"] < got["recall"]
    assert pred.evaluate(held, 4)["recall"] >= got["recall"]            # more guesses, more recall


def test_save_load_and_bad_files(tmp_path):
    pred = TokenPredictor.train(synthetic(POP, tokens=100, top_k=2, locality=0.5, seed=0))
    path = pred.save(tmp_path / "p.predictor")
    back = TokenPredictor.load(path)
    assert back.layers == pred.layers and np.allclose(back.W, pred.W, atol=1e-5)
    (tmp_path / "junk").write_bytes(b"not safetensors")
    with pytest.raises(CoEError, match="not a token predictor"):
        TokenPredictor.load(tmp_path / "junk")
    with pytest.raises(CoEError, match="not found"):
        TokenPredictor.load(tmp_path / "missing")
    import json

    from safetensors.numpy import save_file
    arrays = {"W": pred.W.astype(np.float32), "b": pred.b.astype(np.float32)}
    for meta, says in (({"layers": "0,1", "top_k": 2}, "'layers' must be a list of layer numbers"),
                       ({"layers": list(pred.layers), "top_k": "two"}, "'top_k' must be an integer >= 1"),
                       ({"layers": list(pred.layers), "top_k": 0}, "'top_k' must be an integer >= 1")):
        save_file(arrays, str(tmp_path / "odd"), metadata={"coe": json.dumps(
            {"format": "coe-edge/moe-token-predictor", "features": "same-layer", **meta})})
        with pytest.raises(CoEError, match=f"odd: metadata {says}"):
            TokenPredictor.load(tmp_path / "odd")
    other = synthetic([[1, 1, 1, 1]] * 2, tokens=20, top_k=2, seed=0)
    with pytest.raises(CoEError, match="does not fit"):
        pred.evaluate(other)


def test_cli_trains_and_reports_held_out_recall(tmp_path):
    t = synthetic(POP, tokens=400, top_k=2, locality=0.7, seed=3)
    t = Trace(t.model, t.layers, t.top_k, t.scoring, t.probs, t.chosen,
              (np.arange(t.tokens) // 50).astype(np.int32), (np.arange(t.tokens) % 50).astype(np.int32))
    t.save(tmp_path / "t.trace")
    res = CliRunner().invoke(cli, ["llm", "train-predictor", "--trace", str(tmp_path / "t.trace"), "--out",
                                   str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert "top-2 guesses: precision" in res.output and "top-4 guesses" in res.output
    assert TokenPredictor.load(tmp_path / "p").layers == (0, 1, 2)


def test_only_confident_guesses_are_prefetched():
    from executors.moe_prefetch import TokenPrefetcher
    from storage.policies import make_policy
    from storage.pool import Pool
    from storage.tracesim import SizeSource

    trace = synthetic(POP, tokens=600, top_k=2, locality=0.8, seed=1)
    pred = TokenPredictor.train(trace)
    scores = trace.probs[10:11, 0, :].astype(np.float64)
    x = LiveInputs(pred).observe(trace.layers[0], scores)         # what a live prefetcher sees after this call
    p = pred.probabilities(0, x)[0]
    top = [int(e) for e in np.argsort(-p)[:4]]
    assert pred.confident(0, x, 4, 0.0) == top                            # no gate: the top-m, best first
    assert pred.confident(0, x, 4, 1.0) == []
    mid = float(np.sort(p)[-2])                                           # the second best's probability
    assert pred.confident(0, x, 4, mid) == top[:2] and all(p[e] >= mid for e in top[:2])

    ids = {layer: [f"m.L{layer:02d}.E{e:03d}" for e in range(trace.num_experts)] for layer in trace.layers}
    issued = {}
    for gate in (0.0, 1.0):
        pool = Pool("p", 100, make_policy("lru"), SizeSource({e: 1 for v in ids.values() for e in v}))
        tp = TokenPrefetcher(pred, ids, lambda _: pool, m=2, min_prob=gate)
        tp.on_router(trace.layers[0], scores, np.array([[0, 1]]))
        tp.drain()                       # close() drops guesses still queued; wait for them first
        tp.close()
        issued[gate] = (tp.stats.issued, set(pool.resident()))
    assert issued[0.0][0] == 2 and issued[0.0][1] == {ids[trace.layers[0]][e] for e in top[:2]}
    assert issued[1.0] == (0, set())                                      # nothing is sure enough: nothing read
    assert TokenPrefetcher.MIN_PROB == 0.5


def _decode_trace(tokens: int, locality: float, seed: int, cross: bool) -> Trace:
    """A synthetic decode trace of prompts of 50 tokens; with `cross`, layer 1's next experts are layer 0's now.

    The cross-layer rule is what 'freshest' inputs can see and 'same-layer' inputs cannot: token t+1 asks layer 1
    for the experts token t asked layer 0 for.
    """
    t = synthetic(POP, tokens=tokens, top_k=2, locality=locality, seed=seed)
    probs, chosen = t.probs.copy(), t.chosen.copy()
    if cross:
        probs[1:, 1, :], chosen[1:, 1, :] = t.probs[:-1, 0, :], t.chosen[:-1, 0, :]
    return Trace(t.model, t.layers, t.top_k, t.scoring, probs, chosen,
                 (np.arange(t.tokens) // 50).astype(np.int32), (np.arange(t.tokens) % 50).astype(np.int32))


def test_freshest_inputs_see_what_other_layers_said_and_same_layer_inputs_do_not():
    train, held = _decode_trace(800, 0.0, 1, cross=True), _decode_trace(400, 0.0, 2, cross=True)
    fresh = TokenPredictor.train(train, features="freshest")
    same = TokenPredictor.train(train, features="same-layer")
    assert fresh.features == "freshest" and fresh.W.shape == (3, 3 * 8, 8) and same.W.shape == (3, 8, 8)
    # layer index 1 of token t+1 repeats layer 0 of token t: only an input that holds layer 0 can know it
    x, y = (np.asarray(a) for a in __import__("routing.moe_predictor", fromlist=["pairs"]).pairs(held, 1, "freshest"))
    hit_fresh = np.take_along_axis(y, fresh.predict(1, x), axis=1).sum() / y.sum()
    xs, ys = __import__("routing.moe_predictor", fromlist=["pairs"]).pairs(held, 1, "same-layer")
    hit_same = np.take_along_axis(ys, same.predict(1, xs), axis=1).sum() / ys.sum()
    assert hit_fresh > 0.9 and hit_same < 0.6, (hit_fresh, hit_same)
    assert fresh.evaluate(held)["recall"] > same.evaluate(held)["recall"]


def test_live_inputs_match_the_training_inputs_of_the_same_tokens():
    trace = _decode_trace(120, 0.5, 3, cross=False)
    pred = TokenPredictor.train(trace, features="freshest")
    live = LiveInputs(pred)
    for row in range(0, 50):                    # one prompt, token by token, every layer in order
        for j, layer in enumerate(trace.layers):
            got = live.observe(layer, trace.probs[row:row + 1, j, :])
            want = inputs(trace, np.array([row]), j, "freshest")
            assert np.allclose(got, want), (row, j)
    assert live.observe(99, trace.probs[0:1, 0, :]) is None          # a layer the predictor does not know


def test_an_older_same_layer_file_still_loads_and_predicts(tmp_path):
    from safetensors.numpy import save_file

    pred = TokenPredictor.train(synthetic(POP, tokens=200, top_k=2, locality=0.6, seed=0), features="same-layer")
    meta = {"coe": __import__("json").dumps({"format": "coe-edge/moe-token-predictor", "layers": [0, 1, 2],
                                              "top_k": 2})}
    W = np.stack([pred.W[j] / pred.sd[j][:, None] for j in range(3)])      # fold the standardisation in
    b = np.stack([pred.b[j] - (pred.mu[j] / pred.sd[j]) @ pred.W[j] for j in range(3)])
    save_file({"W": W.astype(np.float32), "b": b.astype(np.float32)}, str(tmp_path / "old"), metadata=meta)
    old = TokenPredictor.load(tmp_path / "old")
    assert old.features == "same-layer" and old.mu is None
    x = inputs(synthetic(POP, tokens=20, top_k=2, seed=5), np.arange(10), 0, "same-layer")
    assert np.allclose(old.scores(0, x), pred.scores(0, x), atol=1e-3)
    bad = {"W": np.zeros((3, 5, 8), np.float32), "b": np.zeros((3, 8), np.float32)}
    save_file(bad, str(tmp_path / "bad"), metadata=meta)
    with pytest.raises(CoEError, match="need 8 rows per layer"):
        TokenPredictor.load(tmp_path / "bad")


def test_training_picks_the_inputs_that_validate_better():
    from routing.moe_predictor import choose_features, validation_split

    cross = _decode_trace(800, 0.0, 1, cross=True)            # layers tell about each other: freshest wins
    assert choose_features(cross) == "freshest" and TokenPredictor.train(cross).features == "freshest"
    alone = synthetic(POP, tokens=600, top_k=2, locality=0.8, seed=1)   # independent layers: the extra is noise
    assert choose_features(alone) == "same-layer"
    fit, val = validation_split(cross)
    assert set(np.unique(fit.seq)).isdisjoint(np.unique(val.seq)) and len(fit.seq) + len(val.seq) == len(cross.seq)
    fit1, val1 = validation_split(alone)                        # one prompt: split by position
    assert fit1.step.max() < val1.step.min()


def test_guesses_awaiting_their_use_are_evicted_last_and_scored_when_their_layer_runs():
    """A prefetched guess is not undone by the next load before its token comes (moe_prefetch.expected)."""
    from executors.moe_prefetch import TokenPrefetcher
    from storage.policies import PoolState, Resident, make_policy
    from storage.pool import Pool
    from storage.tracesim import SizeSource

    residents = tuple(Resident(f"e{i}", 1, i, i) for i in range(4))        # e0 is the oldest and least used
    for name in ("lru", "fifo", "lfu", "gate-score", "probability", "predicted"):
        plain = make_policy(name).choose_victims(PoolState(4, residents), 1)
        kept = make_policy(name).choose_victims(PoolState(4, residents, expected=frozenset(plain)), 1)
        assert kept and kept != plain and not set(kept) & set(plain), name     # the guess stays, another goes
        everything = frozenset(r.expert_id for r in residents)
        assert make_policy(name).choose_victims(PoolState(4, residents, expected=everything), 1) == plain

    trace = synthetic(POP, tokens=600, top_k=2, locality=0.8, seed=1)
    pred = TokenPredictor.train(trace, features="same-layer")
    ids = {layer: [f"m.L{layer:02d}.E{e:03d}" for e in range(trace.num_experts)] for layer in trace.layers}
    pool = Pool("p", 100, make_policy("lru"), SizeSource({e: 1 for v in ids.values() for e in v}))
    tp = TokenPrefetcher(pred, ids, lambda _: pool, m=2, min_prob=0.0)
    layer = trace.layers[0]
    scores = trace.probs[10:11, 0, :]
    tp.on_router(layer, scores, np.array([[0, 1]]))
    tp.drain()
    tp.close()
    assert tp.asked() == {ids[layer][0], ids[layer][1]}      # what the layer asked for is kept last too
    tp.asking(trace.layers[1], [7])                  # until the next layer routes (its E007): the guesses apart
    guessed = set(tp.expected()) - tp.asked()
    assert len(guessed) == 2 and guessed <= set(ids[layer]) and guessed == set(pool.resident())
    loaded = sorted(int(g[-3:]) for g in guessed)
    tp._score(layer, {loaded[0]})                    # the next token's layer runs and asks for one of the two
    assert tp.expected() == tp.asked() and tp.stats.useful == 1 and tp.stats.issued == 2


def test_what_a_layer_just_asked_for_is_not_the_victim_of_a_guess_issued_from_its_router_call():
    """The guess is issued from the router call, before the layer pins its experts: the prefetch's eviction must
    not take one of those (it did, and the layer read it straight back); with no other room it is dropped."""
    from executors.moe_prefetch import TokenPrefetcher
    from storage.policies import make_policy
    from storage.pool import Pool
    from storage.tracesim import SizeSource

    trace = synthetic(POP, tokens=600, top_k=2, locality=0.8, seed=1)
    pred = TokenPredictor.train(trace, features="same-layer")
    layer = trace.layers[0]
    ids = {l: [f"m.L{l:02d}.E{e:03d}" for e in range(trace.num_experts)] for l in trace.layers}
    sizes = SizeSource({e: 1 for v in ids.values() for e in v})
    for asked in ([], [0], [0, 1]):
        pool = Pool("p", 2, make_policy("lru"), sizes)
        for e in (0, 1):                              # E000 is the least recently used of the two residents
            pool.release(pool.acquire(ids[layer][e]))
        tp = TokenPrefetcher(pred, ids, lambda _: pool, m=2, min_prob=0.0)
        try:
            tp.asking(layer, np.array([asked]))       # the layer's router chose these; its wave has not pinned them
            tp._issue(layer, {2})                     # a guess for the next token: room for it means a victim
            tp.drain()
        finally:
            tp.close()
        kept = set(pool.resident())
        if len(asked) < 2:                            # LRU alone takes E000; held out, E001 goes instead
            assert kept == {ids[layer][2], ids[layer][1 if not asked else 0]} and tp.stats.dropped == 0
        else:                                         # both held out: no room, the guess is dropped, nothing evicted
            assert kept == {ids[layer][0], ids[layer][1]} and tp.stats.dropped == 1
    # the router call itself records what the layer asked for; the next layer's call replaces it; a prefill's
    # call holds nothing (no guess comes from it); a router's padding index (E) is not an expert
    tp = TokenPrefetcher(pred, ids, lambda _: pool, m=2, min_prob=1.0)     # min_prob 1: no guess is ever read
    try:
        tp.on_router(layer, trace.probs[10:11, 0, :], np.array([[3, 5]]))
        assert tp.asked() == {ids[layer][3], ids[layer][5]}
        nxt = trace.layers[1]
        tp.on_router(nxt, trace.probs[10:11, 1, :], np.array([[4, trace.num_experts]]))
        assert tp.asked() == {ids[nxt][4]}
        assert tp.expected() == tp.asked()            # ranked last in every tier too (a host tier takes no keep)
        tp.on_router(layer, trace.probs[10:16, 0, :], np.repeat(np.array([[3, 5]]), 6, axis=0))
        assert tp.asked() == frozenset()
    finally:
        tp.close()
    import torch

    from executors.moe_prefetch import NextLayerPrefetcher

    routers = {l: torch.nn.Linear(4, trace.num_experts, bias=False) for l in trace.layers}
    nl = NextLayerPrefetcher(routers, ids, 2, lambda _: pool)
    try:                                              # the next-layer prefetch records it as its layer starts
        nl.observe(layer, [1, 6])
        assert nl.asked() == {ids[layer][1], ids[layer][6]}
        nl.forget(layer)                              # a prefill through the layer
        assert nl.asked() == frozenset()
    finally:
        nl.close()


def test_a_prefill_leaves_the_later_layers_uniform_as_training_does_and_two_prompts_still_validate(tmp_path,
                                                                                                    monkeypatch):
    from routing import moe_predictor
    from routing.moe_predictor import _next_pairs, choose_features, validation_split

    trace = _decode_trace(120, 0.5, 3, cross=False)                   # prompts of 50 tokens: step 0 is the prompt
    pred = TokenPredictor.train(trace, features="freshest")
    live = LiveInputs(pred)
    for j, layer in enumerate(trace.layers):                          # a previous prompt's decode left its scores
        live.observe(layer, trace.probs[70:71, j, :])
    prompt = np.flatnonzero(trace.step == 0)[:1]                      # a one-token prompt, as a prefill of 2 rows
    got = live.observe(trace.layers[0], np.repeat(trace.probs[prompt, 0, :], 2, axis=0))
    assert np.allclose(got, inputs(trace, prompt, 0, "freshest"))    # layers after 0: uniform, not the old prompt
    two = trace.rows(np.flatnonzero(trace.seq <= 1))                   # two prompts: each part gets one
    fit, val = validation_split(two)
    assert len(np.unique(fit.seq)) == 1 and len(np.unique(val.seq)) == 1
    assert len(_next_pairs(fit)) > 0 and len(_next_pairs(val)) > 0   # each part has decode pairs to learn and score
    trained = []
    real_train = TokenPredictor.train.__func__

    def counting(cls, tr, **kw):
        trained.append(kw.get("features"))
        return real_train(cls, tr, **kw)
    monkeypatch.setattr(moe_predictor.TokenPredictor, "train", classmethod(counting))
    choose_features(two)
    assert sorted(trained) == sorted(moe_predictor.FEATURES)         # validated both inputs, not a fallback
    monkeypatch.undo()
    from safetensors.numpy import save_file
    half = {"W": pred.W.astype(np.float32), "b": pred.b.astype(np.float32), "mu": pred.mu.astype(np.float32)}
    save_file(half, str(tmp_path / "half"), metadata={"coe": __import__("json").dumps(
        {"format": "coe-edge/moe-token-predictor", "layers": list(pred.layers), "top_k": 2, "features": "freshest"})})
    with pytest.raises(CoEError, match="one of mu and sd"):
        TokenPredictor.load(tmp_path / "half")


def test_a_predictor_holding_nan_weights_is_refused_naming_them(tmp_path):
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    pred = TokenPredictor.train(synthetic(POP, tokens=100, top_k=2, locality=0.5, seed=0))
    path = pred.save(tmp_path / "p.pred")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    arrays = load_file(str(path))
    arrays["W"] = np.full_like(arrays["W"], np.nan)
    save_file(arrays, str(tmp_path / "nan.pred"), metadata=meta)
    with pytest.raises(CoEError, match=r"nan\.pred: W holds NaN or infinite values"):
        TokenPredictor.load(tmp_path / "nan.pred")


def test_a_predictor_for_another_top_k_does_not_fit():
    pred = TokenPredictor.train(synthetic(POP, tokens=100, top_k=2, locality=0.5, seed=0))
    pred.fits(pred.layers, 8, "m", 2)
    with pytest.raises(CoEError, match=r"top-2\) does not fit model 'm' \(layers \[0, 1, 2\], 8 experts, top-3\)"):
        pred.fits(pred.layers, 8, "m", 3)


def test_inputs_of_the_wrong_shape_are_named_not_misread():
    """Scores [2, E/2] were read as one token of E; a wrong input width gave numpy's matmul error; an unknown
    layer index a bare IndexError."""
    pred = TokenPredictor.train(synthetic(POP, tokens=200, top_k=2, locality=0.8, seed=1), features="same-layer")
    E = pred.num_experts
    live = LiveInputs(pred)
    with pytest.raises(CoEError, match=rf"router scores of shape \[2, {E // 2}\], expected \[tokens, {E}\]"):
        live.observe(pred.layers[0], np.full((2, E // 2), 1 / E))
    with pytest.raises(CoEError, match=rf"inputs of shape \[1, {E + 1}\], expected \[tokens, {E}\]"):
        pred.scores(0, np.zeros((1, E + 1)))
    with pytest.raises(CoEError, match="layer index 9 is not one of its"):
        pred.confident(9, np.zeros((1, E)))
    assert pred.scores(0, live.observe(pred.layers[0], np.full((1, E), 1 / E))).shape == (1, E)
