"""Which SSD reads are under way, so a read-ahead can use the disk only while nothing waits for it.

Every `StoreSource` of an agent shares one `DiskActivity`.  A read that an
executor (or its next-group prefetch) waits for is counted while it runs; a
read issued under `ahead()` (the host tier's read-ahead, `executors.readahead`)
is not, because it is the one that must give way.  Why a counter and not a
queue: the SSD has one channel the whole box shares (a switch costs the
whole system, not one queue), and the only question a read-ahead asks is "is
anyone reading now?".
"""
from __future__ import annotations

import contextlib
import threading


class DiskActivity:
    """Counts the demand reads in flight on one SSD (mechanism: holds state, decides nothing)."""

    def __init__(self) -> None:
        self._reads = 0
        self._cond = threading.Condition()
        self._local = threading.local()
        self.demand_reads = 0     # demand reads started, in all
        self.ahead_reads = 0      # reads started under `ahead()`, in all

    @contextlib.contextmanager
    def reading(self):
        """Around one SSD read.  Counted as demand unless this thread is inside `ahead()`."""
        if getattr(self._local, "ahead", False):
            with self._cond:
                self.ahead_reads += 1
            yield
            return
        with self._cond:
            self._reads += 1
            self.demand_reads += 1
        try:
            yield
        finally:
            with self._cond:
                self._reads -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def ahead(self):
        """Reads on this thread inside the block are a read-ahead's: not counted as demand."""
        before = getattr(self._local, "ahead", False)
        self._local.ahead = True
        try:
            yield
        finally:
            self._local.ahead = before

    def busy(self) -> bool:
        """True while a demand read is under way."""
        with self._cond:
            return self._reads > 0

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` s for no demand read to be under way; True if none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._reads == 0, timeout)
