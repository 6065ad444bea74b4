"""Which live processes read an expert store: so a promotion keeps the files they still need.

A running agent finishes every frame it accepted on the expert versions it
accepted it under (`edge_agent/frame_gate.py`), so after `experts promote`
switched the manifest it may still read the old versions' files for a while.
It registers as a reader: a file `.readers/<name>.lock` in the store that it
holds an exclusive `flock` on for as long as it runs, and in which it records
the manifest *generation* it serves (each manifest write counts one up).  A
writer that replaces experts *retires* the old files (kept, listed in the
manifest with the generation that retired them) instead of removing them while
a live reader exists.  A retired file goes once every live reader serves that
generation or a later one (`reader_generations()`), so with several agents on
one store the last one to switch removes it, and files never pile up.

Records are written and read under the store's manifest lock
(`ExpertStore._process_lock`), so no one reads half a record.  A reader that
has recorded nothing yet (it is reading its first manifest), or one of an
older build, reads as generation 0: it keeps every retired file.

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
from typing import BinaryIO

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

    def record(self, generation: int) -> None:
        """Write the manifest generation this reader serves now; the caller holds the store's manifest lock."""
        if self._fh.closed:
            return
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(b"%d\n" % generation)
        self._fh.flush()

    def close(self) -> None:
        if self._fh.closed:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.dir / self.name).unlink()
        self._fh.close()


def others_reading(root: Path, mine: str | None = None) -> bool:
    """Whether a live process other than the holder of `mine` reads the store at `root`."""
    return bool(reader_generations(root, mine))


def reader_generations(root: Path, mine: str | None = None) -> list[int]:
    """The manifest generation each live reader of the store at `root` serves, the holder of `mine` left out.

    Files whose lock can be taken belong to dead processes and are removed on
    the way: a dead reader needs no file.  Without `flock` there is no way to
    tell, and no reader is live.
    """
    if fcntl is None:
        return []
    folder = Path(root) / READERS
    try:
        names = [p for p in folder.iterdir() if p.suffix == ".lock" and p.name != mine]
    except FileNotFoundError:
        return []
    live: list[int] = []
    for path in names:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            continue                      # its reader closed meanwhile
        with fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(_recorded(fh))  # held: a running reader (this process's other stores included)
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()             # its process is gone
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return live


def _recorded(fh: BinaryIO) -> int:
    """The generation a live reader's file records; 0 (keeps every retired file) when it records none."""
    text = fh.read(32).strip()
    return int(text) if text.isdigit() else 0
