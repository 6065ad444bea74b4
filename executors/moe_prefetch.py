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
or whose layer has run meanwhile is dropped, not waited for.  Its file read
gives way too (`storage.flat.yield_to`): it does not start while a layer's
load is queued or running (`pooled_experts.demand_loads`), and stops between
2 MiB chunks when one comes; the expert is then not loaded (`yielded`).
Before this a wrong guess held the one disk while the real misses queued
behind it.
A prefetched expert is unpinned as soon as it is in, so it is an ordinary
resident the policy may evict.  Prefetch changes only what is in memory,
never the arithmetic: logits stay exact.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from routing.moe_predictor import LiveInputs
from storage.pool import Pool

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.005     # how often a waiting prefetch checks whether its guess is still of use


@dataclass
class PrefetchStats:
    predicted: int = 0          # experts predicted for a next layer
    true_positive: int = 0      # predicted and then asked for
    actual: int = 0             # experts the predicted-for layers asked for
    issued: int = 0             # read in before their layer ran (predicted and not in memory)
    useful: int = 0             # of those, asked for by the layer they were loaded for (a read saved)
    dropped: int = 0            # no room, its layer ran first (before or during the read), or failed
    yielded: int = 0            # times a read stopped midway (a layer's own read came, or its layer ran)

    @property
    def precision(self) -> float:
        return self.true_positive / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.true_positive / self.actual if self.actual else 0.0


class _Prefetcher:
    """What both prefetchers share: scoring guesses against what a layer asks for, and loading them."""

    def __init__(self, ids: dict[int, list[str]], pool_of: Callable[[str], Pool]) -> None:
        self._ids, self._pool_of = ids, pool_of
        self._pending: dict[int, set[int]] = {}          # per layer: the guesses awaiting their use
        self._loaded: dict[int, set[int]] = {}             # per layer: the guesses this prefetcher read in
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coe-expert-prefetch")
        self.stats = PrefetchStats()

    def expected(self) -> frozenset[str]:
        """Experts guessed for a layer that has not run since: every eviction policy keeps them last.

        Without this a guess is an ordinary resident the moment it is in, and
        the next load evicts it by recency or score before its use comes
        (measured: hit rate fell from 84% to 77% with prefetch on).
        """
        with self._lock:
            return frozenset(self._ids[layer][e] for layer, guess in self._pending.items() for e in guess)

    def _score(self, layer: int, actual: set[int]) -> None:
        with self._lock:
            self.stats.useful += len(self._loaded.pop(layer, set()) & actual)
            pred = self._pending.pop(layer, None)
            if pred is None:
                return
            self.stats.predicted += len(pred)
            self.stats.actual += len(actual)
            self.stats.true_positive += len(pred & actual)

    def _issue(self, layer: int, guess: set[int]) -> None:
        """Remember the guess for scoring; queue its experts that are not in memory for the prefetch thread."""
        with self._lock:
            self._pending[layer] = guess
        for e in sorted(guess):
            eid = self._ids[layer][e]
            pool = self._pool_of(eid)
            if not pool.present(eid):
                self._loader.submit(self._fetch, layer, guess, e, eid, pool)

    def _fetch(self, layer: int, guess: set[int], e: int, eid: str, pool: Pool) -> None:
        """On the prefetch thread: load one guess when the disk is free, as long as its layer has not run.

        It waits while a layer's own read is queued or running; room is made
        only when its read can start (a read that gave way at once would have
        evicted a resident for nothing); the read gives way between chunks
        (`storage.flat.yield_to`) and is tried again when the disk is free.
        """
        from storage.flat import ReadYielded, yield_to

        from .pooled_experts import demand_loads, wait_no_demand

        if pool.present(eid):
            return

        def stale() -> bool:
            with self._lock:
                return self._pending.get(layer) is not guess

        def urgent() -> bool:           # a layer's own read wants the disk, or this guess's layer has run
            return demand_loads() > 0 or stale()
        while True:
            # the disk is the layers' first: wait for it to be free, as long as the guess can still be of use
            while not wait_no_demand(IDLE_POLL_SECONDS):
                if stale():
                    break
            if stale():
                with self._lock:
                    self.stats.dropped += 1
                return
            try:
                with yield_to(urgent):
                    fut = pool.acquire_async(eid, _inline)
                handle = fut.result() if fut is not None else None
            except ReadYielded:         # a layer's read came (or the layer ran): try again when the disk is free
                with self._lock:
                    self.stats.yielded += 1
                continue
            except Exception as exc:    # the layer's own load of it will raise this, where it matters
                log.debug("prefetch of %s failed: %s", eid, exc)
                with self._lock:
                    self.stats.dropped += 1
                return
            break
        if handle is None:              # no room beside pinned experts: not waited for
            with self._lock:
                self.stats.dropped += 1
            return
        pool.release(handle)            # an ordinary resident now (kept last while its guess awaits its token)
        with self._lock:
            if self._pending.get(layer) is guess:     # read in before its layer ran: it may save a read
                self.stats.issued += 1
                self._loaded.setdefault(layer, set()).add(e)
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
        """What `layer` really asks for: scores the prediction made for it, if any."""
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
    spends one read of the disk the real misses queue for and also evicts a
    resident to make room.  Counting the reads alone, a guess pays when
    p > 1 - p, so the default 0.5 is a lower bound on the break-even (the
    eviction makes the true one higher), not a fitted value.  0 loads every
    top-m guess.
    """

    MIN_PROB = 0.5

    def __init__(self, predictor, ids: dict[int, list[str]], pool_of: Callable[[str], Pool], *,
                 m: int | None = None, min_prob: float = MIN_PROB) -> None:
        super().__init__(ids, pool_of)
        self._pred, self._m, self.min_prob = predictor, m or predictor.top_k, min_prob
        self._index = {layer: j for j, layer in enumerate(predictor.layers)}
        self._live = LiveInputs(predictor)

    def on_router(self, layer: int, probs, chosen) -> None:
        """Called with each router call's scores [T, E] and choices [T, k] (decode: T is 1)."""
        x = self._live.observe(layer, probs)        # every call, a prefill's too: the next step's previous token
        if x is None or len(probs) > 4:
            return
        self._score(layer, {int(e) for e in chosen.reshape(-1)})
        self._issue(layer, set(self._pred.confident(self._index[layer], x, self._m, self.min_prob)))


def _inline(load: Callable) -> Future:
    """Run a pool's load on this thread (the prefetch thread), as a completed future."""
    fut: Future = Future()
    try:
        fut.set_result(load())
    except BaseException as exc:
        fut.set_exception(exc)
    return fut
