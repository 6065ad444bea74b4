"""The backend contract, and the pieces every backend shares.

A backend turns an expert's tensors into a runnable module and runs batches on
it.  The pool and the scheduler only ever see `Backend`; the model zoo of each
family (torchvision, ultralytics, ...) stays inside its own file.

Shared here:
- skeleton cloning, so that switching experts never constructs a model from
  scratch (the cost CoServe's switch latency is made of is the weight copy, not
  Python object construction);
- state-dict checking, so that a wrong file fails as `ExpertLoadError` naming
  the expert and the offending keys instead of a torch traceback;
- image batching, activation-memory tracing, and classifier calibration.
"""
from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from coe import CoEError, Expert, ExpertLoadError, StepError, StepOutput

if TYPE_CHECKING:
    import numpy as np
    import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Traced eager liveness (see `trace_activation_peak`) misses kernel workspaces and
# layout reorders.  Against torch.profiler's CPU allocation trace at batch 16,
# input 64, the real peak was 1.17x (shufflenet_v2_x1_0), 1.18x (mobilenet_v3_small)
# and 1.22x (resnet18) of the traced peak; 1.25 covers those with a little margin.
WORKSPACE_FACTOR = 1.25


def non_finite_message(expert: Expert, raw: "torch.Tensor") -> str:
    """What a frame's `StepError` says when the expert's raw output for it is not finite."""
    import torch

    nan, inf = int(torch.isnan(raw).sum()), int(torch.isinf(raw).sum())
    parts = [f"{nan} NaN" if nan else "", f"{inf} infinite" if inf else ""]
    return (f"expert {expert.id} gave a non-finite output for this frame ({', '.join(p for p in parts if p)} of "
            f"{raw.numel()} values): broken weights, or an overflow in its dtype")


@runtime_checkable
class Backend(Protocol):
    """What the executors need from a model family.

    `build` must be cheap relative to reading the weights: it clones a cached
    skeleton per (arch, number of classes) and assigns the tensors into it.
    """

    family: str

    def init_weights(self, expert: Expert, seed: int) -> dict[str, "torch.Tensor"]: ...

    def build(self, expert: Expert, tensors: Mapping[str, "torch.Tensor"],
              device: str = "cpu") -> "torch.nn.Module": ...

    def run(self, module: "torch.nn.Module", expert: Expert,
            images: Sequence["np.ndarray"]) -> list[StepOutput | StepError]: ...

    def activation_bytes(self, expert: Expert, batch_size: int) -> int: ...


@runtime_checkable
class CalibratableBackend(Backend, Protocol):
    """A classifier backend that exposes raw logits and its final layer's bias key."""

    def logits(self, module: "torch.nn.Module", expert: Expert,
               images: Sequence["np.ndarray"]) -> "torch.Tensor": ...

    def head_bias_key(self, expert: Expert) -> str: ...


# -- building -------------------------------------------------------------------

def clone_skeleton(skeleton: "torch.nn.Module") -> "torch.nn.Module":
    """A structural copy of `skeleton` whose parameters and buffers are meta tensors.

    Python attributes (e.g. ultralytics' `stride`) are deep-copied; registered
    tensors are not, because `load_state_dict(assign=True)` replaces them anyway.
    Copying them would cost as much as the expert's weights on every switch.
    """
    import torch

    memo: dict[int, object] = {}
    for p in skeleton.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in skeleton.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(skeleton, memo)


def check_state(expert: Expert, expected: Mapping[str, "torch.Tensor"],
                tensors: Mapping[str, "torch.Tensor"]) -> None:
    """Raise ExpertLoadError unless `tensors` has exactly the keys and shapes of `expected`."""
    where = expert.uri or "<tensors>"
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = sorted(k for k in set(expected) & set(tensors)
                       if tuple(expected[k].shape) != tuple(tensors[k].shape))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys ({_few(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys ({_few(unexpected)})")
    if misshaped:
        shown = ", ".join(f"{k}: file {tuple(tensors[k].shape)} vs {expert.arch} {tuple(expected[k].shape)}"
                          for k in misshaped[:3])
        more = f", ... {len(misshaped) - 3} more" if len(misshaped) > 3 else ""
        problems.append(f"{len(misshaped)} mis-shaped tensors ({shown}{more})")
    if problems:
        raise ExpertLoadError(expert.id, where,
                              f"weights do not fit {expert.arch} with {len(expert.classes)} classes: "
                              + "; ".join(problems))


def assign_weights(skeleton: "torch.nn.Module", expert: Expert,
                   tensors: Mapping[str, "torch.Tensor"], device: str) -> "torch.nn.Module":
    """Clone `skeleton`, check and assign `tensors` into it, move it to `device`, eval mode."""
    import torch

    check_state(expert, skeleton.state_dict(), tensors)
    module = clone_skeleton(skeleton)
    try:
        module.load_state_dict(dict(tensors), strict=True, assign=True)
    except RuntimeError as exc:  # dtype or other incompatibility check_state cannot see
        raise ExpertLoadError(expert.id, expert.uri or "<tensors>", f"load_state_dict failed: {exc}") from None
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise ExpertLoadError(expert.id, expert.uri or "<tensors>",
                              f"tensors not provided by the weights: {_few(left)}")
    module.eval()
    if torch.device(device) != torch.device("cpu"):
        module.to(device)
    return module


def module_device_dtype(module: "torch.nn.Module") -> tuple["torch.device", "torch.dtype"]:
    p = next(module.parameters())
    return p.device, p.dtype


# -- running --------------------------------------------------------------------

def resize_batch(expert: Expert, images: Sequence["np.ndarray"]) -> "np.ndarray":
    """Resize HxWx3 uint8 images to the expert's square input, stacked as (N, S, S, 3) uint8."""
    import cv2
    import numpy as np

    size = expert.input_size
    out = np.empty((len(images), size, size, 3), dtype=np.uint8)
    for i, img in enumerate(images):
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            desc = f"{type(img).__name__} {getattr(img, 'dtype', '')} {getattr(img, 'shape', '')}".strip()
            raise CoEError(f"expert '{expert.id}': image {i} must be an HxWx3 uint8 RGB array, got {desc}")
        h, w = img.shape[:2]
        if h == 0 or w == 0:
            raise CoEError(f"expert '{expert.id}': image {i} is empty ({h}x{w})")
        if (h, w) == (size, size):
            out[i] = img
        else:
            shrink = h > size or w > size
            out[i] = cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    return out


def to_input(batch: "np.ndarray", device: "torch.device", dtype: "torch.dtype",
             mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> "torch.Tensor":
    """(N, S, S, 3) uint8 -> (N, 3, S, S) float in [0, 1], optionally mean/std normalised."""
    import torch

    x = torch.from_numpy(batch).to(device).permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    if mean is not None and std is not None:
        m = torch.tensor(mean, device=device).view(1, 3, 1, 1)
        s = torch.tensor(std, device=device).view(1, 3, 1, 1)
        x = x.sub_(m).div_(s)
    return x.contiguous().to(dtype)


# -- activation memory ------------------------------------------------------------

def trace_activation_peak(module: "torch.nn.Module", x: "torch.Tensor") -> int:
    """Peak bytes of intermediate tensors alive at once during one eager forward of `x`.

    Runs the forward under a dispatch mode that counts every new storage when an
    op creates it and uncounts it when Python frees it, so it follows eager
    liveness exactly (skip connections, saved feature maps, in-place ops).  It
    works on meta tensors, so it costs no compute.  It does not see kernel
    workspaces; callers scale it by WORKSPACE_FACTOR.  `x` itself is not counted.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = 0
            self.peak = 0
            self.seen: set[int] = set()

        def _free(self, key: int, n: int) -> None:
            self.live -= n
            self.seen.discard(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    key = id(st)
                    if key not in self.seen:
                        n = st.nbytes()
                        self.seen.add(key)
                        self.live += n
                        weakref.finalize(st, self._free, key, n)
            self.peak = max(self.peak, self.live)
            return out

    mode = _Live()
    with torch.inference_mode(), mode:
        out = module(x)
    del out
    return int(mode.peak)


# -- calibration ----------------------------------------------------------------

def calibrate_classifier(backend: CalibratableBackend, expert: Expert,
                         tensors: Mapping[str, "torch.Tensor"], images: Sequence["np.ndarray"],
                         iterations: int = 300) -> dict[str, "torch.Tensor"]:
    """Shift the final layer's bias so predicted-label shares on `images` approach `expert.priors`.

    This is calibration of *generated* demo weights, not training: a randomly
    initialised classifier otherwise says the same label for nearly everything,
    which makes a demo line all-pass or all-defect.  Only the bias changes, so
    the label still depends on the input.

    The bias is the dual variable of assigning the samples to labels in the
    prior proportions, so it is found by Sinkhorn iterations on the bias-free
    logits z: b += tau * (log prior - log mean softmax((z + b) / tau)).  Random
    networks give logits whose spread across images ranges from 1e-1 (resnet18)
    to 1e-10 (mobilenet_v3_small), so tau is tried at several multiples of that
    spread and the bias whose hard argmax shares are closest (L1) to the priors
    wins.  Returns new tensors; the input mapping is not modified.
    """
    import torch

    if expert.kind != "classifier":
        raise CoEError(f"expert '{expert.id}': only classifiers can be calibrated, not a {expert.kind}")
    if not images:
        raise CoEError(f"expert '{expert.id}': calibration needs at least one sample image")
    target = torch.tensor([expert.prior(c) for c in expert.classes], dtype=torch.float64)
    if float(target.sum()) <= 0:
        raise CoEError(f"expert '{expert.id}': priors are all zero")
    target = target / target.sum()
    log_target = torch.log(target.clamp_min(1e-9))

    key = backend.head_bias_key(expert)
    dtype = tensors[key].dtype
    module = backend.build(expert, tensors)
    z = backend.logits(module, expert, images).to(torch.float64) - tensors[key].detach().to(torch.float64)
    z = z - z.mean(dim=0)  # the mean is absorbed by the bias; what is left is how images differ
    spread = float(z.std(dim=0).mean()) if z.shape[0] > 1 else 0.0
    if not math.isfinite(spread) or spread <= 0:
        spread = 1.0  # images indistinguishable: the bias can only pick one label

    def error(b: torch.Tensor) -> float:
        b = b.to(dtype).to(torch.float64)  # judge the bias as it will be stored
        counts = torch.bincount((z + b).argmax(dim=1), minlength=len(expert.classes))
        return float((counts.to(torch.float64) / z.shape[0] - target).abs().sum())

    best = log_target * spread
    best_err = error(best)
    for tau in (spread * f for f in (1.0, 0.3, 0.1, 0.03, 0.01)):
        bias = torch.zeros_like(target)
        for _ in range(iterations):
            soft = torch.softmax((z + bias) / tau, dim=1).mean(dim=0)
            bias = bias + tau * (log_target - torch.log(soft.clamp_min(1e-300)))
        err = error(bias)
        if err < best_err:
            best, best_err = bias, err
    # z was centred, so undo that shift and express the bias against the raw logits
    raw_mean = (backend.logits(module, expert, images).to(torch.float64)
                - tensors[key].detach().to(torch.float64)).mean(dim=0)
    out = dict(tensors)
    out[key] = (best - raw_mean).to(dtype).contiguous()
    return out


def _few(keys: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f", ... {len(keys) - n} more" if len(keys) > n else "")
