"""Token-wise expert prediction (SMoE): which experts will the next token ask for, at the same layer?

One small linear model per MoE layer maps what the router has just said to a
score per expert for the next token at that layer; it is trained here, from
recorded traces, by logistic regression on consecutive tokens of the same
prompt (`coe-agent llm train-predictor`).  Its top-m guesses are what a
prefetcher loads while the rest of the token computes.  Precision and recall
are measured against held-out traces, at m = k and m = 2k.

Inputs ("features").  `freshest`: when layer j routes token t,
the latest router scores of every layer, which are token t's for layers <= j
and token t-1's for the layers after j.  That is all a decode step knows at
that moment, so the prediction still has the rest of token t to load in.
On the trained model's held-out trace it found 0.71 of the next token's
experts in its top-k against 0.69 for `same-layer` (token t's scores at layer
j alone, SMoE's input and this predictor's first form, still read from older
files) trained the same way, and 0.65 for the first form's unstandardised
training.  Training picks one of the two by validation on a fifth of its prompts
(`choose_features`).  Inputs are standardised by the training set's mean and
deviation.

Stored as safetensors (numpy arrays `W` [L, F, E], `b` [L, E], and `mu`, `sd`
[L, F] for standardised inputs) with the layers, k, the features and the
training figures in the metadata; nothing is unpickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coe import CoEError
from coe.files import unique_keys

from .moe_trace import Trace, read_tensor

FORMAT = "coe-edge/moe-token-predictor"
FEATURES = ("freshest", "same-layer")


def _next_pairs(trace: Trace) -> np.ndarray:
    """Rows t whose next row is a decode token of the same prompt: the (t, t+1) pairs to learn from."""
    same = (trace.seq[1:] == trace.seq[:-1]) & (trace.step[1:] > 0) & (trace.step[:-1] >= 0)
    return np.flatnonzero(same)


def inputs(trace: Trace, rows: np.ndarray, j: int, features: str) -> np.ndarray:
    """[len(rows), F]: the predictor's input at layer index j for the tokens `rows` of `trace`, scores x E."""
    E = trace.num_experts
    probs = trace.probs.astype(np.float64) * E            # scores around 1 instead of 1/E
    if features == "same-layer":
        return probs[rows, j, :]
    if features != "freshest":
        raise CoEError(f"predictor features must be one of {', '.join(FEATURES)}, got {features!r}")
    rows = np.asarray(rows)
    # a prompt token's later layers have not run when its layer j routes (the prefill runs layer by layer over
    # the whole prompt): uniform there, as a live prefill leaves them (`LiveInputs`); a decode token's are the
    # previous token's
    has_prev = (rows > 0) & (trace.seq[np.maximum(rows - 1, 0)] == trace.seq[rows]) & (trace.step[rows] > 0)
    prev = np.where(has_prev[:, None, None], probs[np.maximum(rows - 1, 0)], 1.0)   # none yet: uniform
    return np.concatenate([probs[rows, :j + 1], prev[:, j + 1:]], axis=1).reshape(len(rows), -1)


def pairs(trace: Trace, j: int, features: str = "same-layer") -> tuple[np.ndarray, np.ndarray]:
    """(inputs at token t, multi-hot of token t+1's experts) at layer index j, within each prompt."""
    idx = _next_pairs(trace)
    x = inputs(trace, idx, j, features)
    y = np.zeros((len(idx), trace.num_experts), dtype=np.float32)
    np.put_along_axis(y, trace.chosen[idx + 1, j, :].astype(np.int64), 1.0, axis=1)
    return x, y


def validation_split(trace: Trace, share: float = 0.2) -> tuple[Trace, Trace]:
    """(fit, validation): the last `share` of the prompts, or of the tokens when the trace is one prompt."""
    seqs = np.unique(trace.seq)
    if len(seqs) >= 2:
        cut = seqs[min(len(seqs) - 1, max(1, int(round(len(seqs) * (1 - share))))) - 1]   # both parts non-empty
        fit = trace.seq <= cut
    else:
        fit = np.arange(len(trace.seq)) < int(len(trace.seq) * (1 - share))
    return trace.rows(np.flatnonzero(fit)), trace.rows(np.flatnonzero(~fit))


def choose_features(trace: Trace, **train) -> str:
    """The inputs whose predictor finds more of the validation part's next experts (top-k recall); ties: fewer."""
    fit, val = validation_split(trace)
    if not len(_next_pairs(fit)) or not len(_next_pairs(val)):
        return "same-layer"
    recall = {f: TokenPredictor.train(fit, features=f, **train).evaluate(val)["recall"] for f in FEATURES}
    return "freshest" if recall["freshest"] > recall["same-layer"] else "same-layer"


class LiveInputs:
    """The predictor's input for a live decode, built from the router calls as they come (any order of layers).

    Every router call updates its layer's latest scores (a prefill's last
    token too, so the first decode step has its previous token), and returns
    the input for a prediction at that layer.
    """

    def __init__(self, predictor: "TokenPredictor") -> None:
        self.features = predictor.features
        self._index = {layer: j for j, layer in enumerate(predictor.layers)}
        E = predictor.num_experts
        self._latest = np.full((len(predictor.layers), E), float(E) / E)       # uniform x E = 1

    def observe(self, layer: int, probs) -> np.ndarray | None:
        """[1, F] for a prediction at `layer` after this call; None for a layer the predictor does not know.

        A call of several tokens is a prefill: the layers after it have not
        seen this prompt yet, so they read as uniform (what training gives a
        prompt token), not as the previous prompt's last token.
        """
        j = self._index.get(layer)
        if j is None:
            return None
        rows = np.asarray(probs, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] != self._latest.shape[1]:     # [2, E/2] read as one token of E
            raise CoEError(f"layer {layer}: router scores of shape {list(rows.shape)}, expected [tokens, "
                           f"{self._latest.shape[1]}]")
        if len(rows) > 1:
            self._latest[j + 1:] = 1.0
        self._latest[j] = rows[-1] * self._latest.shape[1]
        if self.features == "same-layer":
            return self._latest[j][None, :]
        return self._latest.reshape(1, -1).copy()      # layers <= j: this token's; after j: the previous token's


@dataclass
class TokenPredictor:
    layers: tuple[int, ...]
    top_k: int
    W: np.ndarray       # [L, F, E]
    b: np.ndarray       # [L, E]
    features: str = "same-layer"    # what W [L, F, E] reads: F = E here, L x E for "freshest"
    mu: np.ndarray | None = None    # [L, F]: inputs are standardised as (x - mu) / sd when given
    sd: np.ndarray | None = None

    @property
    def num_experts(self) -> int:
        return int(self.W.shape[2])

    @classmethod
    def train(cls, trace: Trace, *, features: str = "auto", epochs: int = 600, lr: float = 0.5,
              l2: float = 1e-4) -> "TokenPredictor":
        """Full-batch logistic regression per layer on standardised inputs (numpy; seconds on a CPU).

        `features='auto'` picks the inputs by validation (`choose_features`):
        'freshest' sees more and won on the trained model's trace, but where
        the layers carry nothing about each other (a synthetic trace of
        independent layers) its extra inputs only add noise and 'same-layer'
        wins.  The choice is the data's, not a setting to tune.
        """
        if features == "auto":
            features = choose_features(trace, epochs=epochs, lr=lr, l2=l2)
        if features not in FEATURES:
            raise CoEError(f"predictor features must be one of {', '.join(FEATURES)} or auto, got {features!r}")
        L, E = len(trace.layers), trace.num_experts
        F = E if features == "same-layer" else L * E
        W, b = np.zeros((L, F, E)), np.zeros((L, E))
        mu, sd = np.zeros((L, F)), np.ones((L, F))
        for j in range(L):
            x, y = pairs(trace, j, features)
            if not len(x):
                raise CoEError("the trace has no consecutive decode tokens to learn from")
            mu[j], sd[j] = x.mean(axis=0), x.std(axis=0) + 1e-6
            xs = (x - mu[j]) / sd[j]
            for _ in range(epochs):
                p = 1 / (1 + np.exp(-(xs @ W[j] + b[j])))
                g = p - y
                W[j] -= lr * (xs.T @ g / len(xs) + l2 * W[j])
                b[j] -= lr * g.mean(axis=0)
        return cls(trace.layers, trace.top_k, W, b, features, mu, sd)

    def scores(self, j: int, x: np.ndarray) -> np.ndarray:
        """[T, E] logits from inputs `x` [T, F] (see `inputs`, `LiveInputs`)."""
        if not 0 <= j < len(self.layers):
            raise CoEError(f"token predictor: layer index {j} is not one of its {len(self.layers)} layers")
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.W.shape[1]:
            raise CoEError(f"token predictor: inputs of shape {list(x.shape)}, expected [tokens, "
                           f"{self.W.shape[1]}] ({self.features} features)")
        if self.mu is not None:
            x = (x - self.mu[j]) / self.sd[j]
        return x @ self.W[j] + self.b[j]

    def predict(self, j: int, x: np.ndarray, m: int | None = None) -> np.ndarray:
        """[T, m] experts the next token is predicted to ask for at layer index j."""
        m = m or self.top_k
        return np.argsort(-self.scores(j, x), axis=-1)[..., :m]

    def probabilities(self, j: int, x: np.ndarray) -> np.ndarray:
        """[T, E] the model's probability that the next token asks layer index j for each expert."""
        return 1 / (1 + np.exp(-self.scores(j, x)))

    def confident(self, j: int, x: np.ndarray, m: int | None = None, min_prob: float = 0.0) -> list[int]:
        """The top-m guesses for the last row of `x` whose probability is at least `min_prob`."""
        p = self.probabilities(j, np.asarray(x)[-1:])[0]
        top = np.argsort(-p)[: m or self.top_k]
        return [int(e) for e in top if p[e] >= min_prob]

    def evaluate(self, trace: Trace, m: int | None = None) -> dict:
        """Precision and recall of the top-m guesses against `trace`'s next tokens (all layers)."""
        if trace.layers != self.layers or trace.num_experts != self.num_experts:
            raise CoEError(f"trace of layers {trace.layers} x {trace.num_experts} experts does not fit a predictor "
                           f"of layers {self.layers} x {self.num_experts}")
        tp = guessed = actual = 0
        for j in range(len(self.layers)):
            x, y = pairs(trace, j, self.features)
            if not len(x):
                continue
            guess = self.predict(j, x, m)
            tp += int(np.take_along_axis(y, guess, axis=1).sum())
            guessed += guess.size
            actual += int(y.sum())
        return {"m": m or self.top_k, "precision": tp / guessed if guessed else 0.0,
                "recall": tp / actual if actual else 0.0, "pairs": actual // max(self.top_k, 1),
                "features": self.features}

    def fits(self, layers: tuple[int, ...], num_experts: int, model: str, top_k: int | None = None) -> None:
        """Raise CoEError unless this predictor was trained for `layers` x `num_experts` (model `model`), and,
        given, the same `top_k` (a top-2 model's predictor ranks a top-3 model's experts for the wrong count)."""
        if tuple(self.layers) != tuple(layers) or self.num_experts != num_experts or (
                top_k is not None and self.top_k != top_k):
            raise CoEError(f"the token predictor (layers {self.layers}, {self.num_experts} experts, "
                           f"top-{self.top_k}) does not fit model '{model}' (layers {list(layers)}, "
                           f"{num_experts} experts{f', top-{top_k}' if top_k is not None else ''})")

    # -- file -------------------------------------------------------------------------
    def save(self, path: str | Path, info: dict | None = None) -> Path:
        """Written whole or not at all: a kill mid-save leaves the previous predictor as it was.

        The arrays are stored as float32 (a loaded predictor computes in float64 from
        those rounded values).  `info` (training figures) goes into the metadata
        beside the keys `load` reads, which it cannot replace.
        """
        from safetensors.numpy import save

        from coe.files import write_bytes_atomic

        meta = {"coe": json.dumps({**(info or {}), "format": FORMAT, "layers": list(self.layers),
                                   "top_k": self.top_k, "features": self.features})}
        arrays = {"W": self.W.astype(np.float32), "b": self.b.astype(np.float32)}
        if self.mu is not None:
            arrays.update(mu=self.mu.astype(np.float32), sd=self.sd.astype(np.float32))
        return write_bytes_atomic(path, save(arrays, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> "TokenPredictor":
        """A predictor file; one written before `features` existed reads as 'same-layer', unstandardised."""
        from safetensors import SafetensorError, safe_open

        src = str(path)
        try:
            with safe_open(src, framework="numpy") as f:
                meta = json.loads((f.metadata() or {}).get("coe", "{}"), object_pairs_hook=unique_keys)
                W, b = read_tensor(f, "W", src), read_tensor(f, "b", src)
                names = set(f.keys())
                if len(names & {"mu", "sd"}) == 1:
                    raise ValueError("it holds one of mu and sd without the other")
                mu, sd = (read_tensor(f, "mu", src), read_tensor(f, "sd", src)) if {"mu", "sd"} <= names \
                    else (None, None)
        except FileNotFoundError:
            raise CoEError(f"{src}: predictor not found") from None
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise CoEError(f"{src}: not a token predictor file: {exc}") from None
        except RecursionError:
            raise CoEError(f"{src}: not a token predictor file: its metadata is nested too deeply") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CoEError(f"{src}: not a token predictor (metadata format must be '{FORMAT}')")
        raw_layers, top_k = meta.get("layers"), meta.get("top_k", 1)
        if not (isinstance(raw_layers, list) and raw_layers
                and all(isinstance(l, int) and not isinstance(l, bool) and l >= 0 for l in raw_layers)
                and len(set(raw_layers)) == len(raw_layers)):
            raise CoEError(f"{src}: metadata 'layers' must be a list of layer numbers (distinct, >= 0, at least "
                           f"one), got {raw_layers!r}")
        if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1):
            raise CoEError(f"{src}: metadata 'top_k' must be an integer >= 1, got {top_k!r}")
        layers = tuple(raw_layers)
        features = meta.get("features", "same-layer")
        if features not in FEATURES:
            raise CoEError(f"{src}: features {features!r}: expected one of {', '.join(FEATURES)}")
        if W.ndim != 3 or W.shape[0] != len(layers) or b.shape != (W.shape[0], W.shape[2]):
            raise CoEError(f"{src}: W {list(W.shape)} and b {list(b.shape)} do not fit {len(layers)} layers")
        if W.shape[2] < top_k:
            raise CoEError(f"{src}: W {list(W.shape)} scores {W.shape[2]} experts, fewer than top_k {top_k}")
        want = W.shape[2] * (1 if features == "same-layer" else len(layers))
        if W.shape[1] != want:
            raise CoEError(f"{src}: W {list(W.shape)}: {features!r} inputs of {len(layers)} layers x {W.shape[2]} "
                           f"experts need {want} rows per layer")
        for name, a in (("W", W), ("b", b), ("mu", mu), ("sd", sd)):
            if a is not None and not np.isfinite(a).all():    # a NaN weight predicts nothing, silently
                raise CoEError(f"{src}: {name} holds NaN or infinite values (was it trained on a broken trace?)")
        if mu is not None and (mu.shape != W.shape[:2] or sd.shape != W.shape[:2] or not (sd > 0).all()):
            raise CoEError(f"{src}: mu {list(mu.shape)} and sd {list(sd.shape)} must be {list(W.shape[:2])}, "
                           "sd positive")
        as64 = (lambda a: None if a is None else a.astype(np.float64))
        return cls(layers, top_k, W.astype(np.float64), b.astype(np.float64), features,
                   as64(mu), as64(sd))


class NextTokenScores:
    """Live `predicted` scores for the `predicted` eviction policy: after each decode router call of a layer,
    every expert of that layer gets the predictor's probability that the next token asks for it.

    A listener of `routing.moe_router.RouterTap` (`RouterTap.predict_with`); a
    prefill pass (more than a few tokens) is not a next-token question and
    leaves the scores as they are.
    """

    def __init__(self, predictor: TokenPredictor, ids: dict[int, list[str]], *, max_tokens: int = 4) -> None:
        self.predictor, self._ids, self._max_tokens = predictor, ids, max_tokens
        self._index = {layer: j for j, layer in enumerate(predictor.layers)}
        self._live = LiveInputs(predictor)
        self.scores: dict[str, float] = {}

    def on_router(self, layer: int, probs, chosen) -> None:
        x = self._live.observe(layer, probs)        # every call, a prefill's too: the next step's previous token
        if x is None or len(probs) > self._max_tokens:
            return
        p = self.predictor.probabilities(self._index[layer], x)[0]
        self.scores.update(zip(self._ids[layer], p.tolist()))
