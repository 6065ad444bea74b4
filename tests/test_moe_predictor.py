"""The token-wise expert predictor: it learns what a trace's next tokens ask for, and its files are checked."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from coe import CoEError
from edge_agent.cli import cli
from routing.moe_predictor import TokenPredictor
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
    x = trace.probs[10:11, 0, :].astype(np.float64)
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
        tp.on_router(trace.layers[0], x, np.array([[0, 1]]))
        tp.close()
        issued[gate] = (tp.stats.issued, set(pool.resident()))
    assert issued[0.0][0] == 2 and issued[0.0][1] == {ids[trace.layers[0]][e] for e in top[:2]}
    assert issued[1.0] == (0, set())                                      # nothing is sure enough: nothing read
    assert TokenPrefetcher.MIN_PROB == 0.5
