"""ultralytics YOLO detectors (`ultralytics/<model>`), e.g. yolov8n, yolov8s, yolo11n.

The model is built from the architecture YAML that ships inside the ultralytics
package (never from a weights file, never from the network).  ultralytics reads
its settings and may phone home at import, so every entry point first pins
`YOLO_CONFIG_DIR` (a private temp dir unless the caller passes one) and
`YOLO_OFFLINE=1`, with `setdefault` so a deployment's own choice wins.  That
happens inside methods, never when this module is imported.

Only NMS-style heads (`Detect`) are supported; end-to-end heads (yolov10, yolo26)
produce a different output layout and are refused by name.
"""
from __future__ import annotations

import copy
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coe import CoEError, Expert, StepError, StepOutput

from .base import (
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

# ultralytics' predictor default; the per-expert confidence threshold comes from the spec.
IOU_THRESHOLD = 0.7
MAX_DETECTIONS = 300


def offline(config_dir: str | None = None) -> None:
    """Pin ultralytics to a private settings dir and offline mode before it is imported (it resolves DNS names
    and writes its settings at import otherwise); `setdefault`, so a deployment's own choice wins."""
    os.environ.setdefault("YOLO_CONFIG_DIR", config_dir or os.path.join(tempfile.gettempdir(), "coe-edge-ultralytics"))
    os.environ.setdefault("YOLO_OFFLINE", "1")


def detections(preds: "torch.Tensor", expert: Expert,
               images: Sequence["np.ndarray"]) -> list[StepOutput | StepError]:
    """NMS on raw YOLO head output (N, 4 + classes, anchors), boxes scaled back to each image's pixels.

    Shared by every runtime that produces ultralytics' raw head output (torch, ONNX Runtime).
    An image whose head output holds a NaN or infinite value is that frame's
    `StepError`: NMS compares `conf > threshold`, NaN compares false, so every
    box of a broken expert would be dropped and the frame passed.
    NMS runs without ultralytics' time limit (by default 2 s + 50 ms an image, on
    the wall clock): past it, the images not yet reached get no boxes, a silent
    pass, on a slow or busy CPU, for a large batch, or across a clock step.
    """
    import torch

    offline()      # the ONNX detector path reaches ultralytics here first, maybe on a node that never set it
    try:
        from ultralytics.utils.nms import non_max_suppression
    except ImportError:  # older ultralytics keeps it in ops
        from ultralytics.utils.ops import non_max_suppression

    dets = non_max_suppression(preds.float(), conf_thres=expert.conf_threshold, iou_thres=IOU_THRESHOLD,
                               nc=len(expert.classes), max_det=MAX_DETECTIONS, max_time_img=float("inf"))
    size = expert.input_size
    finite = torch.isfinite(preds.flatten(1)).all(dim=1).tolist()
    outs: list[StepOutput | StepError] = []
    for img, det, ok, raw in zip(images, dets, finite, preds):
        if not ok:
            outs.append(StepError("expert_output", non_finite_message(expert, raw)))
            continue
        h, w = img.shape[:2]
        boxes = []
        for x1, y1, x2, y2, conf, cls in det.cpu().tolist():
            boxes.append((
                round(min(max(x1 * w / size, 0.0), w), 2), round(min(max(y1 * h / size, 0.0), h), 2),
                round(min(max(x2 * w / size, 0.0), w), 2), round(min(max(y2 * h / size, 0.0), h), 2),
                round(conf, 2), expert.classes[int(cls)],
            ))
        outs.append(StepOutput(boxes=tuple(boxes)))
    return outs


class UltralyticsBackend:
    """YOLO detectors; input RGB / 255 at the expert's square input size, boxes in image pixels."""

    family = "ultralytics"

    def __init__(self, config_dir: str | os.PathLike[str] | None = None) -> None:
        self._config_dir = str(config_dir) if config_dir is not None else None
        self._skeletons: dict[tuple[str, int], torch.nn.Module] = {}
        self._act_per_sample: dict[tuple[str, int, int], int] = {}
        self._cfgs: dict[str, tuple[Path, str]] | None = None
        self._lock = threading.Lock()

    def _offline(self) -> None:
        """Pin ultralytics to a private settings dir and offline mode before it is imported."""
        offline(self._config_dir)

    # -- names ------------------------------------------------------------------
    def _configs(self) -> dict[str, tuple[Path, str]]:
        """model name -> (architecture YAML inside the package, scale letter or '')."""
        if self._cfgs is not None:
            return self._cfgs
        self._offline()
        import ultralytics
        import yaml

        found: dict[str, tuple[Path, str]] = {}
        root = Path(ultralytics.__file__).parent / "cfg" / "models"
        for path in sorted(root.glob("*/*.yaml")):
            if "-" in path.stem or not path.stem.startswith("yolo"):
                continue
            d = yaml.safe_load(path.read_text(encoding="utf-8"))
            head = d.get("head") or []
            if d.get("end2end") or not head or head[-1][2] != "Detect":
                continue
            for scale in d.get("scales") or {"": None}:
                found[path.stem + scale] = (path, scale)
        self._cfgs = found
        return found

    def model_names(self) -> list[str]:
        return sorted(self._configs())

    def check_model(self, model_name: str) -> None:
        """Raise CoEError unless `model_name` is a YOLO detection architecture this backend can build."""
        self._resolve(model_name)

    def _resolve(self, model_name: str) -> tuple[Path, str]:
        cfgs = self._configs()
        name = model_name[:-1] if model_name not in cfgs and model_name.endswith("u") else model_name
        if name not in cfgs:
            raise CoEError(f"unknown ultralytics detection model '{model_name}' "
                           f"(known: {', '.join(sorted(cfgs))})")
        return cfgs[name]

    # -- weights ----------------------------------------------------------------
    def _construct(self, expert: Expert) -> torch.nn.Module:
        self._check_expert(expert)
        path, scale = self._resolve(expert.model_name)
        from ultralytics.nn.tasks import DetectionModel
        from ultralytics.utils import YAML

        cfg: dict[str, Any] = dict(YAML.load(path))
        nc = len(expert.classes)
        cfg.update(scale=scale, yaml_file=f"{expert.model_name}.yaml", nc=nc)
        return DetectionModel(cfg, ch=3, nc=nc, verbose=False)

    def init_weights(self, expert: Expert, seed: int) -> dict[str, torch.Tensor]:
        """A freshly initialised model of the arch (ultralytics' own init), seeded; RNG state restored."""
        import torch

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self._construct(expert)
        return {k: v.detach().contiguous() for k, v in model.state_dict().items()}

    def skeleton(self, expert: Expert) -> torch.nn.Module:
        """The cached CPU model for (arch, number of classes).

        DetectionModel cannot be built on the meta device (its head init reads
        values), so the skeleton is real; `build` clones its structure only.
        """
        key = (expert.model_name, len(expert.classes))
        with self._lock:
            if key not in self._skeletons:
                self._skeletons[key] = self._construct(expert).eval()
            return self._skeletons[key]

    def build(self, expert: Expert, tensors: Mapping[str, torch.Tensor], device: str = "cpu") -> torch.nn.Module:
        return assign_weights(self.skeleton(expert), expert, tensors, device)

    # -- running ----------------------------------------------------------------
    def run(self, module: torch.nn.Module, expert: Expert, images: Sequence[np.ndarray]) -> list[StepOutput]:
        """Boxes (x1, y1, x2, y2, conf, label) in each image's own pixel coordinates, after NMS."""
        import torch

        if not images:
            return []
        self._offline()
        device, dtype = module_device_dtype(module)
        x = to_input(resize_batch(expert, images), device, dtype)
        with torch.inference_mode():
            preds = module(x)
            if isinstance(preds, (tuple, list)):
                preds = preds[0]
        return detections(preds, expert, images)

    def activation_bytes(self, expert: Expert, batch_size: int) -> int:
        """Input batch bytes + per-sample traced eager activation peak x WORKSPACE_FACTOR.

        The peak (see base.trace_activation_peak) is traced once per
        (arch, classes, input size) with one real CPU forward of a zero image on
        a private copy of the skeleton (the head caches anchors per input shape).
        It includes the feature maps the neck keeps for its concatenations.
        """
        import torch

        key = (expert.model_name, len(expert.classes), expert.input_size)
        if key not in self._act_per_sample:
            probe = copy.deepcopy(self.skeleton(expert))
            x = torch.zeros(1, 3, expert.input_size, expert.input_size)
            peak = trace_activation_peak(probe, x)
            with self._lock:
                self._act_per_sample[key] = peak
        input_bytes = 3 * expert.input_size * expert.input_size * 4
        return int(batch_size * (input_bytes + WORKSPACE_FACTOR * self._act_per_sample[key]))

    def _check_expert(self, expert: Expert) -> None:
        if expert.family != self.family:
            raise CoEError(f"expert '{expert.id}': arch '{expert.arch}' is not an {self.family} model")
        if expert.kind != "detector":
            raise CoEError(f"expert '{expert.id}': the ultralytics backend runs detectors, not {expert.kind}s")
        if expert.input_size % 32:
            raise CoEError(f"expert '{expert.id}': detector input size must be a multiple of 32, "
                           f"got {expert.input_size}")
