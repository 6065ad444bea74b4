"""Which live processes read an expert store: so a promotion keeps the files they still need.

A running agent finishes every frame it accepted on the expert versions it
accepted it under (`edge_agent/frame_gate.py`), so after `experts promote`
switched the manifest it may still read the old versions' files for a while.
It registers as a reader: a file `.readers/<name>.lock` in the store that it
holds an exclusive `flock` on for as long as it runs.  A writer that replaces
experts asks `others_reading()`: if a live reader exists the old files are
*retired* (kept, listed in the manifest) instead of removed, and the reader
removes them once it has switched past them.

A lock, not a pid file: the kernel drops it when the process dies however it
dies, so a killed agent never keeps old files forever.  A reader's file is
created under a temporary name, locked, then renamed into place, so no one can
take a fresh reader's file for a dead one's.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: no cross-process readers, old files go at once
    fcntl = None  # type: ignore[assignment]

READERS = ".readers"


class ReaderLock:
    """This process's registration as a reader of one store; `close()` (or exit) ends it."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / READERS
        self.dir.mkdir(exist_ok=True)
        self.name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}.lock"
        tmp = self.dir / f".{self.name}.tmp"
        self._fh = open(tmp, "a+b")
        if fcntl is not None:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX)
        os.replace(tmp, self.dir / self.name)

    def close(self) -> None:
        if self._fh.closed:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.dir / self.name).unlink()
        self._fh.close()


def others_reading(root: Path, mine: str | None = None) -> bool:
    """Whether a live process other than the holder of `mine` reads the store at `root`.

    Files whose lock can be taken belong to dead processes and are removed on
    the way.  Without `flock` there is no way to tell, and the answer is no.
    """
    if fcntl is None:
        return False
    folder = Path(root) / READERS
    try:
        names = [p for p in folder.iterdir() if p.suffix == ".lock" and p.name != mine]
    except FileNotFoundError:
        return False
    live = False
    for path in names:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            continue                      # its reader closed meanwhile
        with fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live = True               # held: a running reader (this process's other stores included)
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()             # its process is gone
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return live
