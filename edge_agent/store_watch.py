"""Pick up experts promoted into the line's store while the agent runs.

`coe-agent experts promote` rewrites experts with new versions through the
store's atomic writes.  This watcher polls the manifest's stat.  When a new
manifest changes some expert's version, and the agent gave it a `FrameGate`:

1. the gate closes: frames accepted from now on are held;
2. the frames already in flight finish on the old versions (the store keeps
   serving its old manifest, and the promotion kept the old files for this
   live reader);
3. once they have committed (or after `drain_timeout` s, logged), the store
   switches to the new manifest, load failures of experts with a new version
   are forgotten (a fixed expert gets another chance), their ONNX twins are
   exported again, other boxes' stores are synced and their actors follow
   (`on_switch`), the retired files go, and the gate opens.

So every frame runs wholly on the expert set that was live when it was
accepted.  Without a gate the switch happens at once (each batch is still
consistent).  After a switch, resident copies whose version is stale are
dropped; a copy a running batch holds stays until that batch releases it, and
that release drops it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)
LOADING_WAIT_S = 30.0   # a switch waits at most this long for pools' loads begun before it (their version unknown)
DRAIN_SLICE_S = 0.25    # the watcher's thread waits for a drain in slices this long (a stop is seen between them)


class StoreWatcher:
    """A daemon thread comparing each pool's resident versions with the store's manifest."""

    def __init__(self, store, pools: Callable[[], Iterable], *, forget: Callable[[str], None],
                 interval: float = 0.5, prepare: Callable[[str], None] | None = None, gate=None,
                 drain_timeout: float = 60.0, on_switch: Callable[[dict[str, int]], None] | None = None) -> None:
        self.store, self._pools, self._forget, self.interval = store, pools, forget, interval
        self._gate, self.drain_timeout = gate, drain_timeout
        # after the store switched and before held frames run: carry the change to other boxes' stores
        self._on_switch = on_switch
        self._closed_at: float | None = None   # when the gate closed for a pending switch
        self.switches: list[dict] = []          # one per switch: versions, frames drained and held, seconds
        self.failed_switches: list[dict] = []   # one per switch that failed: why, and the held frames released
        # run on this thread for each expert with a new version, before its stale copies go (ONNX twins:
        # the export happens here, not on a load that sizes it under a pool's lock)
        self._prepare = prepare
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-watch", daemon=True)
        # the stamp of the manifest the store's entries came from, not of the file now: a promotion between
        # the store's read (the agent's start) and this line is then a change like any other
        self._mtime = store.manifest_stamp if hasattr(store, "manifest_stamp") else self._stamp()
        # the versions this watcher last saw, its own: the store may reload itself (a load that found a
        # newer file), and comparing with the store's copy would then miss the change
        self._seen = {e.id: e.version for e in store.entries()}
        self._changed: set[str] = set()  # experts with a new version some pool may still hold stale
        self.dropped = 0                # stale copies dropped (for tests and metrics)
        self._failed: tuple | None = None   # the manifest state last complained about (logged once)
        self._loading_stale: set[str] = set()   # replaced experts a pool was still loading at the last drop

    def _stamp(self) -> tuple | None:
        """Inode, mtime and size: an atomic rename changes the inode even within one coarse mtime tick."""
        try:
            st = self.store.manifest_path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _complain(self, stamp, message: str) -> None:
        """Log a manifest problem once per manifest state (the watcher ticks every interval)."""
        if self._failed != (stamp, message):
            log.error("store watcher: %s", message)
        self._failed = (stamp, message)

    def pending(self) -> set[str]:
        """Experts with a new version that some pool may still hold stale (empty: every pool is current)."""
        return set(self._changed)

    def start(self) -> "StoreWatcher":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop ticking; True once the thread has ended (a watcher never started stops at once).

        A switch already under way runs to its end (the store, the pools and
        other boxes would be left half switched), and this waits up to
        `timeout` s for it; a switch not yet begun is not made (the gate is
        opened, its held frames run on the versions served).  While this
        returns False the thread still owns the gate: the caller must not
        open it (the held frames would run mid-switch).
        """
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def alive(self) -> bool:
        """Whether the watcher's thread is running (an agent's stop counts it among the threads to wait for)."""
        return self._thread.is_alive()

    @property
    def switching(self) -> bool:
        """True while new frames are held for a switch (frames in flight still finishing)."""
        return self._closed_at is not None

    def _run(self) -> None:
        try:
            while not self._stop.wait(0 if self.switching else self.interval):
                try:
                    # waiting for a drain in short slices: a verdict's commit wakes it at once anyway, and a
                    # stop is seen within one slice, however long the poll interval
                    self.tick(wait=min(self.interval, DRAIN_SLICE_S))
                except Exception:  # noqa: BLE001 - a watcher that dies would silently keep stale experts
                    log.exception("store watcher: checking for promoted experts failed; retrying")
        finally:
            if self._closed_at is not None:     # stopped before the switch began: the held frames run as served
                self._closed_at = None
                self._gate.open()

    def tick(self, wait: float = 0.0) -> int:
        """One check: follow a changed manifest and drop stale unpinned copies; returns how many were dropped.

        While a switch waits for frames in flight, `wait` is how long this call
        may block for them (the watcher's thread passes its interval).
        """
        stamp = self._stamp()
        dropped = 0
        if stamp is None and self._mtime is not None:
            # the manifest is gone (a restore by `mv`, rsync --delete): keep serving the experts last read
            self._complain(stamp, "the expert store manifest is gone; serving the experts last read")
        elif stamp != self._mtime:
            try:
                if self._gate is None:
                    self._switch()
                elif self._closed_at is None and self._new_versions():
                    drain = self._gate.close()
                    self._closed_at = time.monotonic()
                    log.info("new expert versions in the store: holding new frames until %d in flight finish on "
                             "the versions they started with", drain)
                elif self._closed_at is None and not self.store.reload_if(
                        lambda entries: not any(self._seen.get(i) != e.version for i, e in entries.items())):
                    # new versions landed between the check and the reload: not adopted; the gated path takes
                    # them at the next tick
                    return dropped
            except Exception as exc:  # noqa: BLE001 - tried again at the next tick: the stamp is not marked seen
                self._complain(stamp, f"reading the expert store manifest failed ({exc}); trying again")
                return dropped
            # marked seen only once handled: a manifest whose read failed once is read again
            self._mtime = stamp
            self._failed = None
        if self._closed_at is not None:
            drained = self._gate.wait_drained(wait)
            waited = time.monotonic() - self._closed_at
            if self._stop.is_set():
                # stopping before the switch began: it is not made (the agent closes the store and the pools
                # next); the held frames run on the versions served, and this manifest is followed at next start
                held = self._gate.open()
                self._closed_at = None
                log.info("stopping: the expert switch was not made; %d held frame(s) released on the versions "
                         "served", held)
                return dropped
            if drained or waited >= self.drain_timeout:
                left = 0 if drained else self._gate.in_flight()
                if left:
                    log.warning("expert switch: %d frame(s) still in flight after %.0f s; switching anyway, their "
                                "remaining steps run on the new versions (their verdicts' versions say which)",
                                left, waited)
                began = time.monotonic()
                try:
                    changed = self._switch()
                    # the stale copies go before the held frames run: released first, a held frame could take a
                    # version-1 copy still in a pool for its classifier and meet version 2 of its detector (seen
                    # once in tests/test_promote.py: ten frames mixed).  Drained, no batch holds one now.
                    dropped = self._drop_stale()
                    # a copy still loading (a prefetch, a read-ahead) may be of the old version: which is known
                    # only once it is in, so the held frames wait for those loads (bounded) and its drop
                    until = time.monotonic() + LOADING_WAIT_S
                    while self._loading_stale and time.monotonic() < until and not self._stop.wait(0.02):
                        dropped += self._drop_stale()
                except Exception as exc:  # noqa: BLE001 - a store that cannot be switched to must not stop the line
                    # the held frames run on the versions already served; a later change of the manifest (a fixed
                    # promotion) is tried again (`_mtime` moved on).  Retrying here would hold them for good
                    held = self._gate.open()
                    self._closed_at = None
                    self.failed_switches.append({"error": f"{type(exc).__name__}: {exc}", "held": held})
                    log.error("expert switch failed (%s); %d held frame(s) released on the versions served before; "
                              "the next change of the manifest is tried again", exc, held)
                    return dropped
                held = self._gate.open()
                self._closed_at = None
                took = time.monotonic() - began
                self.switches.append({"experts": changed, "held": held, "late": left, "seconds": waited + took,
                                      "drain_seconds": waited, "switch_seconds": took})
                log.info("expert switch done in %.2f s (%.2f s draining, %.2f s switching): %s; %d held frame(s) "
                         "released", waited + took, waited, took,
                         ", ".join(f"{e} v{v}" for e, v in changed.items()) or "no version change", held)
        return dropped + self._drop_stale()

    def _new_versions(self) -> bool:
        """Whether the manifest on disk gives some expert another version than this watcher last saw."""
        on_disk = self.store.read_manifest()
        return any(self._seen.get(eid) != e.version for eid, e in on_disk.items())

    def _switch(self) -> dict[str, int]:
        """Follow the manifest on disk now; returns the experts whose version changed (id -> new version)."""
        self.store.reload()
        changed: dict[str, int] = {}
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
                changed[e.id] = e.version
        if changed and self._on_switch is not None:
            try:
                self._on_switch(changed)
            except Exception:  # noqa: BLE001 - the line goes on; the log names what did not follow
                log.exception("carrying the new versions to other boxes failed; their executors may serve the "
                              "old ones until they rejoin (restart the agent after `coe-agent experts sync`)")
        release = getattr(self.store, "release_retired", None)
        if changed and release is not None:
            try:
                gone = release()
                if gone:
                    log.info("removed %d file(s) of replaced expert versions", gone)
            except Exception:  # noqa: BLE001 - the switch is done: a cleanup fault must not read as a failed switch
                log.exception("removing the replaced versions' files failed; they are retried at the next switch")
        return changed

    def _drop_stale(self) -> int:
        """Drop the unpinned copies of replaced versions; notes in `_loading_stale` the ones still loading."""
        dropped, settled, self._loading_stale = 0, set(), set()
        for eid in sorted(self._changed):
            want = self.store.entry(eid).version if self.store.has(eid) else None
            done = True
            for pool in self._pools():
                if not pool.present(eid):
                    continue
                value = pool.peek(eid)
                if value is None:                  # still loading: which version is not known yet
                    done = False
                    self._loading_stale.add(eid)
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
