"""Line config: defaults, COE_* overrides, and errors that name the file, the key and the reason."""
from pathlib import Path

import pytest

from coe import SpecError
from edge_agent.config import endpoint_parts, find_config, load_config, parse_bytes

REPO = Path(__file__).resolve().parent.parent
LINE_A = REPO / "configs" / "line-A.yaml"


def write(tmp_path, text: str) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text((REPO / "configs" / "specs" / "line-A.coe.yaml").read_text())
    p = tmp_path / "line-T.yaml"
    p.write_text(text)
    return p


def test_line_a_loads_with_resolved_paths():
    cfg = load_config(LINE_A, env={})
    assert cfg.line == "A"
    assert Path(cfg.spec).is_file() and Path(cfg.spec).is_absolute()
    assert cfg.results_db == "var/line-A/results.db"
    assert cfg.executors[0].memory == 160_000_000


def test_env_overrides_nested_keys():
    cfg = load_config(LINE_A, env={"COE_DATA_DIR": "/tmp/x", "COE_EXECUTORS__0__MEMORY": "1GiB",
                                   "COE_SCHEDULER__MAX_BATCH": "4", "COE_METRICS__PORT": "0",
                                   "UNRELATED": "1"})
    assert cfg.results_db == "/tmp/x/results.db"
    assert cfg.executors[0].memory == 2**30
    assert cfg.scheduler.max_batch == 4
    assert cfg.metrics.port == 0


@pytest.mark.parametrize("text,key,reason", [
    ("line: T\nspec: spec.yaml\nbogus: 1\n", "bogus", "not a config key"),
    ("line: T\nspec: spec.yaml\nschedular: {}\n", "schedular", "not a config key (did you mean 'scheduler'?)"),
    ("line: T\nspec: spec.yaml\nexecutors: [{device: cpu, memroy: 1GB}]\n", "executors.0.memroy",
     "not a config key (did you mean 'memory'?)"),
    ("spec: spec.yaml\n", "line", "required"),
    ("line: T\nspec: spec.yaml\nexecutors: [{device: tpu}]\n", "executors.0.device", "cuda"),
    ("line: T\nspec: spec.yaml\nexecutors: [{memory: lots}]\n", "executors.0.memory", "256MB"),
    ("line: T\nspec: spec.yaml\ningest: tcp://127.0.0.1:5\n", "ingest", "router+bind"),
    ("line: T\nspec: spec.yaml\neviction: random\n", "eviction", "lru"),
    ("line: T\nspec: spec.yaml\nscheduler: {max_batch: 0}\n", "scheduler.max_batch", "greater than"),
    ("line: T\nspec: spec.yaml\nscheduler: {max_wait: -1}\n", "scheduler.max_wait", "greater than or equal to 0"),
    ("line: T\nspec: spec.yaml\ncpu_tier_mode: shared\n", "cpu_tier_mode", "'exclusive' or 'inclusive'"),
    ("line: T\nspec: spec.yaml\ncpu_reads_host_tier: sometimes\n", "cpu_reads_host_tier", "valid boolean"),
    ("line: T\nspec: spec.yaml\ncpu_victims_to_host_tier: maybe\n", "cpu_victims_to_host_tier", "'queued', 'always' or 'never'"),
    ("line: T\nspec: spec.yaml\nhost_tier_admission: best\n", "host_tier_admission", "'ranked' or 'all'"),
    ("line: T\nspec: spec.yaml\npool_fill: fastest\n", "pool_fill", "'gpu-first' or 'round-robin'"),
    ("line: T\nspec: spec.yaml\nexecutors: [{count: 0}]\n", "executors.0.count", "greater than or equal to 1"),
    ("line: T\nspec: spec.yaml\nexecutors: [{memory: .inf}]\n", "executors.0.memory", "finite number of bytes"),
    ("line: T\nspec: spec.yaml\ndata_dir: var/{site}\n", "data_dir", "unknown placeholder {site}"),
    ("line: T\nspec: spec.yaml\nresults_db: '{data_dir'\n", "results_db", "a literal brace"),
    # ZeroMQ takes a port modulo 65536: the agent would listen where no client is pointed
    ("line: T\nspec: spec.yaml\ningest: router+bind:tcp://127.0.0.1:99999\n", "ingest", "port 99999 is out of range"),
    ("line: T\nspec: spec.yaml\npublish: pub+bind:tcp://127.0.0.1:0\n", "publish", "port 0 is out of range"),
    # budgets and limits an agent would start with, then fail every frame
    ("line: T\nspec: spec.yaml\nexecutors: [{memory: 0}]\n", "executors.0.memory", "more than 0 bytes"),
    ("line: T\nspec: spec.yaml\nexecutors: [{memory: 0.5}]\n", "executors.0.memory", "more than 0 bytes"),
    ("line: T\nspec: spec.yaml\nexecutors: [{expert_memory: 0}]\n", "executors.0.expert_memory", "more than 0 bytes"),
    ("line: T\nspec: spec.yaml\nmax_payload_bytes: 0\n", "max_payload_bytes", "at least 1024 bytes"),
    ("line: T\nspec: spec.yaml\nline: U\n", "line", "written twice (lines 1 and 3)"),
    ("line: T\nspec: spec.yaml\nmetrics: {port: 1, port: 2}\n", "port", "written twice"),
    # one line each: the value given, no class names, the YAML problem without PyYAML's caret lines
    ("line: T\nspec: spec.yaml\nmetrics: {port: abc}\n", "metrics.port", "(got 'abc')"),
    ("line: T\nspec: spec.yaml\nmetrics: 9105\n", "metrics", "expected a mapping of keys under it, got '9105'"),
    ("line: T\nspec: spec.yaml\nbad: [\n", "<file>", "not valid YAML: line 4, column 1: expected the node"),
])
def test_invalid_config_names_file_key_reason(tmp_path, text, key, reason):
    p = write(tmp_path, text)
    with pytest.raises(SpecError) as ei:
        load_config(p, env={})
    assert ei.value.key == key
    assert str(p) in str(ei.value)
    assert reason in ei.value.reason and "\n" not in str(ei.value) and "MetricsConfig" not in str(ei.value)


def test_env_error_names_the_variable(tmp_path):
    p = write(tmp_path, "line: T\nspec: spec.yaml\n")
    with pytest.raises(SpecError) as ei:
        load_config(p, env={"COE_MAX_INFLIGHT": "-3"})
    assert "COE_MAX_INFLIGHT" in str(ei.value) and ei.value.key == "max_inflight"


@pytest.mark.parametrize("var,reason", [
    ("COE_EXECUTORS__1__MEMORY", "index 1 is past the end of a list of 1"),
    ("COE_EXECUTORS__x__MEMORY", "'x' is not a list index"),
    ("COE_INGEST__X", "valid string"),                  # made a section where a string goes: the variable named
])
def test_an_env_variable_whose_path_does_not_fit_is_named(tmp_path, var, reason):
    p = write(tmp_path, "line: T\nspec: spec.yaml\nexecutors: [{device: cpu}]\n")
    with pytest.raises(SpecError) as ei:
        load_config(p, env={var: "1GiB"})
    assert var in str(ei.value) and str(p) in str(ei.value) and reason in ei.value.reason


def test_an_env_variable_under_a_key_that_is_not_a_section_is_named(tmp_path):
    p = write(tmp_path, "line: T\nspec: spec.yaml\nscheduler: fast\n")
    with pytest.raises(SpecError) as ei:
        load_config(p, env={"COE_SCHEDULER__MAX_BATCH": "4"})
    assert "COE_SCHEDULER__MAX_BATCH" in str(ei.value) and "'scheduler' is a str, not a section" in ei.value.reason


def test_a_config_or_spec_that_is_not_utf8_is_named(tmp_path):
    from coe.spec import load_spec

    p = tmp_path / "latin1.yaml"
    p.write_bytes("line: T\nspec: caf\xe9.yaml\n".encode("latin-1"))
    with pytest.raises(SpecError, match="not UTF-8 text") as ei:
        load_config(p, env={})
    assert str(p) in str(ei.value)
    with pytest.raises(SpecError, match="not UTF-8 text") as ei:
        load_spec(p)
    assert str(p) in str(ei.value)


def test_broken_yaml_and_missing_file(tmp_path):
    p = write(tmp_path, "line: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_config(p, env={})
    with pytest.raises(SpecError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", env={})


def test_find_config_prefers_explicit_then_env(tmp_path, monkeypatch):
    p = write(tmp_path, "line: T\nspec: spec.yaml\n")
    assert find_config("T", p) == p
    monkeypatch.setenv("COE_CONFIG_DIR", str(tmp_path))
    assert find_config("T") == tmp_path / "line-T.yaml"
    with pytest.raises(SpecError, match="no config for line 'Q'"):
        find_config("Q")


def test_sizes_and_endpoints():
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError):
        parse_bytes("12 parsecs")
    assert endpoint_parts("router+bind:tcp://127.0.0.1:5555") == ("router", True, "tcp://127.0.0.1:5555")


def test_new_keys_defaults_and_unset_count(tmp_path):
    cfg = load_config(write(tmp_path, "line: T\nspec: spec.yaml\n"), env={})
    assert cfg.scheduler.max_wait == 2.0 and cfg.cpu_tier_mode == "exclusive" and cfg.cpu_reads_host_tier
    assert cfg.cpu_victims_to_host_tier == "queued" and cfg.ssd_read_ahead is True
    assert cfg.host_tier_admission == "ranked" and cfg.pool_fill is None and cfg.start_fill == "gpu-first"
    assert cfg.executors[0].count == 1 and not cfg.executors[0].count_is_set   # the profile decides
    cfg = load_config(write(tmp_path, "line: T\nspec: spec.yaml\nscheduler: {max_wait: null}\n"
                                      "cpu_tier_mode: inclusive\neviction: coserve-paper\n"
                                      "cpu_reads_host_tier: false\ncpu_victims_to_host_tier: true\n"
                                      "ssd_read_ahead: false\nhost_tier_admission: all\npool_fill: round-robin\n"
                                      "executors: [{count: null}, {count: 2}]\n"), env={})
    assert cfg.scheduler.max_wait is None and cfg.cpu_tier_mode == "inclusive" and cfg.eviction == "coserve-paper"
    assert cfg.cpu_reads_host_tier is False and cfg.cpu_victims_to_host_tier == "always" and not cfg.ssd_read_ahead
    assert cfg.host_tier_admission == "all" and cfg.start_fill == "round-robin"
    # unset, the paper's rule and the baselines start round-robin, as the paper does
    for policy, fill in (("coserve", "gpu-first"), ("coserve-paper", "round-robin"), ("fcfs", "round-robin")):
        other = load_config(write(tmp_path, f"line: T\nspec: spec.yaml\nscheduler: {{policy: {policy}}}\n"), env={})
        assert other.start_fill == fill, policy
    other = load_config(write(tmp_path, "line: T\nspec: spec.yaml\nscheduler: {policy: coserve-paper}\n"
                                        "pool_fill: gpu-first\n"), env={})
    assert other.start_fill == "gpu-first"                            # set, it holds under any policy
    assert [(e.count, e.count_is_set) for e in cfg.executors] == [(1, False), (2, True)]
    for given, read in (("false", "never"), ("never", "never"), ("queued", "queued"), ("always", "always"),
                        ("'true'", "always"), ("1", "always"), ("0", "never")):
        cfg = load_config(write(tmp_path, f"line: T\nspec: spec.yaml\ncpu_victims_to_host_tier: {given}\n"), env={})
        assert cfg.cpu_victims_to_host_tier == read
    cfg = load_config(LINE_A, env={"COE_SCHEDULER__MAX_WAIT": "0.5", "COE_EXECUTORS__0__COUNT": "2"})
    assert cfg.scheduler.max_wait == 0.5 and cfg.executors[0].count_is_set and cfg.executors[0].count == 2
    assert not load_config(LINE_A, env={}).executors[0].count_is_set            # line A leaves it to the profile


@pytest.mark.parametrize("max_wait,expected", [(None, 2.0), (0.25, 0.25), (0, None)])
def test_agent_passes_max_wait_to_the_scheduler(tiny_line, max_wait, expected):
    from edge_agent.agent import Agent

    env = {} if max_wait is None else {"COE_SCHEDULER__MAX_WAIT": str(max_wait)}
    agent = Agent(load_config(tiny_line, env=env))
    try:
        assert agent.scheduler.max_wait == expected          # 0 disables the age bound
    finally:
        agent.stop()


def test_a_mistyped_section_variable_is_named_in_a_warning_not_ignored_unseen(tmp_path, caplog):
    import logging

    p = write(tmp_path, "line: T\nspec: spec.yaml\n")
    with caplog.at_level(logging.WARNING, logger="edge_agent.config"):
        cfg = load_config(p, env={"COE_METRIC__PORT": "9200", "COE_TRT_CACHE": "/x"})
    assert cfg.metrics.port == 9105
    [rec] = [r for r in caplog.records if "COE_" in r.getMessage()]     # the plain COE_X variable is not named
    assert "COE_METRIC__PORT is not applied: 'metric' is no config section" in rec.getMessage()
    assert "metrics" in rec.getMessage() and "llm" in rec.getMessage()


def test_yaml_merge_keys_still_load_and_a_key_twice_in_a_nested_list_item_is_refused():
    from coe import yaml_strict

    assert yaml_strict.load("base: &b {k: 1}\nm:\n  <<: *b\n  k: 2\n")["m"] == {"k": 2}
    with pytest.raises(yaml_strict.DuplicateKey, match="key 'a' appears twice in one mapping \\(line 2, then line 3\\)"):
        yaml_strict.load("x:\n- a: 1\n  a: 2\n")
