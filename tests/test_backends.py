"""Backends: build and run real (tiny) models of both families from generated weights."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
import torch

from coe import CoEError, Expert, ExpertLoadError
from executors.backends import Backend, calibrate_classifier, get_backend

CLASSES = ("ok", "missing", "misaligned")


pytestmark = pytest.mark.usefixtures("ultralytics_offline")


def classifier(eid: str = "cls-a", arch: str = "torchvision/shufflenet_v2_x0_5", **kw: object) -> Expert:
    kw.setdefault("priors", {"ok": 0.7, "missing": 0.2, "misaligned": 0.1})
    return Expert(id=eid, arch=arch, kind="classifier", classes=CLASSES, input_size=32, **kw)


def detector(eid: str = "det-a") -> Expert:
    return Expert(id=eid, arch="ultralytics/yolov8n", kind="detector", classes=("bridge", "tombstone"),
                  input_size=64, conf_threshold=0.3)


def images(n: int, seed: int = 0) -> list[np.ndarray]:
    """Random RGB images of assorted sizes, as ingest would hand them over."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (int(rng.integers(20, 90)), int(rng.integers(20, 90)), 3), dtype=np.uint8)
            for _ in range(n)]


def test_registry_returns_backends_that_keep_the_contract() -> None:
    tv = get_backend("torchvision/shufflenet_v2_x0_5")
    assert tv.family == "torchvision" and isinstance(tv, Backend)
    assert get_backend("torchvision") is tv  # one instance per family: its skeleton cache is shared
    assert get_backend("ultralytics/yolov8n").family == "ultralytics"


@pytest.mark.parametrize("arch, words", [
    ("onnxx/model", ["onnxx/model", "torchvision", "ultralytics"]),
    ("torchvision/resnet9000", ["torchvision/resnet9000", "resnet9000"]),
    ("ultralytics/yolov8q", ["ultralytics/yolov8q", "yolov8n"]),
    ("ultralytics/yolov10n", ["yolov10n"]),  # end-to-end head: not an NMS detector
])
def test_unknown_family_or_model_fails_loudly(arch: str, words: list[str]) -> None:
    with pytest.raises(CoEError) as err:
        get_backend(arch)
    for w in words:
        assert w in str(err.value)


def test_init_weights_is_seeded_and_leaves_global_rng_alone() -> None:
    tv, e = get_backend("torchvision"), classifier()
    state = torch.random.get_rng_state()
    a, b, c = tv.init_weights(e, 1), tv.init_weights(e, 1), tv.init_weights(e, 2)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert all(t.is_contiguous() for t in a.values())
    assert any("running_mean" in k for k in a)  # buffers are part of an expert


def test_classifier_gives_one_output_per_image_with_its_labels() -> None:
    tv, e = get_backend("torchvision"), classifier()
    module = tv.build(e, tv.init_weights(e, 0))
    assert not module.training
    imgs = images(7)
    out = tv.run(module, e, imgs)
    assert len(out) == 7
    assert all(o.label in CLASSES and 0.0 < o.score <= 1.0 and o.boxes == () for o in out)
    assert tv.run(module, e, []) == []


def test_detector_gives_one_output_per_image_with_boxes_in_image_pixels() -> None:
    ul, e = get_backend("ultralytics"), detector()
    tensors = ul.init_weights(e, 0)
    # make the head certain of class 1 everywhere, so NMS must return boxes of that label
    cls_bias = [k for k in tensors if re.fullmatch(r"model\.\d+\.cv3\.\d+\.2\.bias", k)]
    assert len(cls_bias) == 3
    for k in cls_bias:
        tensors[k] = torch.tensor([-20.0, 20.0])
    module = ul.build(e, tensors)
    imgs = images(3, seed=1)
    out = ul.run(module, e, imgs)
    assert len(out) == 3
    for o, img in zip(out, imgs):
        h, w = img.shape[:2]
        assert o.label is None and o.boxes
        for x1, y1, x2, y2, conf, label in o.boxes:
            assert label == "tombstone" and conf >= e.conf_threshold
            assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h
            assert all(round(v, 2) == v for v in (x1, y1, x2, y2, conf))


def test_detector_with_suppressed_classes_finds_nothing() -> None:
    ul, e = get_backend("ultralytics"), detector()
    tensors = ul.init_weights(e, 0)
    for k in [k for k in tensors if re.fullmatch(r"model\.\d+\.cv3\.\d+\.2\.bias", k)]:
        tensors[k] = torch.full((2,), -20.0)
    out = ul.run(ul.build(e, tensors), e, images(2))
    assert [o.boxes for o in out] == [(), ()]


def test_second_expert_of_same_arch_follows_its_own_weights() -> None:
    import torchvision

    tv = get_backend("torchvision")
    ea, eb = classifier("cls-a"), classifier("cls-b")
    wa, wb = tv.init_weights(ea, 10), tv.init_weights(eb, 11)
    ma = tv.build(ea, wa)
    mb = tv.build(eb, wb)
    assert tv.skeleton(ea) is tv.skeleton(eb)  # one skeleton per (arch, classes)
    x = torch.rand(4, 3, 32, 32)
    ref = torchvision.models.get_model("shufflenet_v2_x0_5", weights=None, num_classes=3).eval()
    ref.load_state_dict(wb)
    with torch.inference_mode():
        ya, yb, yref = ma(x), mb(x), ref(x)
    assert torch.allclose(yb, yref, atol=1e-6)
    assert not torch.allclose(ya, yb, atol=1e-3)
    ref.load_state_dict(wa)
    with torch.inference_mode():
        assert torch.allclose(ma(x), ref(x), atol=1e-6)  # building b did not touch a


@pytest.mark.parametrize("favoured", [0, 2])
def test_zeroed_head_with_biased_label_always_outputs_that_label(favoured: int) -> None:
    tv, e = get_backend("torchvision"), classifier()
    tensors = tv.init_weights(e, 0)
    tensors["fc.weight"] = torch.zeros_like(tensors["fc.weight"])
    bias = torch.zeros(3)
    bias[favoured] = 3.0
    tensors["fc.bias"] = bias
    out = tv.run(tv.build(e, tensors), e, images(12))
    assert {o.label for o in out} == {CLASSES[favoured]}
    expected = float(torch.softmax(bias, 0)[favoured])
    assert all(abs(o.score - expected) < 1e-5 for o in out)


def test_wrong_shaped_tensors_name_the_expert_and_keys() -> None:
    tv = get_backend("torchvision")
    four = Expert(id="cls-4", arch="torchvision/shufflenet_v2_x0_5", kind="classifier",
                  classes=("a", "b", "c", "d"), input_size=32)
    e = classifier("cls-three", uri="/store/cls-three.safetensors")
    with pytest.raises(ExpertLoadError) as err:
        tv.build(e, tv.init_weights(four, 0))
    assert err.value.expert_id == "cls-three"
    assert err.value.path == "/store/cls-three.safetensors"
    assert "fc.weight" in str(err.value) and "mis-shaped" in str(err.value)

    good = tv.init_weights(e, 0)
    missing = {k: v for k, v in good.items() if k != "conv1.0.weight"}
    with pytest.raises(ExpertLoadError, match=r"missing keys \(conv1\.0\.weight\)"):
        tv.build(e, missing)
    with pytest.raises(ExpertLoadError, match="unexpected keys .*extra.weight"):
        tv.build(e, {**good, "extra.weight": torch.zeros(1)})


def test_detector_weights_of_another_size_are_refused() -> None:
    ul, e = get_backend("ultralytics"), detector()
    bigger = Expert(id="det-s", arch="ultralytics/yolov8n", kind="detector", classes=("a", "b", "c"),
                    input_size=64)
    with pytest.raises(ExpertLoadError, match="det-a.*mis-shaped"):
        ul.build(e, ul.init_weights(bigger, 0))


def test_bad_images_are_refused_with_the_expert_named() -> None:
    tv, e = get_backend("torchvision"), classifier()
    module = tv.build(e, tv.init_weights(e, 0))
    with pytest.raises(CoEError, match="cls-a.*image 1"):
        tv.run(module, e, [images(1)[0], np.zeros((10, 10), dtype=np.uint8)])
    with pytest.raises(CoEError, match="uint8"):
        tv.run(module, e, [np.zeros((10, 10, 3), dtype=np.float32)])


def test_activation_bytes_cover_the_input_and_grow_with_the_batch() -> None:
    for backend, e in ((get_backend("torchvision"), classifier()), (get_backend("ultralytics"), detector())):
        input_bytes = 3 * e.input_size ** 2 * 4
        one, eight = backend.activation_bytes(e, 1), backend.activation_bytes(e, 8)
        assert one > 2 * input_bytes  # intermediate feature maps dwarf the input
        assert eight == pytest.approx(8 * one, rel=0.01)


def test_calibration_moves_label_shares_toward_the_priors() -> None:
    tv, e = get_backend("torchvision"), classifier()
    tensors = tv.init_weights(e, 3)
    sample = images(60, seed=5)
    target = np.array([e.prior(c) for c in CLASSES])

    def distance(t: dict[str, torch.Tensor]) -> float:
        counts = Counter(o.label for o in tv.run(tv.build(e, t), e, sample))
        return float(np.abs(np.array([counts[c] / len(sample) for c in CLASSES]) - target).sum())

    before = distance(tensors)
    calibrated = calibrate_classifier(tv, e, tensors, sample)
    after = distance(calibrated)
    assert after < before and after <= 0.1
    changed = [k for k in tensors if not torch.equal(tensors[k], calibrated[k])]
    assert changed == ["fc.bias"]  # only the final bias moves: this is calibration, not training


def test_calibration_works_on_a_network_with_vanishing_logit_spread() -> None:
    """mobilenet_v3_small at random init separates images by ~1e-10 in logit space."""
    tv = get_backend("torchvision")
    e = classifier("cls-m", arch="torchvision/mobilenet_v3_small")
    sample = images(40, seed=6)
    calibrated = calibrate_classifier(tv, e, tv.init_weights(e, 0), sample)
    counts = Counter(o.label for o in tv.run(tv.build(e, calibrated), e, sample))
    assert counts["ok"] / 40 == pytest.approx(0.7, abs=0.1)
    assert counts["missing"] > 0 and counts["misaligned"] > 0


def test_calibration_refuses_detectors() -> None:
    ul, e = get_backend("ultralytics"), detector()
    with pytest.raises(CoEError, match="only classifiers"):
        calibrate_classifier(ul, e, {}, images(2))  # type: ignore[arg-type]


def test_nms_has_no_time_limit_a_slow_box_or_a_clock_step_would_pass_frames(monkeypatch) -> None:
    """ultralytics' NMS quits after 2 s + 50 ms an image of wall clock, leaving the images it has not reached
    without boxes: frames passed that were never looked at.  Here the wall clock steps a minute per reading."""
    from ultralytics.utils import nms

    from executors.backends.ultralytics_backend import detections

    e = detector()
    n, nc, anchors = 4, len(e.classes), 8
    preds = torch.zeros(n, 4 + nc, anchors)
    preds[:, :4, 0] = torch.tensor([20.0, 20.0, 10.0, 10.0])    # one confident box (xywh) per image
    preds[:, 4, 0] = 0.9
    clock = iter(range(0, 10**6, 60))
    monkeypatch.setattr(nms.time, "time", lambda: float(next(clock)))
    outs = detections(preds, e, images(n))
    assert [len(o.boxes) for o in outs] == [1, 1, 1, 1]
