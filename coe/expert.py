"""The expert: a named set of tensors with a byte size and a role in a chain."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

KINDS = ("classifier", "detector", "moe-ffn")


@dataclass(frozen=True)
class Expert:
    """One expert model as the spec declares it.

    `nbytes` is filled in from the expert store's manifest once the zoo is built;
    the spec alone does not know it.  `next` maps a classifier output label to the
    expert that runs after it (the chain edge).  `priors` is the expected share of
    each output label; it drives usage probabilities and weight calibration.
    """

    id: str
    arch: str
    kind: str
    classes: tuple[str, ...]
    input_size: int
    next: dict[str, str] = field(default_factory=dict)
    pass_labels: tuple[str, ...] = ("ok",)
    priors: dict[str, float] = field(default_factory=dict)
    conf_threshold: float = 0.25
    nbytes: int = 0
    uri: str = ""

    @property
    def family(self) -> str:
        """The backend family, e.g. 'torchvision' of 'torchvision/resnet18'."""
        return self.arch.split("/", 1)[0]

    @property
    def model_name(self) -> str:
        """The architecture name inside its family, e.g. 'resnet18'."""
        return self.arch.split("/", 1)[1] if "/" in self.arch else self.arch

    def prior(self, label: str) -> float:
        """Expected share of `label` among this expert's outputs."""
        return self.priors.get(label, 0.0)


@dataclass(frozen=True)
class Component:
    """A component type the AOI machine cuts out of a board image."""

    name: str
    classifier: str
    frequency: float


def id_problem(expert_id: object) -> str | None:
    """Why `expert_id` cannot name an expert (its store file is named after it), or None.

    Checked where an id enters (a spec) and again where a file is named
    (`storage.expert_store`): a path in an id would write outside the store.
    """
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if (not isinstance(expert_id, str) or not expert_id or expert_id.startswith(".") or ".." in expert_id
            or any(s in expert_id for s in seps) or any(ord(c) < 32 for c in expert_id)):
        return "cannot name a store file: no path separators, '..', leading '.', or control characters"
    return None
