"""The tier sources: how bytes get from SSD to host memory to device memory.

SSD -> host: `StoreSource` reads an expert file sequentially into one private
buffer (pinned when a GPU will copy from it, so the copy can be asynchronous).
Host -> device: `TierSource` copies a parent tier's buffer into the device tier,
on CUDA with a non-blocking copy on a side stream, and records how many bytes
the allocator really handed out (`measured_nbytes`), which the pool accounts.
With unified memory (Jetson) the parent is the store itself: the host buffer
is only staging and is dropped after the copy, so no expert is held twice.

Inclusive or exclusive host tier.  Inclusive (the paper's reading, Samba-CoE):
every GPU load goes through the host tier, which keeps a copy, so the host
tier mostly duplicates what the GPU pools hold.  Exclusive (`TierSource(...,
exclusive=True)` with `demote`): the host tier is a victim cache.  A GPU miss
is served from it when the expert is there (and the host copy is then
discarded), else read from SSD through a staging buffer that the host tier
does not keep; a GPU victim moves down into it (`demote`, a device-to-host
copy into a pinned buffer, an evicted one of the same size when there is one).
GPU and host memory together then hold more distinct experts.

CPU executors read through the host tier too (`HostReadSource`): an expert
the host tier holds is copied from RAM, not read from the shared SSD.  With
an exclusive host tier a CPU executor's victim moves down into it as a GPU
victim does (`HostReadSource.demote`, a RAM-to-RAM copy, pinned when the host
tier pins): its next use, on a CPU executor or a GPU, is then a host copy
instead of an SSD read.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .flat import FlatWeights
from .pinned import host_empty
from .pool import WAIT_CHECK_S, Pool, PoolEvent

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch


def source_dtype(setting: str) -> str:
    """What a StoreSource casts to for a config's compute dtype: 'stored' computes in the stored dtype."""
    return StoreSource.UNIFORM if setting == "stored" else setting


def take_buffer(reuse, nbytes: int, device, pinned: bool | None = None) -> FlatWeights | None:
    """An evicted value whose buffer holds exactly `nbytes` on `device`, or None."""
    for v in reuse:
        buf = getattr(v, "buffer", None)
        if (buf is not None and buf.numel() == nbytes and buf.device == device
                and (pinned is None or buf.is_pinned() == pinned)):
            reuse.remove(v)
            return v
    return None


class SpareBuffers:
    """Host buffers kept for reuse instead of freed: a device tier's staging, an exclusive tier's promotions.

    An exclusive tier frees a host buffer at each promotion and needs one at
    each staged SSD read and each demotion; without these, each is a fresh
    page-locked allocation (`host_empty(pin=True)`, `cudaHostRegister`) and
    a release.  On an H200 (`llm bench --part b --host-mode exclusive`,
    before this) loads took 1.9x the inclusive tier's time for the same
    bytes; the inclusive tier's loads refill its own victims' buffers.  That
    page-locking is the likely cause (not measured apart from the demotion's
    device-to-host copy, which this does not remove).
    Memory: up to `limit` buffers wait here, page-locked while idle, outside
    every pool's accounting, beside the buffers of the staged reads in flight
    (`load_pooled` sizes an exclusive host tier that much smaller, so a
    model's host memory is the same in either mode).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[FlatWeights] = []
        self._lock = threading.Lock()
        self.reused = 0        # buffers handed out again instead of allocated

    def put(self, value: FlatWeights | None) -> None:
        """Keep `value`'s buffer for a later take, if there is room; nobody else may still use it."""
        if value is None or getattr(value, "buffer", None) is None:
            return
        with self._lock:
            if len(self._free) < self.limit:
                self._free.append(value)

    def take(self, nbytes: int, device, pinned: bool | None = None) -> FlatWeights | None:
        """A kept buffer of exactly `nbytes` on `device` (and pinning), or None."""
        with self._lock:
            out = take_buffer(self._free, nbytes, device, pinned)
            self.reused += out is not None
            return out

    def held(self) -> int:
        """Buffers waiting here now."""
        with self._lock:
            return len(self._free)


def uniform_dtype(store, expert_id: str) -> str | None:
    """The dtype `StoreSource`'s default ('uniform') loads `expert_id` in: its dominant floating dtype, if any."""
    from .convert import FLOATING

    dominant = store.entry(expert_id).dtype
    return dominant if dominant in FLOATING else None


class StoreSource:
    """SSD tier: the expert store, read into host memory (into an evicted expert's buffer when sizes match).

    `dtype` is the dtype a CPU executor computes in: floating tensors stored
    in another dtype are cast while they load (fp16 on disk, fp32 in the
    pool), and the pool accounts the loaded size.  'uniform' (the default)
    casts the few tensors an fp16 expert keeps in fp32 (see
    `storage.dtypes.fp16_underflows`) to the expert's dominant dtype: a
    module computes in one dtype, and an expert stored half stays half.
    None keeps the stored dtypes as they are, mixed or not.  Compressed experts decode on the calling
    loader thread (and the shared decode pool).
    """

    UNIFORM = "uniform"

    reuses_memory = True

    def __init__(self, store, *, pin: bool = False, method: str = "read", drop_after_read: bool = False,
                 dtype: str | None = "uniform", activity=None) -> None:
        import torch

        self.store, self.pin, self.method, self.dtype = store, pin, method, dtype
        # the box's `storage.disk_activity.DiskActivity`: each read is counted there (None: not watched)
        self.activity = activity
        # a box whose RAM is the budget has no page cache to spare: every miss then reads the SSD
        self.drop_after_read = drop_after_read
        self._cpu = torch.device("cpu")
        self.reused = 0
        # bytes of whole experts read from their files (from SSD, or the page cache if it had them), as loaded:
        # after a dtype cast, the cast size
        self.bytes_read = 0
        self._count = threading.Lock()

    def _dtype(self, expert_id: str) -> str | None:
        return uniform_dtype(self.store, expert_id) if self.dtype == self.UNIFORM else self.dtype

    def size(self, expert_id: str) -> int:
        dtype = self._dtype(expert_id)
        return self.store.loaded_nbytes(expert_id, dtype) if dtype else self.store.nbytes(expert_id)

    def load(self, expert_id: str, reuse=None) -> FlatWeights:
        out = take_buffer(reuse, self.size(expert_id), self._cpu, self.pin) if reuse else None
        if reuse:
            reuse.clear()  # the victims we did not take are freed before we allocate
        self.reused += out is not None
        try:
            with self.activity.reading() if self.activity is not None else contextlib.nullcontext():
                flat = self.store.read_flat(expert_id, pin=self.pin, method=self.method, out=out,
                                            dtype=self._dtype(expert_id))
        except BaseException:
            if self.drop_after_read:    # a read cut short (a prefetch that gave way): its pages must not stay
                self._drop(expert_id, quiet=True)
            raise
        if self.drop_after_read:     # advice to the kernel: a drop that fails (a file a promotion retired between
            self._drop(expert_id, quiet=True)   # the read and here) never fails a read whose bytes are good
        with self._count:
            self.bytes_read += flat.nbytes
        return flat

    def _drop(self, expert_id: str, *, quiet: bool = False) -> None:
        from .pagecache import drop_from_page_cache

        try:
            drop_from_page_cache(self.store.path(expert_id))
        except OSError:
            if not quiet:               # after a failed read the read's own error is the one to report
                raise


class TierSource:
    """Loads into `device` memory from a parent pool (held only for the copy) or a plain source.

    With `exclusive`, a parent pool is a victim cache: an expert found there is
    copied and then discarded from it (promoted, not duplicated), and one not
    there is read from the parent's own source into a staging buffer that is
    dropped after the copy, so a miss never evicts the parent's experts.
    """

    reuses_memory = True

    def __init__(self, parent: Pool | StoreSource, device: str, *, wait: float = 60.0,
                 exclusive: bool = False, spares: "int | SpareBuffers" = 0) -> None:
        import torch

        self.parent, self.device, self._wait = parent, torch.device(device), wait
        self._cpu = torch.device("cpu")
        self.exclusive = exclusive and isinstance(parent, Pool)
        # same-sized experts (an LLM's): staging host buffers (a plain source's, or an exclusive tier's reads
        # around it) and promoted host copies are reused, not freed; an inclusive tier's loads refill its own
        # victims' buffers and need none (an int: that many of its own; a SpareBuffers: shared with other
        # device tiers and their demotions)
        if isinstance(spares, int):
            spares = SpareBuffers(spares) if spares > 0 else None
        self.spares = spares if self.exclusive or not isinstance(parent, Pool) else None
        self.promoted = 0      # exclusive: loads served from the parent pool (and discarded there)
        self.staged = 0        # exclusive: loads read around the parent pool, from its source
        self._counts = threading.Lock()    # the loader threads count at once
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.Lock()  # one copy at a time per device tier keeps the measurement honest
        self.reused = 0

    def _buffer(self, nbytes: int, reuse) -> tuple["torch.Tensor", FlatWeights | None]:
        import torch

        old = take_buffer(reuse, nbytes, self.device) if reuse else None
        if reuse:
            reuse.clear()
        if old is not None:
            self.reused += 1
            return old.buffer, old
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device), None

    def size(self, expert_id: str) -> int:
        return self.parent.source.size(expert_id) if isinstance(self.parent, Pool) else self.parent.size(expert_id)

    def load(self, expert_id: str, reuse=None) -> FlatWeights:
        reuse = reuse if reuse is not None else []
        if not isinstance(self.parent, Pool):
            return self._staged(self.parent, expert_id, reuse)
        if self.exclusive:
            return self._promote(expert_id, reuse)
        deadline = time.monotonic() + self._wait
        while True:
            since = self.parent.generation
            if (handle := self.parent.acquire(expert_id)) is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"'{expert_id}': the {self.parent.tier} tier stayed full of pinned experts")
            self.parent.wait_changed(since, WAIT_CHECK_S)
        try:
            return self._copy(handle.value, reuse)
        finally:
            self.parent.release(handle)

    def _promote(self, expert_id: str, reuse) -> FlatWeights:
        """Exclusive: copy from the parent tier if it holds the expert, then let it go there; else stage from SSD.

        A held copy of a version the store no longer serves is dropped there
        and the expert is staged from SSD: the host tier can hold one a
        promotion made stale (see `current_in`)."""
        handle = self.parent.hold(expert_id)
        store = getattr(self.parent.source, "store", None)
        if handle is not None and store is not None and not current_in(store)(expert_id, handle.value):
            self.parent.release(handle)
            self.parent.discard(expert_id, when_free=True)
            handle = None
        if handle is None:
            with self._counts:
                self.staged += 1
            return self._staged(self.parent.source, expert_id, reuse)
        try:
            out = self._copy(handle.value, reuse)
        finally:
            self.parent.release(handle)
        with self._counts:
            self.promoted += 1
        # stays only if another tier's copy still pins it; once gone, nobody holds its buffer
        if self.parent.discard(expert_id) and self.spares is not None:
            self.spares.put(handle.value)
        return out

    def _staged(self, source, expert_id: str, reuse) -> FlatWeights:
        """Read `expert_id` from `source` into a host staging buffer (a kept one when there is one) and copy it."""
        if self.spares is None:
            return self._copy(source.load(expert_id), reuse)      # the staging buffer dies with this call
        spare = self.spares.take(source.size(expert_id), self._cpu, getattr(source, "pin", None))
        staged = source.load(expert_id, reuse=[spare]) if spare is not None else source.load(expert_id)
        out = self._copy(staged, reuse)
        self.spares.put(staged)          # the copy has finished (`_copy_bytes` waits for it)
        return out

    def _copy(self, src: FlatWeights, reuse) -> FlatWeights:
        out = self._copy_bytes(src, reuse)
        out.version = getattr(src, "version", None)
        return out

    def _copy_bytes(self, src: FlatWeights, reuse) -> FlatWeights:
        import torch

        with self._lock:
            if self._stream is None:
                dst, old = self._buffer(src.nbytes, reuse)
                dst.copy_(src.buffer)
                return FlatWeights(src.layout, dst, like=old)
            before = torch.cuda.memory_allocated(self.device)
            with torch.cuda.stream(self._stream):
                dst, old = self._buffer(src.nbytes, reuse)
                dst.copy_(src.buffer, non_blocking=src.buffer.is_pinned())
                done = self._stream.record_event()
            done.synchronize()  # the parent may evict its buffer as soon as we return
            out = FlatWeights(src.layout, dst, like=old)
            out.measured_nbytes = allocator_bytes(src.nbytes, torch.cuda.memory_allocated(self.device) - before,
                                                  reused=old is not None)  # type: ignore[attr-defined]
            return out


class HostReadSource:
    """A CPU executor's source: a RAM copy of the host tier's copy when it holds the expert, else the SSD.

    The host tier is host memory, so a CPU executor that needs an expert the
    tier holds copies it at memory speed (about 30 ms for a 170 MB expert)
    instead of reading it from the SSD that every executor's switches queue
    for (about 320 ms at 530 MB/s).  The host tier keeps its copy: it is the
    GPU pools' victim cache and stays so; the CPU pool's copy is its own,
    counted in its own budget.  Only when both sources would produce the same
    bytes: the host tier holds the expert in the dtype the GPU computes in,
    and a CPU executor that computes in another reads the SSD (`compatible`).
    The copy must also be of the store's current version and of the size the
    CPU pool reserved: between a promotion's store switch and the eviction of
    the replaced copies the host tier may still hold the old version (in
    another dtype, even), and such a copy is read around, from the SSD.
    """

    reuses_memory = True

    def __init__(self, host: Pool, fallback: StoreSource) -> None:
        self.host, self.fallback = host, fallback
        self.from_host = 0     # loads served by a copy of the host tier's copy
        self.from_ssd = 0      # loads read from the store
        self.demoted = 0       # this CPU pool's victims moved down into the host tier (`demote`)

    def compatible(self, expert_id: str) -> bool:
        """True if the host tier's copy of `expert_id` has the bytes this CPU executor computes with."""
        src = self.host.source
        return isinstance(src, StoreSource) and src._dtype(expert_id) == self.fallback._dtype(expert_id)

    def size(self, expert_id: str) -> int:
        return self.fallback.size(expert_id)

    def load(self, expert_id: str, reuse=None) -> FlatWeights:
        reuse = reuse if reuse is not None else []
        handle = self.host.hold(expert_id) if self.compatible(expert_id) else None
        if handle is not None:
            try:
                current = self._current(expert_id, handle.value)
            except BaseException:     # the check read the store and failed: the held copy must not stay pinned
                self.host.release(handle)
                raise
            if not current:
                self.host.release(handle)
                handle = None
        if handle is None:
            self.from_ssd += 1
            return self.fallback.load(expert_id, reuse)
        try:
            out = host_copy(handle.value, reuse, pin=False)
        finally:
            self.host.release(handle)
        self.from_host += 1
        return out

    def demote(self, event: PoolEvent, *, ranked: bool = False) -> bool:
        """Move this CPU pool's victim (its evict `event`) down into the host tier; True if it was admitted.

        The CPU pool's copy is a copy of what the host tier would hold only
        where the dtypes agree (`compatible`), it is the store's current
        version, at the host tier's size for it, and it is not a copy a
        promotion replaced (`event.stale`); any other victim is dropped, as
        before.  The copy is pinned when the host tier's own reads pin (a GPU
        then promotes it with an asynchronous copy).  As `demote`, it never
        raises: a victim cache may always decline.  `ranked` as for `demote`.
        """
        value = event.value
        if event.stale or getattr(value, "buffer", None) is None:
            return False
        try:
            src = self.host.source
            if not (self.compatible(event.expert_id) and self._current(event.expert_id, value)
                    and value.nbytes == src.size(event.expert_id)):
                return False
        except Exception as exc:  # noqa: BLE001 - an expert the store no longer lists: dropped, as before
            log.debug("not demoting '%s' from a CPU pool (%s: %s)", event.expert_id, type(exc).__name__, exc)
            return False
        if demote(event, self.host, pin=bool(getattr(src, "pin", False)), ranked=ranked):
            self.demoted += 1
            return True
        return False

    def _current(self, expert_id: str, value) -> bool:
        """True if the host tier's `value` is the store's current version, at the size this pool reserved."""
        version = getattr(value, "version", None)
        return (version is not None and version == self.fallback.store.entry(expert_id).version
                and value.nbytes == self.fallback.size(expert_id))


_streams = threading.local()


def _side_stream(device):
    """This thread's side stream on `device`, made once: a demotion runs on whichever thread evicts (an
    executor's, a prefetcher's), and each copy is synchronised before it returns, so one stream per thread
    and device serves every copy.  (torch hands streams out of a fixed per-device pool, so a new Stream per
    demotion was a wrapper and a pool slot each time, not a driver allocation; the saving is small and
    unmeasured.)"""
    import torch

    cache = getattr(_streams, "by_device", None)
    if cache is None:
        cache = _streams.by_device = {}
    stream = cache.get(device)
    if stream is None:
        stream = cache[device] = torch.cuda.Stream(device)
    return stream


def host_copy(src: FlatWeights, reuse: list, *, pin: bool, spares: SpareBuffers | None = None) -> FlatWeights:
    """A host-memory copy of `src`, finished when this returns.

    Into a buffer from `reuse` (values just evicted from the host tier) when
    one has the same size and pinning, else a new one, pinned if `pin` (so
    a later host-to-device copy can be asynchronous); before a new one, a
    kept buffer from `spares`.  From CUDA the copy runs
    on a side stream and is synchronised: the caller may hand the device
    buffer to the next load as soon as we return.
    """
    import torch

    cpu = torch.device("cpu")
    old = take_buffer(reuse, src.nbytes, cpu, pin) if reuse else None
    reuse.clear()   # the victims we did not take are freed before we allocate
    if old is None and spares is not None:
        old = spares.take(src.nbytes, cpu, pin)
    dst = old.buffer if old is not None else host_empty(src.nbytes, pin)
    if src.buffer.device.type == "cuda":
        stream = _side_stream(src.buffer.device)
        with torch.cuda.stream(stream):
            dst.copy_(src.buffer, non_blocking=dst.is_pinned())
        stream.synchronize()
    else:
        dst.copy_(src.buffer)
    out = FlatWeights(src.layout, dst, like=old)
    out.version = getattr(src, "version", None)
    return out


def current_in(store) -> Callable[[str, object], bool]:
    """`(expert_id, value) -> bool`: is `value` the version `store` serves now?  (False if the store cannot say.)

    A copy made before a promotion switched the store must not enter a tier
    after the store watcher dropped the stale copies: nothing would look at it
    again, and the next miss would be served the old weights.
    """
    def current(expert_id: str, value) -> bool:
        try:
            return getattr(value, "version", None) == store.entry(expert_id).version
        except Exception:  # noqa: BLE001 - an expert the store no longer names is not current
            return False
    return current


def demote(event: PoolEvent, host: Pool, *, pin: bool | None = None, ranked: bool = False,
           spares: SpareBuffers | None = None, held: Callable[[str], bool] | None = None,
           current: Callable[[str, object], bool] | None = None) -> bool:
    """Move a device pool's victim (its evict `event`) down into the `host` tier; True if it was admitted.

    Call it from the device pool's evict callback: the pool hands the victim's
    buffer to the incoming load only after its callbacks return, so the copy
    made here reads bytes that are still the victim's.  The expert the device
    pool is making room for is kept in the host tier meanwhile (it is about to
    be promoted from there).  It never raises: a victim the host tier cannot
    take (no room, a failed copy) is dropped, which costs a later SSD read,
    whereas an exception here would fail the device pool's load.  `pin`
    defaults to pinning when the victim comes from CUDA.  `ranked`: the
    victim enters a full tier only if the tier's policy ranks it above what
    it would push out (`Pool.admit(worth_keeping=True)`; the config's
    `host_tier_admission: ranked`).  `spares`: kept buffers to copy into
    before allocating (`TierSource(spares=...)`).  `held`: the evicting
    pool's `present`; a victim it holds again is not copied down (an eviction
    reported late, `Pool.report_victims`, after the victim was read back in:
    one expert would sit in both tiers).  `current` (`current_in(store)`): a
    victim of a version the store no longer serves is not copied down (an
    eviction reported after a promotion's switch).
    """
    value = event.value
    if getattr(value, "buffer", None) is None:
        return False   # nothing to copy (a weightless value): the simulator calls `host.admit` itself
    if held is not None and held(event.expert_id):
        return False
    if current is not None and not current(event.expert_id, value):
        return False
    if pin is None:
        pin = value.buffer.device.type == "cuda"
    try:
        return host.admit(event.expert_id, lambda reuse: host_copy(value, reuse, pin=pin, spares=spares),
                          keep=(event.incoming,),
                          worth_keeping=ranked)
    except Exception as exc:  # noqa: BLE001 - a victim cache may always decline
        log.warning("could not demote '%s' into the %s tier (%s: %s); it stays on SSD only",
                    event.expert_id, host.tier, type(exc).__name__, exc)
        return False


def allocator_bytes(nbytes: int, delta: int, *, reused: bool) -> int:
    """What the CUDA caching allocator really holds for a buffer of `nbytes`.

    The measured `memory_allocated` delta is used when it agrees with the
    allocator's rounding (512 B blocks, 2 MiB for large buffers); when other
    threads allocated at the same moment (activations, another executor) the
    delta is polluted and the rounded size is the honest figure.
    """
    rounded = -(-nbytes // 512) * 512 if nbytes < 2**20 else -(-nbytes // 2**21) * 2**21
    if reused or abs(delta - rounded) > 2**21:
        return rounded
    return delta


def measured_nbytes(value: Any) -> int:
    """What a pool should account for a loaded value: the allocator's figure where there is one."""
    return int(getattr(value, "measured_nbytes", 0) or getattr(value, "nbytes", 0))
