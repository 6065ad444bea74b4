"""Learned routing: a small CNN reads the component type off the frame itself.

Rule routing needs the AOI machine to name the component in the header.  Where
it does not, `LearnedRouter` predicts the type from the pixels, and the type
names the first expert of the chain (the component's classifier).

The contract, because a misrouted frame gets a confident verdict from the
wrong expert:

* a header that names a component the spec does not know is rejected
  (`unknown_component`), whatever the network thinks;
* at or above `threshold` the network's type is used (router "learned");
* below it, a header that names the component decides (router
  "rules-fallback"); a header that names none gets `RouteError("low_confidence")`
  with the network's best guess in the detail.  Nothing is routed on a guess.

The weights live in the line's expert store under the id `router`, as any
expert does (safetensors, sha256 manifest, no pickle).  The class names and the
input size travel inside the same file as two small tensors (`meta.*`), so the
file alone is enough to rebuild the network and check it against the spec.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import cv2
import numpy as np
import torch
from torch import nn

from coe import CoEError, CoEModel, Expert

from .rules import Route, RouteError, RuleRouter

if TYPE_CHECKING:
    from storage.expert_store import ExpertStore

ROUTER_ID = "router"
ROUTER_ARCH = "coe/router-cnn"
INPUT_SIZES = range(16, 129)
MAX_WIDTH = 128                # RouterNet width a stored router may claim (the CLI trains 16; ~100 w^2 parameters)
DEFAULT_THRESHOLD = 0.9
_META_CLASSES = "meta.classes_json"
_META_SIZE = "meta.input_size"
_META_WIDTH = "meta.width"


class RouterNet(nn.Module):
    """Four 3x3 conv blocks (16-32-64 channels), a 4x4 pooled map, one linear layer.

    About 60k parameters: big enough to tell 24 package types apart by colour,
    size and lead pattern at 32 px, small enough to train on two CPU cores in
    seconds and to add well under a millisecond per frame to ingest.
    """

    def __init__(self, n_classes: int, width: int = 16) -> None:
        super().__init__()
        if n_classes < 1 or width < 1:
            raise ValueError(f"RouterNet needs n_classes >= 1 and width >= 1, got {n_classes}, {width}")
        w = width

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(
            *block(3, w), *block(w, w), nn.MaxPool2d(2),
            *block(w, 2 * w), nn.MaxPool2d(2),
            *block(2 * w, 4 * w), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(4 * w * 16, n_classes)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def preprocess(images: Sequence[np.ndarray], input_size: int) -> torch.Tensor:
    """HxWx3 (or HxW) uint8 RGB crops -> an Nx3xSxS float tensor, resized with area averaging.

    Shared by training and inference, so both see exactly the same pixels.
    Raises ValueError naming the offending image.
    """
    ready = []
    for i, img in enumerate(images):
        try:
            ready.append(_one(img, input_size))
        except ValueError as exc:
            raise ValueError(f"image {i}: {exc}" if len(images) > 1 else str(exc)) from None
    return _to_tensor(ready)


def _to_tensor(ready: list[np.ndarray]) -> torch.Tensor:
    x = torch.from_numpy(np.stack(ready).astype(np.float32)).permute(0, 3, 1, 2)
    return (x - 128.0) / 64.0


def _one(img: np.ndarray, size: int) -> np.ndarray:
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8:
        raise ValueError(f"expected a uint8 numpy array, got {getattr(img, 'dtype', type(img).__name__)}")
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.ndim != 3 or img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
        raise ValueError(f"expected an HxWx3 RGB image, got shape {tuple(img.shape)}")
    if img.shape[0] != size or img.shape[1] != size:
        img = cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA)
    return img


class LearnedRouter:
    """Routes a frame by the component type a CNN sees in it; see the module doc for the contract."""

    name = "learned"
    needs_image = True   # ingest routes it after decoding, one batch per read

    def __init__(self, model: CoEModel, net: nn.Module, classes: list[str], input_size: int, *,
                 threshold: float = DEFAULT_THRESHOLD, fallback: RuleRouter | None = None) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        if input_size not in INPUT_SIZES:
            raise ValueError(f"input_size must be in {INPUT_SIZES.start}..{INPUT_SIZES.stop - 1}, got {input_size!r}")
        _check_classes(model, list(classes), "learned router")
        self.model = model
        self.net = net.eval()
        self.classes = list(classes)
        self.input_size = int(input_size)
        self.threshold = float(threshold)
        self.fallback = fallback if fallback is not None else RuleRouter(model)

    # -- storage ------------------------------------------------------------------------
    @classmethod
    def load(cls, model: CoEModel, store: "ExpertStore", *, threshold: float = DEFAULT_THRESHOLD) -> "LearnedRouter":
        """The router stored in `store`; CoEError if there is none or it was trained for other components."""
        if not store.has(ROUTER_ID):
            raise CoEError(f"expert store {store.root} holds no learned router (id '{ROUTER_ID}'); "
                           f"train one: coe-agent router train --line LINE --data RECORDING")
        entry = store.entry(ROUTER_ID)
        if entry.arch != ROUTER_ARCH:
            raise CoEError(f"expert store {store.root}: '{ROUTER_ID}' is a {entry.arch}, not a {ROUTER_ARCH}")
        tensors = store.read(ROUTER_ID)
        where = f"learned router {store.root / entry.file}"
        try:
            raw = tensors.pop(_META_CLASSES)
            if raw.dtype != torch.uint8 or raw.dim() != 1:
                raise ValueError(f"classes must be a 1-D uint8 tensor, got {raw.dtype} {list(raw.shape)}")
            classes = json.loads(bytes(raw.tolist()).decode("utf-8"))
            size_t, width_t = tensors.pop(_META_SIZE), tensors.pop(_META_WIDTH)
            if size_t.numel() != 1 or width_t.numel() != 1 or size_t.is_floating_point() or width_t.is_floating_point():
                raise ValueError("input size and width must be one whole number each")
            input_size, width = int(size_t.item()), int(width_t.item())
        except (KeyError, ValueError, UnicodeDecodeError, RuntimeError, TypeError) as exc:
            raise CoEError(f"{where}: missing or unreadable metadata tensors ({exc})") from None
        if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
            raise CoEError(f"{where}: metadata classes must be a list of component names")
        if input_size not in INPUT_SIZES:
            raise CoEError(f"{where}: input size {input_size}, expected {INPUT_SIZES.start}..{INPUT_SIZES.stop - 1}")
        if not 1 <= width <= MAX_WIDTH:      # checked before the net is built: width^2 parameters
            raise CoEError(f"{where}: width {width}, expected 1..{MAX_WIDTH}")
        _check_classes(model, classes, where)
        net = RouterNet(len(classes), width)
        try:
            net.load_state_dict(tensors, strict=True)
        except RuntimeError as exc:
            raise CoEError(f"{where}: weights do not fit a RouterNet(width={width}): {exc}") from None
        return cls(model, net, classes, input_size, threshold=threshold)

    def save(self, store: "ExpertStore") -> None:
        """Write the network into `store` under the id `router` (atomic, like any expert)."""
        if not isinstance(self.net, RouterNet):
            raise CoEError(f"only a RouterNet can be stored as the learned router, not a {type(self.net).__name__}")
        if not 1 <= self.net.width <= MAX_WIDTH:     # what `load` takes: a router stored must load again
            raise CoEError(f"a RouterNet of width {self.net.width} cannot be stored (1..{MAX_WIDTH})")
        tensors = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        tensors[_META_CLASSES] = torch.tensor(list(json.dumps(self.classes).encode("utf-8")), dtype=torch.uint8)
        tensors[_META_SIZE] = torch.tensor([self.input_size], dtype=torch.int64)
        tensors[_META_WIDTH] = torch.tensor([self.net.width], dtype=torch.int64)
        expert = Expert(id=ROUTER_ID, arch=ROUTER_ARCH, kind="classifier", classes=tuple(self.classes),
                        input_size=self.input_size)
        on_disk = store.read_manifest().get(ROUTER_ID)      # a retrain is the next version, as a promotion is
        store.write(expert, tensors, version=on_disk.version + 1 if on_disk is not None else 1)

    # -- inference ----------------------------------------------------------------------
    def probabilities(self, images: Sequence[np.ndarray]) -> np.ndarray:
        """Softmax over `classes` for each image (N x C), in one forward pass."""
        if not images:
            return np.zeros((0, len(self.classes)), np.float32)
        return self._forward(preprocess(images, self.input_size))

    def _forward(self, x: torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            return torch.softmax(self.net(x), dim=1).numpy()

    def route(self, component: str | None, image: np.ndarray) -> Route:
        """Where one frame's chain starts; raises RouteError when it cannot be routed safely."""
        self._check_component(component)
        try:
            probs = self.probabilities([image])[0]
        except ValueError as exc:
            raise RouteError("bad_image", f"learned router: {exc}") from None
        return self._decide(component, probs)

    def route_batch(self, components: list[str | None], images: list[np.ndarray]) -> list[Route | RouteError]:
        """`route` for a whole ingest read with one forward pass; each frame's error is returned, not raised."""
        if len(components) != len(images):
            raise ValueError(f"route_batch: {len(components)} components but {len(images)} images")
        results: list[Route | RouteError | None] = [None] * len(images)
        todo: list[int] = []
        ready: list[np.ndarray] = []
        for i, (comp, img) in enumerate(zip(components, images)):
            try:
                self._check_component(comp)
                ready.append(_one(img, self.input_size))  # one bad image spoils only itself
            except RouteError as exc:
                results[i] = exc
                continue
            except ValueError as exc:
                results[i] = RouteError("bad_image", f"learned router: {exc}")
                continue
            todo.append(i)
        probs = self._forward(_to_tensor(ready)) if ready else np.zeros((0, len(self.classes)), np.float32)
        for row, i in enumerate(todo):
            try:
                results[i] = self._decide(components[i], probs[row])
            except RouteError as exc:
                results[i] = exc
        return results  # type: ignore[return-value]

    def _check_component(self, component: str | None) -> None:
        if component is not None and component not in self.model.components:
            self.fallback.route(component)  # raises unknown_component with the rule router's wording

    def _decide(self, component: str | None, probs: np.ndarray) -> Route:
        best = int(np.argmax(probs))
        conf = float(probs[best])
        predicted = self.classes[best]
        if conf >= self.threshold:
            return Route(self.model.components[predicted].classifier, conf, self.name, predicted)
        if component is not None:
            rule = self.fallback.route(component)
            return Route(rule.expert_id, rule.confidence, "rules-fallback", rule.component)
        raise RouteError("low_confidence",
                         f"learned router is {conf:.2f} sure of {predicted} (threshold {self.threshold:.2f}) "
                         f"and the header names no component")


def _check_classes(model: CoEModel, classes: list[str], where: str) -> None:
    if len(set(classes)) != len(classes):
        raise CoEError(f"{where}: duplicate component names in its classes")
    missing = sorted(set(model.components) - set(classes))
    extra = sorted(set(classes) - set(model.components))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"spec components it cannot predict: {', '.join(missing[:6])}"
                         + (", ..." if len(missing) > 6 else ""))
        if extra:
            parts.append(f"classes the spec does not have: {', '.join(extra[:6])}"
                         + (", ..." if len(extra) > 6 else ""))
        raise CoEError(f"{where} was trained for other components than spec {model.name} "
                       f"({'; '.join(parts)}); retrain: coe-agent router train")
