"""What an MoE model's routers ask for: a hook on each router, its statistics and its traces.

The router of every transformers MoE family returns `(router_logits,
top_k_weights, top_k_index)`.  `RouterTap` hooks those modules (found by
structure, `storage.moe_structure`) and keeps, per expert id:
- `counts`: how many tokens chose it so far (LFU; the prompt's prefill seeds it);
- `gate_scores`: its gate score averaged over the last `window` router calls,
  for every expert, chosen or not (the importance paper's Eq. 3);
- `predicted` (with `predict_with`): a token-wise predictor's probability
  that the next token asks for each expert;
and, while recording, every token's full router probabilities and chosen
experts, which become a `Trace`.  Pools read these through `context()`;
they never see the model.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from coe import CoEError
from coe.moe import MoELayout, expert_id

from .moe_trace import Trace
from .substitution import WeightRule, substitute, warn_approximate

if TYPE_CHECKING:
    import torch
    from torch import nn


class RouterTap:
    """Hooks on an MoE model's routers; see the module docstring."""

    def __init__(self, layout: MoELayout, window: int = 8) -> None:
        if window < 1:
            raise CoEError(f"gate-score window must be at least 1 step, got {window}")
        self.layout = layout
        self.window = window
        self._ids = {l.layer: [expert_id(layout.model, l.layer, e) for e in range(l.num_experts)]
                     for l in layout.layers}
        self._recent: dict[int, deque] = {l.layer: deque(maxlen=window) for l in layout.layers}
        self.counts: dict[str, float] = {}
        self._scores: dict[str, float] | None = {}
        self._hooks: list = []
        self._rec: dict[int, list[tuple[np.ndarray, np.ndarray]]] | None = None
        self._rec_meta: list[tuple[int, int, int]] = []     # (seq, step, tokens) per forward pass
        self._seq, self._step = 0, 0
        self.alpha = 0.0                # importance-driven substitution (`substitute_with`); 0 = exact
        self._rule = WeightRule()
        self._resident_of = None
        self.substituted = 0
        self.missing_low = 0
        self._listeners: list = []
        self._predicted: dict[str, float] = {}
        # the layer thread appends router calls while a prefetch thread ranks victims on `gate_scores`: the
        # history and its cached mean change under this lock, and a mean built from an older history is not kept
        self._lock = threading.Lock()
        self._version = 0

    # -- hooking ------------------------------------------------------------------
    def attach(self, model: "nn.Module", routers: dict[int, str]) -> "RouterTap":
        """Hook `routers` (layer -> module path); every MoE layer must have one."""
        modules = dict(model.named_modules())
        missing = [l.layer for l in self.layout.layers if routers.get(l.layer) not in modules]
        if missing:
            raise CoEError(f"model '{self.layout.model}': no router module found for MoE layers {missing[:5]} "
                           "(a sibling of the experts module with a [num_experts, hidden] weight)")
        for layer, path in routers.items():
            self._hooks.append(modules[path].register_forward_hook(self._hook(layer, path)))
        return self

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, layer: int, path: str):
        import torch

        sigmoid = self.layout.scoring == "sigmoid"

        def hook(module, inputs, output):
            if not isinstance(output, tuple) or len(output) < 3:
                raise CoEError(f"router '{path}' returned {type(output).__name__}, not (logits, weights, indices)")
            logits, weights, index = output[0], output[1], output[2]
            with torch.no_grad():
                flat = logits.reshape(-1, logits.shape[-1]).float()
                probs = (flat.sigmoid() if sigmoid else flat.softmax(dim=-1)).cpu().numpy()
                chosen = index.reshape(probs.shape[0], -1).cpu().numpy()
                replaced = None
                rank = _router_rank(module, flat.sigmoid()) if sigmoid and self.alpha > 0 else None
                sub = self.route(layer, probs, chosen, rank)
                if sub is not None:
                    rows = torch.from_numpy(sub.changed).to(index.device)
                    new_index = index.reshape(chosen.shape).clone()
                    new_index[rows] = torch.from_numpy(sub.chosen[sub.changed]).to(index.device, index.dtype)
                    new_weights = weights.reshape(chosen.shape).clone()
                    new_weights[rows] = torch.from_numpy(sub.weights[sub.changed]).to(weights.device, weights.dtype)
                    replaced = (output[0], new_weights.reshape(weights.shape), new_index.reshape(index.shape),
                                *output[3:])
            return replaced      # None keeps the router's own output (always, with alpha = 0)
        return hook

    def route(self, layer: int, probs: np.ndarray, chosen: np.ndarray, rank: np.ndarray | None = None):
        """The routing decision for one router call: substitution (if on), then the statistics.

        Returns the `Substitution` when experts were replaced, else None (the router's choice stands).
        Used by the hook and by trace-driven decode, which has no router to hook.  `rank`: what the router
        selects on where that is not the gate score (`_router_rank`).
        """
        self._check(layer, probs, chosen)   # before substitution counts anything
        sub = None
        if self.alpha > 0 and self._resident_of is not None:
            sub = substitute(probs, chosen, self._resident_of(layer), self.alpha, self._rule, rank)
            self.substituted += sub.substituted
            self.missing_low += sub.missing_low
            if not sub.substituted:
                sub = None
        self.observe(layer, probs, sub.chosen if sub is not None else chosen)
        return sub

    def substitute_with(self, alpha: float, rule: WeightRule, resident_of) -> None:
        """Turn on importance-driven substitution (alpha > 0 is approximate; 0 turns it off)."""
        if not 0 <= alpha < 1:
            raise CoEError(f"substitution threshold alpha must be in [0, 1), got {alpha}")
        self.alpha, self._rule, self._resident_of = alpha, rule, resident_of
        warn_approximate(alpha)

    def predict_with(self, scorer) -> None:
        """Feed a `routing.moe_predictor.NextTokenScores` every router call; pools then see its `predicted`."""
        self.listen(scorer.on_router)
        self._predicted = scorer.scores

    def listen(self, fn) -> None:
        """Call `fn(layer, probs, chosen)` on every router call (a token-wise prefetcher)."""
        self._listeners.append(fn)

    def _check(self, layer: int, probs: np.ndarray, index: np.ndarray) -> np.ndarray:
        """`probs`/`index` of one router call checked against the layer (before any state changes: a wrong
        shape used to be kept, and fail every later ranking on another thread); the chosen experts a layer has
        (an index past the experts, a router's padding, is no expert: left out of the counts)."""
        ids = self._ids.get(layer)
        if ids is None:
            raise CoEError(f"model '{self.layout.model}': no MoE layer {layer} (layers: "
                           f"{', '.join(str(l) for l in self._ids)})")
        probs, index = np.asarray(probs), np.asarray(index)
        if probs.ndim != 2 or probs.shape[1] != len(ids):
            raise CoEError(f"layer {layer}: router scores of shape {list(probs.shape)}, expected [tokens, "
                           f"{len(ids)}]")
        if index.ndim != 2 or index.shape[0] != probs.shape[0] or not np.issubdtype(index.dtype, np.integer):
            raise CoEError(f"layer {layer}: chosen experts of shape {list(index.shape)} ({index.dtype}), expected "
                           f"integers [{probs.shape[0]}, k]")
        return index[(index >= 0) & (index < len(ids))]

    def observe(self, layer: int, probs: np.ndarray, index: np.ndarray) -> None:
        """One router call of `layer`: gate scores [T, E] and chosen experts [T, k] (from a hook or a trace)."""
        chosen = self._check(layer, probs, index)
        for fn in self._listeners:
            fn(layer, probs, index)
        ids = self._ids[layer]
        with self._lock:
            self._recent[layer].append(probs.astype(np.float32).mean(axis=0))
            for e, n in zip(*np.unique(chosen, return_counts=True)):
                self.counts[ids[int(e)]] = self.counts.get(ids[int(e)], 0.0) + float(n)
            self._scores = None
            self._version += 1
        first = layer == self.layout.layers[0].layer
        if self._rec is not None:
            self._rec[layer].append((probs.astype(np.float16), index.astype(np.int16)))
            if first:
                self._rec_meta.append((self._seq, self._step, int(probs.shape[0])))
                self._step += 1

    # -- what the pools see ------------------------------------------------------------
    def gate_scores(self) -> dict[str, float]:
        with self._lock:
            if self._scores is not None:
                return self._scores
            version = self._version
            history = {layer: list(recent) for layer, recent in self._recent.items() if recent}
        scores = {}
        for layer, recent in history.items():
            mean = np.mean(np.stack(recent), axis=0)
            scores.update(zip(self._ids[layer], mean.tolist()))
        with self._lock:
            if self._version == version:    # no router call since the snapshot: the mean is current
                self._scores = scores
        return scores

    def context(self) -> dict:
        return {"counts": self.counts, "gate_scores": self.gate_scores(), "predicted": self._predicted}

    # -- recording -------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        return self._rec is not None

    def start_recording(self) -> None:
        self._rec = {l.layer: [] for l in self.layout.layers}
        self._rec_meta = []
        self._seq, self._step = 0, 0

    def abort_recording(self) -> None:
        """Drop a partial recording (the run that fed it failed)."""
        self._rec, self._rec_meta = None, []

    def next_sequence(self) -> None:
        """The following forward passes belong to the next prompt (its step 0 is the prefill)."""
        if self._rec is not None and self._rec_meta and self._rec_meta[-1][0] == self._seq:
            self._seq += 1
        self._step = 0

    def stop_recording(self, prompts: Iterable[str] = ()) -> Trace:
        if self._rec is None:
            raise CoEError("router tap: stop_recording without start_recording")
        rec, meta, self._rec = self._rec, self._rec_meta, None
        layers = [l.layer for l in self.layout.layers]
        if not meta:
            raise CoEError("router tap: nothing was recorded")
        probs = np.stack([np.concatenate([p for p, _ in rec[l]]) for l in layers], axis=1)
        chosen = np.stack([np.concatenate([c for _, c in rec[l]]) for l in layers], axis=1)
        seq = np.concatenate([np.full(n, s, dtype=np.int32) for s, _, n in meta])
        step = np.concatenate([np.full(n, k, dtype=np.int32) for _, k, n in meta])
        return Trace(model=self.layout.model, layers=tuple(layers), top_k=self.layout.top_k,
                     scoring=self.layout.scoring, probs=probs, chosen=chosen, seq=seq, step=step)


def _router_rank(module, scores) -> np.ndarray | None:
    """[T, E] what a sigmoid router selects its experts on, where that is not the gate score: DeepSeek-V3's
    sigmoid + `e_score_correction_bias`, within its `topk_group` best groups of `num_group` (a group scores the
    sum of its best two), -inf outside them; as transformers' `DeepseekV3TopkRouter.forward` computes it.
    None for a router that selects on the gate scores alone."""
    import torch

    bias = getattr(module, "e_score_correction_bias", None)
    groups, keep = int(getattr(module, "num_group", 1) or 1), int(getattr(module, "topk_group", 1) or 1)
    if bias is None and groups <= 1:
        return None
    with torch.no_grad():
        rank = scores + bias.to(scores.dtype) if bias is not None else scores.clone()
        E = rank.shape[-1]
        if groups > 1 and E % groups == 0 and keep < groups:
            per = rank.view(-1, groups, E // groups)
            best = per.topk(min(2, E // groups), dim=-1)[0].sum(dim=-1)
            mask = torch.zeros_like(best).scatter_(1, torch.topk(best, k=keep, dim=-1)[1], 1.0).bool()
            rank = rank.masked_fill(~mask.unsqueeze(-1).expand_as(per).reshape(-1, E), float("-inf"))
        return rank.cpu().numpy()
