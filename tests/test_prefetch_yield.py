"""A prefetch's read gives way to the loads a layer waits for (issue 11: prefetches never delay them).

The read checks before it starts and between small chunks.  While a layer's
load runs it pauses, keeping what it has read, and goes on where it stopped;
once its layer has asked for the expert it is the layer's read (adopted, and
joined rather than read twice); if its layer ran without asking for it, it
stops, loads nothing, leaves no reservation behind, and is counted.
"""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

from executors import pooled_experts  # noqa: E402
from executors.moe_prefetch import _Prefetcher  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from storage.flat import ReadYielded, read_flat, yield_to  # noqa: E402
from storage.policies import make_policy  # noqa: E402
from storage.pool import Pool  # noqa: E402
from storage.tiers import StoreSource  # noqa: E402


@pytest.fixture()
def big_file(tmp_path):
    """One 6 MiB tensor: three chunks of a read that may yield."""
    path = tmp_path / "e.safetensors"
    save_file({"w": torch.arange(6 * 2**20 // 4, dtype=torch.float32)}, str(path))
    return path


def test_a_read_that_may_yield_gives_way_before_it_starts_and_between_chunks(big_file):
    whole = read_flat(big_file, "e")
    with yield_to(lambda: True), pytest.raises(ReadYielded, match="gave way"):
        read_flat(big_file, "e")
    asked = []

    def after_two_checks():                 # the start check, the first chunk's: then a load comes
        asked.append(time.perf_counter())
        return len(asked) > 2
    with yield_to(after_two_checks), pytest.raises(ReadYielded):
        read_flat(big_file, "e")
    assert len(asked) == 3                  # it stopped at the second chunk, not at the end of the file
    with yield_to(lambda: False):           # nothing urgent: the same bytes as a plain read
        calm = read_flat(big_file, "e")
        with yield_to(lambda: True):        # nested, and the outer predicate comes back after
            with pytest.raises(ReadYielded):
                read_flat(big_file, "e")
        again = read_flat(big_file, "e")
    assert torch.equal(calm.buffer, whole.buffer) and torch.equal(again.buffer, whole.buffer)
    assert torch.equal(read_flat(big_file, "e").buffer, whole.buffer)      # outside: never yields


def _settle(pre):
    pre.drain()                                    # the prefetch thread has done what was queued before


def _one_expert(tiny_zoo):
    """A pool over the tiny zoo, its first expert, and a prefetcher guessing it for layer 0."""
    store = ExpertStore(tiny_zoo)
    pool = Pool("cpu", 200 * 2**20, make_policy("lru"), StoreSource(store))
    eid = store.entries()[0].id
    return pool, eid, _Prefetcher({0: [eid]}, lambda _: pool)


def test_a_prefetch_waits_for_the_layers_load_and_loads_once_the_disk_is_free(tiny_zoo):
    pool, eid, pre = _one_expert(tiny_zoo)
    try:
        pooled_experts._demand_add(1)                       # a layer's own load is queued
        try:
            pre._issue(0, {0})
            time.sleep(0.1)                                  # the prefetch thread is waiting, not reading
            # nothing read, nothing evicted, nothing reserved while the layer's load holds the disk
            assert not pool.present(eid) and pool.stats().resident_bytes == 0 and pool.stats().misses == 0
            assert pre.stats.issued == 0
        finally:
            pooled_experts._demand_add(-1)                   # the disk is free now: it loads
        _settle(pre)
        assert pool.present(eid) and pre.stats.issued == 1 and pre.stats.yielded == 0
        pre._score(0, {0})
        assert pre.stats.useful == 1                         # read in, then asked for: a read saved
    finally:
        pre.close()


def test_a_guess_a_layers_own_load_brought_in_meanwhile_is_not_read_or_counted(tiny_zoo):
    """The current token's layer may load the very expert guessed for the next token: the prefetch, waiting
    for that load, then finds it in and neither takes a pool hit nor counts a read it did not do."""
    pool, eid, pre = _one_expert(tiny_zoo)
    try:
        pooled_experts._demand_add(1)                       # the layer's load is queued: the prefetch waits
        try:
            pre._issue(0, {0})
            time.sleep(0.1)
            pool.release(pool.acquire(eid))                 # the layer's own load of the same expert
        finally:
            pooled_experts._demand_add(-1)
        _settle(pre)
        assert pre.stats.issued == 0 and pre.stats.dropped == 0
        assert (pool.stats().misses, pool.stats().hits) == (1, 0)     # the layer's miss; no hit for the prefetch
        pre._score(0, {0})
        assert pre.stats.useful == 0                         # no read of the prefetch's saved the layer anything
    finally:
        pre.close()


def test_a_read_that_may_pause_waits_between_chunks_and_goes_on_where_it_stopped(big_file):
    whole = read_flat(big_file, "e")
    checks, waits = [], []

    def pause():                            # the second and third checks find a layer's load under way
        checks.append(1)
        return len(checks) in (2, 3)
    with yield_to(lambda: False, pause=pause, wait=waits.append):
        got = read_flat(big_file, "e")
    assert torch.equal(got.buffer, whole.buffer)            # paused, not started over: the same bytes
    assert len(waits) == 2                                  # it waited twice, between chunks
    stop = iter([False, False, True])                       # urgent on the third check: it gives up after all
    paused = []

    def always():                                           # a read that never re-checks `urgent` fails, not hangs
        paused.append(1)
        if len(paused) > 50:
            raise AssertionError("a paused read must look again whether to give up")
        return True
    with yield_to(lambda: next(stop, True), pause=always, wait=waits.append), pytest.raises(ReadYielded):
        read_flat(big_file, "e")
    assert len(paused) == 2


def test_a_prefetch_whose_read_is_overtaken_pauses_and_goes_on_reading_once(tiny_zoo, monkeypatch):
    from executors import moe_prefetch
    monkeypatch.setattr(moe_prefetch, "PAUSE_LIMIT_SECONDS", 60.0)    # a slow timer thread must not look like a limit
    pool, eid, pre = _one_expert(tiny_zoo)
    load, calls = pool.source.load, []
    release = __import__("threading").Event()

    def overtaken(expert_id, reuse=None):       # a layer's load arrives, from its own thread, as the read begins
        calls.append(pool.present(expert_id))   # the entry is 'loading' (reserved) while its read runs
        pooled_experts._demand_add(1)
        __import__("threading").Timer(0.05, lambda: (release.set(), pooled_experts._demand_add(-1))).start()
        from storage.flat import may_yield
        may_yield(expert_id)                    # the read's next chunk: it waits here until the load is done
        assert release.is_set()
        return load(expert_id, reuse)
    pool.source.load = overtaken
    try:
        pre._issue(0, {0})
        _settle(pre)
        assert calls == [True]                  # one read: paused, not stopped and started again
        assert pre.stats.paused == 1 and pre.stats.yielded == 0 and pre.stats.issued == 1
        assert pool.present(eid)
        pre._score(0, {0})
        assert pre.stats.useful == 1
    finally:
        pre.close()


def test_a_read_stops_when_its_layer_runs_meanwhile_without_asking_for_it(tiny_zoo):
    """The layer ran (asking for other experts) while the guess was read: the read stops and leaves nothing."""
    pool, eid, pre = _one_expert(tiny_zoo)
    load = pool.source.load

    def layer_runs(expert_id, reuse=None):
        pre._score(0, set())                        # the layer's tokens came and went, and did not ask for it
        from storage.flat import may_yield
        may_yield(expert_id)
        return load(expert_id, reuse)
    pool.source.load = layer_runs
    try:
        pre._issue(0, {0})
        _settle(pre)
        assert pre.stats.yielded == 1 and pre.stats.issued == 0 and pre.stats.adopted == 0
        assert (pre.stats.stopped_ran, pre.stats.stopped_room, pre.stats.stopped_limit) == (1, 0, 0)   # why
        assert pre.stats.useful == 0 and not pool.present(eid) and pool.stats().resident_bytes == 0
    finally:
        pre.close()


def test_a_read_its_layer_asks_for_meanwhile_is_adopted_and_joined_not_read_twice(tiny_zoo):
    """The layer asks for the expert being read: the read goes on unpaused and the layer joins it.

    A wrong implementation does not hang here: timers free the read and the
    layer's other load after 30 s, and the assertions then fail.
    """
    import threading

    pool, eid, pre = _one_expert(tiny_zoo)
    load, reads = pool.source.load, []
    started, go, other_load_done = threading.Event(), threading.Event(), threading.Event()
    ending = threading.Lock()

    def slow(expert_id, reuse=None):
        reads.append(expert_id)
        started.set()
        go.wait(30)                             # the layer comes while the read is under way
        return load(expert_id, reuse)

    def other_load_ends():                      # once, whoever calls it first (a timer or the test)
        with ending:
            if not other_load_done.is_set():
                other_load_done.set()
                pooled_experts._demand_add(-1)
    pool.source.load = slow
    timers = [threading.Timer(30, go.set), threading.Timer(30, other_load_ends)]
    try:
        pre._issue(0, {0})
        assert started.wait(5)
        pre._score(0, {0})                      # the layer routes to it: the read is the layer's now
        pooled_experts._demand_add(1)           # another of the layer's loads is under way: an adopted read goes on
        for t in timers:
            t.start()
        with pooled_experts.PinnedWave(lambda _: pool, [eid]) as wave:
            assert wave.ready == 0              # joined: reserving did not wait for the read
            go.set()
            got = [h.expert_id for _, h in wave.as_ready()]
        other_load_ends()
        _settle(pre)
        assert got == [eid] and reads == [eid]  # read once, by the prefetch
        st = pool.stats()
        assert st.misses == 1 and st.hits == 1  # the layer's use is a hit on the prefetch's load
        assert pre.stats.adopted == 1 and pre.stats.useful == 1
        assert pre.stats.paused == 0 and pre.stats.yielded == 0
        with pool._cond:
            assert pool._entries[eid].pins == 0  # the prefetch's pin and the layer's both given back
    finally:
        go.set()
        other_load_ends()
        for t in timers:
            t.cancel()
        pre.close()


def test_a_stale_guess_is_dropped_not_loaded(tiny_zoo):
    store = ExpertStore(tiny_zoo)
    pool = Pool("cpu", 200 * 2**20, make_policy("lru"), StoreSource(store))
    ids = [e.id for e in store.entries()[:2]]
    pre = _Prefetcher({0: ids}, lambda _: pool)
    gate = __import__("threading").Event()
    try:
        pre._loader.submit(gate.wait, 5)                     # the prefetch thread is busy for now
        pre._issue(0, {0})
        pre._score(0, {1})                                   # the layer runs before the guess's turn comes
        gate.set()
        _settle(pre)
        assert pre.stats.dropped == 1 and pre.stats.issued == 0 and not pool.present(ids[0])
    finally:
        pre.close()


def test_a_layers_loads_count_as_demand_while_they_run(tiny_zoo):
    store = ExpertStore(tiny_zoo)
    pool = Pool("cpu", 200 * 2**20, make_policy("lru"), StoreSource(store))
    seen = []
    load = pool.source.load

    def spy(eid, reuse=None):
        seen.append(pooled_experts.demand_loads())
        return load(eid, reuse)
    pool.source.load = spy
    ids = [e.id for e in store.entries()[:2]]
    before = pooled_experts.demand_loads()
    with pooled_experts.PinnedWave(lambda _: pool, ids) as wave:
        assert len(list(wave.as_ready())) == 2
    assert seen and all(n >= 1 for n in seen)               # counted while running
    assert pooled_experts.demand_loads() == before          # and not after


def test_an_in_place_expert_from_its_file_counts_as_demand_and_one_from_the_host_copy_does_not():
    from executors.moe_fiddler import MappedInPlace
    from executors.moe_split import LoadComputeSplit

    seen = {}

    class Weights:                                  # where the expert's bytes are: 'file' or the host tier
        def __init__(self, where):
            self.where = where

        def open(self, expert_id):
            return {"w": torch.ones(2)}, (None if self.where == "file" else object())

        def close(self, handle, expert_id=None):
            pass

    def compute(e, tensors, hidden, mask, weights):
        seen[e] = pooled_experts.demand_loads()
        return torch.tensor([0]), torch.tensor([0]), hidden * tensors["w"].sum()

    before = pooled_experts.demand_loads()
    for e, where in ((0, "file"), (1, "host")):
        MappedInPlace(Weights(where), LoadComputeSplit()).start(compute, [(e, f"x{e}")], torch.ones(1, 2),
                                                                torch.ones(1), torch.ones(1))
    assert seen == {0: before + 1, 1: before} and pooled_experts.demand_loads() == before


def test_a_prefill_pass_voids_the_guess_and_its_read_stops(tiny_zoo):
    """A new prompt's prefill runs the layer: the guess made for the next decode step is void, its read stops."""
    import threading

    pool, eid, pre = _one_expert(tiny_zoo)
    load, started, go = pool.source.load, threading.Event(), threading.Event()

    def slow(expert_id, reuse=None):
        started.set()
        go.wait(30)                                 # until the prefill below has run (a wrong read fails, not hangs)
        return load(expert_id, reuse)
    pool.source.load = slow
    try:
        pre._issue(0, {0})
        assert started.wait(5)
        pre.forget(0)                               # the prefill's pass through layer 0
        go.set()
        _settle(pre)
        assert pre.stats.yielded == 1 and pre.stats.issued == 0 and not pool.present(eid)
        assert pre.stats.stopped_ran == 1          # a void guess stops as one whose layer ran
        assert pre.expected() == frozenset()        # nothing kept last for a guess that is void
    finally:
        go.set()
        pre.close()


def test_a_read_under_way_gives_its_room_to_a_layer_that_has_none(tiny_zoo, monkeypatch):
    """A pool with room for one expert: a layer that needs it makes the prefetch stop, and runs in one wave."""
    import threading

    from executors import moe_prefetch
    monkeypatch.setattr(moe_prefetch, "PAUSE_LIMIT_SECONDS", 60.0)     # only the layer's want of room can stop it

    store = ExpertStore(tiny_zoo)
    entries = store.entries()
    src = StoreSource(store)
    size = max(src.size(e.id) for e in entries[:2])
    pool = Pool("cpu", size, make_policy("lru"), src)
    ids = [e.id for e in entries[:2]]
    pre = _Prefetcher({0: ids}, lambda _: pool)
    load, started, outside_done = pool.source.load, threading.Event(), threading.Event()

    ending = threading.Lock()

    def outside_ends():
        with ending:
            if not outside_done.is_set():
                outside_done.set()
                pooled_experts._demand_add(-1)

    def slow(expert_id, reuse=None):
        if expert_id == ids[0]:
            started.set()
            pooled_experts._demand_add(1)           # a layer's load elsewhere: the prefetch pauses, holding its room
            from storage.flat import may_yield
            may_yield(expert_id)
        return load(expert_id, reuse)
    pool.source.load = slow
    try:
        pre._issue(0, {0})
        assert started.wait(5)
        # the outside load stays under way through the wave: a paused read that kept its room until that load
        # ended would leave the wave nothing, and it raises after 20 s
        with pooled_experts.PinnedWave(lambda _: pool, [ids[1]], wait=20) as wave:
            got = [h.expert_id for _, h in wave.as_ready()]
        assert not outside_done.is_set()
        outside_ends()
        _settle(pre)
        assert got == [ids[1]] and pre.stats.yielded == 1 and not pool.present(ids[0])
        assert (pre.stats.stopped_ran, pre.stats.stopped_room, pre.stats.stopped_limit) == (0, 1, 0)
        assert not pooled_experts.short_of_room()   # the wave's mark went with it
    finally:
        outside_ends()
        pre.close()


def test_a_read_paused_too_long_gives_up_but_not_once_adopted(tiny_zoo, monkeypatch):
    """The pause limit stops a guess nobody waits on; a read its layer asked for is never stopped by it.

    The limit runs on a clock the test moves (no thread's timing decides it):
    the read pauses, then (adopted or not) the clock jumps past the limit.
    """
    import threading
    import types

    from executors import moe_prefetch
    from storage.flat import may_yield
    monkeypatch.setattr(moe_prefetch, "PAUSE_LIMIT_SECONDS", 1.0)
    clock = [0.0]
    monkeypatch.setattr(moe_prefetch, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    for adopt in (False, True):
        clock[0] = 0.0
        pool, eid, pre = _one_expert(tiny_zoo)
        load = pool.source.load

        def held(expert_id, reuse=None, load=load):
            pooled_experts._demand_add(1)           # a layer's load comes as the read starts, and stays
            may_yield(expert_id)                    # paused here: until adopted, or the limit
            return load(expert_id, reuse)
        pool.source.load = held
        try:
            pre._issue(0, {0})
            deadline = __import__("time").monotonic() + 30
            while pre.stats.paused == 0:            # the read is paused (a liveness bound only)
                assert __import__("time").monotonic() < deadline, "the read never paused"
                threading.Event().wait(0.005)
            if adopt:
                pre._score(0, {0})                  # its layer asks for it while it is paused
            clock[0] = 5.0                          # long past the limit
            _settle(pre)
            if adopt:                               # read to the end under the layer's own load
                assert pre.stats.adopted == 1 and pre.stats.yielded == 0 and pool.present(eid)
            else:                                   # gave up after the limit; nothing left behind
                assert pre.stats.yielded == 1 and pre.stats.paused == 1 and not pool.present(eid)
                assert (pre.stats.stopped_ran, pre.stats.stopped_room, pre.stats.stopped_limit) == (0, 0, 1)
        finally:
            pooled_experts._demand_add(-1)
            pre.close()
