"""torchvision classifiers (`torchvision/<model>`), e.g. resnet18, mobilenet_v3_small.

Weights never come from torchvision's hub: `init_weights` builds the
architecture with `weights=None` and its own seeded initialisation, and `build`
assigns tensors read from the expert store into a meta-device skeleton.
"""
from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from coe import CoEError, Expert, StepError, StepOutput

from .base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    WORKSPACE_FACTOR,
    assign_weights,
    module_device_dtype,
    non_finite_message,
    resize_batch,
    to_input,
    trace_activation_peak,
)

if TYPE_CHECKING:
    import numpy as np
    import torch


def classify(logits: "torch.Tensor", expert: Expert) -> list[StepOutput | StepError]:
    """Label and softmax score per row of (N, C) logits; shared with runtimes that produce the same logits.

    A row with a NaN or infinite logit is that frame's `StepError`: argmax of
    NaN logits is label 0 (`ok` in every shipped spec), so a broken expert
    would otherwise send every frame on as good.
    """
    import torch

    # argmax on the logits, not the probabilities: calibrated demo weights can
    # separate labels by less than float32 resolves after softmax
    idx = logits.argmax(dim=1)
    score = logits.softmax(dim=1).gather(1, idx[:, None])[:, 0]
    finite = torch.isfinite(logits).all(dim=1)
    return [StepOutput(label=expert.classes[int(i)], score=float(s)) if ok else
            StepError("expert_output", non_finite_message(expert, row))
            for s, i, ok, row in zip(score, idx, finite.tolist(), logits)]


class TorchvisionBackend:
    """Classification models of torchvision, run as ImageNet-normalised RGB classifiers."""

    family = "torchvision"

    def __init__(self) -> None:
        self._skeletons: dict[tuple[str, int], torch.nn.Module] = {}
        self._act_per_sample: dict[tuple[str, int, int], int] = {}
        self._lock = threading.Lock()

    # -- names ------------------------------------------------------------------
    def model_names(self) -> list[str]:
        import torchvision

        return sorted(torchvision.models.list_models(module=torchvision.models))

    def check_model(self, model_name: str) -> None:
        """Raise CoEError unless `model_name` is a torchvision classification model."""
        names = self.model_names()
        if model_name not in names:
            close = difflib.get_close_matches(model_name, names, n=5, cutoff=0.6)
            hint = f" (similar: {', '.join(close)})" if close else ""
            raise CoEError(f"unknown torchvision classification model '{model_name}'{hint}")

    # -- weights ----------------------------------------------------------------
    def _construct(self, expert: Expert) -> torch.nn.Module:
        import torchvision

        self._check_expert(expert)
        return torchvision.models.get_model(expert.model_name, weights=None, num_classes=len(expert.classes))

    def init_weights(self, expert: Expert, seed: int) -> dict[str, torch.Tensor]:
        """A freshly initialised model of the arch (torchvision's own init), seeded; RNG state restored."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self._construct(expert)
        return {k: v.detach().contiguous() for k, v in model.state_dict().items()}

    def skeleton(self, expert: Expert) -> torch.nn.Module:
        """The cached meta-device model for (arch, number of classes): structure without storage."""
        import torch

        key = (expert.model_name, len(expert.classes))
        with self._lock:
            if key not in self._skeletons:
                with torch.device("meta"):
                    self._skeletons[key] = self._construct(expert).eval()
            return self._skeletons[key]

    def build(self, expert: Expert, tensors: Mapping[str, torch.Tensor], device: str = "cpu") -> torch.nn.Module:
        return assign_weights(self.skeleton(expert), expert, tensors, device)

    def head_bias_key(self, expert: Expert) -> str:
        """The state-dict key of the final Linear layer's bias (the one calibration may move)."""
        import torch

        last = None
        for name, mod in self.skeleton(expert).named_modules():
            if isinstance(mod, torch.nn.Linear) and mod.out_features == len(expert.classes):
                last = name
        if last is None or getattr(self.skeleton(expert).get_submodule(last), "bias", None) is None:
            raise CoEError(f"expert '{expert.id}': {expert.arch} has no final Linear layer with a bias")
        return f"{last}.bias"

    # -- running ----------------------------------------------------------------
    def logits(self, module: torch.nn.Module, expert: Expert, images: Sequence[np.ndarray]) -> torch.Tensor:
        """Raw class logits (N, C) as float32 on the CPU."""
        import torch

        device, dtype = module_device_dtype(module)
        x = to_input(resize_batch(expert, images), device, dtype, IMAGENET_MEAN, IMAGENET_STD)
        with torch.inference_mode():
            return module(x).float().cpu()

    def run(self, module: torch.nn.Module, expert: Expert, images: Sequence[np.ndarray]) -> list[StepOutput]:
        if not images:
            return []
        return classify(self.logits(module, expert, images), expert)

    def activation_bytes(self, expert: Expert, batch_size: int) -> int:
        """Input batch bytes + per-sample traced eager activation peak x WORKSPACE_FACTOR.

        The peak is traced once per (arch, classes, input size) on the meta
        skeleton (see base.trace_activation_peak); it grows linearly in the batch.
        """
        import torch

        key = (expert.model_name, len(expert.classes), expert.input_size)
        if key not in self._act_per_sample:
            x = torch.empty(1, 3, expert.input_size, expert.input_size, device="meta")
            peak = trace_activation_peak(self.skeleton(expert), x)
            with self._lock:
                self._act_per_sample[key] = peak
        input_bytes = 3 * expert.input_size * expert.input_size * 4
        return int(batch_size * (input_bytes + WORKSPACE_FACTOR * self._act_per_sample[key]))

    def _check_expert(self, expert: Expert) -> None:
        if expert.family != self.family:
            raise CoEError(f"expert '{expert.id}': arch '{expert.arch}' is not a {self.family} model")
        if expert.kind != "classifier":
            raise CoEError(f"expert '{expert.id}': the torchvision backend runs classifiers, not {expert.kind}s")
        self.check_model(expert.model_name)
