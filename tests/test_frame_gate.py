"""A promotion switches the expert set between frames: frames in flight finish on the versions they started with."""
from __future__ import annotations

import shutil
import threading

from coe import parse_spec
from edge_agent.frame_gate import FrameGate
from edge_agent.store_watch import StoreWatcher
from storage.expert_store import ExpertStore
from storage.policies import make_policy
from storage.pool import Pool
from storage.tiers import StoreSource

from conftest import TINY_SPEC, until

MODEL = parse_spec(TINY_SPEC)
CHAIN = ("cls-r0402", "det-2term")


def _line(tmp_path, tiny_zoo):
    shutil.copytree(tiny_zoo, tmp_path / "line")
    store = ExpertStore(tmp_path / "line")
    store.register_reader()                      # as the agent does at start
    return store


def _promote(root) -> list[str]:
    """Another process promotes the classifier and its detector together; returns the files it replaced."""
    writer = ExpertStore(root)
    old = [writer.entry(e).file for e in CHAIN]
    writer.write_many([(MODEL.experts[e], writer.read(e), 2) for e in CHAIN])
    return old


class _Line:
    """The agent's side of the gate: an in-flight table under a condition, and what got scheduled."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.inflight: dict[str, object] = {}
        self.scheduled: list[str] = []
        self.gate = FrameGate(self.lock, self.inflight, self.scheduled.extend, lambda f: f)

    def accept(self, frame: str) -> None:
        with self.lock:
            self.inflight[frame] = object()
            now = self.gate.admit([frame])
        self.scheduled.extend(now)

    def commit(self, frame: str) -> None:
        with self.lock:
            del self.inflight[frame]
            self.lock.notify_all()


def test_a_frame_in_flight_finishes_on_the_old_set_and_new_frames_wait_for_the_new_one(tmp_path, tiny_zoo):
    store = _line(tmp_path, tiny_zoo)
    pool = Pool("cpu", 10**9, make_policy("lru"), StoreSource(store))
    line = _Line()
    watch = StoreWatcher(store, lambda: [pool], forget=lambda e: None, gate=line.gate)
    line.accept("f1")
    first = pool.acquire("cls-r0402")                 # f1's classifier step ran on version 1
    assert first.value.version == 1
    pool.release(first)
    old_files = _promote(store.root)
    watch.tick()
    assert line.gate.closed and watch.switching
    line.accept("f2")                                 # accepted after the promotion: held, not scheduled
    assert line.scheduled == ["f1"]
    det = pool.acquire("det-2term")                   # f1's detector step: version 1, from the kept file
    assert det.value.version == 1 and store.entry("det-2term").version == 1
    pool.release(det)
    watch.tick()
    assert line.gate.closed                           # f1 has no verdict yet
    line.commit("f1")
    watch.tick()
    assert not line.gate.closed and line.scheduled == ["f1", "f2"]
    assert {e: store.entry(e).version for e in CHAIN} == {"cls-r0402": 2, "det-2term": 2}
    assert not pool.contains("det-2term") and not pool.contains("cls-r0402")   # stale copies dropped
    for e in CHAIN:                                   # f2 runs its whole chain on version 2
        h = pool.acquire(e)
        assert h.value.version == 2
        pool.release(h)
    assert not any((store.root / f).exists() for f in old_files)               # the kept files went
    took = watch.switches[0]
    assert took == {"experts": {"cls-r0402": 2, "det-2term": 2}, "held": 1, "late": 0, "seconds": took["seconds"],
                    "drain_seconds": took["drain_seconds"], "switch_seconds": took["switch_seconds"]}
    assert took["seconds"] == took["drain_seconds"] + took["switch_seconds"]
    store.close_reader()


def test_the_held_frames_are_released_only_once_the_stale_copies_are_gone(tmp_path, tiny_zoo):
    """A held frame released while a pool still holds a version-1 copy could run its classifier on it and
    its detector on version 2.  At the moment the gate schedules the held frames, no stale copy is left."""
    store = _line(tmp_path, tiny_zoo)
    pool = Pool("cpu", 10**9, make_policy("lru"), StoreSource(store))
    line = _Line()
    seen = []
    line.gate = FrameGate(line.lock, line.inflight,
                          lambda frames: seen.append({e: pool.contains(e) for e in CHAIN}) or
                          line.scheduled.extend(frames), lambda f: f)
    watch = StoreWatcher(store, lambda: [pool], forget=lambda e: None, gate=line.gate)
    for e in CHAIN:                                   # both experts resident on version 1
        pool.release(pool.acquire(e))
    line.accept("f1")
    _promote(store.root)
    watch.tick()
    line.accept("f2")                                 # held
    line.commit("f1")
    assert watch.tick() == 2                          # both stale copies dropped by this tick
    assert line.scheduled == ["f1", "f2"]
    assert seen == [{"cls-r0402": False, "det-2term": False}]   # gone before f2 was scheduled
    store.close_reader()


def test_a_drain_that_outlasts_its_timeout_switches_anyway_and_says_how_many_were_late(tmp_path, tiny_zoo):
    store = _line(tmp_path, tiny_zoo)
    line = _Line()
    watch = StoreWatcher(store, lambda: [], forget=lambda e: None, gate=line.gate, drain_timeout=0.0)
    line.accept("stuck")
    _promote(store.root)
    watch.tick()
    assert not line.gate.closed and watch.switches[0]["late"] == 1
    assert store.entry("det-2term").version == 2
    store.close_reader()


def test_a_switch_that_fails_releases_the_held_frames_on_the_versions_served(tmp_path, tiny_zoo, monkeypatch):
    """The promotion's manifest cannot be loaded when the drain ends (corrupt, say): the gate must not stay closed
    for good, holding every new frame until the agent answers busy to all; the held frames run on the versions
    already served, and a later change of the manifest is tried again."""
    store = _line(tmp_path, tiny_zoo)
    line = _Line()
    watch = StoreWatcher(store, lambda: [], forget=lambda e: None, gate=line.gate, drain_timeout=0.0)
    _promote(store.root)
    real = store.reload
    monkeypatch.setattr(store, "reload", lambda: (_ for _ in ()).throw(ValueError("manifest.json: truncated")))
    line.accept("early")                           # in flight: the gate closes for it, then the switch is due
    watch.tick()
    assert not line.gate.closed and watch.switches == []
    assert watch.failed_switches and "manifest.json: truncated" in watch.failed_switches[0]["error"]
    line.accept("later")                           # served at once, on the old versions
    assert line.scheduled[-1] == "later" and store.entry("det-2term").version == 1
    monkeypatch.setattr(store, "reload", real)     # fixed, and the manifest written again: switched this time
    _promote(store.root)
    watch.tick()
    assert watch.switches and store.entry("det-2term").version >= 2
    store.close_reader()


def test_a_manifest_rewrite_with_the_same_versions_holds_nothing(tmp_path, tiny_zoo):
    store = _line(tmp_path, tiny_zoo)
    line = _Line()
    watch = StoreWatcher(store, lambda: [], forget=lambda e: None, gate=line.gate)
    line.accept("f1")
    ExpertStore(store.root).set_compression("none")  # rewrites the manifest, changes no version
    watch.tick()
    assert not line.gate.closed and watch.switches == []
    line.accept("f2")
    assert line.scheduled == ["f1", "f2"]
    store.close_reader()


def test_a_closed_gate_waits_for_the_frames_in_flight_only():
    line = _Line()
    line.accept("a")
    line.accept("b")
    assert line.gate.close() == 2
    line.accept("c")
    assert not line.gate.wait_drained(0.0) and line.gate.in_flight() == 2
    line.commit("a")
    assert line.gate.in_flight() == 1
    done = threading.Timer(0.05, line.commit, args=("b",))
    done.start()
    assert line.gate.wait_drained(5.0)                # woken by the commit, not by polling
    assert "c" in line.inflight and line.gate.open() == 1 and line.scheduled == ["a", "b", "c"]
    assert line.gate.holds == 1 and line.gate.held_total == 1


def test_a_stop_during_a_switch_waits_for_it_and_leaves_the_gate_to_the_switch(tmp_path, tiny_zoo):
    """A stop that lands while the store switches (other boxes syncing, say) must not open the gate itself: the
    held frames would run on a store, pools and nodes half switched.  `stop` says the watcher still runs; the
    switch ends, releases them on the new versions, and the thread ends."""
    store = _line(tmp_path, tiny_zoo)
    line = _Line()
    syncing, go = threading.Event(), threading.Event()

    def on_switch(changed):
        syncing.set()
        go.wait(10)
    watch = StoreWatcher(store, lambda: [], forget=lambda e: None, gate=line.gate, interval=0.01,
                         on_switch=on_switch).start()
    line.accept("f1")
    _promote(store.root)
    until(lambda: line.gate.closed, 10, "the gate closing for the promotion")
    line.accept("f2")                                  # held
    line.commit("f1")
    assert syncing.wait(10)                            # the switch is under way
    assert watch.stop(timeout=0.2) is False            # still switching: the gate is not the caller's to open
    assert line.gate.closed and line.scheduled == ["f1"]
    go.set()
    assert watch.stop(timeout=10) is True
    assert not line.gate.closed and line.scheduled == ["f1", "f2"]
    assert watch.switches and watch.switches[0]["held"] == 1 and store.entry("det-2term").version == 2
    store.close_reader()


def test_a_stop_before_the_switch_begins_makes_no_switch_and_releases_the_held_frames(tmp_path, tiny_zoo):
    """Stopped while frames in flight still drain, with a long poll interval: the watcher sees the stop at once
    (it waited a whole interval for the drain, past `stop`'s join), switches nothing, and the held frames run on
    the versions served (the agent closes the store and pools next)."""
    store = _line(tmp_path, tiny_zoo)
    line = _Line()
    watch = StoreWatcher(store, lambda: [], forget=lambda e: None, gate=line.gate, interval=30.0)
    line.accept("f1")
    _promote(store.root)
    watch.tick()                                       # the gate closes for the new versions
    assert line.gate.closed
    line.accept("f2")
    watch.start()                                      # its thread now waits for f1's verdict
    assert watch.stop(timeout=5) is True
    assert not line.gate.closed and line.scheduled == ["f1", "f2"]
    line.commit("f1")
    assert watch.switches == [] and store.entry("det-2term").version == 1    # no switch after the stop
    store.close_reader()
