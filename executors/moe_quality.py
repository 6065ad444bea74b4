"""What substitution costs in quality: held-out perplexity and next-token agreement, decoded token by token.

Substitution decides per decode step from what is resident at that moment,
so quality is measured the way generation runs: the held-out text is fed one
token at a time through the KV cache (teacher forcing), each step's logits
score the next token (negative log-likelihood) and give its argmax, which is
compared with the α = 0 run's argmax (next-token agreement).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .moe_model import PooledModel


@dataclass(frozen=True)
class Quality:
    tokens: int
    nll: float              # mean negative log-likelihood per predicted token (nats)
    seconds: float
    argmax: tuple[int, ...]

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    def agreement(self, other: "Quality") -> float:
        """Share of positions whose predicted next token equals `other`'s."""
        n = min(len(self.argmax), len(other.argmax))
        return sum(a == b for a, b in zip(self.argmax, other.argmax)) / n if n else 0.0


@torch.no_grad()
def decode_quality(pm: PooledModel, sequences: list[list[int]]) -> Quality:
    """Teacher-forced, token-by-token decode of each sequence; see the module docstring."""
    nll, n, argmax = 0.0, 0, []
    start = time.perf_counter()
    for seq in sequences:
        past = None
        for i in range(len(seq) - 1):
            res = pm.model(input_ids=torch.tensor([[seq[i]]], device=pm.device), past_key_values=past, use_cache=True)
            past = res.past_key_values
            logp = torch.log_softmax(res.logits[0, -1].float(), dim=-1)
            nll -= float(logp[seq[i + 1]])
            argmax.append(int(logp.argmax()))
            n += 1
    return Quality(n, nll / max(n, 1), time.perf_counter() - start, tuple(argmax))


def pick_alpha(alphas: list[float], ms_per_token: list[float], budget_ms: float, degree: int = 2) -> tuple:
    """The smallest α whose fitted ms/token meets `budget_ms` (the importance paper's Eq. 5 search).

    T(α) is fitted with a low-degree polynomial to the measured points and
    searched on a fine grid; returns (alpha or None if no α meets it, the fit's
    coefficients, highest power first).
    """
    import numpy as np

    if len(alphas) != len(ms_per_token) or len(alphas) < 2:
        raise ValueError("need at least two (alpha, ms/token) points")
    deg = min(degree, len(alphas) - 1)
    coef = np.polyfit(np.asarray(alphas, float), np.asarray(ms_per_token, float), deg)
    grid = np.linspace(0.0, max(alphas), 201)
    ok = grid[np.polyval(coef, grid) <= budget_ms]
    return (float(ok[0]) if len(ok) else None), coef.tolist()
