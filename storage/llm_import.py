"""Split a local Hugging Face MoE checkpoint into one store entry per (layer, expert), once.

`coe-agent llm import MODEL_DIR --out STORE` reads the safetensors shards of
MODEL_DIR (never a pickle), finds the experts modules of the model its config
describes (`moe_structure.find_experts`, by structure), and maps every
checkpoint key to the model's own parameter names with transformers' own
conversion mapping: legacy per-expert checkpoints (`experts.3.w1.weight`,
`experts.3.gate_proj.weight`) and fused ones (`experts.gate_up_proj`) both
import.  Each expert becomes `{gate_up_proj [2I, H], down_proj [H, I]}`, the
slice the fused model parameter would hold, written through `ExpertStore` with
its manifest and sha256.  Everything else (embeddings, attention, norms,
routers, shared experts) streams into one resident file.

Only one tensor slice is in memory at a time (`ShardReader` reads with
`pread`, not a memory map), so a checkpoint larger than RAM imports.

`dtype` casts the floating-point weights, experts and resident alike, one
tensor at a time as they stream through, and records the stored dtype in
`llm.json` and in the copied config.json: the imported model is then exactly
what importing a checkpoint saved in that dtype gives.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coe import CoEError, Expert
from coe.moe import LAYOUT_FILE, MoELayer, MoELayout, check_model_name, expert_id

from .dtypes import FLOATING_DTYPES, cast_floating, parse_dtype
from .expert_store import ExpertStore
from .moe_structure import ExpertsSite, find_experts
from .safetensors_io import ShardReader, StreamWriter

log = logging.getLogger(__name__)

MODEL_SUBDIR = "model"          # config, generation config and tokenizer files, copied from MODEL_DIR
_COPY_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_WEIGHT_NAMES = ("model.safetensors.index.json",)


@dataclass(frozen=True)
class _Part:
    shard: Path
    key: str
    index: int | None = None     # a slice of a fused tensor along dim 0


def load_config(model_dir: str | Path):
    """The model's transformers config from local files only."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise CoEError(f"{path}: no config.json; point at a local Hugging Face model directory")
    try:
        from huggingface_hub.errors import StrictDataclassError   # a field of the wrong type (transformers 5)
    except ImportError:
        StrictDataclassError = TypeError
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError, StrictDataclassError) as exc:
        first = str(exc).strip().splitlines()
        raise CoEError(f"{path}/config.json: transformers cannot read it: {first[0] if first else exc!r}"
                       + (f" {first[1].strip()}" if len(first) > 1 else "")) from None


def meta_model(config):
    """The model built on the meta device: shapes and module structure, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise CoEError(f"model type '{getattr(config, 'model_type', '?')}': transformers has no causal LM for it: "
                       f"{exc}") from None
    except RuntimeError as exc:     # a size the config gives that no tensor can have (num_experts: -1)
        raise CoEError(f"config of '{getattr(config, 'model_type', '?')}': transformers cannot build the model: "
                       f"{str(exc).splitlines()[0]}") from None


def shards(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files; a pickle-only checkpoint is refused, not loaded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise CoEError(f"{index}: malformed shard index: {exc}") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise CoEError(f"{index}: malformed shard index: 'weight_map' must map tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).name != n or n in (".", "..")]
        if outside:
            raise CoEError(f"{index}: malformed shard index: shard '{outside[0]}' is not a file name in {model_dir}")
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CoEError(f"{index}: lists shards that are missing: {', '.join(missing[:3])}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = (f" (found {', '.join(pickles[:3])}: pickled weights are never loaded; convert them to safetensors "
                "on a trusted machine)") if pickles else ""
        raise CoEError(f"{model_dir}: no safetensors weights{hint}")
    return files


def import_checkpoint(model_dir: str | Path, out: str | Path, *, name: str | None = None,
                      progress: Callable[[str, int], None] | None = None, dtype: str | None = None) -> MoELayout:
    """Import MODEL_DIR into the expert store at `out`; returns the layout written to `out/llm.json`.

    `progress(stage, n)` is called as work is done ('experts' with experts
    written, 'resident' with tensors written), for a progress bar.  `dtype`
    (fp32, fp16, bf16 or a torch name) is the stored dtype of every
    floating-point weight; without it the checkpoint's dtype is kept.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    want = parse_dtype(dtype, where="dtype") if dtype is not None else None
    model_dir, out = Path(model_dir), Path(out)
    _check_out(model_dir, out)
    config = load_config(model_dir)
    name = check_model_name(name if name is not None else re.sub(r"[^A-Za-z0-9_.+-]", "-", model_dir.resolve().name).lstrip(".-_+")
                            or "model")
    model = meta_model(config)
    sites = find_experts(model)
    by_param = {f"{s.path}.{p}": (s, p) for s in sites for p in ("gate_up_proj", "down_proj")}
    meta_sd = model.state_dict()
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    fused: dict[tuple[str, str], _Part] = {}
    split: dict[tuple[str, str], dict[int, dict[int, _Part]]] = defaultdict(lambda: defaultdict(dict))
    resident: dict[str, _Part] = {}
    dtypes: set[str] = set()
    readers: dict[Path, ShardReader] = {}
    seen: dict[str, Path] = {}
    unused: list[str] = []
    try:
        for shard in shards(model_dir):
            reader = readers[shard] = ShardReader(shard)
            for key, info in reader.tensors.items():
                if key in seen:
                    raise CoEError(f"{model_dir}: tensor '{key}' is in two shards ({seen[key].name}, {shard.name})")
                seen[key] = shard
                target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
                if target in by_param:
                    site, param = by_param[target]
                    dtypes.add(info.dtype)
                    if pattern is None:
                        fused[(site.path, param)] = _Part(shard, key)
                    else:
                        order, e = _split_source(key, pattern, converters)
                        split[(site.path, param)][e][order] = _Part(shard, key)
                elif target in meta_sd:
                    if target in resident:
                        raise CoEError(f"{model_dir}: checkpoint keys '{resident[target].key}' and '{key}' both map "
                                       f"to the model's '{target}'")
                    resident[target] = _Part(shard, key)
                else:
                    unused.append(key)
        _check_complete(sites, fused, split, model_dir)
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        lacking = sorted(k for k in meta_sd if k not in by_param and k not in resident and k not in tied)
        if lacking:
            raise CoEError(f"{model_dir}: the checkpoint lacks {len(lacking)} non-expert weights the model needs: "
                           f"{', '.join(lacking[:3])}")
        stored = _one_dtype(dtypes, model_dir) if want is None else _castable(dtypes, model_dir, want)
        # every check the headers allow, before anything under `out` changes: a re-import that would fail
        # part-way must leave the model already there working
        _check_sites(sites, _top_k(config), model_dir)
        _check_expert_headers(sites, readers, fused, split, model_dir)
        _check_resident(resident, readers, meta_sd, model_dir)
        if unused:
            log.warning("%s: %d checkpoint tensor(s) the model (as its config.json describes it) has no place for "
                        "are left out, e.g. %s", model_dir, len(unused), ", ".join(unused[:3]))
        keep32 = _kept_in_fp32(model, stored)
        store = ExpertStore(out)
        nbytes: dict[int, int] = {}

        def experts():
            done = 0
            for site in sites:
                for e in range(site.num_experts):
                    tensors = {p: _read_param(readers, site, p, e, fused, split)
                               for p in ("gate_up_proj", "down_proj")}
                    _check_shapes(site, e, tensors, model_dir)
                    if want is not None:
                        tensors = _cast(tensors, want, f"{model_dir}: expert {e} of '{site.path}'")
                    yield (Expert(id=expert_id(name, site.layer, e), arch=f"transformers/{config.model_type}",
                                  kind="moe-ffn", classes=(), input_size=site.hidden), tensors, 1)
                    done += 1                 # back here: the store has written it to its file
                    if progress:
                        progress("experts", done)

        layer_of = {expert_id(name, s.layer, e): s.layer for s in sites for e in range(s.num_experts)}

        def landed(entry) -> None:
            nbytes[layer_of[entry.id]] = entry.nbytes
        # a re-import into a store that has a model: its layout goes before the first expert is replaced (every
        # check above passed), so an import killed part-way leaves a store that refuses to load ("not found; is
        # it a store written by 'coe-agent llm import'?"), never one that loads with experts of two checkpoints
        (out / LAYOUT_FILE).unlink(missing_ok=True)
        store.write_each(experts(), done=landed)
        layout_layers = [MoELayer(s.layer, s.path, s.num_experts, s.hidden, s.intermediate, nbytes[s.layer])
                         for s in sites]
        sha, rbytes = _write_resident(out / "resident.safetensors", readers, resident, progress, stored, keep32,
                                      model_dir)
    finally:
        for r in readers.values():
            r.close()
    _copy_model_files(model_dir, out / MODEL_SUBDIR)
    if want is not None:
        _record_config_dtype(out / MODEL_SUBDIR / "config.json", want)
    scoring = "sigmoid" if getattr(config, "scoring_func", "softmax") == "sigmoid" or any(
        hasattr(m, "e_score_correction_bias") for m in model.modules()) else "softmax"
    layout = MoELayout(model=name, model_type=config.model_type, top_k=_top_k(config), dtype=stored,
                       layers=tuple(layout_layers), resident_sha256=sha, resident_nbytes=rbytes, scoring=scoring,
                       extra={"source": str(model_dir.resolve()),
                              "norm_topk_prob": bool(getattr(config, "norm_topk_prob", True)),
                              "routed_scaling_factor": float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)})
    layout.save(out)        # checked as the reader checks it first (equal expert counts per layer, say)
    return layout


def _split_source(key: str, pattern: str, converters) -> tuple[int, int]:
    """(position of `pattern` in its converter's sources, expert index) for a per-expert checkpoint key."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    for conv in converters:
        sources = conv.source_patterns if isinstance(conv.source_patterns, list) else [conv.source_patterns]
        if pattern not in sources:
            continue
        ops = list(conv.operations)
        if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0 or any(
                not isinstance(o, Concatenate) or o.dim != 1 for o in ops[1:]):
            raise CoEError(f"checkpoint key '{key}': its conversion ({', '.join(type(o).__name__ for o in ops)}) "
                           "is not a plain stack of per-expert matrices; coe-edge cannot split it")
        regex = re.escape(pattern).replace(r"\*", r"(\d+)")
        m = re.search(regex, key)
        if m is None:
            raise CoEError(f"checkpoint key '{key}': no expert index where '{pattern}' expects one")
        return sources.index(pattern), int(m.group(1))
    raise CoEError(f"checkpoint key '{key}': matched '{pattern}' but no converter lists it")


def _check_complete(sites: list[ExpertsSite], fused, split, model_dir: Path) -> None:
    for s in sites:
        for p in ("gate_up_proj", "down_proj"):
            if (s.path, p) in fused:
                continue
            have = split.get((s.path, p), {})
            parts = 2 if p == "gate_up_proj" else 1
            missing = [e for e in range(s.num_experts) if len(have.get(e, {})) != parts]
            if missing:
                raise CoEError(f"{model_dir}: the checkpoint lacks {p} of experts {missing[:5]} in '{s.path}' "
                               f"(layer {s.layer})")


def _one_dtype(dtypes: set[str], model_dir: Path) -> str:
    if len(dtypes) != 1:
        raise CoEError(f"{model_dir}: expert tensors come in several dtypes ({', '.join(sorted(dtypes))}); "
                       "coe-edge stores one dtype per model")
    (dtype,) = dtypes
    if dtype not in ("float32", "float16", "bfloat16"):
        raise CoEError(f"{model_dir}: expert tensors are {dtype}; coe-edge imports float32, float16 or bfloat16")
    return dtype


def _castable(dtypes: set[str], model_dir: Path, want: str) -> str:
    """With a stored dtype asked for, the experts may come in any floating dtypes: each is cast."""
    other = sorted(d for d in dtypes if d not in FLOATING_DTYPES)
    if other:
        raise CoEError(f"{model_dir}: expert tensors are {', '.join(other)}; coe-edge casts only floating-point "
                       f"weights to {want}")
    return want


def _cast(tensors: dict, want: str, where: str) -> dict:
    try:
        return cast_floating(tensors, want, keep_underflow=False)   # llm.json states one dtype
    except CoEError as exc:
        raise CoEError(f"{where}: {exc}") from None


def _record_config_dtype(path: Path, want: str) -> None:
    """Say the stored dtype in the copied config.json: transformers builds the model skeleton in it."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CoEError(f"{path}: cannot record the stored dtype: {exc}") from None
    raw["dtype"] = want
    if "torch_dtype" in raw:
        raw["torch_dtype"] = want
    path.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")


def _read_param(readers, site: ExpertsSite, param: str, e: int, fused, split):
    import torch

    part = fused.get((site.path, param))
    if part is not None:
        return readers[part.shard].read(part.key, e)
    pieces = split[(site.path, param)][e]
    tensors = [readers[pieces[i].shard].read(pieces[i].key) for i in sorted(pieces)]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _check_shapes(site: ExpertsSite, e: int, tensors: dict, model_dir: Path) -> None:
    want = {"gate_up_proj": (2 * site.intermediate, site.hidden), "down_proj": (site.hidden, site.intermediate)}
    for p, shape in want.items():
        if tuple(tensors[p].shape) != shape:
            raise CoEError(f"{model_dir}: expert {e} of '{site.path}': {p} is {list(tensors[p].shape)}, the config "
                           f"says {list(shape)}")


def _check_out(model_dir: Path, out: Path) -> None:
    """`--out` checked before anything is read or written: not the checkpoint itself (its experts and resident
    file would join the checkpoint, which could then never import again), and `out/model` a folder if there."""
    m, o = model_dir.resolve(), out.resolve()
    if o == m or m in o.parents:
        raise CoEError(f"--out {out}: inside the checkpoint {model_dir}; give the store a folder of its own")
    sub = out / MODEL_SUBDIR
    if sub.exists() and not sub.is_dir():
        raise CoEError(f"--out {out}: {sub} is a file; the store keeps the model's config files in that folder")


def _check_sites(sites: list[ExpertsSite], top_k: int, model_dir: Path) -> None:
    for s in sites:
        if s.num_experts < 1:
            raise CoEError(f"{model_dir}/config.json: '{s.path}' has {s.num_experts} experts")
        if top_k > s.num_experts:
            raise CoEError(f"{model_dir}/config.json: each token asks for {top_k} experts (num_experts_per_tok) "
                           f"but '{s.path}' has {s.num_experts}")


def _check_expert_headers(sites: list[ExpertsSite], readers, fused, split, model_dir: Path) -> None:
    """Every expert tensor's shape, from the shard headers (no data read): a fused tensor holds exactly
    num_experts slices of the config's shape; per-expert pieces stack to it, and none is numbered past it."""
    for s in sites:
        want = {"gate_up_proj": (2 * s.intermediate, s.hidden), "down_proj": (s.hidden, s.intermediate)}
        for p, shape in want.items():
            part = fused.get((s.path, p))
            if part is not None:
                have = readers[part.shard].tensors[part.key].shape
                if tuple(have) != (s.num_experts, *shape):
                    raise CoEError(f"{model_dir}: '{part.key}' is {list(have)}, the config says "
                                   f"{[s.num_experts, *shape]} ({s.num_experts} experts of {list(shape)})")
                continue
            for e, pieces in sorted(split.get((s.path, p), {}).items()):
                if e >= s.num_experts:
                    key = next(iter(pieces.values())).key
                    raise CoEError(f"{model_dir}: '{key}' is expert {e} of '{s.path}', which the config gives "
                                   f"{s.num_experts} experts (num_experts)")
                shapes = [readers[pieces[i].shard].tensors[pieces[i].key].shape for i in sorted(pieces)]
                stacked = (sum(x[0] for x in shapes), shapes[0][1]) if all(len(x) == 2 for x in shapes) and len(
                    {x[1] for x in shapes}) == 1 else None
                if stacked != shape:
                    keys = ", ".join(pieces[i].key for i in sorted(pieces))
                    raise CoEError(f"{model_dir}: expert {e} of '{s.path}': {keys} are "
                                   f"{[list(x) for x in shapes]}, which do not make {p} {list(shape)} "
                                   "(the config's sizes)")


def _check_resident(resident: dict[str, _Part], readers, meta_sd: dict, model_dir: Path) -> None:
    """Each non-expert tensor has the shape of the model parameter it becomes, and a floating dtype where the
    model's is floating: checked at import, not met as a traceback from load_state_dict at generation."""
    for target, part in sorted(resident.items()):
        info = readers[part.shard].tensors[part.key]
        ref = meta_sd[target]
        if tuple(info.shape) != tuple(ref.shape):
            raise CoEError(f"{model_dir}: '{part.key}' is {list(info.shape)}, the model's '{target}' is "
                           f"{list(ref.shape)} (does config.json describe this checkpoint?)")
        if ref.is_floating_point() and info.dtype not in FLOATING_DTYPES:
            raise CoEError(f"{model_dir}: '{part.key}' is {info.dtype}, the model's '{target}' is floating point")


def _kept_in_fp32(model, stored: str) -> Callable[[str], bool]:
    """Which parameters transformers keeps in float32 when it loads this model in `stored` (its dtype plan)."""
    import torch

    try:
        plan = model._get_dtype_plan(getattr(torch, stored))
    except (AttributeError, TypeError):
        plan = {}
    patterns = [re.compile(rf"(^|\.){re.escape(p)}($|\.)") for p, dt in plan.items() if dt == torch.float32]
    return lambda name: any(p.search(name) for p in patterns)


def _write_resident(path: Path, readers, resident: dict[str, _Part], progress, stored: str,
                    keep32: Callable[[str], bool], model_dir: Path) -> tuple[str, int]:
    """Stream the non-expert weights into one file, each floating one cast as it passes to the model's dtype
    (`stored`), or to float32 where the model keeps a module in float32 (`keep32`: DeepSeek-V3's router), as
    transformers' own loading does: a bf16 checkpoint with an fp32 router would otherwise mix dtypes in one
    matmul, and a router rounded to bf16 would route other tokens than the reference."""
    specs = []
    for target in sorted(resident):
        part = resident[target]
        info = readers[part.shard].tensors[part.key]
        to = ("float32" if keep32(target) else stored) if info.dtype in FLOATING_DTYPES else info.dtype
        specs.append((target, to, info.shape))
    writer = StreamWriter(path, specs, metadata={"coe": json.dumps({"kind": "moe-resident"})})
    try:
        for i, (target, to, _) in enumerate(specs):
            part = resident[target]
            tensor = readers[part.shard].read(part.key)
            if str(tensor.dtype).removeprefix("torch.") != to:
                tensor = _cast({part.key: tensor}, to, str(model_dir))[part.key]
            writer.write(target, tensor)
            if progress:
                progress("resident", i + 1)
        return writer.close(), writer.nbytes
    except BaseException:
        writer.abort()
        raise


def _copy_model_files(model_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name not in _WEIGHT_NAMES:
            shutil.copy2(f, dest / f.name)


def _top_k(config) -> int:
    for attr in ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    raise CoEError(f"config of '{config.model_type}': no top-k attribute (num_experts_per_tok)")
