"""Export a torch expert (torchvision classifier, ultralytics detector) to an ONNX expert.

The exported file carries what the ONNX backend needs to feed it, in its own
metadata (`coe-edge` in metadata_props): task, input normalisation, source
arch and the per-sample activation bytes of the torch network, so an .onnx
file moved to another box still runs the same way.  The batch axis is
dynamic; the input size is the expert's.  Export is in fp32 whatever the
stored dtype, since ONNX Runtime's CPU provider runs fp32 kernels.
"""
from __future__ import annotations

import dataclasses
import io
import json
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from coe import CoEError, Expert

from .backends import get_backend
from .backends.onnx_backend import META_FORMAT, META_KEY, MODEL_KEY

if TYPE_CHECKING:
    import torch

OPSET = 17
_PREPROCESS = {"torchvision": "imagenet", "ultralytics": "unit"}
_TASK = {"classifier": "logits", "detector": "yolo"}


def onnx_expert(source: Expert, expert_id: str) -> Expert:
    """The spec entry of the ONNX twin of `source`: same classes, kind and thresholds, arch onnx/<model>."""
    return dataclasses.replace(source, id=expert_id, arch=f"onnx/{source.model_name}", uri="")


def export_onnx(expert: Expert, tensors: Mapping[str, "torch.Tensor"]) -> bytes:
    """The .onnx bytes of `expert` built from `tensors` (CoEError for a family that cannot export)."""
    import onnx
    import torch

    family = expert.family
    if family not in _PREPROCESS:
        raise CoEError(f"expert '{expert.id}': cannot export a {expert.arch} to ONNX "
                       f"(exportable families: {', '.join(sorted(_PREPROCESS))})")
    backend = get_backend(expert.arch)
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    module = _FirstOutput(backend.build(expert, fp32, "cpu")).eval()
    size = expert.input_size
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")           # the TorchScript exporter's deprecation notice
        torch.onnx.export(module, (torch.zeros(2, 3, size, size),), buf, input_names=["images"],
                          output_names=["output"], dynamic_axes={"images": {0: "batch"}, "output": {0: "batch"}},
                          opset_version=OPSET, dynamo=False)
    model = onnx.load_from_string(buf.getvalue())
    input_bytes = 3 * size * size * 4
    meta = {"format": META_FORMAT, "task": _TASK[expert.kind], "preprocess": _PREPROCESS[family],
            "source_arch": expert.arch,
            "activation_bytes_per_sample": max(0, backend.activation_bytes(expert, 1) - input_bytes)}
    entry = model.metadata_props.add()
    entry.key, entry.value = META_KEY, json.dumps(meta, sort_keys=True)
    return model.SerializeToString()


def onnx_tensors(blob: bytes) -> dict[str, "torch.Tensor"]:
    """An ONNX expert's store tensors: the file's bytes as one uint8 tensor."""
    import torch

    return {MODEL_KEY: torch.frombuffer(bytearray(blob), dtype=torch.uint8)}


def max_output_difference(expert, tensors, blob: bytes, batch: int = 4, seed: int = 0) -> float:
    """Max |torch - onnxruntime| over the raw outputs of one random batch, both in fp32 on the CPU.

    A classifier's outputs are its logits.  A YOLO detector's raw output holds,
    per anchor, a box in input pixels (rows 0-3) and class scores (the rest):
    the box rows are compared as fractions of the input size, so a detector
    is held to the same 1e-4 as a logit, not to 1e-4 of a pixel (a trained
    det-3pin differs by 3.7e-4 px at 64 px, 6e-6 of the crop).
    """
    import numpy as np
    import onnxruntime as ort
    import torch

    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    module = get_backend(expert.arch).build(expert, fp32, "cpu")
    x = torch.rand(batch, 3, expert.input_size, expert.input_size, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        want = module(x)
    want = (want[0] if isinstance(want, (tuple, list)) else want).float().numpy()
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    diff = np.abs(got - want)
    if expert.kind == "detector" and diff.ndim == 3 and diff.shape[1] > 4:
        diff[:, :4] /= expert.input_size                  # (batch, 4 + classes, anchors): boxes in crop units
    return float(diff.max())


class _FirstOutput:
    """Wraps a module whose eval forward returns (predictions, extras): export the predictions only."""

    def __new__(cls, module):
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self, inner) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, x):
                out = self.inner(x)
                return out[0] if isinstance(out, (tuple, list)) else out

        return Wrapper(module)
