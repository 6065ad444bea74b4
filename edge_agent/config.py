"""Line config: one YAML file per production line, overridable by COE_* variables.

Invalid configs fail at start with the file (or variable), the key and the reason,
because an agent that starts with a half-understood config loses frames later.
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from coe import SpecError, yaml_strict

log = logging.getLogger(__name__)

ENV_PREFIX = "COE_"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}
_ENDPOINT = re.compile(r"^(router|pub)\+(bind|connect):((tcp://[^\s]+:(\d+|\*))|(ipc://\S+)|(inproc://\S+))$")


def parse_bytes(value: Any) -> int:
    """'160MB', '1.5GiB' or a plain integer -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size like '256MB', got a boolean")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a size cannot be negative")
        if value != value or value == float("inf"):
            raise ValueError(f"a size must be a finite number of bytes, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like '256MB' or '1GiB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


MIN_PAYLOAD_BYTES = 1024   # below this no camera image fits: every frame would be rejected oversize


def _payload_bytes(value: Any) -> int:
    n = parse_bytes(value)
    if n < MIN_PAYLOAD_BYTES:
        raise ValueError(f"must be at least {MIN_PAYLOAD_BYTES} bytes (every frame would be rejected oversize), "
                         f"got {value!r}")
    return n


def _positive_bytes(value: Any) -> int:
    """`parse_bytes`, for a budget: 0 (or under a byte) would start an agent whose every frame fails."""
    n = parse_bytes(value)
    if n <= 0:
        raise ValueError(f"must be more than 0 bytes, got {value!r}")
    return n


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExecutorConfig(_Strict):
    """One device's executors.

    `count` left out (or null) means "from the profile": the agent runs the
    executor count that `coe-agent profile`'s search found for this device, and
    they share `memory` equally, as the search assumed; with no profile entry,
    one executor.  A `count` written in the config (or COE_EXECUTORS__N__COUNT)
    always wins, and then `memory` is each executor's own budget.  `count`
    reads as 1 when unset, so code that only sums budgets sees this entry's
    total either way.
    """

    device: str = "cpu"
    count: int = Field(1, ge=1, le=64, description="executors on this device; unset: the profile's "
                                                   "executor-count search, else 1")
    memory: int = Field(256 * 2**20, description="byte budget of this executor's model pool (with count unset: "
                                                  "of all this entry's executors together)")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: cores / executors")
    prefetch: bool = Field(True, description="load the next group's expert while a batch computes")
    expert_memory: int | None = Field(None, description="bytes of `memory` for experts (with count unset: of all "
                                                        "this entry's executors together); default: profiled "
                                                        "split, else 75% (the rest is for activations)")
    node: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                             description="run these executors on another box of the `cluster` (a Ray node started "
                                         "with the resource 'coe:<node>'); unset: on this box")

    _emem = field_validator("expert_memory", mode="before")(
        classmethod(lambda cls, v: None if v is None else _positive_bytes(v)))

    _mem = field_validator("memory", mode="before")(classmethod(lambda cls, v: _positive_bytes(v)))

    @model_validator(mode="before")
    @classmethod
    def _unset_count(cls, raw: Any) -> Any:
        """`count: null` (or an empty COE_ variable) means unset, i.e. from the profile."""
        if isinstance(raw, dict) and raw.get("count", 0) in (None, ""):
            raw = {k: v for k, v in raw.items() if k != "count"}
        return raw

    @property
    def count_is_set(self) -> bool:
        """True when the config (or an environment variable) states `count`; else the profile decides."""
        return "count" in self.model_fields_set

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and not re.fullmatch(r"cuda(:\d+)?", v):
            raise ValueError(f"must be 'cpu' or 'cuda:N', got '{v}'")
        return v


class SchedulerConfig(_Strict):
    policy: Literal["coserve", "coserve-paper", "em+ra", "em", "none", "fcfs", "round-robin",
                    "grouped"] = "coserve"
    max_batch: int = Field(16, ge=1, le=1024, description="batch cap where no profile gives one")
    profile: str = Field("{data_dir}/profile.json", description="costs from `coe-agent profile`; estimates if absent")
    tie_seconds: float = Field(0.0, ge=0, description="assignment: predicted makespans this close count as ties "
                                                      "(0: exact, as the paper; the SSD term handles switches)")
    initialize: bool = Field(True, description="fill pools by usage probability at start (CoServe §4.1)")
    max_wait: float | None = Field(2.0, ge=0, description="age bound in seconds: a request that has waited this "
                                                          "much longer than the wait predicted when it was queued "
                                                          "is served next, whatever its group; null or 0: off")


class WriterConfig(_Strict):
    batch_rows: int = Field(512, ge=1)
    flush_ms: float = Field(50.0, gt=0)


class CurveConfig(_Strict):
    """ZeroMQ CURVE for factory networks: the agent's secret certificate and the clients it admits."""

    server_key: str = Field(description="secret certificate file (from `coe-agent keys generate`)")
    allowed_clients: list[str] = Field(default_factory=list,
                                       description="client public keys: certificate files or 40-char z85 keys")


class RetentionConfig(_Strict):
    days: float | None = Field(30.0, gt=0, description="prune inferences, errors and events older than this")
    keep_verdicts: bool = Field(True, description="verdicts (and their frames) are never pruned")
    interval_s: float = Field(3600.0, gt=0, description="how often the writer prunes")


class RoutingConfig(_Strict):
    mode: Literal["rules", "learned"] = Field("rules", description="rules: the header's component; "
                                                                   "learned: a model on the image")
    threshold: float = Field(0.9, gt=0, lt=1, description="below this confidence: the header's component, "
                                                          "else a low_confidence reject")


class MetricsConfig(_Strict):
    """The agent's HTTP port: Prometheus `/metrics`, the status page at `/` and its read-only JSON API."""

    enabled: bool = True
    bind: str = Field("127.0.0.1", description="where /metrics, the status page and /api/* listen")
    port: int = Field(9105, ge=0, le=65535, description="0 picks a free port")
    token: str | None = Field(None, min_length=16, description="when set, every request must present it "
                                                               "(Authorization: Bearer, or ?token= for a browser)")
    thumbnails: int = Field(2000, ge=0, description="defect thumbnails kept at most (oldest go first; "
                                                    "retention.days prunes them too); 0: none stored")


class ClusterConfig(_Strict):
    """Executors on other boxes (issue 15): the Ray cluster the line's `node:` executors run in."""

    address: str = Field(description="Ray cluster address, e.g. 'ray://10.0.0.1:10001' or '10.0.0.1:6379'")
    stores: dict[str, str] = Field(default_factory=dict, description="expert store path on each node "
                                                                     "(default: the line's expert_store path)")
    call_timeout_s: float = Field(60.0, gt=0, description="a batch on a remote executor that has not answered in "
                                                          "this long counts as lost and is requeued")
    rejoin_s: float = Field(2.0, gt=0, description="how often a lost executor's node is looked for again")
    connect_timeout_s: float = Field(30.0, gt=0, description="how long start waits for the cluster and the actors")
    channel: Literal["zmq", "ray"] = Field("zmq", description="how batches reach a remote executor: 'zmq', a "
                                           "ZeroMQ socket the actor binds on its node (Ray still places, warms and "
                                           "health-checks it), or 'ray', Ray actor calls (slower by ~1 ms a batch)")


class LLMConfig(_Strict):
    """An MoE LLM served next to the vision line, its experts in the executors' pools."""

    store: str = Field(description="store written by 'coe-agent llm import' ({data_dir} allowed)")
    bind: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="OpenAI-style /v1/completions; 0 picks a free port")
    executor: str | None = Field(None, description="the executor whose pool (and device) the LLM shares, e.g. "
                                                   "'cpu-0.0'; default: the first executor")
    max_tokens: int = Field(128, ge=1, le=8192, description="completion length when a request gives none")
    max_tokens_limit: int = Field(2048, ge=1, le=65536, description="longest completion a request may ask for")
    max_waiting: int = Field(8, ge=0, description="completions queued behind the running one before 503 busy")
    max_share: float = Field(1.0, gt=0, le=1, description="the most of the shared pool the LLM's experts may hold; "
                                                          "1: ranked with the vision experts alone (an LLM expert, "
                                                          "used by k/E of the tokens, outranks most detectors); "
                                                          "e.g. 0.5 keeps half the pool for the line")
    trace: str | None = Field(None, description="a trace (coe-agent llm trace) whose per-layer popularity ranks "
                                                "the LLM's experts against the vision experts; default: uniform")

    @model_validator(mode="after")
    def _default_within_limit(self) -> "LLMConfig":
        if self.max_tokens > self.max_tokens_limit:   # every request that gives no max_tokens would get a 400
            raise ValueError(f"max_tokens ({self.max_tokens}) exceeds max_tokens_limit ({self.max_tokens_limit})")
        return self


class LineConfig(_Strict):
    """Everything one line agent needs.  Paths are resolved by `load_config`."""

    line: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$")
    spec: str
    data_dir: str = "var/line-{line}"
    results_db: str = "{data_dir}/results.db"
    expert_store: str = "{data_dir}/experts"
    ingest: str = "router+bind:tcp://127.0.0.1:5555"
    publish: str = "pub+bind:tcp://127.0.0.1:5556"
    max_payload_bytes: int = 4 * 2**20
    max_inflight: int = Field(4096, ge=1, description="accepted frames without a verdict before ingest pauses")
    expert_verify: Literal["first", "always", "never"] = "first"
    eviction: Literal["coserve", "coserve-paper", "probability", "lru", "fifo"] = "coserve"
    cpu_tier: int = Field(2 * 2**30, description="shared host-memory tier behind GPU executors' pools")
    cpu_tier_mode: Literal["exclusive", "inclusive"] = Field(
        "exclusive", description="exclusive: the host tier is a victim cache of the GPU pools (GPU victims move "
                                 "down into it, promoted experts leave it); inclusive: every GPU load goes "
                                 "through it and it keeps a copy (the paper's reading)")
    cpu_reads_host_tier: bool = Field(
        True, description="CPU executors copy an expert the host tier holds (a RAM copy) instead of reading the "
                          "SSD, where both hold the same dtype; the host tier keeps its copy")
    cpu_victims_to_host_tier: Literal["queued", "always", "never"] = Field(
        "queued", description="with an exclusive host tier and cpu_reads_host_tier: 'queued' (the default): a CPU "
                              "executor's victim that a request queued on the box still needs moves down into the "
                              "host tier (a RAM copy), as a GPU victim does, where both hold the same dtype and it "
                              "is the store's current version; 'always' (or true): every such victim; 'never' (or "
                              "false): none, each is dropped and re-read from SSD.  In simulation 'queued' raised "
                              "the flood throughput by 1.6-12% (mean over 4 seeds, tasks A1-B2) and left p99 as it "
                              "was at line rates up to 11.9 frames/s; 'always' thrashes the CPU pools against the "
                              "host tier at a line rate and lowered the highest rate sustained on eleven boards of "
                              "bench/sim_shapes.py, by more than 5% on four (bench '+cpudemote')")

    @field_validator("cpu_victims_to_host_tier", mode="before")
    @classmethod
    def _victims(cls, v: Any) -> Any:
        """true/false (as YAML, a string or 0/1), the setting's values before 'queued', read as always/never."""
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            v = v.strip().lower() in ("true", "yes", "on", "1")
        if isinstance(v, (bool, int)) and v in (0, 1):
            return "always" if v else "never"
        if v not in ("queued", "always", "never"):
            raise ValueError(f"should be 'queued', 'always' or 'never' (or true/false), got {v!r}")
        return v
    host_tier_admission: Literal["ranked", "all"] = Field(
        "ranked", description="with an exclusive host tier: 'ranked' (the default): a victim moving down (a GPU "
                              "victim, or a CPU victim per cpu_victims_to_host_tier) enters a full host tier only if "
                              "the eviction policy ranks it above what it would push out, never for being used "
                              "last (coserve: by probability, a queued request, then a fixed order among equal "
                              "probabilities); 'all': every victim enters, pushing out the tier's lowest.  With "
                              "eviction lru or fifo (recency only) every victim enters either way.  A board's rare "
                              "types share one usage probability and a line cycles through them, so with 'all' "
                              "each one just run pushed out another that the next board needed.  In simulation "
                              "(bench/sim_seeds.py, A1-B2, seeds 0-3; bench ablation '-admit') 'ranked' lowered "
                              "the mean p99 at 11.5 frames/s on every task, by 0.01-0.08 s, and moved the mean "
                              "flood throughput by -1.7% to +1.2%")
    pool_fill: Literal["gpu-first", "round-robin"] | None = Field(
        None, description="how the executors' pools start, most probable experts first: 'gpu-first': the GPU "
                          "executors' pools, then the CPU executors' with the next ones; 'round-robin': dealt "
                          "across every executor, as the CoServe paper does.  Unset (the default): gpu-first under "
                          "scheduler.policy coserve, round-robin under the paper's rule and the baselines.  "
                          "Round-robin leaves two of every three of the hottest experts on two CPU executors, "
                          "which the GPU, running most requests, then reads from SSD.  In simulation "
                          "(bench/sim_seeds.py --systems coserve,-gpufirst, A1-B2, seeds 0-3) 'gpu-first' raised "
                          "the mean flood throughput by 12-20%.  No effect without a GPU")
    ssd_read_ahead: bool = Field(
        True, description="with an exclusive host tier: while no executor reads the SSD, read the expert of the "
                          "earliest queued group behind a queue's head that no pool or tier holds into the host "
                          "tier, so its switch is a host copy (executors/readahead.py; bench ablation "
                          "'-readahead')")
    expert_read: Literal["read", "mmap"] = Field("read", description="how tiers read expert files (bench/expert_load.py)")
    cpu_compute_dtype: Literal["float32", "bfloat16", "float16", "stored"] = Field(
        "float32", description="dtype CPU executors compute in: experts stored in another floating dtype are "
                               "cast while they load (GPU pools keep the stored half precision); 'stored' "
                               "computes in whatever the store holds")
    gpu_compute_dtype: Literal["stored", "float32", "bfloat16", "float16"] = Field(
        "stored", description="dtype GPU executors compute in: 'stored' keeps half-stored experts half (the "
                              "bytes a switch moves stay halved); a tensor an fp16 expert kept in fp32 because "
                              "fp16 would flush it is then cast to fp16 too")
    store_poll_s: float = Field(0.5, gt=0, description="how often the agent looks for experts promoted into its "
                                                      "store (coe-agent experts promote)")
    unified_memory: bool = Field(False, description="Jetson-style: GPU and CPU share DRAM, no separate host tier")
    runtime: Literal["torch", "onnx", "auto"] = Field(
        "torch", description="what runs torchvision and ultralytics experts: torch; onnx (ONNX Runtime, through an "
                             "export of each expert kept beside the store); auto (per architecture, whichever "
                             "measured faster on this box's CPU, kept in {data_dir}/runtimes.json)")
    executors: list[ExecutorConfig] = Field(default_factory=lambda: [ExecutorConfig()])
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    writer: WriterConfig = Field(default_factory=WriterConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    curve: CurveConfig | None = None
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    llm: LLMConfig | None = None
    cluster: ClusterConfig | None = None
    source: str = Field("<config>", exclude=True)

    _tier = field_validator("cpu_tier", mode="before")(classmethod(lambda cls, v: parse_bytes(v)))
    _payload = field_validator("max_payload_bytes", mode="before")(classmethod(lambda cls, v: _payload_bytes(v)))

    @field_validator("ingest", "publish")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        m = _ENDPOINT.match(v)
        if not m:
            raise ValueError(f"expected an endpoint like 'router+bind:tcp://127.0.0.1:5555', got '{v}'")
        port = m.group(5)
        if port is not None and port != "*" and not 1 <= int(port) <= 65535:
            # ZeroMQ would take the port modulo 65536 and listen somewhere no client is pointed at
            raise ValueError(f"port {port} is out of range 1-65535 (or '*' for any free port), in '{v}'")
        return v

    @model_validator(mode="after")
    def _kinds(self) -> "LineConfig":
        if not self.ingest.startswith("router+"):
            raise ValueError("ingest: must be a 'router+' endpoint (acked ingest)")
        if not self.publish.startswith("pub+"):
            raise ValueError("publish: must be a 'pub+' endpoint")
        if not self.executors:
            raise ValueError("executors: at least one executor is required")
        for i, ex in enumerate(self.executors):
            if ex.node is not None and self.cluster is None:
                raise ValueError(f"executors.{i}.node: '{ex.node}' names a box but the config has no "
                                 "`cluster: {address: ...}` section")
        if self.cluster is not None:
            named = {ex.node for ex in self.executors if ex.node is not None}
            stray = sorted(set(self.cluster.stores) - named)
            if stray:
                raise ValueError(f"cluster.stores: node '{stray[0]}' runs no executor (executor nodes: "
                                 f"{', '.join(sorted(named)) or 'none'})")
        if self.runtime != "torch" and any(ex.node is not None for ex in self.executors):
            raise ValueError(f"runtime: '{self.runtime}' needs each expert's ONNX export beside the store, which "
                             "`coe-agent experts sync` does not copy to other boxes yet; use runtime: torch with "
                             "node executors")
        return self

    @property
    def start_fill(self) -> str:
        """How the pools start (`pool_fill`; unset: CoServe's gpu-first, the paper's round-robin otherwise)."""
        if self.pool_fill is not None:
            return self.pool_fill
        return "gpu-first" if self.scheduler.policy == "coserve" else "round-robin"

    @property
    def spec_path(self) -> Path:
        return Path(self.spec)

    @property
    def db_path(self) -> Path:
        return Path(self.results_db)

    @property
    def store_path(self) -> Path:
        return Path(self.expert_store)


def endpoint_parts(endpoint: str) -> tuple[str, bool, str]:
    """'router+bind:tcp://h:p' -> ('router', True, 'tcp://h:p')."""
    kind, rest = endpoint.split("+", 1)
    how, addr = rest.split(":", 1)
    return kind, how == "bind", addr


def find_config(line: str, config: str | Path | None = None) -> Path:
    """Where `--line A` finds its config: --config, then $COE_CONFIG_DIR, ./configs, the installed copy."""
    if config:
        return Path(config)
    name = f"line-{line}.yaml"
    candidates = []
    if os.environ.get("COE_CONFIG_DIR"):
        candidates.append(Path(os.environ["COE_CONFIG_DIR"]) / name)
    candidates.append(Path.cwd() / "configs" / name)
    candidates.append(Path(__file__).resolve().parent.parent / "configs" / name)
    for c in candidates:
        if c.is_file():
            return c
    raise SpecError(name, "<file>", "no config for line '%s' (looked in: %s)" % (line, ", ".join(str(c.parent) for c in candidates)))


def load_config(path: str | Path, env: Mapping[str, str] | None = None, **overrides: Any) -> LineConfig:
    """Read, override (COE_* variables, then keyword overrides) and validate a line config."""
    path = Path(path)
    src = str(path)
    if not path.is_file():
        raise SpecError(src, "<file>", "config file does not exist")
    try:
        raw = yaml_strict.load(path.read_text(encoding="utf-8")) or {}
    except yaml_strict.DuplicateKey as exc:
        raise SpecError(src, str(exc.key), f"written twice (lines {exc.first} and {exc.line}); keep one") from None
    except yaml.YAMLError as exc:
        raise SpecError(src, "<file>", f"not valid YAML: {yaml_strict.problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(src, "<file>", f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    if not isinstance(raw, dict):
        raise SpecError(src, "<root>", "expected a mapping of config keys")
    env_keys = apply_env(raw, os.environ if env is None else env, src)
    for key, val in overrides.items():
        try:
            _set_path(raw, key.split("."), val)
        except ValueError as exc:
            raise SpecError(src, key, str(exc)) from None
    try:
        cfg = LineConfig(**raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        reason = _plain_reason(err)
        where = src
        for var, dotted in env_keys.items():
            if key == dotted or key.startswith(dotted + ".") or dotted.startswith(key + "."):
                where = f"{var} (overriding {src})"
        if "." not in key and ":" in reason and key == "<root>":
            key, reason = reason.split(":", 1)
            reason = reason.strip()
        raise SpecError(where, key, reason) from None
    return _resolve(cfg, path)


def _plain_reason(err: dict) -> str:
    """pydantic's message for one error, as a line engineer reads it: the value given, no class names, and the
    nearest key for a misspelt one."""
    import difflib
    import re

    reason = err["msg"].removeprefix("Value error, ")
    kind, given = err.get("type", ""), err.get("input")
    if kind == "extra_forbidden":
        parent: Any = LineConfig
        for part in err["loc"][:-1]:
            if isinstance(part, int):          # an item of a list (executors.0.memroy): the list's item type
                continue
            field = getattr(parent, "model_fields", {}).get(part)
            parent = field.annotation if field is not None else None
            for arg in get_args(parent):       # list[ExecutorConfig], ExecutorConfig | None: the model inside
                for inner in (arg, *get_args(arg)):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        parent = inner
        known = list(getattr(parent, "model_fields", {}) or {})
        near = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        return "not a config key" + (f" (did you mean '{near[0]}'?)" if near else "")
    if kind == "model_type" or kind == "dict_type":
        return f"expected a mapping of keys under it, got {str(given)[:60]!r}"
    reason = re.sub(r" or instance of \w+", "", reason)
    if kind.endswith(("_parsing", "_type")) and given is not None and not isinstance(given, (dict, list)):
        reason += f" (got {str(given)[:60]!r})"
    return reason


def _sections() -> list[str]:
    """The config's sections: the keys whose value is a mapping of its own (COE_SECTION__KEY)."""
    def is_model(t: Any) -> bool:
        return isinstance(t, type) and issubclass(t, BaseModel)
    return [k for k, f in LineConfig.model_fields.items()
            if is_model(f.annotation) or any(is_model(a) for a in get_args(f.annotation))
            or any(is_model(b) for a in get_args(f.annotation) for b in get_args(a))]


def apply_env(raw: dict, env: Mapping[str, str], src: str = "<config>") -> dict[str, str]:
    """Apply COE_KEY / COE_SECTION__KEY variables to the raw config; returns var -> dotted key.

    A variable whose path does not fit the config (an index past a list's
    end, a word where a list index goes) is a SpecError naming it.
    """
    applied = {}
    for var, value in sorted(env.items()):
        if not var.startswith(ENV_PREFIX) or var in ("COE_CONFIG_DIR",):
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX):].split("__")]
        if parts[0] not in LineConfig.model_fields:
            if len(parts) > 1:      # COE_SECTION__KEY shaped: a typo in the section would be ignored unseen
                log.warning("%s is not applied: '%s' is no config section (sections: %s)", var, parts[0],
                            ", ".join(_sections()))
            continue
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, (dict, list)) and len(parts) == 1 and parts[0] not in ("executors",):
            parsed = value
        try:
            _set_path(raw, parts, parsed)
        except ValueError as exc:
            raise SpecError(f"{var} (overriding {src})", ".".join(parts), str(exc)) from None
        applied[var] = ".".join(parts)
    return applied


def _set_path(raw: Any, parts: list[str], value: Any) -> None:
    """Set raw[parts[0]][parts[1]]... = value, making mappings and lists on the way; ValueError says why not."""
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt_is_index = parts[i + 1].isdigit()
        if isinstance(node, list):
            if not part.isdigit():
                raise ValueError(f"'{part}' is not a list index (0, 1, ...)")
            if int(part) >= len(node):
                raise ValueError(f"index {part} is past the end of a list of {len(node)}")
            node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"'{parts[i - 1] if i else part}' is a {type(node).__name__}, not a section")
        if part not in node or node[part] is None:
            node[part] = [] if nxt_is_index else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit():
            raise ValueError(f"'{last}' is not a list index (0, 1, ...)")
        idx = int(last)
        while len(node) <= idx:
            node.append({})
        node[idx] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ValueError(f"'{parts[-2] if len(parts) > 1 else last}' is a {type(node).__name__}, not a section")


def _placeholders(template: str, key: str, src: str, **subs: str) -> str:
    """`template` with its {line}/{data_dir} filled in; a SpecError naming the key for any other brace."""
    try:
        return template.format(**subs)
    except KeyError as exc:
        raise SpecError(src, key, f"unknown placeholder {{{exc.args[0]}}} in {template!r} (known: "
                                  f"{', '.join('{' + k + '}' for k in subs)})") from None
    except (ValueError, IndexError) as exc:
        raise SpecError(src, key, f"{template!r}: {exc} (a literal brace is written {{{{ or }}}})") from None


def _resolve(cfg: LineConfig, path: Path) -> LineConfig:
    """Expand {line}/{data_dir}; the spec is relative to the config file, data to the CWD."""
    src = str(path)
    data_dir = Path(_placeholders(cfg.data_dir, "data_dir", src, line=cfg.line)).expanduser()
    subs = {"line": cfg.line, "data_dir": str(data_dir)}

    def fill(template: str, key: str) -> str:
        return _placeholders(template, key, src, **subs)
    spec = Path(fill(cfg.spec, "spec")).expanduser()
    if not spec.is_absolute():
        spec = (path.parent / spec).resolve()
    scheduler = cfg.scheduler.model_copy(update={"profile": str(Path(fill(cfg.scheduler.profile,
                                                                          "scheduler.profile")))})
    llm = cfg.llm
    if llm is not None:
        llm = llm.model_copy(update={
            "store": str(Path(fill(llm.store, "llm.store")).expanduser()),
            "trace": str(Path(fill(llm.trace, "llm.trace")).expanduser()) if llm.trace else None})
    return cfg.model_copy(update={
        "llm": llm,
        "scheduler": scheduler,
        "data_dir": str(data_dir),
        "results_db": str(Path(fill(cfg.results_db, "results_db")).expanduser()),
        "expert_store": str(Path(fill(cfg.expert_store, "expert_store")).expanduser()),
        "spec": str(spec),
        "source": str(path),
    })
