"""Usage probabilities: the share of chain steps that use each expert.

They drive which experts are loaded at start, which are evicted first and how
memory is split, so they come from one of two places and say which:

* the spec (`from_spec`): component frequencies walked through the chain with
  each classifier's priors, as `CoEModel.usage_probabilities` does;
* a sample run (`from_counts`): how often each expert was used when a recording
  was routed (see `routing.train.sample_probabilities`).

`save`/`load` keep them as JSON `{"source": ..., "probabilities": {...}}`, by
default at `{data_dir}/probabilities.json`, where the scheduler and the pools
read them.  Pure Python: no torch, nothing from the other packages.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from .errors import CoEError
from .files import write_json_atomic
from .files import unique_keys
from .spec import CoEModel

FORMAT = "coe-edge/usage-probabilities"


def from_spec(model: CoEModel) -> dict[str, float]:
    """Per-step usage probability of every expert the spec declares (sums to 1)."""
    return model.usage_probabilities()


def ranked(experts: Iterable[str], probabilities: Mapping[str, float]) -> list[str]:
    """`experts` from most to least probable, ties by id: the order pools and tiers are filled in at start.

    CoServe's eviction evicts along the reverse of it (least probable first,
    ties from the largest id), so the experts a pool starts with are the ones
    it would keep: among a board's rare types, which share one probability,
    the same subset stays resident from the first frame on, instead of the
    first boards trading the ones loaded at start for others.
    """
    return sorted(experts, key=lambda e: (-probabilities.get(e, 0.0), e))


def from_counts(counts: Mapping[str, int | float]) -> dict[str, float]:
    """Normalise use counts to probabilities; experts counted 0 keep a 0 entry."""
    bad = {k: v for k, v in counts.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0}
    if bad:
        raise ValueError(f"use counts must be non-negative numbers, got {dict(list(bad.items())[:3])}")
    total = sum(counts.values())
    if total <= 0:
        raise ValueError("no expert was used: cannot turn zero counts into probabilities")
    return {k: v / total for k, v in counts.items()}


def compare(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """The largest absolute difference over the union of experts (a missing expert counts as 0)."""
    keys = set(a) | set(b)
    return max((abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys), default=0.0)


def save(probs: Mapping[str, float], path: str | os.PathLike[str], source: str) -> Path:
    """Write `probs` atomically as JSON, with `source` saying where they came from."""
    clean = _validated(probs, str(path))
    doc = {"format": FORMAT, "source": str(source), "probabilities": {k: clean[k] for k in sorted(clean)}}
    return write_json_atomic(path, doc, sort_keys=False)


def load(path: str | os.PathLike[str]) -> dict[str, float]:
    """The probabilities saved at `path`; CoEError naming the file if it is missing or malformed."""
    return load_document(path)[1]


def load_document(path: str | os.PathLike[str]) -> tuple[str, dict[str, float]]:
    """(source, probabilities) saved at `path`."""
    src = str(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise CoEError(f"{src}: no usage probabilities file (run: coe-agent probabilities --line LINE)") from None
    except (OSError, ValueError) as exc:    # not UTF-8, not JSON, a key written twice
        raise CoEError(f"{src}: unreadable usage probabilities: {exc}") from None
    except RecursionError:
        raise CoEError(f"{src}: unreadable usage probabilities: nested too deeply") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("probabilities"), dict):
        raise CoEError(f"{src}: expected an object with a 'probabilities' mapping")
    source = raw.get("source", "")
    if not isinstance(source, str):
        raise CoEError(f"{src}: 'source' must be a string")
    return source, _validated(raw["probabilities"], src)


def _validated(probs: Mapping[str, float], src: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in probs.items():
        if not isinstance(k, str) or not k:
            raise CoEError(f"{src}: expert ids must be non-empty strings, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
            raise CoEError(f"{src}: probability of '{k}' must be a number in [0, 1], got {v!r}")
        out[k] = float(v)
    if not out:
        raise CoEError(f"{src}: no probabilities")
    total = sum(out.values())
    if abs(total - 1.0) > 1e-6:
        raise CoEError(f"{src}: probabilities must sum to 1, they sum to {total:.6f}")
    return out
