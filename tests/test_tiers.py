"""Tiers, flat buffers, skeleton switching and prefetch, on real files and real models."""
from __future__ import annotations

import gc
import os
import sqlite3
import weakref

import numpy as np
import psutil
import pytest
import torch

from coe import CoEError, Expert, ExpertLoadError, parse_spec
from edge_agent.agent import Agent
from edge_agent.config import load_config
from edge_agent.replay import replay
from executors.backends import get_backend
from executors.prefetch import Prefetcher
from executors.skeletons import Skeletons
from storage.expert_store import ExpertStore
from storage.heap import trim_heap
from storage.policies import make_policy
from storage.pool import Pool
from storage.recording import Recording
from storage.tiers import StoreSource, TierSource

from conftest import TINY_SPEC

MODEL = parse_spec(TINY_SPEC)


def test_flat_read_matches_safetensors_and_checks_sha(tiny_zoo, tmp_path):
    store = ExpertStore(tiny_zoo, verify="always")
    flat = store.read_flat("det-2term")
    ref = store.read("det-2term")
    assert flat.nbytes == store.nbytes("det-2term")
    assert set(flat.tensors()) == set(ref) and all(torch.equal(flat.tensors()[k], ref[k]) for k in ref)


def corrupt_copy(tiny_zoo, tmp_path, how):
    import shutil
    root = tmp_path / "store"
    shutil.copytree(tiny_zoo, root)
    store = ExpertStore(root)
    path = store.path("cls-c0402")
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-100] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "header":
        data[8:20] = b"not json at "
    path.write_bytes(bytes(data))
    return store, path


@pytest.mark.parametrize("how,needle", [("flip", "sha256 mismatch"), ("truncate", "truncated"),
                                        ("header", "corrupt")])
def test_corrupt_files_name_the_expert_and_file(tiny_zoo, tmp_path, how, needle):
    store, path = corrupt_copy(tiny_zoo, tmp_path, how)
    with pytest.raises(ExpertLoadError) as ei:
        store.read_flat("cls-c0402")
    assert ei.value.expert_id == "cls-c0402" and str(path) in str(ei.value) and needle in str(ei.value)


def rss() -> int:
    gc.collect()
    return psutil.Process(os.getpid()).memory_info().rss


def test_memory_really_comes_back_after_eviction(tmp_path):
    store = ExpertStore(tmp_path / "big")
    big = Expert("big", "torchvision/none", "classifier", ("a",), 32)
    # 48 MiB: above glibc's largest mmap threshold (32 MiB), so the allocation is its own mapping and a
    # free hands it straight back to the OS; smaller buffers are reused by the allocator instead
    store.write(big, {"w": torch.ones(48 * 2**20 // 4)})
    store.write(Expert("other", "torchvision/none", "classifier", ("a",), 32), {"w": torch.ones(1024)})
    pool = Pool("cpu", 60 * 2**20, make_policy("lru"), StoreSource(store))
    h = pool.acquire("big")
    ref = weakref.ref(h.value)
    loaded = rss()
    pool.release(h)
    del h
    assert pool.evict("big")
    assert ref() is None                                            # nothing else holds the buffer
    # in a long test process malloc may serve the 48 MiB from a free heap region instead of a mapping of its
    # own (CI saw it), and free() keeps that; trimming releases whole free pages, so RSS can only fall if the
    # buffer really was freed
    trim_heap()
    assert loaded - rss() > 40 * 2**20                              # and the 48 MiB went back to the OS


def test_skeleton_switch_rebinds_without_building(tiny_zoo):
    store = ExpertStore(tiny_zoo)
    sk = Skeletons("cpu")
    imgs = [np.random.default_rng(i).integers(0, 255, (40, 40, 3), dtype=np.uint8) for i in range(6)]
    outs = {}
    for eid in ("cls-r0402", "cls-c0402", "cls-r0402"):
        e = MODEL.experts[eid]
        be = get_backend(e.arch)
        module = sk.bind(e, store.read_flat(eid))
        got = be.logits(module, e, imgs)
        want = be.logits(be.build(e, store.read(eid)), e, imgs)
        assert torch.allclose(got, want, rtol=1e-4, atol=0)   # logits of random weights are ~1e-10: no atol
        outs[eid] = got
    assert not torch.allclose(outs["cls-r0402"], outs["cls-c0402"], rtol=1e-2, atol=0)
    assert sk.builds == 1 and sk.rebinds == 2                      # one skeleton, switched twice


def test_unbind_releases_evicted_weights(tiny_zoo):
    store = ExpertStore(tiny_zoo)
    sk = Skeletons("cpu")
    flat = store.read_flat("cls-r0402")
    sk.bind(MODEL.experts["cls-r0402"], flat)
    ref = weakref.ref(flat)
    del flat
    gc.collect()
    assert ref() is not None                                        # the module still points into it
    sk.unbind(ref())
    gc.collect()
    assert ref() is None


def test_device_tier_loads_through_the_shared_host_tier(tiny_zoo):
    store = ExpertStore(tiny_zoo)
    host = Pool("host", 64 * 2**20, make_policy("lru"), StoreSource(store))
    dev1 = Pool("dev1", 20 * 2**20, make_policy("lru"), TierSource(host, "cpu"))
    dev2 = Pool("dev2", 20 * 2**20, make_policy("lru"), TierSource(host, "cpu"))
    for pool in (dev1, dev2):
        pool.release(pool.acquire("det-2term"))
    assert host.stats().misses == 1 and host.stats().hits == 1    # one SSD read served both device pools
    a, b = dev1.acquire("det-2term"), dev2.acquire("det-2term")
    assert a.value.buffer.data_ptr() != b.value.buffer.data_ptr()  # each device tier owns its copy
    assert torch.equal(a.value.buffer, b.value.buffer)
    # unified memory: the device tier reads straight from SSD and nothing stays in a host tier
    uni = Pool("uni", 20 * 2**20, make_policy("lru"), TierSource(StoreSource(store), "cpu"))
    uni.release(uni.acquire("cls-r0402"))
    assert "cls-r0402" in uni.resident() and "cls-r0402" not in host.resident()


def test_prefetcher_loads_the_hinted_expert(tiny_zoo):
    pool = Pool("cpu", 40 * 2**20, make_policy("lru"), StoreSource(ExpertStore(tiny_zoo)))
    pf = Prefetcher(pool, "t")
    try:
        pf.hint("det-ic")
        assert pf.idle(10)
        assert "det-ic" in pool.resident() and pf.loaded == 1
        h = pool.acquire("det-ic")                                  # the executor then hits
        assert pool.stats().hits == 1
        pool.release(h)
    finally:
        pf.close()


class _Watched:
    """An in-memory source that notes, as each load begins, what the pool holds and what the executor's
    prefetcher says is still coming."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes, self.order, self.seen = sizes, [], {}
        self.pool = self.executor = None

    def size(self, eid: str) -> int:
        return self.sizes[eid]

    def load(self, eid: str) -> bytearray:
        self.order.append(eid)
        coming = self.executor.prefetch_remaining("b") if self.executor is not None else 0.0
        self.seen[eid] = (sorted(self.pool.resident()), self.pool.present("b"), coming)
        return bytearray(self.sizes[eid])


class _Next:
    """The executor's view of a scheduler: 'b' is queued next; every switch costs 1 s, 0.5 s of it reading the
    SSD; the reads it is told of are noted."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    class costs:
        @staticmethod
        def switch_cost(executor: str, expert_id: str) -> float:
            return 1.0

        @staticmethod
        def ssd_seconds(executor: str, expert_id: str) -> float:
            return 0.5

    def next_expert(self, executor: str, current: str) -> str | None:
        return "b"

    def channel(self, executor: str) -> str:
        return ""

    def plan_read(self, seconds: float, channel: str = ""):
        sched = self

        class Read:
            def start(self):
                sched.reads.append(f"start {seconds}")

            def end(self):
                sched.reads.append("end")
        sched.reads.append(f"plan {seconds}")
        return Read()


def test_the_executor_plans_its_prefetch_when_it_takes_a_batch_and_reads_it_after_its_own_load():
    """The next group's expert is reserved before the batch's own load runs (the pool and the scheduler's
    `arriving` see it coming: 1 s for the batch's load + 1 s for its own), and read only after it."""
    from executors.executor import Executor

    src = _Watched({"a": 30, "b": 30, "c": 30})
    pool = src.pool = Pool("cpu", 100, make_policy("lru"), src)
    pool.release(pool.acquire("c"))
    ex = src.executor = Executor("cpu#0", "cpu", pool, _Next(), model=None, on_result=lambda r: None)
    ex.prefetcher.close()
    ex.prefetcher = Prefetcher(pool, "cpu#0", clock=lambda: 100.0)   # a still clock: no wall time in the figure
    try:
        handle = ex._acquire("a")
        assert ex.prefetcher.idle(10)
        pool.release(handle)
        assert src.order == ["c", "a", "b"]                 # its own load first, then the prefetch's read
        # its SSD read counted in the scheduler's backlog from the plan, started with the read, ended after it
        assert ex.scheduler.reads[:3] == ["plan 0.5", "start 0.5", "end"]
        resident, b_present, coming = src.seen["a"]
        assert b_present and "b" not in resident            # reserved, not yet read, while 'a' loaded
        assert coming == 2.0
        assert sorted(pool.resident()) == ["a", "b", "c"] and ex.prefetcher.loaded == 1
        assert ex.prefetch_remaining("b") == 0.0            # in: nothing left to wait for
    finally:
        ex.prefetcher.close()


def test_when_the_batchs_own_load_fails_its_room_is_given_back_and_the_planned_prefetch_still_reads():
    """The own load raises (a corrupt file): the error reaches the batch, no entry stays 'loading' (a later
    acquire of that expert would hang on it), and the next group's prefetch, planned before, is read."""
    from executors.executor import Executor

    class Broken(_Watched):
        def load(self, eid):
            if eid == "a":
                raise OSError("a.safetensors: checksum mismatch")
            return super().load(eid)

    src = Broken({"a": 30, "b": 30})
    pool = src.pool = Pool("cpu", 100, make_policy("lru"), src)
    ex = src.executor = Executor("cpu#0", "cpu", pool, _Next(), model=None, on_result=lambda r: None)
    try:
        with pytest.raises(OSError, match="checksum mismatch"):
            ex._acquire("a")
        assert not pool.present("a")                        # no half entry: a later acquire does not hang
        assert ex.prefetcher.idle(10) and src.order == ["b"] and pool.resident() == ["b"]
        assert ex.scheduler.reads == ["plan 0.5", "start 0.5", "end"]
    finally:
        ex.prefetcher.close()


def test_a_prefetch_plans_victims_move_down_on_its_thread_before_its_read():
    """The victims of a planned prefetch are reported by the prefetch thread as soon as it is free (a GPU
    victim's copy into the host tier runs there), not only when the read starts after `go`."""
    events = []
    src = _Watched({"a": 50, "b": 50, "c": 50})
    pool = src.pool = Pool("cpu", 100, make_policy("lru"), src, on_event=events.append)
    pf = Prefetcher(pool, "t")
    try:
        pool.release(pool.acquire("a"))
        pool.release(pool.acquire("b"))
        assert not pf.plan("a")                                     # resident: nothing to plan
        assert pf.plan("c")
        assert pf.idle(10)                                          # no go yet: only the report ran
        assert [e.expert_id for e in events if e.event == "evict"] == ["a"]
        assert src.order == ["a", "b"] and pool.present("c") and not pool.contains("c")
        pf.go()
        assert pf.idle(10) and src.order == ["a", "b", "c"]
        assert [e.expert_id for e in events if e.event == "evict"] == ["a"]   # reported once
    finally:
        pf.close()


def test_a_newer_prefetch_plan_drops_one_not_yet_read_and_gives_its_room_back():
    src = _Watched({"a": 40, "b": 40, "c": 40})
    pool = src.pool = Pool("cpu", 100, make_policy("lru"), src)
    pf = Prefetcher(pool, "t")
    try:
        assert pf.plan("a", 1.0) and pool.present("a") and not pool.contains("a") and pf.remaining("a") > 0
        assert pf.plan("b", 1.0)                             # 'a' never read: dropped, its room free again
        assert not pool.present("a") and pool.present("b") and pf.dropped == 1 and pf.remaining("a") == 0.0
        pf.go()
        assert pf.idle(10) and src.order == ["b"] and pool.resident() == ["b"]
        assert not pf.plan("b")                              # already in: nothing to plan
        assert pf.plan("c") and pool.present("c")
    finally:
        pf.close()
    assert not pool.present("c") and src.order == ["b"]     # closing drops the plan not yet read
    assert not pf.plan("a") and not pool.present("a")       # closed: nothing is reserved that no one would read


def test_released_prefetch_plans_are_read_in_order_though_the_thread_is_busy():
    """Two plans released while the prefetch thread is still reading: both are read, in order (their room
    and victims are taken already; the simulator reads every plan too)."""
    import threading

    gate, reading = threading.Event(), threading.Event()

    class Slow(_Watched):
        def load(self, eid):
            if eid == "a":
                reading.set()
                gate.wait(10)
            return super().load(eid)

    src = Slow({"a": 20, "b": 20, "c": 20})
    pool = src.pool = Pool("cpu", 100, make_policy("lru"), src)
    pf = Prefetcher(pool, "t")
    try:
        pf.hint("a")
        assert reading.wait(10)                               # the thread is in a's read
        assert pf.plan("b")
        pf.go()
        assert pf.plan("c")
        pf.go()
        gate.set()
        assert pf.idle(10) and src.order == ["a", "b", "c"] and pf.loaded == 3 and pf.dropped == 0
    finally:
        gate.set()
        pf.close()


def test_corrupt_expert_gives_error_verdicts_and_the_rest_is_served(tmp_path, tiny_zoo, tiny_recording):
    from conftest import write_line
    store, path = corrupt_copy(tiny_zoo, tmp_path, "flip")
    cfg = load_config(write_line(tmp_path / "line", store=store.root), env={})
    rec = Recording(tiny_recording)
    agent = Agent(cfg).start()
    try:
        assert replay(rec, agent.endpoints["ingest"]).accepted == len(rec)
        assert agent.wait_verdicts(len(rec), timeout=120)
    finally:
        agent.stop()
    con = sqlite3.connect(cfg.db_path)
    rows = con.execute("SELECT f.component, v.verdict, v.reason FROM verdicts v JOIN frames f USING (frame_id)"
                       ).fetchall()
    errors = con.execute("SELECT count(*) FROM errors WHERE kind='expert_load'").fetchone()[0]
    con.close()
    bad = [r for r in rows if r[0] == "C0402"]
    good = [r for r in rows if r[0] != "C0402"]
    assert bad and good and len(rows) == len(rec)
    assert all(v == "error" and "cls-c0402" in reason and str(path) in reason and "sha256" in reason
               for _, v, reason in bad)
    assert all(v in ("pass", "defect") for _, v, _ in good)
    assert errors == len(bad)
    assert "cls-c0402" in agent.failed.all()


def test_a_cpu_pool_copies_what_the_host_tier_holds_instead_of_reading_the_ssd(tiny_zoo, monkeypatch):
    from storage.tiers import HostReadSource

    store = ExpertStore(tiny_zoo)
    host = Pool("host", 64 * 2**20, make_policy("lru"), StoreSource(store))
    host.release(host.acquire("det-2term"))
    src = HostReadSource(host, StoreSource(store))
    cpu = Pool("cpu", 40 * 2**20, make_policy("lru"), src)
    reads = []
    real = store.read_flat
    monkeypatch.setattr(store, "read_flat", lambda eid, **kw: reads.append(eid) or real(eid, **kw))
    a = cpu.acquire("det-2term")
    assert reads == [] and (src.from_host, src.from_ssd) == (1, 0)           # no SSD read: a RAM copy
    b = host.acquire("det-2term")
    assert torch.equal(a.value.buffer, b.value.buffer) and a.value.buffer.data_ptr() != b.value.buffer.data_ptr()
    assert not a.value.buffer.is_pinned() and a.value.version == b.value.version
    assert "det-2term" in host.resident()                                   # the host tier keeps its copy
    cpu.release(a), host.release(b)
    cpu.release(cpu.acquire("cls-r0402"))                                   # not in the host tier: the SSD
    assert reads == ["cls-r0402"] and src.from_ssd == 1 and "cls-r0402" not in host.resident()
    # a CPU executor computing in another dtype than the host tier holds reads the SSD, cast as it loads
    half = HostReadSource(host, StoreSource(store, dtype="float16"))
    assert not half.compatible("det-2term")
    value = half.load("det-2term")
    assert half.from_ssd == 1 and reads[-1] == "det-2term"
    assert {t.dtype for t in value.tensors().values() if t.is_floating_point()} == {torch.float16}


def test_a_cpu_pool_never_copies_a_stale_or_other_dtype_host_copy(tmp_path):
    """Between a promotion's store switch and the eviction of the replaced copies, the host tier may still
    hold v1 (stored fp16); a CPU executor computing fp32 must read v2 from the SSD, not copy v1 (review)."""
    from coe import Expert
    from storage.tiers import HostReadSource, source_dtype

    store = ExpertStore(tmp_path)
    e = Expert("x", "mlp", "classifier", ("ok", "defect"), 8)
    store.write(e, {"w": torch.ones(64, 64, dtype=torch.float16)}, version=1)
    host = Pool("host", 1 << 24, make_policy("lru"), StoreSource(store, dtype=source_dtype("stored")))
    host.release(host.acquire("x"))
    store.write(e, {"w": torch.full((64, 64), 2.0)}, version=2)          # promoted in fp32
    store.reload()
    src = HostReadSource(host, StoreSource(store, dtype="float32"))
    assert src.compatible("x")                                           # by the manifest's dtype, yes...
    value = Pool("cpu", 1 << 24, make_policy("lru"), src).acquire("x").value
    assert (src.from_host, src.from_ssd) == (0, 1)                       # ...but the held copy is v1: the SSD
    assert value.version == 2 and value.tensors()["w"].dtype == torch.float32
    assert float(value.tensors()["w"][0, 0]) == 2.0 and value.nbytes == src.size("x")


def test_present_above_counts_the_queued_and_what_the_pools_above_hold():
    """The host tier's policy sees an expert as present when some executor has it queued or a GPU pool holds it."""
    from storage.policies import make_policy
    from storage.pool import Pool, present_above

    from conftest import SizedSource

    gpu = Pool("cuda", 20, make_policy("lru"), SizedSource({"cls-a": 10, "det-x": 10}), name="gpu")
    gpu.release(gpu.acquire("cls-a"))
    assert present_above([{"det-x"}, set()], [gpu]) == {"cls-a", "det-x"}
    assert present_above([], [gpu]) == {"cls-a"}
    assert present_above([{"det-x"}], []) == {"det-x"}


def test_a_demotion_copies_on_its_threads_one_side_stream_not_a_new_stream_each_time(monkeypatch):
    """host_copy used to make a CUDA stream per demotion.  On this CPU box torch.cuda.Stream is played by a
    recorder (a test double for the GPU only): one stream per thread and device, made once."""
    import threading

    import torch

    from storage import tiers

    made = []

    class Recorder:
        def __init__(self, device):
            made.append((threading.get_ident(), device))

    monkeypatch.setattr(torch.cuda, "Stream", Recorder)
    monkeypatch.setattr(tiers, "_streams", threading.local())
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    s1, s2, s3 = tiers._side_stream(a), tiers._side_stream(a), tiers._side_stream(b)
    assert s1 is s2 and s3 is not s1 and len(made) == 2
    other = []
    t = threading.Thread(target=lambda: other.append(tiers._side_stream(a)))
    t.start()
    t.join()
    assert other[0] is not s1 and len(made) == 3


def test_a_host_copy_whose_check_fails_is_not_left_pinned(tiny_zoo, monkeypatch):
    """The check that the host tier's copy is current reads the store; when that read raises (a store switched
    under it), the load fails, and the copy it held is released: evictable, not pinned for good."""
    from coe import ExpertLoadError
    from storage.tiers import HostReadSource

    store = ExpertStore(tiny_zoo)
    host = Pool("host", 64 * 2**20, make_policy("lru"), StoreSource(store))
    host.release(host.acquire("det-2term"))
    src = HostReadSource(host, StoreSource(store))
    cpu = Pool("cpu", 40 * 2**20, make_policy("lru"), src)

    def gone(eid, value):          # the check, reading a store switched under it
        raise ExpertLoadError(eid, "<store>", "not in the manifest any more")
    monkeypatch.setattr(src, "_current", gone)
    with pytest.raises(ExpertLoadError, match="not in the manifest any more"):
        cpu.acquire("det-2term")
    assert host.evict("det-2term") is True                  # a pinned copy would raise here


def test_a_batch_whose_expert_never_finds_room_fails_after_the_wait_instead_of_spinning(monkeypatch):
    """Every byte of the pool pinned by a holder that never lets go (a leaked pin): the batch's acquire gives up
    after ROOM_WAIT_S with an error naming the executor, the expert and the pool, which the batch turns into
    error verdicts; before, the executor thread retried forever and its frames never got one."""
    from executors import executor as executor_mod
    from executors.executor import Executor

    monkeypatch.setattr(executor_mod, "ROOM_WAIT_S", 0.2)
    src = _Watched({"a": 60, "b": 60})
    pool = src.pool = Pool("cpu", 100, make_policy("lru"), src)
    held = pool.acquire("b")                                 # never released
    ex = src.executor = Executor("cpu#0", "cpu", pool, _Next(), model=None, on_result=lambda r: None)
    try:
        with pytest.raises(CoEError, match=r"cpu#0: no room for expert a in its pool of 0 MB: pinned experts "
                                           r"held it for 0 s"):
            ex._acquire("a")
        assert not pool.present("a") and pool.resident() == ["b"]
    finally:
        ex.prefetcher.close()
        pool.release(held)


def test_a_copy_a_promotion_made_stale_never_enters_the_host_tier_nor_leaves_it(tmp_path):
    """An eviction reported after a promotion switched the store (a late report, `Pool.report_victims`): its
    version-1 copy is not demoted, since the store watcher has already dropped the stale copies and would not
    look again.  And a version-1 copy already in the exclusive host tier is not promoted: it is dropped there and
    version 2 read from the SSD."""
    from storage.tiers import TierSource, current_in, demote

    store = ExpertStore(tmp_path)
    e = Expert("x", "mlp", "classifier", ("ok", "defect"), 8)
    store.write(e, {"w": torch.ones(64, 64)}, version=1)
    host = Pool("host", 1 << 24, make_policy("lru"), StoreSource(store))
    device = Pool("cpu", 1 << 24, make_policy("lru"), TierSource(host, "cpu", exclusive=True))
    device.release(device.acquire("x"))                     # version 1, promoted out of the host tier
    evicted = []
    device._on_event = evicted.append
    store.write(e, {"w": torch.full((64, 64), 2.0)}, version=2)
    store.reload()
    assert device.evict("x")
    (ev,) = [v for v in evicted if v.event == "evict"]
    assert demote(ev, host, current=current_in(store)) is False and "x" not in host.resident()
    assert demote(ev, host) is True and "x" in host.resident()     # the control: without the check it enters
    got = device.acquire("x")                                # the stale copy the control let in is not used
    assert got.value.version == 2 and float(got.value.tensors()["w"][0, 0]) == 2.0
    assert "x" not in host.resident()
    device.release(got)


def test_a_failed_page_cache_drop_after_a_good_read_does_not_fail_the_load(tiny_zoo, monkeypatch):
    """`drop_after_read` is advice to the kernel: a file a promotion retired between the read and the drop made
    the drop raise, and a load whose bytes were good failed."""
    import storage.pagecache as pagecache
    from storage.tiers import StoreSource

    def gone(path):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(pagecache, "drop_from_page_cache", gone)
    src = StoreSource(ExpertStore(tiny_zoo), drop_after_read=True)
    flat = src.load("cls-r0402")
    assert flat.nbytes == src.size("cls-r0402") and src.bytes_read == flat.nbytes


def test_a_miss_reads_the_experts_size_outside_the_pool_lock(tiny_zoo):
    """A first read of an expert's size reads its file's header: under the pool's lock it stalled every other
    executor (and, through the scheduler's calls into pools, ingest) behind an SSD read."""
    from storage.tiers import StoreSource

    class Watched(StoreSource):
        def size(self, expert_id):
            locked.append(pool._cond._is_owned())
            return super().size(expert_id)

    locked: list[bool] = []
    pool = Pool("cpu", 10**9, make_policy("lru"), Watched(ExpertStore(tiny_zoo)))
    pool.release(pool.acquire("cls-r0402"))
    assert locked and not any(locked)
