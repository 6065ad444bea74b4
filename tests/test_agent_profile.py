"""The agent runs the profile's executor count and memory split unless the config states a count (issue 9, item 8)."""
from __future__ import annotations

import logging
import shutil

import pytest

from conftest import write_line
from edge_agent.agent import Agent
from edge_agent.config import load_config
from executors.profile import DeviceProfile, Profile

MB = 10**6


@pytest.fixture
def line(tmp_path, tiny_zoo):
    """Write line T with the given executor entry and, optionally, a profile.json where the agent looks."""
    store = tmp_path / "experts"
    shutil.copytree(tiny_zoo, store)

    def make(executor: dict, profile: DeviceProfile | None = None, env: dict | None = None):
        path = write_line(tmp_path / "line", store=store, executors=[{"threads": 1, "prefetch": False, **executor}])
        cfg = load_config(path, env=env or {})
        if profile is not None:
            Profile("assumed: test", {profile.name: profile}, {}).save(cfg.scheduler.profile)
        return cfg

    return make


def searched(executors: int = 2) -> DeviceProfile:
    """What `coe-agent profile` writes for a 40 MB cpu entry whose searches chose `executors` and 30 MB of experts."""
    return DeviceProfile("cpu", "cpu", 40 * MB, executors=executors, expert_memory=30 * MB)


def build(cfg, caplog) -> tuple[Agent, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edge_agent.agent"):
        agent = Agent(cfg)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu: ")]
    assert len(lines) == 1, lines                          # one line per executor entry
    return agent, lines[0]


def summary(agent: Agent) -> list[tuple[int, int]]:
    return [(agent.costs.executors[s.name].memory, agent.pools[s.name].capacity) for s in agent.slots]


def test_count_unset_runs_the_profiles_count_sharing_the_memory(line, caplog):
    cfg = line({"device": "cpu", "memory": "40MB"}, searched(2))
    agent, said = build(cfg, caplog)
    try:
        assert [e.name for e in agent.executors] == ["cpu-0.0", "cpu-0.1"]
        # as the search simulated it: 40 MB shared by 2, and the searched 30 MB of experts split the same way
        assert summary(agent) == [(20 * MB, 15 * MB), (20 * MB, 15 * MB)]
        assert agent.scheduler.names == ["cpu-0.0", "cpu-0.1"]
        assert said == (f"cpu: 2 executors, 15 MB experts each (of 20 MB), from profile {cfg.scheduler.profile} "
                        f"(executor-count search); expert memory from profile (memory-split search)")
    finally:
        agent.stop()


def test_count_in_the_config_wins_over_the_profile(line, caplog):
    cfg = line({"device": "cpu", "memory": "40MB", "count": 3}, searched(2))
    agent, said = build(cfg, caplog)
    try:
        assert len(agent.executors) == 3
        assert summary(agent) == [(40 * MB, 30 * MB)] * 3  # memory is each executor's own; the split proportional
        assert said.startswith("cpu: 3 executors, 30 MB experts each (of 40 MB), from config;")
        assert "executor-count search" not in said
    finally:
        agent.stop()


def test_count_from_an_environment_variable_is_from_config(line, caplog):
    cfg = line({"device": "cpu", "memory": "40MB"}, searched(2), env={"COE_EXECUTORS__0__COUNT": "1"})
    agent, said = build(cfg, caplog)
    try:
        assert len(agent.executors) == 1 and "from config" in said
    finally:
        agent.stop()


def test_configured_expert_memory_is_shared_like_the_memory(line, caplog):
    cfg = line({"device": "cpu", "memory": "40MB", "expert_memory": "26MB"}, searched(2))
    agent, said = build(cfg, caplog)
    try:
        assert summary(agent) == [(20 * MB, 13 * MB), (20 * MB, 13 * MB)]
        assert said.endswith("expert memory from config")
    finally:
        agent.stop()


def test_without_a_profile_one_executor_and_the_default_split(line, caplog):
    cfg = line({"device": "cpu", "memory": "40MB"})
    agent, said = build(cfg, caplog)
    try:
        assert summary(agent) == [(40 * MB, 30 * MB)]
        assert said == "cpu: 1 executor, 30 MB experts each (of 40 MB), default (count unset, no profile); " \
                       "expert memory default (75%)"
    finally:
        agent.stop()


def test_a_config_sized_executor_keeps_the_max_batch_reserve(line, caplog, tmp_path):
    """The config runs 3 executors of 40 MB where the search sized 2: the proportional 30 MB of experts
    would leave 10 MB, less than the 16 MB a max batch needs (2 MB x 8), so experts get 24 MB."""
    from executors.profile import ArchProfile

    cfg = line({"device": "cpu", "memory": "40MB", "count": 3})
    arch = ArchProfile("ultralytics/yolov8n", "cpu", 0.01, 0.01, 8, 3 * MB, 2 * MB, {"ssd": 0.05, "host": 0.01})
    Profile("assumed: test", {"cpu": searched(2)}, {Profile.key(arch.arch, "cpu"): arch}).save(cfg.scheduler.profile)
    agent, said = build(cfg, caplog)
    try:
        assert summary(agent) == [(40 * MB, 24 * MB)] * 3
        assert "cut to keep the max-batch activation reserve" in said
    finally:
        agent.stop()


def test_a_line_where_no_executor_can_hold_an_expert_is_refused_at_start(line):
    """It was accepted, and every frame routed to that expert failed while serving (the pool refused it)."""
    from coe import CoEError

    cfg = line({"device": "cpu", "memory": "40MB", "expert_memory": "5MB"})
    with pytest.raises(CoEError, match=r"executors: no executor's pool can hold expert \S+ nor \d+ more \(the "
                                       r"largest pool holds 5 MB of experts\)"):
        Agent(cfg)


def test_a_split_cut_to_the_largest_expert_says_how_little_is_left_for_activations(line, caplog):
    """The profiled split left less than the reserve: the log said the reserve was kept while activations got
    what was left of the largest expert (even nothing)."""
    from executors.profile import ArchProfile

    cfg = line({"device": "cpu", "memory": "16MB", "count": 1})
    arch = ArchProfile("ultralytics/yolov8n", "cpu", 0.01, 0.01, 8, 3 * MB, 2 * MB, {"ssd": 0.05, "host": 0.01})
    dev = DeviceProfile("cpu", "cpu", 16 * MB, executors=1, expert_memory=15 * MB)
    Profile("assumed: test", {"cpu": dev}, {Profile.key(arch.arch, "cpu"): arch}).save(cfg.scheduler.profile)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edge_agent.agent"):
        agent = Agent(cfg)
    try:
        said = "\n".join(r.getMessage() for r in caplog.records)
        assert "cut to keep the max-batch activation reserve" not in said
        assert "cut to the largest expert" in said and "below the max batch's 16 MB" in said
        assert "left for activations, below the 16 MB the profiled max batch needs" in said
    finally:
        agent.stop()


def test_a_profile_measured_for_another_line_is_refused_and_other_hardware_is_warned_about(line, caplog):
    """A profile recorded no line, spec or hardware: another line's (or another box's) executor counts and split
    were applied and logged 'from profile'."""
    from coe import CoEError
    from executors.profile import box_identity, spec_digest

    cfg = line({"device": "cpu", "memory": "40MB"})
    Profile("measured on test", {"cpu": searched(2)}, {}, made_for={"line": "Z"}).save(cfg.scheduler.profile)
    with pytest.raises(CoEError, match=r"scheduler.profile: .* was measured for line Z, this is line T; run "
                                       r"`coe-agent profile --line T`"):
        Agent(cfg)
    here = box_identity(["cpu"])
    assert here["cpu"].endswith("cores")
    Profile("measured on test", {"cpu": searched(2)}, {}, made_for={
        "line": "T", "spec": spec_digest(cfg.spec_path), "box": here}).save(cfg.scheduler.profile)
    agent, _ = build(cfg, caplog)
    agent.stop()
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "was measured" in r.getMessage()]
    Profile("measured on test", {"cpu": searched(2)}, {}, made_for={
        "line": "T", "spec": "0" * 64, "box": {"cpu": "Another CPU, 96 cores"}}).save(cfg.scheduler.profile)
    agent, _ = build(cfg, caplog)
    agent.stop()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("measured for another version of the spec" in m for m in said)
    assert any("measured on cpu (Another CPU, 96 cores); this box's cpu is" in m for m in said)


def test_a_constructor_that_fails_leaves_no_reader_lock_nor_context_open(line, monkeypatch):
    """The store's reader lock (which keeps a promotion's retired files) and the zmq context stayed open after a
    constructor raised, until the process exited."""
    import zmq

    from coe import CoEError
    from storage.expert_store import ExpertStore

    closed, destroyed = [], []
    real_close, real_destroy = ExpertStore.close_reader, zmq.Context.destroy
    monkeypatch.setattr(ExpertStore, "close_reader", lambda self: (closed.append(1), real_close(self))[1])
    monkeypatch.setattr(zmq.Context, "destroy", lambda self, linger=None: (destroyed.append(1),
                                                                           real_destroy(self, linger=linger))[1])
    cfg = line({"device": "cpu", "memory": "40MB", "expert_memory": "5MB"})
    with pytest.raises(CoEError, match="no executor's pool can hold expert"):
        Agent(cfg)
    assert closed and destroyed


def test_an_agent_built_and_never_started_closes_its_prefetch_threads_and_context_on_stop(line):
    """Each executor's prefetcher starts its thread in the constructor; `stop` on an agent never started closed
    only the store's reader and the context, and those threads (and the pools' memory) stayed."""
    cfg = line({"device": "cpu", "memory": "40MB", "prefetch": True})
    agent = Agent(cfg)
    threads = [ex.prefetcher._thread for ex in agent.executors if ex.prefetcher is not None]
    assert threads and all(t.is_alive() for t in threads)
    assert agent.stop() is True
    assert not any(t.is_alive() for t in threads)
    assert agent.ctx.closed and agent.phase == "stopped"
    assert agent.stop() is True                    # a second stop does nothing
