"""Routing: rule and learned routers give correct chains; unsure frames fall back or are rejected, never guessed.

The learned router is trained once per module on a small synthetic recording of
the tiny spec (4 component types, 32 px) and scored on a recording with another
seed.  Fallback and reject paths use a stub network whose confidence is set
exactly, so they do not depend on what training happened to learn.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from coe import CoEError, StepOutput, parse_spec
from coe import probabilities as P
from routing import Route, RouteError, RuleRouter
from routing.learned import ROUTER_ARCH, ROUTER_ID, LearnedRouter
from routing.train import (decode_frame, evaluate_router, load_frames, plot_confusion, sample_probabilities,
                           train_router)
from storage.expert_store import ExpertStore
from storage.recording import Recording, RecordingWriter
from storage.synthetic import encode_image, record_synthetic

from conftest import TINY_SPEC, write_line

DETECTOR_OF = {"R0402": "det-2term", "C0402": "det-2term", "R0603": "det-2term", "U-SOIC8": "det-ic"}


@pytest.fixture(scope="module")
def model():
    return parse_spec(TINY_SPEC)


@pytest.fixture(scope="module")
def recs(model, tmp_path_factory) -> dict[str, Recording]:
    root = tmp_path_factory.mktemp("router-recs")
    return {
        # training frames carry the type only as truth_component, as a line without headers would
        "train": Recording(record_synthetic(model, root / "train", 600, line="T", seed=1, size=32,
                                            omit_component=True)),
        # held out: another seed, so other boards and other pixels; headers name the component
        "test": Recording(record_synthetic(model, root / "test", 300, line="T", seed=2, size=32)),
    }


@pytest.fixture(scope="module")
def trained(model, recs, tmp_path_factory):
    net, classes, report = train_router(model, recs["train"], epochs=10, seed=0)
    store = ExpertStore(tmp_path_factory.mktemp("router-store"))
    LearnedRouter(model, net, classes, 32).save(store)
    return LearnedRouter.load(model, store), report, store


class Fixed(nn.Module):
    """A stand-in network whose softmax is exactly `probs` for every frame."""

    def __init__(self, probs: list[float]) -> None:
        super().__init__()
        self.logits = torch.log(torch.tensor(probs, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], -1)


def stub(model, probs, threshold=0.9) -> LearnedRouter:
    return LearnedRouter(model, Fixed(probs), list(model.components), 32, threshold=threshold)


def img(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (48, 48, 3), dtype=np.uint8)


def chain(model, first: str, labels: list[str]) -> list[str]:
    steps, eid = [first], first
    for lb in labels:
        eid = model.next_expert(eid, StepOutput(label=lb, score=1.0))
        if eid is None:
            break
        steps.append(eid)
    return steps


# -- correct chains ------------------------------------------------------------------------

def test_rule_router_starts_each_component_at_its_classifier_and_ok_reaches_its_detector(model):
    rules = RuleRouter(model)
    for comp, det in DETECTOR_OF.items():
        route = rules.route(comp)
        assert route == Route(f"cls-{comp.lower()}", 1.0, "rules", comp)
        assert chain(model, route.expert_id, ["ok", "ok"]) == [route.expert_id, det]
        assert chain(model, route.expert_id, ["missing"]) == [route.expert_id]


def test_learned_router_is_accurate_on_held_out_frames(trained, recs):
    router, report, _ = trained
    assert report.unseen == [] and report.frames == 600 and report.train_accuracy > 0.9
    ev = evaluate_router(router, recs["test"])
    assert ev.n == 300 and sum(map(sum, ev.confusion)) == 300
    assert ev.accuracy >= 0.9, ev.top_confusions()
    # where the part is on its pads the type is plain to see; a missing part shows only pads that R0402 and
    # C0402 share, which is why the overall figure is lower and why those frames must stay below threshold
    assert ev.accuracy_by_truth["ok"] >= 0.98
    assert ev.routed_accuracy >= 0.97 and ev.routed >= 0.7
    assert set(ev.per_class_recall) == set(DETECTOR_OF) and min(ev.per_class_recall.values()) >= 0.8


def test_learned_and_rule_routers_give_the_same_chains(trained, recs, model):
    router, _, _ = trained
    rules = RuleRouter(model)
    frames = recs["test"].frames
    images = [decode_frame(recs["test"], f) for f in frames]
    agree = confident = 0
    for frame, image in zip(frames, images):
        comp = frame.header["component"]
        try:
            learned = router.route(None, image)  # the header is hidden from the network's decision
        except RouteError as exc:
            assert exc.reason == "low_confidence"
            continue
        confident += 1
        truth = [frame.truth or "ok", "ok"]
        agree += chain(model, learned.expert_id, truth) == chain(model, rules.route(comp).expert_id, truth)
    assert confident >= 0.7 * len(frames)
    assert agree / confident >= 0.97


# -- below the threshold: fall back or reject, never guess -----------------------------------

def test_confident_prediction_routes_to_the_predicted_components_classifier(model):
    router = stub(model, [0.01, 0.95, 0.02, 0.02])  # C0402
    route = router.route(None, img())
    assert route.expert_id == "cls-c0402" and route.router == "learned"
    assert route.confidence == pytest.approx(0.95, abs=1e-6)


def test_threshold_is_inclusive(model):
    assert stub(model, [0.9, 0.05, 0.03, 0.02], threshold=0.875).route(None, img()).router == "learned"
    with pytest.raises(RouteError):
        stub(model, [0.9, 0.05, 0.03, 0.02], threshold=0.95).route(None, img())


def test_low_confidence_falls_back_to_the_rule_router_when_the_header_names_the_component(model):
    router = stub(model, [0.62, 0.3, 0.05, 0.03])  # unsure, and leaning to R0402
    route = router.route("U-SOIC8", img())
    assert route == Route("cls-u-soic8", 1.0, "rules-fallback", "U-SOIC8")


def test_low_confidence_without_a_component_is_rejected_with_the_reason(model):
    router = stub(model, [0.62, 0.3, 0.05, 0.03])
    with pytest.raises(RouteError) as info:
        router.route(None, img())
    assert info.value.reason == "low_confidence"
    assert info.value.detail == ("learned router is 0.62 sure of R0402 (threshold 0.90) "
                                 "and the header names no component")


def test_unknown_component_is_rejected_even_when_the_network_is_sure(model):
    router = stub(model, [0.99, 0.005, 0.003, 0.002])
    with pytest.raises(RouteError) as info:
        router.route("R9999", img())
    assert info.value.reason == "unknown_component" and "R9999" in info.value.detail


def test_an_unusable_image_is_a_bad_image_reject(model):
    router = stub(model, [0.99, 0.005, 0.003, 0.002])
    with pytest.raises(RouteError) as info:
        router.route(None, np.zeros((8, 8, 4), np.uint8))
    assert info.value.reason == "bad_image" and "(8, 8, 4)" in info.value.detail


def test_route_batch_equals_route_frame_by_frame(trained, recs):
    router, _, _ = trained
    frames = recs["test"].frames[:40]
    images = [decode_frame(recs["test"], f) for f in frames]
    comps = [f.header["component"] if i % 3 else None for i, f in enumerate(frames)]
    comps[5], images[7] = "NOPE", np.zeros((4, 4), np.float32)  # one unknown component, one unusable image
    router = LearnedRouter(router.model, router.net, router.classes, router.input_size, threshold=0.99)
    batch = router.route_batch(comps, images)
    assert len(batch) == 40
    kinds = set()
    for comp, image, got in zip(comps, images, batch):
        try:
            want: Route | RouteError = router.route(comp, image)
        except RouteError as exc:
            want = exc
        if isinstance(want, RouteError):
            assert isinstance(got, RouteError) and (got.reason, got.detail) == (want.reason, want.detail)
            kinds.add(want.reason)
        else:
            assert isinstance(got, Route) and (got.expert_id, got.router) == (want.expert_id, want.router)
            assert got.confidence == pytest.approx(want.confidence, abs=1e-5)
            kinds.add(want.router)
    assert {"unknown_component", "bad_image", "learned", "rules-fallback"} <= kinds
    with pytest.raises(ValueError):
        router.route_batch([None], [])


# -- storage ---------------------------------------------------------------------------------

def test_router_round_trips_through_the_expert_store(trained, recs, model):
    router, _, store = trained
    entry = store.entry(ROUTER_ID)
    assert entry.arch == ROUTER_ARCH and store.path(ROUTER_ID).suffix == ".safetensors"
    again = LearnedRouter.load(model, ExpertStore(store.root), threshold=0.5)
    images = [decode_frame(recs["test"], f) for f in recs["test"].frames[:16]]
    assert again.threshold == 0.5 and again.classes == router.classes and again.input_size == 32
    np.testing.assert_array_equal(again.probabilities(images), router.probabilities(images))


def test_load_fails_clearly_without_a_router_or_for_another_spec(model, trained, tmp_path):
    with pytest.raises(CoEError, match="holds no learned router.*router train"):
        LearnedRouter.load(model, ExpertStore(tmp_path / "empty"))
    _, _, store = trained
    bigger = dict(TINY_SPEC, components=[*TINY_SPEC["components"],
                                         {"name": "C0603", "classifier": "cls-c0402", "frequency": 1}])
    with pytest.raises(CoEError, match="cannot predict: C0603"):
        LearnedRouter.load(parse_spec(bigger), store)


# -- training ----------------------------------------------------------------------------------

def test_training_is_seeded_and_reports_each_epoch(model, recs, tmp_path):
    small = Recording(record_synthetic(model, tmp_path / "small", 40, line="T", seed=4, size=32))  # headers only
    seen = []
    a, classes, rep = train_router(model, small, epochs=2, seed=5, progress=seen.append)
    b, _, _ = train_router(model, small, epochs=2, seed=5)
    c, _, _ = train_router(model, small, epochs=2, seed=6)
    assert [s.epoch for s in seen] == [1, 2] and rep.history == seen and classes == list(model.components)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_training_refuses_frames_with_no_component_at_all(model, tmp_path):
    image = encode_image(np.zeros((32, 32, 3), np.uint8), "png")
    with RecordingWriter(tmp_path / "r") as w:
        w.add({"v": 1, "frame_id": "f1", "line": "T", "board_id": "b", "ts": 1.0, "encoding": "png"}, image, "png")
    with pytest.raises(CoEError, match="neither 'truth_component' nor 'component'"):
        load_frames(model, Recording(tmp_path / "r"))


def test_confusion_png_is_written(trained, recs, tmp_path):
    router, _, _ = trained
    out = plot_confusion(evaluate_router(router, recs["test"]), tmp_path / "sub" / "cm.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- sample probabilities ------------------------------------------------------------------------

def test_sample_probabilities_follow_the_truth_through_the_chain(model, tmp_path):
    image = encode_image(np.zeros((32, 32, 3), np.uint8), "png")
    with RecordingWriter(tmp_path / "r") as w:
        for i, (comp, truth) in enumerate([("R0402", "ok"), ("R0402", "ok"), ("U-SOIC8", "missing"),
                                           ("U-SOIC8", "ok")]):
            w.add({"v": 1, "frame_id": f"f{i}", "line": "T", "board_id": "b", "component": comp, "ts": 1.0 + i,
                   "encoding": "png"}, image, "png", truth=truth)
    probs = sample_probabilities(RuleRouter(model), model, Recording(tmp_path / "r"), rng_seed=0)
    # 4 classifier steps, 2 + 1 detector steps ('ok' continues to next['ok'], 'missing' ends the chain)
    assert probs == {"cls-r0402": 2 / 7, "cls-c0402": 0.0, "cls-r0603": 0.0, "cls-u-soic8": 2 / 7,
                     "det-2term": 2 / 7, "det-ic": 1 / 7}


def test_learned_sample_probabilities_match_the_rule_routed_ones(trained, recs, model):
    router, _, _ = trained
    by_rules = sample_probabilities(RuleRouter(model), model, recs["test"], rng_seed=0)
    by_net = sample_probabilities(router, model, recs["test"], rng_seed=0)
    assert P.compare(by_net, by_rules) <= 0.03
    unsure = stub(model, [0.4, 0.3, 0.2, 0.1])  # rejects every header-less frame
    guessed = sample_probabilities(unsure, model, recs["train"], rng_seed=0, count_unsure=True)
    assert guessed["cls-r0402"] > 0.5 and guessed["cls-c0402"] == 0.0  # every frame counted at its best guess
    with pytest.raises(CoEError, match="routed none"):
        sample_probabilities(unsure, model, recs["train"], rng_seed=0, count_unsure=False)


# -- CLI -------------------------------------------------------------------------------------------

def test_cli_train_eval_probabilities_on_real_files(model, recs, tmp_path):
    from edge_agent.cli import cli

    cfg = write_line(tmp_path / "line", store=tmp_path / "store")
    runner = CliRunner()
    res = runner.invoke(cli, ["router", "train", "--config", str(cfg), "--data", str(recs["train"].root),
                              "--epochs", "3", "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert "epoch   3/3" in res.output and "accuracy on the training data:" in res.output
    assert ExpertStore(tmp_path / "store").entry(ROUTER_ID).arch == ROUTER_ARCH

    png = tmp_path / "cm.png"
    res = runner.invoke(cli, ["router", "eval", "--config", str(cfg), "--data", str(recs["test"].root),
                              "--png", str(png)])
    assert res.exit_code == 0, res.output
    assert "top-1 accuracy:" in res.output and "recall" in res.output and "R0402" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = runner.invoke(cli, ["probabilities", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    default = tmp_path / "line" / "data" / "probabilities.json"
    assert P.load(default) == pytest.approx(P.from_spec(model))
    assert "det-2term" in res.output and "sample" not in res.output.splitlines()[0]

    out = tmp_path / "p.json"
    res = runner.invoke(cli, ["probabilities", "--config", str(cfg), "--data", str(recs["test"].root),
                              "--router", "rules", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "max |sample - spec| =" in res.output
    doc = json.loads(out.read_text())
    assert doc["source"].startswith("sample ") and "rules router" in doc["source"]
    assert P.compare(doc["probabilities"], P.from_spec(model)) < 0.1


def test_cli_errors_are_one_clear_line(recs, tmp_path):
    from edge_agent.cli import cli

    cfg = write_line(tmp_path / "line", store=tmp_path / "store")
    runner = CliRunner()
    res = runner.invoke(cli, ["router", "eval", "--config", str(cfg), "--data", str(recs["test"].root)])
    assert res.exit_code == 1 and "coe-agent router train" in res.output and "Traceback" not in res.output
    res = runner.invoke(cli, ["probabilities", "--config", str(cfg), "--data", str(recs["train"].root),
                              "--router", "rules"])
    assert res.exit_code == 1 and "cannot be rule-routed" in res.output


def _learned_line(tmp_path, tiny_zoo, threshold: float = 0.5):
    """A tiny line with `routing: learned` (a router trained here) and a held-out recording without components."""
    import shutil

    from conftest import write_line
    from edge_agent.config import load_config
    from routing import LearnedRouter
    from routing.train import train_router
    from storage.expert_store import ExpertStore
    from storage.recording import Recording
    from storage.synthetic import record_synthetic

    store_dir = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store_dir)
    model = parse_spec(TINY_SPEC)
    train = Recording(record_synthetic(model, tmp_path / "train", 400, line="T", seed=5, size=32,
                                       omit_component=True, boards_components=40))
    net, classes, _ = train_router(model, train, epochs=6, seed=0, input_size=32)
    store = ExpertStore(store_dir)
    LearnedRouter(model, net, classes, 32).save(store)
    cfg = load_config(write_line(tmp_path / "line", store=store_dir, routing={"mode": "learned",
                                                                            "threshold": threshold}), env={})
    test = Recording(record_synthetic(model, tmp_path / "test", 60, line="T", seed=6, size=32, omit_component=True,
                                      boards_components=20))
    return cfg, test


def test_agent_runs_end_to_end_with_learned_routing(tmp_path, tiny_zoo):
    """`routing: learned`: frames without a component are routed by the model, and every frame gets a verdict."""
    import sqlite3

    from edge_agent.agent import Agent
    from edge_agent.replay import replay as send

    cfg, test = _learned_line(tmp_path, tiny_zoo)
    agent = Agent(cfg).start()
    try:
        report = send(test, agent.endpoints["ingest"])
        assert report.accepted + report.rejected == len(test)
        assert report.accepted > 0.8 * len(test)
        assert set(report.reasons) <= {"low_confidence"}            # never anything silent
        assert agent.wait_verdicts(report.accepted, timeout=120)
    finally:
        agent.stop()
    con = sqlite3.connect(cfg.db_path)
    rows = dict(con.execute("SELECT frame_id, component FROM frames"))
    con.close()
    truth = {f.header["frame_id"]: f.truth_component for f in test}
    right = sum(rows[fid] == truth[fid] for fid in rows)
    assert right >= 0.8 * len(rows)                                 # routed to the right chain


def test_recovered_frames_keep_the_route_decided_when_they_were_accepted(tmp_path, tiny_zoo):
    """Frames journaled by a run that died before their verdicts, each with the component its learned route chose:
    the next start runs them on that component, even under a router that now refuses nearly every frame (threshold
    0.9999); before, it routed the whole backlog again and gave each refused frame an error verdict."""
    from conftest import db_rows
    from edge_agent import protocol as P
    from edge_agent.agent import Agent
    from storage.results import JournalEntry, ResultStore

    cfg, test = _learned_line(tmp_path, tiny_zoo, threshold=0.9999)
    frames = list(test)[:20]
    rs = ResultStore(cfg.db_path)
    rs.journal([JournalEntry(f.header["frame_id"], "T", f.header["board_id"], f.truth_component, f.header["ts"],
                             1.0, P.encode_header(f.header).decode(), test.payload(f)) for f in frames])
    rs.close()
    agent = Agent(cfg).start()
    try:
        assert agent.wait_verdicts(len(frames), timeout=120)
    finally:
        agent.stop()
    rows = db_rows(cfg.db_path, "SELECT frame_id, verdict, reason FROM verdicts")
    assert len(rows) == len(frames)
    assert not [r for r in rows if r[2].startswith("recovery:")], rows
    assert dict(db_rows(cfg.db_path, "SELECT frame_id, component FROM frames")) == {
        f.header["frame_id"]: f.truth_component for f in frames}


def test_a_frame_that_breaks_the_router_costs_only_itself_and_a_broken_router_asks_for_a_resend(trained, recs):
    """The read's forward pass raises: each frame is routed alone; the one that still breaks it is a bad image
    (the client fixes it), the others are routed.  When every frame breaks it, the router is at fault: 'busy'."""
    from coe import Frame
    from edge_agent import protocol as P
    from edge_agent.ingest import Accepted, route_learned
    from routing.learned import LearnedRouter as LR

    router, _, _ = trained

    class Fragile(LR):                      # the real trained router; its forward fails on an all-white crop
        def _forward(self, x):
            if bool((x.flatten(1).min(dim=1).values >= x.max()).any()):
                raise RuntimeError("kernel failed")
            return super()._forward(x)
    fragile = Fragile(router.model, router.net, router.classes, router.input_size, threshold=0.5)
    images = [decode_frame(recs["test"], f) for f in list(recs["test"])[:4]]

    def read(imgs):
        return [(b"peer", Accepted(Frame(f"f{i}", "T", "B0", "", 0.0, img, 0.0), None, "{}", b""))
                for i, img in enumerate(imgs)]
    white = np.full_like(images[0], 255)
    checked = read([white] + images[1:])
    route_learned(fragile, checked)
    first = checked[0][1]
    assert isinstance(first, P.Reject) and first.reason == P.BAD_IMAGE and "kernel failed" in first.detail
    assert all(isinstance(c, Accepted) and c.expert_id or isinstance(c, P.Reject) and c.reason == "low_confidence"
               for _, c in checked[1:])
    checked = read([white] * 4)
    route_learned(fragile, checked)
    assert {c.reason for _, c in checked} == {P.BUSY}


def _subset(src: Recording, dst, keep) -> Recording:
    """A copy of `src` holding only the frames `keep(frame)` says, and with header fields changed by it."""
    w = RecordingWriter(dst)
    for f in src:
        if keep(f):
            w.add(dict(f.header), src.payload(f), f.file.rsplit(".", 1)[-1], truth=f.truth,
                  truth_component=f.truth_component)
    w.close()
    return Recording(dst)


def test_train_refuses_a_recording_missing_component_types_and_keeps_the_router_there(model, recs, tmp_path):
    """Trained on one type, a router routes every frame to it, confidently, over correct headers; before, it was
    stored with a warning printed after."""
    from edge_agent.cli import cli

    cfg = write_line(tmp_path / "line", store=tmp_path / "store")
    one = _subset(recs["test"], tmp_path / "one", lambda f: f.header["component"] == "C0402")
    res = CliRunner().invoke(cli, ["router", "train", "--config", str(cfg), "--data", str(one.root), "--epochs", "1"])
    assert res.exit_code == 1 and "have no frame in" in res.output and "--allow-missing" in res.output
    assert not (tmp_path / "store").exists() or not ExpertStore(tmp_path / "store").has(ROUTER_ID)
    res = CliRunner().invoke(cli, ["router", "train", "--config", str(cfg), "--data", str(one.root), "--epochs", "1",
                                   "--allow-missing"])
    assert res.exit_code == 0, res.output
    first = ExpertStore(tmp_path / "store").entry(ROUTER_ID).version
    res = CliRunner().invoke(cli, ["router", "train", "--config", str(cfg), "--data", str(one.root), "--epochs", "1",
                                   "--allow-missing"])
    assert res.exit_code == 0 and ExpertStore(tmp_path / "store").entry(ROUTER_ID).version == first + 1
    assert "already holds other weights" not in res.output      # a retrain is the next version, not a conflict


def test_train_and_eval_refuse_another_lines_frames_and_a_single_frame(model, recs, tmp_path):
    from edge_agent.cli import cli

    cfg = write_line(tmp_path / "line", store=tmp_path / "store")
    other = _subset(recs["test"], tmp_path / "z", lambda f: f.header.update(line="Z") or True)
    res = CliRunner().invoke(cli, ["router", "train", "--config", str(cfg), "--data", str(other.root), "--epochs", "1"])
    assert res.exit_code == 1 and "frames of line Z, not of line T" in res.output
    first = next(iter(recs["test"])).header["frame_id"]
    single = _subset(recs["test"], tmp_path / "single", lambda f: f.header["frame_id"] == first)
    with pytest.raises(CoEError, match=r"1 frame\(s\); the router needs at least 2"):
        train_router(model, single, epochs=1, seed=0)


def test_a_stored_router_with_metadata_out_of_bounds_is_refused_naming_the_file(model, trained, tmp_path):
    import shutil

    from routing.learned import _META_CLASSES, _META_WIDTH

    _, _, src = trained
    for name, change, says in (("wide", lambda t: t.update({_META_WIDTH: torch.tensor([100000])}), "width 100000"),
                               ("float", lambda t: t.update({_META_CLASSES: t[_META_CLASSES].float()}),
                                "classes must be a 1-D uint8 tensor")):
        root = tmp_path / name
        shutil.copytree(src.root, root)
        store = ExpertStore(root)
        tensors = dict(store.read(ROUTER_ID))
        change(tensors)
        entry = store.entry(ROUTER_ID)
        store.write(__import__("coe").Expert(id=ROUTER_ID, arch=entry.arch, kind="classifier",
                                             classes=tuple(model.components), input_size=32), tensors, version=2)
        with pytest.raises(CoEError, match=rf"learned router {re.escape(str(root))}.*{says}"):
            LearnedRouter.load(model, ExpertStore(root))


def test_the_spec_reserves_the_routers_id():
    import copy

    from coe import SpecError

    spec = copy.deepcopy(TINY_SPEC)
    spec["experts"][0]["id"] = "router"
    with pytest.raises(SpecError, match="'router' is reserved"):
        parse_spec(spec)


def test_eval_shows_its_figures_before_a_png_it_cannot_write_and_uses_the_lines_threshold(trained, recs, tmp_path):
    import shutil

    from edge_agent.cli import cli

    _, _, src = trained
    shutil.copytree(src.root, tmp_path / "store")
    cfg = write_line(tmp_path / "line", store=tmp_path / "store", routing={"mode": "learned", "threshold": 0.55})
    (tmp_path / "afile").write_text("x")
    res = CliRunner().invoke(cli, ["router", "eval", "--config", str(cfg), "--data", str(recs["test"].root),
                                   "--png", str(tmp_path / "afile" / "cm.png")])
    assert res.exit_code == 1 and "top-1 accuracy:" in res.output and "at threshold 0.55" in res.output
    assert "the confusion matrix could not be written" in res.output and "the figures above stand" in res.output


def test_a_frame_the_network_routes_over_its_header_is_recorded_as_the_type_that_judged_it(model):
    """The header says R0402, the network is sure it is C0402: C0402's classifier judges it, so the verdict and
    journal rows must say C0402 (they said R0402: another type's classifier had judged an 'R0402' frame)."""
    from coe import Frame
    from edge_agent.ingest import Accepted, route_learned

    router = stub(model, [0.01, 0.95, 0.02, 0.02])                      # C0402, sure
    acc = Accepted(Frame("f1", "T", "B", "R0402", 0.0, img()), None, "{}", b"")
    unsure = stub(model, [0.4, 0.3, 0.2, 0.1], threshold=0.9)           # below the threshold: the header's
    acc2 = Accepted(Frame("f2", "T", "B", "R0402", 0.0, img()), None, "{}", b"")
    route_learned(router, [(None, acc)])
    route_learned(unsure, [(None, acc2)])
    assert (acc.expert_id, acc.frame.component) == ("cls-c0402", "C0402")
    assert (acc2.expert_id, acc2.frame.component) == ("cls-r0402", "R0402")


def test_a_type_sharing_its_classifier_with_another_is_recorded_as_the_type_the_network_saw():
    import copy

    from coe import Frame
    from edge_agent.ingest import Accepted, route_learned

    spec = copy.deepcopy(TINY_SPEC)
    spec["components"].append({"name": "R0805", "classifier": "cls-r0402", "frequency": 1})   # shares R0402's
    shared = parse_spec(spec)
    router = LearnedRouter(shared, Fixed([0.01, 0.01, 0.01, 0.01, 0.96]), list(shared.components), 32)
    acc = Accepted(Frame("f1", "T", "B", "", 0.0, img()), None, "{}", b"")
    route_learned(router, [(None, acc)])
    assert (acc.expert_id, acc.frame.component) == ("cls-r0402", "R0805")      # not R0402, the first sharer
