"""The expert store: one safetensors file per expert on SSD, plus a JSON manifest.

The manifest is the source of truth for what the store holds: id, arch, kind,
file, sha256 of the file, tensor bytes, dominant dtype and a version.  Loading
never unpickles (safetensors is a JSON header plus raw bytes), and every failure
to load is an `ExpertLoadError` that names the expert, the file and the reason,
because a corrupt expert on a line box must be diagnosable from one log line.

Writes are atomic: the tensor file and the manifest are each written to a temp
file, fsynced and `os.replace`d, so a crash leaves the old version or the new
one, never half of either.  Within a process the manifest is guarded by a lock;
across processes (two zoo builds on one store) by an advisory file lock where
the platform has one.

`read` memory-maps the file: the tensors are backed by the page cache, not by
private memory, and stay valid while the file is removed because the inode
stays with its readers.  Nothing here rewrites a file in place (a truncation
under a live mapping would SIGBUS the reader), and a new version of an expert
never takes the name of a file the manifest names: it gets a file of its own,
so a reader that still serves the old manifest (an agent finishing frames on
the old versions) is never handed the new bytes under the old entry.  A pool
that must own its bytes (pinned memory, a GPU copy) copies them itself.

Every manifest write counts its `generation` up by one.  A live reader
(`storage/store_readers.py`) records the generation it serves; a replaced
file is *retired* with the generation that replaced it and removed once every
live reader serves that generation or a later one.

Hash checking costs a full read of the file, which is exactly what a cold load
is trying to avoid, so `verify` chooses: 'first' (once per expert and content per
process), 'always', or 'never' (a truncated or corrupt file still fails to parse).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from coe import CoEError, Expert, ExpertLoadError
from coe.expert import id_problem
from coe.files import fsync_dir, fsync_file

from .flat import Layout, read_layout
from .safetensors_io import DATA_ALIGN
from .store_readers import ReaderLock, reader_generations

try:  # advisory locking between processes; absent on Windows, where the in-process lock still holds
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import torch

    from .flat import FlatWeights, MappedFlat

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "coe-edge/expert-store"
MANIFEST_VERSION = 2          # 2 adds compression; version 1 manifests read as uncompressed stores
READ_VERSIONS = (1, 2)
SUFFIX = ".safetensors"
_T = TypeVar("_T")
_SET_FILE = re.compile(r".+\.v\d+-[0-9a-f]{6}\.(safetensors|coez)$")   # write_many's file names
# a writer's temp files (`_tmp`, `StreamWriter`): `.<file>.<pid>[.<hex>].tmp`; a dead pid's are a kill's leftovers
_TMP_FILE = re.compile(r"^\..+\.(\d+)(?:\.[0-9a-f]{8})?\.tmp$")
VERIFY_POLICIES = ("first", "always", "never")
COMPRESSIONS = ("none", "exponent-zstd")
_ZSUFFIX = ".coez"            # a compressed expert's file (storage.compressed.SUFFIX)
log = logging.getLogger(__name__)


class ChangedOnDisk(CoEError):
    """A rewrite of an expert's same bytes found another version on disk when it landed (nothing replaced)."""

    def __init__(self, expert_id: str, version: int, now: int | None) -> None:
        super().__init__(f"expert {expert_id}: changed on disk while being rewritten (was version {version}, now "
                         + ("gone" if now is None else f"version {now}") + "); not replaced")
        self.expert_id = expert_id
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ManifestEntry:
    """One expert as the manifest records it.  `nbytes` counts tensor bytes, not file bytes.

    `sha256` is always the hash of the plain safetensors bytes, decoded ones
    for a compressed expert, so it means the same whatever the store does.
    Older manifests lack the last four fields; they read as plain files.
    """

    id: str
    arch: str
    kind: str
    file: str
    sha256: str
    nbytes: int
    dtype: str
    version: int
    compression: str = "none"
    stored_nbytes: int = 0   # the file on disk
    plain_nbytes: int = 0    # the plain safetensors file it decodes to
    bound_nbytes: int = 0    # entropy bound of the compressed form (0: not measured)

    @property
    def ratio(self) -> float:
        """Stored bytes over plain-file bytes (1.0 for a plain file)."""
        if self.compression == "none" or not self.plain_nbytes:
            return 1.0
        return self.stored_nbytes / self.plain_nbytes

    @property
    def bound(self) -> float | None:
        """The exponent-entropy bound as a ratio of the plain file, when measured."""
        return self.bound_nbytes / self.plain_nbytes if self.bound_nbytes and self.plain_nbytes else None


class ExpertStore:
    """Expert tensors on disk, addressed by expert id.

    `read` returns a dict of CPU tensors memory-mapped from the file; `write`
    replaces an expert atomically.  Ids are file names, so an id with a path
    separator or '..' is refused, and no manifest entry may point outside `root`.

    With `reader=True` the store registers as a live reader before it reads its
    first manifest (see `register_reader`), and from then on it follows a new
    manifest only through `reload()`: the switch is its owner's to make.
    """

    def __init__(self, root: str | os.PathLike[str], verify: str = "first", *, reader: bool = False) -> None:
        if verify not in VERIFY_POLICIES:
            raise CoEError(f"expert store: verify must be one of {', '.join(VERIFY_POLICIES)}, got {verify!r}")
        self.root = Path(root)
        self.verify = verify
        self._lock = threading.RLock()
        self._verified: set[tuple[str, str]] = set()  # (id, sha256) whose file hashed correctly
        self._verified_stat: dict[tuple[str, str], tuple] = {}  # ... and that file's (inode, mtime, size)
        self._layouts: dict[tuple[str, str], Layout] = {}  # (id, sha256) -> stored layout
        self._compression = "none"
        # old versions' files a live reader may still need -> the manifest generation that retired them
        self._retired: dict[str, int] = {}
        self._reader: ReaderLock | None = None
        self._disk_generation = 0                 # of the manifest last read or written
        self._disk_stamp: tuple | None = None     # ... and its file's (inode, mtime, size)
        self._generation = 0                      # of the manifest `_entries` came from
        self._stamp: tuple | None = None
        self._entries: dict[str, ManifestEntry] = {}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CoEError(f"expert store: cannot create {self.root}: {exc.strerror or exc}") from None
        if reader:
            self.register_reader()
        else:
            self._adopt(self._load_manifest())
        if self.manifest_path.exists() and (self._retired or any(_SET_FILE.match(p.name) or _TMP_FILE.match(p.name)
                                                                 for p in self.root.iterdir())):
            self._sweep_unrecorded()

    def _sweep_unrecorded(self) -> None:
        """Remove `write_many` files no manifest names: a crash between their renames and the manifest write.

        Installs rename and record under the process lock, so under it a file
        of that pattern that the manifest does not name is no one's.  Retired
        files are named too; they go here once every live reader has switched
        past them (an agent that was killed mid-switch left them).
        """
        with self._lock, self._process_lock():
            if not self.manifest_path.exists():
                # a store being copied or restored, its manifest not there yet: nothing says which files are whose
                return
            entries = self._load_manifest()
            if self._retired:
                self._drop_retired(entries, keep=set(), readers=reader_generations(self.root, self._reader_name()))
            named = {e.file for e in entries.values()} | set(self._retired)
            for p in self.root.iterdir():
                m = _TMP_FILE.match(p.name)
                if (_SET_FILE.match(p.name) and p.name not in named) or (m and _abandoned(p, int(m.group(1)))):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()

    # -- queries ----------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / MANIFEST

    def has(self, expert_id: str) -> bool:
        with self._lock:
            return expert_id in self._entries

    def entry(self, expert_id: str) -> ManifestEntry:
        with self._lock:
            found = self._entries.get(expert_id)
        if found is None:
            raise ExpertLoadError(expert_id, str(self.manifest_path), "not in the expert store manifest")
        return found

    def entries(self) -> list[ManifestEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.id)

    def path(self, expert_id: str) -> Path:
        """Where the expert's file is (or will be written)."""
        with self._lock:
            found = self._entries.get(expert_id)
        if found is not None:
            return self.root / found.file
        return self.root / (_check_id(expert_id) + SUFFIX)

    def nbytes(self, expert_id: str) -> int:
        return self.entry(expert_id).nbytes

    @property
    def compression(self) -> str:
        """How new and rewritten experts are stored: 'none' or 'exponent-zstd' (the manifest keeps it)."""
        return self._compression

    def layout(self, expert_id: str) -> Layout:
        """Where each tensor sits in the expert's plain data section (cached per content)."""
        return self._retried(expert_id, lambda entry: self._layout(expert_id, entry))

    def _layout(self, expert_id: str, entry: ManifestEntry | None = None) -> Layout:
        from .compressed import read_header

        entry = entry or self.entry(expert_id)
        key = (expert_id, entry.sha256)
        found = self._layouts.get(key)
        if found is None:
            path = self._existing(entry)
            found = (read_header(path, expert_id).layout if entry.compression != "none"
                     else read_layout(path, expert_id)[0])
            if found.nbytes != entry.nbytes:   # before anyone sizes a pool's room or a buffer by it
                raise ExpertLoadError(expert_id, str(path), f"file holds {found.nbytes} tensor bytes, manifest "
                                                            f"says {entry.nbytes}")
            with self._lock:
                self._layouts[key] = found
        return found

    def loaded_nbytes(self, expert_id: str, dtype: str | None = None) -> int:
        """Bytes the expert takes in memory when loaded to compute in `dtype` (None: as stored)."""
        if dtype is None:
            return self.nbytes(expert_id)
        from .convert import converted_layout

        return converted_layout(self.layout(expert_id), dtype).nbytes

    def reload(self) -> None:
        """Switch to the manifest on disk now (another process may have written experts).

        A reader records the generation it switched to, under the manifest
        lock where writers read it (`release_retired`).
        """
        with self._lock, (self._process_lock() if self._reader is not None else contextlib.nullcontext()):
            self._adopt(self._load_manifest())

    def reload_if(self, accept: Callable[[dict[str, ManifestEntry]], bool]) -> bool:
        """`reload`, only if `accept(entries on disk)`; the check and the switch under one hold of the manifest
        lock, so no promotion lands between them (a watcher adopting 'the same versions' adopted it)."""
        with self._lock, (self._process_lock() if self._reader is not None else contextlib.nullcontext()):
            entries = self._load_manifest()
            if not accept(entries):
                return False
            self._adopt(entries)
            return True

    def read_manifest(self) -> dict[str, ManifestEntry]:
        """The manifest on disk now, without switching this store to it (a watcher decides when)."""
        with self._lock:
            return self._load_manifest()

    @property
    def manifest_stamp(self) -> tuple | None:
        """(inode, mtime_ns, size) of the manifest file the served entries came from; None: there was none.

        A watcher starts from it, so a promotion between this store's read and
        the watcher's start is still seen as a change.
        """
        return self._stamp

    @property
    def generation(self) -> int:
        """The generation of the manifest the served entries came from (0: none, or written by an older build)."""
        return self._generation

    def _adopt(self, entries: dict[str, ManifestEntry]) -> None:
        """Serve `entries`, the manifest last read or written; a reader records its generation.

        A reader's caller holds the manifest lock, where removers read records.
        """
        with self._lock:
            self._entries = entries
            self._generation, self._stamp = self._disk_generation, self._disk_stamp
            if self._reader is not None:
                self._reader.record(self._generation)

    # -- readers and retired files --------------------------------------------------
    def register_reader(self) -> None:
        """Mark this process as a live reader: promotions keep the files it reads until it has switched past them.

        An agent opens its store as one (`reader=True`): frames in flight finish
        on the versions they started with, whose files a promotion in another
        process would otherwise remove under them.  The manifest is read again
        under the same lock as the registration, so the generation recorded is
        one no promotion has yet removed a file of.  `close_reader` (or the
        process's end) undoes it.
        """
        with self._lock, self._process_lock():
            if self._reader is None:
                self._reader = ReaderLock(self.root)
            self._adopt(self._load_manifest())

    def close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _reader_name(self) -> str | None:
        return self._reader.name if self._reader is not None else None

    @property
    def retired(self) -> list[str]:
        """Files of replaced versions kept for a live reader (as of the last manifest read)."""
        return sorted(self._retired)

    def release_retired(self) -> int:
        """Remove the retired files every live reader has switched past; returns how many went.

        A reader calls it once it has switched (its watcher, after `reload`).
        A file retired in generation G goes when every other live reader
        records G or later; a dead reader needs nothing.  Files this store's
        own entries name stay (a later promotion may have retired the versions
        it still serves).  Of several agents on one store, the last to switch
        removes the file.
        """
        with self._lock, self._process_lock():
            entries = self._load_manifest()
            if not self._retired:
                return 0
            return self._drop_retired(entries, keep={e.file for e in self._entries.values()},
                                      readers=reader_generations(self.root, self._reader_name()))

    def _drop_retired(self, entries: Mapping[str, ManifestEntry], keep: set[str], readers: Sequence[int]) -> int:
        """Under both locks: unlink the retired files no live reader needs (see `_passed`); record the rest."""
        before = len(self._retired)
        gone = self._passed(entries, keep, readers)
        _unlink(self.root, gone)
        if len(self._retired) != before:
            self._write_manifest(entries)
        return len(gone)

    def _passed(self, entries: Mapping[str, ManifestEntry], keep: set[str], readers: Sequence[int]) -> list[str]:
        """Under both locks: take the retired files that may go off the list and return them.

        A file may go when no entry and not `keep` names it and every live
        reader (`readers`: the generations they serve) is at or past the
        generation that retired it.  Names the manifest serves again leave the
        list without going.
        """
        named = {e.file for e in entries.values()}
        floor = min(readers, default=None)
        gone = sorted(f for f, at in self._retired.items()
                      if f not in named and f not in keep and (floor is None or floor >= at))
        self._retired = {f: at for f, at in self._retired.items() if f not in named and f not in gone}
        return gone

    # -- write --------------------------------------------------------------------
    def write(self, expert: Expert, tensors: Mapping[str, "torch.Tensor"], version: int = 1) -> ManifestEntry:
        """Store `tensors` as `expert`, replacing any previous version atomically.

        A new expert gets the plain `<id>.safetensors`.  One the store holds
        already (on disk, whatever this process last read) goes through
        `write_many`: a file of its own beside the live one, one manifest
        switch, and the old file retired while a reader lives.  Overwriting the
        live name would hand a reader still on the old manifest the new bytes
        under the old version, and leave nothing to finish its frames on.
        """
        _check_id(expert.id)
        if self._holds(expert.id):
            return self.write_many([(expert, tensors, version)])[0]
        return self._install_many([self._prepare(expert, tensors, version, expert.id + SUFFIX)])[0]

    def _holds(self, expert_id: str) -> bool:
        """Whether `expert_id` is in this store's view or the manifest on disk, or a file has its plain name."""
        from .compressed import SUFFIX as ZSUFFIX

        if self.has(expert_id) or expert_id in self.read_manifest():
            return True
        return any((self.root / (expert_id + suffix)).exists() for suffix in (SUFFIX, ZSUFFIX))

    def write_each(self, items: "Iterable[tuple[Expert, Mapping[str, torch.Tensor], int]]", *, every: int = 256,
                   done: "Callable[[ManifestEntry], None] | None" = None) -> list[ManifestEntry]:
        """`write` for many experts in turn, with one manifest write per `every` experts instead of one each.

        Why: each `write` reads, rewrites and fsyncs the whole manifest, so
        writing N experts one by one costs O(N^2) (an MoE import of 1,024 tiny
        experts took a minute, most of it manifest work).  Items are taken
        one at a time (each expert's tensors are serialised to its file and let
        go before the next is made), so memory stays one expert's.  Each group
        of `every` lands as one change; a failure leaves the groups before it
        stored and none of its own.  `done(entry)` is told of each as it lands.
        """
        held = set(self.read_manifest())           # read once, not once per expert
        out: list[ManifestEntry] = []
        prepared: list[tuple[ManifestEntry, Path]] = []
        try:
            for expert, tensors, version in items:
                _check_id(expert.id)
                taken = expert.id in held or self.has(expert.id) or any(
                    (self.root / (expert.id + sfx)).exists() for sfx in (SUFFIX, _ZSUFFIX))
                file = (f"{expert.id}.v{int(version)}-{uuid.uuid4().hex[:6]}{SUFFIX}" if taken
                        else expert.id + SUFFIX)
                prepared.append(self._prepare(expert, tensors, version, file))
                if len(prepared) >= every:
                    out += self._landed(prepared, done)
                    prepared = []
            if prepared:
                out += self._landed(prepared, done)
                prepared = []
        finally:
            for _, tmp in prepared:             # prepared but never installed (an item raised)
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        return out

    def _landed(self, prepared, done) -> list[ManifestEntry]:
        got = self._install_many(prepared)
        for entry in got:
            if done is not None:
                done(entry)
        return got

    def write_many(self, items: "Sequence[tuple[Expert, Mapping[str, torch.Tensor], int]]") -> list[ManifestEntry]:
        """Store several (expert, tensors, version) as one change: all the new versions, or none.

        Each new version goes to a file of its own name first, beside the live
        one; one manifest write then switches every expert, and only after it
        do the old files go.  A reader sees the old set or the new set, never
        a mix (a promotion of a classifier and its detector lands together),
        and a failure before the switch leaves the store as it was.
        """
        ids = [e.id for e, _, _ in items]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise CoEError(f"write_many: an expert named twice in one change: {', '.join(twice)}")
        prepared: list[tuple[ManifestEntry, Path]] = []
        try:
            for expert, tensors, version in items:
                prepared.append(self._prepare(expert, tensors, version,
                                              f"{expert.id}.v{int(version)}-{uuid.uuid4().hex[:6]}{SUFFIX}"))
        except BaseException:
            for _, tmp in prepared:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            raise
        return self._install_many(prepared)

    def _prepare(self, expert: Expert, tensors: Mapping[str, "torch.Tensor"], version: int,
                 file: str) -> tuple[ManifestEntry, Path]:
        """Serialise (and compress, per the store) `tensors` to a temp file; the entry it will have as `file`."""
        import torch

        _check_id(expert.id)
        if not tensors:
            raise CoEError(f"expert '{expert.id}': refusing to store an expert with no tensors")
        bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise CoEError(f"expert '{expert.id}': tensors must map str to torch.Tensor, bad keys: {bad[:3]}")
        from .flat import STORED_DTYPES

        odd = [f"{k} ({str(v.dtype).removeprefix('torch.')})" for k, v in tensors.items()
               if str(v.dtype).removeprefix("torch.") not in STORED_DTYPES]
        if odd:     # written, it would be refused at every read as a corrupt header
            raise CoEError(f"expert '{expert.id}': unsupported tensor dtype: {', '.join(odd[:3])}; the store "
                           f"keeps {', '.join(sorted(STORED_DTYPES))}")
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        by_dtype: dict[str, int] = {}
        for v in cpu.values():
            name = str(v.dtype).removeprefix("torch.")
            by_dtype[name] = by_dtype.get(name, 0) + v.numel() * v.element_size()
        nbytes = sum(by_dtype.values())
        dtype = max(by_dtype.items(), key=lambda kv: kv[1])[0]

        tmp = self._tmp(file)
        # one metadata key: safetensors stores metadata in a hash map, so several keys would be
        # written in a random order and the same tensors would hash differently on every write
        meta = {"coe": json.dumps({"expert_id": expert.id, "arch": expert.arch, "kind": expert.kind,
                                   "version": int(version)}, sort_keys=True)}
        try:
            digest = _write_safetensors(tmp, cpu, meta, expert.id)
            entry = ManifestEntry(id=expert.id, arch=expert.arch, kind=expert.kind, file=file, sha256=digest,
                                  nbytes=nbytes, dtype=dtype, version=int(version),
                                  stored_nbytes=tmp.stat().st_size, plain_nbytes=tmp.stat().st_size)
            if self._compression != "none":
                zfile = file[:-len(SUFFIX)] if file.endswith(SUFFIX) else file
                compressed = self._compressed(entry, tmp, zfile)
                tmp.unlink()
                return compressed
            return entry, tmp
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise

    def set_compression(self, mode: str) -> None:
        """Make `mode` the store's compression for experts written from now on (see `recompress`)."""
        if mode not in COMPRESSIONS:
            raise CoEError(f"expert store: compression must be one of {', '.join(COMPRESSIONS)}, got {mode!r}")
        with self._lock, self._process_lock():
            entries = self._load_manifest()
            self._compression = mode
            self._write_manifest(entries)
            self._adopt(entries)

    def recompress(self, expert_id: str, attempts: int = 3) -> ManifestEntry:
        """Rewrite one expert in the store's compression; its sha256 (of the plain bytes) stays.

        The entry rewritten is the disk's, and it is replaced only if it is
        still the disk's when the rewrite lands: a promotion meanwhile (an
        agent's line, another shell) is never undone; the rewrite starts again
        from the promoted version.
        """
        for attempt in range(attempts):
            self.reload()
            entry = self.entry(expert_id)
            try:
                try:
                    return self._recompress(entry)
                except OSError as exc:     # the store is as it was (temp files go): name what and where
                    raise CoEError(f"expert '{expert_id}': cannot rewrite it in {self.root} "
                                   f"({exc.strerror or exc}; is the disk full?)") from None
            except (ChangedOnDisk, ExpertLoadError) as exc:   # its file may have gone with the old version
                self.reload()
                now = self._entries.get(expert_id)
                moved = now is None or (now.version, now.sha256) != (entry.version, entry.sha256)
                if not moved or attempt == attempts - 1:
                    raise
                log.info("expert %s changed on disk while being rewritten (%s); rewriting it again", expert_id, exc)
        raise AssertionError("unreachable")

    def _recompress(self, entry: ManifestEntry) -> ManifestEntry:
        from .compressed import decompress_file

        expert_id = entry.id
        if entry.compression == self._compression:
            return entry
        src = self._existing(entry)
        base = self._free_base(entry)
        tmp = self._tmp(base + SUFFIX)
        try:
            if entry.compression != "none":
                decompress_file(src, tmp, expert_id)
            else:
                shutil.copyfile(src, tmp)
            if _sha256(tmp) != entry.sha256:
                raise ExpertLoadError(expert_id, str(src), "sha256 mismatch: refusing to rewrite a corrupt expert")
            size = tmp.stat().st_size
            plain = dataclasses.replace(entry, file=base + SUFFIX, compression="none", stored_nbytes=size,
                                        plain_nbytes=size, bound_nbytes=0)
            done = self._compressed(plain, tmp, base) if self._compression != "none" else (plain, tmp)
            try:
                return self._install_many([done], expect={expert_id: entry})[0]
            finally:
                with contextlib.suppress(FileNotFoundError):
                    done[1].unlink()
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _free_base(self, entry: ManifestEntry) -> str:
        """The file name stem for rewriting `entry` in the store's compression: its id while that name is free.

        A retired file may hold the name, and a reader may still read it: then
        the rewrite gets a name of its own.
        """
        from .compressed import SUFFIX as ZSUFFIX

        if (self.root / (entry.id + (SUFFIX if self._compression == "none" else ZSUFFIX))).exists():
            return f"{entry.id}.v{entry.version}-{uuid.uuid4().hex[:6]}"
        return entry.id

    def _compressed(self, plain: ManifestEntry, plain_file: Path, base: str | None = None
                    ) -> tuple[ManifestEntry, Path]:
        """Compress `plain_file` to a temp file; the entry it would have (file `base` + the compressed suffix)."""
        import numpy as np

        from .compressed import SUFFIX as ZSUFFIX
        from .compressed import compress_file, decode_to, read_header

        file = (base or plain.id) + ZSUFFIX
        tmp = self._tmp(file)
        try:
            stats = compress_file(plain_file, tmp, plain.id)
            # decode it once before it replaces anything: the plain file may be the only other copy
            header = read_header(tmp, plain.id)
            decode_to(tmp, header, plain.id, np.empty(header.layout.nbytes, np.uint8), expect_sha256=plain.sha256)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return dataclasses.replace(plain, file=file, compression=self._compression,
                                   stored_nbytes=stats.stored_bytes, plain_nbytes=stats.raw_bytes,
                                   bound_nbytes=stats.bound_bytes), tmp

    def _install_many(self, prepared: "Sequence[tuple[ManifestEntry, Path]]",
                      expect: "Mapping[str, ManifestEntry] | None" = None) -> list[ManifestEntry]:
        """Move every temp file into place, record them all in one manifest write, then drop the old files.

        A version names one set of bytes: an entry whose version is not above
        the one on disk, with other bytes (another process promoted it
        meanwhile, or a writer passed the default version 1), is stored as the
        disk's version + 1, so every reader sees the change as a new version.
        With `expect` (a rewrite of the same bytes in another encoding), an
        expert whose disk entry is no longer the expected one is not replaced:
        `ChangedOnDisk`, and nothing is.
        """
        try:
            for _, tmp in prepared:
                fsync_file(tmp)
            with self._lock, self._process_lock():
                entries = self._load_manifest()  # pick up what other processes wrote meanwhile
                for eid, want in (expect or {}).items():
                    now = entries.get(eid)
                    if now is None or (now.version, now.sha256) != (want.version, want.sha256):
                        raise ChangedOnDisk(eid, want.version, None if now is None else now.version)
                prepared = [(self._versioned(entry, entries.get(entry.id), tmp), tmp) for entry, tmp in prepared]
                for entry, tmp in prepared:
                    os.replace(tmp, self.root / entry.file)
                fsync_dir(self.root)
                old = {entry.id: entries.get(entry.id) for entry, _ in prepared}
                for entry, _ in prepared:
                    entries[entry.id] = entry
                # a running agent may still need the old versions (frames it accepted before the switch): their
                # files are retired by this manifest's generation and go once every live reader has switched
                # past it (with no reader, now); older retired files every reader has passed go too
                live = {e.file for e in entries.values()}
                for was in old.values():
                    if was is not None and was.file not in live:
                        self._retired[was.file] = self._disk_generation + 1
                gone = self._passed(entries, set(), reader_generations(self.root, self._reader_name()))
                self._write_manifest(entries)
                self._adopt(entries)
                changed = set(old)
                self._verified = {v for v in self._verified if v[0] not in changed}
                _unlink(self.root, gone)   # after the switch; readers that mapped them keep the inodes
        finally:
            for _, tmp in prepared:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        return [entry for entry, _ in prepared]

    def _versioned(self, entry: ManifestEntry, disk: ManifestEntry | None, tmp: Path | None = None
                   ) -> ManifestEntry:
        """`entry`, at a version above the disk's when the disk already holds other bytes under its version, and
        under a file name of its own when its plain name is taken.

        Under the process lock.  A writer that saw no such expert chose the
        plain `<id>` name; if a file has it now (another writer's new expert,
        or one retired while a reader still maps it), replacing it would hand
        that file's readers other bytes."""
        if disk is not None and disk.sha256 != entry.sha256 and entry.version <= disk.version \
                and not self._same_tensors(disk, tmp):
            log.warning("expert %s: version %d on disk already holds other weights; these are stored as version %d",
                        entry.id, disk.version, disk.version + 1)
            entry = dataclasses.replace(entry, version=disk.version + 1)
        suffix = entry.file[len(entry.id):]
        if entry.file == entry.id + suffix and suffix in (SUFFIX, _ZSUFFIX) and (self.root / entry.file).exists() \
                and (disk is None or disk.sha256 != entry.sha256):
            entry = dataclasses.replace(entry, file=f"{entry.id}.v{entry.version}-{uuid.uuid4().hex[:6]}{suffix}")
        return entry

    def _same_tensors(self, disk: ManifestEntry, tmp: Path | None) -> bool:
        """Whether the plain file `tmp` holds the same tensors as `disk`'s plain file, byte for byte, whatever
        their order and header: a file written before expert files were aligned to 64 bytes hashes otherwise,
        and rewriting the same weights (a re-import) is not new weights."""
        if tmp is None or disk.compression != "none" or not str(tmp).endswith(".tmp") or \
                not (self.root / disk.file).is_file():
            return False
        try:
            a, _ = read_layout(self.root / disk.file, disk.id)
            b, _ = read_layout(tmp, disk.id)
        except CoEError:
            return False
        if {(x.name, x.dtype, x.shape) for x in a.specs} != {(x.name, x.dtype, x.shape) for x in b.specs}:
            return False
        where = {x.name: x for x in b.specs}
        with open(self.root / disk.file, "rb") as fa, open(tmp, "rb") as fb:
            for x in a.specs:
                y = where[x.name]
                fa.seek(a.data_offset + x.start)
                fb.seek(b.data_offset + y.start)
                if fa.read(x.end - x.start) != fb.read(y.end - y.start):
                    return False
        return True

    def _tmp(self, file: str) -> Path:
        return self.root / f".{file}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"

    def _existing(self, entry: ManifestEntry) -> Path:
        path = self.root / entry.file
        if not path.is_file():
            raise ExpertLoadError(entry.id, str(path), "file missing from the expert store")
        return path

    def _current(self, expert_id: str, entry: ManifestEntry | None = None) -> tuple[ManifestEntry, Path]:
        """The entry (this store's, or `entry`) and its file; the manifest is read again if the file went or changed.

        `experts compress` in another process renames an expert's file
        (.safetensors <-> .coez) while a running agent holds the old manifest;
        an older build's `experts promote` replaced it with a new version.  A
        file that is not the one verified under this entry (another inode,
        mtime or size) means the cached manifest is stale: without the re-read,
        a `verify: first` store would serve the new bytes under the old entry's
        version.  A reader reads the new entry for this read only (`_fresh_entry`).
        """
        entry = entry or self.entry(expert_id)
        path = self.root / entry.file
        if not path.is_file() or self._replaced(expert_id, entry.sha256, path):
            entry = self._fresh_entry(expert_id)
        return entry, self._existing(entry)

    def _fresh_entry(self, expert_id: str) -> ManifestEntry:
        """The expert's entry in the manifest on disk now, for a read whose file has gone or changed.

        A store that is not a reader switches to that manifest.  A reader does
        not: its watcher switches it between frames, after the frames in flight
        finish on the set they started with, so a silent switch here would run
        the rest of their chains on new versions.  Only this read uses the new
        entry (its row names that version); every other expert stays put.
        """
        if self._reader is None:
            self.reload()
            return self.entry(expert_id)
        found = self.read_manifest().get(expert_id)
        if found is None:
            raise ExpertLoadError(expert_id, str(self.manifest_path), "not in the expert store manifest")
        return found

    def _replaced(self, expert_id: str, sha256: str, path: Path) -> bool:
        """Whether `path` is no longer the file verified as (expert_id, sha256)."""
        seen = self._verified_stat.get((expert_id, sha256))
        return seen is not None and seen != _stat(path)

    def _mark_verified(self, key: tuple[str, str], path: Path) -> None:
        with self._lock:
            self._verified.add(key)
            self._verified_stat[key] = _stat(path)

    # -- read -----------------------------------------------------------------------
    def read(self, expert_id: str) -> dict[str, "torch.Tensor"]:
        """The expert's tensors on the CPU, verified per the store's policy.

        A plain file is memory-mapped (page-cache backed); a compressed one is
        decoded into one private buffer.  A read that raced a promotion is
        retried once on the new entry.
        """
        return self._retried(expert_id, lambda entry: self._read(expert_id, entry))

    def _read(self, expert_id: str, entry: ManifestEntry | None = None) -> dict[str, "torch.Tensor"]:
        from safetensors.torch import load_file

        entry, path = self._current(expert_id, entry)
        if entry.compression != "none":
            return self._read_flat(expert_id, entry=entry).tensors()
        where = str(path)
        checked = self._check_whole_file(expert_id, entry, path, mark=False)
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors raises its own SafetensorError, plus OSError
            raise ExpertLoadError(expert_id, where, f"truncated or corrupt safetensors: {exc}") from None
        got = sum(t.numel() * t.element_size() for t in tensors.values())
        if got != entry.nbytes:
            raise ExpertLoadError(expert_id, where, f"file holds {got} tensor bytes, manifest says {entry.nbytes}")
        if checked and self.verify == "first":
            self._mark_verified((expert_id, entry.sha256), path)
        return tensors

    def _needs_check(self, key: tuple[str, str], path: Path) -> bool:
        """Whether the store's policy hashes this read: always, or the first time for these bytes at this path."""
        return self.verify == "always" or (self.verify == "first" and (key not in self._verified
                                                                       or self._replaced(*key, path)))

    def _check_whole_file(self, expert_id: str, entry: ManifestEntry, path: Path, *, mark: bool = True) -> bool:
        """Hash the file when the store's policy asks (always, or the first time for these bytes); True if it did.

        A mismatch raises `ExpertLoadError` naming the file; a match is marked
        verified here unless `mark` is False (the caller marks it once the rest
        of its checks pass)."""
        key = (expert_id, entry.sha256)
        if not self._needs_check(key, path):
            return False
        try:
            digest = _sha256(path)
        except OSError as exc:
            raise ExpertLoadError(expert_id, str(path), f"cannot read: {exc.strerror or exc}") from None
        if digest != entry.sha256:
            raise ExpertLoadError(expert_id, str(path),
                                  f"sha256 mismatch: manifest {entry.sha256[:12]}…, file {digest[:12]}…")
        if mark and self.verify == "first":
            self._mark_verified(key, path)
        return True

    def map_flat(self, expert_id: str, *, dtype: str | None = None) -> "MappedFlat | None":
        """The expert's tensors over its file's memory map, verified per the store's policy; None if it cannot be.

        No copy and no buffer of its own (`storage.flat.MappedFlat`): for a
        computation that must not take memory beside the pools.  None when the
        file holds no such bytes: a compressed one, or one that `dtype` would
        cast on the way in (`storage.convert`; the pools load it so), or one
        whose data section is off a 64-byte boundary (written before expert
        files were aligned: mapped, its arithmetic would not be a pool's; import
        it again to map it); the caller reads it instead.  A verified read hashes the bytes as they stream into
        the page cache (`MappedFlat`'s read-through), so the disk is read once.
        A read that raced a promotion is retried once on the new entry, as
        `read` is.
        """
        return self._retried(expert_id, lambda entry: self._map_flat(expert_id, dtype, entry))

    def _map_flat(self, expert_id: str, dtype: str | None, entry: ManifestEntry | None) -> "MappedFlat | None":
        from .convert import converted_layout
        from .flat import MappedFlat

        entry, path = self._current(expert_id, entry)
        stored = self._layout(expert_id, entry)
        if entry.compression != "none" or converted_layout(stored, dtype) != stored:
            return None
        if stored.data_offset % DATA_ALIGN:
            # mapped, each tensor would sit at another alignment than in a pool's (aligned) buffer, and CPU kernels
            # round differently there: the in-place result would not be the pooled one, bit for bit
            return None
        key = (expert_id, entry.sha256)
        checked = self._needs_check(key, path)
        mapped = MappedFlat(path, expert_id, expect_sha256=entry.sha256 if checked else None)
        if mapped.flat.nbytes != entry.nbytes:
            got = mapped.flat.nbytes
            mapped.close()
            raise ExpertLoadError(expert_id, str(path), f"file holds {got} tensor bytes, manifest says {entry.nbytes}")
        if checked and self.verify == "first":
            self._mark_verified(key, path)
        return mapped

    def read_flat(self, expert_id: str, *, pin: bool = False, method: str = "read",
                  out: "FlatWeights | None" = None, dtype: str | None = None) -> "FlatWeights":
        """See `_read_flat`; a read that raced a promotion is retried once on the new entry."""
        return self._retried(expert_id, lambda entry: self._read_flat(expert_id, pin=pin, method=method, out=out,
                                                                     dtype=dtype, entry=entry))

    def _retried(self, expert_id: str, attempt: Callable[[ManifestEntry | None], _T]) -> _T:
        """`attempt(None)` (this store's entry), and once more if it failed because the expert changed under it.

        An older build's `experts promote` replaced a file under its name (a
        sha256 mismatch); a promotion with no live reader installs a new file
        and removes the old (the file vanishes between the manifest read and
        the open).  If the manifest, read again, names other bytes, the error
        was the race and `attempt(new entry)` reads them (a reader does not
        switch for it, see `_fresh_entry`); otherwise the error stands.
        """
        before = self.entry(expert_id) if self.has(expert_id) else None
        try:
            return attempt(None)
        except (ExpertLoadError, FileNotFoundError):
            try:
                after = self._fresh_entry(expert_id)
            except ExpertLoadError:
                after = None
            if before is None or after is None or (after.sha256, after.file) == (before.sha256, before.file):
                raise
            return attempt(after)

    def _read_flat(self, expert_id: str, *, pin: bool = False, method: str = "read",
                   out: "FlatWeights | None" = None, dtype: str | None = None,
                   entry: ManifestEntry | None = None) -> "FlatWeights":
        """The expert as one private buffer read sequentially (the tiers' format).

        Verification per the store's policy happens while the bytes stream in,
        so a checked cold load still reads the disk once.  A compressed expert
        decodes chunk by chunk into the buffer; with `dtype` its floating
        tensors are cast on the way in (see `storage.convert`).  `out` lends
        its buffer when it has exactly the loaded size.  `entry` overrides this
        store's entry (a reader's read retried on the manifest on disk).
        """
        from .flat import read_flat

        entry, path = self._current(expert_id, entry)
        key = (expert_id, entry.sha256)
        check = self._needs_check(key, path)
        expect = entry.sha256 if check else None
        from .convert import converted_layout

        stored = self._layout(expert_id, entry)
        if entry.compression == "none" and converted_layout(stored, dtype) is stored:
            flat = read_flat(path, expert_id, pin=pin, expect_sha256=expect, method=method, out=out)
        else:
            flat = self._stream_flat(entry, path, pin=pin, out=out, dtype=dtype, expect_sha256=expect)
        if flat.nbytes != (entry.nbytes if dtype is None else converted_layout(stored, dtype).nbytes):
            raise ExpertLoadError(expert_id, str(path),
                                  f"file holds {flat.nbytes} tensor bytes, manifest says {entry.nbytes}")
        if check:
            self._mark_verified(key, path)
        flat.version = entry.version     # the manifest entry this read used: what inference rows name
        return flat

    def _stream_flat(self, entry: ManifestEntry, path: Path, *, pin: bool, out: "FlatWeights | None",
                     dtype: str | None, expect_sha256: str | None) -> "FlatWeights":
        """Decode and/or convert into one buffer through a bounded scratch buffer."""
        from .compressed import decode_to, iter_decoded, read_header
        from .convert import Placer, cast_in_place, converted_layout, only_widens
        from .flat import FlatWeights, iter_plain, may_yield
        from .pinned import host_empty

        eid = entry.id
        may_yield(eid)          # a read that must give way (a prefetch) does so before it starts
        if entry.compression != "none":
            header = read_header(path, eid)
            stored, prefix = header.layout, header.prefix
        else:
            stored, prefix = read_layout(path, eid)
        if stored.nbytes != entry.nbytes:     # before the buffer is allocated by what the file claims
            raise ExpertLoadError(eid, str(path), f"file holds {stored.nbytes} tensor bytes, manifest says "
                                                  f"{entry.nbytes}")
        target = converted_layout(stored, dtype)
        if out is not None and (out.nbytes != target.nbytes or out.device.type != "cpu"):
            out = None
        buf = out.buffer if out is not None else host_empty(target.nbytes, pin)
        dest = buf.numpy()
        if target is stored and entry.compression != "none":
            decode_to(path, header, eid, dest, expect_sha256)
            return FlatWeights(target, buf, like=out)
        tail = target.nbytes - stored.nbytes
        if entry.compression != "none" and tail >= 0 and only_widens(stored, target):
            # widening (fp16 stored, fp32 computed): decode at full speed into the buffer's tail, then
            # cast front to back in place; a tensor's cast never reaches bytes not yet cast (see convert)
            decode_to(path, header, eid, dest[tail:], expect_sha256)
            cast_in_place(stored, target, buf, tail)
            return FlatWeights(target, buf, like=out)
        hasher = hashlib.sha256(prefix) if expect_sha256 else None
        placer = Placer(stored, target, buf)
        pieces = (iter_decoded(path, header, eid) if entry.compression != "none"
                  else iter_plain(path, stored, eid))
        try:
            for start, end, view in pieces:
                may_yield(eid)    # and between pieces (a whole-file decode, `decode_to`, checks only at its start)
                if hasher is not None:
                    hasher.update(view)
                placer.place(start, end, view)
        finally:
            pieces.close()        # a failed load lets go of its file and read-ahead now
        if hasher is not None and hasher.hexdigest() != expect_sha256:
            raise ExpertLoadError(eid, str(path), f"sha256 mismatch: manifest {expect_sha256[:12]}…, "
                                                  f"file {hasher.hexdigest()[:12]}…")
        return FlatWeights(target, buf, like=out)

    # -- manifest ---------------------------------------------------------------------
    def _load_manifest(self) -> dict[str, ManifestEntry]:
        """The manifest on disk; notes its generation, stamp, compression and retired files as the disk's."""
        path = self.manifest_path
        src = str(path)
        try:
            with open(path, "rb") as fh:          # the stamp of the very file read, not of a later one
                st = os.fstat(fh.fileno())
                text = fh.read().decode("utf-8")
        except FileNotFoundError:
            if getattr(self, "_disk_stamp", None) is not None:
                # it was there: gone a moment (a restore by `mv`, rsync --delete) is not an empty store, and
                # adopting {} would serve no expert at all
                raise CoEError(f"{src}: the expert store manifest is gone (it was read before); keeping the "
                               "experts last read") from None
            self._disk_generation, self._disk_stamp, self._retired = 0, None, {}
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            raise CoEError(f"{src}: cannot read the expert store manifest: {exc}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CoEError(f"{src}: malformed expert store manifest: not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
            raise CoEError(f"{src}: malformed expert store manifest: expected an object with "
                           f"format '{MANIFEST_FORMAT}'")
        if raw.get("version") not in READ_VERSIONS:
            raise CoEError(f"{src}: unsupported expert store manifest version {raw.get('version')!r} "
                           f"(this build reads {', '.join(map(str, READ_VERSIONS))})")
        compression = raw.get("compression", "none")
        if compression not in COMPRESSIONS:
            raise CoEError(f"{src}: compression: must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
        self._compression = compression
        items = raw.get("experts")
        if not isinstance(items, list):
            raise CoEError(f"{src}: malformed expert store manifest: 'experts' must be a list")
        generation = raw.get("generation", 0)    # absent: written before generations, or by an older build
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise CoEError(f"{src}: generation: malformed expert store manifest: must be a non-negative integer")
        retired = raw.get("retired", [])
        if not isinstance(retired, list) or not all(isinstance(f, str) for f in retired):
            raise CoEError(f"{src}: retired: malformed expert store manifest: must be a list of file names")
        for i, f in enumerate(retired):
            self._check_inside(f, f"{src}: retired[{i}]")
        retired_in = raw.get("retired_in", {})
        if not isinstance(retired_in, dict) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in retired_in.values()):
            raise CoEError(f"{src}: retired_in: malformed expert store manifest: must map file names to generations")
        # a file listed without its generation (an older build retired it) counts as retired by this one
        self._retired = {f: retired_in.get(f, generation) for f in retired}
        self._disk_generation, self._disk_stamp = generation, (st.st_ino, st.st_mtime_ns, st.st_size)
        entries: dict[str, ManifestEntry] = {}
        for i, item in enumerate(items):
            entry = self._parse_entry(item, f"{src}: experts[{i}]")
            if entry.id in entries:
                raise CoEError(f"{src}: experts[{i}]: duplicate expert id '{entry.id}'")
            entries[entry.id] = entry
        return entries

    def _parse_entry(self, item: object, where: str) -> ManifestEntry:
        types = {"id": str, "arch": str, "kind": str, "file": str, "sha256": str, "nbytes": int,
                 "dtype": str, "version": int, "compression": str, "stored_nbytes": int, "plain_nbytes": int,
                 "bound_nbytes": int}
        optional = {"compression", "stored_nbytes", "plain_nbytes", "bound_nbytes"}
        if not isinstance(item, dict):
            raise CoEError(f"{where}: malformed expert store manifest: expected an object")
        for f in fields(ManifestEntry):
            val = item.get(f.name)
            if f.name not in item:
                if f.name in optional:
                    continue
                raise CoEError(f"{where}: malformed expert store manifest: missing '{f.name}'")
            if not isinstance(val, types[f.name]) or isinstance(val, bool):
                raise CoEError(f"{where}.{f.name}: malformed expert store manifest: "
                               f"must be {types[f.name].__name__}, got {type(val).__name__}")
        entry = ManifestEntry(**{f.name: item[f.name] for f in fields(ManifestEntry) if f.name in item})
        if entry.compression not in COMPRESSIONS:
            raise CoEError(f"{where}.compression: must be one of {', '.join(COMPRESSIONS)}, "
                           f"got {entry.compression!r}")
        try:
            _check_id(entry.id)
        except CoEError as exc:
            raise CoEError(f"{where}.id: {exc}") from None
        if len(entry.sha256) != 64 or any(c not in "0123456789abcdef" for c in entry.sha256):
            raise CoEError(f"{where}.sha256: malformed expert store manifest: not a hex sha256")
        if entry.nbytes < 0:
            raise CoEError(f"{where}.nbytes: malformed expert store manifest: negative")
        self._check_inside(entry.file, where)
        return entry

    def _check_inside(self, file: str, where: str) -> None:
        p = Path(file)
        root = self.root.resolve()
        if p.is_absolute() or ".." in p.parts or not file or (root / p).resolve().parent != root:
            raise CoEError(f"{where}.file: '{file}' is not a file directly inside the store root {self.root}")

    def _write_manifest(self, entries: Mapping[str, ManifestEntry]) -> None:
        """Under the process lock, after `_load_manifest`: write the next generation of the manifest."""
        compressed = self._compression != "none" or any(e.compression != "none" for e in entries.values())
        generation = self._disk_generation + 1
        # version 1 while nothing is compressed: older builds ignore the new fields and keep reading the store
        doc = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION if compressed else 1,
               "compression": self._compression, "generation": generation,
               "experts": [asdict(entries[k]) for k in sorted(entries)]}
        if self._retired:   # only when some are kept: older builds ignore the keys
            doc["retired"] = sorted(self._retired)
            doc["retired_in"] = {f: self._retired[f] for f in sorted(self._retired)}
        fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
                st = os.fstat(fh.fileno())
            os.replace(tmp, self.manifest_path)
            fsync_dir(self.root)
            self._disk_generation, self._disk_stamp = generation, (st.st_ino, st.st_mtime_ns, st.st_size)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @contextlib.contextmanager
    def _process_lock(self) -> Iterator[None]:
        with store_lock(self.root):
            yield


TMP_STALE_S = 600.0    # a temp file untouched this long whose writer's pid is gone: a kill's leftover


def _abandoned(path: Path, pid: int) -> bool:
    """A writer's temp file that no one writes any more: its pid is gone and it has not changed for a while
    (the age guards a writer in another pid namespace, a container sharing the store's volume)."""
    import time

    try:
        idle = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return False
    return idle > TMP_STALE_S and not _alive(pid)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (one we may not signal runs too): its temp files may still be written."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def store_lock(root: str | os.PathLike) -> Iterator[None]:
    """The store's lock across processes: every manifest change, and the files it names, happen under it."""
    if fcntl is None:
        yield
        return
    with open(Path(root) / ".manifest.lock", "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _check_id(expert_id: str) -> str:
    """Refuse ids that are not a plain file name: they would let a spec write outside the store."""
    problem = id_problem(expert_id)
    if problem is not None:
        raise CoEError(f"expert id {expert_id!r} {problem}")
    return expert_id


def _unlink(root: Path, files: Sequence[str]) -> None:
    """Remove `files` from the store root; one already gone is fine (another reader removed it)."""
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            (root / f).unlink()


def _stat(path: Path) -> tuple | None:
    """A file's identity for "is this still the file we verified": inode, mtime and size."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_safetensors(path: Path, tensors: Mapping[str, "torch.Tensor"], metadata: dict[str, str],
                       expert_id: str) -> str:
    """Write `tensors` as a safetensors file at `path` (not fsynced: the install does that); its sha256.

    Our own writer rather than safetensors' `save_file`: the data section
    starts on a 64-byte boundary (`DATA_ALIGN`), so a file computed in place
    from its memory map has each tensor at the alignment a pool's buffer gives
    it.  Tensors go widest dtype first, then by name, so no tensor starts off
    its element size's alignment.
    """
    from .safetensors_io import StreamWriter

    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    specs = [(k, str(tensors[k].dtype).removeprefix("torch."), tuple(tensors[k].shape)) for k in order]
    try:
        writer = StreamWriter(path, specs, metadata, sync=False)
        try:
            for k in order:
                writer.write(k, tensors[k])
        except BaseException:
            writer.abort()
            raise
        return writer.close()
    except CoEError as exc:     # the writer names the file; say whose it is
        raise CoEError(f"expert '{expert_id}': {exc}") from None

