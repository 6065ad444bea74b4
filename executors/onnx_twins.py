"""Run a line's torch experts through ONNX Runtime: each gets an ONNX twin, kept beside the line's store.

With `runtime: onnx` (or `auto` choosing ONNX for an architecture), an expert
is served by its twin: the same id, classes and thresholds, arch
`onnx/<model>`, the bytes an ONNX export of the stored weights
(`onnx_export.export_onnx`).  Twins live in their own store under the line's
(`<expert_store>/.onnx`), with the version of the weights they were exported
from, so every inference row still names the expert's own version.  The
pools hold the twin's bytes like any expert's, and a switch builds a session
from them.

A twin is exported when missing, and again when its expert's stored bytes
change (a promotion): each read checks the source's sha256 against the one
the twin was made from, so a promoted expert never runs on a stale twin.  An
export whose outputs differ from torch's by more than `TOLERANCE` is refused:
the expert then stays on torch, and the reason is logged and kept.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from coe import CoEError, CoEModel, Expert, ExpertLoadError
from coe.files import write_json_atomic
from storage.expert_store import ExpertStore
from storage.store_union import StoreUnion

log = logging.getLogger(__name__)

TWIN_DIR = ".onnx"
SOURCES = "sources.json"
TOLERANCE = 1e-4
EXPORTABLE = ("torchvision", "ultralytics")


def twin_root(store_root: str | os.PathLike[str]) -> Path:
    return Path(store_root) / TWIN_DIR


class OnnxTwins:
    """The twin store of one line: exports on demand, and knows which source bytes each twin came from."""

    def __init__(self, base: ExpertStore, *, verify: str = "first", spec: CoEModel | None = None) -> None:
        self.base = base
        self.spec = spec          # the spec's torch experts: a twin is exported for their input size and classes
        self.root = twin_root(base.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CoEError(f"{self.root}: cannot create the ONNX twins' store ({exc.strerror or exc}); the line's "
                           "store must be writable for runtime onnx/auto") from None
        self.store = ExpertStore(self.root, verify=verify)
        self._sources_path = self.root / SOURCES
        self._sources: dict[str, str] = self._read_sources()
        self._lock = threading.Lock()
        self.exported: list[str] = []         # ids exported by this process (tests, logs)
        self.attempts = 0                     # exports tried, refused ones included
        self.refused: dict[str, str] = {}     # id -> why it stays on torch
        self._refused_sha: dict[str, str] = {}  # id -> the source sha256 whose export was refused (not retried)

    def _read_sources(self) -> dict[str, str]:
        try:
            doc = json.loads(self._sources_path.read_text()) if self._sources_path.is_file() else {}
            if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
                raise ValueError("expected an object of expert id -> source sha256 (and shape)")
            return doc
        except (OSError, ValueError) as exc:
            raise CoEError(f"{self._sources_path}: unreadable ({exc}); delete {self.root} to export again") from None

    def current(self, expert_id: str) -> bool:
        """True when the twin exists and was exported from the bytes the line's store holds now, for the
        spec's input size and classes (a spec that changed `input_size` needs another graph from the same
        weights: the old twin would fail every load)."""
        return (self.store.has(expert_id) and self.base.has(expert_id)
                and self._sources.get(expert_id) == self._recipe(expert_id))

    def _recipe(self, expert_id: str, sha: str | None = None) -> str:
        """What a twin is exported from: the source bytes' sha256 (`sha`: the ones the export read; a promotion
        during it must not be recorded as exported), and the spec's shape of the expert."""
        sha = sha or self.base.entry(expert_id).sha256
        e = self.spec.experts.get(expert_id) if self.spec is not None else None
        return sha if e is None else f"{sha}|{e.arch}|{e.input_size}|{len(e.classes)}"

    def ensure(self, expert: Expert) -> bool:
        """Export `expert`'s twin unless current; False (and `refused[id]`) when its export is not faithful."""
        with self._lock:
            if self.current(expert.id):
                return True
            if self._refused_sha.get(expert.id) == self.base.entry(expert.id).sha256:
                return False                  # these bytes were refused already: not exported again
            return self._export(expert)

    def _export(self, expert: Expert) -> bool:
        from .onnx_export import export_onnx, max_output_difference, onnx_expert, onnx_tensors

        self.attempts += 1
        source = self.base.entry(expert.id)
        tensors = self.base.read(expert.id)
        blob = export_onnx(expert, tensors)
        diff = max_output_difference(expert, tensors, blob)
        if not diff <= TOLERANCE:
            self.refused[expert.id] = (f"its ONNX export differs from torch by {diff:.2e} "
                                       f"(tolerance {TOLERANCE:.0e}); it runs on torch")
            log.warning("expert '%s': %s", expert.id, self.refused[expert.id])
            self._refused_sha[expert.id] = source.sha256
            return False
        twin = onnx_expert(expert, expert.id)
        self.store.write(twin, onnx_tensors(blob), version=source.version)
        self._sources[expert.id] = self._recipe(expert.id, source.sha256)
        write_json_atomic(self._sources_path, self._sources)
        self.exported.append(expert.id)
        return True


class TwinOverlay(StoreUnion):
    """The line's store, with the experts that run on ONNX read from their twins.

    Writes, the manifest the store watcher follows and every other expert
    stay with the line's store (`primary`).  Reading a twin first makes sure
    it is current, so a promotion re-exports before the new version loads.
    """

    def __init__(self, base: ExpertStore, twins: OnnxTwins, source: CoEModel, ids: set[str]) -> None:
        self.twins, self._source, self._ids = twins, source, set(ids)   # source: the spec's torch experts
        super().__init__(base, twins.store)

    def _index(self) -> dict[str, ExpertStore]:
        owner = {e.id: self.primary for e in self.primary.entries()}
        for eid in self._ids:
            if eid in owner and self.twins.store.has(eid):
                owner[eid] = self.twins.store
        return owner

    def _fresh(self, expert_id: str) -> ExpertStore:
        """The store to load `expert_id` from, its twin exported again first if the source changed.

        Only reads come here, which a pool runs outside its lock: look-ups
        (`entry`, `has`, sizes, layouts; the scheduler's, the status page's, a
        pool's `size` under its lock) never wait for an export.  The store
        watcher exports a promoted expert first (`prepare`); a load that races
        it is sized by the old twin (a few KB apart) and exported here.  A promoted expert whose
        export is refused cannot be served from its old twin: its load fails
        with the reason, and the expert is marked failed like any unloadable one.
        """
        if expert_id in self._ids and not self.twins.current(expert_id):
            if not self.twins.ensure(self._source.experts[expert_id]):
                raise ExpertLoadError(expert_id, str(self.twins.root),
                                      self.twins.refused.get(expert_id, "its ONNX export is not current"))
        return self._of(expert_id)

    def prepare(self, expert_id: str) -> None:
        """Export `expert_id`'s twin again now if its source changed (the store watcher calls it on a
        promotion, off the load path, so the next load is sized by the new twin)."""
        if expert_id in self._ids and not self.twins.current(expert_id):
            self.twins.ensure(self._source.experts[expert_id])

    def read(self, expert_id: str):
        return self._fresh(expert_id).read(expert_id)

    def read_flat(self, expert_id: str, **kw):
        return self._fresh(expert_id).read_flat(expert_id, **kw)

    @property
    def manifest_path(self):
        return self.primary.manifest_path

    def entries(self):
        return [self.entry(e.id) for e in self.primary.entries()]

    def reload(self) -> None:
        self.primary.reload()
        self.twins.store.reload()
        self._owner = self._index()


def serve_with_twins(model: CoEModel, store: ExpertStore, onnx_ids: Iterable[str], *,
                     progress: Callable[[str], None] | None = None
                     ) -> tuple[CoEModel, "ExpertStore | TwinOverlay", dict[str, str]]:
    """(model, store, refused): the experts `onnx_ids` served by their twins, exported first where needed.

    `refused` maps the experts kept on torch to the reason (an export that is
    not faithful, or a family ONNX cannot export).
    """
    refused: dict[str, str] = {}
    want = []
    for eid in onnx_ids:
        e = model.experts[eid]
        if e.family not in EXPORTABLE:
            refused[eid] = f"a {e.arch} expert cannot be exported to ONNX; it runs on its own backend"
        else:
            want.append(e)
    if not want:
        return model, store, refused
    twins = OnnxTwins(store, verify=store.verify, spec=model)
    done = set()
    for e in want:
        if progress is not None and not twins.current(e.id):
            progress(e.id)
        if twins.ensure(e):
            done.add(e.id)
    refused.update(twins.refused)
    if not done:
        return model, store, refused
    from .onnx_export import onnx_expert

    served = model.with_experts({eid: onnx_expert(model.experts[eid], eid) for eid in done})
    return served, TwinOverlay(store, twins, model, done), refused
