"""MoE routing traces: per token and per MoE layer, the full router probabilities and the chosen experts.

A trace is one safetensors file (numpy arrays, JSON metadata; nothing is
unpickled):
- `probs` [N, L, E] float16: every expert's gate score for each token;
- `chosen` [N, L, k] int16: the experts the router picked;
- `seq` [N] int32: which prompt the token belongs to;
- `step` [N] int32: which forward pass of that prompt (0 is the prefill).
`coe-agent llm trace` records them from a real model; `synthetic` draws them
from measured per-layer popularity (Mixtral).  Replays read accesses from
them: each forward pass asks each layer, in order, for the union of its
tokens' chosen experts.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coe import CoEError
from coe.files import unique_keys
from coe.moe import check_model_name, expert_id

TRACE_FORMAT = "coe-edge/moe-trace"
TRACE_VERSION = 1
SCORINGS = ("softmax", "sigmoid")       # as MoELayout.scoring


@dataclass
class Trace:
    model: str
    layers: tuple[int, ...]
    top_k: int
    scoring: str
    probs: np.ndarray       # [N, L, E] float16
    chosen: np.ndarray      # [N, L, k] int16
    seq: np.ndarray         # [N] int32
    step: np.ndarray        # [N] int32

    @property
    def tokens(self) -> int:
        return int(self.chosen.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.probs.shape[2])

    def ids(self) -> list[str]:
        return [expert_id(self.model, l, e) for l in self.layers for e in range(self.num_experts)]

    def rows(self, sel) -> "Trace":
        """The same trace restricted to token rows `sel` (a mask or indices)."""
        return Trace(self.model, self.layers, self.top_k, self.scoring, self.probs[sel], self.chosen[sel],
                     self.seq[sel], self.step[sel])

    def passes(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(seq, step, token rows) of each forward pass, in order."""
        if not self.tokens:
            return
        cut = np.flatnonzero((np.diff(self.seq) != 0) | (np.diff(self.step) != 0)) + 1
        for rows in np.split(np.arange(self.tokens), cut):
            yield int(self.seq[rows[0]]), int(self.step[rows[0]]), rows

    def accesses(self) -> Iterator[tuple[int, int, list[str], np.ndarray]]:
        """(pass index, layer, sorted expert ids the layer asks for, mean gate scores [E]) in execution order."""
        for p, (_, _, rows) in enumerate(self.passes()):
            for j, layer in enumerate(self.layers):
                hit = np.unique(self.chosen[rows, j, :])
                yield p, layer, [expert_id(self.model, layer, int(e)) for e in hit], \
                    self.probs[rows, j, :].astype(np.float32).mean(axis=0)

    def popularity_for(self, model: str, where: str, layout=None) -> dict[str, float]:
        """`popularity()` for a store of `model`: a trace of another model is refused, naming both.

        Without the check another model's ids match nothing, and every expert
        silently gets popularity 0.  `where` names the trace in the error.
        """
        if self.model != model:
            raise CoEError(f"{where}: a trace of model '{self.model}', but the store holds '{model}' "
                           "(trace it with coe-agent llm trace --model on this store)")
        if layout is not None:     # the same name on another model (two stores imported as 'tiny')
            layers = tuple(l.layer for l in layout.layers)
            experts = layout.layers[0].num_experts if layout.layers else 0
            if tuple(self.layers) != layers or self.num_experts != experts or self.top_k != layout.top_k:
                raise CoEError(f"{where}: a trace of layers {list(self.layers)} with {self.num_experts} experts, "
                               f"top-{self.top_k}, but the store's '{model}' has layers {list(layers)} with "
                               f"{experts} experts, top-{layout.top_k}: trace it on this store")
        return self.popularity()

    def popularity(self) -> dict[str, float]:
        """Per-layer share of tokens that chose each expert (CoServe's usage probability, per layer)."""
        out = {}
        n = max(self.tokens, 1)
        for j, layer in enumerate(self.layers):
            counts = np.bincount(self.chosen[:, j, :].ravel().astype(np.int64), minlength=self.num_experts)
            out.update({expert_id(self.model, layer, e): float(c) / n for e, c in enumerate(counts)})
        return out

    # -- file -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Written whole or not at all (a temp file of its own, flushed, then renamed)."""
        from safetensors.numpy import save

        from coe.files import write_bytes_atomic

        meta = {"coe": json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": self.model,
                                   "layers": list(self.layers), "top_k": self.top_k, "scoring": self.scoring})}
        return write_bytes_atomic(path, save({"probs": np.ascontiguousarray(self.probs, dtype=np.float16),
                                              "chosen": np.ascontiguousarray(self.chosen, dtype=np.int16),
                                              "seq": np.ascontiguousarray(self.seq, dtype=np.int32),
                                              "step": np.ascontiguousarray(self.step, dtype=np.int32)},
                                             metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        from safetensors import SafetensorError, safe_open

        src = str(path)
        try:
            with safe_open(src, framework="numpy") as f:
                meta = f.metadata() or {}
                arrays = {k: read_tensor(f, k, src) for k in f.keys()}
        except FileNotFoundError:
            raise CoEError(f"{src}: trace not found") from None
        except (SafetensorError, OSError, ValueError) as exc:
            raise CoEError(f"{src}: not a readable trace (truncated or not safetensors): {exc}") from None
        try:
            info = json.loads(meta.get("coe", ""), object_pairs_hook=unique_keys)
        except ValueError as exc:
            raise CoEError(f"{src}: trace metadata is missing or not JSON ({exc})") from None
        except RecursionError:
            raise CoEError(f"{src}: trace metadata is missing or not JSON (nested too deeply)") from None
        if not isinstance(info, dict) or info.get("format") != TRACE_FORMAT:
            raise CoEError(f"{src}: not an MoE trace (metadata format must be '{TRACE_FORMAT}')")
        if info.get("version") != TRACE_VERSION:
            raise CoEError(f"{src}: unsupported trace version {info.get('version')!r}")
        for k in ("probs", "chosen", "seq", "step"):
            if k not in arrays:
                raise CoEError(f"{src}: trace lacks the '{k}' array")
        layers = info.get("layers")
        if not isinstance(layers, list) or not layers or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers) \
                or any(a >= b for a, b in zip(layers, layers[1:])):
            # a layer twice would replay its accesses twice, under ids that name the other layer's experts
            raise CoEError(f"{src}: trace metadata 'layers' must be a non-empty list of distinct layer indices "
                           f">= 0 in ascending order, got {layers!r}")
        top_k = info.get("top_k")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise CoEError(f"{src}: trace metadata 'top_k' must be a whole number >= 1, got {top_k!r}")
        try:
            model = check_model_name(info.get("model"))
        except CoEError as exc:
            raise CoEError(f"{src}: trace metadata 'model': {exc}") from None
        scoring = info.get("scoring", "softmax")
        if scoring not in SCORINGS:
            raise CoEError(f"{src}: trace metadata 'scoring' must be one of {', '.join(SCORINGS)}, got {scoring!r}")
        trace = cls(model=model, layers=tuple(layers), top_k=top_k, scoring=scoring, probs=arrays["probs"],
                    chosen=arrays["chosen"], seq=arrays["seq"], step=arrays["step"])
        trace.check(src)
        return trace

    def check(self, src: str = "trace") -> None:
        for name, want in (("probs", np.floating), ("chosen", np.integer), ("seq", np.integer),
                           ("step", np.integer)):
            dtype = getattr(self, name).dtype
            if not np.issubdtype(dtype, want):      # a float `chosen` lets NaN past the range check below
                raise CoEError(f"{src}: {name} must hold {'floats' if want is np.floating else 'integers'}, "
                               f"got {dtype}")
        if self.chosen.ndim < 1 or self.probs.ndim < 1:
            raise CoEError(f"{src}: chosen and probs must be arrays of tokens, got shapes "
                           f"{list(self.chosen.shape)} and {list(self.probs.shape)}")
        n, L = self.chosen.shape[0], len(self.layers)
        if self.probs.ndim != 3 or self.probs.shape[:2] != (n, L):
            raise CoEError(f"{src}: probs is {list(self.probs.shape)}, expected [{n}, {L}, experts]")
        if self.chosen.ndim != 3 or self.chosen.shape[1] != L or self.chosen.shape[2] != self.top_k:
            raise CoEError(f"{src}: chosen is {list(self.chosen.shape)}, expected [tokens, {L}, {self.top_k}]")
        if self.seq.shape != (n,) or self.step.shape != (n,):
            raise CoEError(f"{src}: seq and step must hold one entry per token ({n})")
        if n and (self.chosen.min() < 0 or self.chosen.max() >= self.probs.shape[2]):
            raise CoEError(f"{src}: chosen names an expert outside 0..{self.probs.shape[2] - 1}")
        if n and not np.isfinite(self.probs).all():   # a predictor trained on them learns NaN, silently
            bad = int(np.count_nonzero(~np.isfinite(self.probs)))
            raise CoEError(f"{src}: probs holds {bad} NaN or infinite gate score(s)")
        if n and (self.probs.min() < 0 or self.probs.max() > 1):
            raise CoEError(f"{src}: probs holds gate scores outside [0, 1] ({float(self.probs.min())} .. "
                           f"{float(self.probs.max())})")


def read_tensor(f, name: str, src: str) -> np.ndarray:
    """One array of an open safetensors file; BF16 is named, not read: numpy has no bfloat16 of its own (a
    TypeError), unless a library imported earlier registered one (ml_dtypes), which no check here knows."""
    dtype = f.get_slice(name).get_dtype()
    if dtype == "BF16":
        raise CoEError(f"{src}: array '{name}' is stored as BF16, which numpy cannot read (store it as F16 or F32)")
    try:
        return f.get_tensor(name)
    except TypeError:
        raise CoEError(f"{src}: array '{name}' is stored as {f.get_slice(name).get_dtype()}, which numpy cannot "
                       "read (store it as F16 or F32)") from None


def synthetic(popularity: Mapping[str, object] | list[list[float]], *, tokens: int, model: str = "mixtral",
              top_k: int = 2, locality: float = 0.0, seed: int = 0) -> Trace:
    """A decode trace whose per-layer marginals follow `popularity[layer][expert]` (counts or shares).

    Each token draws its k experts per layer without replacement, weighted by
    popularity, and its gate scores are consistent with that draw (see the
    Gumbel-top-k note below).  `locality` is an assumption, not data: the
    probability that a layer keeps the previous token's scores and experts
    (the measured counts carry no temporal information).
    """
    try:
        pop = np.asarray(popularity, dtype=np.float64)
    except (ValueError, TypeError):
        pop = np.empty((0, 0))          # ragged or not numbers: refused below
    if top_k < 1 or pop.ndim != 2 or pop.shape[1] < top_k or not np.isfinite(pop).all() or (pop < 0).any() \
            or (pop.sum(axis=1) <= 0).any():
        raise CoEError(f"popularity must be [layers][experts] of non-negative counts with at least {top_k} experts")
    if not 0 <= locality < 1:
        raise CoEError(f"locality must be in [0, 1), got {locality}")
    if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) or tokens < 0:
        raise CoEError(f"tokens must be a whole number >= 0, got {tokens!r}")
    rng = np.random.default_rng(seed)
    L, E = pop.shape
    logp = np.log(np.maximum(pop / pop.sum(axis=1, keepdims=True), 1e-12))
    scores = np.empty((tokens, L, E))
    for t in range(tokens):
        fresh = logp + rng.gumbel(size=(L, E))
        if t and locality:
            keep = rng.random(L) < locality
            fresh[keep] = scores[t - 1, keep]
        scores[t] = fresh
    # Gumbel-top-k: the top-k of log(share) + Gumbel noise is a draw of k experts without replacement weighted
    # by share, and softmax of the same scores is a router distribution consistent with that choice
    chosen = np.sort(np.argsort(-scores, axis=2)[:, :, :top_k], axis=2).astype(np.int16)
    z = np.exp(scores - scores.max(axis=2, keepdims=True))
    probs = (z / z.sum(axis=2, keepdims=True)).astype(np.float16)
    return Trace(model=model, layers=tuple(range(L)), top_k=top_k, scoring="softmax", probs=probs, chosen=chosen,
                 seq=np.zeros(tokens, dtype=np.int32), step=np.arange(tokens, dtype=np.int32))


def load_popularity(path: str | Path) -> list[list[float]]:
    """`expert_popularity[layer][expert]` from a JSON file such as ../shared/data/mixtral-expert-popularity/*.json."""
    src = str(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        pop = raw["expert_popularity"]
    except FileNotFoundError:
        raise CoEError(f"{src}: popularity file not found") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CoEError(f"{src}: not a popularity file with 'expert_popularity': {exc}") from None
    if not isinstance(pop, list) or not pop or not all(isinstance(r, list) and r for r in pop):
        raise CoEError(f"{src}: expert_popularity must be a non-empty list of per-layer lists")
    if len({len(r) for r in pop}) != 1 or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for r in pop for x in r):
        raise CoEError(f"{src}: every layer must list the same number of non-negative counts")
    return [[float(x) for x in r] for r in pop]
