"""Seeded paper-scale workloads (DESIGN.md §9, CoServe §5.1): boards of component images in order.

Board A has 352 component types and Board B 342; one image arrives every 4 ms;
the model's component frequencies are the counts on the drawn board (what a
line knows about its board, and what the paper computes its probabilities from);
tasks A1/B1 are 2,500 requests and A2/B2 3,500.  Each type has its own
ResNet-101-class classifier; a share of types continue on "ok" to one of a few
shared YOLO detectors.  Type frequency follows a Zipf law with a tunable skew,
so results are not tuned to one shape.  Pure Python: no torch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .expert import Component, Expert
from .spec import CoEModel

# Weight bytes of the architectures (fp32 state dicts as torchvision/ultralytics build them)
ARCH_BYTES = {
    "torchvision/resnet101": 170_500_000,
    "torchvision/resnet18": 44_800_000,
    "ultralytics/yolov8m": 104_000_000,
    "ultralytics/yolov8l": 175_000_000,
    "ultralytics/yolov8n": 12_100_000,
}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "A1"
    board: str = "A"
    types: int = 352
    requests: int = 2500
    interval: float = 0.004
    skew: float = 0.8
    detector_share: float = 0.5
    detectors: int = 6
    board_size: int = 500
    ok_rate: float = 0.9
    classifier_arch: str = "torchvision/resnet101"
    detector_archs: tuple[str, ...] = ("ultralytics/yolov8m", "ultralytics/yolov8l")
    seed: int = 0


TASKS = {
    "A1": WorkloadSpec("A1", "A", 352, 2500),
    "A2": WorkloadSpec("A2", "A", 352, 3500),
    "B1": WorkloadSpec("B1", "B", 342, 2500),
    "B2": WorkloadSpec("B2", "B", 342, 3500),
}


def task(name: str, **overrides) -> WorkloadSpec:
    try:
        return replace(TASKS[name], **overrides)
    except KeyError:
        raise ValueError(f"unknown workload '{name}' (known: {', '.join(sorted(TASKS))})") from None


@dataclass(frozen=True)
class Arrival:
    t: float
    frame_id: str
    component: str
    ok: bool           # whether the classifier's label continues the chain (to the detector), if any
    label: str = "ok"  # that label, when `ok`: a classifier with several `next` edges sends each elsewhere


def next_expert(model: CoEModel, arrival: Arrival) -> str | None:
    """The expert an arrival's frame runs after its classifier (None: the classifier's verdict ends it)."""
    if not arrival.ok:
        return None
    return model.experts[model.components[arrival.component].classifier].next.get(arrival.label)


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    model: CoEModel
    arrivals: tuple[Arrival, ...]


def make_workload(spec: WorkloadSpec) -> Workload:
    """The CoE model of the board and the seeded arrival stream of the task."""
    board_rng = random.Random(f"board-{spec.board}-{spec.seed}")   # the board, shared by its tasks
    dets = [Expert(f"det-{i}", spec.detector_archs[i % len(spec.detector_archs)], "detector",
                   ("defect",), 640, nbytes=ARCH_BYTES[spec.detector_archs[i % len(spec.detector_archs)]])
            for i in range(spec.detectors)]
    experts = {d.id: d for d in dets}
    comps = {}
    for i in range(spec.types):
        name = f"{spec.board}-T{i:03d}"
        nxt = {}
        if spec.detectors and board_rng.random() < spec.detector_share:
            nxt = {"ok": dets[board_rng.randrange(spec.detectors)].id}
        cls = Expert(f"cls-{name}", spec.classifier_arch, "classifier", ("ok", "defect"), 224, next=nxt,
                     priors={"ok": spec.ok_rate, "defect": 1 - spec.ok_rate},
                     nbytes=ARCH_BYTES.get(spec.classifier_arch, 100_000_000))
        experts[cls.id] = cls
        comps[name] = Component(name, cls.id, 1.0 / (i + 1) ** spec.skew)
    model = CoEModel(f"board-{spec.board}", experts, comps, source=f"workload {spec.name}")
    names = list(comps)
    weights = [comps[n].frequency for n in names]
    layout = board_rng.choices(names, weights=weights, k=spec.board_size)
    # The line knows its board: usage probabilities come from the component counts on it (CoServe §4.5),
    # not from the law the board was drawn from.  Types the board does not carry get frequency 0.
    counts = {n: 0 for n in names}
    for n in layout:
        counts[n] += 1
    model = replace(model, components={n: replace(c, frequency=float(counts[n])) for n, c in comps.items()})
    rng = random.Random(f"task-{spec.name}-{spec.seed}")
    arrivals = tuple(Arrival(i * spec.interval, f"{spec.name}-{i:05d}", layout[i % len(layout)],
                             rng.random() < spec.ok_rate) for i in range(spec.requests))
    return Workload(spec, model, arrivals)


def from_model(model: CoEModel, requests: int, *, interval: float = 0.004, board_size: int = 200,
               seed: int = 0) -> Workload:
    """A seeded board stream for a line's own spec: layout by component frequency, outcomes by priors."""
    rng = random.Random(f"line-{model.name}-{seed}")
    names = list(model.components)
    layout = rng.choices(names, weights=[model.components[n].frequency for n in names], k=board_size)
    arrivals = []
    for i in range(requests):
        comp = layout[i % len(layout)]
        cls = model.experts[model.components[comp].classifier]
        # one draw decides whether the chain goes on and along which edge: the labels with a `next` edge in
        # turn, each by its prior (one edge, 'ok': exactly the draw `u < prior(ok)`)
        u, below, label = rng.random(), 0.0, None
        for edge in cls.next:
            below += cls.prior(edge)
            if u < below:
                label = edge
                break
        arrivals.append(Arrival(i * interval, f"{model.name}-{i:05d}", comp, label is not None, label or "ok"))
    return Workload(WorkloadSpec(name=model.name, requests=requests, interval=interval, seed=seed), model,
                    tuple(arrivals))
