"""Find a transformers model's MoE experts modules by their structure, not by class name.

transformers 5 gives about 65 MoE families one experts module: a forward of
`(hidden_states, top_k_index, top_k_weights)` and two fused 3-D parameters,
`gate_up_proj [E, 2I, H]` (gate rows first, then up) and `down_proj [E, H, I]`.
A module with exactly that is pooled whatever its class is called.  A module
that looks like an experts module but has another layout (GPT-OSS: transposed,
interleaved, with biases; Llama 4: a forward without routing; Switch: a dict of
separate MLPs) is refused with its path and the reason, so a user knows at
once why their model cannot be served rather than getting wrong text.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coe import CoEError

if TYPE_CHECKING:
    from torch import nn

SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")
_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")
# the flags transformers' @use_experts_implementation sets, and the values of the layout we compute
_FLAGS = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True,
          "has_post_expert_norm": False}


@dataclass(frozen=True)
class ExpertsSite:
    """One servable experts module: where it is, which layer, and the shape of one expert."""

    path: str
    layer: int
    num_experts: int
    hidden: int
    intermediate: int
    router: str | None          # the sibling module that produces the router logits, if found


def _looks_like_experts(name: str, module: "nn.Module") -> bool:
    cls = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    params = {n for n, _ in module.named_parameters(recurse=False)}
    return (cls.endswith("Experts") or leaf == "experts"
            or bool({"gate_up_proj", "down_proj"} & params and any(p.dim() == 3 for p in module.parameters(False))))


def why_not_servable(module: "nn.Module") -> str | None:
    """None if `module` has the fused experts layout; else the reason it does not."""
    try:
        params = [p for p in inspect.signature(type(module).forward).parameters if p != "self"]
    except (TypeError, ValueError):
        params = []
    if tuple(params[:3]) != SIGNATURE or any(
            inspect.signature(type(module).forward).parameters[p].default is inspect.Parameter.empty
            for p in params[3:]):
        return f"its forward takes ({', '.join(params)}), not ({', '.join(SIGNATURE)})"
    own = {n: p for n, p in module.named_parameters(recurse=False)}
    extra = sorted(set(own) - {"gate_up_proj", "down_proj"})
    if extra:
        return f"it has parameters beyond gate_up_proj and down_proj: {', '.join(extra)}"
    if "gate_up_proj" not in own or "down_proj" not in own:
        return "it lacks the fused gate_up_proj and down_proj parameters"
    gu, dn = own["gate_up_proj"], own["down_proj"]
    if gu.dim() != 3 or dn.dim() != 3:
        return f"gate_up_proj {list(gu.shape)} and down_proj {list(dn.shape)} are not 3-D [experts, out, in]"
    e, two_i, h = gu.shape
    if dn.shape[0] != e or dn.shape[1] != h or two_i != 2 * dn.shape[2]:
        return (f"gate_up_proj {list(gu.shape)} and down_proj {list(dn.shape)} do not fit "
                "[E, 2I, H] and [E, H, I]")
    for flag, want in _FLAGS.items():
        if hasattr(module, flag) and bool(getattr(module, flag)) != want:
            return f"its weights are laid out with {flag}={getattr(module, flag)} (coe-edge serves {flag}={want})"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        return "it applies its own gate function, not act_fn(gate) * up"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn for act_fn(gate) * up"
    for child_name, child in module.named_children():
        if child_name != "act_fn" and any(True for _ in child.parameters()):
            return f"it holds a sub-module with weights ('{child_name}')"
    return None


def find_experts(model: "nn.Module") -> list[ExpertsSite]:
    """Every experts module of `model`, in layer order; an error for any it cannot serve or if none exist."""
    sites, refused = [], []
    modules = dict(model.named_modules())
    taken: list[str] = []
    for name, module in modules.items():
        if not name or any(name.startswith(t + ".") for t in taken) or not _looks_like_experts(name, module):
            continue
        taken.append(name)
        why = why_not_servable(module)
        if why is not None:
            refused.append(f"'{name}' ({type(module).__name__}): {why}")
            continue
        e, two_i, h = module.gate_up_proj.shape
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else len(sites)
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        sites.append(ExpertsSite(name, layer, int(e), int(h), int(two_i) // 2,
                                 _find_router(modules, parent, name, int(e), int(h))))
    if refused:
        raise CoEError(f"{type(model).__name__}: cannot pool these experts modules: " + "; ".join(refused[:3])
                       + (f" (and {len(refused) - 3} more)" if len(refused) > 3 else "")
                       + f". coe-edge serves experts with forward({', '.join(SIGNATURE)}) and fused "
                         "gate_up_proj [E, 2I, H], down_proj [E, H, I]")
    if not sites:
        raise CoEError(f"{type(model).__name__}: no MoE experts module found (coe-edge serves modules with "
                       f"forward({', '.join(SIGNATURE)}) and fused gate_up_proj [E, 2I, H], down_proj [E, H, I])")
    if len({s.layer for s in sites}) != len(sites):
        raise CoEError(f"{type(model).__name__}: two experts modules map to one layer index: "
                       + ", ".join(s.path for s in sites))
    return sorted(sites, key=lambda s: s.layer)


def _find_router(modules: dict, parent: str, experts: str, num_experts: int, hidden: int) -> str | None:
    """The sibling of the experts module whose weight is [E, H]: it produces the router logits."""
    prefix = parent + "." if parent else ""
    for name, module in modules.items():
        if not name.startswith(prefix) or name == experts or "." in name[len(prefix):]:
            continue
        w = getattr(module, "weight", None)
        if w is not None and getattr(w, "dim", lambda: 0)() == 2 and tuple(w.shape) == (num_experts, hidden):
            return name
    return None
