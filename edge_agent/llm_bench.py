"""`coe-agent llm bench`, part (a): hit rate and bytes moved per policy and pool size, on two trace kinds.

Simulation on real pools: the traces are replayed through the production
`Pool` and policies (`routing.moe_replay`); only the bytes are absent.
- 'trained': the small MoE trained here on stdlib text (`coe-agent llm
  make-model --trained`), traced on held-out text.  The first half of the
  prompts is the profile the 'probability' policy ranks by; the second half
  is replayed.
- 'mixtral': synthetic traces whose per-layer marginals are Mixtral-8x7B's
  measured popularity (`../shared/data/mixtral-expert-popularity`):
  replayed on one subject, profiled on another.  No temporal locality is
  assumed (the counts carry none), which is the hardest case for any cache.
Belady is the offline oracle: a bound, not a contender.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from routing.moe_replay import FutureView, replay
from routing.moe_trace import Trace, load_popularity, synthetic

from .memory_cgroup import OVER_THE_BOUND, MemoryCgroup

SIZES = (0.125, 0.25, 0.5)
# 'P+admission': policy P, and a miss it ranks below what it would push out is read for its one use (computed
# over its file's memory map) and never enters the pool (`Pool.admissions`); one expert of the memory is set
# aside for it
def row_policy(row: str) -> tuple[str, bool]:
    """(policy, admission) of a bench row's name: 'predicted+admission' -> ('predicted', True)."""
    policy, _, extra = row.partition("+")
    if extra not in ("", "admission"):
        raise ValueError(f"row {row!r}: expected POLICY or POLICY+admission")
    return policy, bool(extra)


ADMITTING = ("lfu+admission", "gate-score+admission", "probability+admission", "predicted+admission")
POLICIES = ("lru", "fifo", "lfu", "gate-score", "predicted", "probability", *ADMITTING, "belady", "belady+admission")
REALISABLE = ("lfu", "gate-score", "predicted", "probability", "fifo", *ADMITTING)
MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2      # one Mixtral-8x7B expert in bf16: w1, w3 [14336, 4096], w2
QUOTAS = ("shared", "per-layer")


@dataclass(frozen=True)
class Row:
    trace: str
    size: float
    quota: str
    policy: str
    hit_rate: float | None
    loads: int | None       # misses: loads into the pools, plus the reads of misses they declined (admission)
    gib_moved: float | None
    experts: int            # pool capacity in experts, all pools together


def split_trace(trace: Trace) -> tuple[Trace, Trace]:
    """(profile, replay): the first and second half of the trace's prompts."""
    import numpy as np

    seqs = np.unique(trace.seq)
    if len(seqs) < 2:
        raise ValueError("a trace needs at least two prompts to split into a profile and a replay")
    cut = seqs[len(seqs) // 2]
    return trace.rows(trace.seq < cut), trace.rows(trace.seq >= cut)


def batch_prompts(trace: Trace, batch: int) -> Trace:
    """The trace's prompts decoded `batch` at a time: each decode pass holds one token of each of `batch` prompts.

    Prompts are taken in order, `batch` to a group (a last group that is short
    is left out); a group's prefills form one pass (step 0), then its prompts
    decode side by side for as many steps as the shortest of them has.  Each
    row keeps its own routing; only the grouping into passes changes, so the
    pools see what a batched decode would ask of them.  The importance paper's
    headline is at batch 3.
    """
    import numpy as np

    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    seqs = np.unique(trace.seq)
    rows: list[int] = []
    seq: list[int] = []
    step: list[int] = []
    for g in range(len(seqs) // batch):
        group = seqs[g * batch:(g + 1) * batch]
        prefill = [int(r) for s in group for r in np.flatnonzero((trace.seq == s) & (trace.step == 0))]
        rows += prefill
        seq += [g] * len(prefill)
        step += [0] * len(prefill)
        steps = min(int(trace.step[trace.seq == s].max()) for s in group)
        for k in range(1, steps + 1):
            for s in group:
                hit = np.flatnonzero((trace.seq == s) & (trace.step == k))
                if len(hit) != 1:
                    raise ValueError(f"prompt {s} has {len(hit)} rows at decode step {k}, not one")
                rows.append(int(hit[0]))
                seq.append(g)
                step.append(k)
    if not rows:
        raise ValueError(f"the trace has {len(seqs)} prompts: fewer than one batch of {batch}")
    out = trace.rows(np.asarray(rows))
    return Trace(out.model, out.layers, out.top_k, out.scoring, out.probs, out.chosen,
                 np.asarray(seq, dtype=np.int32), np.asarray(step, dtype=np.int32))


def mixtral_data_dir() -> Path:
    """Mixtral-8x7B's measured expert popularity, shipped in the package (configs/moe/; source in its README)."""
    import configs

    from coe import CoEError

    path = Path(configs.__file__).resolve().parent / "moe" / "mixtral-expert-popularity"
    if not path.is_dir():
        raise CoEError(f"{path}: the packaged Mixtral popularity data is missing; pass --mixtral-data DIR")
    return path


def mixtral_traces(data_dir: Path, tokens: int = 256, seed: int = 0) -> tuple[Trace, Trace]:
    """(profile, replay) drawn from two MMLU subjects' measured Mixtral popularity."""
    prof = synthetic(load_popularity(data_dir / "college_computer_science.json"), tokens=tokens, seed=seed + 1)
    rep = synthetic(load_popularity(data_dir / "international_law.json"), tokens=tokens, seed=seed)
    return prof, rep


def run_replays(kind: str, profile: Trace, trace: Trace, *, expert_nbytes: int = 1,
                progress: Callable[[str], None] | None = None) -> list[Row]:
    from routing.moe_predictor import TokenPredictor

    popularity = profile.popularity()
    predictor = TokenPredictor.train(profile)   # for 'predicted': learnt on the profile, never on the replay
    total = len(trace.layers) * trace.num_experts
    rows = []
    for size in SIZES:
        experts = max(1, round(total * size))
        for quota in QUOTAS:
            for policy in POLICIES:
                if progress:
                    progress(f"{kind} {size:.1%} {quota} {policy}")
                name, admission = row_policy(policy)
                if admission and quota == "per-layer":   # equal per-layer pools would each give up a share of the
                    rows.append(Row(kind, size, quota, policy, None, None, None, experts))   # expert set aside
                    continue
                try:
                    r = replay(trace, policy=name, capacity=experts * expert_nbytes, expert_nbytes=expert_nbytes,
                               quota=quota, popularity=popularity, predictor=predictor,
                               admission=admission)
                except Exception as exc:  # a per-layer share below top-k experts: reported, not fatal
                    if "cannot hold" not in str(exc):
                        raise
                    rows.append(Row(kind, size, quota, policy, None, None, None, experts))
                    continue
                rows.append(Row(kind, size, quota, policy, r.hit_rate, r.misses, r.bytes_loaded / 2**30, experts))
    return rows


def summary(rows: list[Row]) -> dict:
    """Per trace kind at 25%: LRU's misses, the best realisable policy's, their ratio (target <= 0.7)."""
    out = {}
    for kind in sorted({r.trace for r in rows}):
        at = [r for r in rows if r.trace == kind and r.size == 0.25 and r.loads is not None]
        lru = min((r for r in at if r.policy == "lru"), key=lambda r: r.loads)
        best = min((r for r in at if r.policy in REALISABLE + ("lru",)), key=lambda r: r.loads)
        oracle = min((r for r in at if r.policy.startswith("belady")), key=lambda r: r.loads)
        by_quota = {q: max((r.hit_rate for r in at if r.quota == q and r.policy in REALISABLE + ("lru",)),
                           default=None) for q in QUOTAS}
        out[kind] = {"lru_hit_rate": round(lru.hit_rate, 4), "lru_quota": lru.quota,
                     "lru_gib_moved": lru.gib_moved, "best_gib_moved": best.gib_moved,
                     "best": best.policy, "best_quota": best.quota, "best_hit_rate": round(best.hit_rate, 4),
                     "miss_ratio_vs_lru": round(best.loads / lru.loads, 3) if lru.loads else None,
                     "belady_hit_rate": round(oracle.hit_rate, 4),
                     "belady_miss_ratio_vs_lru": round(oracle.loads / lru.loads, 3) if lru.loads else None,
                     "best_shared_hit_rate": by_quota["shared"], "best_per_layer_hit_rate": by_quota["per-layer"]}
    return out


def table(rows: list[Row]) -> str:
    head = [p.replace("+admission", "+a") for p in POLICIES]      # +a: with admission
    lines = [f"{'trace':8} {'size':>6} {'quota':9} " + " ".join(f"{p:>12}" for p in head)]
    keys = sorted({(r.trace, r.size, r.quota) for r in rows}, key=lambda k: (k[0], k[1], QUOTAS.index(k[2])))
    for k in keys:
        cells = []
        for p in POLICIES:
            r = next(x for x in rows if (x.trace, x.size, x.quota, x.policy) == (*k, p))
            cells.append(f"{'n/a':>12}" if r.hit_rate is None else f"{r.hit_rate:>11.1%} ")
        lines.append(f"{k[0]:8} {k[1]:>6.1%} {k[2]:9} " + " ".join(cells))
    return "\n".join(lines)


def as_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


# -- (b) trace-driven real decode and (c) end to end ------------------------------------------------------------
# a '+admission' row lets the pools decline misses worth less than what they would push out (`Pool.admissions`)
DECODE_POLICIES = ("lru", "fifo", "lfu", "gate-score", "predicted", "probability", "predicted+admission",
                   "belady", "lru")  # LRU last too
E2E_POLICIES = ("lru", "fifo", "lfu", "gate-score")
ACCELERATE_SHARES = (1.0, 0.75, 0.5, 0.25, 0.0)
REFERENCES = ("coe-resident", "ram")   # (c)'s rows with every weight in memory, not bounded by the budget


@dataclass(frozen=True)
class DecodeRow:
    policy: str
    tokens: int
    seconds: float
    tokens_per_second: float
    hit_rate: float
    gib_read: float
    load_seconds: float
    gib_from_files: float = 0.0     # of which read from expert files (the rest: copies from a host tier)
    declined: int = 0               # misses the pools declined (admission rows): read for one use, never loaded


def disk_read_speed(files: list[Path], threads: int = 4) -> float:
    """Bytes/s of a cold read of `files` (page cache dropped first), the faster of one reader and `threads`.

    The raw speed the SSD-bound limit assumes: the disk at its best, with the
    queue depth the pools' loader threads can give it.
    """
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    from storage.pagecache import drop_from_page_cache

    def read(f: Path) -> int:
        buf, n = bytearray(16 << 20), 0
        fd = os.open(f, os.O_RDONLY)
        try:
            while k := os.readv(fd, [buf]):
                n += k
        finally:
            os.close(fd)
        return n

    best = 0.0
    for workers in (1, threads):
        for f in files:
            drop_from_page_cache(f)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as ex:
            total = sum(ex.map(read, files))
        best = max(best, total / (time.perf_counter() - t0))
    return best


def store_read_speed(store: Path, layout) -> float:
    """`disk_read_speed` of the store's first MoE layer's expert files, by its own manifest (a store imported by
    hand may name its model otherwise than the bench does)."""
    from storage.expert_store import ExpertStore

    first = ExpertStore(store, verify="never")
    return disk_read_speed([first.path(eid) for eid in layout.ids(layout.layers[0].layer)])


def drop_store(root: Path) -> None:
    from storage.pagecache import drop_from_page_cache

    for f in root.glob("*.safetensors"):
        drop_from_page_cache(f)


def decode_only(trace: Trace, tokens: int) -> Trace:
    """The prompts of `trace` up to its first `tokens` decode steps, prefills included (they seed the counts)."""
    import numpy as np

    decode = np.flatnonzero(trace.step > 0)
    last = decode[min(tokens, len(decode)) - 1] if len(decode) else -1
    return trace.rows(np.arange(last + 1))


def run_decode(store: Path, profile: Trace, trace: Trace, *, share: float = 0.25, device: str = "cpu",
               host_share: float = 0.0, host_mode: str = "inclusive",
               progress: Callable[[str], None] | None = None) -> list[DecodeRow]:
    """(b): each policy decodes `trace` through a pool of `share` of the experts, every miss read from SSD.

    Prefill passes are shown to the router tap but not computed (LFU is seeded by them, as live); the
    decode passes run real loads and matmuls.  On a CUDA `device` the pool is GPU memory behind a pinned
    host tier of `host_share` of the experts (0: none), which keeps a copy of each load (`host_mode`
    'inclusive') or holds the GPU pool's victims ('exclusive'); a miss the host tier holds is a
    host-to-device copy, any other an SSD read (page cache dropped) staged through it.
    """
    from coe.moe import MoELayout
    from executors.moe_decode import future_accesses, remap, trace_decode
    from executors.moe_model import load_pooled

    from routing.moe_predictor import TokenPredictor
    from storage.policies import POLICIES

    layout = MoELayout.load(store)
    trace, profile = remap(trace, layout.model), remap(profile, layout.model)
    flat = future_accesses(trace, prefill=False)
    predictor = TokenPredictor.train(profile)   # for 'predicted': learnt on other prompts than the decoded ones
    rows = []
    for row in DECODE_POLICIES:
        if progress:
            progress(row)
        policy, admission = row_policy(row)
        pos = [0]
        oracle = getattr(POLICIES[policy], "oracle", False)
        ctx = (lambda: {"future": FutureView(flat, pos[0])}) if oracle else None
        drop_store(store)
        pm = load_pooled(store, memory=int(layout.expert_bytes * share), policy=policy,
                         popularity=profile.popularity(), context=ctx, drop_after_read=True,
                         predictor=predictor if policy == "predicted" else None, device=device,
                         host_memory=int(layout.expert_bytes * host_share), host_mode=host_mode,
                         admission=admission)
        before = pm.file_bytes()
        r = trace_decode(pm, trace, position=pos, prefill=False)
        # a declined miss is read for its one use: bytes moved all the same (from its file, or the host tier's copy)
        declined = r.stats.bypassed_bytes
        in_files = pm.in_place.weights.reads.file_bytes if pm.in_place is not None else 0
        files = (pm.file_bytes() - before + in_files) / 2**30
        pm.close()
        rows.append(DecodeRow(row, r.tokens, r.seconds, r.tokens_per_second, r.stats.hit_rate,
                              (r.stats.bytes_in + declined) / 2**30, r.stats.load_seconds, files,
                              r.stats.bypassed))
    return rows


def failure(returncode: int, stderr: str) -> str:
    """Why a (c) child failed: stopped at its memory bound (with what it held then), killed, or its own error.

    A SIGKILL with no 'bounded at' line came before the bound applied: the
    box's OOM killer or someone else's kill, not the bench's bound.
    """
    said = "; ".join(line for line in stderr.splitlines() if line.startswith(("bounded at", "over the bound")))
    if returncode == OVER_THE_BOUND or (returncode == -9 and said):
        return f"killed at the memory bound ({said})"
    if returncode == -9:
        return "killed (SIGKILL) before its memory bound applied: the box's OOM killer or an outside kill"
    return stderr.strip()[-500:]


def run_e2e(hf: Path, store: Path, prompt_ids: list[int], tokens: int, *, share: float = 0.25,
            device: str = "cpu", host_share: float = 0.0, host_mode: str = "inclusive", headroom: int = 0,
            progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
    """(c): each system generates `tokens` greedily in its own process at the same budget; see `llm_e2e`.

    Each process runs in a memory cgroup of (its baseline after imports) +
    1.15 x (expert budget + non-expert weights) where the box allows one, so
    accelerate's page-cache reads and our pools share one bound.  Returns the
    runs and a note on how memory was bounded.

    On a CUDA `device` the budget is GPU memory: coe-edge's pool is on the GPU
    behind a pinned host tier of `host_share` of the experts; accelerate gets
    max_memory = budget + non-expert weights on the GPU and the same host
    memory, the rest offloaded to disk; 'ram' holds the whole model on the
    GPU.  Host memory is bounded there too, where the box allows a cgroup: the
    baseline (now with the CUDA context) + 1.15 x (host memory + non-expert
    weights), RSS and page cache together, so accelerate's offload files
    cannot sit in the box's RAM while coe-edge keeps to its host tier.

    `headroom` bytes are added to every bound: a tiny model's 15% is less than
    an allocator's noise (the tests' models), a real one's is not.
    """
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from coe.moe import MoELayout
    from storage.pagecache import drop_from_page_cache

    layout = MoELayout.load(store)
    memory = int(layout.expert_bytes * share)
    cuda = device.startswith("cuda")
    host_memory = int(layout.expert_bytes * host_share)

    def child(system: str, policy: str | None, extra: list[str], cgroup: "MemoryCgroup | None") -> dict:
        off = tempfile.mkdtemp(prefix="coe-offload-", dir=store.parent)   # accelerate's "disk" on the store's disk
        #                                                                   (a tmpfs /tmp would be RAM)
        cmd = [sys.executable, "-m", "edge_agent.llm_e2e", "--system", system, "--hf", str(hf), "--store",
               str(store), "--memory", str(memory), "--prompt-ids", ",".join(map(str, prompt_ids)), "--tokens",
               str(tokens), "--offload-dir", off] + (["--policy", policy] if policy else []) + extra + (
            ["--device", device, "--host-memory", str(host_memory), "--host-mode", host_mode] if cuda else [])
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                                 preexec_fn=cgroup.enter if cgroup else None)
        finally:
            shutil.rmtree(off, ignore_errors=True)
        if res.returncode != 0:
            return {"system": system, "policy": policy, "tokens_per_second": 0.0,
                    "failed": failure(res.returncode, res.stderr)}
        return json.loads(res.stdout.strip().splitlines()[-1])

    # the baseline the cgroup charges for the interpreter, torch and the model's code (shared libraries
    # already loaded by this process are charged here, not to the child), measured in an unbounded cgroup.
    # On a GPU the 'ram' run's host RSS replaces it when larger (below): the CUDA kernels a generation loads
    probe = MemoryCgroup.create(f"coe-bench-{os.getpid()}-probe", 1 << 50)
    rss_base = child("probe", None, [], probe)["rss_base"]
    base = probe.peak() if probe is not None else rss_base
    if probe is not None:
        probe.remove()
    # the host memory each system may hold: on the CPU the budget; on a GPU the host tier (the budget is on the GPU)
    host_bound = host_memory if cuda else memory
    runs = [("coe", p) for p in E2E_POLICIES] + [("coe-resident", "lru"), ("accelerate", None), ("ram", None)]
    # on a GPU the baseline is what the 'ram' run, every weight on the GPU, holds on the host while it generates
    # (the CUDA context, the kernels it loaded, the loader's leftovers): it runs first, unbounded
    order = runs[-1:] + runs[:-1] if cuda else runs
    out = []
    bounded = True

    def bound(baseline: int) -> float:
        return baseline + 1.15 * (host_bound + layout.resident_nbytes) + headroom
    limit = bound(base)
    ram_host = None
    for i, (system, policy) in enumerate(order):
        if progress:
            progress(system if policy is None else f"{system}/{policy}")
        drop_store(store)
        for f in hf.glob("*.safetensors"):
            drop_from_page_cache(f)
        reference = system in REFERENCES        # unbounded: what the box runs at with every weight in memory
        cg = None if reference else MemoryCgroup.create(f"coe-bench-{os.getpid()}-{i}", 1 << 50)
        bounded &= reference or cg is not None
        extra = ["--drop-after-read"] if system == "coe" and cg is None else []
        # accelerate gets its best shot: max_memory = budget + non-expert weights, and if its process does not
        # fit the bound that way, smaller shares (more on disk) until it runs
        shares = ACCELERATE_SHARES if system == "accelerate" else (None,)
        try:
            for share_try in shares:
                more = ["--accelerate-share", str(share_try)] if share_try is not None else []
                if cg is not None:   # loading is unbounded (transformers' loader materialises fused experts);
                    more += ["--bound-cgroup", str(cg.path), "--bound", str(int(limit))]  # generation is not
                r = child(system, policy, extra + more, cg)
                if "failed" not in r:
                    break
                drop_store(store)         # a failed try left its pages cached: the next starts as cold as the first
                for f in hf.glob("*.safetensors"):
                    drop_from_page_cache(f)
                if cg is not None:
                    cg.remove()
                    cg = MemoryCgroup.create(f"coe-bench-{os.getpid()}-{i}", 1 << 50)
            if cg is not None and "failed" not in r:
                r["cgroup_limit"], r["cgroup_failcnt"] = int(limit), cg.failcnt()
        finally:
            if cg is not None:
                cg.remove()
        out.append(r)
        if cuda and system == "ram" and "failed" not in r:
            ram_host = r["rss_peak"]
            base = max(base, ram_host)
            limit = bound(base)
    by_run = dict(zip(order, out))
    out = [by_run[run] for run in runs]
    where = (f"on {device}: GPU budget {memory / 1e6:.0f} MB of experts, pinned host tier {host_memory / 1e6:.0f} MB "
             f"(coe-edge) / {host_memory / 1e6:.0f} MB of max_memory['cpu'] (accelerate); " if cuda else "")
    if bounded:
        what = ("the larger of the 'ram' run's host RSS while generating, every weight on the GPU, and what a "
                "probe's cgroup charged" if ram_host is not None else "what a probe's cgroup charged for the "
                "interpreter, torch and the model's code")
        note = (f"{where}each process but the references ('ram', 'coe-resident') bounded, from its first generated "
                f"token, by a memory cgroup of "
                f"{limit / 1e6:.0f} MB (the {base / 1e6:.0f} MB of {what}" + (
                    f" + {headroom / 1e6:.0f} MB of headroom" if headroom else "") + " + 1.15 x "
                f"({'host tier' if cuda else 'budget'} + non-expert weights)), counting RSS and page cache together; "
                f"loading is unbounded (transformers' loader materialises fused experts)")
    else:
        note = (f"{where}no writable memory cgroup: page cache not bounded; coe-edge drops each expert file from the "
                f"page cache after reading it, accelerate's offload reads stay cached")
    return out, {"bounded": bounded, "limit": int(limit), "baseline": rss_base, "limit_baseline": base,
                 "ram_host_rss": ram_host, "note": note}


def compared_coe_runs(runs: list[dict]) -> list[dict]:
    """(c)'s coe-edge runs at the budget that finished: the ones compared with accelerate and the limits.  The
    'coe-resident' reference (a pool of every expert) is not one of them: it is not at the budget."""
    return [r for r in runs if r["system"] == "coe" and "failed" not in r]


def ssd_limits(run: dict, resident: dict | None, speed: float) -> dict:
    """How near a coe-edge (c) run came to what its misses allow, on the CPU (the SSD feeds the pool directly).

    - `ssd_bound`: the issue's SSD-bound limit, tokens/s if every byte the
      run read moved at `speed` (the disk at its measured best) and nothing
      else took time; `of_ssd_bound` is the run against it.
    - `compute_and_ssd`: tokens/s if those reads and the compute overlapped
      perfectly: no schedule of the same reads beats max(read time, compute
      time), with compute as the `resident` run (every expert in the pool,
      the same tokens) measured it.  A limit, not a promise: it assumes loads
      never slow the matmuls, which on a 2-core box they do.
    - the `decode_` figures: the same for the decode steps alone (after the
      first token), where a miss is known only when its layer routes; the
      prompt's prefill knows every layer's experts up front and reads near
      the disk's speed, which the whole-run figures fold in.
    Figures that need the resident run are None without one.
    """
    def limit(tokens: int, nbytes: int, compute_s: float | None) -> float | None:
        io_s = nbytes / speed
        if compute_s is None:
            return tokens / io_s if io_s > 0 else None
        floor = max(io_s, compute_s)
        return tokens / floor if floor > 0 else None

    res_ok = resident is not None and "failed" not in resident
    out: dict = {"ssd_bound": limit(run["tokens"], run["bytes_in"], None),
                 "compute_and_ssd": limit(run["tokens"], run["bytes_in"], resident["seconds"] if res_ok else None)
                 if res_ok else None}
    if run.get("decode_tokens", 0) > 0 and run.get("decode_seconds", 0) > 0:
        out["decode_ssd_bound"] = limit(run["decode_tokens"], run["decode_bytes_in"], None)
        out["decode_compute_and_ssd"] = (limit(run["decode_tokens"], run["decode_bytes_in"], resident["decode_seconds"])
                                         if res_ok and resident.get("decode_seconds") else None)
        out["decode_tokens_per_second"] = run["decode_tokens"] / run["decode_seconds"]
    for key in ("ssd_bound", "compute_and_ssd"):
        tps = run["tokens_per_second"]
        out[f"of_{key}"] = tps / out[key] if out[key] else None
        dk = f"decode_{key}"
        if out.get(dk):
            out[f"of_{dk}"] = out["decode_tokens_per_second"] / out[dk]
    return out


def import_peak(hf: Path) -> dict:
    """Import `hf` into a scratch store in its own process; its peak RSS against the checkpoint's size."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="coe-import-"))
    try:
        res = subprocess.run([sys.executable, "-m", "edge_agent.llm_e2e", "--system", "import", "--hf", str(hf),
                              "--store", str(out / "store"), "--memory", "0", "--prompt-ids", "0"],
                             capture_output=True, text=True, timeout=3600)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if res.returncode != 0:
        raise RuntimeError(f"import run failed: {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


LRU_AGAIN = "LRU again (after the other rows: the box's drift)"
ALPHA_WIDE = "next token + popularity, alpha 0.5"
ALPHA_WIDER = "next token + popularity, alpha 0.7"
NO_SUBSTITUTION = "next token + popularity, no substitution"
WIDE_ROWS = (ALPHA_WIDE, ALPHA_WIDER)   # wider bands than the alpha <= 0.3 the quality target is set at
ORACLE_LRU = "oracle: LRU + prefetch of exact guesses"
ORACLE_BEST = "oracle: best row + prefetch, exact guesses"
ORACLE_TOP = "oracle: best row + prefetch, exact top-score"
ORACLE_ROWS = (ORACLE_LRU, ORACLE_BEST, ORACLE_TOP)     # bounds, not candidates for "best" or the LRU baseline
BEST_AGAIN = "best row again (beside the oracle rows: the drift)"
ABLATION = (("lru", "LRU (baseline)", {}),
            ("gate-score", "eviction by windowed gate score", {}),
            ("gate-score", "+ substitution (alpha 0.3)", {"alpha": 0.3}),
            ("predicted", "eviction by next token + popularity", {"alpha": 0.3}),
            ("predicted", "+ token-wise prefetch, every top-k guess",
             {"alpha": 0.3, "prefetch": "token", "prefetch_min_prob": 0.0}),
            ("predicted", "+ token-wise prefetch, guesses with p >= 0.5",
             {"alpha": 0.3, "prefetch": "token", "prefetch_min_prob": 0.5}),
            ("predicted", "+ load/compute split", {"alpha": 0.3, "prefetch": "token", "prefetch_min_prob": 0.5,
                                                  "split": True}),
            # not on top of the split: the best row's settings with a wider band (quality: docs/llm.md)
            ("predicted", ALPHA_WIDE, {"alpha": 0.5}),
            ("predicted", ALPHA_WIDER, {"alpha": 0.7}),
            # the eviction alone: with gate-score, the best baseline without substitution, which the importance
            # paper's latency reduction is measured against
            ("predicted", NO_SUBSTITUTION, {}),
            # the best row's settings once more, right before the oracle rows: they are compared with the mean of
            # its two runs, so a box that speeds up or slows down over the run favours neither
            ("predicted", BEST_AGAIN, {"alpha": 0.3}),
            # not realisable, not on top of anything: the token-wise prefetch with the trace's own next token as
            # its guesses (`TraceGuesses`), so the table says whether the mechanism or the predictor holds it back
            ("lru", ORACLE_LRU, {"prefetch": "token", "oracle": "all"}),
            ("predicted", ORACLE_BEST, {"alpha": 0.3, "prefetch": "token", "oracle": "all"}),
            ("predicted", ORACLE_TOP, {"alpha": 0.3, "prefetch": "token", "oracle": "top"}),
            ("lru", LRU_AGAIN, {}))


def run_ablation(store: Path, profile: Trace, trace: Trace, *, share: float = 0.25, device: str = "cpu",
                 host_share: float = 0.0, host_mode: str = "inclusive", progress: Callable[[str], None] | None = None,
                 on_row: Callable[[dict], None] | None = None, rows_to_run: tuple = ()) -> list[dict]:
    """Issue 11's ablation on trace-driven decode: each row on top of the one before (the two prefetch rows
    are alternatives: every guess, or only confident ones; the split goes on top of the second), then the
    best row's settings at alpha 0.5 and 0.7 (not on top of the split), the same eviction without
    substitution (with the gate score's row, the baselines `latency_cuts` compares with), three oracle
    rows (the token-wise prefetch guessing the trace's own next token: `TraceGuesses`), LRU again and
    the ceiling.

    The importance paper's order, with one row of ours between substitution
    and prefetch: the windowed gate score gives way to `predicted` eviction
    (next-token probability + per-layer popularity), substitution kept.
    Every miss is read from SSD (page cache dropped after each read).  The
    token-wise predictor and the popularity come from `profile` (other
    prompts than `trace`).  LRU runs first and again last; rows are compared
    with the mean of the two (`lru_baseline`), so a box that speeds up or
    slows down over the run favours no row.
    The next-layer prefetch needs real hidden states, which a trace-driven run
    does not have: it is not a row.  On a CUDA `device` the pool is GPU memory
    behind a pinned host tier of `host_share` of the experts, as in `run_decode`;
    the split row is then the Fiddler split (CPU computation on the host copy).
    `on_row` gets each row as it ends, so a run cut short by a time limit still
    says what it measured.  `rows_to_run` replaces `ABLATION`'s rows (policy, name,
    settings) with others (bench/moe_prefetch_gates.py); the ceiling still ends it.
    """
    from coe.moe import MoELayout
    from executors.moe_decode import TraceGuesses, remap, trace_decode
    from executors.moe_model import load_pooled
    from routing.moe_predictor import TokenPredictor

    layout = MoELayout.load(store)
    trace, profile = remap(trace, layout.model), remap(profile, layout.model)
    predictor, popularity = TokenPredictor.train(profile), profile.popularity()
    rows = []
    for policy, name, extra in rows_to_run or ABLATION:
        if progress:
            progress(name)
        drop_store(store)
        wants = extra.get("prefetch") == "token" or policy == "predicted"
        settings = {k: v for k, v in extra.items() if k != "oracle"}
        pm = load_pooled(store, memory=int(layout.expert_bytes * share), policy=policy, drop_after_read=True,
                         predictor=predictor if wants else None,
                         popularity=popularity if policy == "predicted" else None, device=device,
                         host_memory=int(layout.expert_bytes * host_share), host_mode=host_mode, **settings)
        if "oracle" in extra:
            pm.prefetcher.guess_with(TraceGuesses(trace, top_alpha=extra.get("alpha", 0.0)
                                                  if extra["oracle"] == "top" else 0.0))
        before = pm.file_bytes()
        r = trace_decode(pm, trace, prefill=False)
        files = (pm.file_bytes() - before) / 2**30
        pm.close()
        row = {"row": name, "policy": policy, **extra, "tokens_per_second": r.tokens_per_second,
               "hit_rate": r.stats.hit_rate, "gib_read": r.stats.bytes_in / 2**30, "gib_from_files": files,
               "tokens": r.tokens, "substituted": pm.tap.substituted}
        if pm.prefetcher is not None:
            st = pm.prefetcher.stats
            row.update(prefetch_precision=st.precision, prefetch_recall=st.recall, prefetch_issued=st.issued,
                       prefetch_useful=st.useful, prefetch_yielded=st.yielded, prefetch_paused=st.paused,
                       prefetch_adopted=st.adopted, prefetch_dropped=st.dropped,
                       prefetch_stopped_ran=st.stopped_ran, prefetch_stopped_room=st.stopped_room,
                       prefetch_stopped_limit=st.stopped_limit)
        if pm.split is not None:
            # an in-place expert is read from its file (dropped from the page cache after): disk bytes too
            in_place = pm.in_place.weights.reads.file_bytes / 2**30
            row.update(in_place=pm.split.stats.in_place, loaded=pm.split.stats.loaded, gib_in_place=in_place,
                       gib_read=row["gib_read"] + in_place, gib_from_files=row["gib_from_files"] + in_place)
        rows.append(row)
        if on_row:
            on_row(row)
    rows.append(_ceiling(store, layout, trace, progress, device))
    if on_row:
        on_row(rows[-1])
    return rows


def latency_cuts(rows: list[dict]) -> list[dict]:
    """Per substituting row of (d) without prefetch or split: its decode latency cut against LRU (the mean of
    the LRU rows) and against the best row without substitution, prefetch or split (our analogue of the
    importance paper's "best baseline": gate score or next token + popularity alone), as 1 - their tokens/s
    over its own."""
    lru = lru_baseline(rows)
    plain = [r for r in rows if r.get("policy") not in ("lru", None) and not r.get("alpha")
             and not r.get("prefetch") and not r.get("split")]
    if not plain:
        raise ValueError("no row without substitution to compare with")
    best = max(plain, key=lambda r: r["tokens_per_second"])
    return [{"row": r["row"], "alpha": r["alpha"], "vs_lru": 1 - lru / r["tokens_per_second"],
             "vs_best_baseline": 1 - best["tokens_per_second"] / r["tokens_per_second"], "best_baseline": best["row"]}
            for r in rows if r.get("alpha") and not r.get("prefetch") and not r.get("split") and r["row"] != BEST_AGAIN]


def best_row(rows: list[dict]) -> dict:
    """(d)'s best row at alpha <= 0.3: not LRU or the ceiling, not a wider band (they trade quality for speed,
    and are said apart), not an oracle (a bound no system realises)."""
    return max((r for r in rows if r.get("policy") not in ("lru", None)
                and r["row"] not in WIDE_ROWS + ORACLE_ROWS + (BEST_AGAIN,)), key=lambda r: r["tokens_per_second"])


def oracle_ratios(rows: list[dict]) -> dict:
    """The oracle rows of (d) against what they prefetch on top of: LRU (the mean of its two runs) for the LRU
    oracle, the best row's settings (the mean of `predicted` + alpha 0.3 and `BEST_AGAIN`) for the others."""
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)
    by = {r["row"]: r for r in rows}
    best = [r["tokens_per_second"] for r in rows
            if r.get("policy") == "predicted" and r.get("alpha") == 0.3 and not r.get("prefetch") and not r.get("split")]
    out = {}
    if ORACLE_LRU in by:
        out[ORACLE_LRU] = by[ORACLE_LRU]["tokens_per_second"] / lru_baseline(rows)
    for name in (ORACLE_BEST, ORACLE_TOP):
        if name in by and best:
            out[name] = by[name]["tokens_per_second"] / mean(best)
    return out


def lru_baseline(rows: list) -> float:
    """LRU's tokens/s in (b) or (d): the mean of its first and last runs (rows as dicts or `DecodeRow`s)."""
    def get(r, key):
        return r[key] if isinstance(r, dict) else getattr(r, key)
    lru = [get(r, "tokens_per_second") for r in rows
           if get(r, "policy") == "lru" and not (isinstance(r, dict) and r.get("prefetch"))]
    if not lru:
        raise ValueError("no LRU row to compare with")
    return sum(lru) / len(lru)


CEILING = "ceiling: every expert resident (no policy)"


def _ceiling(store: Path, layout, trace: Trace, progress: Callable[[str], None] | None, device: str = "cpu") -> dict:
    """The same decode with every expert already in the pool: what no policy, prefetch or split can beat.

    The first pass loads each expert once; the second, timed, has no miss.
    A row faster than this one was measured on a noisier box, not won.
    """
    from executors.moe_decode import trace_decode
    from executors.moe_model import load_pooled

    if progress:
        progress(CEILING)
    pm = load_pooled(store, memory=layout.expert_bytes, policy="lru", device=device)
    try:
        trace_decode(pm, trace, prefill=False)
        r = trace_decode(pm, trace, prefill=False)
    finally:
        pm.close()
    return {"row": CEILING, "policy": None, "tokens_per_second": r.tokens_per_second, "hit_rate": r.stats.hit_rate,
            "gib_read": r.stats.bytes_in / 2**30, "gib_from_files": 0.0, "tokens": r.tokens, "substituted": 0}


def prefill_batching(store: Path, prompt_ids: list[int], *, share: float = 0.25) -> dict:
    """Item 4 on a CPU box: the prefill split reduces to batching a prompt's tokens per expert.

    One forward over the whole prompt (each expert loaded once and run on all
    its tokens) against the same prompt fed token by token through the KV cache
    (each token's experts loaded as it comes), same pool, every miss from SSD.
    """
    import time

    import torch

    from coe.moe import MoELayout
    from executors.moe_model import load_pooled

    layout = MoELayout.load(store)
    out = {}
    for mode in ("batched", "token-by-token"):
        drop_store(store)
        pm = load_pooled(store, memory=int(layout.expert_bytes * share), policy="lru", drop_after_read=True)
        ids = torch.tensor([prompt_ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            if mode == "batched":
                pm.model(input_ids=ids)
            else:
                past = None
                for i in range(ids.shape[1]):
                    past = pm.model(input_ids=ids[:, i:i + 1], past_key_values=past, use_cache=True).past_key_values
        seconds = time.perf_counter() - t0
        st = pm.stats()
        pm.close()
        out[mode] = {"seconds": seconds, "tokens_per_second": len(prompt_ids) / seconds,
                     "gib_read": st.bytes_in / 2**30}
    out["speedup"] = out["batched"]["tokens_per_second"] / out["token-by-token"]["tokens_per_second"]
    return out


# (e): issue 11 items 3 and 4 on a GPU box; each row is a (decode split, prefill) setting of the same pool
GPU_ROWS = ((False, "batched"), ("fiddler", "batched"), (False, "balance"), (False, "queues"),
            ("fiddler", "balance"))


def gpu_split_bench(store: Path, prompt_ids: list[int], decode_tokens: int, *, device: str = "cuda",
                    share: float = 0.25, host_share: float = 0.5, rows=GPU_ROWS,
                    progress: Callable[[str], None] | None = None) -> list[dict]:
    """Prefill and decode tokens/s with the Fiddler split and the prefill balance on and off, same budgets.

    The device pool holds `share` of the experts behind a host tier of
    `host_share` (pinned on CUDA), filled by the first run's loads as a
    server's would be; page cache as it is (the host tier and the page cache
    are the in-place path's sources).  `rows` names the settings; on a CPU
    device only 'batched' prefills can run (the balance needs a GPU).
    """
    import time

    import torch

    from coe.moe import MoELayout
    from executors.moe_model import load_pooled

    layout = MoELayout.load(store)
    ids = torch.tensor([prompt_ids])
    out = []
    for split, prefill in rows:
        if progress:
            progress(f"split {split or 'off'}, prefill {prefill}")
        pm = load_pooled(store, memory=int(layout.expert_bytes * share), policy="gate-score", device=device,
                         split=split, prefill=prefill, host_memory=int(layout.expert_bytes * host_share))
        try:
            with torch.no_grad():
                pm.generate(ids, 2)                                 # warm: kernels, the host tier, the costs
                sync = torch.cuda.synchronize if pm.device.type == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                pm.model(input_ids=ids.to(pm.device))
                sync()
                prefill_s = time.perf_counter() - t0
            host_misses = pm.host.stats().misses if pm.host is not None else 0
            first: dict = {}

            def mark(_tok: int) -> None:      # the first token ends the generation's prefill: decode starts here
                if not first:
                    first.update(t=time.perf_counter(), misses=pm.stats().misses,
                                 host=pm.host.stats().misses if pm.host is not None else 0)
            _, st = pm.generate(ids, decode_tokens, on_token=mark)
            sync()
            end = time.perf_counter()
            row = {"split": split or "off", "prefill": prefill, "prefill_tokens_per_second": len(prompt_ids) / prefill_s,
                   "decode_tokens_per_second": st.tokens_per_second, "hit_rate": st.hit_rate,
                   "gib_read": st.bytes_in / 2**30,
                   # the tokens after the first, alone: the generation's own prefill left out
                   "decode_only_tokens_per_second": (st.tokens - 1) / (end - first["t"]) if st.tokens > 1 else 0.0,
                   "decode_only_misses": pm.stats().misses - first["misses"]}
            if pm.host is not None:     # the file reads of the timed generation: what the host tier lacked
                row["host_misses"] = pm.host.stats().misses - host_misses
                row["decode_only_host_misses"] = pm.host.stats().misses - first["host"]
            if pm.split is not None:
                reads = pm.in_place.weights.reads
                row.update(in_place=pm.split.stats.in_place, loaded=pm.split.stats.loaded,
                           from_host=reads.from_host, from_file=reads.from_file,
                           c_load_ms=pm.split.stats.load_seconds * 1e3, c_cpu_ms=pm.split.stats.compute_seconds * 1e3,
                           costs=pm.split.summary(),
                           costs_ms={f"{k}:{src}": v * 1e3 for (k, src), v in sorted(pm.split.stats.by_source.items())})
            if pm.prefill is not None:
                pf = pm.prefill.stats
                row.update(prefill_gpu_resident=pf.resident, prefill_streamed=pf.streamed, prefill_cpu=pf.cpu,
                           prefill_admitted=pf.admitted, prefill_costs=pm.prefill.costs.source)
            out.append(row)
        finally:
            pm.close()
    return out
