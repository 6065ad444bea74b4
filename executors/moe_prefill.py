"""The prefill split on a GPU box: each expert to the GPU or the CPU by profiled costs (issue 11 item 4).

A prefill pass gives expert e some n tokens at once.  GPU-NDP's balance rule
(also SMoE's prefill) sends it to the GPU when

    T_CPU(e, n) > T_GPU(e, n) + T_load(e) * [e not resident on the GPU]

and computes it on the CPU otherwise (a tie stays on the CPU: the load is not
worth it).  `goes_to_gpu` and `place` are that rule, pure (`prefill='balance'`);
the costs are `PrefillCosts`, linear fits K*n + B of timings (`profile_costs`
measures one expert of the model on this box at a few token counts;
`fit_linear` fits).

The rule weighs each expert alone, but the two sides are queues: the CPU's
experts run one after another on the in-place thread, the GPU's streamed
experts one after another through the staging buffers, and a streamed expert
the host tier lacks is first read from its file (READ_AHEAD reads at once).  On
the H200 box it put 84 of 144 expert passes on the CPU and prefill ran 20%
slower than loading every expert into the pool.  `place_balanced`
(`prefill='queues'`) keeps the rule's costs, adds the file read where an
expert's bytes are not in host memory, and balances the queues: experts
sorted by how much cheaper the GPU is for them, the first n to the GPU, n
making max(GPU queue, CPU queue) smallest (`moe_split.choose_split`, the
decode split's rule).  The read cost is measured as the stream reads.
Measured on the H200 box (`llm bench --part e`; docs/llm.md's GPU section has
the figures) it did not pay, so the per-expert rule stays `balance`.

`PrefillBalance` is the mechanism, run by `PooledExperts` on a pass over more
than a decode step's tokens:

- resident experts are pinned where they are (`Pool.hold`: never a load);
- the CPU's experts run on the in-place thread (`moe_fiddler`), from the
  host tier's copy or the file's memory map, started first so they overlap
  everything else;
- the GPU's other experts stream through two staging buffers, not the pool
  (a prefill touching every expert would otherwise evict decode's working
  set): expert i+1 is copied on a side stream into one device buffer while
  the GPU computes expert i from the other.  Their host bytes are the host
  tier's copy, held, or a file read into a pinned buffer on reader threads
  of the stream's own, READ_AHEAD experts ahead, so reads overlap each other
  as the pool's loads do.  Events order the reuse: a copy into a buffer waits
  for the computation that last read it; a computation waits for its copy.

The parts are added in ascending expert order by the caller, as the eager
loop adds them.  With the CPU playing the device (a CPU pool) the same code
runs with plain copies and no streams; the tests check it there bit for bit.
On a CPU box the rule itself has nothing to choose (the "GPU" is the CPU), and
the prefill split reduces to batching a prompt's tokens per expert, which
every pooled forward already does (`llm_bench.prefill_batching` measures it).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .moe_split import choose_split, ema

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

    from storage.tiers import StoreSource

    from .moe_fiddler import HostWeights, ThreadInPlace
    from .pooled_experts import PooledExperts


@dataclass(frozen=True)
class LinearCost:
    """Seconds for n tokens: per_token * n + fixed."""

    per_token: float
    fixed: float

    def __call__(self, n: int) -> float:
        return self.per_token * n + self.fixed


@dataclass(frozen=True)
class PrefillCosts:
    """T_CPU(e, n), T_GPU(e, n) and T_load(e) for one expert, and where the figures came from."""

    cpu: LinearCost
    gpu: LinearCost
    load: float
    source: str = "given"
    read: float = 0.0       # one expert's file read into host memory (when the host tier does not hold it)


def goes_to_gpu(n: int, resident: bool, costs: PrefillCosts) -> bool:
    """The balance rule: T_CPU(n) > T_GPU(n) + T_load·[not resident]; a tie stays on the CPU."""
    if n < 1:
        raise ValueError(f"an expert with {n} tokens has nothing to place")
    return costs.cpu(n) > costs.gpu(n) + (0.0 if resident else costs.load)


def place(tokens: Mapping[int, int], resident: Collection[int], costs: PrefillCosts) -> tuple[list[int], list[int]]:
    """(to the GPU, to the CPU), each in ascending expert order, for `tokens` = {expert: its token count}."""
    gpu = [e for e in sorted(tokens) if goes_to_gpu(tokens[e], e in resident, costs)]
    chosen = set(gpu)
    return gpu, [e for e in sorted(tokens) if e not in chosen]


def place_balanced(tokens: Mapping[int, int], resident: Collection[int], in_host: Collection[int],
                   costs: PrefillCosts) -> tuple[list[int], list[int]]:
    """(to the GPU, to the CPU), each ascending: the rule's costs, balanced as two queues.

    An expert's GPU cost is T_GPU(n), plus T_load when not resident, plus the
    file read when its bytes are not in host memory either (`in_host`: the
    host tier's copies), shared by the READ_AHEAD reads in flight at once;
    its CPU cost is T_CPU(n) (the CPU thread computes on the memory map).

    Up to EXACT_UP_TO experts, every placement is tried (the best one).
    Beyond, a heuristic: sorted by CPU cost over GPU cost (the GPU's biggest
    wins first), the first n go to the GPU, n making max(Σ GPU costs, Σ CPU
    costs) smallest; the same by the GPU's saving; single moves and swaps
    while they shorten the longer queue; the best of those and the
    per-expert rule's placement.  The ratio order's prefix is within the
    largest single cost of the fractional optimum (only the split expert is
    rounded), so the result is at most the best placement plus one expert.
    """
    cost = {}
    for e, n in tokens.items():
        if n < 1:
            raise ValueError(f"an expert with {n} tokens has nothing to place")
        read = 0.0 if e in in_host else costs.read
        # the stream reads a file into a pinned buffer, READ_AHEAD at once; the CPU thread computes on the file's
        # memory map, which costs what the page cache lacks (the decode split measured that whole in-place
        # computation at ~2 ms on the H200 box, against ~33 ms for a read into a buffer): no read on its side
        cost[e] = (costs.gpu(n) + (0.0 if e in resident else costs.load + read / READ_AHEAD), costs.cpu(n))

    def span(g: set[int], c: set[int]) -> float:
        return max(sum(cost[e][0] for e in g), sum(cost[e][1] for e in c))

    if len(cost) <= EXACT_UP_TO:
        return _exact(cost)
    best = None
    for key in (lambda e: (-cost[e][1] / max(cost[e][0], 1e-12), e),     # the fractional optimum's order
                lambda e: (cost[e][0] - cost[e][1], e)):                  # the GPU's largest saving first
        order = sorted(cost, key=key)
        n = choose_split([cost[e] for e in order])
        g, c = _improve(set(order[:n]), set(order[n:]), cost)
        if best is None or span(g, c) < span(*best) - 1e-12:
            best = (g, c)
    rule = place(tokens, resident, costs)            # never worse, in these costs, than the per-expert rule
    if best is None or span(set(rule[0]), set(rule[1])) < span(*best) - 1e-12:
        return rule
    return sorted(best[0]), sorted(best[1])


EXACT_UP_TO = 10    # experts a layer's placement tries exhaustively (2^10 sums, well under a millisecond)


def _exact(cost: dict[int, tuple[float, float]]) -> tuple[list[int], list[int]]:
    """The placement with the shortest longer queue, by trying all of them (ties: more on the GPU, lower ids)."""
    ids = sorted(cost)
    m = len(ids)
    g, c = [0.0] * (1 << m), [0.0] * (1 << m)     # mask bit i set: ids[i] on the GPU
    c[0] = sum(cost[e][1] for e in ids)
    best, best_mask = c[0], 0
    for mask in range(1, 1 << m):
        low = mask & -mask
        i = low.bit_length() - 1
        g[mask] = g[mask ^ low] + cost[ids[i]][0]
        c[mask] = c[mask ^ low] - cost[ids[i]][1]
        span = max(g[mask], c[mask])
        if span < best - 1e-12 or (abs(span - best) <= 1e-12 and bin(mask).count("1") > bin(best_mask).count("1")):
            best, best_mask = span, mask
    return ([e for i, e in enumerate(ids) if best_mask >> i & 1],
            [e for i, e in enumerate(ids) if not best_mask >> i & 1])


def _improve(gpu: set[int], cpu: set[int], cost: dict[int, tuple[float, float]]) -> tuple[set[int], set[int]]:
    """Move or swap single experts while that lowers max(GPU queue, CPU queue).

    Neither order is always the whole-expert optimum (three 4-vs-3 experts and
    one 14-vs-13: the ratio order puts the big one on the GPU for 14, the best
    is 13, which the savings order finds), and two experts cannot always be
    placed better one move at a time: a heuristic, not an optimum.  The sums
    are kept as running totals, so a pass over the moves and swaps is
    O(experts²) of float arithmetic, and the passes are capped.
    """
    gpu, cpu = set(gpu), set(cpu)
    g, c = sum(cost[e][0] for e in gpu), sum(cost[e][1] for e in cpu)
    for _ in range(2 * len(cost) + 1):
        best, move = max(g, c), None
        for e in gpu:
            span = max(g - cost[e][0], c + cost[e][1])
            if span < best - 1e-12:
                best, move = span, (e, None)
        for e in cpu:
            span = max(g + cost[e][0], c - cost[e][1])
            if span < best - 1e-12:
                best, move = span, (None, e)
        for a in gpu:
            for b in cpu:
                span = max(g - cost[a][0] + cost[b][0], c - cost[b][1] + cost[a][1])
                if span < best - 1e-12:
                    best, move = span, (a, b)
        if move is None:
            break
        a, b = move
        if a is not None:
            gpu.discard(a), cpu.add(a)
            g, c = g - cost[a][0], c + cost[a][1]
        if b is not None:
            cpu.discard(b), gpu.add(b)
            g, c = g + cost[b][0], c - cost[b][1]
    return gpu, cpu


def fit_linear(points: Sequence[tuple[int, float]]) -> LinearCost:
    """Least-squares K·n + B through (n, seconds) points; needs two distinct n."""
    ns = {n for n, _ in points}
    if len(ns) < 2:
        raise ValueError(f"a linear fit needs timings at two token counts or more, got {sorted(ns)}")
    m = len(points)
    mx = sum(n for n, _ in points) / m
    my = sum(t for _, t in points) / m
    k = sum((n - mx) * (t - my) for n, t in points) / sum((n - mx) ** 2 for n, _ in points)
    return LinearCost(k, my - k * mx)


@dataclass
class PrefillStats:
    resident: int = 0       # computed on the device from the pool's copy
    streamed: int = 0       # copied through a staging buffer and computed on the device
    cpu: int = 0            # computed on the CPU thread
    bytes_streamed: int = 0
    admitted: int = 0       # streamed experts read from the file whose host bytes the host tier then kept


READ_AHEAD = 4      # streamed experts whose host bytes are fetched ahead (file reads on threads of their own)


@dataclass
class _Slot:
    """One staging buffer: host bytes, device bytes, and the events that order their reuse."""

    own: object | None = None           # our pinned host FlatWeights being copied from (back to the spares after)
    held: object | None = None          # the host tier's Handle while its copy is the one being copied from
    layout: object | None = None        # the layout of the bytes now in `device`
    device: "torch.Tensor | None" = None
    copied: object | None = None        # CUDA event: the host-to-device copy into `device` is done
    computed: object | None = None      # CUDA event: the computation that last read `device` is done


class PrefillBalance:
    """Prefill's placement and the two-buffer stream (see the module docstring); one forward at a time."""

    def __init__(self, costs: PrefillCosts, weights: "HostWeights", cpu: "ThreadInPlace", source: "StoreSource",
                 device: "torch.device", *, balanced: bool = False) -> None:
        import torch

        self.costs, self.weights, self.cpu, self.source = costs, weights, cpu, source
        self.balanced = balanced        # queues balanced (`place_balanced`), else the per-expert rule (`place`)
        self.device = torch.device(device)
        self.stats = PrefillStats()
        self._slots = [_Slot(), _Slot()]
        self._ahead: list[Future] = []      # the streamed experts' host bytes, in stream order
        self._spare: list = []              # our pinned host buffers not in use, refilled by later reads
        self._lock = threading.Lock()
        # the stream's reads have threads of their own: on the pools' loader threads a device-pool load waiting
        # for host-tier room that the stream's held copies take could stall the reads the stream waits for
        self._reader = ThreadPoolExecutor(READ_AHEAD, "coe-prefill-read")
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None

    def close(self) -> None:
        """Stop the stream's reader threads (after the last forward), and let its buffers go: the pinned host
        spares and the two device staging buffers outlived a closed model for as long as it was referenced."""
        self._reader.shutdown(wait=True)
        with self._lock:
            self._spare.clear()
            self._ahead.clear()
        self._slots = [_Slot(), _Slot()]

    @property
    def staging_bytes(self) -> int:
        """Device memory the two staging buffers hold, outside the pool's budget (host: up to READ_AHEAD + 2
        pinned buffers of an expert each, reused across prompts)."""
        return sum(s.device.numel() for s in self._slots if s.device is not None)

    def run(self, layer: "PooledExperts", hits: list[int], hidden_states, expert_mask, top_k_weights) -> dict:
        """{expert: (top-k positions, token rows, contribution)} for every expert in `hits`."""
        import torch

        where = {e: torch.where(expert_mask[e]) for e in hits}       # the syncs happen here, before any launch
        tokens = {e: int(where[e][1].numel()) for e in hits}
        resident = {e for e in hits if layer._pool_of(layer.ids[e]).contains(layer.ids[e])}
        if self.balanced:
            host = self.weights.host
            in_host = {e for e in hits if host is not None and host.present(layer.ids[e])}
            gpu, cpu = place_balanced(tokens, resident, in_host, self.costs)
        else:
            gpu, cpu = place(tokens, resident, self.costs)
        parts = self.cpu.start(layer._expert, [(e, layer.ids[e]) for e in cpu], hidden_states, expert_mask,
                               top_k_weights) if cpu else None
        out: dict[int, tuple] = {}
        holds = []
        try:
            stream = []
            for e in gpu:
                eid = layer.ids[e]
                h = layer._pool_of(eid).hold(eid) if e in resident else None
                if h is None:       # not resident, or evicted since by another request: stream it
                    stream.append(e)
                    continue
                holds.append(h)
                out[e] = layer._expert(e, h.value.tensors(), hidden_states, expert_mask, top_k_weights, where[e])
                self.stats.resident += 1
            self._stream(layer, stream, hidden_states, expert_mask, top_k_weights, where, out)
            if self._cuda:
                torch.cuda.current_stream(self.device).synchronize()    # before the pins and the buffers go
        except BaseException:
            if self._cuda:   # the layer raised: its queued kernels still finish before the buffers are let go
                try:
                    torch.cuda.current_stream(self.device).synchronize()
                except Exception:  # noqa: BLE001 - a failed device: the layer's own error propagates
                    pass
            raise
        finally:
            self._drain()
            for h in holds:
                layer._pool_of(h.expert_id).release(h)
            for slot in self._slots:
                self._let_go(slot)
        if parts is not None:
            out.update(parts.results())
            self.stats.cpu += len(parts)
        return out

    def _stream(self, layer, experts: list[int], hidden_states, expert_mask, top_k_weights, where, out) -> None:
        """Expert i computed from one staging buffer while expert i+1 is copied into the other.

        The host bytes come READ_AHEAD experts ahead: a file read runs on a
        reader thread while earlier experts are copied and computed,
        so reads overlap each other as the pool's loads do (read one at a time
        on this thread, they were the stream's slow part on the H200 box).
        """
        import torch

        from storage.flat import FlatWeights

        if not experts:
            return
        ahead = self._ahead
        for i in range(min(READ_AHEAD, len(experts))):
            ahead.append(self._fetch(layer.ids[experts[i]]))
        self._fill(self._slots[0])
        for i, e in enumerate(experts):
            slot = self._slots[i % 2]
            current = torch.cuda.current_stream(self.device) if self._cuda else None
            if current is not None:
                current.wait_event(slot.copied)
            tensors = FlatWeights(slot.layout, slot.device).tensors()
            out[e] = layer._expert(e, tensors, hidden_states, expert_mask, top_k_weights, where[e])
            if current is not None:
                slot.computed = current.record_event()
            self.stats.streamed += 1
            if i + READ_AHEAD < len(experts):
                ahead.append(self._fetch(layer.ids[experts[i + READ_AHEAD]]))
            if i + 1 < len(experts):       # launched: the device computes expert i while i+1 is copied
                self._fill(self._slots[(i + 1) % 2])

    def _fetch(self, expert_id: str) -> Future:
        """Expert's host bytes, as a future of (host-tier handle or None, FlatWeights): held now, or read ahead."""
        held = self.weights.host.hold(expert_id) if self.weights.host is not None else None
        if held is not None:
            done: Future = Future()
            done.set_result((held, held.value))
            return done
        with self._lock:
            spare = self._spare.pop() if self._spare else None
        return self._reader.submit(self._read, expert_id, spare)

    def _read(self, expert_id: str, spare) -> tuple[None, object]:
        from .pooled_experts import _demand_add

        t0 = time.perf_counter()
        _demand_add(1)          # the prefill waits for this read: a prefetch's read gives way to it
        try:
            flat = self.source.load(expert_id, reuse=[spare] if spare is not None else [])
        finally:
            _demand_add(-1)
        # the read the balance adds for experts the host tier lacks: a recent mean of the reads made here
        took = time.perf_counter() - t0
        with self._lock:
            self.costs = replace(self.costs, read=ema(self.costs.read, took, 0.3))
        flat.expert_id = expert_id      # the host tier may keep these bytes once copied (`_offer`)
        return None, flat

    def _fill(self, slot: _Slot) -> None:
        """Copy the next fetched expert's host bytes into `slot`'s device buffer (on the copy stream on CUDA)."""
        import torch

        self._let_go(slot)          # the previous copy out of this slot's host bytes is done; its bytes go
        # taken from `_ahead` only now, and given to the slot at once: a failure before this leaves it to `_drain`
        held, src = self._ahead.pop(0).result()
        if held is not None:
            slot.held = held
        else:
            slot.own = src
        if slot.device is None or slot.device.numel() != src.nbytes:
            if slot.computed is not None:
                slot.computed.synchronize()
            slot.device = torch.empty(src.nbytes, dtype=torch.uint8, device=self.device)
            if self._cuda:      # fresh memory may be the current stream's just-freed memory: order after it
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        slot.layout = src.layout
        if not self._cuda:
            slot.device.copy_(src.buffer)
        else:
            with torch.cuda.stream(self._copy_stream):
                if slot.computed is not None:
                    self._copy_stream.wait_event(slot.computed)     # the computation that last read it is done
                slot.device.copy_(src.buffer, non_blocking=src.buffer.is_pinned())
                slot.copied = self._copy_stream.record_event()
        self.stats.bytes_streamed += src.nbytes

    def _let_go(self, slot: _Slot) -> None:
        """Wait for the slot's copy out of its host bytes; unpin a host-tier copy, keep our own buffer for reuse."""
        if slot.copied is not None:
            slot.copied.synchronize()
        if slot.held is not None:
            self.weights.host.release(slot.held)
            slot.held = None
        if slot.own is not None:
            if not self._offer(getattr(slot.own, "expert_id", None), slot.own):
                with self._lock:
                    self._spare.append(slot.own)
            slot.own = None

    def _offer(self, expert_id: str | None, flat) -> bool:
        """Hand a streamed expert's host bytes, read from its file, to the host tier; True if it kept them.

        Batched prefill loads every expert through the pools, so the inclusive
        host tier ends a prompt holding the experts the prompt asked for most
        recently, and the decode's misses copy from it (1.8 ms on the H200
        box) instead of reading the file (25-27 ms).  The stream read these
        bytes anyway; without this a balanced prefill left the host tier as it
        was.  On an H200 run with it, a generation read 19 files after a
        balanced prefill against 32 after a batched one, yet decode after the
        balanced prefill was still slower (0.89x; the cause is not found).  The host tier
        admits by its own policy, and a victim of the same size becomes the
        stream's spare buffer in place of the one given away, so the stream
        allocates nothing new.
        """
        from storage.tiers import take_buffer

        host = self.weights.host
        if host is None or expert_id is None:
            return False

        def produce(reuse: list):
            spare = take_buffer(reuse, flat.nbytes, flat.buffer.device, flat.buffer.is_pinned())
            if spare is not None:
                with self._lock:
                    self._spare.append(spare)
            return flat
        try:
            if host.source.size(expert_id) != flat.nbytes:
                return False
            kept = host.admit(expert_id, produce)
        except Exception:  # noqa: BLE001 - the host tier may always decline
            log.exception("prefill stream: the host tier could not take %s", expert_id)
            # whether the tier kept the bytes is not known (an error after the entry was made, a listener's
            # say): the stream gives the buffer up rather than risk two owners; it only costs a later allocation
            return True
        if kept:
            self.stats.admitted += 1
        return kept

    def _drain(self) -> None:
        """After a failure midway: wait for the reads still ahead, unpin what they hold, keep their buffers."""
        while self._ahead:
            try:
                held, flat = self._ahead.pop(0).result()
            except Exception:       # the failure being raised already says what went wrong
                continue
            if held is None:
                with self._lock:
                    self._spare.append(flat)
                continue
            try:
                self.weights.host.release(held)
            except Exception:       # keep going: the other holds must go too; the error being raised comes first
                log.exception("prefill stream: releasing the host tier's copy of %s failed", held.expert_id)


def profile_costs(weights: dict, act_fn, device: "torch.device", *, ns: Sequence[int] = (1, 8, 32, 128),
                  repeats: int = 3) -> PrefillCosts:
    """T_CPU, T_GPU (linear fits over `ns` token counts) and T_load of one expert's `weights`, timed on this box.

    T_load is one host-to-device copy of the expert's bytes from pinned memory
    (the staging path; an SSD read on top is not counted: the rule compares
    computing against moving bytes that are in host memory or the page cache).
    The file read the balance adds is the caller's (`PrefillCosts.read`).
    """
    import torch

    from torch import nn

    device = torch.device(device)
    cpu = torch.device("cpu")
    gate_up, down = weights["gate_up_proj"], weights["down_proj"]
    hidden = gate_up.shape[1]

    def run(gu, dn, x):
        gate, up = nn.functional.linear(x, gu).chunk(2, dim=-1)
        return nn.functional.linear(act_fn(gate) * up, dn)

    def timed(dev) -> list[tuple[int, float]]:
        gu, dn = gate_up.to(dev), down.to(dev)
        points = []
        for n in ns:
            x = torch.randn(n, hidden, dtype=gu.dtype, device=dev)
            run(gu, dn, x)          # warm-up
            for _ in range(repeats):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                run(gu, dn, x)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                points.append((n, time.perf_counter() - t0))
        return points

    with torch.no_grad():
        cpu_cost, dev_cost = fit_linear(timed(cpu)), fit_linear(timed(device))
        nbytes = sum(t.numel() * t.element_size() for t in (gate_up, down))
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        loads = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=src.is_pinned())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            loads.append(time.perf_counter() - t0)
    # noisy tiny timings can fit a negative slope or intercept: a cost is never below zero
    cpu_cost = LinearCost(max(cpu_cost.per_token, 0.0), max(cpu_cost.fixed, 0.0))
    dev_cost = LinearCost(max(dev_cost.per_token, 0.0), max(dev_cost.fixed, 0.0))
    load = min(loads[1:])
    where = f"profiled on this box ({device.type}, {nbytes / 2**20:.1f} MiB expert, n in {list(ns)})"
    return PrefillCosts(cpu_cost, dev_cost, load, where)

