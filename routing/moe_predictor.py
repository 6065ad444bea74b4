"""Token-wise expert prediction (SMoE): which experts will the next token ask for, at the same layer?

One small linear model per MoE layer maps a token's router scores at that
layer ([E]) to a score per expert for the next token; it is trained here,
from recorded traces, by logistic regression on consecutive decode tokens of
the same prompt (`coe-agent llm train-predictor`).  Its top-m guesses are
what a prefetcher loads while the rest of the token computes.  Precision and
recall are measured against held-out traces, at m = k and m = 2k.

Stored as safetensors (numpy arrays `W` [L, E, E], `b` [L, E]) with the
layers, k and the training figures in the metadata; nothing is unpickled.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coe import CoEError

from .moe_trace import Trace

FORMAT = "coe-edge/moe-token-predictor"


def pairs(trace: Trace, j: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores of token t, multi-hot of token t+1's experts) at layer index j, within each prompt's decode."""
    same = (trace.seq[1:] == trace.seq[:-1]) & (trace.step[1:] > 0) & (trace.step[:-1] >= 0)
    idx = np.flatnonzero(same)
    x = trace.probs[idx, j, :].astype(np.float32)
    y = np.zeros((len(idx), trace.num_experts), dtype=np.float32)
    np.put_along_axis(y, trace.chosen[idx + 1, j, :].astype(np.int64), 1.0, axis=1)
    return x, y


@dataclass
class TokenPredictor:
    layers: tuple[int, ...]
    top_k: int
    W: np.ndarray       # [L, E, E]
    b: np.ndarray       # [L, E]

    @classmethod
    def train(cls, trace: Trace, *, epochs: int = 300, lr: float = 0.5, l2: float = 1e-4) -> "TokenPredictor":
        """Full-batch logistic regression per layer (numpy; seconds on a CPU)."""
        L, E = len(trace.layers), trace.num_experts
        W = np.zeros((L, E, E), dtype=np.float64)
        b = np.zeros((L, E), dtype=np.float64)
        for j in range(L):
            x, y = pairs(trace, j)
            if not len(x):
                raise CoEError("the trace has no consecutive decode tokens to learn from")
            x = x.astype(np.float64) * E          # scores around 1 instead of 1/E
            for _ in range(epochs):
                p = 1 / (1 + np.exp(-(x @ W[j] + b[j])))
                g = p - y
                W[j] -= lr * (x.T @ g / len(x) + l2 * W[j])
                b[j] -= lr * g.mean(axis=0)
        return cls(trace.layers, trace.top_k, W, b)

    def scores(self, j: int, probs: np.ndarray) -> np.ndarray:
        return (np.asarray(probs, dtype=np.float64) * self.W.shape[1]) @ self.W[j] + self.b[j]

    def predict(self, j: int, probs: np.ndarray, m: int | None = None) -> np.ndarray:
        """[T, m] experts the next token is predicted to ask for at layer index j."""
        m = m or self.top_k
        return np.argsort(-self.scores(j, probs), axis=-1)[..., :m]

    def probabilities(self, j: int, probs: np.ndarray) -> np.ndarray:
        """[T, E] the model's probability that the next token asks layer index j for each expert."""
        return 1 / (1 + np.exp(-self.scores(j, probs)))

    def confident(self, j: int, probs: np.ndarray, m: int | None = None, min_prob: float = 0.0) -> list[int]:
        """The top-m guesses for the last token of `probs` whose probability is at least `min_prob`."""
        p = self.probabilities(j, probs[-1:])[0]
        top = np.argsort(-p)[: m or self.top_k]
        return [int(e) for e in top if p[e] >= min_prob]

    def evaluate(self, trace: Trace, m: int | None = None) -> dict:
        """Precision and recall of the top-m guesses against `trace`'s next tokens (all layers)."""
        if trace.layers != self.layers or trace.num_experts != self.W.shape[1]:
            raise CoEError(f"trace of layers {trace.layers} x {trace.num_experts} experts does not fit a predictor "
                           f"of layers {self.layers} x {self.W.shape[1]}")
        tp = guessed = actual = 0
        for j in range(len(self.layers)):
            x, y = pairs(trace, j)
            if not len(x):
                continue
            guess = self.predict(j, x, m)
            tp += int(np.take_along_axis(y, guess, axis=1).sum())
            guessed += guess.size
            actual += int(y.sum())
        return {"m": m or self.top_k, "precision": tp / guessed if guessed else 0.0,
                "recall": tp / actual if actual else 0.0, "pairs": actual // max(self.top_k, 1)}

    def fits(self, layers: tuple[int, ...], num_experts: int, model: str) -> None:
        """Raise CoEError unless this predictor was trained for `layers` x `num_experts` (model `model`)."""
        if tuple(self.layers) != tuple(layers) or self.W.shape[1] != num_experts:
            raise CoEError(f"the token predictor (layers {self.layers}, {self.W.shape[1]} experts) does not fit "
                           f"model '{model}'")

    # -- file -------------------------------------------------------------------------
    def save(self, path: str | Path, info: dict | None = None) -> Path:
        from safetensors.numpy import save_file

        meta = {"coe": json.dumps({"format": FORMAT, "layers": list(self.layers), "top_k": self.top_k,
                                   **(info or {})})}
        save_file({"W": self.W.astype(np.float32), "b": self.b.astype(np.float32)}, str(path), metadata=meta)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "TokenPredictor":
        from safetensors import SafetensorError, safe_open

        src = str(path)
        try:
            with safe_open(src, framework="numpy") as f:
                meta = json.loads((f.metadata() or {}).get("coe", "{}"))
                W, b = f.get_tensor("W"), f.get_tensor("b")
        except FileNotFoundError:
            raise CoEError(f"{src}: predictor not found") from None
        except (SafetensorError, OSError, ValueError, KeyError) as exc:
            raise CoEError(f"{src}: not a token predictor file: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CoEError(f"{src}: not a token predictor (metadata format must be '{FORMAT}')")
        layers = tuple(meta.get("layers") or ())
        if W.ndim != 3 or W.shape[0] != len(layers) or W.shape[1] != W.shape[2] or b.shape != W.shape[:2]:
            raise CoEError(f"{src}: W {list(W.shape)} and b {list(b.shape)} do not fit {len(layers)} layers")
        return cls(layers, int(meta.get("top_k", 1)), W.astype(np.float64), b.astype(np.float64))


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
        self.scores: dict[str, float] = {}

    def on_router(self, layer: int, probs, chosen) -> None:
        if layer not in self._index or len(probs) > self._max_tokens:
            return
        p = self.predictor.probabilities(self._index[layer], np.asarray(probs)[-1:])[0]
        self.scores.update(zip(self._ids[layer], p.tolist()))
