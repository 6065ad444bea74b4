"""Training the classifiers on synthetic frames: better than chance, reproducible, cached, and used by the agent."""
from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from click.testing import CliRunner

from coe import CoEError, parse_spec
from edge_agent.cli import cli
from edge_agent.zoo_train import MARKER, train_classifiers
from storage.expert_store import ExpertStore

from conftest import TINY_SPEC, write_line

MODEL = parse_spec(TINY_SPEC)
CLASSIFIERS = [e for e in MODEL.experts.values() if e.kind == "classifier"]


def test_classifiers_learn_the_drawn_labels_and_a_second_run_keeps_them(tmp_path):
    store = ExpertStore(tmp_path)
    first = train_classifiers(MODEL, store, steps=40, batch=16, seed=0)
    assert len(first) == 1 and not first[0].skipped
    assert sorted(first[0].experts) == sorted(e.id for e in CLASSIFIERS)
    assert first[0].heldout_accuracy > 0.5                       # four labels: chance is 0.25
    shas = {e.id: store.entry(e.id).sha256 for e in CLASSIFIERS}
    w = [store.read(e.id) for e in CLASSIFIERS]
    assert all(torch.equal(w[0][k], x[k]) for x in w[1:] for k in w[0])   # one network for the group
    marker = json.loads((tmp_path / MARKER).read_text())
    assert set(marker) == set(shas) and all(m["sha256"] == shas[k] for k, m in marker.items())
    again = train_classifiers(MODEL, store, steps=40, batch=16, seed=0)
    assert again[0].skipped and {e.id: store.entry(e.id).sha256 for e in CLASSIFIERS} == shas
    other = train_classifiers(MODEL, store, steps=41, batch=16, seed=0)   # another recipe: trained again
    assert not other[0].skipped and store.entry(CLASSIFIERS[0].id).version == 2


def test_training_is_reproducible(tmp_path):
    a = train_classifiers(MODEL, ExpertStore(tmp_path / "a"), steps=5, batch=8, seed=3)
    b = train_classifiers(MODEL, ExpertStore(tmp_path / "b"), steps=5, batch=8, seed=3)
    wa = ExpertStore(tmp_path / "a").read(CLASSIFIERS[0].id)
    wb = ExpertStore(tmp_path / "b").read(CLASSIFIERS[0].id)
    assert a[0].heldout_accuracy == b[0].heldout_accuracy and all(torch.equal(wa[k], wb[k]) for k in wa)
    train_classifiers(MODEL, ExpertStore(tmp_path / "c"), steps=5, batch=8, seed=4)
    wc = ExpertStore(tmp_path / "c").read(CLASSIFIERS[0].id)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)      # the seed decides: another seed, other weights


def test_classes_the_frames_cannot_show_are_refused():
    spec = json.loads(json.dumps(TINY_SPEC))
    spec["experts"][0]["classes"] = ["ok", "scratched"]
    spec["experts"][0]["priors"] = {"ok": 0.9, "scratched": 0.1}
    with pytest.raises(CoEError, match="classes \\['scratched'\\] are not drawn"):
        train_classifiers(parse_spec(spec), None)


def test_the_cli_trains_and_reports(tmp_path, tiny_zoo):
    import shutil

    shutil.copytree(tiny_zoo, tmp_path / "store")
    config = write_line(tmp_path / "line", store=tmp_path / "store")
    args = ["zoo", "train", "--config", str(config), "--steps", "20", "--batch", "8", "--detector-steps", "2"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert "torchvision/mobilenet_v3_small: 4 classifier(s), 4 component type(s), trained 20 steps in " in res.output
    assert re.search(r"det-2term \(ultralytics/yolov8n\): 3 component type\(s\), trained 2 steps in \d+ s; held-out "
                     r"recall at IoU 0.5", res.output) and "false alarms on clean parts" in res.output
    store = ExpertStore(yaml.safe_load(config.read_text())["expert_store"])
    assert all(store.entry(e.id).version == 2 for e in CLASSIFIERS)   # written over the generated zoo
    assert store.entry("det-ic").version == 2
    res = CliRunner().invoke(cli, args)
    assert res.output.count("kept (already trained)") == 3            # one classifier group, two detectors
    res = CliRunner().invoke(cli, args[:-1] + ["-1"])
    assert res.exit_code != 0 and "--detector-steps" in res.output and "must be 0 or more" in res.output


def test_the_demo_rebuilds_an_expert_the_spec_now_gives_another_arch(tmp_path, tiny_zoo):
    import shutil

    from edge_agent.config import load_config
    from edge_agent.demo import ensure_zoo

    shutil.copytree(tiny_zoo, tmp_path / "store")
    config = write_line(tmp_path / "line", store=tmp_path / "store")
    spec = json.loads(json.dumps(TINY_SPEC))
    spec["experts"][-1]["arch"] = "ultralytics/yolov8s"        # det-ic changed architecture since the zoo was built
    store = ensure_zoo(load_config(config), parse_spec(spec), quiet=True)
    assert store.entry("det-ic").arch == "ultralytics/yolov8s"
    assert store.entry("det-2term").arch == "ultralytics/yolov8n"   # the rest is kept as it was


def test_a_spec_that_reorders_the_classes_retrains_instead_of_swapping_labels(tmp_path):
    store = ExpertStore(tmp_path)
    assert not train_classifiers(MODEL, store, steps=3, batch=8, seed=0)[0].skipped
    spec = json.loads(json.dumps(TINY_SPEC))
    for e in spec["experts"]:
        if e["kind"] == "classifier":
            e["classes"] = list(reversed(e["classes"]))        # same labels, other output order
    again = train_classifiers(parse_spec(spec), store, steps=3, batch=8, seed=0)
    assert not again[0].skipped and store.entry(CLASSIFIERS[0].id).version == 2


def test_a_group_stops_once_its_validation_draw_is_good_enough_without_changing_its_batches():
    from edge_agent.zoo_train import train_group

    e = CLASSIFIERS[0]
    comps = [c.name for c in MODEL.components.values() if c.classifier in {x.id for x in CLASSIFIERS}]
    args = (e.arch, e.classes, e.input_size, comps)
    _, _, ran = train_group(*args, steps=6, batch=8, seed=0, until=0.0, check_every=2)
    assert ran == 2                                                  # any accuracy is >= 0: the first check stops it
    never, _, ran = train_group(*args, steps=6, batch=8, seed=0, until=1.01, check_every=2)
    plain, _, plain_ran = train_group(*args, steps=6, batch=8, seed=0)
    assert ran == plain_ran == 6
    # the checks draw and run on their own generators: the trained weights are those of a run without them
    assert all(torch.equal(a, b) for a, b in zip(never.state_dict().values(), plain.state_dict().values()))


def test_a_training_record_of_the_wrong_shape_is_named_not_an_attribute_error(tmp_path):
    from coe import CoEError
    from edge_agent.zoo_train import MARKER, _read_marker
    from storage.expert_store import ExpertStore

    store = ExpertStore(tmp_path)
    for bad in ("[]", '{"cls-a": 3}'):
        (tmp_path / MARKER).write_text(bad)
        with pytest.raises(CoEError, match="unreadable training record .*expected an object of expert records"):
            _read_marker(store)
