"""Small files written so that a reader never sees half of one."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


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
