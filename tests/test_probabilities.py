"""Usage probabilities: from the spec, from counts, compared, saved and loaded; a large seeded sample agrees."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from coe import CoEError, parse_spec
from coe import probabilities as P
from routing import RuleRouter
from routing.train import sample_probabilities
from storage.recording import RecordedFrame

from conftest import TINY_SPEC


@pytest.fixture(scope="module")
def model():
    return parse_spec(TINY_SPEC)


class Headers:
    """Just the manifest side of a recording (no images): what a rule-routed sample run reads."""

    def __init__(self, frames: list[RecordedFrame]) -> None:
        self.frames = frames
        self.manifest = Path("<headers>")

    def __len__(self) -> int:
        return len(self.frames)

    def __iter__(self):
        return iter(self.frames)


def synthetic_headers(model, n: int, seed: int, *, with_truth: bool) -> Headers:
    """`n` frames whose component follows the spec's frequencies and whose truth follows the priors."""
    rng = np.random.default_rng(seed)
    names = list(model.components)
    freq = np.array([model.components[c].frequency for c in names])
    frames = []
    for i, ci in enumerate(rng.choice(len(names), size=n, p=freq / freq.sum())):
        comp = names[ci]
        expert = model.experts[model.components[comp].classifier]
        truth = None
        if with_truth:
            truth = expert.classes[rng.choice(len(expert.classes), p=[expert.prior(c) for c in expert.classes])]
        header = {"v": 1, "frame_id": f"f{i}", "line": "T", "board_id": "b", "component": comp, "ts": float(i),
                  "encoding": "png"}
        frames.append(RecordedFrame(header=header, file=f"frames/f{i}.png", truth=truth))
    return Headers(frames)


def test_from_spec_walks_frequencies_through_the_chain(model):
    probs = P.from_spec(model)
    assert probs == model.usage_probabilities() and sum(probs.values()) == pytest.approx(1.0)
    steps = 1 + 0.7  # every frame runs its classifier; 'ok' (prior 0.7) goes on to a detector
    assert probs["cls-r0402"] == pytest.approx(4 / 12 / steps)
    assert probs["cls-u-soic8"] == pytest.approx(2 / 12 / steps)
    assert probs["det-2term"] == pytest.approx(0.7 * 10 / 12 / steps)
    assert probs["det-ic"] == pytest.approx(0.7 * 2 / 12 / steps)


def test_from_counts_normalises_and_keeps_unused_experts(model):
    assert P.from_counts({"a": 3, "b": 1, "c": 0}) == {"a": 0.75, "b": 0.25, "c": 0.0}
    with pytest.raises(ValueError, match="no expert was used"):
        P.from_counts({"a": 0})
    with pytest.raises(ValueError, match="non-negative"):
        P.from_counts({"a": 2, "b": -1})


def test_compare_is_the_largest_absolute_difference_over_all_experts():
    assert P.compare({"a": 0.5, "b": 0.5}, {"a": 0.5, "b": 0.5}) == 0.0
    assert P.compare({"a": 0.6, "b": 0.4}, {"a": 0.5, "b": 0.45, "c": 0.05}) == pytest.approx(0.1)
    assert P.compare({"a": 1.0}, {"b": 1.0}) == 1.0


def test_save_load_round_trip(model, tmp_path):
    probs = P.from_spec(model)
    path = P.save(probs, tmp_path / "deep" / "probabilities.json", "spec tiny")
    assert P.load(path) == probs
    assert P.load_document(path) == ("spec tiny", probs)
    doc = json.loads(path.read_text())
    assert doc["source"] == "spec tiny" and set(doc["probabilities"]) == set(model.experts)
    assert [p.name for p in path.parent.iterdir()] == ["probabilities.json"]  # no temp file left behind


@pytest.mark.parametrize("text, match", [
    ("not json", "unreadable"),
    ('{"probabilities": {"a": 0.5}}', "sum to 1"),
    ('{"probabilities": {"a": 1.5, "b": -0.5}}', r"in \[0, 1\]"),
    ('{"source": "x"}', "'probabilities' mapping"),
])
def test_load_rejects_malformed_files_naming_the_file(tmp_path, text, match):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(CoEError, match=match) as info:
        P.load(path)
    assert str(path) in str(info.value)
    with pytest.raises(CoEError, match="coe-agent probabilities"):
        P.load(tmp_path / "absent.json")


@pytest.mark.parametrize("with_truth", [True, False])
def test_a_large_seeded_sample_agrees_with_the_spec(model, with_truth):
    sample = sample_probabilities(RuleRouter(model), model, synthetic_headers(model, 4000, 11, with_truth=with_truth),
                                  rng_seed=3)
    assert set(sample) == set(model.experts) and sum(sample.values()) == pytest.approx(1.0)
    assert P.compare(sample, P.from_spec(model)) <= 0.02
    # and the comparison can tell a different workload apart: a line that only places R0402
    skewed = synthetic_headers(model, 4000, 11, with_truth=with_truth)
    for f in skewed.frames:
        f.header["component"] = "R0402"
    assert P.compare(sample_probabilities(RuleRouter(model), model, skewed, rng_seed=3), P.from_spec(model)) > 0.2


def test_sampling_is_seeded(model):
    rec = synthetic_headers(model, 500, 2, with_truth=False)
    router = RuleRouter(model)
    assert sample_probabilities(router, model, rec, 7) == sample_probabilities(router, model, rec, 7)
    assert sample_probabilities(router, model, rec, 7) != sample_probabilities(router, model, rec, 8)


def test_agent_pools_read_saved_probabilities(tmp_path, tiny_line):
    """`coe-agent probabilities` saves where the pools read them: the agent uses them over the spec's."""
    from coe import probabilities as probs
    from edge_agent.agent import Agent
    from edge_agent.config import load_config

    cfg = load_config(tiny_line, env={})
    model = parse_spec(TINY_SPEC)
    custom = {e: (0.5 if e == "cls-u-soic8" else 0.5 / (len(model.experts) - 1)) for e in model.experts}
    probs.save(custom, Path(cfg.data_dir) / "probabilities.json", source="test sample")
    agent = Agent(cfg)
    try:
        assert agent.probabilities == custom
        assert next(iter(agent.pools.values())).state().probabilities["cls-u-soic8"] == 0.5
    finally:
        agent.stop()
