"""Pick up experts promoted into the line's store while the agent runs.

`coe-agent experts promote` rewrites experts with new versions through the
store's atomic writes.  This watcher polls the manifest's mtime; when it
changes it re-reads the manifest, forgets load failures of experts that have
a new version (a fixed expert gets another chance), and drops resident
copies whose version is stale.  A copy a running batch holds stays until
that batch releases it (the batch finishes on the bytes it started with) and
is dropped at a later tick; the next batch loads the new version.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class StoreWatcher:
    """A daemon thread comparing each pool's resident versions with the store's manifest."""

    def __init__(self, store, pools: Callable[[], Iterable], *, forget: Callable[[str], None],
                 interval: float = 0.5) -> None:
        self.store, self._pools, self._forget, self.interval = store, pools, forget, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-watch", daemon=True)
        self._mtime = self._stamp()
        self._pending = False           # a stale copy was pinned last tick: look again
        self.dropped = 0                # stale copies dropped (for tests and metrics)

    def _stamp(self) -> float | None:
        try:
            return self.store.manifest_path.stat().st_mtime_ns
        except OSError:
            return None

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
            before = {e.id: e.version for e in self.store.entries()}
            self.store.reload()
            for e in self.store.entries():
                if before.get(e.id) != e.version:
                    self._forget(e.id)
                    log.info("expert %s: version %s in the store now (was %s)", e.id, e.version, before.get(e.id))
            self._pending = True
        if not self._pending:
            return 0
        dropped, stale_left = 0, False
        for pool in self._pools():
            for eid in pool.resident():
                if not self.store.has(eid):
                    continue
                version = getattr(pool.peek(eid), "version", None)
                if version is None or version == self.store.entry(eid).version:
                    continue
                if pool.discard(eid):
                    dropped += 1
                else:
                    stale_left = True   # a batch holds it: it finishes on these bytes; drop it next tick
        self._pending = stale_left
        self.dropped += dropped
        return dropped
