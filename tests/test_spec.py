"""The CoE model spec: validation, chain edges, usage probabilities, verdict decisions."""
from pathlib import Path

import pytest

from coe import SpecError, StepOutput, decide, load_spec, parse_spec

REPO = Path(__file__).resolve().parent.parent


def tiny(**over):
    raw = {"experts": [
        {"id": "c1", "arch": "torchvision/resnet18", "kind": "classifier", "classes": ["ok", "bad"],
         "priors": {"ok": 0.8, "bad": 0.2}, "next": {"ok": "d"}},
        {"id": "c2", "arch": "torchvision/resnet18", "kind": "classifier", "classes": ["ok", "bad"],
         "priors": {"ok": 0.5, "bad": 0.5}},
        {"id": "d", "arch": "ultralytics/yolov8n", "kind": "detector", "classes": ["bridge"], "input_size": 64},
    ], "components": [{"name": "R1", "classifier": "c1", "frequency": 3},
                      {"name": "R2", "classifier": "c2", "frequency": 1}]}
    raw.update(over)
    return raw


def test_demo_spec_shape():
    m = load_spec(REPO / "configs" / "specs" / "line-A.coe.yaml")
    classifiers = [e for e in m.experts.values() if e.kind == "classifier"]
    detectors = [e for e in m.experts.values() if e.kind == "detector"]
    assert len(m.components) >= 24 and len(classifiers) >= 24 and len(detectors) >= 3
    assert len({c.classifier for c in m.components.values()}) == len(m.components)  # one classifier each
    assert all(len(m.preliminaries(d.id)) >= 2 for d in detectors)  # detectors are shared


def test_usage_probabilities_follow_frequencies_and_priors():
    m = parse_spec(tiny())
    uses = m.expected_uses()
    assert uses["c1"] == pytest.approx(0.75) and uses["c2"] == pytest.approx(0.25)
    assert uses["d"] == pytest.approx(0.75 * 0.8)
    p = m.usage_probabilities()
    assert sum(p.values()) == pytest.approx(1.0)
    assert p["d"] == pytest.approx(0.6 / 1.6)
    assert m.preliminaries("d") == ["c1"]


def test_chain_decisions():
    m = parse_spec(tiny())
    assert decide(m, "c1", StepOutput("ok", 0.9)).next_expert == "d"
    bad = decide(m, "c1", StepOutput("bad", 0.7))
    assert bad.verdict == "defect" and "bad" in bad.reason
    assert decide(m, "c2", StepOutput("ok", 0.9)).verdict == "pass"
    assert decide(m, "d", StepOutput(boxes=())).verdict == "pass"
    found = decide(m, "d", StepOutput(boxes=((1, 2, 3, 4, 0.8, "bridge"),)))
    assert found.verdict == "defect" and "bridge" in found.reason
    silent = decide(m, "c2", StepOutput())          # a classifier that gave no label: nobody judged the frame
    assert silent.verdict == "error" and silent.reason == "c2: the classifier gave no label"


@pytest.mark.parametrize("mutate,key", [
    (lambda r: r["experts"][0].update(kind="ranker"), "experts[0].kind"),
    (lambda r: r["experts"][0].update(next={"ok": "ghost"}), "experts[0].next.ok"),
    (lambda r: r["experts"][0].update(next={"meh": "d"}), "experts[0].next.meh"),
    (lambda r: r["experts"][0].update(priors={"ok": 0.5, "bad": 0.2}), "experts[0].priors"),
    (lambda r: r["experts"][2].update(input_size=100), "experts[2].input_size"),
    (lambda r: r["experts"][1].update(id="c1"), "experts[1].id"),
    (lambda r: r["experts"][0].pop("arch"), "experts[0].arch"),
    (lambda r: r["components"][0].update(classifier="d"), "components[0].classifier"),
    (lambda r: r["components"][0].update(frequency=-1), "components[0].frequency"),
    (lambda r: r["components"][0].update(frequency=float("nan")), "components[0].frequency"),
    (lambda r: r["components"][0].update(frequency=float("inf")), "components[0].frequency"),
    (lambda r: r["components"][1].update(name="R1"), "components[1].name"),
    (lambda r: r.update(colour="blue"), "colour"),
])
def test_invalid_specs_name_the_key(mutate, key):
    raw = tiny()
    mutate(raw)
    with pytest.raises(SpecError) as ei:
        parse_spec(raw, "spec.yaml")
    assert ei.value.key == key and str(ei.value).startswith("spec.yaml: key")


def test_cycles_are_refused():
    raw = tiny()
    raw["experts"][2] = {"id": "d", "arch": "torchvision/resnet18", "kind": "classifier", "classes": ["ok"],
                         "next": {"ok": "c1"}}
    with pytest.raises(SpecError, match="cycle"):
        parse_spec(raw)
