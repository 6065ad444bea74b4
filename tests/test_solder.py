"""Soldering defects drawn with their boxes: visible where the box says, reproducible, refused where impossible."""
from __future__ import annotations

import json

import numpy as np
import pytest

from coe import parse_spec
from edge_agent.judge import true_verdict
from storage.recording import Recording
from storage.solder import MIN_BOX, SOLDER_DEFECTS, applicable, draw_solder_defect
from storage.synthetic import draw_component, record_synthetic

from conftest import TINY_SPEC

PARTS = ("R0402", "C0201", "D-SOD123", "LED0603", "Q-SOT23", "U-SOIC8", "U-QFP64", "X-HC49", "J-USBC")
PAIRS = [(c, d) for c in PARTS for d in applicable(c)]


def test_each_family_gets_the_defects_it_can_show():
    assert applicable("R0402") == ("solder_bridge", "tombstone", "insufficient_solder")
    assert applicable("D-SOD123") == ("solder_bridge", "tombstone", "insufficient_solder", "lifted_lead",
                                      "polarity_mark")
    assert applicable("Q-SOT23") == ("solder_bridge", "insufficient_solder", "lifted_lead")
    assert applicable("U-SOIC8") == ("solder_bridge", "insufficient_solder", "lifted_lead", "polarity_mark")
    assert "tombstone" not in applicable("X-HC49") and "lifted_lead" not in applicable("X-HC49")
    # a QFN is a no-lead package: its terminals sit under the body's edge, so none can lift; a QFP's can
    assert applicable("U-QFN32") == ("solder_bridge", "insufficient_solder", "polarity_mark")
    assert "lifted_lead" in applicable("U-QFP64")
    assert set().union(*(applicable(c) for c in PARTS)) == set(SOLDER_DEFECTS)


@pytest.mark.parametrize("component,defect", PAIRS)
def test_the_defect_changes_the_picture_inside_its_box(component, defect):
    img, (x0, y0, x1, y1) = draw_solder_defect(component, defect, np.random.default_rng(5), 64)
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64
    assert min(x1 - x0, y1 - y0) >= MIN_BOX * 64 * 0.9            # the part's scale jitters by 5%
    # the same generator draws the same part in the same place; only the defect (and the noise) differ
    ok = draw_component(component, "ok", np.random.default_rng(5), 64)
    strong = np.abs(img.astype(np.int16) - ok.astype(np.int16)).sum(axis=2) > 90
    inside = np.zeros_like(strong)
    inside[max(int(y0) - 1, 0):int(np.ceil(y1)) + 1, max(int(x0) - 1, 0):int(np.ceil(x1)) + 1] = True
    assert strong[inside].sum() >= 3, (component, defect)
    # a reversed part's mark also leaves its old place, outside the box; every other change is inside it
    share = 0.4 if defect == "polarity_mark" else 0.9
    assert strong[inside].sum() >= share * strong.sum(), (component, defect)


def test_drawing_is_reproducible():
    a = draw_solder_defect("U-SOIC8", "lifted_lead", np.random.default_rng(9))
    b = draw_solder_defect("U-SOIC8", "lifted_lead", np.random.default_rng(9))
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    c = draw_solder_defect("U-SOIC8", "lifted_lead", np.random.default_rng(10))
    assert not np.array_equal(a[0], c[0])          # the generator draws it: another seed, another picture


def test_impossible_requests_are_refused_by_name():
    with pytest.raises(ValueError, match="cannot draw tombstone on U-SOIC8 \\(it can show: solder_bridge"):
        draw_solder_defect("U-SOIC8", "tombstone", np.random.default_rng(0))
    with pytest.raises(ValueError, match="defect must be one of solder_bridge"):
        draw_solder_defect("R0402", "cold_joint", np.random.default_rng(0))
    with pytest.raises(ValueError, match="a scene is drawn on an ok part"):
        draw_component("R0402", "missing", np.random.default_rng(0), scene=lambda fp: None)


def test_a_recording_with_solder_defects_names_them_as_truth(tmp_path):
    model = parse_spec(TINY_SPEC)
    plain = record_synthetic(model, tmp_path / "plain", 60, line="T", seed=2)
    zero = record_synthetic(model, tmp_path / "zero", 60, line="T", seed=2, solder_rate=0.0)
    assert (plain / "manifest.jsonl").read_bytes() == (zero / "manifest.jsonl").read_bytes()
    rec = record_synthetic(model, tmp_path / "solder", 60, line="T", seed=2, solder_rate=1.0)
    frames = list(Recording(rec))
    truths = {f.header["component"]: set() for f in frames}
    for f in frames:
        truths[f.header["component"]].add(f.truth)
    # every ok part became a defect its detector knows and the part can show
    assert all("ok" not in t for t in truths.values())
    assert truths["U-SOIC8"] <= {"missing", "misaligned", "wrong_part", "solder_bridge", "lifted_lead"}
    assert truths["R0402"] <= {"missing", "misaligned", "wrong_part", "solder_bridge", "tombstone"}
    solder = [f for f in frames if f.truth in SOLDER_DEFECTS]
    assert solder and all(true_verdict(model, f.header["component"], f.truth) == "defect" for f in solder)
    assert true_verdict(model, "R0402", "lifted_lead") is None      # det-2term cannot say it: not judged


@pytest.mark.parametrize("rate", [-0.1, 1.5, "half", True])
def test_a_bad_solder_rate_is_refused(tmp_path, rate):
    with pytest.raises(ValueError, match="solder_rate must be a number in 0..1"):
        record_synthetic(parse_spec(TINY_SPEC), tmp_path / "r", 5, line="T", solder_rate=rate)


def test_truth_of_a_spec_whose_detector_is_not_drawn_is_judged_by_its_classes():
    spec = json.loads(json.dumps(TINY_SPEC))
    spec["experts"][-1]["classes"] = ["cold_joint"]
    model = parse_spec(spec)
    assert true_verdict(model, "U-SOIC8", "cold_joint") == "defect"
    assert true_verdict(model, "U-SOIC8", "ok") == "pass"
