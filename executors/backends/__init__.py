"""Model backends, one file per family, and the registry that picks one for an arch.

The registry is derived from the backend classes and fails loudly: an unknown
family or model name raises CoEError naming the arch and what is known, at
spec load or zoo build, not when the first frame arrives.  Backends are
per-process singletons because they cache skeletons.
"""
from __future__ import annotations

import threading

from coe import CoEError

from .base import Backend, CalibratableBackend, calibrate_classifier
from .onnx_backend import OnnxBackend
from .torchvision_backend import TorchvisionBackend
from .ultralytics_backend import UltralyticsBackend

BACKEND_CLASSES: dict[str, type] = {cls.family: cls for cls in (TorchvisionBackend, UltralyticsBackend, OnnxBackend)}

_instances: dict[str, Backend] = {}
_lock = threading.Lock()


def get_backend(arch: str) -> Backend:
    """The backend for 'family/model' (model name checked) or a bare 'family'."""
    family, _, model = arch.partition("/")
    cls = BACKEND_CLASSES.get(family)
    if cls is None:
        raise CoEError(f"no backend for arch '{arch}': unknown family '{family}' "
                       f"(known families: {', '.join(sorted(BACKEND_CLASSES))})")
    with _lock:
        backend = _instances.get(family)
        if backend is None:
            backend = _instances[family] = cls()
    if model:
        try:
            backend.check_model(model)
        except CoEError as exc:
            raise CoEError(f"no backend for arch '{arch}': {exc}") from None
    return backend


__all__ = [
    "BACKEND_CLASSES", "Backend", "CalibratableBackend", "OnnxBackend", "TorchvisionBackend", "UltralyticsBackend",
    "calibrate_classifier", "get_backend",
]
