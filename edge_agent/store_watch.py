"""Pick up experts promoted into the line's store while the agent runs.

`coe-agent experts promote` rewrites experts with new versions through the
store's atomic writes.  This watcher polls the manifest's stat; when it
changes it re-reads the manifest, forgets load failures of experts that have
a new version (a fixed expert gets another chance), and drops resident
copies whose version is stale.  A copy a running batch holds stays until
that batch releases it (the batch finishes on the bytes it started with):
that release drops it, so the next batch loads the new version even while
batches of a hot expert follow one another without a gap.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class StoreWatcher:
    """A daemon thread comparing each pool's resident versions with the store's manifest."""

    def __init__(self, store, pools: Callable[[], Iterable], *, forget: Callable[[str], None],
                 interval: float = 0.5, prepare: Callable[[str], None] | None = None) -> None:
        self.store, self._pools, self._forget, self.interval = store, pools, forget, interval
        # run on this thread for each expert with a new version, before its stale copies go (ONNX twins:
        # the export happens here, not on a load that sizes it under a pool's lock)
        self._prepare = prepare
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-watch", daemon=True)
        self._mtime = self._stamp()
        # the versions this watcher last saw, its own: the store may reload itself (a load that found a
        # newer file), and comparing with the store's copy would then miss the change
        self._seen = {e.id: e.version for e in store.entries()}
        self._changed: set[str] = set()  # experts with a new version some pool may still hold stale
        self.dropped = 0                # stale copies dropped (for tests and metrics)

    def _stamp(self) -> tuple | None:
        """Inode, mtime and size: an atomic rename changes the inode even within one coarse mtime tick."""
        try:
            st = self.store.manifest_path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def pending(self) -> set[str]:
        """Experts with a new version that some pool may still hold stale (empty: every pool is current)."""
        return set(self._changed)

    def start(self) -> "StoreWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a watcher that dies would silently keep stale experts
                log.exception("store watcher: checking for promoted experts failed; retrying")

    def tick(self) -> int:
        """One check: re-read a changed manifest and drop stale unpinned copies; returns how many were dropped."""
        stamp = self._stamp()
        if stamp != self._mtime:
            self._mtime = stamp
            self.store.reload()
            for e in self.store.entries():
                if self._seen.get(e.id) != e.version:
                    self._forget(e.id)
                    if self._prepare is not None:
                        try:
                            self._prepare(e.id)
                        except Exception:  # noqa: BLE001 - the load path prepares it again and reports why
                            log.exception("expert %s: preparing version %s failed", e.id, e.version)
                    self._changed.add(e.id)
                    log.info("expert %s: version %s in the store now (was %s)", e.id, e.version, self._seen.get(e.id))
                    self._seen[e.id] = e.version
        dropped, settled = 0, set()
        for eid in sorted(self._changed):
            want = self.store.entry(eid).version if self.store.has(eid) else None
            done = True
            for pool in self._pools():
                if not pool.present(eid):
                    continue
                value = pool.peek(eid)
                if value is None:                  # still loading: which version is not known yet
                    done = False
                elif getattr(value, "version", want) != want:
                    if pool.discard(eid, when_free=True):
                        dropped += 1
                    else:
                        done = False               # a batch holds it and finishes on these bytes; its release
                        #                            drops the copy, and the next batch loads the new version
            if done:
                settled.add(eid)
        self._changed -= settled
        self.dropped += dropped
        return dropped
