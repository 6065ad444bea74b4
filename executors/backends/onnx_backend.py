"""ONNX Runtime experts (`onnx/<name>`): classifiers and YOLO detectors shipped as .onnx files.

An ONNX expert is one tensor in the store, the model file's bytes
(`MODEL_KEY`), so the pools page it like any other expert.  A switch builds
an InferenceSession from the resident bytes; there is no skeleton to re-point
(`builds_per_switch`), so what a switch costs is the session build, which the
profiler measures.  How to feed the model is read from the file's own
metadata (`coe-edge` in metadata_props, written by `export_onnx`): the task
(classifier logits or YOLO head output), the input normalisation, and the
per-sample activation bytes of the network it was exported from.  A file
without that metadata gets the family defaults of its expert kind.

Execution providers: the CPU provider here; with `onnxruntime-gpu` and a
CUDA device, TensorRT then CUDA (whichever the installed build offers), with
the input bound on the device through IO binding.  The session owns the
memory it allocates for the weights on a GPU; the pool accounts the bytes of
the model file.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coe import CoEError, Expert, ExpertLoadError, StepError, StepOutput

from .base import IMAGENET_MEAN, IMAGENET_STD, resize_batch

if TYPE_CHECKING:
    import numpy as np
    import torch

MODEL_KEY = "onnx.model"
META_KEY = "coe-edge"               # metadata_props key written by export_onnx
META_FORMAT = "coe-edge/onnx-expert"
PREPROCESS = ("imagenet", "unit")   # (x/255 - mean)/std, or x/255
TASKS = {"classifier": "logits", "detector": "yolo"}
DEFAULT_ACTIVATION_FACTOR = 16      # per-sample activation bytes = factor x input bytes, without metadata
_NAME = re.compile(r"^[A-Za-z0-9_.+-]{1,64}$")


@dataclass
class OnnxModule:
    """What `build` returns: a session and how to feed it (the executors treat it as the module)."""

    session: Any
    meta: dict
    device: str
    nbytes: int

    @property
    def input_name(self) -> str:
        return self.session.get_inputs()[0].name


def model_meta(session, expert: Expert) -> dict:
    """The file's coe-edge metadata, checked, with defaults for a file that has none."""
    raw = session.get_modelmeta().custom_metadata_map.get(META_KEY)
    meta = {"task": TASKS.get(expert.kind, ""), "preprocess": "imagenet" if expert.kind == "classifier" else "unit",
            "activation_bytes_per_sample": 0, "source_arch": ""}
    if raw:
        try:
            got = json.loads(raw)
            if not isinstance(got, dict) or got.get("format") != META_FORMAT:
                raise ValueError(f"format {got.get('format') if isinstance(got, dict) else got!r}")
        except ValueError as exc:
            raise ExpertLoadError(expert.id, expert.uri or "<onnx>", f"unreadable coe-edge metadata: {exc}") from None
        meta.update({k: got[k] for k in meta if k in got})
    if meta["task"] != TASKS.get(expert.kind):
        raise ExpertLoadError(expert.id, expert.uri or "<onnx>",
                              f"the model is a {meta['task'] or 'model of unknown task'}, the spec says {expert.kind}")
    if meta["preprocess"] not in PREPROCESS:
        raise ExpertLoadError(expert.id, expert.uri or "<onnx>",
                              f"unknown preprocess {meta['preprocess']!r} (known: {', '.join(PREPROCESS)})")
    act = meta["activation_bytes_per_sample"]
    if not isinstance(act, int) or isinstance(act, bool) or act < 0:
        raise ExpertLoadError(expert.id, expert.uri or "<onnx>",
                              f"activation_bytes_per_sample must be a whole number of bytes >= 0, got {act!r}")
    return meta


def _channels(shape) -> int | None:
    return shape[1] if len(shape) >= 2 and isinstance(shape[1], int) else None


def check_io(session, expert: Expert, meta: dict, *, probe: bool = False) -> None:
    """The model's input and output shapes against the spec: a wrong file fails at import, not per batch.

    Dimensions the model leaves symbolic are not checked, except with `probe`
    (import), which runs one zero image to learn the output's channels.
    """
    import numpy as np

    where = expert.uri or "<onnx>"
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1:    # the backend feeds one image batch: a second input is missing on every run
        raise ExpertLoadError(expert.id, where, f"the model has {len(inputs)} inputs "
                                                f"({', '.join(i.name for i in inputs)}); an expert takes one image batch")
    if inputs[0].type != "tensor(float)":
        raise ExpertLoadError(expert.id, where, f"the model's input is {inputs[0].type}; the backend feeds "
                                                "tensor(float) images")
    rank = 2 if meta["task"] == "logits" else 3
    out_shape = outputs[0].shape if outputs else None
    if not outputs or (isinstance(out_shape, list) and len(out_shape) != rank):
        raise ExpertLoadError(expert.id, where, f"the model's first output is {out_shape}; a {meta['task']} "
                                                f"expert's must have {rank} dimensions")
    shape = inputs[0].shape
    want = [None, 3, expert.input_size, expert.input_size]
    if len(shape) != 4 or any(isinstance(d, int) and w is not None and d != w for d, w in zip(shape, want)):
        raise ExpertLoadError(expert.id, where, f"the model takes input {shape}, the spec needs "
                                                f"[batch, 3, {expert.input_size}, {expert.input_size}]")
    if probe and isinstance(shape[0], int):   # import: a fixed batch fails every batch of another size (split
        #                                        to single frames); a store that already holds one still loads it
        raise ExpertLoadError(expert.id, where, f"the model takes a fixed batch of {shape[0]} (input {shape}); "
                                                "export it with a dynamic batch axis (ultralytics: dynamic=True; "
                                                "torch.onnx.export: dynamic_axes={input: {0: 'batch'}})")
    per = _channels(session.get_outputs()[0].shape)
    if per is None and probe:       # symbolic (a YOLO head's concat): run one zero image to see
        x = np.zeros((1, 3, expert.input_size, expert.input_size), np.float32)
        per = _channels(list(session.run(None, {session.get_inputs()[0].name: x})[0].shape))
    classes = len(expert.classes)
    need = classes if meta["task"] == "logits" else 4 + classes
    if isinstance(per, int) and per != need:
        what = "classes" if meta["task"] == "logits" else "box + class channels"
        raise ExpertLoadError(expert.id, where, f"the model outputs {per} {what}, the spec's {classes} classes "
                                                f"need {need}")


def providers_for(device: str, model: bytes | None = None) -> list:
    """Execution providers for `device`, best first, among those this onnxruntime build has (`model`: the
    bytes the session is built from, which key its TensorRT engines: `trt_cache_options`)."""
    import onnxruntime as ort

    if not device.startswith("cuda"):
        return ["CPUExecutionProvider"]
    index = int(device.partition(":")[2] or 0)
    have = set(ort.get_available_providers())
    trt = {"device_id": index, **trt_cache_options(model)} if "TensorrtExecutionProvider" in have else {}
    wanted = [("TensorrtExecutionProvider", trt), ("CUDAExecutionProvider", {"device_id": index})]
    chosen = [p for p in wanted if p[0] in have]
    if not chosen:
        raise CoEError(f"device {device}: this onnxruntime has no CUDA or TensorRT execution provider "
                       f"(has {', '.join(sorted(have))}); install onnxruntime-gpu, or run ONNX experts on the CPU")
    return [*chosen, "CPUExecutionProvider"]


def trt_cache_options(model: bytes | None = None) -> dict:
    """TensorRT engine and timing caches on disk, so a switch (a new session) reuses a built engine.

    Building a TensorRT engine takes seconds (minutes on a Jetson); without the
    cache every session build, that is every switch to an ONNX expert, and every
    new batch shape would pay it again.  `COE_TRT_CACHE` names the directory
    (default: coe-edge-trt in the temp dir).  onnxruntime names a cached engine
    by the graph's node and initializer names and the input shapes, never by
    the weights (microsoft/onnxruntime#6455): every expert of one architecture
    (352 ResNet twins) would share one engine, and run the first one's weights.
    So each model's engines go in a folder of their own, named by the sha256 of
    its bytes (a promoted version gets a new one).  The timing cache, kernel
    timings per layer shape, is shared.
    """
    root = os.environ.get("COE_TRT_CACHE") or os.path.join(tempfile.gettempdir(), "coe-edge-trt")
    engines = os.path.join(root, hashlib.sha256(model).hexdigest()[:32]) if model is not None else root
    os.makedirs(engines, exist_ok=True)
    return {"trt_engine_cache_enable": True, "trt_engine_cache_path": engines,
            "trt_timing_cache_enable": True, "trt_timing_cache_path": root}


class OnnxBackend:
    """Any classifier or YOLO detector exported to ONNX, run by onnxruntime."""

    family = "onnx"
    builds_per_switch = True     # a switch builds a session; there is no skeleton to re-point

    def __init__(self) -> None:
        self._act_per_sample: dict[str, int] = {}
        self._lock = threading.Lock()

    def model_names(self) -> list[str]:
        return []

    def check_model(self, model_name: str) -> None:
        """Any plain name (it says what the file was exported from, e.g. onnx/resnet18)."""
        if not _NAME.match(model_name):
            raise CoEError(f"onnx model name {model_name!r} must be 1-64 letters, digits or _.+-")

    def init_weights(self, expert: Expert, seed: int) -> dict[str, "torch.Tensor"]:
        raise CoEError(f"expert '{expert.id}': ONNX experts are not generated; import one "
                       f"(coe-agent experts import {expert.id} model.onnx) or export one from a torch expert "
                       f"(coe-agent experts export-onnx SOURCE_ID --out model.onnx)")

    def build(self, expert: Expert, tensors: Mapping[str, "torch.Tensor"], device: str = "cpu") -> OnnxModule:
        """A session over the resident model bytes (copied to the host: onnxruntime parses host memory)."""
        import onnxruntime as ort

        where = expert.uri or "<tier>"
        if set(tensors) != {MODEL_KEY}:
            raise ExpertLoadError(expert.id, where, f"an ONNX expert holds exactly one tensor '{MODEL_KEY}', "
                                                    f"got {sorted(tensors)[:4]}")
        blob = tensors[MODEL_KEY].detach().cpu().contiguous().numpy().tobytes()
        import torch

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = torch.get_num_threads()   # the same cores torch executors get
        try:
            session = ort.InferenceSession(blob, sess_options=options, providers=providers_for(device, blob))
        except CoEError:
            raise
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise ExpertLoadError(expert.id, where, f"onnxruntime cannot load the model: "
                                                    f"{str(exc).splitlines()[0][:300]}") from None
        meta = model_meta(session, expert)
        check_io(session, expert, meta)
        if meta["activation_bytes_per_sample"]:
            with self._lock:
                self._act_per_sample[expert.id] = int(meta["activation_bytes_per_sample"])
        return OnnxModule(session, meta, device, len(blob))

    def check_fits(self, module: OnnxModule, expert: Expert) -> None:
        """At import: every shape against the spec, running one zero image where the graph does not say."""
        check_io(module.session, expert, module.meta, probe=True)

    def run(self, module: OnnxModule, expert: Expert,
            images: Sequence["np.ndarray"]) -> list[StepOutput | StepError]:
        import numpy as np
        import torch

        if not images:
            return []
        x = resize_batch(expert, images).astype(np.float32) / 255.0          # N, H, W, 3 RGB
        if module.meta["preprocess"] == "imagenet":
            x = (x - np.asarray(IMAGENET_MEAN, np.float32)) / np.asarray(IMAGENET_STD, np.float32)
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        out = torch.from_numpy(self._infer(module, x))
        if module.meta["task"] == "logits":
            from .torchvision_backend import classify

            return classify(out.float(), expert)
        from .ultralytics_backend import detections

        return detections(out, expert, images)

    @staticmethod
    def _infer(module: OnnxModule, x: "np.ndarray") -> "np.ndarray":
        if not module.device.startswith("cuda"):
            return module.session.run(None, {module.input_name: x})[0]
        import onnxruntime as ort

        binding = module.session.io_binding()                    # input on the device once, output fetched
        index = int(module.device.partition(":")[2] or 0)
        binding.bind_ortvalue_input(module.input_name, ort.OrtValue.ortvalue_from_numpy(x, "cuda", index))
        binding.bind_output(module.session.get_outputs()[0].name, "cuda", index)
        module.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    def activation_bytes(self, expert: Expert, batch_size: int) -> int:
        """Input bytes plus the exported network's per-sample activation peak (a default before the first build)."""
        input_bytes = 3 * expert.input_size * expert.input_size * 4
        per = self._act_per_sample.get(expert.id, DEFAULT_ACTIVATION_FACTOR * input_bytes)
        return int(batch_size * (input_bytes + per))
