"""An imported MoE model running with its experts paged through pools.

`load_pooled(STORE, memory=..., policy=...)` builds the transformers model on
the meta device (no memory), swaps every experts module for `PooledExperts`,
and materialises only the resident weights, memory-mapped from the resident
file written by `coe-agent llm import`.  Expert bytes live only in the pools,
so the process holds the budget plus the non-expert weights.

Budgets.  `quota='shared'` gives all layers one pool (ranked together by the
policy); `quota='per-layer'` gives each MoE layer an equal share.  On CUDA the
device pool loads through a pinned host staging buffer (`TierSource`), or
through a host tier of `host_memory` bytes: inclusive (`host_mode`, the
default), it keeps a copy of each load; exclusive, it is a victim cache (a GPU
victim moves down into it, a GPU miss found there is promoted out of it, one
not there is read around it), so GPU and host memory hold more distinct
experts, as the vision line's host tier does (`storage.tiers`).

Where a missing expert may be computed instead of loaded (`split`): on a CPU
pool from the file's memory map, on a CUDA pool on a CPU thread from the host
tier's copy (Fiddler), see `moe_split` (the rule) and `moe_fiddler` (the
mechanism).  Prefill's GPU/CPU placement (`prefill='balance'`) is `moe_prefill`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from coe import CoEError
from coe.moe import HOST_MODES, MoELayout, expert_id, parse_expert_id
from routing.moe_router import RouterTap
from storage.expert_store import ExpertStore, _sha256
from storage.llm_import import MODEL_SUBDIR, load_config, meta_model
from storage.moe_structure import find_experts
from storage.policies import make_policy, ranks_by_value
from storage.pool import Pool, PoolEvent, PoolStats
from storage.tiers import SpareBuffers, StoreSource, TierSource, demote

from .moe_prefill import PrefillCosts
from .moe_threads import loader_friendly_threads
from .pooled_experts import LOADERS, PooledExperts

log = logging.getLogger(__name__)

QUOTAS = ("shared", "per-layer")
SPLITS = ("mapped", "fiddler")      # in place from the memory map on the calling thread; on a CPU thread
PREFILLS = ("batched", "balance", "queues")
LLM_POLICIES = ("lru", "lfu", "gate-score", "probability", "fifo", "belady")


@dataclass
class OffloadStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    load_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    pools: list[PoolStats] = field(default_factory=list)
    bypassed: int = 0           # misses the pools declined (`admission`): computed from their files, never loaded
    bypassed_bytes: int = 0     # what those misses read

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses + self.bypassed
        return self.hits / n if n else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def since(self, before: "OffloadStats", tokens: int, seconds: float) -> "OffloadStats":
        """What happened between `before` and these counters, over `tokens` in `seconds` (the pools as now)."""
        return OffloadStats(self.hits - before.hits, self.misses - before.misses, self.bytes_in - before.bytes_in,
                            self.load_seconds - before.load_seconds, tokens, seconds, self.pools,
                            self.bypassed - before.bypassed, self.bypassed_bytes - before.bypassed_bytes)

    def line(self) -> str:
        declined = f", {self.bypassed} declined" if self.bypassed else ""
        return (f"hit rate {self.hit_rate:.1%} ({self.hits} hits, {self.misses} loads{declined}), "
                f"{self.bytes_in / 2**20:.1f} MiB read, {self.load_seconds:.2f} s loading, "
                f"{self.tokens} tokens in {self.seconds:.2f} s = {self.tokens_per_second:.2f} tokens/s")


@dataclass
class PooledModel:
    model: torch.nn.Module
    layout: MoELayout
    store: ExpertStore
    pools: list[Pool]
    tap: RouterTap
    device: torch.device
    root: Path
    owns_pools: bool = True
    prefetcher: object | None = None
    split: object | None = None         # LoadComputeSplit: the decode split's rule and measured costs
    in_place: object | None = None      # moe_fiddler.MappedInPlace / ThreadInPlace: where in-place misses run
    prefill: object | None = None       # moe_prefill.PrefillBalance
    host: Pool | None = None            # the host tier this model built (host_memory), if any
    closing: bool = False               # set by close: an exclusive host tier takes no victim then
    _pool_by_layer: dict[int, Pool] = field(default_factory=dict)

    def pool_of(self, eid: str) -> Pool:
        return self._pool_by_layer[parse_expert_id(eid)[1]]

    def stats(self) -> OffloadStats:
        out = OffloadStats()
        for p in self.pools:
            s = p.stats()
            out.hits += s.hits
            out.misses += s.misses
            out.bypassed += s.bypassed
            out.bypassed_bytes += s.bypassed_bytes
            out.bytes_in += s.bytes_in
            out.load_seconds += s.load_seconds
            out.pools.append(s)
        return out

    def file_bytes(self) -> int:
        """Bytes the pools and the host tier read from expert files so far (SSD, or the page cache).

        A GPU pool's loads that a host tier served are copies, not file
        reads: with a host tier these are fewer than the pools' `bytes_in`.
        """
        sources = {}
        for p in [*self.pools, *([self.host] if self.host is not None else [])]:
            src = p.source
            if isinstance(src, TierSource):
                src = src.parent.source if isinstance(src.parent, Pool) else src.parent
            if isinstance(src, StoreSource):
                sources[id(src)] = src
        stream = getattr(self.prefill, "source", None)      # the prefill balance streams from files of its own
        if isinstance(stream, StoreSource):
            sources[id(stream)] = stream
        return sum(s.bytes_read for s in sources.values())

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.root / MODEL_SUBDIR), local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise CoEError(f"{self.root / MODEL_SUBDIR}: no usable tokenizer ({exc}); "
                           "import a model directory that has its tokenizer files") from None

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 on_token: Callable[[int], None] | None = None,
                 on_logits: Callable[[torch.Tensor], None] | None = None,
                 min_new_tokens: int = 0) -> tuple[list[int], OffloadStats]:
        """Greedy decoding with the KV cache; `on_token` sees each new token as it is produced, `on_logits` each
        step's last-position logits (before any masking).

        Generation ends at an end-of-sequence token, except within the first
        `min_new_tokens`, where those tokens cannot be chosen: transformers'
        `min_new_tokens` does the same (its logits processor sets their
        scores to -inf), so a comparison with it produces the same tokens.

        A model that owns its pools runs with one core left to the expert
        loads (`loader_friendly_threads`).  CPU matmul kernels round by thread
        count, so its logits are bit-exact with the reference model run at
        that same thread count (tests), not at another one.
        """
        before = self.stats()
        ids = input_ids.to(self.device).reshape(1, -1)
        out: list[int] = []
        start = time.perf_counter()
        past = None
        nxt = ids
        eos = _eos_ids(self.model)
        # one core left to the expert loads (moe_threads); not in the line agent (shared pools), whose vision
        # executors' threads would take the lower count as their default
        with loader_friendly_threads(self.device.type) if self.owns_pools else nullcontext():
            for _ in range(max_new_tokens):
                res = self.model(input_ids=nxt, past_key_values=past, use_cache=True)
                past = res.past_key_values
                if on_logits is not None:
                    on_logits(res.logits[0, -1])
                last = res.logits[0, -1]
                if len(out) < min_new_tokens and eos:
                    last = last.clone()
                    last[list(eos)] = float("-inf")
                tok = int(last.argmax())
                out.append(tok)
                if on_token is not None:
                    on_token(tok)
                if tok in eos:
                    break
                nxt = torch.tensor([[tok]], device=self.device)
        after = self.stats()
        delta = after.since(before, len(out), time.perf_counter() - start)
        return out, delta

    def close(self) -> None:
        self.closing = True
        self.tap.detach()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.in_place is not None:
            self.in_place.close()
        if self.prefill is not None:
            self.prefill.cpu.close()
            self.prefill.close()
        for p in self.pools if self.owns_pools else ():
            p.close()
        if self.host is not None:
            self.host.close()


def load_pooled(root: str | Path, *, memory: int, policy: str = "lru", quota: str = "shared", device: str = "cpu",
                window: int = 8, popularity: dict[str, float] | None = None, verify: str = "first",
                context: Callable[[], dict] | None = None, drop_after_read: bool = False,
                shared_pool: Pool | None = None, alpha: float = 0.0, prefetch: str | None = None,
                predictor=None, split: bool | str = False, host_memory: int = 0, host_mode: str = "inclusive",
                prefill: str | PrefillCosts | None = None, prefetch_min_prob: float | None = None,
                admission: bool = False) -> PooledModel:
    """The imported model at `root` with `memory` bytes of expert pool; see the module docstring.

    `popularity` (expert id -> per-layer share, e.g. `Trace.popularity()`)
    ranks experts for the 'probability' policy and joins the prediction for
    'predicted'.  `context`, if given, adds to
    what the policy sees (the offline oracle's future, in a trace replay).
    `drop_after_read` drops each expert file from the page cache once read, so
    every miss is an SSD read (benchmarks of a box whose RAM is the budget).
    `shared_pool` serves every layer from a pool someone else owns (the line
    agent's executor pool, shared with vision experts; its source must load
    this model's ids): `memory`, `policy` and `quota` are then that pool's.
    `alpha` > 0 turns on importance-driven substitution (`routing.substitution`):
    approximate; 0 keeps logits exact.  `prefetch='next-layer'` loads the next
    layer's predicted experts in the background, `prefetch='token'` the next
    token's (from `predictor`, a `TokenPredictor` or its file); both exact.
    `policy='predicted'` evicts the experts least likely soon: `predictor`'s
    next-token probability (`routing.moe_predictor.NextTokenScores`) plus the
    per-layer `popularity`, when given.
    `prefetch_min_prob` is the token-wise prefetch's confidence gate (default
    `TokenPrefetcher.MIN_PROB`, the break-even 0.5; 0 loads every top-m guess).
    `split` computes a decode step's low-score misses in place instead of
    loading them (`moe_split` decides how many, `moe_fiddler` runs them):
    True picks 'fiddler' on a CUDA pool (a CPU thread computes them from the
    host tier's copy or the memory map while the loads proceed; the result
    is copied to the GPU) and 'mapped' on a CPU pool (the matmul from the
    memory map on the calling thread); either may be named, 'fiddler' on a
    CPU pool runs the same thread with the CPU playing the device.  Exact on
    the CPU; on CUDA the CPU's parts round as the CPU does.
    `host_memory` > 0 puts a host tier of that many bytes (pinned on CUDA)
    between the store and the device pools; with `host_mode='inclusive'` it
    keeps a copy of each load, with 'exclusive' it holds the device pools'
    victims instead (ranked admission: a victim enters a full tier only if the
    policy ranks it above what it would push out).
    `prefill='balance'` (CUDA) places each expert of a prefill pass on the
    GPU or the CPU by the papers' per-expert rule (`moe_prefill.place`) from
    costs profiled at load; 'queues' balances the two sides as queues
    instead (`moe_prefill.place_balanced`); a `PrefillCosts` gives the costs
    instead (any device, the per-expert rule).  'batched' (the
    default) runs every expert through the pool.
    `admission` lets the pools decline a miss (a prefill's or a decode
    step's) that the policy ranks below what it would push out
    (`Pool.admissions`): the expert is computed for that use on the CPU over
    its file's memory map, one at a time (on a CPU thread beside the layer's
    loads; with a CPU split, on the calling thread before them), and the
    residents stay.  The page cache holds that one expert while it is
    computed, so one expert of `memory` (of `host_memory` on CUDA, when
    given) is set aside for it and the pools get the rest: the same memory
    in all (measured: `bench/moe_admission.py`).  Exact on the CPU.  Under
    LRU or FIFO, which rank by recency alone and so never decline, it is off
    and nothing is set aside; it needs `quota='shared'`.  A CUDA prefill
    placed by `prefill='balance'|'queues'` follows that rule instead.  On
    CUDA it is allowed but warned about: measured on an H200 it ran at 0.74x
    and 0.67x the same policy without it (`llm bench --part b --device cuda`,
    docs/llm.md), since a declined expert is read from its file (or the host
    tier's copy) and computed on the CPU where a load would have been one
    host-to-GPU copy, and the host tier would have kept it.
    """
    if prefetch not in (None, "none", "next-layer", "token"):
        raise CoEError(f"prefetch must be 'next-layer', 'token' or none, got {prefetch!r}")
    if prefetch == "token" and predictor is None:
        raise CoEError("prefetch 'token' needs a token predictor (coe-agent llm train-predictor)")
    if policy == "predicted" and predictor is None:
        raise CoEError("eviction policy 'predicted' needs a token predictor (coe-agent llm train-predictor)")
    root = Path(root)
    layout = MoELayout.load(root)
    if alpha:
        check_substitution(layout)
    if quota not in QUOTAS:
        raise CoEError(f"quota must be one of {', '.join(QUOTAS)}, got {quota!r}")
    if shared_pool is not None:
        memory, quota = shared_pool.capacity, "shared"
    elif policy == "probability" and not popularity:
        raise CoEError("policy 'probability' ranks experts by per-layer popularity: give --trace TRACE "
                       "(recorded with coe-agent llm trace) to take it from")
    store = ExpertStore(root, verify=verify)
    missing = [eid for eid in layout.ids() if not store.has(eid)]
    if missing:
        raise CoEError(f"{root}: the store lacks {len(missing)} experts of '{layout.model}' (first: {missing[0]}); "
                       "re-run coe-agent llm import")
    # the manifest's experts are the ones llm.json describes (another model's files under the same ids would
    # pass every sha check and load as weights of the wrong shape, budgeted at the wrong size)
    other = [(eid, store.entry(eid).nbytes, l.expert_nbytes) for l in layout.layers for eid in layout.ids(l.layer)
             if store.entry(eid).nbytes != l.expert_nbytes]
    if other:
        eid, have, want = other[0]
        raise CoEError(f"{root}: expert {eid} holds {have} bytes, llm.json says {want} ({len(other)} such): the "
                       "store's files are not this model's; re-run coe-agent llm import")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise CoEError(f"device {device!r}: expected 'cpu' or 'cuda[:N]'") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise CoEError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cpu", "cuda"):
        raise CoEError(f"device {device!r}: expected 'cpu' or 'cuda[:N]'")
    split_mode = _split_mode(split, dev)
    if prefill not in (None, *PREFILLS) and not isinstance(prefill, PrefillCosts):
        raise CoEError(f"prefill must be one of {', '.join(PREFILLS)}, got {prefill!r}")
    if prefill in ("balance", "queues") and dev.type != "cuda":
        raise CoEError(f"prefill {prefill!r} places experts between a GPU and the CPU; on a CPU box the prefill split "
                       "reduces to batching a prompt's tokens per expert, which 'batched' (the default) does")
    biggest = max(l.expert_nbytes for l in layout.layers)
    if host_memory and shared_pool is not None:
        raise CoEError("host_memory builds a host tier; a shared pool brings its own")
    if host_mode not in HOST_MODES:
        raise CoEError(f"host_mode must be one of {', '.join(HOST_MODES)}, got {host_mode!r}")
    if admission and shared_pool is not None:
        raise CoEError("admission declines misses on the pools' behalf; a shared pool's owner (the line agent) "
                       "decides what enters it")
    set_aside = ""
    admission = admission and ranks_by_value(make_policy(policy))   # LRU, FIFO never decline: nothing to set aside
    if admission and quota != "shared":
        raise CoEError("admission sets one expert of the memory aside for the declined ones; equal per-layer pools "
                       "would each give up a slot for it: use --quota shared")
    if admission:       # the declined expert's pages, one at a time: out of the budget that holds host memory
        if dev.type != "cuda":
            memory -= biggest
            set_aside = f" (less one {biggest}-byte expert set aside for admission's declined experts)"
        elif host_memory:
            host_memory -= biggest
    if host_mode == "exclusive" and not host_memory:
        raise CoEError("host mode 'exclusive' makes the host tier a victim cache of the pools: give it host memory "
                       "(--host-memory)")
    if host_memory and host_memory < biggest:
        raise CoEError(f"host memory {host_memory} bytes cannot hold one expert ({biggest} bytes)")
    need = layout.top_k * biggest
    if quota == "shared":
        if memory < need:
            raise CoEError(f"memory {memory} bytes{set_aside} cannot hold one token's {layout.top_k} experts "
                           f"({need} bytes)")
        caps = {None: memory}
    else:
        share = memory // len(layout.layers)
        if share < need:
            raise CoEError(f"memory {memory} bytes split over {len(layout.layers)} layers gives {share} per layer, "
                           f"less than one token's {layout.top_k} experts ({need} bytes)")
        caps = {l.layer: share for l in layout.layers}
    if admission and dev.type == "cuda":        # allowed, for measurement; said once every check has passed
        log.warning("admission on %s: a declined expert is read from its file (or the host tier's copy) and computed "
                    "on the CPU; on an H200 that ran at 0.67-0.74x the same policy without admission (docs/llm.md)",
                    dev)

    config = load_config(root / MODEL_SUBDIR)
    model = meta_model(config)
    sites = find_experts(model)
    if [s.layer for s in sites] != [l.layer for l in layout.layers]:
        raise CoEError(f"{root}: the model's MoE layers {[s.layer for s in sites]} differ from llm.json's "
                       f"{[l.layer for l in layout.layers]}")
    tap = RouterTap(layout, window=window)
    extra = context or dict

    def ctx() -> dict:
        out = {**tap.context(), **extra()}
        if pmodel.prefetcher is not None:        # guesses awaiting their use are evicted last (moe_prefetch)
            out["expected"] = pmodel.prefetcher.expected()
        return out

    pmodel = PooledModel(model, layout, store, [], tap, dev, root, owns_pools=shared_pool is None)
    pools = {None: shared_pool} if shared_pool is not None else {}
    # an exclusive tier's kept buffers (reused by staged reads and demotions; one per loader, at most an eighth of
    # the tier) come out of its host memory, so host memory is the same whichever the mode: the tier holds less
    n_spares = min(LOADERS, host_memory // biggest // 8) if host_mode == "exclusive" else 0
    if host_memory:
        pmodel.host = Pool("cpu", host_memory - n_spares * biggest, make_policy(policy), StoreSource(
            store, pin=dev.type == "cuda", drop_after_read=drop_after_read), probabilities=popularity or {},
            context=ctx, name=f"{layout.model}:host")
    exclusive = pmodel.host is not None and host_mode == "exclusive"
    spares = SpareBuffers(n_spares) if exclusive and n_spares > 0 else None

    def on_event(e: PoolEvent) -> None:
        # runs before the evicting pool reuses the victim's buffer, so the copy down reads the victim's own bytes
        if e.event == "evict" and not e.stale and not pmodel.closing:
            demote(e, pmodel.host, ranked=True, spares=spares)

    # without a host tier, a CUDA pool stages through pinned host buffers kept for the next loads: one set of
    # LOADERS for the model (the loads that run at once), however many per-layer pools share it
    staging = SpareBuffers(LOADERS) if pmodel.host is None and dev.type == "cuda" else None
    for key, cap in caps.items() if shared_pool is None else ():
        if pmodel.host is not None:
            source = TierSource(pmodel.host, str(dev), exclusive=exclusive, spares=spares if spares is not None else 0)
        else:
            source = StoreSource(store, pin=dev.type == "cuda", drop_after_read=drop_after_read)
            if staging is not None:
                source = TierSource(source, str(dev), spares=staging)
        pools[key] = Pool(dev.type, cap, make_policy(policy), source, probabilities=popularity or {}, context=ctx,
                          on_event=on_event if exclusive else None, name=f"{layout.model}:{'all' if key is None else f'L{key:02d}'}")
    pmodel.pools = list(pools.values())
    pmodel._pool_by_layer = {l.layer: pools[None if quota == "shared" else l.layer] for l in layout.layers}

    for site in sites:
        parent_path, _, leaf = site.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, leaf)
        ids = [expert_id(layout.model, site.layer, e) for e in range(site.num_experts)]
        setattr(parent, leaf, PooledExperts(site.layer, ids, old.act_fn, pmodel.pool_of, device=dev))
    _load_resident(model, root / layout.resident_file, layout, verify)
    model.to(dev)
    model.eval()
    tap.attach(model, {s.layer: s.router for s in sites if s.router})
    if prefetch == "next-layer":
        from .moe_prefetch import NextLayerPrefetcher

        routers = {s.layer: model.get_submodule(s.router) for s in sites if s.router}
        pmodel.prefetcher = NextLayerPrefetcher(routers, {l.layer: layout.ids(l.layer) for l in layout.layers},
                                                layout.top_k, pmodel.pool_of)
        for m in model.modules():
            if isinstance(m, PooledExperts):
                m.prefetcher = pmodel.prefetcher
    if policy == "predicted":
        from routing.moe_predictor import NextTokenScores

        tap.predict_with(NextTokenScores(_predictor(predictor, layout),
                                         {l.layer: layout.ids(l.layer) for l in layout.layers}))
    if prefetch == "token":
        from .moe_prefetch import TokenPrefetcher

        pred = _predictor(predictor, layout)
        gate = {} if prefetch_min_prob is None else {"min_prob": prefetch_min_prob}
        pmodel.prefetcher = TokenPrefetcher(pred, {l.layer: layout.ids(l.layer) for l in layout.layers},
                                            pmodel.pool_of, **gate)
        tap.listen(pmodel.prefetcher.on_router)
    if split_mode is not None or prefill not in (None, "batched") or admission:
        _split_and_prefill(pmodel, split_mode, prefill, drop_after_read=drop_after_read, admission=admission)
    if alpha:
        from routing.substitution import WeightRule

        def resident_of(layer: int) -> set[int]:
            pool = pmodel._pool_by_layer[layer]
            return {e for e, eid in enumerate(layout.ids(layer)) if pool.contains(eid)}
        tap.substitute_with(alpha, WeightRule(normalise=bool(layout.extra.get("norm_topk_prob", True)),
                                              scale=float(layout.extra.get("routed_scaling_factor", 1.0))),
                            resident_of)
    return pmodel


# the families whose router substitution reproduces (scores, selection, weights: `routing.substitution`, tests);
# others run exactly (alpha 0): ERNIE-4.5 has a correction bias on softmax scores, LFM2 calls its bias
# `expert_bias`, Jamba never renormalises and has no norm_topk_prob to say so
SUBSTITUTION_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def check_substitution(layout: MoELayout) -> None:
    """Refuse substitution (alpha > 0) for a model family whose gate scores and weight rule it does not know."""
    if layout.model_type not in SUBSTITUTION_FAMILIES:
        raise CoEError(f"model '{layout.model}' ({layout.model_type}): substitution (alpha > 0) knows the routers "
                       f"of {', '.join(SUBSTITUTION_FAMILIES)} only; run this model with alpha 0 (exact)")


def _predictor(predictor, layout: MoELayout):
    """A `TokenPredictor` (given, or loaded from its file) checked against the model's layers."""
    from routing.moe_predictor import TokenPredictor

    pred = predictor if isinstance(predictor, TokenPredictor) else TokenPredictor.load(predictor)
    pred.fits(tuple(l.layer for l in layout.layers), layout.layers[0].num_experts, layout.model, layout.top_k)
    return pred


def _split_mode(split: bool | str | None, dev: torch.device) -> str | None:
    if split in (False, None, "none"):
        return None
    if split is True or split == "auto":
        return "fiddler" if dev.type == "cuda" else "mapped"
    if split not in SPLITS:
        raise CoEError(f"split must be one of {', '.join(SPLITS)} (or True: fiddler on CUDA, mapped on a CPU), "
                       f"got {split!r}")
    if split == "mapped" and dev.type == "cuda":
        raise CoEError("split 'mapped' computes on the calling thread from the memory map, which a CUDA pool's "
                       "layer cannot use; use 'fiddler'")
    return split


def _split_and_prefill(pm: PooledModel, split_mode: str | None, prefill, *, drop_after_read: bool = False,
                       admission: bool = False) -> None:
    """Wire the decode split (`moe_split` + `moe_fiddler`), admission and the prefill balance (`moe_prefill`)
    into the layers."""
    from .moe_fiddler import HostWeights, MappedInPlace, ThreadInPlace, host_tier_of
    from .moe_split import LoadComputeSplit

    layers = [m for m in pm.model.modules() if isinstance(m, PooledExperts)]
    weights = HostWeights(pm.store, pm.host if pm.host is not None else host_tier_of(pm.pools[0]),
                          drop_after_read=drop_after_read)
    if split_mode is not None or admission:
        # declined misses run where the split's in-place ones do; with admission alone, one at a time on a CPU
        # thread beside the layer's loads (its costs are measured into a split nobody consults)
        split = LoadComputeSplit()
        if split_mode is None:
            pm.in_place = ThreadInPlace(weights, split)
        else:
            pm.in_place = (ThreadInPlace if split_mode == "fiddler" else MappedInPlace)(weights, split)
        pm.split = split if split_mode is not None else None
        for m in layers:
            m.split, m.in_place, m.admission = pm.split, pm.in_place, admission
    if prefill in (None, "batched"):
        return
    from .moe_prefill import PrefillBalance, profile_costs

    if prefill in ("balance", "queues"):
        first = pm.layout.ids(pm.layout.layers[0].layer)[0]
        t0 = time.perf_counter()
        tensors = StoreSource(pm.store).load(first).tensors()
        # the first read (disk, and the store's verification) stands for the file read until the stream measures one
        costs = replace(profile_costs(tensors, layers[0].act_fn, pm.device), read=time.perf_counter() - t0)
    else:
        costs = prefill
    # its own thread and measured costs: prefill's token counts would skew the decode split's C_other
    pm.prefill = PrefillBalance(costs, weights, ThreadInPlace(weights, LoadComputeSplit()),
                                StoreSource(pm.store, pin=pm.device.type == "cuda"), pm.device,
                                balanced=prefill == "queues")
    for m in layers:
        m.prefill = pm.prefill


def _load_resident(model: torch.nn.Module, path: Path, layout: MoELayout, verify: str) -> None:
    """Assign the resident weights (memory-mapped), tie embeddings, and build non-persistent buffers."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise CoEError(f"{path}: the resident weights are missing; re-run coe-agent llm import")
    if verify != "never" and layout.resident_sha256 and _sha256(path) != layout.resident_sha256:
        raise CoEError(f"{path}: sha256 differs from llm.json: the resident weights are corrupt")
    try:
        state = load_file(str(path))
    except Exception as exc:  # SafetensorError, OSError
        raise CoEError(f"{path}: truncated or corrupt resident weights: {exc}") from None
    # a tensor the file leaves off a 64-byte boundary gets its own aligned copy: CPU kernels take
    # another path on unaligned data and round differently, so the logits would drift from the model's
    state = {k: v.clone() if v.data_ptr() % 64 else v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise CoEError(f"{path}: holds weights the model does not have: {result.unexpected_keys[:3]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for name, module in model.named_modules():
        bufs = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not bufs or not any(getattr(module, b).is_meta for b in bufs):
            continue
        for b in bufs:
            setattr(module, b, torch.empty_like(getattr(module, b), device="cpu"))
        keep = {k: v.detach().clone() for k, v in module.named_parameters(recurse=False)}
        model._init_weights(module)         # transformers' own init computes rotary inv_freq and friends
        for k, v in keep.items():
            getattr(module, k).data.copy_(v)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CoEError(f"{path}: the resident weights lack {len(left)} tensors the model needs: {left[:3]}")


def _eos_ids(model) -> set[int]:
    cfg = getattr(model, "generation_config", None) or model.config
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def record_trace(pm: PooledModel, prompts: list[torch.Tensor], max_new_tokens: int,
                 progress: Callable[[int], None] | None = None):
    """Run each prompt (its prefill, then `max_new_tokens` greedy steps) and return the routing `Trace`."""
    pm.tap.start_recording()
    try:
        for i, ids in enumerate(prompts):
            if i:
                pm.tap.next_sequence()
            if max_new_tokens:
                pm.generate(ids, max_new_tokens)
            else:
                with torch.no_grad():
                    pm.model(ids.to(pm.device).reshape(1, -1))
            if progress:
                progress(i + 1)
    except BaseException:
        pm.tap.abort_recording()
        raise
    return pm.tap.stop_recording()
