"""Train the demo zoo's classifiers on synthetic frames, so their verdicts mean something.

The synthetic recordings draw every component with a known label (ok,
missing, misaligned, wrong_part), so the same drawing code is a labelled
training set.  Classifiers that share an architecture, classes and input
size share one network: it is trained once on all of their component types
(a label looks alike across types: bare pads, a shifted body, another
family's body), and each of those experts is written with it; a group stops
early once a validation draw says it has learned the labels.  Per-expert
fine-tuning of that base is not built.  Detectors are trained on soldering
defects (`edge_agent.detector_train`).  The groups and the detectors train
side by side in worker processes, a core each (`edge_agent.train_jobs`).

Training runs a fixed number of steps from a seeded generator, so a run is
reproducible; BatchNorm statistics are recomputed at the end with the
network frozen (a short run leaves the running averages behind the weights,
and eval-mode accuracy would collapse).  A group whose experts still hold
exactly what the last training wrote is skipped (`.trained.json` in the
store), so the demo trains on its first run and reuses the result after.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coe import CoEError, CoEModel, Expert
from coe.files import write_json_atomic
from storage.expert_store import ExpertStore
from storage.synthetic import LABELS, draw_component

from executors.backends.base import IMAGENET_MEAN, IMAGENET_STD

from .detector_train import CHECK_CROPS, CHECK_FROM, MAX_FALSE_ALARMS
from .detector_train import CHECK_EVERY as DET_CHECK_EVERY
from .train_jobs import Job, Progress, from_numpy, run_jobs, to_numpy

MARKER = ".trained.json"
# seconds per training step at one thread on this 2-core box (batch 48 classifiers, batch 16 detectors):
# only the order the jobs start in depends on them, longest first
_STEP_SECONDS = {"torchvision/resnet18": 0.6, "torchvision/shufflenet_v2_x1_0": 0.2,
                 "torchvision/mobilenet_v3_small": 0.15, "detector": 0.11}
CLASSIFIER_STEPS = 300   # at most: with CLASSIFIER_UNTIL a group stops once its validation draw is that good
CLASSIFIER_UNTIL = 0.99
CHECK_EVERY = 50
DETECTOR_STEPS = 500     # at most: with DETECTOR_UNTIL a detector stops once its validation recall is that good
DETECTOR_UNTIL = 0.97    # (and false alarms at most detector_train.MAX_FALSE_ALARMS), checked from step 300
EVAL_CROPS = 1024    # held-out crops per detector: about 170 per class at half clean, half defects
SOLDER_RATE = 0.05   # the demo recording: share of ok parts drawn with a soldering defect


@dataclass(frozen=True)
class GroupResult:
    arch: str
    experts: tuple[str, ...]
    components: tuple[str, ...]
    steps: int
    heldout_accuracy: float
    skipped: bool
    seconds: float = 0.0            # the job's wall time in its worker (0 when kept)


@dataclass(frozen=True)
class DetectorResult:
    """One trained detector: held-out recall at IoU >= 0.5 (all and per class) and false alarms on clean crops."""

    arch: str
    expert: str
    components: tuple[str, ...]
    steps: int
    heldout_recall: float
    recall_by_class: dict
    false_alarm_rate: float
    undrawable: tuple[str, ...]
    skipped: bool
    drawn: int = 0                  # held-out defects drawn (the recall's denominator)
    seconds: float = 0.0            # the job's wall time in its worker (0 when kept)

    def describe(self) -> str:
        """One line for a terminal: recall per class, false alarms, classes it never saw."""
        state = "kept (already trained)" if self.skipped else f"trained {self.steps} steps in {self.seconds:.0f} s"
        by_class = ", ".join(f"{k} {100 * v:.0f}%" for k, v in self.recall_by_class.items())
        out = (f"{self.expert} ({self.arch}): {len(self.components)} component type(s), {state}; held-out recall "
               f"at IoU 0.5 {100 * self.heldout_recall:.1f}% of {self.drawn} drawn defects ({by_class}); "
               f"false alarms on clean parts "
               f"{100 * self.false_alarm_rate:.1f}%")
        if self.undrawable:
            out += f"; not trained on {', '.join(self.undrawable)} (no part of it can show them)"
        return out


def _groups(model: CoEModel) -> dict[tuple, tuple[list[Expert], list[str]]]:
    """(arch, classes, input size) -> (classifier experts, the component types they classify)."""
    out: dict[tuple, tuple[list[Expert], list[str]]] = {}
    for comp in model.components.values():
        e = model.experts[comp.classifier]
        if e.family != "torchvision":
            continue
        unknown = [c for c in e.classes if c not in LABELS]
        if unknown:
            raise CoEError(f"expert '{e.id}': cannot train on synthetic frames: classes {unknown} are not drawn "
                           f"(drawn labels: {', '.join(LABELS)})")
        key = (e.arch, e.classes, e.input_size)
        experts, comps = out.setdefault(key, ([], []))
        if e not in experts:
            experts.append(e)
        comps.append(comp.name)
    return out


def _batch(rng: np.random.Generator, comps: list[str], classes: tuple[str, ...], n: int, size: int):
    import torch

    ys = rng.integers(len(classes), size=n)
    xs = np.stack([draw_component(comps[int(rng.integers(len(comps)))], classes[int(y)], rng, size) for y in ys])
    x = torch.from_numpy(xs).permute(0, 3, 1, 2).float() / 255.0
    x = (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    return x, torch.from_numpy(ys.astype(np.int64))


def train_group(arch: str, classes: tuple[str, ...], size: int, comps: list[str], *, steps: int, batch: int,
                seed: int, until: float | None = None, check_every: int = CHECK_EVERY,
                progress: Callable[[int], None] | None = None):
    """A trained torchvision network, its accuracy on held-out draws (another seed), and the steps it ran.

    With `until`, it stops early once a BatchNorm-recalibrated copy classifies
    a validation draw (a third seed, not the held-out one the result reports)
    at least that well, checked every `check_every` steps: resnet18 is there
    in 50 steps, where mobilenet needs a few hundred.  The checks draw from
    their own generator, so the training batches are the same with or without
    them.  It trains in channels-last memory format: on a CPU that makes
    mobilenet_v3_small's step about twice as fast and the others no slower.
    """
    import copy

    import torch
    import torchvision

    torch.manual_seed(seed)
    net = torchvision.models.get_model(arch.split("/", 1)[1], weights=None, num_classes=len(classes))
    net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    rng = np.random.default_rng(seed)
    check_rng = np.random.default_rng([seed, 20_000])

    def draw(n: int, gen: np.random.Generator = rng):
        x, y = _batch(gen, comps, classes, n, size)
        return x.contiguous(memory_format=torch.channels_last), y

    def accuracy(model, x, y) -> float:
        with torch.no_grad():
            return float((model(x.contiguous(memory_format=torch.channels_last)).argmax(1) == y).float().mean())

    val = draw(256, check_rng) if until is not None else None
    ran = steps
    net.train()
    for step in range(steps):
        x, y = draw(batch)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step + 1)
        if val is not None and (step + 1) % check_every == 0 and step + 1 < steps:
            with torch.random.fork_rng(devices=[]):      # the probe's dropout must not move the training's RNG
                probe = copy.deepcopy(net)
                recalibrate_batchnorm(probe, lambda: draw(batch, check_rng)[0])
                good = accuracy(probe, *val) >= until
            if good:
                ran = step + 1
                if progress is not None:
                    progress(steps)            # the bar ends full: the rest is not needed
                break
    recalibrate_batchnorm(net, lambda: draw(batch)[0])
    held = np.random.default_rng(seed + 10_000)
    acc = accuracy(net, *_batch(held, comps, classes, 256, size))
    return net, acc, ran


def recalibrate_batchnorm(net, batches: Callable[[], object], rounds: int = 8) -> None:
    """Recompute BatchNorm running statistics with the weights frozen, then leave `net` in eval mode.

    A short run leaves the running averages behind the weights, and eval-mode
    outputs would collapse; a cumulative average over a few batches fixes that.
    """
    import torch

    for m in net.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None
    net.train()
    with torch.no_grad():
        for _ in range(rounds):
            net(batches())
    net.eval()


def train_classifiers(model: CoEModel, store: ExpertStore, *, steps: int = CLASSIFIER_STEPS, batch: int = 48,
                      seed: int = 0, until: float | None = CLASSIFIER_UNTIL, force: bool = False,
                      workers: int | None = None, progress: Progress | None = None) -> list[GroupResult]:
    """Train every torchvision classifier group of `model` and write its experts into `store`."""
    return train_zoo(model, store, steps=steps, batch=batch, seed=seed, until=until, force=force, workers=workers,
                     progress=progress, detectors=False)[0]


def train_detectors(model: CoEModel, store: ExpertStore, *, steps: int = DETECTOR_STEPS, batch: int = 16,
                    seed: int = 0, until: float | None = DETECTOR_UNTIL, force: bool = False, frame_size: int = 64,
                    workers: int | None = None, progress: Progress | None = None) -> list[DetectorResult]:
    """Train every ultralytics detector the classifiers hand ok parts to, and write it into `store`.

    Each is scored on held-out crops through the serving backend; a detector
    whose stored bytes are still what the last training wrote is skipped.
    """
    return train_zoo(model, store, det_steps=steps, det_batch=batch, det_until=until, seed=seed, force=force,
                     frame_size=frame_size, workers=workers, progress=progress, classifiers=False)[1]


def train_zoo(model: CoEModel, store: ExpertStore, *, steps: int = CLASSIFIER_STEPS, batch: int = 48,
              until: float | None = CLASSIFIER_UNTIL, det_steps: int = DETECTOR_STEPS, det_batch: int = 16,
              det_until: float | None = DETECTOR_UNTIL,
              seed: int = 0, force: bool = False, frame_size: int = 64, workers: int | None = None,
              progress: Progress | None = None, classifiers: bool = True, detectors: bool = True
              ) -> tuple[list[GroupResult], list[DetectorResult]]:
    """Train the classifier groups and the detectors of `model` side by side (`train_jobs`), into `store`.

    Everything the spec asks for is checked before anything trains.  What the
    store still holds from the same recipe is kept.  Each job's experts are
    written, and the training record replaced, as soon as that job ends, so an
    interrupted run keeps what it finished.
    """
    from .detector_train import plans

    groups = _groups(model) if classifiers else {}   # a spec the frames cannot teach fails before anything is touched
    todo_det = plans(model) if detectors and det_steps > 0 else []
    marker_path, marker = _read_marker(store)
    groups_out: list[GroupResult | None] = []
    dets_out: list[DetectorResult | None] = []
    jobs: list[Job] = []
    finish: list[Callable[[object], None]] = []

    for (arch, classes, size), (experts, comps) in groups.items():
        recipe = {"steps": steps, "batch": batch, "seed": seed, "components": sorted(comps), "arch": arch,
                  "classes": list(classes), "input_size": size, "until": until, "check_every": CHECK_EVERY}
        current = all(store.has(e.id) and marker.get(e.id, {}).get("sha256") == store.entry(e.id).sha256
                      and marker[e.id].get("recipe") == recipe for e in experts)
        if current and not force:
            rec = marker[experts[0].id]
            groups_out.append(GroupResult(arch, tuple(e.id for e in experts), tuple(comps),
                                          rec.get("steps_run", steps), rec["heldout_accuracy"], True))
            continue
        slot = len(groups_out)
        groups_out.append(None)
        jobs.append(Job(arch, _classifier_job, (arch, classes, size, comps, steps, batch, seed, until),
                        total=steps, cost=steps * _STEP_SECONDS.get(arch, 0.2) * (0.5 if until else 1.0)))

        def done_group(out, slot=slot, arch=arch, experts=experts, comps=comps, recipe=recipe) -> None:
            arrays, acc, ran, seconds = out
            tensors = from_numpy(arrays)
            for e in experts:
                version = store.entry(e.id).version + 1 if store.has(e.id) else 1
                entry = store.write(e, in_stored_dtype(store, e.id, tensors), version=version)
                marker[e.id] = {"sha256": entry.sha256, "recipe": recipe, "heldout_accuracy": round(acc, 4),
                                "steps_run": ran}
            _write_marker(marker_path, marker)
            groups_out[slot] = GroupResult(arch, tuple(e.id for e in experts), tuple(comps), ran, acc, False,
                                           seconds)
        finish.append(done_group)

    for plan in todo_det:
        e = plan.expert
        recipe = {"steps": det_steps, "batch": det_batch, "seed": seed, "frame_size": frame_size, "arch": e.arch,
                  "classes": list(e.classes), "pairs": sorted(map(list, plan.pairs)), "input_size": e.input_size,
                  "crops": EVAL_CROPS, "until": det_until,
                  "checks": [CHECK_FROM, DET_CHECK_EVERY, CHECK_CROPS, MAX_FALSE_ALARMS]}
        rec = marker.get(e.id, {})
        if (not force and store.has(e.id) and rec.get("sha256") == store.entry(e.id).sha256
                and rec.get("recipe") == recipe):
            dets_out.append(DetectorResult(e.arch, e.id, plan.components, rec.get("steps_run", det_steps),
                                           rec["heldout_recall"],
                                           rec["recall_by_class"], rec["false_alarm_rate"], plan.undrawable, True,
                                           rec.get("drawn", 0)))
            continue
        slot = len(dets_out)
        dets_out.append(None)
        jobs.append(Job(e.id, _detector_job, (plan, det_steps, det_batch, seed, frame_size, det_until), total=det_steps,
                        cost=det_steps * _STEP_SECONDS["detector"]))

        def done_detector(out, slot=slot, plan=plan, recipe=recipe) -> None:
            arrays, score, ran, seconds = out
            e = plan.expert
            version = store.entry(e.id).version + 1 if store.has(e.id) else 1
            entry = store.write(e, in_stored_dtype(store, e.id, from_numpy(arrays)), version=version)
            marker[e.id] = {"sha256": entry.sha256, "recipe": recipe, "heldout_recall": round(score.recall, 4),
                            "recall_by_class": score.recall_by_class(),
                            "false_alarm_rate": round(score.false_alarm_rate, 4), "drawn": sum(score.drawn.values()),
                            "steps_run": ran}
            _write_marker(marker_path, marker)
            dets_out[slot] = DetectorResult(e.arch, e.id, plan.components, ran, round(score.recall, 4),
                                            score.recall_by_class(), round(score.false_alarm_rate, 4),
                                            plan.undrawable, False, sum(score.drawn.values()), seconds)
        finish.append(done_detector)

    run_jobs(jobs, workers=workers, progress=progress, on_result=lambda i, out: finish[i](out))
    return groups_out, dets_out           # type: ignore[return-value]  (every slot is filled by now)


def _classifier_job(arch: str, classes: tuple[str, ...], size: int, comps: list[str], steps: int, batch: int,
                    seed: int, until: float | None, progress: Callable[[int], None] | None = None):
    """In a worker: (state dict as numpy arrays, held-out accuracy, steps run, seconds)."""
    t0 = time.perf_counter()
    net, acc, ran = train_group(arch, classes, size, comps, steps=steps, batch=batch, seed=seed, until=until,
                                progress=progress)
    return to_numpy(net.state_dict()), acc, ran, time.perf_counter() - t0


def _detector_job(plan, steps: int, batch: int, seed: int, frame_size: int, until: float | None,
                  progress: Callable[[int], None] | None = None):
    """In a worker: (state dict as numpy arrays, held-out score through the serving backend, steps run, seconds)."""
    from .detector_train import evaluate, train_detector

    t0 = time.perf_counter()
    tensors, losses = train_detector(plan, steps=steps, batch=batch, seed=seed, frame_size=frame_size,
                                     until=until, progress=progress)
    score = evaluate(plan, tensors, seed=seed, frame_size=frame_size, crops=EVAL_CROPS)
    return to_numpy(tensors), score, len(losses), time.perf_counter() - t0


def in_stored_dtype(store: ExpertStore, expert_id: str, tensors: dict) -> dict:
    """`tensors` (trained in fp32) in the dtype the store keeps `expert_id` in: a zoo cast to fp16 or bf16
    (`zoo build --dtype`) stays so when it is trained again."""
    if not store.has(expert_id) or store.entry(expert_id).dtype not in ("float16", "bfloat16"):
        return tensors
    from storage.dtypes import cast_floating

    return cast_floating(tensors, store.entry(expert_id).dtype)


def note_cast(store: ExpertStore, expert_id: str, before_sha256: str, after_sha256: str) -> None:
    """An expert this training wrote was cast to another dtype (`zoo build --dtype`): the record follows it, so
    the cast weights count as this training (not as untrained ones to train again in fp32)."""
    path, marker = _read_marker(store)
    rec = marker.get(expert_id)
    if rec is not None and rec.get("sha256") == before_sha256:
        rec["sha256"] = after_sha256
        _write_marker(path, marker)


def _write_marker(path: Path, marker: dict) -> None:
    """Replace the training record atomically: a crash mid-write must not leave a record that reads as garbage."""
    write_json_atomic(path, marker)


def _read_marker(store: ExpertStore) -> tuple[Path, dict]:
    marker_path = Path(store.root) / MARKER
    try:
        marker = json.loads(marker_path.read_text()) if marker_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise CoEError(f"{marker_path}: unreadable training record ({exc}); delete it to retrain") from None
    if not isinstance(marker, dict) or not all(isinstance(v, dict) for v in marker.values()):
        raise CoEError(f"{marker_path}: unreadable training record (expected an object of expert records); "
                       "delete it to retrain")
    return marker_path, marker
