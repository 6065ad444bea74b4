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


def test_a_prefetch_gives_way_to_a_layers_load_and_loads_once_the_disk_is_free(tiny_zoo):
    store = ExpertStore(tiny_zoo)
    pool = Pool("cpu", 200 * 2**20, make_policy("lru"), StoreSource(store))
    eid = store.entries()[0].id
    pre = _Prefetcher({0: [eid]}, lambda _: pool)
    try:
        pooled_experts._demand_add(1)                       # a layer's own load is queued
        try:
            assert pooled_experts.demand_loads() >= 1
            pre._issue(0, {0})
            pre._loader.submit(lambda: None).result()        # the prefetch thread is done with it
        finally:
            pooled_experts._demand_add(-1)
        for _ in range(100):                                 # its done-callbacks run just after
            if pre.stats.yielded:
                break
            time.sleep(0.01)
        assert pre.stats.issued == 1 and pre.stats.yielded == 1
        assert not pool.present(eid) and pool.stats().resident_bytes == 0     # nothing loaded, nothing reserved
        pre._score(0, {0})
        assert pre.stats.useful == 0                         # a guess never read in saves no read
        pre._issue(0, {0})                                   # the disk is free now: it loads
        pre._loader.submit(lambda: None).result()
        assert pool.present(eid) and pre.stats.yielded == 1
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
