"""The profiled cost model the CoServe scheduler predicts with.

It answers the scheduler's three questions from a `Profile` plus the live
pools: how long a batch takes (K, B for the expert's architecture on the
executor's device), how long a switch takes (0 if resident, else the profiled
load from the tier where the expert lives now), and how big a batch may be
(min of the profiled max batch and what fits in the executor's free memory).
Architectures the profile does not cover fall back to stated estimates, so an
agent without a profile still runs; `estimated` lists them.

An executor on another box (issue 15) pays for its frames' trip: the cost
model adds the link's per-frame transfer to K and its one-way latency to B
(`ExecutorInfo.link`), because the batch cannot start before its frames
arrive.  Each box reads its own SSD and has its own host tier, so an
executor names its SSD channel and its host tier; on one box those are the
shared defaults and nothing changes.

An expert stored compressed (exponent-zstd) loads from SSD in
`compressed_load_seconds` instead of its architecture's profiled plain load,
once the profile knows the box's disk and decode rates (`StorageProfile`):
the scheduler then predicts the switch the reader will actually make.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from coe import CoEModel

from .links import DEFAULT_FRAME_BYTES, Link
from .profile import ArchProfile, Profile, StorageProfile

log = logging.getLogger(__name__)

# Stated estimates for an unprofiled architecture: a 1.5 GB/s SSD, a 10 GB/s host copy, and
# per-request compute proportional to weight bytes.  Only used until `coe-agent profile` runs.
SIZE_RETRY_S = 5.0     # `fits`: an expert size that could not be read is read again after this long
EST_SSD_BPS = 1.5e9
EST_HOST_BPS = 10e9
EST_K_PER_BYTE = 1.0 / 4e9
EST_B = 0.002


@dataclass
class ExecutorInfo:
    device_kind: str      # 'cpu' | 'cuda'
    memory: int           # the executor's whole budget: experts + activations
    pool: object          # storage.pool.Pool (experts resident on this executor)
    device: str | None = None   # the profile's device name ('cpu', 'cuda:0'); default: the first of its kind
    node: str = ""              # the box it runs on ('' = the front box); executors share a device only on one box
    link: Link | None = None    # the link its frames cross (None: on the front box, no transfer)
    host: object | None = None  # its box's host tier (None: the cost model's shared `host`)
    ssd_channel: str = ""       # the SSD its switches read from: one per box
    # a CPU executor that copies what the host tier holds (storage.tiers.HostReadSource; GPUs always do): True,
    # or a predicate on the expert id (the source's `compatible`: only where both tiers hold the same dtype)
    host_reads: "bool | Callable[[str], bool]" = False
    # a CPU executor's thread share as an executor count (cores // its threads): what its compute speed is
    # relative to the profiled one by (None: the count of the device's executors in this model, as the
    # simulator runs them; the agent splits the cores among every executor, GPU ones included)
    thread_share: int | None = None


@dataclass(frozen=True)
class StoredForm:
    """How one compressed expert sits on disk: `stored` bytes in the file that decode to `decoded` bytes."""

    stored: int
    decoded: int


# expert id -> its StoredForm when it is stored compressed, None when plain
StoredLookup = Callable[[str], "StoredForm | None"]


def compressed_load_seconds(stored: float, decoded: float, disk_bps: float, decode_bps: float) -> float:
    """Seconds to load an expert of `decoded` bytes stored compressed in `stored` bytes.

    max(), not the sum: the compressed reader is a pipeline (storage.compressed)
    in which the read of the next chunk group is in flight while the current
    one decodes, so the disk and the decoder work at once and the slower of
    the two sets the pace.  Disk-bound (decode faster than the disk delivers
    decoded bytes) it is stored / disk: the bytes saved are time saved;
    decode-bound it is decoded / decode, and compression costs time.
    """
    if disk_bps <= 0 or decode_bps <= 0:
        raise ValueError(f"disk and decode rates must be positive, got disk {disk_bps} B/s, decode {decode_bps} B/s")
    return max(stored / disk_bps, decoded / decode_bps)


def ssd_load_seconds(arch: ArchProfile, form: StoredForm | None, storage: StorageProfile | None) -> float:
    """An expert's SSD load: the arch's profiled one, with the transfer re-priced for how the expert is stored.

    The profiled load is transfer + the rest (rebind, host-to-device copy),
    timed on a file stored as `arch.ssd_stored_bytes` says.  The rest is what
    is left after taking out that file's modelled transfer, and it stays; the
    transfer becomes the expert's own: decoded / disk for a plain expert,
    `compressed_load_seconds` for a compressed one.  So a plain expert timed
    plain keeps exactly its profiled load.  The disk rate is the profile's
    measured one, else the arch's own effective rate (weight bytes over its
    profiled load: all of it transfer).  Without a decode rate the profiled
    load stands: nothing is known to re-price it with.
    """
    measured = arch.load("ssd")
    decode = storage.decode_total_bps if storage is not None else None
    if decode is None or measured <= 0 or (form is None and not arch.ssd_stored_bytes):
        return measured
    disk = storage.disk_bps or arch.weight_bytes / measured

    def transfer(f: StoredForm | None, decoded: int) -> float:
        return decoded / disk if f is None else compressed_load_seconds(f.stored, f.decoded, disk, decode)
    timed = StoredForm(arch.ssd_stored_bytes, arch.weight_bytes) if arch.ssd_stored_bytes else None
    rest = max(0.0, measured - transfer(timed, arch.weight_bytes))
    return rest + transfer(form, form.decoded if form is not None else arch.weight_bytes)


def store_forms(store) -> StoredLookup:
    """A StoredLookup over an ExpertStore's manifest, read at each call (a recompress changes it live)."""
    def lookup(expert_id: str) -> StoredForm | None:
        if not store.has(expert_id):
            return None
        e = store.entry(expert_id)
        if e.compression == "none":
            return None
        return StoredForm(e.stored_nbytes, e.nbytes)
    return lookup


def uniform_forms(model: CoEModel, ratio: float) -> StoredLookup:
    """Every expert of `model` stored at `ratio` of its bytes (the simulation's what-if); 1.0: all plain."""
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio must be in (0, 1] (stored over plain bytes), got {ratio}")
    if ratio == 1:
        return lambda expert_id: None
    forms = {k: StoredForm(round(e.nbytes * ratio), e.nbytes) for k, e in model.experts.items()}
    return forms.get


def estimated_arch(arch: str, kind: str, weight_bytes: int, max_batch: int) -> ArchProfile:
    return ArchProfile(arch=arch, device=kind, K=max(weight_bytes * EST_K_PER_BYTE, 1e-4), B=EST_B,
                       max_batch=max_batch, weight_bytes=weight_bytes, activation_bytes=max(weight_bytes // 8, 1),
                       load_seconds={"ssd": weight_bytes / EST_SSD_BPS, "host": weight_bytes / EST_HOST_BPS})


class ProfileCosts:
    """K, B, switch and batch-cap answers for the scheduler, from a profile and the live pools.

    K and B are the profiled figures divided by the executor's compute speed
    when every executor of its device is busy (the device's concurrency
    curve): executors that share a device share its compute, and a queue's
    prediction is made for the loaded system it will run in.
    """

    def __init__(self, model: CoEModel, executors: dict[str, ExecutorInfo], profile: Profile | None = None, *,
                 host=None, default_max_batch: int = 16, ssd_inflight=None, arriving=None, host_arriving=None,
                 stored: StoredLookup | None = None, frame_bytes: int = DEFAULT_FRAME_BYTES) -> None:
        self.model, self.executors, self.profile, self.host = model, executors, profile, host
        self.frame_bytes = frame_bytes
        self._stored = stored or (lambda expert_id: None)
        self._storage = profile.storage if profile is not None else None
        if stored is not None and not (self._storage and self._storage.decode_total_bps):
            packed = sum(1 for e in model.experts if stored(e) is not None)
            if packed:
                log.warning("%d expert(s) are stored compressed but the profile has no decode rate: their "
                            "switches are predicted at the plain load (rerun `coe-agent profile`)", packed)
        self._ssd_inflight = ssd_inflight
        self._arriving = arriving or (lambda executor, expert_id: 0.0)
        # seconds until the host tier's copy of an expert is there to copy from: the simulator admits an SSD
        # read into the host tier when it is issued, so a copy may still be on its way (the agent's host tier
        # holds an expert only once its read is in, so there it is 0)
        self._host_arriving = host_arriving or (lambda executor, expert_id: 0.0)
        self._speed = {name: self._full_load_speed(name) for name in executors}
        self._size_failed: dict[tuple[str, str], float] = {}   # (executor, expert) -> when its size read failed
        self._arch: dict[tuple[str, str], ArchProfile] = {}
        self.estimated: set[str] = set()
        for e in model.experts.values():
            for info in executors.values():
                key = (e.arch, info.device_kind)
                if key in self._arch:
                    continue
                if profile is not None and Profile.key(*key) in profile.archs:
                    self._arch[key] = profile.archs[Profile.key(*key)]
                else:
                    self._arch[key] = estimated_arch(e.arch, info.device_kind, e.nbytes, default_max_batch)
                    self.estimated.add(Profile.key(*key))
        if self.estimated:
            log.warning("no profiled costs for %s: scheduling on estimates (run `coe-agent profile`)",
                        ", ".join(sorted(self.estimated)))

    def _full_load_speed(self, name: str) -> float:
        dev = self.device_profile(name)
        if dev is None:
            return 1.0
        info = self.executors[name]
        n = sum(1 for other, o in self.executors.items() if o.node == info.node and self.device_profile(other) is dev)
        if dev.sharing != "dynamic" and info.thread_share:
            return dev.speed(info.thread_share, info.thread_share)
        return dev.speed(n, n)

    def device_profile(self, name: str):
        """The profile's DeviceProfile for executor `name` (None without a profile or device entry)."""
        if self.profile is None:
            return None
        info = self.executors[name]
        if info.device is not None and info.device in self.profile.devices:
            return self.profile.devices[info.device]
        return next((d for d in self.profile.devices.values() if d.kind == info.device_kind), None)

    def ssd_inflight(self, channel: str = "") -> float | None:
        """Seconds of SSD reads under way on `channel` (the simulator's SSD of one box); None where the
        device is not watched, and the scheduler counts the reads of the batches it handed out instead."""
        if self._ssd_inflight is None:
            return None
        return self._ssd_inflight(channel) if channel else self._ssd_inflight()

    def ssd_channel(self, executor: str) -> str:
        """The SSD `executor`'s switches read from ('' on a single box: the one shared SSD)."""
        return self.executors[executor].ssd_channel

    def transfer(self, executor: str) -> tuple[float, float]:
        """(seconds per frame, seconds per batch) of sending frames to `executor`'s node; (0, 0) on the front box."""
        link = self.executors[executor].link
        if link is None:
            return 0.0, 0.0
        return link.per_request(self.frame_bytes), link.latency_s

    def arch(self, executor: str, expert_id: str) -> ArchProfile:
        return self._arch[(self.model.experts[expert_id].arch, self.executors[executor].device_kind)]

    def exec_cost(self, executor: str, expert_id: str) -> tuple[float, float]:
        a = self.arch(executor, expert_id)
        s = self._speed[executor]
        per_frame, per_batch = self.transfer(executor)
        return a.K / s + per_frame, a.B / s + per_batch

    def tier_of(self, executor: str, expert_id: str) -> str:
        pool = self.executors[executor].pool
        present = getattr(pool, "present", pool.contains)   # loading counts as arriving, not absent
        if present(expert_id):
            return "resident"
        # GPU pools load through the host tier; a CPU executor copies from it only with `host_reads`, else it
        # reads the SSD
        info = self.executors[executor]
        host = info.host if info.host is not None else self.host
        if host is None or not host.contains(expert_id):
            return "ssd"
        reads = info.device_kind == "cuda" or (info.host_reads(expert_id) if callable(info.host_reads)
                                               else info.host_reads)
        if reads:
            return "host"
        return "ssd"

    def fits(self, executor: str, expert_id: str) -> bool:
        """Whether `executor`'s pool can hold `expert_id` at all: the size its pool's source loads it at (cast to
        the executor's compute dtype: an fp16 expert takes twice its file in an fp32 CPU pool) within the
        pool's capacity.  The scheduler assigns an expert only where it can be loaded.  The source's size is
        cached by the store per expert version; the agent reads every expert's once at start and each new
        version's when a promotion switches to it.  A size that cannot be read (a file gone) is taken from the
        spec, and not read again for `SIZE_RETRY_S`: this runs under the scheduler's lock, and each try costs a
        stat and a manifest read (the load itself says why, naming the file)."""
        pool = self.executors[executor].pool
        cap = getattr(pool, "capacity", None)
        if cap is None:
            return True
        key = (executor, expert_id)
        failed = self._size_failed.get(key)
        need = None
        if failed is None or time.monotonic() - failed >= SIZE_RETRY_S:
            try:
                source = getattr(pool, "source", None)
                need = source.size(expert_id) if source is not None else pool.size(expert_id)
                self._size_failed.pop(key, None)
            except Exception:  # noqa: BLE001 - unknown here: the spec's size stands in (below)
                self._size_failed[key] = time.monotonic()
        if need is None:
            e = self.model.experts.get(expert_id)
            need = e.nbytes if e is not None else 0
        return need <= cap

    def switch_cost(self, executor: str, expert_id: str) -> float:
        """The load time from the tier where the expert lives; for one already loading (resident in the
        pool's books), what is left of its load where that is known (the simulator's prefetches); from the
        host tier, after its copy there has arrived (`host_arriving`)."""
        tier = self.tier_of(executor, expert_id)
        if tier == "resident":
            return self._arriving(executor, expert_id)
        if tier == "host":
            return self._host_arriving(executor, expert_id) + self.load_seconds(executor, expert_id, tier)
        return self.load_seconds(executor, expert_id, tier)

    def load_seconds(self, executor: str, expert_id: str, tier: str) -> float:
        """Seconds to load `expert_id` on `executor` from `tier`; from SSD, as the expert is stored."""
        a = self.arch(executor, expert_id)
        if tier != "ssd":
            return a.load(tier)
        return ssd_load_seconds(a, self._stored(expert_id), self._storage)

    def ssd_seconds(self, executor: str, expert_id: str) -> float:
        tier = self.tier_of(executor, expert_id)
        return self.load_seconds(executor, expert_id, "ssd") if tier == "ssd" else 0.0

    def max_batch(self, executor: str, expert_id: str, *, memory: bool = True) -> int:
        a = self.arch(executor, expert_id)
        if not memory:
            return a.max_batch
        info = self.executors[executor]
        used = info.pool.used_bytes()
        if not info.pool.contains(expert_id):
            used += a.weight_bytes
        fits = (info.memory - used) // max(a.activation_bytes, 1)
        return max(1, min(a.max_batch, int(fits)))

    def resident(self, executor: str) -> set[str]:
        return set(self.executors[executor].pool.resident())
