"""Train the demo zoo's YOLO detectors on synthetic soldering defects, and measure their recall.

A detector runs on the frames its classifiers called ok (the spec's `next`
edges), so it learns from ok crops of exactly those component types: about
half show one soldering defect that `storage.solder` draws with its box, the
rest are clean (a box on a clean part turns a pass into a defect, so the
clean crops teach it to stay quiet).  Crops are drawn at the recording's
frame size and resized with the backend's own `resize_batch`, so training sees
what serving sees.

The loop is ours, around ultralytics' own model and loss (`v8DetectionLoss`,
the task-aligned assigner, DFL): no trainer, no dataset on disk, nothing
downloaded.  It is seeded, and BatchNorm statistics are recomputed at the end
as for the classifiers.  `evaluate` runs the trained weights through the
serving backend (`UltralyticsBackend.run`: NMS at the expert's confidence
threshold) on held-out crops from another seed and counts a drawn defect as
found when a box of its class overlaps it at IoU >= 0.5.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from coe import CoEError, CoEModel, Expert, StepError
from storage.solder import SOLDER_DEFECTS, applicable, draw_solder_defect
from storage.synthetic import draw_component

IOU_MATCH = 0.5
DEFECT_SHARE = 0.5       # share of training crops that show a defect
CHECK_FROM = 300         # early stop (train_detector's `until`): first check, then every CHECK_EVERY steps
CHECK_EVERY = 50
CHECK_CROPS = 256
MAX_FALSE_ALARMS = 0.02


@dataclass(frozen=True)
class DetectorPlan:
    """What one detector learns: the component types it sees and the (type, defect) pairs drawable on them."""

    expert: Expert
    components: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]       # (component, defect) with defect among the expert's classes
    undrawable: tuple[str, ...]              # classes no component of it can show


@dataclass
class DetectorScore:
    """Held-out result: per class found/drawn at IoU >= 0.5, and clean crops with any box."""

    found: dict[str, int] = field(default_factory=dict)
    drawn: dict[str, int] = field(default_factory=dict)
    clean: int = 0
    false_alarms: int = 0

    @property
    def recall(self) -> float:
        drawn = sum(self.drawn.values())
        return sum(self.found.values()) / drawn if drawn else float("nan")

    def recall_by_class(self) -> dict[str, float]:
        return {k: round(self.found.get(k, 0) / n, 4) for k, n in sorted(self.drawn.items()) if n}

    @property
    def false_alarm_rate(self) -> float:
        return self.false_alarms / self.clean if self.clean else float("nan")


def plans(model: CoEModel) -> list[DetectorPlan]:
    """One plan per ultralytics detector the spec's classifiers hand their pass labels to."""
    comps: dict[str, list[str]] = {}
    for comp in model.components.values():
        cls = model.experts[comp.classifier]
        for label in cls.pass_labels:
            nxt = cls.next.get(label)
            if nxt is not None and model.experts[nxt].family == "ultralytics":
                bucket = comps.setdefault(nxt, [])
                if comp.name not in bucket:
                    bucket.append(comp.name)
    out = []
    for det_id, names in comps.items():
        expert = model.experts[det_id]
        unknown = [c for c in expert.classes if c not in SOLDER_DEFECTS]
        if unknown:
            raise CoEError(f"expert '{det_id}': cannot train on synthetic frames: classes {unknown} are not drawn "
                           f"(drawn defects: {', '.join(SOLDER_DEFECTS)})")
        pairs = tuple((c, d) for c in names for d in applicable(c) if d in expert.classes)
        if not pairs:
            raise CoEError(f"expert '{det_id}': none of its classes can be drawn on its component types "
                           f"{', '.join(names)}")
        undrawable = tuple(d for d in expert.classes if d not in {p[1] for p in pairs})
        out.append(DetectorPlan(expert, tuple(names), pairs, undrawable))
    return out


def draw_batch(plan: DetectorPlan, rng: np.random.Generator, n: int, frame_size: int, *,
               defect_share: float = DEFECT_SHARE) -> tuple[list[np.ndarray], list[list[tuple]]]:
    """`n` crops at `frame_size` and, per crop, its boxes as (x1, y1, x2, y2, class index) in pixels."""
    images, boxes = [], []
    for _ in range(n):
        if rng.random() < defect_share:
            comp, defect = plan.pairs[int(rng.integers(len(plan.pairs)))]
            img, box = draw_solder_defect(comp, defect, rng, frame_size)
            images.append(img)
            boxes.append([(*box, plan.expert.classes.index(defect))])
        else:
            comp = plan.components[int(rng.integers(len(plan.components)))]
            images.append(draw_component(comp, "ok", rng, frame_size))
            boxes.append([])
    return images, boxes


def _targets(boxes: list[list[tuple]], frame_size: int):
    """ultralytics' batch dict: image index, class, box as normalised (cx, cy, w, h)."""
    import torch

    rows = [(i, c, (x0 + x1) / 2 / frame_size, (y0 + y1) / 2 / frame_size, (x1 - x0) / frame_size,
             (y1 - y0) / frame_size) for i, bs in enumerate(boxes) for x0, y0, x1, y1, c in bs]
    t = torch.tensor(rows, dtype=torch.float32).reshape(-1, 6)
    return {"batch_idx": t[:, 0], "cls": t[:, 1:2], "bboxes": t[:, 2:]}


def train_detector(plan: DetectorPlan, *, steps: int, batch: int, seed: int, frame_size: int = 64,
                   until: float | None = None, check_from: int = CHECK_FROM, check_every: int = CHECK_EVERY,
                   progress: Callable[[int], None] | None = None) -> tuple[dict, list[float]]:
    """A trained state dict for `plan.expert` (ultralytics' model and loss, our seeded loop), and the loss per step.

    With `until`, it stops early once a BatchNorm-recalibrated copy finds that
    share of the defects in a validation draw (its own seed, not the held-out
    one) with at most `MAX_FALSE_ALARMS` on clean crops, checked every
    `check_every` steps from `check_from` on.  Recall swings while the boxes
    settle (a run can score 99% at step 150 and 0% at 250), so checks start
    late; the held-out score reported afterwards is measured apart.
    """
    import copy

    import torch

    from executors.backends.base import resize_batch, to_input
    from executors.backends.ultralytics_backend import UltralyticsBackend

    from .zoo_train import recalibrate_batchnorm

    backend = UltralyticsBackend()
    expert = plan.expert
    torch.manual_seed(seed)
    net = backend._construct(expert)     # pins ultralytics offline and quiet before it is imported
    from ultralytics.cfg import get_cfg

    net.args = get_cfg()                     # the loss gains (box, cls, dfl) of ultralytics' defaults
    criterion = net.init_criterion()
    # only what the model leaves trainable: DFL's projection is a fixed 0..15 ramp, and training it breaks boxes
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3, weight_decay=5e-4)
    rng = np.random.default_rng(seed)

    def inputs(images):
        return to_input(resize_batch(expert, images), torch.device("cpu"), torch.float32)

    check_rng = np.random.default_rng([seed, 30_000])

    def good_enough() -> bool:
        with torch.random.fork_rng(devices=[]):          # checking must not move the training's RNG
            probe = copy.deepcopy(net)
            recalibrate_batchnorm(probe, lambda: inputs(draw_batch(plan, check_rng, batch, frame_size)[0]))
            score = evaluate(plan, probe.state_dict(), seed=seed, crops=CHECK_CROPS, frame_size=frame_size,
                             stream=20_000)
        return score.recall >= until and score.false_alarm_rate <= MAX_FALSE_ALARMS

    net.train()
    losses = []
    for step in range(steps):
        images, boxes = draw_batch(plan, rng, batch, frame_size)
        loss, _ = criterion(net(inputs(images)), _targets(boxes, frame_size))
        opt.zero_grad()
        loss.sum().backward()
        losses.append(float(loss.detach().sum()) / batch)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
        opt.step()
        if progress is not None:
            progress(step + 1)
        done = step + 1
        if (until is not None and done >= check_from and done < steps and (done - check_from) % check_every == 0
                and good_enough()):
            if progress is not None:
                progress(steps)                # the bar ends full: the rest is not needed
            break
    recalibrate_batchnorm(net, lambda: inputs(draw_batch(plan, rng, batch, frame_size)[0]))
    return {k: v.detach().contiguous() for k, v in net.state_dict().items()}, losses


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def evaluate(plan: DetectorPlan, tensors: dict, *, seed: int, crops: int = 256, frame_size: int = 64,
             stream: int = 10_000) -> DetectorScore:
    """Recall at IoU >= 0.5 per class and false alarms on clean crops, through the serving backend.

    `stream` picks the draw: 10,000 the held-out crops a result reports, 20,000 the validation crops
    an early stop looks at.
    """
    from executors.backends.ultralytics_backend import UltralyticsBackend

    backend = UltralyticsBackend()
    expert = plan.expert
    module = backend.build(expert, tensors)
    rng = np.random.default_rng([seed, stream])
    score = DetectorScore()
    for start in range(0, crops, 32):
        images, boxes = draw_batch(plan, rng, min(32, crops - start), frame_size)
        for out, want in zip(backend.run(module, expert, images), boxes):
            if isinstance(out, StepError):   # training diverged: say so, not an AttributeError on .boxes
                raise CoEError(f"detector {expert.id}: {out.message} (training diverged; train it again with "
                               "another seed or fewer steps)")
            if not want:
                score.clean += 1
                score.false_alarms += bool(out.boxes)
                continue
            for *box, cls in want:
                name = expert.classes[cls]
                score.drawn[name] = score.drawn.get(name, 0) + 1
                hit = any(b[5] == name and _iou(box, b[:4]) >= IOU_MATCH for b in out.boxes)
                score.found[name] = score.found.get(name, 0) + hit
    return score
