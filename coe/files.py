"""Small files written so that a reader never sees half of one, and read so that a bad one says why."""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class DuplicateKeyError(ValueError):
    """A JSON object names `key` twice (`unique_keys`)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"key {key!r} appears twice in one object")


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """`json.loads(..., object_pairs_hook=unique_keys)`: a key written twice is an error, not 'the last one wins'."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(k)
        out[k] = v
    return out


def open_regular(path: str | os.PathLike) -> int | None:
    """A read-only fd of `path` if it is a regular file, else None (the fd closed).  O_NONBLOCK: opening a FIFO
    with no writer would wait for one for ever; a FIFO or a device read would block or never end (on a regular
    file the flag changes nothing)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        return None
    return fd


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_files(root: str | os.PathLike, paths: Iterable[str | os.PathLike]) -> None:
    """Flush `paths` (all on `root`'s file system) to disk: one syncfs(2) of that file system where the platform
    has it (thousands of frame files would otherwise cost one flush each), else each file's fsync."""
    libc_name = ctypes.util.find_library("c")
    syncfs = getattr(ctypes.CDLL(libc_name, use_errno=True), "syncfs", None) if libc_name else None
    if syncfs is not None:
        fd = os.open(root, os.O_RDONLY)
        try:
            if syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    for p in paths:
        fsync_file(p)


def write_json_atomic(path: str | os.PathLike, doc: Any, *, sort_keys: bool = True) -> Path:
    """Write `doc` as JSON to `path` through a temp file in the same directory and an atomic rename.

    A crash mid-write leaves the old file (or none), never a truncated one that
    would then read as garbage; two writers never share a temp file.
    """
    text = json.dumps(doc, indent=1, sort_keys=sort_keys) + "\n"
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` so that a crash or a power cut leaves the old file or the new one, never a mix.

    A temp file in the same directory, flushed to disk before the rename, and
    the directory flushed after it: without the first fsync a power cut can
    leave the renamed file empty, which the agent would refuse at its next start.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it) to disk; where a platform cannot, the rename is still
    atomic, only not yet durable."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:          # a platform that cannot open a directory: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
