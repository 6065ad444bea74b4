"""Rule routing: the AOI machine names the component, the spec names its classifier."""
from __future__ import annotations

from dataclasses import dataclass

from coe import CoEModel


@dataclass(frozen=True)
class Route:
    """Where a frame's chain starts, and how sure the router is."""

    expert_id: str
    confidence: float
    router: str
    component: str | None = None   # the type it routed the frame as (several types may share a classifier)


class RouteError(Exception):
    """The frame cannot be routed; `reason` is a protocol reject code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


class RuleRouter:
    """Maps a header's `component` to that component's classifier."""

    name = "rules"

    def __init__(self, model: CoEModel) -> None:
        self.model = model

    def route(self, component: str | None, image: object = None) -> Route:
        if component is None:
            raise RouteError("missing_field", "field 'component' is required for rule routing")
        comp = self.model.components.get(component)
        if comp is None:
            known = ", ".join(sorted(self.model.components)[:8])
            raise RouteError("unknown_component",
                             f"component '{component}' is not in spec {self.model.name} (known: {known}, ...)")
        return Route(comp.classifier, 1.0, self.name, comp.name)
