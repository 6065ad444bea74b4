"""Import a trained expert's weights into the expert store, once.

Weights arrive as safetensors or as PyTorch pickles (.pt/.pth/.ckpt).  The
store itself never unpickles, so this is the one place a pickle is opened, and
only when the operator says they trust it: unpickling can run arbitrary code.
Even then `torch.load(weights_only=True)` is tried first, which refuses
anything but tensors and plain containers; the unrestricted load is used only
for the ultralytics family, whose checkpoints pickle whole model objects.

The weights are checked by building the expert's module with its backend
before anything is written, so a file for the wrong architecture or class count
fails here, naming the expert and the file, and leaves the store unchanged.
With `dtype` the floating-point weights are cast first (`storage.dtypes`), so
the check builds the expert exactly as it will be stored.

It lives in `executors` because the check needs the backends; `storage` only
stores (it imports nothing above `coe`).
"""
from __future__ import annotations

import dataclasses
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coe import CoEError, Expert

from storage.dtypes import cast_floating, parse_dtype
from storage.expert_store import ExpertStore, ManifestEntry

from .backends import get_backend

if TYPE_CHECKING:
    import torch

SAFE_SUFFIXES = (".safetensors",)
ONNX_SUFFIXES = (".onnx",)
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt")
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model")  # where training scripts nest a state_dict
UNSAFE_FALLBACK_FAMILIES = ("ultralytics",)


def import_expert(store: ExpertStore, expert: Expert, src: str | Path, *, trust: bool = False,
                  dtype: str | None = None) -> ManifestEntry:
    """Convert `src` into the store as `expert` (version = the stored one + 1, or 1); return its manifest entry.

    `dtype` (fp32, fp16, bf16 or a torch name) is the stored dtype of the
    floating-point weights; without it they keep the file's dtype.  Raises
    CoEError for a refused or unreadable file or a cast that overflows fp16,
    ExpertLoadError (naming the expert and `src`) when the weights do not fit
    the expert's arch.
    """
    want = parse_dtype(dtype, where="dtype") if dtype is not None else None
    src = Path(src)
    # resolve the backend first: an unknown arch fails before the file is opened, and the
    # ultralytics backend pins its offline settings before any unpickling imports ultralytics
    backend = get_backend(expert.arch)
    if not src.is_file():
        raise CoEError(f"expert '{expert.id}': weights file {src} does not exist")
    suffix = src.suffix.lower()
    if suffix in ONNX_SUFFIXES:
        return _import_onnx(store, expert, src, backend, want)
    if backend.family == "onnx":
        raise CoEError(f"expert '{expert.id}' is an {expert.arch} in the spec: import an .onnx file, not {src.name}")
    if suffix in SAFE_SUFFIXES:
        tensors = _read_safetensors(expert, src)
    elif suffix in PICKLE_SUFFIXES:
        if not trust:
            raise CoEError(f"expert '{expert.id}': {src} is a pickle file; pickles can run code when loaded; "
                           "pass --trust if you trust its source")
        tensors = _read_pickle(expert, src)
    else:
        raise CoEError(f"expert '{expert.id}': cannot import {src}: unknown weights format '{src.suffix}' "
                       f"(expected one of {', '.join(SAFE_SUFFIXES + PICKLE_SUFFIXES + ONNX_SUFFIXES)})")
    tensors = _owned_cpu(_strip_prefix(tensors, "module."))
    if want is not None:
        try:
            tensors = cast_floating(tensors, want)
        except CoEError as exc:
            raise CoEError(f"expert '{expert.id}': {src}: {exc}") from None
    # build on the backend's skeleton: missing, unexpected or mis-shaped keys raise ExpertLoadError naming src
    module = backend.build(dataclasses.replace(expert, uri=str(src)), tensors)
    del module
    return store.write(expert, tensors, version=_next_version(store, expert.id))


def _import_onnx(store: ExpertStore, expert: Expert, src: Path, backend, want: str | None) -> ManifestEntry:
    """An .onnx file becomes one uint8 tensor (the pools page it like any expert); a session build checks it."""
    import torch

    if backend.family != "onnx":
        raise CoEError(f"expert '{expert.id}': {src.name} is an ONNX model but the spec says {expert.arch}; "
                       f"give the expert an onnx/<name> arch (e.g. onnx/{expert.model_name})")
    if want is not None:
        raise CoEError(f"expert '{expert.id}': --dtype does not apply to an .onnx file (its graph fixes the dtypes)")
    blob = src.read_bytes()
    if not blob:
        raise CoEError(f"expert '{expert.id}': {src} is empty (0 bytes), not an ONNX model")
    tensors = {"onnx.model": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}
    named = dataclasses.replace(expert, uri=str(src))
    module = backend.build(named, tensors)                   # ExpertLoadError names src
    backend.check_fits(module, named)                        # output channels too, by one zero image
    del module
    return store.write(expert, tensors, version=_next_version(store, expert.id))


def _next_version(store: ExpertStore, expert_id: str) -> int:
    """The version an import writes: the one on disk now + 1, or 1.

    The manifest on disk, not this process's view of it: another process may
    have promoted the expert since the store was opened, and the import must
    not write a second file under a version that already ran.  `store.write`
    puts a held expert's new version in a file of its own, so a running agent
    finishes its frames on the old one.
    """
    found = store.read_manifest().get(expert_id)
    return found.version + 1 if found is not None else 1


def _read_safetensors(expert: Expert, src: Path) -> dict[str, "torch.Tensor"]:
    from safetensors.torch import load_file

    try:
        return load_file(str(src))
    except Exception as exc:  # SafetensorError, OSError: the file is not what its name says
        raise CoEError(f"expert '{expert.id}': cannot read {src} as safetensors: {exc}") from None


def _read_pickle(expert: Expert, src: Path) -> dict[str, "torch.Tensor"]:
    """A trusted pickle's state_dict: weights_only first, the unrestricted load only for ultralytics."""
    import torch

    if not _looks_like_torch_file(src):
        raise CoEError(f"expert '{expert.id}': cannot read {src} with torch.load: "
                       "not a PyTorch checkpoint (neither a zip archive nor a pickle)")
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # holds objects other than tensors and plain containers
        if expert.family not in UNSAFE_FALLBACK_FAMILIES:
            # torch hides the refused global behind a generic preamble; the cause names it
            why = _first_line(exc.__context__ if exc.__context__ is not None else exc)
            raise CoEError(f"expert '{expert.id}': {src} holds Python objects, not just tensors, and "
                           f"{expert.family} weights must be a plain state_dict "
                           f"(torch.load weights_only refused it: {why})") from None
        return _read_ultralytics(expert, src)
    except Exception as exc:  # truncated zip, not a torch file at all
        raise CoEError(f"expert '{expert.id}': cannot read {src} with torch.load: {_first_line(exc)}") from None
    return _state_dict_of(expert, src, ckpt)


def _read_ultralytics(expert: Expert, src: Path) -> dict[str, "torch.Tensor"]:
    """An ultralytics checkpoint pickles the model object; its EMA copy holds the weights to serve."""
    import torch

    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CoEError(f"expert '{expert.id}': cannot read {src} with torch.load: {_first_line(exc)}") from None
    if not isinstance(ckpt, Mapping):
        raise CoEError(f"expert '{expert.id}': {src} is not an ultralytics checkpoint "
                       f"(a dict with 'model' or 'ema'), got {type(ckpt).__name__}")
    model = ckpt.get("ema")
    if model is None:
        model = ckpt.get("model")
    if isinstance(model, torch.nn.Module):
        _check_names(expert, src, getattr(model, "names", None))
        return dict(model.float().state_dict())
    if model is not None:
        return _state_dict_of(expert, src, {"model": model})
    raise CoEError(f"expert '{expert.id}': {src} is not an ultralytics checkpoint: no 'ema' or 'model' "
                   f"(top-level keys: {_keys(ckpt)})")


def _check_names(expert: Expert, src: Path, names: Any) -> None:
    """A checkpoint's class names against the spec's, in order: the head's i-th class becomes the spec's i-th
    label in every box, so classes trained in another order would label every defect wrongly."""
    if isinstance(names, Mapping):
        try:
            names = [names[i] for i in range(len(names))]
        except KeyError:
            return                      # not ultralytics' {0: 'name', ...}: nothing to compare
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return
    if list(names) == [str(i) for i in range(len(names))]:
        return                          # a model built from its YAML alone: '0', '1', ... say nothing
    def norm(name: str) -> str:         # 'Solder bridge' and 'solder_bridge' are one class
        return " ".join(name.replace("_", " ").replace("-", " ").split()).casefold()
    trained, spec = [norm(n) for n in names], [norm(c) for c in expert.classes]
    if trained != spec:
        at = next((i for i, (a, b) in enumerate(zip(trained, spec)) if a != b), min(len(trained), len(spec)))
        raise CoEError(f"expert '{expert.id}': {src} was trained on {len(names)} classes, the spec's {expert.id} "
                       f"has {len(expert.classes)}, and they differ at index {at}: "
                       f"{list(names)[at] if at < len(names) else '(none)'!r} against "
                       f"{expert.classes[at] if at < len(expert.classes) else '(none)'!r} (its head's i-th class "
                       "is the spec's i-th label: same classes in the same order)")


def _state_dict_of(expert: Expert, src: Path, ckpt: Any) -> dict[str, "torch.Tensor"]:
    """The state_dict in `ckpt`: the dict itself, or one nested under a conventional key."""
    if _is_state_dict(ckpt):
        return dict(ckpt)
    if isinstance(ckpt, Mapping):
        for key in STATE_DICT_KEYS:
            if _is_state_dict(ckpt.get(key)):
                return dict(ckpt[key])
        raise CoEError(f"expert '{expert.id}': {src} holds no state_dict: expected a dict of tensors, or one "
                       f"under {', '.join(repr(k) for k in STATE_DICT_KEYS)} (top-level keys: {_keys(ckpt)})")
    raise CoEError(f"expert '{expert.id}': {src} holds a {type(ckpt).__name__}, not a state_dict")


def _is_state_dict(obj: Any) -> bool:
    import torch

    return (isinstance(obj, Mapping) and bool(obj)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


def _strip_prefix(tensors: dict[str, "torch.Tensor"], prefix: str) -> dict[str, "torch.Tensor"]:
    """Drop the prefix DataParallel adds, but only if every key has it (else it is a real module name)."""
    if tensors and all(k.startswith(prefix) for k in tensors):
        return {k[len(prefix):]: v for k, v in tensors.items()}
    return tensors


def _owned_cpu(tensors: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """Contiguous CPU tensors that share no storage: safetensors refuses aliased tensors (tied weights)."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        t = v.detach().to("cpu").contiguous()
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() != t.numel() * t.element_size():
            t = t.clone()
            st = t.untyped_storage()
        seen.add(st.data_ptr())
        out[k] = t
    return out


def _looks_like_torch_file(src: Path) -> bool:
    """torch.save writes a zip archive (or, before torch 1.6, a raw pickle starting with PROTO 0x80)."""
    if zipfile.is_zipfile(src):
        return True
    with open(src, "rb") as fh:
        return fh.read(1) == b"\x80"


def _keys(d: Mapping[Any, Any], n: int = 8) -> str:
    keys = [repr(k) for k in list(d)[:n]]
    return ", ".join(keys) + (", ..." if len(d) > n else "") if keys else "none"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
