"""The pooled experts module: transformers' experts seam, with weights paged through `Pool`s.

It replaces a model's experts module and keeps its signature,
`forward(hidden_states, top_k_index, top_k_weights)`.  Each expert it needs is
acquired from the pool that holds its (layer, expert) store entry; the pool
loads it (SSD -> host -> device) and evicts by its policy, never knowing it
holds an LLM.

Pinning.  Every expert the layer computes with stays pinned until its
contribution is added; a pinned expert is never a victim, so a load later in
the same layer cannot evict it and refill its buffer under it (the vLLM LFRU
bug: a freshly loaded expert evicted within the same forward pass, its memory
reused, wrong weights used silently).  When the pool cannot hold all of a
layer's experts at once (a prefill touching every expert with a pool of top-k
experts), the layer runs in waves: as many as fit are pinned, computed and
released, then the next.  The misses of a wave load concurrently on loader
threads, and the layer computes expert i while the later ones still load.

Exactness.  The arithmetic is the eager transformers loop, op for op, in
ascending expert order, so logits equal the unmodified model's bit for bit in
fp32 on the CPU whatever the pool size or policy, prefill and every decode step
(tests/test_moe_pooled.py), given weights on 64-byte-aligned memory on both
sides: a CPU kernel on unaligned data rounds differently, and transformers
computes on the checkpoint's memory map, which leaves some tensors unaligned
(ours are copied to aligned memory, `moe_model._load_resident`).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from storage.pool import Handle, Pool, wait_for_room

from .moe_split import FILE, HOST

WAIT_SECONDS = 60.0
DECODE_TOKENS = 4   # a pass over at most this many tokens is decode (the split's case); more is a prefill
LOADERS = 4         # concurrent expert loads: a cold read at queue depth 2-4 moves ~1.4x the bytes of one at a time

_loader: ThreadPoolExecutor | None = None
_loader_lock = threading.Lock()
_demand = 0                 # layers' own loads submitted and not yet finished, in this process
_demand_lock = threading.Condition()
_short = 0                  # layers' waves that found no room for one of their experts, and have not ended


def demand_loads() -> int:
    """How many loads that a layer waits for are queued or running now (what a prefetch must give way to)."""
    return _demand


def _demand_add(n: int) -> None:
    global _demand
    with _demand_lock:
        _demand += n
        if _demand == 0:
            _demand_lock.notify_all()


def short_of_room() -> bool:
    """Whether a layer's wave found its pool without room for one of its experts, and has not ended.

    A prefetch under way holds the room it reserved; while a layer is short
    of room it gives that up rather than pausing (`moe_prefetch`), so a
    small pool never makes a layer run in extra waves for a guess.
    """
    return _short > 0


def wait_no_demand(timeout: float) -> bool:
    """Wait up to `timeout` s until no load a layer waits for is queued or running; True if none is."""
    with _demand_lock:
        return _demand_lock.wait_for(lambda: _demand == 0, timeout)


def loader() -> ThreadPoolExecutor:
    """The process's expert loader threads, shared by every pooled layer."""
    global _loader
    with _loader_lock:
        if _loader is None:
            _loader = ThreadPoolExecutor(max_workers=LOADERS, thread_name_prefix="coe-expert-load")
        return _loader


def _drain_gpu(handles) -> None:
    """Wait for the work queued on the CUDA devices these handles' weights live on (a layer that raised skips
    its own synchronize; the pins it releases could otherwise be refilled under kernels still reading them)."""
    import torch

    devices = {h.value.buffer.device for h in handles
               if getattr(getattr(h.value, "buffer", None), "device", None) is not None
               and h.value.buffer.device.type == "cuda"}
    for device in devices:
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a failed device: its own error is the one that propagates
            pass


class PinnedWave:
    """Pin a layer's experts in order, loading the misses concurrently; release them all on exit.

    Room is reserved in order (`Pool.acquire_async`), so the wave is the
    longest prefix of `ids` that fits beside what is pinned, exactly what
    sequential acquires would give; the loads of that prefix run on the loader
    threads.  Iterating yields the handles in order, each as soon as its load
    is done, so the layer computes expert i while expert i+1 still loads.
    An expert a prefetch is reading is joined, not read again and not waited
    for while the others are reserved (`Pool.acquire_async(join=...)`).
    """

    def __init__(self, pool_of: Callable[[str], Pool], ids: Sequence[str], wait: float = WAIT_SECONDS,
                 submit: Callable | None = None) -> None:
        self._pool_of, self._ids, self._wait = pool_of, list(ids), wait
        self._submit = submit or loader().submit
        self._futures: list[Future] = []
        self.landed: list[float] = []       # perf_counter() when each load this wave submitted finished
        self.handles: list[Handle] = []
        self._taken: dict[int, Handle] = {}
        self._ready = 0
        self._short = False                 # found no room for one of its experts (counted in `short_of_room`)

    def __enter__(self) -> "PinnedWave":
        deadline = time.monotonic() + self._wait
        try:
            for eid in self._ids:
                pool = self._pool_of(eid)
                fut = pool.acquire_async(eid, self._timed_submit, join=self._timed_submit)
                if fut is None:
                    self._short_of_room()
                    if not self._futures:
                        # nothing of ours is pinned, so others hold the room (another layer or request): wait
                        fut = wait_for_room(lambda: pool.acquire_async(eid, self._timed_submit,
                                                                       join=self._timed_submit), deadline,
                                            lambda: f"expert '{eid}': its pool stayed full of pinned experts "
                                                    f"for {self._wait:.0f} s", pool)
                if fut is None:
                    break
                self._futures.append(fut)
        except BaseException:
            self.__exit__(None, None, None)     # what was reserved before the error is released, not leaked
            raise
        self._ready = sum(f.done() for f in self._futures)
        return self

    def _short_of_room(self) -> None:
        """This wave found no room: until it ends, prefetches under way give theirs up (`short_of_room`)."""
        global _short
        if not self._short:
            self._short = True
            with _demand_lock:
                _short += 1

    def _timed_submit(self, load: Callable[[], Handle]) -> Future:
        """Submit one of this wave's loads; its end is noted before its future completes (no race with a reader).

        From submission to its end it counts in `demand_loads()`, which prefetches give way to.
        """
        def run() -> Handle:
            try:
                return load()
            finally:
                self.landed.append(time.perf_counter())
                _demand_add(-1)
        _demand_add(1)
        try:
            return self._submit(run)
        except BaseException:
            _demand_add(-1)
            raise

    def __len__(self) -> int:
        return len(self._futures)

    @property
    def ready(self) -> int:
        """How many of the wave's experts were in memory when it was reserved (hits: no load to wait for)."""
        return self._ready

    def as_ready(self):
        """(index, handle) of every expert of the wave: those in memory first, then each load as it completes."""
        from concurrent.futures import as_completed

        first = [i for i, f in enumerate(self._futures) if f.done()]
        rest = {f: i for i, f in enumerate(self._futures) if not f.done()}
        for i in first:
            yield i, self._take(i)
        for f in as_completed(rest):
            yield rest[f], self._take(rest[f])

    def __iter__(self):
        """The handles in the wave's order, each as soon as its load is done."""
        for i in range(len(self._futures)):
            yield self._take(i)

    def _take(self, i: int) -> Handle:
        handle = self._futures[i].result()
        self._taken[i] = handle
        self.handles.append(handle)
        return handle

    def __exit__(self, *exc) -> None:
        global _short
        if self._short:
            self._short = False
            with _demand_lock:
                _short -= 1
        for i, fut in enumerate(self._futures):   # loads never waited for (an error cut the layer short)
            if i in self._taken:
                continue
            try:
                self.handles.append(fut.result())
            except Exception:  # a failed load left no entry behind; the first error already propagates
                pass
        if exc and exc[0] is not None:
            _drain_gpu(self.handles)    # kernels queued on these weights finish before a load may reuse them
        for h in self.handles:
            self._pool_of(h.expert_id).release(h)
        self.handles, self._futures, self._taken = [], [], {}


class PooledExperts(nn.Module):
    """One MoE layer's experts, held by pools instead of parameters."""

    def __init__(self, layer: int, ids: Sequence[str], act_fn: nn.Module, pool_of: Callable[[str], Pool], *,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.layer = layer
        self.ids = list(ids)
        self.num_experts = len(self.ids)
        self.act_fn = act_fn
        self.device = torch.device(device)
        self._pool_of = pool_of
        self.prefetcher = None      # a NextLayerPrefetcher, set by the model builder when prefetch is on
        self.split = None           # a LoadComputeSplit (the rule), with `in_place` (moe_fiddler: where misses run)
        self.in_place = None
        self.admission = False      # misses the pool declines (`Pool.admissions`) run in place and never enter it
        self.prefill = None         # a PrefillBalance (moe_prefill): prefill's GPU/CPU placement, set on a GPU box

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, pooled"

    def _declined(self, misses: list[int], hits: list[int]) -> list[int]:
        """The misses their pools would not admit, weighed in the given order (`Pool.admissions`).

        Cache admission: a miss worth less than what it would push out (the
        policy ranks it below the residents it would evict, the layer's own
        resident experts aside: they are pinned with it) is computed from its
        file for this one use, and the residents stay.  Under LRU or FIFO
        every miss is admitted.
        """
        missing = set(misses)
        resident = [self.ids[e] for e in hits if e not in missing]
        by_pool: dict[int, tuple[Pool, list[int]]] = {}
        for e in misses:
            pool = self._pool_of(self.ids[e])
            by_pool.setdefault(id(pool), (pool, []))[1].append(e)
        out = set()
        for pool, es in by_pool.values():
            answers = pool.admissions([self.ids[e] for e in es], keep=resident)
            out.update(e for e, ok in zip(es, answers) if not ok)
        return [e for e in misses if e in out]

    def _split_misses(self, hits: list[int], hidden_states, expert_mask, top_k_weights, *, split: bool = True):
        """Load the high-score misses; start the low-score ones (`split`), and those the pools decline, in place.

        Returns (to acquire, in-place parts, the source of the loads): the
        source is False when nothing is loaded, None when the loads come from
        both the host tier and files.
        """
        misses = [e for e in hits if not self._pool_of(self.ids[e]).present(self.ids[e])]
        if not misses:
            return hits, None, False
        score = {}
        for e in misses:
            pos, tok = torch.where(expert_mask[e])
            score[e] = float(top_k_weights[tok, pos].sum())
        misses.sort(key=lambda e: -score[e])
        declined = self._declined(misses, hits) if self.admission else []
        for e in declined:
            self._pool_of(self.ids[e]).bypass(self.ids[e])
        refused = set(declined)
        misses = [e for e in misses if e not in refused]
        host = self.in_place.weights.host
        source = {e: HOST if host is not None and host.present(self.ids[e]) else FILE for e in misses}
        in_place = declined + (self.split.split(misses, [source[e] for e in misses])[1]
                               if split and self.split is not None and misses else [])
        parts = self.in_place.start(self._expert, [(e, self.ids[e]) for e in in_place], hidden_states, expert_mask,
                                    top_k_weights) if in_place else None
        # the source of this layer's loads when they are all one (a mixed layer's wall time is not either's cost)
        computed = set(in_place)
        loaded = {source[e] for e in misses if e not in computed}
        load_source = (loaded.pop() if len(loaded) == 1 else None) if loaded else False
        if self.admission:      # as `Pool.admissions` weighed them: the resident experts first, then the misses
            gone = set(misses) | computed
            return [e for e in hits if e not in gone] + [e for e in misses if e not in computed], parts, load_source
        return [e for e in hits if e not in computed], parts, load_source

    def _expert(self, e: int, weights: dict, hidden_states: torch.Tensor, expert_mask: torch.Tensor,
                top_k_weights: torch.Tensor, where: tuple | None = None) -> tuple:
        """Expert e's weighted output for its tokens: transformers' eager arithmetic, op for op.

        `where` is `torch.where(expert_mask[e])` computed beforehand (on CUDA
        it synchronises, which a pipeline of launches must not do per expert).
        """
        gate_up_proj, down_proj = weights["gate_up_proj"], weights["down_proj"]
        top_k_pos, token_idx = where if where is not None else torch.where(expert_mask[e])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, gate_up_proj).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, down_proj)
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        return top_k_pos, token_idx, current_hidden_states

    @staticmethod
    def _partial(hidden_states: torch.Tensor, out: dict) -> torch.Tensor:
        """The layer's input plus the contributions computed so far: what the next router is guessed from."""
        approx = hidden_states.clone()
        for _, token_idx, contrib in out.values():
            approx.index_add_(0, token_idx, contrib.to(approx.dtype))
        return approx

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        hits = [int(i) for i in expert_hit[:, 0].tolist() if int(i) < self.num_experts]
        prefetch = self.prefetcher if self.prefetcher is not None and self.prefetcher.wants(len(hidden_states)) \
            else None
        if prefetch is None and self.prefetcher is not None:   # a prefill: a guess made for this layer is void
            self.prefetcher.forget(self.layer)
        if prefetch is not None:
            prefetch.observe(self.layer, hits)
        out: dict[int, tuple] = {}
        pending, in_place, load_source = hits, None, False
        if self.prefill is not None and len(hidden_states) > DECODE_TOKENS:     # prefill on a GPU box
            out = self.prefill.run(self, hits, hidden_states, expert_mask, top_k_weights)
            pending = []
        elif self.admission or (self.split is not None and len(hidden_states) <= DECODE_TOKENS):
            # some misses stay out of the pool: those it declines (a prefill's too), and in decode the split's
            pending, in_place, load_source = self._split_misses(hits, hidden_states, expert_mask, top_k_weights,
                                                                split=len(hidden_states) <= DECODE_TOKENS)
        loads, loads_wall, t_loads = 0, 0.0, time.perf_counter()
        while pending:
            with PinnedWave(self._pool_of, [self.ids[e] for e in pending]) as wave:
                experts = pending[:len(wave)]
                if prefetch is not None and wave.ready == 0:     # nothing in memory: guess from the input alone
                    prefetch.predict(self.layer, hidden_states)
                    prefetch = None
                # the experts already in memory first (their futures are done), then each load as it lands
                for n, (i, handle) in enumerate(wave.as_ready(), 1):
                    out[experts[i]] = self._expert(experts[i], handle.value.tensors(), hidden_states, expert_mask,
                                                   top_k_weights)
                    if prefetch is not None and n == wave.ready:
                        prefetch.predict(self.layer, self._partial(hidden_states, out))
                        prefetch = None
                if self.device.type == "cuda":
                    # the kernels just launched read the wave's buffers: they must be done before the wave
                    # releases its pins, or a later load's copy (on the tier's side stream) may refill one under them
                    torch.cuda.current_stream(self.device).synchronize()
            if wave.landed:             # this wave's own loads: how many, and when the last one finished
                loads, loads_wall = loads + len(wave.landed), max(wave.landed) - t_loads
            pending = pending[len(experts):]
        if in_place is not None:        # the CPU's parts (Fiddler: computed meanwhile on its own thread)
            out.update(in_place.results())
        if (self.split is not None and load_source is not False and loads
                and len(hidden_states) <= DECODE_TOKENS):     # what a step's loads cost, for the next split
            # the wall time until the last load finished, per load: the loads run LOADERS at a time, so one
            # load's own duration (what the pool's stats add up) overstates what n of them cost together by up to
            # LOADERS times (H200 box: C_load 9.5 ms per load against 14.5 ms in place, and still 89 misses
            # computed in place against 27 layers that loaded)
            self.split.measured(load=loads_wall / loads, source=load_source)
        # the sum runs in ascending expert order whatever order the parts were computed in: the eager loop's result
        for e in hits:
            _, token_idx, contribution = out[e]
            final_hidden_states.index_add_(0, token_idx, contribution.to(final_hidden_states.dtype))
        return final_hidden_states
