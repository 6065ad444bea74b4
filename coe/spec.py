"""The CoE model spec: which experts exist, which component uses which, and the chain edges.

A spec is plain YAML (see configs/specs/).  Loading validates everything up
front so that a typo in a 300-expert spec fails at start with the file, the key
and the reason, not at 3 a.m. when the first frame of that component arrives.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from . import yaml_strict
from .errors import SpecError, shown
from .expert import KINDS, Component, Expert, id_problem
from .request import StepOutput


@dataclass
class CoEModel:
    """Experts, components, and the chain graph between them."""

    name: str
    experts: dict[str, Expert]
    components: dict[str, Component]
    source: str = "<spec>"

    # -- chain -----------------------------------------------------------------
    def first_expert(self, component: str) -> str:
        return self.components[component].classifier

    def next_expert(self, expert_id: str, output: StepOutput) -> str | None:
        """The expert that runs after `expert_id` produced `output`, or None if the chain ends."""
        expert = self.experts[expert_id]
        if output.label is None:
            return None
        return expert.next.get(output.label)

    def preliminaries(self, expert_id: str) -> list[str]:
        """Experts whose output can lead to `expert_id` (its classifiers, for a detector)."""
        return sorted(e.id for e in self.experts.values() if expert_id in e.next.values())

    # -- probabilities -----------------------------------------------------------
    def expected_uses(self) -> dict[str, float]:
        """Expected number of times each expert runs per frame, from frequencies and priors."""
        total = sum(c.frequency for c in self.components.values())
        uses = {e: 0.0 for e in self.experts}
        for comp in self.components.values():
            uses[comp.classifier] += comp.frequency / total
        # an expert hands its mass on once all of it has arrived (topological order): linear in the edges, where
        # walking every path from each classifier took time exponential in the chain's depth
        waiting = {e: 0 for e in self.experts}
        for expert in self.experts.values():
            for nxt in expert.next.values():
                waiting[nxt] += 1
        ready = [e for e, n in waiting.items() if n == 0]
        while ready:
            eid = ready.pop()
            expert = self.experts[eid]
            for label, nxt in expert.next.items():
                uses[nxt] += uses[eid] * expert.prior(label)
                waiting[nxt] -= 1
                if not waiting[nxt]:
                    ready.append(nxt)
        stuck = [e for e, n in waiting.items() if n]
        if stuck:  # a cycle would be caught at load; guard anyway
            raise SpecError(self.source, f"experts.{stuck[0]}.next", "chain has a cycle")
        return uses

    def usage_probabilities(self) -> dict[str, float]:
        """Probability that a random request (one chain step) uses each expert; sums to 1."""
        uses = self.expected_uses()
        steps = sum(uses.values())
        return {e: u / steps for e, u in uses.items()}

    def usage_probability(self, expert_id: str) -> float:
        return self.usage_probabilities()[expert_id]

    def with_sizes(self, sizes: Mapping[str, int]) -> "CoEModel":
        """A copy whose experts carry their on-disk byte sizes (from the store manifest)."""
        experts = {k: replace(e, nbytes=int(sizes.get(k, e.nbytes))) for k, e in self.experts.items()}
        return replace(self, experts=experts)

    def with_experts(self, replacements: Mapping[str, Expert]) -> "CoEModel":
        """A copy in which the experts named in `replacements` are swapped for those (same ids, same chain)."""
        unknown = sorted(set(replacements) - set(self.experts))
        if unknown or any(e.id != k for k, e in replacements.items()):
            raise ValueError(f"with_experts replaces experts by id; unknown or renamed: {unknown or list(replacements)}")
        return replace(self, experts={k: replacements.get(k, e) for k, e in self.experts.items()})


RESERVED_IDS = frozenset({"router"})   # store entries coe-edge writes itself (routing.learned.ROUTER_ID)
MAX_NAME = 128          # a spec's or a component's name
MAX_WEIGHTS = 4096      # an expert's `weights` (a path or URI)


# -- loading -------------------------------------------------------------------

def load_spec(path: str | Path) -> CoEModel:
    """Read and validate a spec file."""
    path = Path(path)
    src = str(path)
    if not path.is_file():
        raise SpecError(src, "<file>", "spec file does not exist")
    try:
        raw = yaml_strict.load(path.read_text(encoding="utf-8"))
    except yaml_strict.DuplicateKey as exc:
        raise SpecError(src, str(exc.key), f"written twice (lines {exc.first} and {exc.line}); keep one") from None
    except yaml.YAMLError as exc:
        raise SpecError(src, "<file>", f"not valid YAML: {yaml_strict.problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(src, "<file>", f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:
        raise SpecError(src, "<file>", f"cannot read: {exc.strerror or exc}") from None
    except RecursionError:
        raise SpecError(src, "<file>", "nested too deeply to read") from None
    return parse_spec(raw, src)


def parse_spec(raw: Any, src: str = "<spec>") -> CoEModel:
    if not isinstance(raw, Mapping):
        raise SpecError(src, "<root>", "expected a mapping with 'experts' and 'components'")
    _only_keys(raw, {"name", "experts", "components"}, src, "")
    name = raw.get("name", "coe")
    if isinstance(name, (int, float)) and not isinstance(name, bool) and math.isfinite(name):
        name = str(name)                # `name: 2024` reads as a number in YAML
    name = _text(name, MAX_NAME, src, "name")
    experts_raw = _need(raw, "experts", list, src, "")
    comps_raw = _need(raw, "components", list, src, "")
    if not experts_raw:
        raise SpecError(src, "experts", "at least one expert is required")
    if not comps_raw:
        raise SpecError(src, "components", "at least one component is required")

    experts: dict[str, Expert] = {}
    for i, e in enumerate(experts_raw):
        exp = _parse_expert(e, src, f"experts[{i}]")
        if exp.id in experts:
            raise SpecError(src, f"experts[{i}].id", f"duplicate expert id '{exp.id}'")
        experts[exp.id] = exp
    for i, exp in enumerate(experts.values()):
        for label, nxt in exp.next.items():
            if nxt not in experts:
                raise SpecError(src, f"experts[{i}].next.{label}", f"unknown expert '{nxt}'")
    _check_acyclic(experts, src)

    components: dict[str, Component] = {}
    for i, c in enumerate(comps_raw):
        key = f"components[{i}]"
        if not isinstance(c, Mapping):
            raise SpecError(src, key, "expected a mapping")
        _only_keys(c, {"name", "classifier", "frequency"}, src, key)
        cname = _text(_need(c, "name", str, src, key), MAX_NAME, src, f"{key}.name")
        cls = _need(c, "classifier", str, src, key)
        freq = c.get("frequency", 1.0)
        if cls not in experts:
            raise SpecError(src, f"{key}.classifier", f"unknown expert '{cls}'")
        if experts[cls].kind != "classifier":
            raise SpecError(src, f"{key}.classifier", f"expert '{cls}' is a {experts[cls].kind}, not a classifier")
        if not isinstance(freq, (int, float)) or isinstance(freq, bool) or not 0 < freq < math.inf:
            # NaN fails both comparisons: it would make every usage probability NaN (eviction, pool fill)
            raise SpecError(src, f"{key}.frequency", f"must be a positive finite number, got {shown(freq)}")
        if cname in components:
            raise SpecError(src, f"{key}.name", f"duplicate component '{cname}'")
        components[cname] = Component(cname, cls, float(freq))
    return CoEModel(name=name, experts=experts, components=components, source=src)


def _parse_expert(e: Any, src: str, key: str) -> Expert:
    if not isinstance(e, Mapping):
        raise SpecError(src, key, "expected a mapping")
    _only_keys(e, {"id", "arch", "kind", "classes", "input_size", "next", "pass_labels",
                   "priors", "conf_threshold", "weights"}, src, key)
    eid = _need(e, "id", str, src, key)
    if (problem := id_problem(eid)) is not None:
        raise SpecError(src, f"{key}.id", f"{eid!r} {problem}")
    if eid in RESERVED_IDS:
        raise SpecError(src, f"{key}.id", f"'{eid}' is reserved (the learned router's entry in the expert store)")
    arch = _need(e, "arch", str, src, key)
    if "/" not in arch:
        raise SpecError(src, f"{key}.arch", f"expected 'family/model' like 'torchvision/resnet18', got '{arch}'")
    kind = _need(e, "kind", str, src, key)
    if kind not in KINDS:
        raise SpecError(src, f"{key}.kind", f"must be one of {', '.join(KINDS)}, got '{kind}'")
    classes = _need(e, "classes", list, src, key)
    if not classes or not all(isinstance(c, str) and c for c in classes):
        raise SpecError(src, f"{key}.classes", "must be a non-empty list of non-empty strings")
    if len(set(classes)) != len(classes):
        raise SpecError(src, f"{key}.classes", "has duplicate labels")
    size = e.get("input_size", 64)
    if not isinstance(size, int) or isinstance(size, bool) or not 16 <= size <= 2048:
        raise SpecError(src, f"{key}.input_size", f"must be an integer in 16..2048, got {shown(size)}")
    if kind == "detector" and size % 32:
        raise SpecError(src, f"{key}.input_size", f"a detector's input size must be a multiple of 32, got {size}")
    nxt = e.get("next", {})
    if nxt is None or (isinstance(nxt, (list, str)) and not nxt):   # `next:`, `next: []`, `next: ""`: none
        nxt = {}
    if not isinstance(nxt, Mapping) or not all(isinstance(v, str) for v in nxt.values()):
        raise SpecError(src, f"{key}.next", "must map an output label to an expert id")
    for label in nxt:
        if label not in classes:
            raise SpecError(src, f"{key}.next.{label}", f"'{label}' is not one of this expert's classes")
    pass_labels = e.get("pass_labels", ["ok"] if "ok" in classes else [])
    if not isinstance(pass_labels, list) or any(p not in classes for p in pass_labels):
        raise SpecError(src, f"{key}.pass_labels", "must be a list of this expert's classes")
    if len(set(pass_labels)) != len(pass_labels):
        raise SpecError(src, f"{key}.pass_labels", "has duplicate labels")
    priors = e.get("priors")
    if priors is None:
        priors = _default_priors(classes, pass_labels)
    if not isinstance(priors, Mapping):
        raise SpecError(src, f"{key}.priors", "must map label to a probability")
    for label, p in priors.items():
        if label not in classes:
            raise SpecError(src, f"{key}.priors.{label}", f"'{label}' is not one of this expert's classes")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
            raise SpecError(src, f"{key}.priors.{label}", f"must be a probability in [0, 1], got {shown(p)}")
    if abs(sum(priors.values()) - 1.0) > 1e-6:
        raise SpecError(src, f"{key}.priors", f"must sum to 1, sums to {sum(priors.values()):.4f}")
    conf = e.get("conf_threshold", 0.25)
    if not isinstance(conf, (int, float)) or not 0 < conf < 1:
        raise SpecError(src, f"{key}.conf_threshold", f"must be in (0, 1), got {shown(conf)}")
    weights = _text(e.get("weights", ""), MAX_WEIGHTS, src, f"{key}.weights", least=0)
    return Expert(id=eid, arch=arch, kind=kind, classes=tuple(classes), input_size=size,
                  next=dict(nxt), pass_labels=tuple(pass_labels),
                  priors={k: float(v) for k, v in priors.items()}, conf_threshold=float(conf),
                  uri=weights)


def _default_priors(classes: list[str], pass_labels: list[str]) -> dict[str, float]:
    """90% pass, the rest spread over the other labels: a plausible line yield."""
    others = [c for c in classes if c not in pass_labels]
    if not pass_labels or not others:
        return {c: 1.0 / len(classes) for c in classes}
    pri = {c: 0.9 / len(pass_labels) for c in pass_labels}
    pri.update({c: 0.1 / len(others) for c in others})
    return pri


def _check_acyclic(experts: dict[str, Expert], src: str) -> None:
    state: dict[str, int] = {}      # 1: on the path being walked, 2: done
    for root in experts:
        if root in state:
            continue
        state[root] = 1
        stack = [(root, iter(experts[root].next.values()))]
        while stack:    # depth first with a stack of its own: a chain of 1000 experts is not a recursion limit
            eid, todo = stack[-1]
            for nxt in todo:
                if state.get(nxt) == 1:
                    raise SpecError(src, f"experts.{eid}.next", f"chain cycle through '{nxt}'")
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, iter(experts[nxt].next.values())))
                    break
            else:
                state[eid] = 2
                stack.pop()


def _need(m: Mapping, key: str, typ: type, src: str, prefix: str) -> Any:
    full = f"{prefix}.{key}" if prefix else key
    if key not in m:
        raise SpecError(src, full, "is required")
    val = m[key]
    if not isinstance(val, typ) or (typ is not bool and isinstance(val, bool)):
        raise SpecError(src, full, f"must be a {typ.__name__}, got {type(val).__name__}")
    return val


def _text(val: Any, limit: int, src: str, key: str, least: int = 1) -> str:
    """`val` if it is a string of least..limit characters: never str() of a list (YAML aliases nest one list in
    another: 600 bytes of spec expand to gigabytes of text)."""
    if not isinstance(val, str):
        raise SpecError(src, key, f"must be a string, got {type(val).__name__}")
    if not least <= len(val) <= limit:
        raise SpecError(src, key, f"must be {least} to {limit} characters, got {len(val)}")
    return val




def _only_keys(m: Mapping, allowed: set[str], src: str, prefix: str) -> None:
    for k in m:
        if k not in allowed:
            full = f"{prefix}.{k}" if prefix else str(k)
            raise SpecError(src, full, f"unknown key (allowed: {', '.join(sorted(allowed))})")
