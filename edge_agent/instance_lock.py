"""One agent per results database: a second one on the same data would re-run the first's frames in flight.

Two agents started on one data dir by mistake (a copied config with other
ports, an `ipc://` endpoint the second silently takes over) would each re-run
the other's journaled frames at start and answer each other's resends as
duplicates.  The lock is an exclusive `flock` on a file beside the database,
held for the agent's life: the kernel drops it when the process dies, so a
SIGKILLed agent never leaves a stale lock behind.
"""
from __future__ import annotations

import os
from pathlib import Path

from coe import CoEError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux: no lock, as before
    fcntl = None


class InstanceLock:
    """Held from `acquire` to `release`; `acquire` raises CoEError naming the holder when another agent has it."""

    def __init__(self, db_path: str | os.PathLike) -> None:
        self.db = Path(db_path)
        self.path = self.db.parent / f"{self.db.name}.agent.lock"
        self._fh = None

    def acquire(self) -> "InstanceLock":
        if fcntl is None:
            return self
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)   # owner-only, as the database's own
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)   # owner-only, as the database beside it
        os.fchmod(fd, 0o600)
        fh = os.fdopen(fd, "r+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise CoEError(f"another agent (pid {holder}) serves the results database {self.db}; stop it first, "
                           "or give this one its own data_dir") from None
        except OSError as exc:      # ENOLCK, EOPNOTSUPP: a file system without locks (NFS without its lock service)
            fh.close()
            raise CoEError(f"cannot lock {self.path}: {exc.strerror or exc}; the file system of the data_dir may "
                           "not support locks (NFS?): give the agent a data_dir on a local disk") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._fh = fh
        return self

    @property
    def held(self) -> bool:
        return self._fh is not None

    def release(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()           # closing the file drops the flock
