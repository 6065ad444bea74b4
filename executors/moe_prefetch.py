"""Next-layer expert prefetch (the importance paper's top-score prefetch), and how good its guesses are.

While a layer computes, its output is approximated from the experts already
resident (the hits, computed first), the next MoE layer's router weight is
applied to `hidden + partial output`, and that layer's predicted top experts
that are not in memory are loaded in the background.  The approximation skips
the next layer's attention and norm (a cheap stand-in for the paper's pass
through the next layer with the KV cache); its precision and recall against
the experts the next layer really asks for are counted, so the bench can say
whether it pays.

Prefetches never delay the layer's own loads.  They run on a thread of
their own, one at a time; room for one is made there, only when its read
can start, and a prefetch that finds no room (pinned experts fill the pool)
or whose layer has run meanwhile without asking for it is dropped, not
waited for.  Its file read gives way too (`storage.flat.yield_to`): it does
not start while a layer's load is queued or running
(`pooled_experts.demand_loads`), and pauses between 2 MiB chunks while one
is (`paused`), keeping what it has read, then goes on where it stopped.
Before this a wrong guess held the one disk while the real misses queued
behind it; later, before reads could pause, a guess gave up its partial
read at every layer load and started over, so it seldom finished in the gaps
between them.
When the guess's layer runs and asks for the expert being read, the read
is that layer's from then on (`adopted`): it no longer pauses, and the
layer joins it (`Pool.acquire_async(join=...)`) rather than reading the
expert a second time.  A read stops (`yielded`) and the room it took is
freed when its layer ran without asking for it, when a layer finds no room
for its own experts (`pooled_experts.short_of_room`), or after
`PAUSE_LIMIT_SECONDS` paused in all; a prefill pass voids the guesses for
the layers it runs (`forget`).
A prefetched expert is unpinned as soon as it is in, so it is an ordinary
resident the policy may evict.  Prefetch changes only what is in memory,
never the arithmetic: logits stay exact.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from routing.moe_predictor import LiveInputs
from storage.pool import Pool

from .pooled_experts import DECODE_TOKENS

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.005     # how often a waiting prefetch checks whether its guess is still of use
# a read paused longer than this in all gives up its room: a guess for the next token waits out a few layers'
# reads (tens of ms); a pause this long means something waits on the paused read that it cannot see
PAUSE_LIMIT_SECONDS = 0.5


@dataclass
class PrefetchStats:
    predicted: int = 0          # experts predicted for a next layer
    true_positive: int = 0      # predicted and then asked for
    actual: int = 0             # experts the predicted-for layers asked for
    issued: int = 0             # read in (predicted and not in memory): before their layer ran, or joined by it
    useful: int = 0             # of those, asked for by the layer they were loaded for (a read saved)
    dropped: int = 0            # no room, its layer ran first (before or during the read), or failed
    yielded: int = 0            # reads stopped midway: their layer ran without asking, or a layer needed the room
    paused: int = 0             # times a read paused for a layer's own read (to go on where it stopped, or stop)
    adopted: int = 0            # reads still under way when their layer asked for the expert: joined, not repeated
    stopped_ran: int = 0        # of `yielded`: their layer ran without asking for the expert
    stopped_room: int = 0       # of `yielded`: a layer found no room for its own experts
    stopped_limit: int = 0      # of `yielded`: paused longer than PAUSE_LIMIT_SECONDS in all

    @property
    def precision(self) -> float:
        return self.true_positive / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.true_positive / self.actual if self.actual else 0.0


class _Guess:
    """One prediction for one layer: its experts, and what the layer asked for once it ran (None until then)."""

    __slots__ = ("experts", "asked")

    def __init__(self, experts: set[int]) -> None:
        self.experts = experts
        self.asked: set[int] | None = None


class _Prefetcher:
    """What both prefetchers share: scoring guesses against what a layer asks for, and loading them."""

    def __init__(self, ids: dict[int, list[str]], pool_of: Callable[[str], Pool]) -> None:
        self._ids, self._pool_of = ids, pool_of
        self._pending: dict[int, _Guess] = {}             # per layer: the guess awaiting its use
        self._loaded: dict[int, set[int]] = {}             # per layer: the guesses this prefetcher read in
        self._asking: frozenset[str] = frozenset()          # what the layer that routed last asked for (`asking`)
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coe-expert-prefetch")
        self.stats = PrefetchStats()

    def expected(self) -> frozenset[str]:
        """Experts guessed for a layer that has not run since, and what the layer that routed last asked for:
        every eviction policy, in every tier, keeps them last.

        Without the guesses a guess is an ordinary resident the moment it is
        in, and the next load evicts it by recency or score before its use
        comes (measured: hit rate fell from 84% to 77% with prefetch on).  The
        layer's own experts are held out of the device pool's room for a
        prefetch outright (`asking`); ranked last here, they also stay in a
        host tier a prefetch's copy passes through, which takes room as the
        tier's own load does and so cannot be given a `keep`.
        """
        with self._lock:
            guessed = {self._ids[layer][e] for layer, guess in self._pending.items() for e in guess.experts}
            return frozenset(guessed) | self._asking

    def asking(self, layer: int, experts) -> None:
        """`layer` asked for `experts` (its router's choice after any substitution): a prefetch may not evict them.

        A guess is issued from the router call, before the layer pins what it
        asked for (its wave comes after the router returns), and the prefetch
        thread's eviction took one of those (the policy had just re-ranked
        them for the next token); the layer read it straight back.  They are
        held out of the prefetch's room (`Pool.acquire_async(keep=...)`, read
        under the pool's lock when the victims are chosen) until the next
        layer routes or a prefill runs (`forget`); a prefetch that finds no
        other room is dropped.  Indices outside the layer (a router's padding)
        are ignored.  One window stays: substitution reads what is resident
        before the router's listeners run, so a prefetch that evicts a chosen
        substitute in between makes the layer load it.
        """
        ids = self._ids.get(layer, [])
        asked = frozenset(ids[e] for e in {int(x) for x in np.asarray(experts).reshape(-1)} if 0 <= e < len(ids))
        with self._lock:
            self._asking = asked

    def asked(self) -> frozenset[str]:
        """What the layer that routed last asked for (held out of a prefetch's room)."""
        with self._lock:
            return self._asking

    def _score(self, layer: int, actual: set[int]) -> None:
        with self._lock:
            self.stats.useful += len(self._loaded.pop(layer, set()) & actual)
            pred = self._pending.pop(layer, None)
            if pred is None:
                return
            pred.asked = actual          # a read of one of these still under way is the layer's own now
            self.stats.predicted += len(pred.experts)
            self.stats.actual += len(actual)
            self.stats.true_positive += len(pred.experts & actual)

    def forget(self, layer: int) -> None:
        """A pass that is not a decode step (a new prompt's prefill) ran `layer`: its pending guess is void.

        Its read, if under way, stops, so nothing that pass waits on is
        paused behind it.
        """
        with self._lock:
            pred = self._pending.pop(layer, None)
            self._loaded.pop(layer, None)
            self._asking = frozenset()              # a prefill issues no guess: nothing to hold out
            if pred is not None:
                pred.asked = set()

    def _issue(self, layer: int, guess: set[int]) -> None:
        """Remember the guess for scoring; queue its experts that are not in memory for the prefetch thread."""
        g = _Guess(guess)
        with self._lock:
            self._pending[layer] = g
        for e in sorted(guess):
            eid = self._ids[layer][e]
            pool = self._pool_of(eid)
            if not pool.present(eid):
                self._loader.submit(self._fetch, layer, g, e, eid, pool)

    def _fetch(self, layer: int, guess: _Guess, e: int, eid: str, pool: Pool) -> None:
        """On the prefetch thread: load one guess when the disk is free, as long as its layer has not run.

        It waits while a layer's own read is queued or running; room is made
        only when its read can start (a read that gave way at once would have
        evicted a resident for nothing).  Under way, the read pauses while a
        layer's read is (`storage.flat.yield_to`) and goes on where it
        stopped; once its layer has asked for the expert it is that layer's
        read and pauses no more; it stops if its layer ran without asking.
        """
        from storage.flat import ReadYielded, yield_to

        from .pooled_experts import demand_loads, short_of_room, wait_no_demand

        if pool.present(eid):
            return

        def ran() -> bool:              # its layer has run (or a newer guess replaced this one)
            with self._lock:
                return guess.asked is not None or self._pending.get(layer) is not guess

        def adopted() -> bool:          # its layer ran and asked for it: the layer waits on this read
            with self._lock:
                return guess.asked is not None and e in guess.asked

        paused_since, paused_for, why = [None], [0.0], [""]

        def give_up() -> bool:          # of no use any more, a layer needs its room, or paused too long
            if adopted():               # the layer waits on this read: never stopped, whatever came before
                return False
            waited = paused_for[0] + (time.monotonic() - paused_since[0] if paused_since[0] is not None else 0.0)
            why[0] = "ran" if ran() else "room" if short_of_room() else "limit" if waited > PAUSE_LIMIT_SECONDS else ""
            return bool(why[0])

        def pause() -> bool:            # a layer's own read wants the disk, and this one is not the layer's yet
            now = demand_loads() > 0 and not adopted()
            if now and paused_since[0] is None:
                paused_since[0] = time.monotonic()
                with self._lock:
                    self.stats.paused += 1
            elif not now and paused_since[0] is not None:
                paused_for[0] += time.monotonic() - paused_since[0]
                paused_since[0] = None
            return now
        # the disk is the layers' first: wait for it to be free, as long as the guess can still be of use
        while not wait_no_demand(IDLE_POLL_SECONDS):
            if ran():
                break
        if ran():           # not started before its layer came: the layer reads it itself
            with self._lock:
                self.stats.dropped += 1
            return
        if pool.present(eid):   # a layer's own load brought it in while this waited: nothing to read or count
            return
        try:
            with yield_to(give_up, pause=pause, wait=wait_no_demand):
                fut = pool.acquire_async(eid, _inline, keep=self.asked)
            handle = fut.result() if fut is not None else None
        except ReadYielded:             # of no use, or its room wanted: the room it took is free again
            with self._lock:
                self.stats.yielded += 1
                field = {"ran": "stopped_ran", "room": "stopped_room", "limit": "stopped_limit"}.get(why[0])
                if field:
                    setattr(self.stats, field, getattr(self.stats, field) + 1)
            return
        except Exception as exc:        # the layer's own load of it will raise this, where it matters
            log.debug("prefetch of %s failed: %s", eid, exc)
            with self._lock:
                self.stats.dropped += 1
            return
        if handle is None:              # no room beside pinned experts: not waited for
            with self._lock:
                self.stats.dropped += 1
            return
        pool.release(handle)            # an ordinary resident now (kept last while its guess awaits its token)
        with self._lock:
            if self._pending.get(layer) is guess:     # read in before its layer ran: it may save a read
                self.stats.issued += 1
                self._loaded.setdefault(layer, set()).add(e)
            elif guess.asked is not None and e in guess.asked:   # its layer came during the read and joined it
                self.stats.issued += 1
                self.stats.useful += 1
                self.stats.adopted += 1
            else:                                      # its layer ran meanwhile: too late to count
                self.stats.dropped += 1

    def drain(self) -> None:
        """Wait until the guesses queued so far are read in, dropped or given way."""
        self._loader.submit(lambda: None).result()

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)     # queued guesses hold nothing: drop them


class NextLayerPrefetcher(_Prefetcher):
    """Predicts layer l+1's experts during layer l and loads the missing ones in the background."""

    def __init__(self, routers: dict[int, torch.nn.Module], ids: dict[int, list[str]], top_k: int,
                 pool_of: Callable[[str], Pool], *, max_tokens: int = 4) -> None:
        super().__init__(ids, pool_of)
        layers = sorted(routers)
        self._next = dict(zip(layers, layers[1:]))
        self._routers, self._k, self._max_tokens = routers, top_k, max_tokens

    def wants(self, tokens: int) -> bool:
        """Decode steps only: a prefill asks for nearly every expert anyway."""
        return tokens <= self._max_tokens

    def observe(self, layer: int, hits: list[int]) -> None:
        """What `layer` really asks for: scores the prediction made for it, if any, and holds them out of a
        prefetch's room until its wave has pinned them."""
        self.asking(layer, hits)
        self._score(layer, set(hits))

    @torch.no_grad()
    def predict(self, layer: int, approx: torch.Tensor) -> None:
        """`approx` [T, H]: this layer's input plus its partial output; prefetch the next layer's guesses."""
        nxt = self._next.get(layer)
        if nxt is None:
            return
        router = self._routers[nxt]
        logits = torch.nn.functional.linear(approx.to(router.weight.dtype), router.weight)
        self._issue(nxt, {int(e) for e in logits.topk(self._k, dim=-1).indices.reshape(-1).tolist()})


class TokenPrefetcher(_Prefetcher):
    """Token-wise prefetch (SMoE): when layer l routes token t, load what token t+1 will likely ask of layer l.

    The guesses come from a trained `routing.moe_predictor.TokenPredictor`
    (its top-m); they have the rest of token t to load.  Like the next-layer
    prefetch, loads run on their own thread, a guess that finds no room is
    dropped, and a loaded guess is unpinned at once.

    Only guesses the predictor gives at least `min_prob` are loaded.  A right
    guess takes at most one read's stall off the critical path; a wrong one
    evicts a resident to make room and reads in the disk's idle gaps (it
    pauses for the layers' reads, so the real misses wait at most one 2 MiB
    chunk for it).  When wrong reads also held the disk the real misses
    queued for, counting the reads alone a guess paid when p > 1 - p; the
    default 0.5 comes from there.  It is not a fitted value.  0 loads every
    top-m guess.
    """

    MIN_PROB = 0.5

    def __init__(self, predictor, ids: dict[int, list[str]], pool_of: Callable[[str], Pool], *,
                 m: int | None = None, min_prob: float = MIN_PROB) -> None:
        super().__init__(ids, pool_of)
        self._pred, self._m, self.min_prob = predictor, m or predictor.top_k, min_prob
        self._index = {layer: j for j, layer in enumerate(predictor.layers)}
        self._live = LiveInputs(predictor)
        self._oracle: Callable[[int], list[int]] | None = None

    def guess_with(self, oracle: Callable[[int], list[int]] | None) -> None:
        """Take the guesses from `oracle(layer)` (called once per decode router call) instead of the predictor.

        For an offline bound only (`executors.moe_decode.TraceGuesses`, the
        trace's own next token): how much prefetch could pay here if every
        guess were right, which says whether the mechanism or the predictor
        is what holds it back.
        """
        self._oracle = oracle

    def on_router(self, layer: int, probs, chosen) -> None:
        """Called with each router call's scores [T, E] and choices [T, k] (decode: T is 1)."""
        x = self._live.observe(layer, probs)        # every call, a prefill's too: the next step's previous token
        if len(probs) > DECODE_TOKENS:
            self.forget(layer)
            return
        self.asking(layer, chosen)
        if x is None:
            return
        self._score(layer, {int(e) for e in chosen.reshape(-1)})
        guess = self._oracle(layer) if self._oracle is not None else \
            self._pred.confident(self._index[layer], x, self._m, self.min_prob)
        self._issue(layer, set(guess))


def _inline(load: Callable) -> Future:
    """Run a pool's load on this thread (the prefetch thread), as a completed future."""
    fut: Future = Future()
    try:
        fut.set_result(load())
    except BaseException as exc:
        fut.set_exception(exc)
    return fut
