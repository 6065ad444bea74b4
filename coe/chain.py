"""What happens after an expert speaks: the next step of the chain, or the verdict."""
from __future__ import annotations

from dataclasses import dataclass

from .request import StepOutput
from .spec import CoEModel


@dataclass(frozen=True)
class Decision:
    """Either `next_expert` is set (run it) or `verdict`/`reason` are (the chain ends)."""

    next_expert: str | None = None
    verdict: str | None = None
    reason: str = ""


def decide(model: CoEModel, expert_id: str, output: StepOutput) -> Decision:
    """Apply the spec's chain semantics to one step's output.

    A classifier label with a `next` edge runs that expert; a pass label without
    one passes; any other label is a defect.  A detector passes unless it found
    a box above its threshold.  A classifier that gave no label is an error, not
    a pass: a frame nobody judged must not read as good.
    """
    expert = model.experts[expert_id]
    nxt = model.next_expert(expert_id, output)
    if nxt is not None:
        return Decision(next_expert=nxt)
    if expert.kind != "detector" and output.label is None:
        return Decision(verdict="error", reason=f"{expert_id}: the classifier gave no label")
    if expert.kind == "detector":
        if output.boxes:
            labels = sorted({str(b[5]) for b in output.boxes})
            best = max(float(b[4]) for b in output.boxes)
            return Decision(verdict="defect",
                            reason=f"{expert_id}: {len(output.boxes)} box(es) {', '.join(labels)} (max conf {best:.2f})")
        return Decision(verdict="pass", reason=f"{expert_id}: no defect found")
    score = f" ({output.score:.2f})" if output.score is not None else ""
    if output.label in expert.pass_labels:
        return Decision(verdict="pass", reason=f"{expert_id}: {output.label}{score}")
    return Decision(verdict="defect", reason=f"{expert_id}: {output.label}{score}")
