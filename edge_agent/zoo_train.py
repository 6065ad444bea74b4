"""Train the demo zoo's classifiers on synthetic frames, so their verdicts mean something.

The synthetic recordings draw every component with a known label (ok,
missing, misaligned, wrong_part), so the same drawing code is a labelled
training set.  Classifiers that share an architecture, classes and input
size share one network: it is trained once on all of their component types
(a label looks alike across types: bare pads, a shifted body, another
family's body), and each of those experts is written with it.  Per-expert
fine-tuning of that base is the next step and not built yet.  Detectors are
trained one by one on soldering defects (`edge_agent.detector_train`).

Training runs a fixed number of steps from a seeded generator, so a run is
reproducible; BatchNorm statistics are recomputed at the end with the
network frozen (a short run leaves the running averages behind the weights,
and eval-mode accuracy would collapse).  A group whose experts still hold
exactly what the last training wrote is skipped (`.trained.json` in the
store), so the demo trains on its first run and reuses the result after.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coe import CoEError, CoEModel, Expert
from storage.expert_store import ExpertStore
from storage.synthetic import LABELS, draw_component

from executors.backends.base import IMAGENET_MEAN, IMAGENET_STD

MARKER = ".trained.json"
DETECTOR_STEPS = 500
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

    def describe(self) -> str:
        """One line for a terminal: recall per class, false alarms, classes it never saw."""
        state = "kept (already trained)" if self.skipped else f"trained {self.steps} steps"
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
                seed: int, progress: Callable[[int], None] | None = None):
    """A trained torchvision network and its accuracy on held-out draws (another seed).

    It trains in channels-last memory format: on a CPU that makes
    mobilenet_v3_small's step about twice as fast and the others no slower.
    """
    import torch
    import torchvision

    torch.manual_seed(seed)
    net = torchvision.models.get_model(arch.split("/", 1)[1], weights=None, num_classes=len(classes))
    net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    rng = np.random.default_rng(seed)

    def draw(n: int):
        x, y = _batch(rng, comps, classes, n, size)
        return x.contiguous(memory_format=torch.channels_last), y

    net.train()
    for step in range(steps):
        x, y = draw(batch)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step + 1)
    recalibrate_batchnorm(net, lambda: draw(batch)[0])
    held = np.random.default_rng(seed + 10_000)
    with torch.no_grad():
        x, y = _batch(held, comps, classes, 256, size)
        acc = float((net(x.contiguous(memory_format=torch.channels_last)).argmax(1) == y).float().mean())
    return net, acc


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


def train_classifiers(model: CoEModel, store: ExpertStore, *, steps: int = 300, batch: int = 48, seed: int = 0,
                      force: bool = False, progress: Callable[[str, int, int], None] | None = None
                      ) -> list[GroupResult]:
    """Train every torchvision classifier group of `model` and write its experts into `store`."""
    groups = _groups(model)               # a spec the frames cannot teach fails before anything is touched
    marker_path, marker = _read_marker(store)
    results = []
    for (arch, classes, size), (experts, comps) in groups.items():
        recipe = {"steps": steps, "batch": batch, "seed": seed, "components": sorted(comps), "arch": arch,
                  "classes": list(classes), "input_size": size}
        current = all(store.has(e.id) and marker.get(e.id, {}).get("sha256") == store.entry(e.id).sha256
                      and marker[e.id].get("recipe") == recipe for e in experts)
        if current and not force:
            results.append(GroupResult(arch, tuple(e.id for e in experts), tuple(comps), steps,
                                       marker[experts[0].id]["heldout_accuracy"], True))
            continue
        net, acc = train_group(arch, classes, size, comps, steps=steps, batch=batch, seed=seed,
                               progress=(lambda s, a=arch: progress(a, s, steps)) if progress else None)
        tensors = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
        for e in experts:
            version = store.entry(e.id).version + 1 if store.has(e.id) else 1
            entry = store.write(e, tensors, version=version)
            marker[e.id] = {"sha256": entry.sha256, "recipe": recipe, "heldout_accuracy": round(acc, 4)}
        _write_marker(marker_path, marker)
        results.append(GroupResult(arch, tuple(e.id for e in experts), tuple(comps), steps, acc, False))
    return results


def _write_marker(path: Path, marker: dict) -> None:
    """Replace the training record atomically: a crash mid-write must not leave a record that reads as garbage."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_marker(store: ExpertStore) -> tuple[Path, dict]:
    marker_path = Path(store.root) / MARKER
    try:
        return marker_path, (json.loads(marker_path.read_text()) if marker_path.is_file() else {})
    except (OSError, ValueError) as exc:
        raise CoEError(f"{marker_path}: unreadable training record ({exc}); delete it to retrain") from None


def train_detectors(model: CoEModel, store: ExpertStore, *, steps: int = DETECTOR_STEPS, batch: int = 16,
                    seed: int = 0, force: bool = False, frame_size: int = 64,
                    progress: Callable[[str, int, int], None] | None = None) -> list[DetectorResult]:
    """Train every ultralytics detector the classifiers hand ok parts to, and write it into `store`.

    Each is scored on held-out crops through the serving backend; a detector
    whose stored bytes are still what the last training wrote is skipped.
    """
    from .detector_train import evaluate, plans, train_detector

    todo = plans(model)                   # a class that cannot be drawn fails before anything is touched
    marker_path, marker = _read_marker(store)
    results = []
    for plan in todo:
        e = plan.expert
        recipe = {"steps": steps, "batch": batch, "seed": seed, "frame_size": frame_size, "arch": e.arch,
                  "classes": list(e.classes), "pairs": sorted(map(list, plan.pairs)), "input_size": e.input_size,
                  "crops": EVAL_CROPS}
        rec = marker.get(e.id, {})
        if (not force and store.has(e.id) and rec.get("sha256") == store.entry(e.id).sha256
                and rec.get("recipe") == recipe):
            results.append(DetectorResult(e.arch, e.id, plan.components, steps, rec["heldout_recall"],
                                          rec["recall_by_class"], rec["false_alarm_rate"], plan.undrawable, True,
                                          rec.get("drawn", 0)))
            continue
        tensors, _losses = train_detector(plan, steps=steps, batch=batch, seed=seed, frame_size=frame_size,
                                 progress=(lambda s, i=e.id: progress(i, s, steps)) if progress else None)
        score = evaluate(plan, tensors, seed=seed, frame_size=frame_size, crops=EVAL_CROPS)
        version = store.entry(e.id).version + 1 if store.has(e.id) else 1
        entry = store.write(e, tensors, version=version)
        marker[e.id] = {"sha256": entry.sha256, "recipe": recipe, "heldout_recall": round(score.recall, 4),
                        "recall_by_class": score.recall_by_class(),
                        "false_alarm_rate": round(score.false_alarm_rate, 4), "drawn": sum(score.drawn.values())}
        _write_marker(marker_path, marker)
        results.append(DetectorResult(e.arch, e.id, plan.components, steps, round(score.recall, 4),
                                      score.recall_by_class(), round(score.false_alarm_rate, 4),
                                      plan.undrawable, False, sum(score.drawn.values())))
    return results
