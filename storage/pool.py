"""A byte-budgeted pool of resident experts: the bookkeeping, not the policy.

The pool asks its source for an expert's size, asks the policy which residents
to evict so it fits, evicts them, reserves the room, and loads *outside* its
lock, so a background prefetch never blocks an executor's hit on another
expert.  It never holds more than its capacity.  An expert acquired by a
running batch (or still loading) is pinned and is never a victim.  Two threads
asking for the same expert share one load (an in-flight set, as Ray Serve's
multiplexer does), and a failed load clears its reservation.

Besides loading from its source, a pool can take an expert handed down from
a tier above (`admit`: a GPU victim moving into the host tier, which makes
the host tier an exclusive victim cache) and can let one go on request
(`discard`: an expert promoted out of it).  Both follow the same rules: the
policy picks the victims, pinned experts stay, capacity is never exceeded.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from coe import CoEError

from .policies import EvictionPolicy, PoolState, Resident, ranks_by_value

log = logging.getLogger(__name__)


class ExpertSource(Protocol):
    """Where a pool loads from: the expert store (SSD) or a parent tier.

    A source with `reuses_memory = True` accepts `load(expert_id, reuse=[...])`:
    the values just evicted to make room, whose memory it may fill instead of
    allocating.
    """

    def size(self, expert_id: str) -> int: ...

    def load(self, expert_id: str) -> Any: ...


@dataclass(frozen=True)
class PoolEvent:
    expert_id: str
    tier: str
    event: str        # 'load' | 'evict' | 'admit'
    nbytes: int
    seconds: float
    at: float
    value: Any = field(default=None, repr=False, compare=False)  # the evicted value, for whoever points into it
    incoming: str | None = None   # evict: the expert the room was made for (None: evicted on request)
    stale: bool = False           # evict: a version a promotion replaced (not worth keeping in a tier below)


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    load_seconds: float = 0.0
    resident_bytes: int = 0
    capacity: int = 0
    manage_seconds: float = 0.0   # bookkeeping and eviction decisions, loads excluded
    admits: int = 0               # experts handed down from a tier above (`Pool.admit`): not loads, not misses
    declined: int = 0             # experts `admit(worth_keeping=True)` turned away: worth less than what they'd push out
    bypassed: int = 0             # misses served beside the pool (`admissions` said no): read, never resident
    bypassed_bytes: int = 0       # what those misses read

    @property
    def switches(self) -> int:
        """Loads into this tier: each one is an expert switch (admits are not)."""
        return self.misses


@dataclass
class Handle:
    expert_id: str
    value: Any
    nbytes: int


@dataclass
class _Entry:
    value: Any
    nbytes: int
    loaded_seq: int
    used_seq: int
    pins: int = 0
    loading: bool = False
    drop_on_release: bool = False   # stale (a promotion): evicted by the release that leaves it unpinned
    # callers that joined this load while it ran (`Pool.acquire_async(join=...)`): (their future, their submit)
    joined: list = field(default_factory=list)
    # loading: the evict events of the victims its reservation made, reported when its load runs (`_fill`), or
    # by `_unreserve` if it never does; either empties the list, so each is reported once
    victims: list = field(default_factory=list)
    # loading: the values of victims already reported (`report_victims`), still offered to its load for reuse
    reported: list = field(default_factory=list)
    # loading, reserved by `acquire_async`: the future its submit returned (`report_victims` checks it is this one)
    reservation: Any = None


def wait_for_room(attempt: Callable[[], Any], deadline: float, why: Callable[[], str],
                  pool: "Pool | None" = None) -> Any:
    """`attempt()` until it returns something other than None (room was found); past `deadline`
    (time.monotonic()) raise CoEError(`why()`).  Pinned experts that hold the room are released by their
    own batches or layers, so waiting for them is all a caller can do.  With the `pool` the attempt asks,
    each wait ends when that pool changes (a release, an eviction, a load ending): every waiter, a vision
    batch or an LLM layer, tries again at once; without it, the waits back off from 1 to 50 ms."""
    pause = 0.001
    while True:
        since = pool.generation if pool is not None else 0
        if (got := attempt()) is not None:
            return got
        left = deadline - time.monotonic()
        if left < 0:
            raise CoEError(why())
        if pool is not None:
            pool.wait_changed(since, min(left, WAIT_CHECK_S))
        else:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


WAIT_CHECK_S = 0.05   # a waiter looks again this often even if no change woke it (an attempt may depend on more)


def _copy_outcome(src: Future, dst: Future) -> None:
    """Complete `dst` (already running) as `src` completed."""
    if src.cancelled():
        dst.set_exception(CoEError("the load that stood in for a failed joined load was cancelled"))
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


class PoolFullError(CoEError):
    """An expert can never fit this pool (it is larger than the whole budget)."""


@dataclass(frozen=True)
class Share:
    """A cap on the bytes one group of experts may hold in a pool (`Pool.limit_share`).

    Why: a pool shared by an MoE LLM and a vision line ranks both kinds
    together by usage, and an LLM expert (a chance of k/E per token) outranks
    most vision detectors, so a long completion can push out the line's
    experts.  A share keeps the group's experts within `max_bytes`: a group
    expert coming in over it makes room among its own group first.
    """

    name: str
    members: frozenset[str]
    max_bytes: int


class Pool:
    """Resident experts of one tier, within `capacity_bytes`."""

    def __init__(self, tier: str, capacity_bytes: int, policy: EvictionPolicy, source: ExpertSource, *,
                 on_event: Callable[[PoolEvent], None] | None = None,
                 probabilities: dict[str, float] | None = None,
                 preliminaries: dict[str, tuple[str, ...]] | None = None,
                 context: Callable[[], dict] | None = None,
                 measure: Callable[[Any], int] | None = None, name: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tier, self.capacity, self.policy, self.source = tier, int(capacity_bytes), policy, source
        self.name = name or tier
        self._on_event = on_event or (lambda e: None)
        self._probabilities = dict(probabilities or {})
        self._preliminaries = dict(preliminaries or {})
        # live knowledge: {'queued': set, 'future': tuple} from a scheduler; {'counts', 'gate_scores', 'predicted'}
        # from an MoE router
        self._context = context or dict
        self._measure = measure
        self._reuses = bool(getattr(source, "reuses_memory", False))
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._seq = 0
        self._cond = threading.Condition()
        self._stats = PoolStats()
        self._share: Share | None = None
        self._gen = 0                 # bumped whenever pins or residents change (`generation`, `wait_changed`)

    @property
    def generation(self) -> int:
        """A counter of changes to pins and residents: read it before an attempt, then `wait_changed`."""
        return self._gen

    def wait_changed(self, since: int, timeout: float) -> bool:
        """Wait up to `timeout` s for a change after `generation` was `since`; True if one came.

        A condition wait, not a poll: a release wakes every waiter at once, so
        a batch and an LLM layer waiting on one pool get the freed room on equal
        terms, and nobody spins while the pins hold."""
        with self._cond:
            return self._cond.wait_for(lambda: self._gen != since, timeout)

    def _changed_locked(self) -> None:
        self._gen += 1
        self._cond.notify_all()

    def limit_share(self, name: str, members: Collection[str], max_bytes: int) -> None:
        """Cap what the experts in `members` may hold here at `max_bytes` (`Share`); `name` is for errors."""
        with self._cond:
            self._share = Share(name, frozenset(members), int(max_bytes))

    def share_bytes(self) -> int:
        """What the capped group (`limit_share`) holds now, loads under way included; 0 without a cap."""
        with self._cond:
            share = self._share
            return 0 if share is None else sum(e.nbytes for k, e in self._entries.items() if k in share.members)

    def room_for(self, expert_id: str) -> int:
        """Free bytes `expert_id` could take without evicting: the pool's, and its group's if capped."""
        with self._cond:
            free = self.capacity - sum(e.nbytes for e in self._entries.values())
            share = self._share
            if share is not None and expert_id in share.members:
                held = sum(e.nbytes for k, e in self._entries.items() if k in share.members)
                free = min(free, share.max_bytes - held)
            return free

    # -- public ---------------------------------------------------------------
    def acquire(self, expert_id: str, *, keep: Collection[str] = ()) -> Handle | None:
        """Pin `expert_id` resident, loading it (and evicting) if needed.

        Returns None when it cannot fit now because pinned experts hold the room
        (residents in `keep` count as pinned this time: a read-ahead must not
        push out one queued expert to read in another); raises PoolFullError
        when it can never fit, and the source's error (e.g. ExpertLoadError)
        when loading fails.
        """
        got = self._reserve(expert_id, keep)
        return got if got is None or isinstance(got, Handle) else got()

    def acquire_async(self, expert_id: str, submit: Callable[[Callable[[], Handle]], Future], *,
                      join: Callable[[Callable[[], Handle]], Future] | None = None,
                      keep: Collection[str] | Callable[[], Collection[str]] = ()) -> Future | None:
        """`acquire`, with the room reserved now and the load run by `submit` (e.g. a loader thread pool).

        Reservations happen in call order in the calling thread, so which
        experts fit (and which are evicted) is what sequential `acquire`s would
        decide; only the loads overlap.  Returns None when the expert cannot
        fit now; a hit is an already-completed future.  The future raises what
        a failed load raises, with the reservation cleared.

        An expert another thread is loading (a prefetch) is waited for here,
        in the calling thread, unless `join` is given: then it is pinned now,
        so it cannot be evicted once in, and the future completes when that
        load does (no thread waits for it), so the caller goes on with its
        other experts meanwhile.  Its bytes move once: a hit, not a second
        miss.  `join` is the submit that runs a load of the caller's own if
        the joined one fails.  `keep`, as in `acquire`: residents that must not
        be evicted to make the room (they look pinned); a callable is asked
        under the pool's lock, when the victims are chosen, so what it names
        is current then (a prefetch's: what the layer that routed last asked for).
        """
        if join is not None:
            joined = self._join_loading(expert_id, join)
            if joined is not None:
                return joined
        got = self._reserve(expert_id, keep)
        if got is None:
            return None
        if isinstance(got, Handle):
            done: Future = Future()
            done.set_result(got)
            return done
        try:
            fut = submit(got)
        except BaseException:
            self._unreserve(expert_id)   # the load will never run: no entry may stay 'loading' with its pin
            raise
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is not None and entry.loading and entry.reservation is None:
                entry.reservation = fut
        fut.add_done_callback(lambda f: self._unreserve(expert_id) if f.cancelled() else None)
        return fut

    def report_victims(self, expert_id: str, reservation: Future | None = None) -> None:
        """Report the evictions the reservation of `expert_id` made, now, if its load has not yet.

        For a load held back for a while after `acquire_async` reserved it
        (`executors.prefetch`): its victims then move down into a victim cache
        now instead of being in no tier until the load starts.  Their memory is
        still offered to the load for reuse (a listener copies what it keeps
        while it is told).  Each eviction is reported once, here or by the load.
        `reservation`: the future `acquire_async` returned; when given, nothing
        is reported unless the entry is still that reservation's (a report left
        behind by a dropped plan must not take a newer reservation's victims).
        A listener that raises is logged and the others are still told.
        """
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is None or not entry.loading or (reservation is not None and entry.reservation is not reservation):
                return
            events = list(entry.victims)
            entry.victims.clear()        # the list its load reports from (`_fill`) and `_unreserve` reads
            # their memory is still the load's to refill (what `_fill` offers it): a fresh allocation per load
            # instead cost a real CPU run a quarter of Samba-CoE's throughput
            entry.reported.extend(e.value for e in events if e.value is not None)
        for ev in events:
            self._tell(ev)

    def _join_loading(self, expert_id: str, submit: Callable[[Callable[[], Handle]], Future]) -> Future | None:
        """If `expert_id` is loading, pin its entry and return a future of it (see `acquire_async`); else None.

        No thread waits: the load that fills the entry hands the joiners their
        handles (`_hand_over`); if it fails or is cancelled, each joiner's
        `submit` runs a load of its own (`_rescue`).
        """
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is None or not entry.loading:
                return None
            entry.pins += 1         # ours from now: the load's own pin goes when its loader releases it
            fut: Future = Future()
            entry.joined.append((fut, submit))
        return fut

    def _hand_over(self, expert_id: str, entry: _Entry, joined: list) -> None:
        """The joined load landed: each joiner gets a handle (a hit); a joiner that cancelled gives its pin back."""
        for fut, _ in joined:
            took = fut.set_running_or_notify_cancel()
            with self._cond:
                if took:                    # a hit on this load: its bytes moved once
                    self._seq += 1
                    entry.used_seq = self._seq
                    self._stats.hits += 1
                else:
                    entry.pins -= 1
                    self._changed_locked()
            if took:
                fut.set_result(Handle(expert_id, entry.value, entry.nbytes))

    def _rescue(self, expert_id: str, joined: list) -> None:
        """The joined load failed (its error goes to its own caller) and took the joiners' pins with it:
        each joiner loads the expert itself, with its own submit."""
        for fut, submit in joined:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                own = submit(lambda: self._acquire_or_fail(expert_id))
            except BaseException as exc:
                fut.set_exception(exc)
                continue
            own.add_done_callback(lambda f, fut=fut: _copy_outcome(f, fut))

    def _acquire_or_fail(self, expert_id: str, wait: float = 60.0) -> Handle:
        """Load `expert_id` for a joiner whose load failed, waiting (as a wave does) while pinned experts hold
        the room the failed load freed."""
        return wait_for_room(lambda: self.acquire(expert_id), time.monotonic() + wait,
                             lambda: f"expert '{expert_id}': a load it joined failed and pinned experts filled "
                                     f"the {self.tier} pool for {wait:.0f} s", self)

    def _unreserve(self, expert_id: str) -> None:
        """A reserved load that will never run (cancelled, or its submit failed): drop the entry, report the
        evictions its reservation made (their listeners, e.g. a victim cache below, must still see them) and
        hand the joiners their own loads."""
        joined, victims = [], []
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is not None and entry.loading:
                del self._entries[expert_id]
                joined, victims, entry.victims, entry.reported = entry.joined, entry.victims, [], []
            self._changed_locked()
        try:
            for ev in victims:
                self._tell(ev)
        finally:
            victims = ev = None
            self._rescue(expert_id, joined)   # the joiners load for themselves, whatever a listener raised

    def _reserve(self, expert_id: str, keep: Collection[str] | Callable[[], Collection[str]] = ()
                 ) -> "Handle | Callable[[], Handle] | None":
        """A hit's handle, None if it cannot fit now, or (a miss, room reserved) the call that loads it."""
        entered = time.perf_counter()
        ctx = self._context()
        try:    # before the lock: a first read of an expert's size reads its file's header
            sized = self.source.size(expert_id)
        except Exception:  # noqa: BLE001 - a hit needs no size; a miss asks again below and raises there
            sized = None
        with self._cond:
            while True:
                self._seq += 1
                entry = self._entries.get(expert_id)
                if entry is None:
                    break
                # someone else is loading it: share that load; a stale copy (a promotion) goes at its last
                # release: wait for that, so no new holder gets the old weights
                if entry.loading or entry.drop_on_release:
                    w0 = time.perf_counter()
                    self._cond.wait()
                    entered += time.perf_counter() - w0   # waiting is not management work
                    continue
                entry.pins += 1
                entry.used_seq = self._seq
                self._stats.hits += 1
                self._stats.manage_seconds += time.perf_counter() - entered
                return Handle(expert_id, entry.value, entry.nbytes)
            need = sized if sized is not None else self.source.size(expert_id)
            if need > self.capacity:
                raise PoolFullError(f"expert '{expert_id}' needs {need} bytes but the {self.tier} pool holds "
                                    f"{self.capacity}; raise the executor's memory budget")
            share = self._share
            if share is not None and expert_id in share.members and need > share.max_bytes:
                raise PoolFullError(f"expert '{expert_id}' needs {need} bytes but {share.name} caps its group at "
                                    f"{share.max_bytes} bytes of the {self.tier} pool")
            held = keep() if callable(keep) else keep
            victims = self._choose_locked(self._state_locked(ctx, incoming=expert_id, keep=held), expert_id, need)
            if victims is None:
                return None
            evicted = [self._evict_locked(v, incoming=expert_id) for v in victims]
            self._entries[expert_id] = _Entry(None, need, self._seq, self._seq, pins=1, loading=True,
                                              victims=evicted)
        managed = time.perf_counter() - entered

        def load() -> Handle:
            # time spent queued for a loader thread is neither management nor loading
            entered = time.perf_counter() - managed
            # the victims' memory may become the new expert's (a switch between same-sized experts then costs
            # one read or copy into warm memory); the source takes what it reuses
            entry = self._fill(expert_id, evicted, need, entered, "load", reuse_victims=self._reuses,
                               make=lambda reuse: (self.source.load(expert_id, reuse=reuse) if reuse
                                                   else self.source.load(expert_id)))
            return Handle(expert_id, entry.value, entry.nbytes)
        return load

    def _fill(self, expert_id: str, evicted: list[PoolEvent], need: int, entered: float, event: str, *,
              reuse_victims: bool, make: Callable[[list], Any]) -> _Entry:
        """Fill the reserved entry of `expert_id` with `make(reuse)`, outside the lock; `event` is 'load' or 'admit'.

        Reports the evictions first, then hands `make` the victims' values it may
        refill.  `evicted` is cleared here, so nothing keeps the other victims
        alive while `make` allocates.  If `make` raises, the reservation goes
        (no half entry) and the error propagates.
        """
        t0 = self._clock()
        started = time.perf_counter()
        reuse = None
        try:
            with self._cond:   # taken under the lock: a reservation dropped meanwhile (`_unreserve`) reports none
                events = list(evicted)
                evicted.clear()
                entry = self._entries.get(expert_id)
                early = []
                if entry is not None:
                    early, entry.reported = entry.reported, []
            for ev in events:
                self._tell(ev)
            ev = entry = None
            reuse = [e.value for e in events if e.value is not None] + early if reuse_victims else []
            events.clear()
            early = []
            value = make(reuse)
            reuse.clear()
            seconds = self._clock() - t0
            wall = time.perf_counter() - started
            measured = self._measure(value) if self._measure and value is not None else need
        except BaseException:
            if reuse:
                reuse.clear()               # the traceback keeps the load's frames, which hold this list
            events = early = reuse = None   # ... and this frame: let the victims' memory go
            with self._cond:
                joined = self._entries.pop(expert_id).joined
                self._changed_locked()
            self._rescue(expert_id, joined)
            raise
        # the policy's context (the scheduler's queued experts) is read before the lock, as `_reserve` does: the
        # scheduler calls into pools while it holds its own lock, so asking it under ours could deadlock
        try:
            ctx = self._context() if measured > need else None
        except Exception:  # noqa: BLE001 - the trim ranks without what is queued rather than strand the load
            log.exception("%s pool: the eviction context failed; trimming without it", self.tier)
            ctx = {}
        with self._cond:
            entry = self._entries[expert_id]
            entry.value, entry.loading, entry.nbytes = value, False, max(measured, need)
            joined, entry.joined = entry.joined, []
            if event == "load":
                self._stats.misses += 1
                self._stats.bytes_in += entry.nbytes
                self._stats.load_seconds += seconds
            else:
                self._stats.admits += 1
            # booked above what was reserved (a CUDA allocator's rounding): others make room, so the pool never
            # holds more than its capacity while anything unpinned can go
            try:
                trimmed = self._trim_locked(expert_id, ctx) if entry.nbytes > need else []
            except Exception:  # noqa: BLE001 - the load is in: its pin, joiners and waiters come first
                log.exception("%s pool: trimming after loading %s failed; the pool may stay over capacity until "
                              "the next eviction", self.tier, expert_id)
                trimmed = []
            self._stats.manage_seconds += time.perf_counter() - entered - wall
            self._changed_locked()
        for ev in trimmed:
            self._tell(ev)
        self._hand_over(expert_id, entry, joined)
        self._tell(PoolEvent(expert_id, self.tier, event, entry.nbytes, seconds, time.time()))
        return entry

    def _trim_locked(self, incoming: str, context: dict | None) -> list[PoolEvent]:
        """Evict what the policy chooses until the pool, and the capped group of `incoming` (`Share`), are within
        their capacity again; the evictions' events.  `context`: the policy's, read before the lock."""
        over = sum(e.nbytes for e in self._entries.values()) - self.capacity
        share = self._share
        over_share = (share is not None and incoming in share.members
                      and sum(e.nbytes for k, e in self._entries.items() if k in share.members) > share.max_bytes)
        if over <= 0 and not over_share:
            return []
        state = self._state_locked(context or {}, incoming=incoming, keep=(incoming,))
        victims = self._choose_locked(state, incoming, 0)            # until free >= 0: within capacity
        if victims is None:          # its group cannot get under its share (pinned): the pool's capacity still
            victims = self.policy.choose_victims(state, 0) or []     # comes first
        if not victims:
            log.warning("%s pool: over its capacity or %s's share after loading it (%d bytes over the pool), and "
                        "nothing unpinned to evict", self.tier, incoming, max(over, 0))
        return [self._evict_locked(v, incoming=incoming) for v in victims]

    def peek(self, expert_id: str):
        """The resident value of `expert_id`, or None: no pin, no hit counted, no recency touched."""
        with self._cond:
            entry = self._entries.get(expert_id)
            return None if entry is None or entry.loading else entry.value

    def hold(self, expert_id: str) -> Handle | None:
        """Pin `expert_id` if it is resident (a hit), else None: never loads and never evicts.

        What a tier below uses to take an expert from this one only when it is
        already here (an exclusive tier: a miss goes around it, not through it).
        An expert still loading or being admitted is waited for, as `acquire` does.
        """
        with self._cond:
            while (entry := self._entries.get(expert_id)) is not None and entry.loading:
                self._cond.wait()
            if entry is None or entry.drop_on_release:   # a stale version is not handed up a tier
                return None
            self._seq += 1
            entry.pins += 1
            entry.used_seq = self._seq
            self._stats.hits += 1
            return Handle(expert_id, entry.value, entry.nbytes)

    def admit(self, expert_id: str, produce: Callable[[list], Any] | None = None, *,
              keep: Collection[str | None] = (), worth_keeping: bool = False) -> bool:
        """Make `expert_id` resident without loading it from the source: an expert handed down a tier.

        Room is made by the pool's policy exactly as for a load (pinned experts
        are never victims).  `produce(reuse)` builds the value and may take one
        of `reuse`, the values just evicted, so a same-sized buffer is refilled
        instead of allocated; with `produce=None` the value is None (the
        simulator's weightless experts).  Returns False and changes nothing when
        the expert is already resident or loading, or cannot fit now.  If
        `produce` raises, the reservation is cleared (no half entry) and the
        error propagates; the victims stay evicted.  Counted in `admits`, not as
        a miss: nothing was read from the source.  Residents in `keep` are not
        victims this time: pass the expert the tier below is making room for
        (`PoolEvent.incoming`), which it is about to take from here, so that
        moving its victim down does not push out the very expert coming up.

        `worth_keeping` is a victim cache's admission test: when room must be
        made, the expert is declined (False, nothing evicted) if the policy,
        shown it as one more resident, would evict it before enough of the
        others, i.e. it is worth less than what it would push out.  Without
        it, a probability-ranked tier takes every victim handed down: a rarely
        used expert just run on the GPU pushes out a more probable one, which
        the next cycle of the board reads from the SSD again.  Under a policy
        that ranks by recency alone (LRU, FIFO) the test does not apply: a
        newcomer could never win there, and a full tier would freeze.
        Counted in `declined`.
        """
        entered = time.perf_counter()
        ctx = self._context()
        need = self.source.size(expert_id)
        with self._cond:
            share = self._share
            if (expert_id in self._entries or need > self.capacity
                    or (share is not None and expert_id in share.members and need > share.max_bytes)):
                return False
            self._seq += 1
            state = self._state_locked(ctx, incoming=expert_id, keep=keep)
            victims = self._choose_locked(state, expert_id, need)
            if victims is None:
                return False
            if (worth_keeping and victims and ranks_by_value(self.policy)
                    and self._worth_less(state, expert_id, need)):
                self._stats.declined += 1
                self._stats.manage_seconds += time.perf_counter() - entered
                return False
            evicted = [self._evict_locked(v, incoming=expert_id) for v in victims]
            self._entries[expert_id] = _Entry(None, need, self._seq, self._seq, loading=True)
        self._fill(expert_id, evicted, need, entered, "admit", reuse_victims=True,
                   make=lambda reuse: produce(reuse) if produce is not None else None)
        return True

    def admissions(self, expert_ids: Sequence[str], *, keep: Collection[str] = ()) -> list[bool]:
        """Would the policy take each of these misses in turn, or is each worth less than what it pushes out?

        Cache admission for a caller that can serve a miss without the pool
        (an MoE layer computes a declined expert straight from its file,
        `executors.pooled_experts`): a miss that the policy, shown it as one
        more resident, would evict before enough of the others (`_worth_less`,
        the victim cache's test) is declined, and the residents it would have
        pushed out stay.  Without it, every miss evicts: an expert the next
        tokens are unlikely to ask for pushes out one they are likely to.

        The answers are in turn, as the caller's wave will pin them
        (`PinnedWave`): the residents in `keep` (the layer's own hits) and each
        admitted miss are pinned, so a later miss is weighed against the other
        residents only (the caller acquires its resident experts first, then
        the admitted misses in the order given).  When a miss no longer fits
        beside that wave, a new wave begins, as it will when the layer runs:
        the earlier wave's experts are released then, the most recently used,
        and the policy may push them out.  A miss that fits
        in free room, one whose room others' pins hold (the caller's wait
        decides), and any miss under a recency-only policy (LRU, FIFO: a
        newcomer could never outrank a resident) are admitted.  Nothing
        changes here; `bypass` counts a declined miss once it is served.
        """
        ctx = self._context()
        with self._cond:
            state = self._state_locked(ctx, keep=keep)
        seq = max((r.used_seq for r in state.residents), default=0)
        wave = {r.expert_id for r in state.residents if r.expert_id in keep}
        state = replace(state, residents=tuple(replace(r, used_seq=seq + 1) if r.expert_id in wave else r
                                               for r in state.residents))    # the layer uses them now
        seq += 1
        out = []
        for eid in expert_ids:
            need = self.source.size(eid)
            if eid in {r.expert_id for r in state.residents}:
                out.append(True)
                continue
            victims = self.policy.choose_victims(replace(state, incoming=eid), need) if need > state.free else []
            if victims is None and wave:            # the wave is full: the next one finds it released
                state = replace(state, residents=tuple(replace(r, pinned=False) if r.expert_id in wave else r
                                                       for r in state.residents))
                wave = set()
                victims = self.policy.choose_victims(replace(state, incoming=eid), need)
            admit = not victims or not ranks_by_value(self.policy) or not self._worth_less(state, eid, need)
            out.append(admit)
            if admit and victims is not None:    # resident, just used, pinned in the wave; its victims are gone
                seq += 1
                kept = tuple(r for r in state.residents if r.expert_id not in victims)
                state = replace(state, residents=(*kept, Resident(eid, need, seq, seq, pinned=True)))
                wave.add(eid)
        return out

    def bypass(self, expert_id: str) -> None:
        """Count a miss served beside the pool: read for one use and dropped, never resident (`admissions`)."""
        with self._cond:
            self._stats.bypassed += 1
            self._stats.bypassed_bytes += self.source.size(expert_id)

    def discard(self, expert_id: str, *, when_free: bool = False) -> bool:
        """Evict `expert_id` if it is resident and nobody holds it; False otherwise.  Never raises.

        For an exclusive tier whose expert was just promoted to the tier below:
        if another holder still pins it, the copy simply stays.  With
        `when_free` (a stale version after a promotion), a held copy is marked
        instead and the release that leaves it unpinned evicts it, so the next
        batch loads the new version even when batches of a hot expert follow
        one another with no gap for a later check to find.
        """
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is None or entry.loading:
                return False
            if entry.pins:
                entry.drop_on_release = entry.drop_on_release or when_free
                return False
            ev = self._evict_locked(expert_id, stale=when_free)
        self._tell(ev)
        return True

    def release(self, handle: Handle) -> None:
        ev = None
        with self._cond:
            entry = self._entries.get(handle.expert_id)
            if entry is None or entry.pins <= 0 or entry.loading:
                raise CoEError(f"release of '{handle.expert_id}' which is not acquired in the {self.tier} pool")
            entry.pins -= 1
            if entry.pins == 0 and entry.drop_on_release:
                ev = self._evict_locked(handle.expert_id)
            self._changed_locked()
        if ev is not None:
            self._tell(ev)

    def evict(self, expert_id: str) -> bool:
        """Evict an unpinned resident expert; False if it was not resident."""
        with self._cond:
            entry = self._entries.get(expert_id)
            if entry is None:
                return False
            if entry.pins or entry.loading:
                raise CoEError(f"cannot evict '{expert_id}': a running batch holds it or it is still loading")
            ev = self._evict_locked(expert_id)
        self._tell(ev)
        return True

    def contains(self, expert_id: str) -> bool:
        with self._cond:
            e = self._entries.get(expert_id)
            return e is not None and not e.loading

    def present(self, expert_id: str) -> bool:
        """Resident or being loaded: the expert is (about to be) here."""
        with self._cond:
            return expert_id in self._entries

    def resident(self) -> list[str]:
        with self._cond:
            return [k for k, e in self._entries.items() if not e.loading]

    def used_bytes(self) -> int:
        with self._cond:
            return sum(e.nbytes for e in self._entries.values())

    def stats(self) -> PoolStats:
        with self._cond:
            s = PoolStats(**vars(self._stats))
            s.resident_bytes = sum(e.nbytes for e in self._entries.values() if not e.loading)
            s.capacity = self.capacity
            return s

    def state(self) -> PoolState:
        ctx = self._context()
        with self._cond:
            return self._state_locked(ctx)

    def close(self) -> None:
        """Drop every unpinned resident; their memory goes back with the last reference."""
        with self._cond:
            evs = [self._evict_locked(k) for k in [k for k, e in self._entries.items() if not e.pins and not e.loading]]
        for ev in evs:
            self._tell(ev)

    # -- internals ----------------------------------------------------------------
    def _tell(self, ev: PoolEvent) -> None:
        """Tell the listener; one that raises is logged, never allowed to undo what the pool already did.

        The event reports a change made under the lock (an entry filled and
        pinned for its caller, a victim gone): a raise here would leave a pin
        no handle ever reaches, or the other victims untold before their
        memory is reused.
        """
        try:
            self._on_event(ev)
        except Exception:  # noqa: BLE001 - the pool's state is already changed; the listener's failure is its own
            log.exception("%s pool: a listener failed on the %s of %s", self.tier, ev.event, ev.expert_id)

    def _state_locked(self, ctx: dict, incoming: str | None = None, keep: Collection[str | None] = ()) -> PoolState:
        """What the policy sees; `keep` residents look pinned (not victims), as held ones do."""
        return PoolState(self.capacity, tuple(
            Resident(k, e.nbytes, e.loaded_seq, e.used_seq, e.pins > 0 or e.loading or k in keep)
            for k, e in self._entries.items()),
            self._probabilities, self._preliminaries, frozenset(ctx.get("queued", ())), ctx.get("future", ()),
            incoming, ctx.get("counts", {}), ctx.get("gate_scores", {}), ctx.get("predicted", {}),
            frozenset(ctx.get("expected", ())))

    def _choose_locked(self, state: PoolState, expert_id: str, need: int) -> list[str] | None:
        """The policy's victims to fit `expert_id` (`need` bytes).  An expert of a capped group (`Share`) over
        its cap first makes room among its own group (the policy, on the group's residents within the cap);
        then, if the pool is still short, among all the residents that are left."""
        share = self._share
        if share is None or expert_id not in share.members:
            return self.policy.choose_victims(state, need)
        group = replace(state, capacity=share.max_bytes,
                        residents=tuple(r for r in state.residents if r.expert_id in share.members))
        inside = self.policy.choose_victims(group, need)
        if not inside:
            return inside if inside is None else self.policy.choose_victims(state, need)
        gone = set(inside)
        rest = self.policy.choose_victims(
            replace(state, residents=tuple(r for r in state.residents if r.expert_id not in gone)), need)
        return None if rest is None else [*inside, *rest]

    def _worth_less(self, state: PoolState, expert_id: str, need: int) -> bool:
        """Would the policy evict `expert_id` itself, were it resident, to get back under capacity?

        The newcomer is shown as the least recently used resident, so it must win on the policy's other
        criteria (usage probability, a queued request, a preliminary present, CoServe's fixed order among
        equal probabilities) and never on recency: where the policy's only tie-break is recency, the one
        already held stays.  A board's rare types share one probability (one placement each), and a line
        cycles through them; letting the one just used push out another of them only trades one for the
        other before either is used again.  (`admit` skips the test under a recency-only policy, where a
        newcomer could never win.)  The room `admit` found without the newcomer is there with it too, so
        the policy always answers."""
        newcomer = Resident(expert_id, need, -1, -1)
        over = replace(state, residents=(*state.residents, newcomer), incoming=None)
        return expert_id in (self.policy.choose_victims(over, 0) or ())

    def _evict_locked(self, expert_id: str, incoming: str | None = None, *, stale: bool = False) -> PoolEvent:
        entry = self._entries.get(expert_id)
        if entry is None or entry.pins or entry.loading:
            raise CoEError(f"policy {self.policy.name} chose '{expert_id}', which is pinned or absent, as a victim")
        del self._entries[expert_id]
        self._stats.evictions += 1
        self._changed_locked()
        return PoolEvent(expert_id, self.tier, "evict", entry.nbytes, 0.0, time.time(), entry.value, incoming,
                         stale=stale or entry.drop_on_release)


def initialize(pools: list[Pool], order: list[str]) -> dict[str, list[str]]:
    """CoServe's initialisation: experts in `order` (descending usage probability) go round-robin
    across `pools`, each into the next pool with free room, until no pool has room left.
    Nothing is evicted.  Returns what each pool received."""
    got: dict[str, list[str]] = {p.name: [] for p in pools}
    if not pools:
        return got
    turn = 0
    for expert_id in order:
        size = pools[0].source.size(expert_id)
        for k in range(len(pools)):
            pool = pools[(turn + k) % len(pools)]
            if pool.contains(expert_id) or pool.room_for(expert_id) < size:
                continue
            pool.release(pool.acquire(expert_id))
            got[pool.name].append(expert_id)
            turn = (turn + k + 1) % len(pools)
            break
        if all(p.capacity - p.used_bytes() <= 0 for p in pools):
            break
    return got


def initialize_in_turn(groups: list[list[Pool]], order: list[str]) -> dict[str, list[str]]:
    """Fill `groups` of pools one group after another, each round-robin (`initialize`) with the experts of
    `order` that no earlier group holds.  Returns what each pool received.

    Why: the paper deals experts round-robin across every executor, which
    suits executors of one kind.  Across a GPU and CPU executors it leaves
    most of the hottest experts on the slow CPU executors (two CPU executors
    beside one GPU take two of every three of the top ones), so under load
    the GPU, which runs most requests, first reads them from SSD.  Filling
    the GPU pools first ([gpu pools], [cpu pools]) keeps the most probable
    experts where most requests run; the CPU pools start with the next ones.
    """
    got: dict[str, list[str]] = {}
    held: set[str] = set()
    for pools in groups:
        got.update(initialize(pools, [e for e in order if e not in held]))
        held |= {e for p in pools for e in p.resident()}
    return got


FILLS = ("gpu-first", "round-robin")


def fill_pools(pools: list[Pool], order: list[str], how: str, gpus: Collection[str]) -> dict[str, list[str]]:
    """The executors' pools at start, from `order` (most probable first): `how` is 'round-robin' across all
    of them (the paper's, `initialize`) or 'gpu-first': the pools named in `gpus`, then the rest
    (`initialize_in_turn`).  Returns what each pool received."""
    if how == "round-robin":
        return initialize(pools, order)
    if how == "gpu-first":
        return initialize_in_turn([[p for p in pools if p.name in gpus], [p for p in pools if p.name not in gpus]],
                                  order)
    raise ValueError(f"unknown fill '{how}' (known: {', '.join(FILLS)})")


def present_above(queued: Iterable[Collection[str]], above: Iterable[Pool]) -> set[str]:
    """What a lower tier's policy counts as present: the experts queued anywhere and those the pools `above`
    it hold (an exclusive host tier never holds what a GPU pool holds, so a detector whose classifier sits
    on a GPU is not orphaned)."""
    out: set[str] = set()
    for q in queued:
        out |= set(q)
    for pool in above:
        out |= set(pool.resident())
    return out


def initialize_tier(tier: Pool, above: list[Pool], order: list[str]) -> list[str]:
    """Fill a lower tier with the experts of `order` that none of the pools `above` it hold.

    Run after `initialize` filled the pools above: the lower tier then starts
    with the next most probable experts instead of copies of theirs (an
    exclusive host tier behind the GPU pools).  Returns what it received.
    """
    held = {e for p in above for e in p.resident()}
    return initialize([tier], [e for e in order if e not in held])[tier.name]
