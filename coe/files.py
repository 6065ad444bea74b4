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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, sort_keys=sort_keys)
            fh.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
