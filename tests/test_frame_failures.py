"""A failure one frame causes stays that frame's: non-finite outputs, a frame that breaks an expert, a frame that
does not fit in memory even alone; an expert that fails on every frame is the whole batch's error, once."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from coe import Expert, StepError, StepOutput, finite_problem
from executors.backends import get_backend
from executors.backends.torchvision_backend import classify
from executors.backends.ultralytics_backend import detections
from executors.executor import Executor, is_out_of_memory

CLASSES = ("ok", "missing", "misaligned")


pytestmark = pytest.mark.usefixtures("ultralytics_offline")


def classifier() -> Expert:
    return Expert(id="cls-a", arch="torchvision/shufflenet_v2_x0_5", kind="classifier", classes=CLASSES,
                  input_size=32, priors={"ok": 0.7, "missing": 0.2, "misaligned": 0.1})


def detector() -> Expert:
    return Expert(id="det-a", arch="ultralytics/yolov8n", kind="detector", classes=("bridge", "tombstone"),
                  input_size=64, conf_threshold=0.3)


def images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (40, 50, 3), dtype=np.uint8) for _ in range(n)]


# -- non-finite outputs -------------------------------------------------------------------------------------------
def test_a_classifier_with_nan_weights_gives_every_frame_an_error_not_label_zero():
    """argmax of NaN logits is index 0, 'ok' here: before, every frame went on as good with score NaN."""
    tv, e = get_backend("torchvision"), classifier()
    tensors = tv.init_weights(e, 0)
    tensors["fc.weight"] = torch.full_like(tensors["fc.weight"], float("nan"))
    out = tv.run(tv.build(e, tensors), e, images(3))
    assert len(out) == 3 and all(isinstance(o, StepError) and o.kind == "expert_output" for o in out)
    assert "cls-a" in out[0].message and "NaN" in out[0].message


def test_a_detector_with_nan_weights_gives_every_frame_an_error_not_a_pass():
    """NMS keeps boxes with conf > threshold; NaN compares false, so every box was dropped: 'no defect found'."""
    ul, e = get_backend("ultralytics"), detector()
    tensors = ul.init_weights(e, 0)
    for k in [k for k in tensors if re.fullmatch(r"model\.\d+\.cv3\.\d+\.2\.bias", k)]:
        tensors[k] = torch.full_like(tensors[k], float("nan"))
    out = ul.run(ul.build(e, tensors), e, images(2))
    assert len(out) == 2 and all(isinstance(o, StepError) and "det-a" in o.message for o in out)


def test_only_the_frame_whose_raw_output_is_not_finite_fails():
    e = classifier()
    logits = torch.tensor([[2.0, 0.0, 0.0], [float("nan"), 1.0, 0.0], [0.0, float("inf"), 0.0], [0.0, 0.0, 3.0]])
    out = classify(logits, e)
    assert [type(o) for o in out] == [StepOutput, StepError, StepError, StepOutput]
    assert out[0].label == "ok" and out[3].label == "misaligned"
    assert "1 NaN" in out[1].message and "1 infinite" in out[2].message
    d = detector()
    preds = torch.zeros(3, 4 + len(d.classes), 84)
    preds[:, :4] = torch.tensor([10.0, 10.0, 20.0, 20.0])[:, None]
    preds[:, 4 + 1] = 0.9                                    # every anchor says 'tombstone'
    preds[1, 5, 7] = float("nan")
    outs = detections(preds, d, images(3))
    assert isinstance(outs[1], StepError)
    assert all(isinstance(o, StepOutput) and o.boxes and o.boxes[0][5] == "tombstone" for o in (outs[0], outs[2]))


def test_finite_problem_is_the_agents_backstop_for_any_other_source():
    assert finite_problem(StepOutput(label="ok", score=0.9)) is None
    assert finite_problem(StepOutput(label="ok", score=float("nan"))) == "score nan"
    assert finite_problem(StepOutput(boxes=((1.0, 2.0, float("inf"), 4.0, 0.5, "x"),))) == "box value inf"
    assert finite_problem(StepOutput(boxes=((1.0, 2.0, 3.0, 4.0, 0.5, "x"),))) is None


# -- narrowing a failing batch --------------------------------------------------------------------------------------
class Scripted:
    """A backend that fails as told: `bad(image)` true for a frame that breaks the expert, `big(image)` for one
    that does not fit alone, `limit` the largest batch that fits, `broken` for an expert that fails always."""

    def __init__(self, *, bad=lambda img: False, big=lambda img: False, limit=1 << 30, broken=False,
                 message="shape [{n}, 3] is not [{n}, 4]"):
        self.bad, self.big, self.limit, self.broken, self.message = bad, big, limit, broken, message
        self.calls: list[int] = []

    def run(self, module, expert, imgs):
        self.calls.append(len(imgs))
        if self.broken or any(self.bad(i) for i in imgs):
            raise ValueError(self.message.format(n=len(imgs)))
        if len(imgs) > self.limit or any(self.big(i) for i in imgs):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456 bytes")
        return [StepOutput(label="ok", score=float(i[0, 0, 0])) for i in imgs]


def executor(backend: Scripted) -> Executor:
    return Executor("cpu0", "cpu", None, None, None, lambda r: None, prefetch=False, backend_for=lambda a: backend)


def marked(n: int, marks: set[int]) -> list[np.ndarray]:
    """n images; image i starts with pixel value i, and those in `marks` with 200 + i."""
    out = []
    for i in range(n):
        img = np.zeros((4, 4, 3), np.uint8)
        img[0, 0, 0] = 200 + i if i in marks else i
        out.append(img)
    return out


def test_a_frame_that_breaks_the_expert_fails_alone_and_its_batchmates_keep_their_outputs():
    be = Scripted(bad=lambda img: img[0, 0, 0] >= 200)
    ex = executor(be)
    outs = ex._run_splitting(None, classifier(), marked(8, {2, 5}))
    assert be.calls[0] == 8 and len(be.calls) == 11
    errors = [i for i, o in enumerate(outs) if isinstance(o, StepError)]
    assert errors == [2, 5] and all(outs[i].kind == "expert_run" and "cls-a" in outs[i].message for i in errors)
    assert [o.score for i, o in enumerate(outs) if i not in errors] == [0, 1, 3, 4, 6, 7]


def test_a_frame_that_does_not_fit_even_alone_fails_alone_and_the_halves_that_ran_keep_their_outputs():
    """Before, the batch of 1 that still ran out of memory raised through every split: 8 frames lost for 1."""
    be = Scripted(big=lambda img: img[0, 0, 0] >= 200, limit=4)
    ex = executor(be)
    outs = ex._run_splitting(None, classifier(), marked(8, {6}))
    assert [isinstance(o, StepError) for o in outs] == [False] * 6 + [True, False]
    assert outs[6].kind == "out_of_memory" and "alone" in outs[6].message and "can't allocate" in outs[6].message
    assert ex.oom_splits >= 2


def test_an_expert_that_fails_on_every_frame_is_one_error_for_the_batch():
    be = Scripted(broken=True)
    ex = executor(be)
    with pytest.raises(ValueError, match="is not"):
        ex._run_splitting(None, classifier(), marked(8, set()))
    assert len(be.calls) == 15                         # narrowed all the way: every frame failed alone


def test_a_batch_of_only_bad_frames_does_not_make_a_healthy_expert_fail_the_next_batches_good_frames():
    """A shortcut once skipped bisecting an expert whose last batch failed on every frame: a batch of two bad
    frames then failed every good frame of the next mixed batches."""
    be = Scripted(bad=lambda img: img[0, 0, 0] >= 200)
    ex = executor(be)
    with pytest.raises(ValueError):
        ex._run_splitting(None, classifier(), marked(2, {0, 1}))
    for _ in range(3):
        outs = ex._run_splitting(None, classifier(), marked(8, {3}))
        assert [isinstance(o, StepError) for o in outs] == [i == 3 for i in range(8)]


@pytest.mark.parametrize("exc, oom", [
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (type("Fail", (Exception,), {})("[ONNXRuntimeError] : 1 : FAIL : Failed to allocate memory for requested "
                                     "buffer of size 1024"), True),
    (type("RuntimeException", (Exception,), {})("CUDA failure 2: out of memory ; GPU=0"), True),
    (MemoryError(), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"), False),
    (ValueError("cannot take this frame"), False),
])
def test_out_of_memory_is_recognised_whichever_runtime_says_it(exc, oom):
    """torch's CPU allocator never says 'out of memory', and onnxruntime's errors are not RuntimeErrors: both
    failed whole where a smaller batch would have fitted."""
    assert is_out_of_memory(exc) is oom
