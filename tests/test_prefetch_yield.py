"""A prefetch's read gives way to the loads a layer waits for (issue 11: prefetches never delay them).

The read checks before it starts and between small chunks; a prefetch that
gives way loads nothing, leaves no reservation behind, and is counted.
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


def test_a_prefetch_whose_read_is_overtaken_stops_keeps_no_reservation_and_reads_again_later(tiny_zoo):
    pool, eid, pre = _one_expert(tiny_zoo)
    load, calls = pool.source.load, []

    def overtaken(expert_id, reuse=None):       # a layer's load arrives as the prefetch's first read begins
        calls.append(pool.present(expert_id))   # the entry is 'loading' (reserved) while its read runs
        if len(calls) > 1:
            return load(expert_id, reuse)
        pooled_experts._demand_add(1)
        try:
            return load(expert_id, reuse)
        finally:
            pooled_experts._demand_add(-1)
    pool.source.load = overtaken
    try:
        pre._issue(0, {0})
        _settle(pre)
        assert len(calls) == 2 and pre.stats.yielded == 1 and pre.stats.issued == 1    # stopped, then read in
        assert pool.present(eid) and calls == [True, True]      # reserved for each read; the first left none behind
        pre._score(0, {0})
        assert pre.stats.useful == 1
    finally:
        pre.close()


def test_a_read_stops_when_its_layer_runs_meanwhile_and_is_not_counted(tiny_zoo):
    """The layer ran (all hits, no load of its own) while the guess was read: the read stops, counts nothing."""
    pool, eid, pre = _one_expert(tiny_zoo)
    load = pool.source.load

    def layer_runs(expert_id, reuse=None):
        pre._score(0, {0})                          # the layer's tokens came and went
        return load(expert_id, reuse)
    pool.source.load = layer_runs
    try:
        pre._issue(0, {0})
        _settle(pre)
        assert pre.stats.yielded == 1 and pre.stats.dropped == 1 and pre.stats.issued == 0
        assert pre.stats.useful == 0 and not pool.present(eid)
    finally:
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
