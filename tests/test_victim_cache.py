"""The exclusive host tier (issue 9, item 5): a victim cache of the GPU pools.

GPU victims move down into it, promoted experts leave it, and at start it holds
the next most probable experts after the GPU pools'.  The "GPU" here is a
'cpu' TierSource, so every test runs without CUDA through the same code; the
agent test swaps the device to 'cpu' the same way.
"""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import storage.tiers as tiers
from coe import Expert
from coe.probabilities import ranked
from storage.expert_store import ExpertStore
from storage.policies import make_policy
from storage.pool import Pool, initialize, initialize_tier
from storage.tiers import StoreSource, TierSource, demote

SMALL, LARGE = 4096, 8192
SIZES = {**{e: SMALL for e in "abcdef"}, **{e: LARGE for e in "XY"}}
FILL = {e: float(i + 1) for i, e in enumerate(SIZES)}    # each expert's bytes are recognisably its own


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ExpertStore:
    s = ExpertStore(tmp_path_factory.mktemp("victims"))
    for eid, n in SIZES.items():
        s.write(Expert(eid, "torchvision/none", "classifier", ("a",), 32), {"w": torch.full((n // 4,), FILL[eid])})
    return s


class CountingSource(StoreSource):
    """The SSD tier, recording every read."""

    def __init__(self, store) -> None:
        super().__init__(store)
        self.reads: list[str] = []

    def load(self, expert_id, reuse=None):
        self.reads.append(expert_id)
        return super().load(expert_id, reuse)


class Tiers:
    """SSD -> host tier -> one or more 'GPU' pools, wired as the agent wires them."""

    def __init__(self, store, *, gpu_bytes: int, host_bytes: int, exclusive: bool = True, gpus: int = 1,
                 policy: str = "lru") -> None:
        self.exclusive = exclusive
        self.ssd = CountingSource(store)
        self.host = Pool("host", host_bytes, make_policy(policy), self.ssd)
        self.sources = [TierSource(self.host, "cpu", exclusive=exclusive) for _ in range(gpus)]
        self.demoted: list[tuple[str, bool]] = []
        self.gpus = [Pool(f"gpu{i}", gpu_bytes, make_policy(policy), src, name=f"gpu{i}", on_event=self._on_event)
                     for i, src in enumerate(self.sources)]

    def _on_event(self, e) -> None:
        if e.event == "evict" and self.exclusive:
            self.demoted.append((e.expert_id, demote(e, self.host)))

    @property
    def gpu(self) -> Pool:
        return self.gpus[0]

    def use(self, expert_id: str, gpu: int = 0):
        pool = self.gpus[gpu]
        h = pool.acquire(expert_id)
        assert h is not None
        assert torch.all(h.value.buffer.view(torch.float32) == FILL[expert_id])   # its own bytes, whatever buffer
        pool.release(h)
        return h.value


def held_value(pool: Pool, expert_id: str):
    h = pool.hold(expert_id)
    assert h is not None, f"{expert_id} is not resident in {pool.name}"
    pool.release(h)
    return h.value


def test_gpu_victim_moves_down_and_is_served_from_host_next_time(store):
    t = Tiers(store, gpu_bytes=2 * SMALL, host_bytes=2 * SMALL)
    t.use("a")
    t.use("b")
    assert t.ssd.reads == ["a", "b"] and t.host.resident() == []      # a miss is staged, not kept in the host
    t.use("c")                                                          # evicts a (LRU): a moves down
    assert t.demoted == [("a", True)] and t.host.resident() == ["a"]
    assert torch.equal(held_value(t.host, "a").buffer, store.read_flat("a").buffer)
    assert t.host.stats().admits == 1 and t.host.stats().misses == 0
    t.use("a")                                                          # a host load, not an SSD load
    assert t.ssd.reads == ["a", "b", "c"]
    assert t.sources[0].promoted == 1 and t.sources[0].staged == 3
    assert "a" not in t.host.resident() and "a" in t.gpu.resident()   # promoted: it left the host tier
    assert t.host.resident() == ["b"]                                   # and b, the new victim, moved down


def test_a_victim_read_back_in_before_its_late_report_is_not_copied_down_too(store):
    """A prefetch's victims may be reported late (`Pool.report_victims`, on the prefetch thread, after a read
    under way).  If the executor has read the victim back in meanwhile, demoting it would hold it in both
    tiers: `demote(held=pool.present)` skips it, as the agent and the real runner call it."""
    from concurrent.futures import Future

    class Guarded(Tiers):
        def _on_event(self, e) -> None:
            if e.event == "evict":
                self.demoted.append((e.expert_id, demote(e, self.host, held=self.gpu.present)))

    t = Guarded(store, gpu_bytes=2 * SMALL, host_bytes=2 * SMALL)
    gpu, moved = t.gpu, t.demoted
    t.use("a")
    t.use("b")
    plan = gpu.acquire_async("c", lambda load: Future())        # a prefetch's reservation: 'a' is its victim
    assert not gpu.present("a") and moved == []
    t.use("a")                                                    # the executor reads 'a' back (evicts 'b')
    gpu.report_victims("c", plan)                                 # the late report of 'a'
    assert ("a", False) in moved and "a" not in t.host.resident() and gpu.present("a")
    assert ("b", True) in moved and t.host.resident() == ["b"]    # an ordinary victim still moves down
    plan.cancel()


def test_moving_a_victim_down_never_pushes_out_the_expert_coming_up(store):
    t = Tiers(store, gpu_bytes=LARGE + 2 * SMALL, host_bytes=LARGE + SMALL)
    t.use("X")
    t.use("Y")                                                          # X moves down
    t.use("a")
    t.use("X")                                                          # Y must go; X comes up from the host
    # Y only fits the host by evicting X, which the GPU pool is about to take: Y is dropped instead
    assert t.demoted == [("X", True), ("Y", False)]
    assert t.ssd.reads == ["X", "Y", "a"] and t.sources[0].promoted == 1
    assert t.host.resident() == [] and sorted(t.gpu.resident()) == ["X", "a"]


def test_promotion_removes_the_host_copy_unless_someone_still_holds_it(store):
    t = Tiers(store, gpu_bytes=2 * SMALL, host_bytes=4 * SMALL)
    for e in "ab":
        t.host.release(t.host.acquire(e))                              # as initialisation fills it
    t.use("a")
    assert "a" not in t.host.resident() and t.sources[0].promoted == 1 and t.ssd.reads == ["a", "b"]
    pinned = t.host.acquire("b")                                        # another tier is still copying b
    t.use("b")
    assert "b" in t.host.resident()                                     # so the host copy stays
    t.host.release(pinned)


def test_inclusive_tier_keeps_a_copy_of_every_gpu_load(store):
    t = Tiers(store, gpu_bytes=2 * SMALL, host_bytes=4 * SMALL, exclusive=False)
    for e in "abc":
        t.use(e)
    assert sorted(t.host.resident()) == ["a", "b", "c"] and t.demoted == []
    assert set(t.gpu.resident()) < set(t.host.resident())               # the duplicates item 5 is about


def test_demotion_refills_an_evicted_host_buffer_of_the_same_size(store):
    t = Tiers(store, gpu_bytes=SMALL, host_bytes=2 * SMALL)
    for e in "de":
        t.host.release(t.host.acquire(e))
    d_buffer = held_value(t.host, "d").buffer
    t.host.release(t.host.hold("e"))                                    # d is now the host's LRU victim
    t.use("a")
    t.use("b")                                                          # a moves down, evicting d
    assert sorted(t.host.resident()) == ["a", "e"]
    a_host = held_value(t.host, "a")
    assert a_host.buffer.data_ptr() == d_buffer.data_ptr()              # into d's old buffer, not a new one
    assert torch.all(a_host.buffer.view(torch.float32) == FILL["a"])


def test_a_victim_the_host_cannot_take_is_dropped_and_the_gpu_load_goes_on(store):
    t = Tiers(store, gpu_bytes=SMALL, host_bytes=SMALL)
    t.host.release(t.host.acquire("d"))
    held = t.host.acquire("d")                                          # the host's only room is pinned
    t.use("a")
    t.use("b")
    assert t.demoted == [("a", False)] and t.host.resident() == ["d"] and t.gpu.resident() == ["b"]
    t.host.release(held)


def test_a_failed_demotion_copy_leaves_no_half_entry_and_the_gpu_load_goes_on(store, monkeypatch, caplog):
    t = Tiers(store, gpu_bytes=SMALL, host_bytes=2 * SMALL)

    def no_memory(*a, **k):
        raise RuntimeError("cudaHostAlloc failed")

    t.use("a")
    monkeypatch.setattr(tiers, "host_copy", no_memory)
    with caplog.at_level(logging.WARNING, logger="storage.tiers"):
        t.use("b")
    assert t.demoted == [("a", False)] and "could not demote 'a'" in caplog.text
    assert t.host.resident() == [] and t.host.used_bytes() == 0 and t.host.stats().admits == 0
    assert t.gpu.resident() == ["b"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=st.lists(st.tuples(st.sampled_from(sorted(SIZES)), st.booleans()), min_size=1, max_size=40),
       policy=st.sampled_from(["lru", "coserve", "fifo"]))
def test_host_never_exceeds_capacity_and_the_tiers_stay_exclusive(store, trace, policy):
    t = Tiers(store, gpu_bytes=LARGE + 2 * SMALL, host_bytes=LARGE + SMALL, policy=policy)
    held = None
    for eid, keep in trace:
        from_host = eid in t.host.resident() and eid not in t.gpu.resident()
        reads = len(t.ssd.reads)
        h = t.gpu.acquire(eid)
        if h is None:                                                   # only the held expert can block
            assert held is not None
            continue
        if from_host:
            assert len(t.ssd.reads) == reads                            # a victim comes back without an SSD read
        assert torch.all(h.value.buffer.view(torch.float32) == FILL[eid])
        if keep and held is None:
            held = h
        else:
            t.gpu.release(h)
        assert t.host.used_bytes() <= t.host.capacity and t.gpu.used_bytes() <= t.gpu.capacity
        assert not set(t.host.resident()) & set(t.gpu.resident())
        for e in t.host.resident():                                     # a demoted copy is the expert's own bytes
            assert torch.all(held_value(t.host, e).buffer.view(torch.float32) == FILL[e])


def test_exclusive_init_puts_no_expert_in_both_tiers(store):
    t = Tiers(store, gpu_bytes=2 * SMALL, host_bytes=2 * SMALL + LARGE, gpus=2)
    order = ["a", "b", "c", "d", "e", "X", "f", "Y"]                    # descending usage probability
    got = initialize(t.gpus, order)
    host_got = initialize_tier(t.host, t.gpus, order)
    assert got == {"gpu0": ["a", "c"], "gpu1": ["b", "d"]}               # round-robin by probability
    assert host_got == ["e", "X", "f"] and sorted(t.host.resident()) == ["X", "e", "f"]   # the next ones
    on_gpus = {e for p in t.gpus for e in p.resident()}
    assert not on_gpus & set(t.host.resident())
    assert t.ssd.reads == ["a", "b", "c", "d", "e", "X", "f"]            # each read once, none for both tiers


# -- CPU victims move down too (cpu_victims_to_host_tier) --------------------------------------------------

class CpuTiers:
    """SSD -> host tier, and a CPU pool reading through it (HostReadSource) whose victims move down into it."""

    def __init__(self, store, *, cpu_bytes: int, host_bytes: int, demote: bool = True, cpu_dtype="uniform") -> None:
        self.host_ssd, self.cpu_ssd = CountingSource(store), CountingSource(store)
        self.cpu_ssd.dtype = cpu_dtype
        self.host = Pool("host", host_bytes, make_policy("lru"), self.host_ssd)
        self.reader = tiers.HostReadSource(self.host, self.cpu_ssd)
        self.demote = demote
        self.demoted: list[tuple[str, bool]] = []
        self.cpu = Pool("cpu", cpu_bytes, make_policy("lru"), self.reader, name="cpu", on_event=self._on_event)

    def _on_event(self, e) -> None:
        if e.event == "evict" and self.demote:
            self.demoted.append((e.expert_id, self.reader.demote(e)))

    def use(self, expert_id: str):
        h = self.cpu.acquire(expert_id)
        assert h is not None
        assert torch.all(h.value.buffer.view(torch.float32) == FILL[expert_id])
        self.cpu.release(h)
        return h.value


def test_a_cpu_victim_moves_down_and_its_next_cpu_load_is_a_host_copy(store):
    t = CpuTiers(store, cpu_bytes=SMALL, host_bytes=2 * SMALL)
    t.use("a")
    t.use("b")                                                          # evicts a: it moves down
    assert t.demoted == [("a", True)] and t.host.resident() == ["a"] and t.reader.demoted == 1
    assert t.host.stats().admits == 1 and t.host.stats().misses == 0 and t.host_ssd.reads == []
    a_host = held_value(t.host, "a")
    assert torch.equal(a_host.buffer, store.read_flat("a").buffer) and a_host.version == store.entry("a").version
    assert not a_host.buffer.is_pinned()                                # the host tier's reads do not pin here
    assert t.cpu_ssd.reads == ["a", "b"]
    t.use("a")                                                          # a host copy, not an SSD read
    assert t.cpu_ssd.reads == ["a", "b"] and (t.reader.from_host, t.reader.from_ssd) == (1, 2)
    assert "a" in t.host.resident() and sorted(t.host.resident()) == ["a", "b"]   # kept; b moved down too
    # without the lever the victim is dropped and re-read from the SSD
    off = CpuTiers(store, cpu_bytes=SMALL, host_bytes=2 * SMALL, demote=False)
    for e in "aba":
        off.use(e)
    assert off.host.resident() == [] and off.cpu_ssd.reads == ["a", "b", "a"] and off.reader.from_host == 0


@pytest.mark.parametrize("ranked", [True, False])
def test_a_ranked_cpu_victim_enters_the_full_host_tier_only_above_what_it_pushes_out(store, ranked):
    """HostReadSource.demote(ranked=True), the agent's CPU-victim path under host_tier_admission: ranked.  The
    host tier (room for one) holds a (p 0.1); the CPU pool (room for one) runs b, c, a: b's eviction (p 0.5)
    outranks a and moves down, c's (p 0.4) does not outrank b and is dropped.  Unranked, both move down."""
    probs = {"a": 0.1, "b": 0.5, "c": 0.4}
    host_ssd, cpu_ssd = CountingSource(store), CountingSource(store)
    host = Pool("host", SMALL, make_policy("coserve"), host_ssd, probabilities=probs)
    host.release(host.acquire("a"))
    reader = tiers.HostReadSource(host, cpu_ssd)
    moved: list[tuple[str, bool]] = []
    cpu = Pool("cpu", SMALL, make_policy("coserve"), reader, name="cpu", probabilities=probs,
               on_event=lambda e: moved.append((e.expert_id, reader.demote(e, ranked=ranked)))
               if e.event == "evict" else None)
    for e in "bca":
        cpu.release(cpu.acquire(e))
    if ranked:
        assert moved == [("b", True), ("c", False)] and host.resident() == ["b"]
        assert host.stats().declined == 1 and reader.demoted == 1
    else:
        assert moved == [("b", True), ("c", True)] and host.resident() == ["c"]
        assert host.stats().declined == 0 and reader.demoted == 2
    assert cpu_ssd.reads == ["b", "c", "a"]                             # a had left the host tier for b


def test_a_cpu_victim_is_pinned_when_the_host_tier_pins(store, monkeypatch):
    t = CpuTiers(store, cpu_bytes=SMALL, host_bytes=2 * SMALL)
    t.host_ssd.pin = True
    seen = []
    real = tiers.host_copy
    monkeypatch.setattr(tiers, "host_copy",
                        lambda src, reuse, *, pin, **kw: seen.append(pin) or real(src, reuse, pin=False, **kw))
    t.use("a")
    t.use("b")
    assert seen == [True] and t.host.resident() == ["a"]


def test_a_stale_or_other_dtype_cpu_victim_is_never_demoted(store, tmp_path):
    # a promotion's replaced copy (its evict event is stale) is dropped, not kept in the host tier
    t = CpuTiers(store, cpu_bytes=2 * SMALL, host_bytes=2 * SMALL)
    t.use("a")
    assert t.cpu.discard("a", when_free=True)
    assert t.demoted == [("a", False)] and t.host.resident() == [] and t.host.stats().admits == 0
    # a CPU executor computing in another dtype than the host tier holds: its copy is not the host's bytes
    half = CpuTiers(store, cpu_bytes=SMALL // 2, host_bytes=4 * SMALL, cpu_dtype="float16")   # fp16: half the bytes
    half.cpu.release(half.cpu.acquire("a"))
    half.cpu.release(half.cpu.acquire("b"))
    assert half.demoted == [("a", False)] and half.host.resident() == []
    # the store's version changed since the CPU pool loaded it (a promotion not yet swept): dropped
    own = ExpertStore(tmp_path / "own")
    for eid in "ab":
        own.write(Expert(eid, "torchvision/none", "classifier", ("a",), 32), {"w": torch.full((SMALL // 4,), FILL[eid])})
    v = CpuTiers(own, cpu_bytes=SMALL, host_bytes=2 * SMALL)
    v.use("a")
    own.write(Expert("a", "torchvision/none", "classifier", ("a",), 32), {"w": torch.full((SMALL // 4,), 9.0)},
              version=2)
    own.reload()
    v.cpu.release(v.cpu.acquire("b"))                                   # evicts a's v1
    assert v.demoted == [("a", False)] and v.host.resident() == [] and v.host.stats().admits == 0
    h = v.cpu.acquire("a")                                               # so the next load reads v2 from the SSD
    assert h.value.version == 2 and float(h.value.buffer.view(torch.float32)[0]) == 9.0
    assert v.reader.from_host == 0


def test_a_cpu_victim_never_pushes_out_the_expert_the_cpu_pool_is_loading(store):
    t = CpuTiers(store, cpu_bytes=SMALL, host_bytes=SMALL)
    t.host.release(t.host.acquire("b"))                                 # the host holds b, the CPU pool a
    t.use("a")
    t.use("b")                                                          # a only fits by evicting b, coming up
    assert t.demoted == [("a", False)] and t.host.resident() == ["b"]
    assert t.reader.from_host == 1 and t.cpu_ssd.reads == ["a"]         # b was still copied from the host tier


# -- the agent's wiring, with the GPU swapped for 'cpu' -------------------------------------------------

class _Writer:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def put_event(self, row: dict) -> None:
        self.events.append(row)


@pytest.fixture
def cpu_gpu_agent(tmp_path, tiny_zoo, monkeypatch):
    """An agent configured with one cuda:0 executor whose device memory is really host memory."""
    import shutil

    import edge_agent.agent as agent_mod
    from conftest import write_line
    from edge_agent.config import load_config

    class CpuTier(TierSource):
        def __init__(self, parent, device, **kw):
            super().__init__(parent, "cpu", **kw)

    class Unpinned(StoreSource):
        def __init__(self, store, **kw):
            super().__init__(store, **{**kw, "pin": False})

    monkeypatch.setattr(agent_mod, "TierSource", CpuTier)
    monkeypatch.setattr(agent_mod, "StoreSource", Unpinned)
    monkeypatch.setattr(agent_mod, "_check_cuda", lambda device, key: None)   # the double stands in for the GPU

    made = []

    def make(mode: str, cpu_tier: str, executors: list | None = None, tag: str = "", **extra):
        store = tmp_path / f"experts-{mode}{tag}"
        shutil.copytree(tiny_zoo, store)
        path = write_line(tmp_path / f"{mode}{tag}", store=store, cpu_tier=cpu_tier, cpu_tier_mode=mode,
                          executors=executors or [{"device": "cuda:0", "count": 1, "memory": "40MB",
                                                   "expert_memory": "30MB", "prefetch": False}], **extra)
        agent = agent_mod.Agent(load_config(path, env={}))
        agent.writer = _Writer()           # pool events are recorded without starting the writer thread
        made.append(agent)
        return agent

    yield make
    for a in made:
        a.stop()


def test_agent_initialises_the_host_tier_with_the_next_experts_and_demotes_gpu_victims(cpu_gpu_agent):
    # 30 MB of experts on the "GPU" hold the tiny line's 3 most probable (12 + 6 + 6 MB); the 20 MB host
    # tier the next two classifiers (6 + 6 MB)
    agent = cpu_gpu_agent("exclusive", "20MB")
    gpu, host = agent.pools["cuda:0-0.0"], agent.host_tier
    loaded = agent._initialize()
    probs = agent.probabilities
    order = ranked(agent.model.experts, probs)      # most probable first, ties by id: what CoServe keeps
    assert sorted(loaded["cuda:0-0.0"]) == sorted(order[:3])
    assert sorted(loaded["host"]) == sorted(order[3:5]) and sorted(host.resident()) == sorted(order[3:5])
    assert not set(gpu.resident()) & set(host.resident())

    missing = next(e for e in order if e not in gpu.resident() and e not in host.resident())
    gpu.release(gpu.acquire(missing))                                     # from SSD: evicts GPU victims
    victims = [r["expert_id"] for r in agent.writer.events if r["tier"] == "cuda:0" and r["event"] == "evict"]
    admitted = [r["expert_id"] for r in agent.writer.events if r["tier"] == "host" and r["event"] == "admit"]
    assert victims and admitted == victims                                # every victim moved down
    assert set(victims) <= set(host.resident()) and missing not in host.resident()
    assert host.used_bytes() <= host.capacity
    gpu.release(gpu.acquire(victims[0]))                                  # promoted back: leaves the host
    assert victims[0] in gpu.resident() and victims[0] not in host.resident()
    assert not set(gpu.resident()) & set(host.resident())


@pytest.mark.parametrize("admission", ["ranked", "all"])
def test_a_gpu_victim_enters_a_full_host_tier_only_if_it_outranks_what_it_pushes_out(cpu_gpu_agent, admission):
    """host_tier_admission: ranked (the default) declines a victim the policy ranks below every expert it would
    push out; 'all' takes every victim, as before."""
    agent = cpu_gpu_agent("exclusive", "12MB", tag=admission, host_tier_admission=admission)
    gpu, host = agent.pools["cuda:0-0.0"], agent.host_tier
    assert agent.ranked_admission is (admission == "ranked")
    agent._initialize()
    probs = agent.probabilities
    missing = [e for e in sorted(agent.model.experts, key=lambda e: -probs[e])
               if e not in gpu.resident() and e not in host.resident()]
    agent.writer.events.clear()
    for e in missing[:3]:                                               # each GPU load evicts a victim
        gpu.release(gpu.acquire(e))
    ev = agent.writer.events
    victims = [r["expert_id"] for r in ev if r["tier"] == "cuda:0" and r["event"] == "evict"]
    admitted = [r["expert_id"] for r in ev if r["tier"] == "host" and r["event"] == "admit"]
    pushed = [r["expert_id"] for r in ev if r["tier"] == "host" and r["event"] == "evict"]
    assert len(victims) >= 3 and host.used_bytes() <= host.capacity
    assert not set(gpu.resident()) & set(host.resident())
    if admission == "all":
        assert admitted == victims and host.stats().declined == 0
        assert min(probs[v] for v in admitted) < max(probs[p] for p in pushed)   # a worse one pushed a better out
        return
    declined = [v for v in victims if v not in admitted]
    assert declined and host.stats().declined == len(declined)
    exported = agent.metrics.registry.get_sample_value("coe_pool_declined_total",
                                                       {"line": agent.cfg.line, "pool": "host"})
    assert exported == len(declined)                                    # the operator sees it too
    assert admitted and pushed                                          # a better victim still moves down
    # what the tier holds all comes before every victim it turned away in the policy's own order (probability,
    # then the fixed order among equal ones): a version that admitted a tie it should lose fails here
    rank = {e: i for i, e in enumerate(ranked(agent.model.experts, probs))}
    assert max(rank[e] for e in host.resident()) < min(rank[v] for v in declined)


def test_agent_fills_its_pools_in_the_order_coserve_evicts_along_in_reverse(cpu_gpu_agent, monkeypatch):
    """Every expert at one probability: the agent hands the fill the experts by id (coe.probabilities.ranked),
    the order CoServe's eviction keeps, not the spec's order.  Under lru eviction the host tier takes every
    victim even with ranked admission on (the pool skips the test where recency is all it ranks by)."""
    import edge_agent.agent as agent_mod

    agent = cpu_gpu_agent("exclusive", "20MB", tag="fill")
    orders = []
    real = agent_mod.fill_pools
    monkeypatch.setattr(agent_mod, "fill_pools",
                        lambda pools, order, *a: orders.append(list(order)) or real(pools, order, *a))
    agent.probabilities = {e: 1.0 for e in agent.model.experts}
    assert list(agent.model.experts) != sorted(agent.model.experts)   # the spec's order differs from the ids'
    agent._initialize()
    assert orders and orders[0] == sorted(agent.model.experts)
    assert agent.ranked_admission
    lru = cpu_gpu_agent("exclusive", "12MB", tag="lru", eviction="lru")
    assert lru.ranked_admission
    lru._initialize()
    gpu, host = lru.pools["cuda:0-0.0"], lru.host_tier
    missing = [e for e in ranked(lru.model.experts, lru.probabilities)
               if e not in gpu.resident() and e not in host.resident()]
    lru.writer.events.clear()
    for e in missing[:3]:
        gpu.release(gpu.acquire(e))
    victims = [r["expert_id"] for r in lru.writer.events if r["tier"] == "cuda:0" and r["event"] == "evict"]
    admitted = [r["expert_id"] for r in lru.writer.events if r["tier"] == "host" and r["event"] == "admit"]
    fits = [v for v in victims if lru.store.nbytes(v) <= host.capacity]      # a 12 MB detector never fits
    assert fits and admitted == fits and host.stats().declined == 0          # frozen, it would admit none


def test_agent_inclusive_mode_keeps_the_paper_tier(cpu_gpu_agent):
    agent = cpu_gpu_agent("inclusive", "40MB")
    gpu, host = agent.pools["cuda:0-0.0"], agent.host_tier
    agent._initialize()
    assert set(gpu.resident()) <= set(host.resident())                   # every GPU load left a copy
    assert host.stats().admits == 0


GPU_AND_CPU = [{"device": "cuda:0", "count": 1, "memory": "40MB", "expert_memory": "30MB", "prefetch": False},
               {"device": "cpu", "count": 1, "memory": "20MB", "expert_memory": "13MB", "prefetch": False,
                "threads": 1}]


@pytest.mark.parametrize("lever", [True, False])
def test_agent_moves_cpu_victims_into_the_host_tier_and_the_scheduler_sees_it(cpu_gpu_agent, lever):
    agent = cpu_gpu_agent("exclusive", "20MB", executors=GPU_AND_CPU, tag=str(lever),
                          cpu_victims_to_host_tier=lever)   # true/false: 'always'/'never'
    assert agent.cpu_demote_queued_only is False
    cpu_name = next(n for n in agent.pools if n.startswith("cpu"))
    cpu, host = agent.pools[cpu_name], agent.host_tier
    assert (cpu_name in agent.cpu_demoters) is lever
    agent._initialize()
    refreshed = []
    real_refresh = agent.scheduler.refresh
    agent.scheduler.refresh = lambda eid, ex=None: refreshed.append((eid, ex)) or real_refresh(eid, ex)
    on_cpu, in_host = set(cpu.resident()), set(host.resident())
    missing = next(e for e in sorted(agent.model.experts, key=lambda e: -agent.probabilities[e])
                   if e not in on_cpu and e not in in_host and agent.store.nbytes(e) <= cpu.capacity)
    agent.writer.events.clear()
    cpu.release(cpu.acquire(missing))                                   # evicts CPU victims
    victims = [r["expert_id"] for r in agent.writer.events if r["tier"] == "cpu" and r["event"] == "evict"]
    admitted = [r["expert_id"] for r in agent.writer.events if r["tier"] == "host" and r["event"] == "admit"]
    assert victims
    if not lever:   # today's rule: a CPU victim is dropped (the host tier may hold it from its start)
        assert admitted == [] and host.stats().admits == 0
        return
    assert not on_cpu & in_host                                         # it started with none of the CPU pool's
    assert admitted and set(admitted) <= set(victims) and agent.cpu_demoters[cpu_name].demoted == len(admitted)
    assert host.used_bytes() <= host.capacity
    back = next(v for v in admitted if v in host.resident())
    assert (back, None) in refreshed                                    # every executor's switch cost follows
    assert agent.costs.tier_of(cpu_name, back) == "host"                # priced as a host copy, not an SSD read
    reader = agent.cpu_demoters[cpu_name]
    ssd_before, host_before = reader.from_ssd, reader.from_host
    cpu.release(cpu.acquire(back))
    assert (reader.from_ssd, reader.from_host) == (ssd_before, host_before + 1)
    assert back in host.resident()                                      # a CPU read leaves the host copy


def test_by_default_only_a_cpu_victim_a_queued_request_needs_moves_down(cpu_gpu_agent):
    """cpu_victims_to_host_tier: queued (the default).  With nothing queued the CPU pool's victims are dropped;
    once a request is queued for each expert the CPU pool holds, its victims move down into the host tier."""
    from coe import Frame, Request

    agent = cpu_gpu_agent("exclusive", "20MB", executors=GPU_AND_CPU, tag="queued")
    cpu_name = next(n for n in agent.pools if n.startswith("cpu"))
    cpu, host = agent.pools[cpu_name], agent.host_tier
    assert agent.cpu_demote_queued_only and cpu_name in agent.cpu_demoters
    agent._initialize()
    held = set(cpu.resident()) | set(host.resident())
    missing = [e for e in sorted(agent.model.experts, key=lambda e: -agent.probabilities[e])
               if e not in held and agent.store.nbytes(e) <= cpu.capacity]

    def load(expert_id: str) -> tuple[list[str], list[str]]:
        agent.writer.events.clear()
        cpu.release(cpu.acquire(expert_id))
        return ([r["expert_id"] for r in agent.writer.events if r["tier"] == "cpu" and r["event"] == "evict"],
                [r["expert_id"] for r in agent.writer.events if r["tier"] == "host" and r["event"] == "admit"])

    victims, admitted = load(missing[0])
    assert victims and admitted == [] and agent.cpu_demoters[cpu_name].demoted == 0   # nothing queued: dropped
    for i, e in enumerate(cpu.resident()):
        agent.scheduler.submit(Request(Frame(f"q{i}", "T", "B", "C", 0.0, None), e))
    victims, admitted = load(missing[1])
    assert victims and admitted and set(admitted) <= set(victims)                     # still needed: moved down
    assert agent.cpu_demoters[cpu_name].demoted == len(admitted) and set(admitted) <= set(host.resident())
    # only this box's queues count: a request queued on an executor of another box does not keep a victim
    ex = agent.scheduler.submit(Request(Frame("other", "T", "B", "C", 0.0, None), missing[2]))
    assert agent._still_queued(missing[2])
    agent._local_names = [n for n in agent._local_names if n != ex]
    assert not agent._still_queued(missing[2])


@pytest.mark.parametrize("setting", [dict(), dict(ssd_read_ahead=False), dict(cpu_tier_mode="inclusive")])
def test_agent_reads_a_queued_expert_ahead_into_the_host_tier_while_the_ssd_is_idle(cpu_gpu_agent, setting):
    """On by default with an exclusive host tier; off when the config says so, and with an inclusive tier."""
    from coe import Frame, Request

    setting = dict(setting)                                   # the parameter's dict is shared: do not change it
    mode = setting.pop("cpu_tier_mode", "exclusive")
    agent = cpu_gpu_agent(mode, "20MB", executors=GPU_AND_CPU, tag="ra" + str(len(setting)) + mode, **setting)
    if setting or mode == "inclusive":
        assert agent.read_ahead is None
        return
    ahead = agent.read_ahead                                  # pools start empty here (no initialisation)
    gpu_name = next(n for n in agent.pools if n.startswith("cuda"))
    cpu_name = next(n for n in agent.pools if n.startswith("cpu"))
    held = {e for p in (agent.pools[gpu_name], agent.pools[cpu_name], agent.host_tier) for e in p.resident()}
    missing = [e for e in sorted(agent.model.experts, key=lambda e: -agent.probabilities[e]) if e not in held]
    assert missing and ahead.step() is None                   # nothing queued: nothing read
    demand = agent.disk.demand_reads
    for i, e in enumerate(missing[:4]):                       # some queue gets a group behind its head
        agent.scheduler.submit(Request(Frame(f"f{i}", "T", "B", "C", 0.0, None), e))
    behind = {e: n for n in (gpu_name, cpu_name) for e in agent.scheduler.queued_groups(n)[1:]}
    assert behind
    seen = []                                                 # the scheduler's SSD backlog while the read runs
    src = agent.host_tier.source
    real = src.load
    src.load = lambda eid, *a, **k: seen.append(agent.scheduler.ssd_inflight()) or real(eid, *a, **k)
    t0 = agent.scheduler._now()
    agent.scheduler._now = lambda: t0                         # frozen: the read's price does not run down meanwhile
    before = agent.scheduler.ssd_inflight()
    got = ahead.step()
    src.load = real
    assert got in behind and agent.host_tier.contains(got)   # a queue's head is left to its executor
    priced = min(agent.costs.load_seconds(n, got, "ssd") for n in (gpu_name, cpu_name))
    assert len(seen) == 1 and seen[0] == pytest.approx(before + priced)   # counted while it read, at its price
    assert agent.scheduler.ssd_inflight() == before                  # and no longer once it is in
    assert agent.disk.demand_reads == demand and agent.disk.ahead_reads == 1
    pool = agent.pools[behind[got]]
    pool.release(pool.acquire(got))                           # the batch's switch: a host copy, no SSD read
    assert agent.disk.demand_reads == demand and got in pool.resident()


def test_a_replay_with_read_ahead_gives_every_frame_the_same_verdict_as_without(cpu_gpu_agent, tiny_recording,
                                                                              monkeypatch):
    """The read-ahead thread runs beside the executors for a whole replay: no frame is lost or duplicated,
    and every verdict is what the agent without it gives (it moves bytes, never decides)."""
    import edge_agent.agent as agent_mod
    from conftest import verdict_rows
    from edge_agent.replay import replay
    from executors.executor import Executor
    from storage.recording import Recording

    class CpuExecutor(Executor):          # the "GPU" executor computes on the CPU, as its pool lives there
        def __init__(self, name, device, *args, **kw):
            super().__init__(name, "cpu", *args, **kw)

    monkeypatch.setattr(agent_mod, "Executor", CpuExecutor)

    small = [{"device": "cuda:0", "count": 1, "memory": "24MB", "expert_memory": "14MB", "prefetch": True},
             {"device": "cpu", "count": 1, "memory": "20MB", "expert_memory": "13MB", "prefetch": True,
              "threads": 1}]
    rec = Recording(tiny_recording)
    out = {}
    for on in (True, False):
        agent = cpu_gpu_agent("exclusive", "16MB", executors=small, tag=f"replay{on}", ssd_read_ahead=on)
        assert (agent.read_ahead is not None) is on
        agent.start()
        assert replay(rec, agent.endpoints["ingest"]).accepted == len(rec)
        assert agent.wait_verdicts(len(rec), timeout=120)
        agent.stop()
        rows = verdict_rows(agent.cfg.db_path)
        assert len(rows) == len(rec) == len({r["frame_id"] for r in rows})
        out[on] = {r["frame_id"]: (r["verdict"], r["reason"]) for r in rows}
        if on:
            assert agent.disk.demand_reads > 0     # this memory makes the executors read the SSD
            st = agent.read_ahead.stats            # every read it made went through the box's one counter
            assert agent.disk.ahead_reads == st.read and st.failed == st.too_big == 0
            from prometheus_client import generate_latest
            text = generate_latest(agent.metrics.registry).decode()
            assert f'coe_read_ahead_reads_total{{line="T"}} {float(st.read)}' in text
    assert out[True] == out[False]


@pytest.mark.parametrize("fill", ["gpu-first", "round-robin"])
def test_the_agent_starts_the_gpu_pool_with_the_hottest_experts_unless_told_round_robin(cpu_gpu_agent, fill):
    """pool_fill: gpu-first (the default) gives the GPU pool the most probable experts and the CPU pool the
    next ones; round-robin (the paper's) deals them across both, so the second most probable lands on the CPU."""
    executors = [{"device": "cuda:0", "count": 1, "memory": "40MB", "expert_memory": "30MB", "prefetch": False},
                 {"device": "cpu", "count": 1, "memory": "20MB", "expert_memory": "12MB", "prefetch": False}]
    agent = cpu_gpu_agent("exclusive", "20MB", executors=executors, tag=fill, pool_fill=fill)
    loaded = agent._initialize()
    gpu, = [n for n in agent.pools if n.startswith("cuda")]
    cpu, = [n for n in agent.pools if n.startswith("cpu")]
    order = ranked(agent.model.experts, agent.probabilities)
    on_gpu, on_cpu = set(agent.pools[gpu].resident()), set(agent.pools[cpu].resident())
    assert loaded[gpu] and loaded[cpu] and not on_gpu & on_cpu
    if fill == "gpu-first":
        assert set(order[:len(on_gpu)]) == on_gpu                       # the GPU holds a prefix of the ranking
        assert set(order[len(on_gpu):len(on_gpu) + len(on_cpu)]) == on_cpu   # the CPU the experts after it
    else:
        assert order[1] in on_cpu and order[0] in on_gpu                # dealt in turn
    assert not set(agent.host_tier.resident()) & (on_gpu | on_cpu)
