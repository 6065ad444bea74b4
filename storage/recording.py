"""Frame recordings on disk: image files plus one `manifest.jsonl`.

A recording is what the replay client sends to test a new expert set before it
goes on the line, so it must be safe to open one that came from somewhere else:
the manifest is validated in full when it is opened (every error names the
manifest, the 1-based line, the field and the reason), and no `file` entry may
point outside the recording directory, whether by an absolute path, `..`, or a
symlink.

Each manifest line is one frame: the wire header fields of DESIGN.md §6
(`component` may be absent, for recordings that exercise learned routing), plus
`file` (relative to the recording directory), an optional `truth` label and an
optional `truth_component` (the true type of a frame sent without `component`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from coe.errors import CoEError
from coe.files import DuplicateKeyError, fsync_dir, open_regular, sync_files, unique_keys

MANIFEST = "manifest.jsonl"
FRAMES_DIR = "frames"
ENCODINGS = ("jpeg", "png", "raw")
WIRE_VERSION = 1
HEADER_FIELDS = ("v", "frame_id", "line", "board_id", "component", "ts", "encoding", "shape", "dtype")
EXTRA_FIELDS = ("file", "truth", "truth_component")
_REQUIRED = ("v", "frame_id", "line", "board_id", "ts", "encoding")
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
_EXT = re.compile(r"[A-Za-z0-9]{1,8}")     # fullmatch: `$` would let 'png\n' through
_MAX_STEM = 120


class RecordingError(CoEError):
    """A recording is unusable: names the manifest, the line, the field and the reason."""

    def __init__(self, source: str, reason: str, line: int | None = None, field: str | None = None) -> None:
        self.source, self.reason, self.line, self.field = source, reason, line, field
        where = source
        if line is not None:
            where += f": line {line}"
        if field is not None:
            where += f": field '{field}'"
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class RecordedFrame:
    """One manifest line: the wire header to send, and where its payload lives.

    `header` holds only wire header fields, so the replay client can send it
    unchanged; `truth`/`truth_component` stay on the recording side.
    """

    header: dict
    file: str
    truth: str | None
    truth_component: str | None = None

    @property
    def frame_id(self) -> str:
        return self.header["frame_id"]

    def to_json(self) -> dict:
        """The manifest line for this frame."""
        rec: dict[str, Any] = {k: self.header[k] for k in HEADER_FIELDS if k in self.header}
        rec["file"] = self.file
        if self.truth is not None:
            rec["truth"] = self.truth
        if self.truth_component is not None:
            rec["truth_component"] = self.truth_component
        return rec


def validate_header(header: Any, source: str, line: int | None = None) -> dict:
    """Check the wire header fields of one frame; return them as a new dict.

    Shared by the reader and the writer so a writer can never produce a
    recording its own reader rejects.
    """
    if not isinstance(header, Mapping):
        raise RecordingError(source, f"expected a JSON object, got {type(header).__name__}", line, "<line>")
    for key in _REQUIRED:
        if key not in header:
            raise RecordingError(source, "is required", line, key)
    v = header["v"]
    if not _is_int(v):
        raise RecordingError(source, f"must be an integer, got {type(v).__name__}", line, "v")
    if v != WIRE_VERSION:
        raise RecordingError(source, f"unsupported version {v} (expected {WIRE_VERSION})", line, "v")
    for key in ("frame_id", "line", "board_id"):
        _need_str(header[key], source, line, key)
    if "component" in header:
        _need_str(header["component"], source, line, "component")
    ts = header["ts"]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise RecordingError(source, f"must be a number, got {type(ts).__name__}", line, "ts")
    if not math.isfinite(ts):
        raise RecordingError(source, f"must be finite, got {ts!r}", line, "ts")
    enc = header["encoding"]
    if not isinstance(enc, str) or enc not in ENCODINGS:
        raise RecordingError(source, f"must be one of {', '.join(ENCODINGS)}, got {enc!r}", line, "encoding")
    if "shape" in header:
        shape = header["shape"]
        if (not isinstance(shape, list) or len(shape) != 3
                or not all(_is_int(d) and d > 0 for d in shape)):
            raise RecordingError(source, f"must be [h, w, c] of positive integers, got {shape!r}", line, "shape")
    elif enc == "raw":
        raise RecordingError(source, "is required for raw encoding", line, "shape")
    if "dtype" in header and header["dtype"] != "uint8":
        raise RecordingError(source, f"must be 'uint8', got {header['dtype']!r}", line, "dtype")
    return {k: header[k] for k in HEADER_FIELDS if k in header}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _need_str(x: Any, source: str, line: int | None, key: str) -> None:
    if not isinstance(x, str):
        raise RecordingError(source, f"must be a string, got {type(x).__name__}", line, key)
    if not x:
        raise RecordingError(source, "must not be empty", line, key)


def _safe_path(root: Path, file: Any, source: str, line: int | None) -> Path:
    """Resolve `file` under `root`, refusing anything that would land outside it."""
    if not isinstance(file, str):
        raise RecordingError(source, f"must be a string, got {type(file).__name__}", line, "file")
    if not file or "\\" in file or "\x00" in file:
        raise RecordingError(source, f"not a usable relative path: {file!r}", line, "file")
    rel = PurePosixPath(file)
    if rel.is_absolute():
        raise RecordingError(source, f"absolute path not allowed: {file!r}", line, "file")
    if ".." in rel.parts:
        raise RecordingError(source, f"'..' not allowed: {file!r}", line, "file")
    try:
        base = root.resolve()
        target = (base / rel).resolve()
    except (RuntimeError, OSError) as exc:     # a symlink loop (RuntimeError before Python 3.13)
        raise RecordingError(source, f"cannot resolve {file!r}: {exc}", line, "file") from None
    if target == base:
        raise RecordingError(source, f"names the recording directory itself, not a file: {file!r}", line, "file")
    if not target.is_relative_to(base):
        raise RecordingError(source, f"resolves outside the recording directory: {file!r}", line, "file")
    return target


class Recording:
    """A recording opened for reading; the whole manifest is validated up front."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.manifest = self.root / MANIFEST
        src = str(self.manifest)
        if not self.root.is_dir():
            raise RecordingError(str(self.root), "recording directory does not exist")
        if not self.manifest.is_file():
            raise RecordingError(src, "manifest does not exist")
        try:
            raw_lines = self.manifest.read_bytes().split(b"\n")
        except OSError as exc:
            raise RecordingError(src, f"cannot read manifest: {exc.strerror or exc}") from None
        self.frames: list[RecordedFrame] = []
        seen: dict[str, int] = {}
        for n, raw in enumerate(raw_lines, start=1):
            if not raw.strip():
                continue
            frame = self._parse_line(raw, src, n)
            fid = frame.frame_id
            if fid in seen:
                raise RecordingError(src, f"duplicate frame_id {fid!r} (first on line {seen[fid]})", n, "frame_id")
            seen[fid] = n
            self.frames.append(frame)

    def _parse_line(self, raw: bytes, src: str, n: int) -> RecordedFrame:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise RecordingError(src, "not valid UTF-8", n, "<line>") from None
        try:
            rec = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=unique_keys)
        except DuplicateKeyError as exc:
            raise RecordingError(src, "written twice in one line; keep one", n, exc.key) from None
        except (json.JSONDecodeError, ValueError) as exc:
            raise RecordingError(src, f"not valid JSON: {exc}", n, "<line>") from None
        except RecursionError:
            raise RecordingError(src, "not valid JSON: nested too deeply", n, "<line>") from None
        header = validate_header(rec, src, n)
        for key in rec:
            if key not in HEADER_FIELDS and key not in EXTRA_FIELDS:
                raise RecordingError(src, "unknown field", n, key)
        if "file" not in rec:
            raise RecordingError(src, "is required", n, "file")
        _safe_path(self.root, rec["file"], src, n)
        truth = rec.get("truth")
        if truth is not None and not isinstance(truth, str):
            raise RecordingError(src, f"must be a string or null, got {type(truth).__name__}", n, "truth")
        tcomp = rec.get("truth_component")
        if tcomp is not None and not isinstance(tcomp, str):
            raise RecordingError(src, f"must be a string or null, got {type(tcomp).__name__}", n, "truth_component")
        return RecordedFrame(header=header, file=rec["file"], truth=truth, truth_component=tcomp)

    def __len__(self) -> int:
        return len(self.frames)

    def __iter__(self) -> Iterator[RecordedFrame]:
        return iter(self.frames)

    def payload(self, frame: RecordedFrame) -> bytes:
        """The frame's image bytes, re-checked against escape (the tree may have changed).

        Only a regular file is read: a FIFO or a device in its place would block the
        reader forever, or never end.
        """
        src = str(self.manifest)
        path = _safe_path(self.root, frame.file, src, None)
        try:
            fd = open_regular(path)
            if fd is None:
                raise RecordingError(src, f"frame {frame.frame_id!r}: {frame.file} is not a regular file",
                                     field="file")
            with open(fd, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            raise RecordingError(src, f"frame {frame.frame_id!r}: image file missing: {frame.file}",
                                 field="file") from None
        except OSError as exc:
            raise RecordingError(src, f"frame {frame.frame_id!r}: cannot read {frame.file}: "
                                 f"{exc.strerror or exc}", field="file") from None
        shape = frame.header.get("shape")
        if frame.header["encoding"] == "raw" and shape is not None:
            want = shape[0] * shape[1] * shape[2]
            if len(data) != want:
                raise RecordingError(src, f"frame {frame.frame_id!r}: raw payload has {len(data)} bytes, "
                                     f"shape {shape} needs {want}", field="shape")
        return data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


class RecordingWriter:
    """Writes a recording; the manifest appears atomically on a clean close.

    Images are written as they are added; `manifest.jsonl` is written to a
    temporary file and moved into place only by `close()`, so a reader never
    sees a half-written manifest, and a writer that fails (an exception inside
    the `with` block) leaves no manifest at all rather than a partial one that
    looks complete.
    """

    def __init__(self, root: str | Path, overwrite: bool = False) -> None:
        self.root = Path(root)
        self.manifest = self.root / MANIFEST
        src = str(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise RecordingError(src, "exists and is not a directory")
        if self.root.is_dir() and any(self.root.iterdir()):
            if not overwrite:
                raise RecordingError(src, "directory is not empty (give --overwrite to replace it)")
            self._clear()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / FRAMES_DIR).mkdir(exist_ok=True)
        self.frames: list[RecordedFrame] = []
        self._ids: set[str] = set()
        self._names: set[str] = set()
        self._closed = False

    def _clear(self) -> None:
        """Remove what a previous recording owns (its manifest and frames/); leave anything else."""
        for name in (MANIFEST, MANIFEST + ".tmp"):
            p = self.root / name
            if p.is_symlink() or p.is_file():
                p.unlink()
        frames = self.root / FRAMES_DIR
        if frames.is_symlink() or frames.is_file():
            frames.unlink()
        elif frames.is_dir():
            shutil.rmtree(frames)

    def add(self, header: dict, payload: bytes, ext: str, truth: str | None = None,
            truth_component: str | None = None) -> RecordedFrame:
        """Write one frame's image and remember its manifest line."""
        if self._closed:
            raise RecordingError(str(self.manifest), "writer is closed")
        line = len(self.frames) + 1
        src = str(self.manifest)
        clean = validate_header(header, src, line)
        for key in header:
            if key not in HEADER_FIELDS:
                raise RecordingError(src, "not a wire header field", line, key)
        if clean["frame_id"] in self._ids:
            raise RecordingError(src, f"duplicate frame_id {clean['frame_id']!r}", line, "frame_id")
        if not isinstance(ext, str) or not _EXT.fullmatch(ext):
            raise RecordingError(src, f"extension must be 1-8 letters/digits, got {ext!r}", line, "file")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise RecordingError(src, f"payload must be bytes, got {type(payload).__name__}", line, "file")
        for key, val in (("truth", truth), ("truth_component", truth_component)):
            if val is not None and not isinstance(val, str):
                raise RecordingError(src, f"must be a string or None, got {type(val).__name__}", line, key)
        rel = f"{FRAMES_DIR}/{self._file_name(clean['frame_id'])}.{ext}"
        try:
            (self.root / rel).write_bytes(bytes(payload))
        except OSError as exc:     # a full disk: name the file and the recording, not only the errno
            raise RecordingError(src, f"cannot write frame file {rel}: {exc.strerror or exc} (is the disk full?)",
                                 line, "file") from None
        frame = RecordedFrame(header=clean, file=rel, truth=truth, truth_component=truth_component)
        self._ids.add(clean["frame_id"])
        self.frames.append(frame)
        return frame

    def _file_name(self, frame_id: str) -> str:
        """A filesystem-safe stem for `frame_id`, unique within this recording."""
        stem = _UNSAFE_NAME.sub("_", frame_id)[:_MAX_STEM]
        if stem.startswith("."):
            stem = "_" + stem[1:]
        name, k = stem, 1
        while name in self._names:
            k += 1
            name = f"{stem}~{k}"
        self._names.add(name)
        return name

    def close(self) -> Path:
        """Write the manifest atomically (tmp file, fsync, os.replace).  Idempotent.

        The images and frames/ are flushed to disk before the manifest is moved into
        place, and the directory after it: a power cut leaves no manifest, or one whose
        images are all there.
        """
        if self._closed:
            return self.root
        tmp = self.root / (MANIFEST + ".tmp")
        try:
            sync_files(self.root, [self.root / frame.file for frame in self.frames])
            fsync_dir(self.root / FRAMES_DIR)
            with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
                for frame in self.frames:
                    fh.write(json.dumps(frame.to_json(), separators=(",", ":"), allow_nan=False))
                    fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.manifest)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            full = " (is the disk full?)" if exc.errno == errno.ENOSPC else ""
            raise RecordingError(str(self.manifest), f"cannot write the manifest: {exc.strerror or exc}{full}") \
                from None
        fsync_dir(self.root)
        self._closed = True
        return self.root

    def abort(self) -> None:
        """Stop without a manifest; the images already written stay for inspection."""
        self._closed = True

    def __enter__(self) -> "RecordingWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
