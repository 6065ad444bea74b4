"""MoE LLM experts described as experts: ids, layers and sizes, no tensors.

Every (layer, expert) of an MoE model is one entry in the expert store and one
resident unit in a pool, exactly like a vision expert.  This module names
them and records the model's MoE shape in `llm.json`, the file `coe-agent llm
import` writes next to the store manifest.  It is a parser boundary (the file
can be edited or truncated), so every field is checked and an error names the
file and the field.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import CoEError
from .expert import Expert
from .files import unique_keys, write_json_atomic

LAYOUT_FILE = "llm.json"
LAYOUT_FORMAT = "coe-edge/moe-layout"
LAYOUT_VERSION = 1
# a pooled model's host tier (GPU pools): a copy of each load, or a victim cache of the pools
HOST_MODES = ("inclusive", "exclusive")
_DTYPES = ("float32", "float16", "bfloat16")    # what `coe-agent llm import` stores
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")      # whole name (fullmatch: `$` lets a newline end it)
_ID = re.compile(r"(?P<model>.+)\.L(?P<layer>\d{2,})\.E(?P<expert>\d{3,})")
MAX_EXPERTS = 2**15 - 1     # per layer: a trace stores expert indices as int16
# what `coe-agent llm import` records in `extra`, and the type each must have where it is read
_EXTRA = {"source": str, "norm_topk_prob": bool, "routed_scaling_factor": float}


def expert_id(model: str, layer: int, expert: int) -> str:
    """The store id of expert `expert` in MoE layer `layer` of `model`, e.g. 'tiny-mixtral.L03.E007'."""
    return f"{model}.L{layer:02d}.E{expert:03d}"


def parse_expert_id(eid: str) -> tuple[str, int, int]:
    """(model, layer, expert) of an id made by `expert_id`; a clear error otherwise."""
    m = _ID.fullmatch(eid) if isinstance(eid, str) else None
    if m is None:
        raise CoEError(f"'{eid}' is not an MoE expert id (expected MODEL.L<layer>.E<expert>)")
    return m["model"], int(m["layer"]), int(m["expert"])


def check_model_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise CoEError(f"model name {name!r} must be 1-64 letters, digits, '.', '_', '+' or '-', "
                       "starting with a letter or digit, without '..' (it prefixes every expert id)")
    return name


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer: where its experts module sits in the model and the shape of one expert."""

    layer: int                  # decoder layer index
    module: str                 # e.g. 'model.layers.3.mlp.experts'
    num_experts: int
    hidden: int                 # H
    intermediate: int           # I: gate_up_proj is [2I, H], down_proj [H, I] per expert
    expert_nbytes: int


@dataclass(frozen=True)
class MoELayout:
    """The MoE shape of an imported model: what the pools will hold."""

    model: str
    model_type: str
    top_k: int
    dtype: str
    layers: tuple[MoELayer, ...]
    resident_file: str = "resident.safetensors"
    resident_sha256: str = ""
    resident_nbytes: int = 0
    scoring: str = "softmax"    # how router logits become gate scores: 'softmax' or 'sigmoid'
    extra: dict = field(default_factory=dict)

    def ids(self, layer: int | None = None) -> list[str]:
        return [expert_id(self.model, l.layer, e) for l in self.layers if layer in (None, l.layer)
                for e in range(l.num_experts)]

    def layer(self, index: int) -> MoELayer:
        for l in self.layers:
            if l.layer == index:
                return l
        raise CoEError(f"model '{self.model}' has no MoE layer {index}")

    @property
    def expert_bytes(self) -> int:
        """All experts of all layers: what a budget is a fraction of."""
        return sum(l.num_experts * l.expert_nbytes for l in self.layers)

    def experts(self) -> list[Expert]:
        return [Expert(id=expert_id(self.model, l.layer, e), arch=f"transformers/{self.model_type}", kind="moe-ffn",
                       classes=(), input_size=l.hidden, nbytes=l.expert_nbytes)
                for l in self.layers for e in range(l.num_experts)]

    # -- file -------------------------------------------------------------------
    def save(self, root: str | os.PathLike) -> Path:
        """Write `llm.json`, after the reader's own checks of what it would read back: a layout the reader
        refuses (unequal expert counts per layer, say) is refused here, before a store that no load can open
        is left behind."""
        path = Path(root) / LAYOUT_FILE
        doc = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, **asdict(self)}
        self.from_dict(json.loads(json.dumps(doc)), str(path))
        return write_json_atomic(path, doc, sort_keys=False)

    @classmethod
    def load(cls, root: str | os.PathLike) -> "MoELayout":
        path = Path(root) / LAYOUT_FILE
        src = str(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
        except FileNotFoundError:
            raise CoEError(f"{src}: not found; is {root} a store written by 'coe-agent llm import'?") from None
        except (OSError, ValueError) as exc:    # not UTF-8, not JSON, a key twice, an int of 5000 digits
            raise CoEError(f"{src}: cannot read the MoE layout: {exc}") from None
        except RecursionError:
            raise CoEError(f"{src}: cannot read the MoE layout: nested too deeply") from None
        return cls.from_dict(raw, src)

    @classmethod
    def from_dict(cls, raw: object, src: str = LAYOUT_FILE) -> "MoELayout":
        if not isinstance(raw, dict) or raw.get("format") != LAYOUT_FORMAT:
            raise CoEError(f"{src}: not an MoE layout (expected an object with format '{LAYOUT_FORMAT}')")
        if raw.get("version") != LAYOUT_VERSION:
            raise CoEError(f"{src}: unsupported MoE layout version {raw.get('version')!r} (this build reads "
                           f"{LAYOUT_VERSION})")
        top = {"model": str, "model_type": str, "top_k": int, "dtype": str, "layers": list,
               "resident_file": str, "resident_sha256": str, "resident_nbytes": int, "scoring": str}
        _check_fields(raw, top, src)
        check_model_name(raw["model"])
        if raw["top_k"] < 1:
            raise CoEError(f"{src}.top_k: must be at least 1, got {raw['top_k']}")
        if raw["scoring"] not in ("softmax", "sigmoid"):
            raise CoEError(f"{src}.scoring: must be 'softmax' or 'sigmoid', got {raw['scoring']!r}")
        if raw["dtype"] not in _DTYPES:
            raise CoEError(f"{src}.dtype: must be one of {', '.join(_DTYPES)}, got {raw['dtype']!r}")
        if raw["resident_nbytes"] < 0:
            raise CoEError(f"{src}.resident_nbytes: must not be negative, got {raw['resident_nbytes']}")
        if raw["resident_file"] in ("", ".", "..") or "\\" in raw["resident_file"] \
                or Path(raw["resident_file"]).name != raw["resident_file"]:
            raise CoEError(f"{src}.resident_file: must be a plain file name, got {raw['resident_file']!r}")
        layers = []
        spec = {"layer": int, "module": str, "num_experts": int, "hidden": int, "intermediate": int,
                "expert_nbytes": int}
        for i, item in enumerate(raw["layers"]):
            where = f"{src}.layers[{i}]"
            if not isinstance(item, dict):
                raise CoEError(f"{where}: expected an object")
            _check_fields(item, spec, where)
            if item["layer"] < 0:
                raise CoEError(f"{where}.layer: must not be negative, got {item['layer']}")
            for k in ("num_experts", "hidden", "intermediate", "expert_nbytes"):
                if item[k] < 1:
                    raise CoEError(f"{where}.{k}: must be positive, got {item[k]}")
            if item["num_experts"] > MAX_EXPERTS:
                raise CoEError(f"{where}.num_experts: at most {MAX_EXPERTS} (traces store expert indices as int16), "
                               f"got {item['num_experts']}")
            if item["num_experts"] < raw["top_k"]:
                raise CoEError(f"{where}.num_experts: {item['num_experts']} is fewer than top_k {raw['top_k']}")
            layers.append(MoELayer(**{k: item[k] for k in spec}))
        if not layers:
            raise CoEError(f"{src}.layers: an MoE layout needs at least one layer")
        seen: set[int] = set()
        for i, l in enumerate(layers):
            if l.layer in seen:
                raise CoEError(f"{src}.layers[{i}].layer: layer index {l.layer} appears twice")
            seen.add(l.layer)
            # readers take layers[0] as the first to run and its num_experts as every layer's (traces, predictors)
            if i and l.layer < layers[i - 1].layer:
                raise CoEError(f"{src}.layers[{i}].layer: layers must be in ascending order, {l.layer} follows "
                               f"{layers[i - 1].layer}")
            if l.num_experts != layers[0].num_experts:
                raise CoEError(f"{src}.layers[{i}].num_experts: {l.num_experts}, but layer {layers[0].layer} has "
                               f"{layers[0].num_experts}: every MoE layer must have the same number of experts")
        extra = raw.get("extra", {})
        if not isinstance(extra, dict):
            raise CoEError(f"{src}.extra: must be an object")
        for k, t in _EXTRA.items():
            if k not in extra:
                continue
            v = extra[k]
            if t is float and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
                raise CoEError(f"{src}.extra.{k}: must be a finite number, got {v!r}")
            if t is not float and not isinstance(v, t):
                raise CoEError(f"{src}.extra.{k}: must be {t.__name__}, got {type(v).__name__}")
        return cls(model=raw["model"], model_type=raw["model_type"], top_k=raw["top_k"], dtype=raw["dtype"],
                   layers=tuple(layers), resident_file=raw["resident_file"], resident_sha256=raw["resident_sha256"],
                   resident_nbytes=raw["resident_nbytes"], scoring=raw["scoring"], extra=extra)


def _check_fields(raw: dict, types: dict, where: str) -> None:
    for k, t in types.items():
        if k not in raw:
            raise CoEError(f"{where}: missing '{k}'")
        v = raw[k]
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise CoEError(f"{where}.{k}: must be {t.__name__}, got {type(v).__name__}")
