"""Profiled costs: what the CoServe scheduler, the batch splitter and the simulated device read.

A profile holds, per (architecture, device kind), the batch latency model
`K*n + B`, the max useful batch, weight and per-sample activation bytes, and
the load latency from each tier; per device, its memory and the executor
count and expert-memory split found by the offline search; for the box's
storage, the raw disk read rate and the exponent decoder's rate per thread
(`StorageProfile`), from which the cost model prices a compressed expert's
load and the profiler decides whether compression pays.  It is written by
`coe-agent profile` (measured) or shipped as a documented assumption set
(configs/profiles/), and always says which in `source`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from coe import CoEError
from coe.files import write_json_atomic

TIERS = ("ssd", "host")


@dataclass(frozen=True)
class ArchProfile:
    arch: str                      # e.g. 'torchvision/resnet101'
    device: str                    # device kind: 'cpu' | 'cuda'
    K: float                       # seconds per request in a batch
    B: float                       # seconds per batch
    max_batch: int
    weight_bytes: int
    activation_bytes: int          # per sample
    load_seconds: dict[str, float] = field(default_factory=dict)  # tier -> seconds to make it resident
    points: tuple[tuple[int, float], ...] = ()                    # measured (batch size, seconds)
    # bytes on disk of the file the 'ssd' load was timed on when it was stored compressed; 0: a plain file
    # (the cost model needs it to tell the decode in that time from the read and the rebind)
    ssd_stored_bytes: int = 0

    def batch_seconds(self, n: int) -> float:
        return self.K * n + self.B if n > 0 else 0.0

    def load(self, tier: str) -> float:
        """Seconds to load from `tier` ('ssd' or 'host'); 0 for 'resident'."""
        if tier == "resident":
            return 0.0
        if tier not in self.load_seconds:
            raise CoEError(f"profile for {self.arch} on {self.device} has no load latency from tier '{tier}'")
        return self.load_seconds[tier]


@dataclass(frozen=True)
class DeviceProfile:
    name: str                      # e.g. 'cpu', 'cuda:0'
    kind: str                      # 'cpu' | 'cuda'
    memory: int                    # bytes usable by executors of this device
    executors: int = 1             # from the executor-count search
    expert_memory: int | None = None   # bytes for experts, from the memory-split search (rest: activations)
    host_tier: int = 0             # bytes of the shared host tier behind this device (GPU only)
    split_points: tuple[tuple[int, float], ...] = ()   # (experts loaded, throughput) seen by the split search
    count_points: tuple[tuple[int, float], ...] = ()   # (executors, throughput) seen by the count search
    # Contention: aggregate throughput of 1..k executors busy at once on this device, relative to one
    # executor alone (concurrency[0] == 1.0).  Measured by `coe-agent profile`; () means unknown and is
    # read as (1.0,): extra executors add no compute, only overlap (the conservative reading).
    concurrency: tuple[float, ...] = ()
    concurrency_source: str = ""
    # CPU executors split the cores statically (threads = cores / executors); K and B of this device's
    # archs were measured at the thread share of this many executors.
    profiled_executors: int = 1

    @property
    def sharing(self) -> str:
        """'static': a CPU splits its cores once, at start; 'dynamic': busy executors share a GPU."""
        return "static" if self.kind == "cpu" else "dynamic"

    def aggregate(self, m: int) -> float:
        """Aggregate throughput of `m` executors busy together, relative to one (flat past the curve)."""
        curve = self.concurrency or (1.0,)
        if m <= 0:
            return 0.0
        return float(curve[min(m, len(curve)) - 1])

    def speed(self, busy: int, configured: int) -> float:
        """One busy executor's compute speed relative to the profiled K and B.

        dynamic (GPU): `busy` executors share the device, each at c(busy)/busy.
        static (CPU): each of `configured` executors owns cores/configured threads
        whatever the others do: c(n)/n, relative to the share K, B were measured at.
        """
        if self.sharing == "dynamic":
            m = max(1, busy)
            return self.aggregate(m) / m
        n, n0 = max(1, configured), max(1, self.profiled_executors)
        return (self.aggregate(n) / n) / (self.aggregate(n0) / n0)

    def capacity(self, configured: int) -> float:
        """Most compute the device's `configured` executors deliver at once, in units of one at profiled speed."""
        if self.sharing == "dynamic":
            return max(self.aggregate(m) for m in range(1, max(1, configured) + 1))
        return max(1, configured) * self.speed(configured, configured)


@dataclass(frozen=True)
class StorageProfile:
    """The box's expert storage: how fast the disk reads and how fast exponent-coded experts decode.

    A compressed expert's SSD load reads fewer bytes and then decodes them on
    the CPU; the reader pipeline overlaps the two, so it costs the longer of
    the two (`executors.costs.compressed_load_seconds`).  Both rates are
    needed to price it, and to decide whether compression pays on this box:
    it does when decoding is faster than the disk.  `None` means not
    measured, and then nothing is assumed.
    """

    disk_bps: float | None = None          # raw cold read rate of expert files, stored bytes per second
    decode_bps: float | None = None        # decoded bytes/s of ONE decode thread while `decode_threads` decode
    decode_threads: int = 1                # threads one load decodes with (and decoding at once when measured)
    decode_bps_alone: float | None = None  # decoded bytes/s of one thread with the others idle
    # decoded bytes/s of whole loads of the line's own experts through the real reader, file in the page cache
    # (decode only, all decode threads): small tensors make small chunks, whose fixed costs the sample lacks
    load_decode_bps: float | None = None
    ratio: float | None = None             # stored/plain bytes of the line's experts compressed; None: unknown
    source: str = ""                       # how and where the figures were measured, or 'assumed: …'

    @property
    def decode_total_bps(self) -> float | None:
        """Decoded bytes/s of one load: measured on the line's experts where it was, else `decode_threads`
        threads at the contended per-thread rate of the synthetic sample."""
        if self.load_decode_bps:
            return self.load_decode_bps
        return self.decode_bps * self.decode_threads if self.decode_bps else None

    @property
    def compression_pays(self) -> bool | None:
        """Whether a compressed load beats a plain one here: decoding outruns the raw disk (None: unknown).

        A plain load takes decoded/disk, a compressed one max(ratio x decoded/disk,
        decoded/decode); for any ratio below 1 the second is smaller exactly when
        decode > disk, so the verdict does not depend on the ratio, only its size does.
        """
        if not self.disk_bps or not self.decode_total_bps:
            return None
        return self.decode_total_bps > self.disk_bps

    def load_factor(self, ratio: float) -> float | None:
        """A compressed load's time over the plain one at `ratio`: max(ratio, disk / decode) (None: unknown)."""
        if not self.disk_bps or not self.decode_total_bps:
            return None
        return max(ratio, self.disk_bps / self.decode_total_bps)

    def to_json(self) -> dict:
        return {**asdict(self), "compression_pays": self.compression_pays}   # derived: for a reader, not read back

    @classmethod
    def from_json(cls, raw: dict, where: str) -> "StorageProfile":
        raw = _mapping(raw, where)
        v = _fields(cls, {k: raw[k] for k in raw if k != "compression_pays"}, where)
        s = cls(**v)
        for name in ("disk_bps", "decode_bps", "decode_bps_alone", "load_decode_bps", "ratio"):
            x = getattr(s, name)
            if x is not None and not (_number(x) and x > 0):
                raise ValueError(f"{where}.{name}: must be a positive number or null, got {x!r}")
        if not (isinstance(s.decode_threads, int) and not isinstance(s.decode_threads, bool)
                and s.decode_threads >= 1):
            raise ValueError(f"{where}.decode_threads: must be an integer >= 1, got {s.decode_threads!r}")
        if not isinstance(s.source, str):
            raise ValueError(f"{where}.source: must be a string, got {s.source!r}")
        return s


@dataclass
class Profile:
    source: str                    # 'measured on …' or 'assumed: …' — never ambiguous
    devices: dict[str, DeviceProfile]
    archs: dict[str, ArchProfile]  # key: f"{arch}@{device kind}"
    notes: list[str] = field(default_factory=list)
    storage: StorageProfile | None = None   # None: a profile from before decode costs were measured
    # what it was measured for: {"line": ..., "spec": sha256 of the spec file, "box": {device: its hardware}};
    # empty for an assumed profile or one from before this was recorded (then nothing is checked)
    made_for: dict = field(default_factory=dict)

    @staticmethod
    def key(arch: str, kind: str) -> str:
        return f"{arch}@{kind}"

    def arch(self, arch: str, kind: str) -> ArchProfile:
        try:
            return self.archs[self.key(arch, kind)]
        except KeyError:
            known = ", ".join(sorted(self.archs))
            raise CoEError(f"profile ({self.source}) has no entry for {arch} on {kind}; "
                           f"run `coe-agent profile` (known: {known})") from None

    def to_json(self) -> dict:
        return {"source": self.source, "notes": self.notes,
                "devices": {k: {**asdict(v), "split_points": [list(p) for p in v.split_points],
                                "count_points": [list(p) for p in v.count_points],
                                "concurrency": list(v.concurrency)}
                            for k, v in self.devices.items()},
                "archs": {k: {**asdict(v), "points": [list(p) for p in v.points]} for k, v in self.archs.items()},
                **({"storage": self.storage.to_json()} if self.storage is not None else {}),
                **({"made_for": self.made_for} if self.made_for else {})}

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_json(), sort_keys=False)

    @classmethod
    def from_json(cls, raw: dict, src: str = "<profile>") -> "Profile":
        try:
            unknown = sorted(set(raw) - set(PROFILE_KEYS))
            if unknown:     # a typo ('storge') silently dropped what it named
                raise ValueError(f"{', '.join(unknown)}: not a profile field (fields: {', '.join(PROFILE_KEYS)})")
            if not isinstance(raw["source"], str):
                raise ValueError(f"source: must be a string saying how the profile was made ('measured on ...' or "
                                 f"'assumed: ...'), got {raw['source']!r}")
            notes = raw.get("notes", [])
            if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
                raise ValueError(f"notes: must be a list of strings, got {notes!r}")
            devices = {}
            if not _mapping(raw["devices"], "devices"):     # the simulated systems take their devices from here
                raise ValueError("devices: empty: a profile needs at least one device")
            for k, v in raw["devices"].items():
                where = f"devices.{k}"
                try:
                    v = _fields(DeviceProfile, dict(_mapping(v, where)), where)
                    for f in ("split_points", "count_points"):
                        v[f] = _pairs(v.get(f, ()), f"{where}.{f}")
                    curve = v.get("concurrency", ())
                    if not (isinstance(curve, (list, tuple)) and all(_number(c) for c in curve)):
                        raise ValueError(f"{where}.concurrency: must be a list of numbers, got {curve!r}")
                    v["concurrency"] = curve = tuple(float(c) for c in curve)
                    # a GPU shared by m executors cannot beat m whole GPUs (one alone has all of it: c(m) <= m); a
                    # CPU can, against one executor whose threads fight each other, so only the GPU is held to it
                    shared = v.get("kind") != "cpu"
                    if curve and (abs(curve[0] - 1.0) > 1e-6
                                  or any(not (0 < c and math.isfinite(c)) or (shared and c > m + 1e-9)
                                         for m, c in enumerate(curve, 1))):
                        raise ValueError(f"{where}.concurrency: must start at 1.0 and hold positive numbers, "
                                         f"on a GPU c(m) <= m (m executors cannot beat m GPUs), got {list(curve)}")
                    d = DeviceProfile(**v)
                    if d.name != k:     # the simulator and the agent go by the name, the curve lookups by the key
                        raise ValueError(f"{where}.name: must be the entry's key '{k}', got {d.name!r}")
                    _check_device(k, d)
                except (TypeError, ValueError) as exc:
                    raise _at(where, exc) from None
                devices[k] = d
            archs = {}
            for k, v in _mapping(raw["archs"], "archs").items():
                where = f"archs.{k}"
                try:
                    v = _fields(ArchProfile, dict(_mapping(v, where)), where)
                    v["points"] = tuple(tuple(p) for p in v.get("points", ()))
                    a = ArchProfile(**v)
                    _check_arch(k, a)
                except (TypeError, ValueError) as exc:
                    raise _at(where, exc) from None
                archs[k] = a
            hosted = [(k, d.host_tier) for k, d in devices.items() if d.host_tier > 0]
            for k, a in archs.items():      # every switch from the host tier reads it (GPU and CPU host reads)
                if hosted and "host" not in a.load_seconds:
                    raise ValueError(f"archs.{k}.load_seconds: has no 'host' time, and devices.{hosted[0][0]} has a "
                                     f"host tier ({hosted[0][1]} bytes) that every load from it is priced by")
            storage = raw.get("storage")
            storage = StorageProfile.from_json(storage, "storage") if storage is not None else None
            made_for = _mapping(raw.get("made_for", {}), "made_for")
            for k in ("line", "spec"):
                if k in made_for and not isinstance(made_for[k], str):
                    raise ValueError(f"made_for.{k}: must be a string, got {made_for[k]!r}")
            box = _mapping(made_for.get("box", {}), "made_for.box")
            if not all(isinstance(v, str) for v in box.values()):
                raise ValueError("made_for.box: must map device names to descriptions")
            return cls(source=raw["source"], devices=devices, archs=archs, notes=list(notes),
                       storage=storage, made_for=dict(made_for))
        except KeyError as exc:
            raise CoEError(f"{src}: malformed profile: missing {exc}") from None
        except (TypeError, ValueError, IndexError) as exc:
            raise CoEError(f"{src}: malformed profile: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CoEError(f"{path}: profile does not exist (run `coe-agent profile`)") from None
        except json.JSONDecodeError as exc:
            raise CoEError(f"{path}: malformed profile: not JSON ({exc})") from None
        except UnicodeDecodeError as exc:
            raise CoEError(f"{path}: malformed profile: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if not isinstance(raw, dict):
            raise CoEError(f"{path}: malformed profile: expected a JSON object, got {type(raw).__name__}")
        return cls.from_json(raw, str(path))


MAX_EXECUTORS = 64      # what a line config allows per device (`ExecutorConfig.count`)


PROFILE_KEYS = ("source", "notes", "devices", "archs", "storage", "made_for")   # what `Profile.to_json` writes


def _mapping(x, where: str) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(x).__name__}")
    return x


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fields(cls, v: dict, where: str) -> dict:
    """`v` if it holds only fields of dataclass `cls` and all its required ones (ValueError naming `where`)."""
    from dataclasses import MISSING, fields

    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(v) - set(known))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: not a field here (fields: {', '.join(known)})")
    missing = [n for n, f in known.items() if n not in v and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(repr(n) for n in missing)}")
    return v


def _pairs(x, where: str) -> tuple[tuple[int, float], ...]:
    """A device's search points: [[whole number >= 0, number >= 0], ...] (ValueError naming `where`)."""
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"{where}: expected a list of [n, throughput] pairs, got {x!r}")
    for i, p in enumerate(x):
        if not (isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                and p[0] >= 0 and _number(p[1]) and p[1] >= 0):
            raise ValueError(f"{where}[{i}]: must be [a whole number >= 0, a throughput >= 0], got {p!r}")
    return tuple(tuple(p) for p in x)


def _at(where: str, exc: Exception) -> ValueError:
    """`exc` as a ValueError whose message starts with the field path `where` (added where it lacks it)."""
    msg = str(exc)
    return ValueError(msg if msg.startswith(where) else f"{where}: {msg}")


LOAD_TIERS = ("ssd", "host")    # where a load can come from (`ArchProfile.load`)


def _check_arch(key: str, a: ArchProfile) -> None:
    """An arch entry's numbers are used as they are by the scheduler and the pools: refuse any they could not
    (ValueError naming `archs.<key>.<field>`), not an agent that starts and then fails every frame."""
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)
    where = f"archs.{key}"
    for name in ("K", "B"):
        x = getattr(a, name)
        if not (number(x) and x >= 0):
            raise ValueError(f"{where}.{name}: must be a finite number of seconds >= 0, got {x!r}")
    if a.K + a.B <= 0:      # every batch predicted to take no time: the scheduler's choices would be blind
        raise ValueError(f"{where}: K and B are both 0; a batch takes time (profile this arch again)")
    if not (whole(a.max_batch) and a.max_batch >= 1):
        raise ValueError(f"{where}.max_batch: must be a whole number >= 1, got {a.max_batch!r}")
    for name in ("weight_bytes", "activation_bytes", "ssd_stored_bytes"):
        x = getattr(a, name)
        if not (whole(x) and x >= 0):
            raise ValueError(f"{where}.{name}: must be a whole number of bytes >= 0, got {x!r}")
    if a.weight_bytes < 1:   # the switch cost re-prices a compressed load per weight byte
        raise ValueError(f"{where}.weight_bytes: an expert has weights: must be >= 1, got {a.weight_bytes!r}")
    if a.device not in ("cpu", "cuda"):
        raise ValueError(f"{where}.device: must be 'cpu' or 'cuda', got {a.device!r}")
    if key != Profile.key(a.arch, a.device):
        raise ValueError(f"{where}: the key must be '{Profile.key(a.arch, a.device)}' (its arch@device)")
    if not isinstance(a.load_seconds, dict):
        raise ValueError(f"{where}.load_seconds: expected an object of tier: seconds, got {a.load_seconds!r}")
    for tier, x in a.load_seconds.items():
        if tier not in LOAD_TIERS:     # a typo ('sdd') left 'ssd' missing: every switch raised while serving
            raise ValueError(f"{where}.load_seconds.{tier}: not a tier (tiers: {', '.join(LOAD_TIERS)})")
        if not (number(x) and x >= 0):
            raise ValueError(f"{where}.load_seconds.{tier}: must be a finite number of seconds >= 0, got {x!r}")
    if "ssd" not in a.load_seconds:
        raise ValueError(f"{where}.load_seconds: has no 'ssd' time (every switch from the SSD needs it)")
    for i, p in enumerate(a.points):
        if not (len(p) == 2 and whole(p[0]) and p[0] >= 1 and number(p[1]) and p[1] >= 0):
            raise ValueError(f"{where}.points[{i}]: must be [batch size >= 1, seconds >= 0], got {list(p)!r}")


def _check_device(name: str, d: DeviceProfile) -> None:
    """A device entry's numbers are what the agent will use as they are: refuse any it could not (ValueError)."""
    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)
    if d.kind not in ("cpu", "cuda"):
        raise ValueError(f"devices.{name}.kind: must be 'cpu' or 'cuda', got {d.kind!r}")
    if not (whole(d.memory) and d.memory > 0):
        raise ValueError(f"devices.{name}.memory: must be a positive number of bytes, got {d.memory!r}")
    if not (whole(d.executors) and 1 <= d.executors <= MAX_EXECUTORS):
        raise ValueError(f"devices.{name}.executors: must be an integer from 1 to {MAX_EXECUTORS}, got {d.executors!r}")
    if d.expert_memory is not None and not (whole(d.expert_memory) and 0 <= d.expert_memory <= d.memory):
        raise ValueError(f"devices.{name}.expert_memory: must be bytes from 0 to its memory ({d.memory}), "
                         f"got {d.expert_memory!r}")
    if not (whole(d.host_tier) and d.host_tier >= 0):
        raise ValueError(f"devices.{name}.host_tier: must be a number of bytes >= 0, got {d.host_tier!r}")
    if d.kind == "cpu" and d.host_tier:     # the host tier backs GPU pools; a CPU's pools are host memory already
        raise ValueError(f"devices.{name}.host_tier: a host tier is for a GPU device only, and {name} is a CPU "
                         f"(give it 0 or put the tier on the GPU), got {d.host_tier!r}")
    if not isinstance(d.concurrency_source, str):
        raise ValueError(f"devices.{name}.concurrency_source: must be a string, got {d.concurrency_source!r}")
    if not (whole(d.profiled_executors) and d.profiled_executors >= 1):
        raise ValueError(f"devices.{name}.profiled_executors: must be an integer >= 1, got {d.profiled_executors!r}")


def fit_latency(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares K, B for latency = K*n + B, both >= 0: where the free fit makes one negative, it is 0 and
    the other is refitted alone (clamping K to 0 and keeping the free fit's B put B above every measured point:
    (1, 1.0), (2, 0.9), (4, 0.8) gave B = 1.05; refitted, 0.9)."""
    n = len(points)
    if n < 2:
        raise ValueError("need at least two (batch, seconds) points to fit K and B")
    sx = sum(p[0] for p in points)
    sy = sum(p[1] for p in points)
    sxx = sum(p[0] ** 2 for p in points)
    sxy = sum(p[0] * p[1] for p in points)
    den = n * sxx - sx * sx
    k = (n * sxy - sx * sy) / den if den else 0.0
    b = (sy - k * sx) / n
    if k < 0:                       # no per-request cost: the best constant is the mean
        return 0.0, max(sy / n, 0.0)
    if b < 0:                       # no fixed cost: the best line through the origin
        return (sxy / sxx if sxx else 0.0), 0.0
    return k, b


def max_useful_batch(points: list[tuple[int, float]], tolerance: float = 0.05) -> int:
    """The smallest batch whose per-request latency is within `tolerance` of the best measured.

    That is where the average latency plateaus (paper §4.5): a bigger batch
    no longer buys throughput, only memory and latency.
    """
    pts = sorted(points)
    best = min(s / n for n, s in pts)
    return next(n for n, s in pts if s / n <= best * (1 + tolerance))


def decay_window_search(throughput, n_max: int, *, window: int = 15, margin: float = 0.05,
                        fit_points: int = 3) -> tuple[int, int, list[tuple[int, float]]]:
    """CoServe's memory-split search (paper §4.4, Eq. 1-3) over 'number of experts loaded'.

    `throughput(n)` runs sample inference with n experts resident.  The window
    starts at [0, window]; each slide moves it up by its size and shrinks the
    size by the decay factor 1 - window/100 (Eq. 1; never below one expert).
    The first `fit_points` upper-bound throughputs, and only those, are fitted
    linearly, f(n) = k*n + b (Eq. 2): that is the upward trend the paper
    expects while more experts still pay.  Every later sample is compared with
    the fit's prediction and sliding stops at the first one where
    (f(n) - actual) / f(n) > margin (Eq. 3), so a plateau or a decline trips
    it a bounded number of samples after it starts.  Two cases Eq. 3 cannot
    catch stop it too: a fit with no upward trend (k <= 0: more experts did
    not pay from the start, and a flat or falling line would be followed to
    the end), right after the fit; and a prediction f(n) <= 0.  Otherwise the
    search ends when the upper bound reaches `n_max` (the caller's cap: the
    most experts that fit the expert memory).  Returns the final window (low,
    high) and the measured points in the order measured; `stop_reason(points,
    ...)` tells why it ended.
    """
    if n_max < 1:
        raise ValueError(f"n_max must be at least 1, got {n_max}")
    if fit_points < 2:
        raise ValueError(f"fit_points must be at least 2 (a line needs two points), got {fit_points}")
    decay = 1 - window / 100.0
    low, size = 0, float(window)
    points: list[tuple[int, float]] = []
    fit: tuple[float, float] | None = None
    while True:
        high = min(n_max, max(low + 1, int(round(low + size))))
        tp = float(throughput(high))
        points.append((high, tp))
        if fit is not None and _deviates(fit, high, tp, margin):
            return low, high, points
        if fit is None and len(points) == fit_points:
            fit = _fit(points)
            if fit[0] <= 0:
                return low, high, points
        if high >= n_max:
            return low, high, points
        low = high
        size = max(1.0, size * decay)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (k, b) of y = k*x + b through `points` (Eq. 2).

    The search calls it once, on its first `fit_points` samples: refitting on
    every sample would let the line bend to follow a plateau and Eq. 3 would
    never trip.
    """
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return k, my - k * mx


def _deviates(fit: tuple[float, float], n: int, actual: float, margin: float) -> bool:
    """Eq. 3: the sample at `n` falls below the fitted trend by more than `margin` (or the trend is <= 0)."""
    expected = fit[0] * n + fit[1]
    return expected <= 0 or (expected - actual) / expected > margin


def stop_reason(points: list[tuple[int, float]], *, margin: float = 0.05, fit_points: int = 3) -> str:
    """Why a `decay_window_search` that measured `points` (with these parameters) ended.

    'Eq. 3' (the last sample fell below the fitted trend), 'no upward trend'
    (the fit of the first points had slope <= 0), or '' (it reached n_max on
    the trend).
    """
    if len(points) < fit_points:
        return ""
    fit = _fit(points[:fit_points])
    if len(points) == fit_points:
        return "no upward trend" if fit[0] <= 0 else ""
    n, tp = points[-1]
    return "Eq. 3" if _deviates(fit, n, tp, margin) else ""


def spec_digest(path: str | Path) -> str:
    """sha256 of a spec file's bytes: what a profile records as the spec it searched the split for."""
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def box_identity(devices: list[str]) -> dict[str, str]:
    """What each device of this box is (CPU model and usable cores; GPU name and memory): a profile measured on
    other hardware is not this box's."""
    out = {}
    for dev in devices:
        if dev == "cpu":
            model = ""
            try:
                with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                    model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
            except OSError:
                pass
            import os

            try:
                cores = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cores = os.cpu_count() or 1
            out[dev] = f"{model or 'cpu'}, {cores} cores"
        elif dev.startswith("cuda"):
            try:
                import torch

                i = int(dev.split(":")[1]) if ":" in dev else 0
                props = torch.cuda.get_device_properties(i)
                out[dev] = f"{props.name}, {props.total_memory // 2**20} MiB"
            except Exception:  # noqa: BLE001 - no CUDA here: nothing to record for it
                continue
    return out
