"""Build the expert zoo: generate every expert of a spec into the expert store.

Nothing is downloaded.  Each expert gets a real, randomly initialised model of
its architecture, seeded from `seed` plus a CRC32 of the expert id, so the same
seed gives the same files for an expert however the spec is reordered or grown.  Classifiers can then be calibrated
on sample images (their final bias only; see
`executors.backends.calibrate_classifier`) so a demo line shows a plausible
ok/defect mix.  This is generated demo content, not trained models.

Weights are generated (and calibrated) in fp32; `dtype` casts them just before
they are written, so an fp16 or bf16 zoo holds exactly the fp32 zoo's weights
rounded once.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from coe import CoEModel
from executors.backends import CalibratableBackend, calibrate_classifier, get_backend
from storage.dtypes import cast_floating, parse_dtype
from storage.expert_store import ExpertStore, ManifestEntry

from .zoo_train import note_cast

if TYPE_CHECKING:
    import numpy as np


def build_zoo(model: CoEModel, store: ExpertStore, *, seed: int = 0, force: bool = False,
              sample_images: Callable[[str], list["np.ndarray"]] | None = None,
              progress: Callable[[str], None] | None = None, dtype: str | None = None) -> list[ManifestEntry]:
    """Write every expert of `model` to `store`; return the manifest entries in spec order.

    An expert already in the store with the same arch and kind is kept unless
    `force`.  `sample_images(expert_id)` supplies calibration images for a
    classifier; without it classifiers are stored as initialised.  `dtype`
    (fp32, fp16, bf16 or a torch name) is the stored dtype; an expert stored
    in another dtype is then cast to it (its weights, trained or generated,
    are kept; `force` generates new ones).  Without it experts are written in
    fp32 and kept whatever their dtype.
    """
    say = progress or (lambda _msg: None)
    want = parse_dtype(dtype, where="dtype") if dtype is not None else None
    # resolve every backend first: an unknown arch fails before anything is written
    backends = {eid: get_backend(exp.arch) for eid, exp in model.experts.items()}
    entries: list[ManifestEntry] = []
    total = len(model.experts)
    for index, (eid, expert) in enumerate(model.experts.items()):
        if not force and store.has(eid):
            existing = store.entry(eid)
            if existing.arch == expert.arch and existing.kind == expert.kind:
                if want in (None, existing.dtype):
                    say(f"[{index + 1}/{total}] {eid}: kept ({expert.arch}, {existing.nbytes} bytes)")
                    entries.append(existing)
                    continue
                # another dtype: the stored weights (trained, perhaps) are cast, not replaced by generated ones
                entry = store.write(expert, cast_floating(store.read(eid), want), version=existing.version + 1)
                note_cast(store, eid, existing.sha256, entry.sha256)
                say(f"[{index + 1}/{total}] {eid}: cast from {existing.dtype} to {entry.dtype} ({entry.nbytes} bytes)")
                entries.append(entry)
                continue
        backend = backends[eid]
        tensors = backend.init_weights(expert, expert_seed(seed, eid))
        note = ""
        if expert.kind == "classifier" and sample_images is not None:
            if isinstance(backend, CalibratableBackend):
                tensors = calibrate_classifier(backend, expert, tensors, sample_images(eid))
                note = ", calibrated"
            else:
                note = f", not calibrated ({backend.family} backend cannot)"
        if want is not None:
            tensors = cast_floating(tensors, want)
        entry = store.write(expert, tensors)
        say(f"[{index + 1}/{total}] {eid}: wrote {expert.arch}, {entry.nbytes} bytes {entry.dtype}{note}")
        entries.append(entry)
    return entries


def expert_seed(seed: int, expert_id: str) -> int:
    """The init seed of one expert: `seed` plus a stable (CRC32) index of its id."""
    return seed + zlib.crc32(expert_id.encode("utf-8"))
