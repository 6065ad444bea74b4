"""Data that crosses package boundaries: frames, requests, step results, verdicts."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy types only for the checker; coe never imports numpy/torch at run time
    import numpy as np

VERDICTS = ("pass", "defect", "error")

_request_ids = itertools.count(1)


@dataclass
class Frame:
    """A validated, decoded frame as ingest accepted it."""

    frame_id: str
    line: str
    board_id: str
    component: str
    ts: float
    image: "np.ndarray"  # HxWx3 uint8, RGB
    received_at: float = field(default_factory=time.time)


@dataclass
class Request:
    """One (frame, expert) step of a chain.  `stage` counts steps from 0."""

    frame: Frame
    expert_id: str
    stage: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_request_ids))


@dataclass(frozen=True)
class StepOutput:
    """What one expert said about one frame.

    For a classifier `label`/`score` are set; for a detector `boxes` holds
    `[x1, y1, x2, y2, conf, cls_label]` rows above the expert's threshold.
    """

    label: str | None = None
    score: float | None = None
    boxes: tuple[tuple[Any, ...], ...] = ()

    def to_json(self) -> dict:
        if self.boxes or self.label is None:
            return {"boxes": [list(b) for b in self.boxes]}
        return {"label": self.label, "score": round(float(self.score or 0.0), 6)}


@dataclass(frozen=True)
class StepError:
    """Why one frame of a batch has no `StepOutput`, where the frames beside it have one.

    It stands in that frame's place in a batch's outputs, so a failure one
    frame causes (its output not finite, it does not fit in memory even alone,
    the expert raises on it and on no other) gives that frame an error verdict
    and leaves the rest of the batch its results.  `kind` is the `errors`
    table's kind.
    """

    kind: str
    message: str


def finite_problem(output: StepOutput) -> str | None:
    """Why `output` cannot be decided on (a NaN or infinite score or box value), or None.

    NaN slips through every comparison a decision makes: argmax of NaN logits
    is label 0 (`ok`), a NaN box never clears a confidence threshold, so a
    broken expert would pass every frame.
    """
    import math

    if output.score is not None and not math.isfinite(float(output.score)):
        return f"score {output.score}"
    for box in output.boxes:
        for v in box[:5]:
            if not math.isfinite(float(v)):
                return f"box value {v}"
    return None


@dataclass(frozen=True)
class Verdict:
    """The final decision on one frame."""

    frame_id: str
    line: str
    board_id: str
    component: str
    verdict: str
    reason: str
    decided_at: float
    latency_ms: float
    chain: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "frame_id": self.frame_id,
            "line": self.line,
            "board_id": self.board_id,
            "component": self.component,
            "verdict": self.verdict,
            "reason": self.reason,
            "decided_at": self.decided_at,
            "latency_ms": round(self.latency_ms, 3),
            "chain": list(self.chain),
        }
