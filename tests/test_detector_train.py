"""Training the detectors on drawn soldering defects: the right crops, a falling loss, honest scoring, a cache."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from coe import CoEError, parse_spec
from edge_agent.detector_train import DetectorScore, draw_batch, evaluate, plans, train_detector
from edge_agent.zoo_train import MARKER, train_detectors
from executors.backends.ultralytics_backend import UltralyticsBackend
from storage.expert_store import ExpertStore

from conftest import TINY_SPEC

MODEL = parse_spec(TINY_SPEC)


def _plan(det_id: str):
    return next(p for p in plans(MODEL) if p.expert.id == det_id)


def test_each_detector_learns_from_the_parts_its_classifiers_pass_to_it():
    two, ic = _plan("det-2term"), _plan("det-ic")
    assert set(two.components) == {"R0402", "C0402", "R0603"} and ic.components == ("U-SOIC8",)
    assert {d for _, d in two.pairs} == {"solder_bridge", "tombstone"}
    assert set(ic.pairs) == {("U-SOIC8", "solder_bridge"), ("U-SOIC8", "lifted_lead")}
    assert two.undrawable == () and ic.undrawable == ()


def test_a_class_that_cannot_be_drawn_is_refused_by_name():
    spec = json.loads(json.dumps(TINY_SPEC))
    spec["experts"][-1]["classes"] = ["solder_bridge", "cold_joint"]
    with pytest.raises(CoEError, match="expert 'det-ic'.*classes \\['cold_joint'\\] are not drawn"):
        plans(parse_spec(spec))


def test_a_class_no_part_of_the_detector_shows_is_reported_not_faked():
    spec = json.loads(json.dumps(TINY_SPEC))
    spec["experts"][-1]["classes"] = ["solder_bridge", "tombstone"]      # a SOIC cannot tombstone
    ic = next(p for p in plans(parse_spec(spec)) if p.expert.id == "det-ic")
    assert ic.undrawable == ("tombstone",) and {d for _, d in ic.pairs} == {"solder_bridge"}


def test_batches_hold_clean_crops_and_boxed_defects_of_the_detectors_classes():
    plan = _plan("det-2term")
    images, boxes = draw_batch(plan, np.random.default_rng(0), 64, 64)
    assert len(images) == 64 and all(i.shape == (64, 64, 3) for i in images)
    boxed = [b for b in boxes if b]
    assert 16 < len(boxed) < 48 and all(len(b) == 1 for b in boxed)                 # about half
    assert {plan.expert.classes[b[0][4]] for b in boxed} == {"solder_bridge", "tombstone"}


def test_a_short_training_finds_an_easy_defect_and_is_reproducible():
    plan = dataclasses.replace(_plan("det-2term"), components=("R0603",), pairs=(("R0603", "tombstone"),))
    untrained = evaluate(plan, UltralyticsBackend().init_weights(plan.expert, 1), seed=1, crops=64)
    a, losses = train_detector(plan, steps=40, batch=8, seed=1)
    trained = evaluate(plan, a, seed=1, crops=64)
    assert untrained.recall < 0.5 and trained.recall >= 0.8, (untrained.recall, trained.recall)
    assert trained.false_alarm_rate < 0.3
    b, again = train_detector(plan, steps=40, batch=8, seed=1)
    assert losses == again and all(torch.equal(a[k], b[k]) for k in a)


def test_scoring_counts_every_crop_and_an_untrained_detector_finds_little(tmp_path):
    plan = _plan("det-ic")
    tensors = UltralyticsBackend().init_weights(plan.expert, 0)
    score = evaluate(plan, tensors, seed=0, crops=64)
    assert isinstance(score, DetectorScore)
    assert score.clean + sum(score.drawn.values()) == 64
    assert set(score.drawn) <= {"solder_bridge", "lifted_lead"} and score.recall < 0.5


def test_train_detectors_writes_scores_and_keeps_a_current_training(tmp_path):
    store = ExpertStore(tmp_path)
    first = train_detectors(MODEL, store, steps=2, batch=4, seed=0)
    assert sorted(r.expert for r in first) == ["det-2term", "det-ic"] and not any(r.skipped for r in first)
    marker = json.loads((tmp_path / MARKER).read_text())
    for r in first:
        assert store.entry(r.expert).version == 1
        assert marker[r.expert]["sha256"] == store.entry(r.expert).sha256
        assert 0.0 <= r.heldout_recall <= 1.0 and set(r.recall_by_class) <= set(MODEL.experts[r.expert].classes)
    again = train_detectors(MODEL, store, steps=2, batch=4, seed=0)
    assert all(r.skipped for r in again) and [r.heldout_recall for r in again] == [r.heldout_recall for r in first]
    other = train_detectors(MODEL, store, steps=3, batch=4, seed=0)
    assert not any(r.skipped for r in other) and store.entry("det-ic").version == 2


def test_a_detector_stops_early_only_once_validation_says_so(monkeypatch):
    import edge_agent.detector_train as dt

    monkeypatch.setattr(dt, "CHECK_CROPS", 16)
    monkeypatch.setattr(dt, "MAX_FALSE_ALARMS", 1.0)       # a barely trained detector may box clean parts
    plan = _plan("det-ic")
    _, losses = train_detector(plan, steps=8, batch=4, seed=0, until=0.0, check_from=4, check_every=2)
    assert len(losses) == 4                                  # recall >= 0 holds at the first check
    _, losses = train_detector(plan, steps=8, batch=4, seed=0, until=1.01, check_from=4, check_every=2)
    assert len(losses) == 8                                  # never good enough: every step runs
