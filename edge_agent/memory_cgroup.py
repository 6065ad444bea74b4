"""A memory cgroup that bounds one child process: RSS and page cache together (`llm bench` part (c)).

The bench runs each system of its end-to-end comparison in its own process
inside one of these, so accelerate's page-cache reads and coe-edge's pools
count against the same memory.  cgroup v1 (a `memory` hierarchy) or v2 (the
unified hierarchy with the memory controller enabled for the root's
children, and `memory.peak`, kernel 5.19 on); elsewhere (not root, a
container without the controller delegated) `MemoryCgroup.create` returns
None and the bench says the page cache was not bounded.
"""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
# (limit, peak, failures) file names per version
FILES = {1: ("memory.limit_in_bytes", "memory.max_usage_in_bytes", "memory.failcnt"),
         2: ("memory.max", "memory.peak", "memory.events")}
OVER_THE_BOUND = 137        # the exit status of a child the bound stopped (as a kill by SIGKILL reads)


class MemoryCgroup:
    """One memory cgroup: made with a limit, entered by a child before exec, read, removed."""

    def __init__(self, path: Path, version: int = 1) -> None:
        self.path, self.version = path, version

    @staticmethod
    def hierarchy() -> tuple[Path, int] | None:
        """(root, version) of a memory hierarchy this process can make cgroups in, or None."""
        if (V1 / "memory.limit_in_bytes").is_file():
            return V1, 1
        try:
            if "memory" in (V2 / "cgroup.subtree_control").read_text().split():
                return V2, 2
        except OSError:
            pass
        return None

    @classmethod
    def create(cls, name: str, limit: int) -> "MemoryCgroup | None":
        """A new cgroup `name` limited to `limit` bytes, or None where the box allows none.

        On v2 a kernel without `memory.peak` (before 5.19) gives None too: the
        bench's baseline is a peak, and `memory.current` read after the child
        has gone is no peak.
        """
        found = cls.hierarchy()
        if found is None:
            return None
        root, version = found
        path = root / name
        limit_file, peak_file, _ = FILES[version]
        try:
            path.mkdir(exist_ok=True)
            (path / limit_file).write_text(str(int(limit)))
            if version == 1:
                (path / peak_file).write_text("0")
            elif not (path / peak_file).is_file():
                raise OSError(errno.ENOENT, "no memory.peak")
        except OSError:
            if path.is_dir():
                os.rmdir(path)
            return None
        return cls(path, version)

    def enter(self) -> None:
        """Run in the child before exec (`preexec_fn`)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """The most memory the cgroup has held."""
        return int((self.path / FILES[self.version][1]).read_text())

    def failcnt(self) -> int:
        """How often usage hit the limit (v2: memory.events' `max` count)."""
        text = (self.path / FILES[self.version][2]).read_text()
        if self.version == 1:
            return int(text)
        return next((int(v) for k, v in (line.split() for line in text.splitlines()) if k == "max"), 0)

    def remove(self) -> None:
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def lower_limit(cgroup: str | os.PathLike, limit: int, resident: int) -> None:
    """In the bounded child: lower its own cgroup's limit to `limit` bytes now that its model is loaded.

    The kernel reclaims page cache to get there.  A process whose own memory
    is larger stops as it would on a box of that size: v2 kills it, and v1,
    which refuses a limit below what it cannot reclaim (EBUSY), is made to
    end the same way, so both read as one event: exit status 137 after a line
    on stderr saying what the process held.
    """
    print(f"bounded at {limit / 1e6:.0f} MB with {resident / 1e6:.0f} MB resident", file=sys.stderr, flush=True)
    v2 = Path(cgroup, FILES[2][0])
    try:
        (v2 if v2.is_file() else Path(cgroup, FILES[1][0])).write_text(str(int(limit)))
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        print("over the bound: the kernel could not reclaim enough to set the limit", file=sys.stderr, flush=True)
        os._exit(OVER_THE_BOUND)
