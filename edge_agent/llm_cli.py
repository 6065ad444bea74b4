"""`coe-agent llm ...`: import an MoE checkpoint, trace its routing, generate with experts paged through pools.

Needs the `[llm]` extra (transformers).  A thin layer over
`storage.llm_import`, `executors.moe_model` and `routing.moe_trace`.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import click

from coe import CoEError
from coe.moe import HOST_MODES

from .cli import _fail_clearly, dtype_option, torch_device
from .config import parse_bytes
from .llm_models import BENCH_TRAIN_STEPS


@click.group()
def llm() -> None:
    """MoE LLMs served through the expert pools (needs: pip install -e '.[llm]').

    \b
    Example:
      coe-agent llm import ./Qwen1.5-MoE-A2.7B --out var/llm/qwen-moe
      coe-agent llm generate --model var/llm/qwen-moe --prompt "def fib(n):" --memory 25% --policy lfu
    """


def _need_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise CoEError("the llm commands need transformers: pip install -e '.[llm]'") from None


def _store(path: str) -> Path:
    root = Path(path)
    if not (root / "llm.json").is_file():
        hint = (f"; it looks like a Hugging Face model: run 'coe-agent llm import {root} --out STORE' first"
                if (root / "config.json").is_file() else "")
        raise CoEError(f"{root}: not an imported MoE store (no llm.json){hint}")
    return root


def _memory(text: str | None, layout, option: str = "--memory") -> int:
    """A size (2GB) or a share of the model's expert bytes (25%); errors name `option`."""
    if text is None:
        return layout.expert_bytes
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise CoEError(f"{option} {text!r}: expected a size (2GB) or a share of the experts (25%)") from None
        if not 0 < share <= 1:
            raise CoEError(f"{option} {text!r}: a share must be in (0%, 100%]")
        return int(layout.expert_bytes * share)
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise CoEError(f"{option}: {exc}") from None


@llm.command("import")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Expert store to write.")
@click.option("--name", default=None, help="Model name prefixing every expert id (default: the directory name).")
@dtype_option("the checkpoint's dtype")
@_fail_clearly
def llm_import(model_dir: str, out: str, name: str | None, dtype: str | None) -> None:
    """Split a local Hugging Face MoE checkpoint into one store entry per (layer, expert), once.

    Reads safetensors shards one tensor slice at a time (never a pickle), so a
    checkpoint bigger than RAM imports.  Non-expert weights go to one resident file.
    With --dtype every floating-point weight, experts and resident alike, is
    cast as it streams through, and the model then computes in that dtype.

    \b
    Example:
      coe-agent llm import ./Qwen1.5-MoE-A2.7B --out var/llm/qwen-moe
      coe-agent llm import ./Qwen1.5-MoE-A2.7B --out var/llm/qwen-moe-bf16 --dtype bf16
    """
    _need_transformers()
    from tqdm import tqdm

    from storage.llm_import import import_checkpoint

    bars: dict[str, tqdm] = {}

    def progress(stage: str, n: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(desc=f"importing {stage}", unit=" tensors" if stage == "resident" else " experts",
                                     disable=None)
        bar.update(n - bar.n)

    t0 = time.perf_counter()
    try:
        layout = import_checkpoint(model_dir, out, name=name, progress=progress, dtype=dtype)
    finally:
        for bar in bars.values():
            bar.close()
    n = sum(l.num_experts for l in layout.layers)
    click.echo(f"imported '{layout.model}' ({layout.model_type}, {layout.dtype}): {n} experts in "
               f"{len(layout.layers)} MoE layers, top-{layout.top_k}, {layout.expert_bytes / 2**20:.1f} MiB of experts"
               f" + {layout.resident_nbytes / 2**20:.1f} MiB resident, in {time.perf_counter() - t0:.1f} s -> {out}")


_POLICY = click.Choice(["lru", "lfu", "gate-score", "predicted", "probability", "fifo"])


def _check_policy_inputs(policy: str, predictor_path: str | None, trace_path: str | None) -> None:
    """A --predictor or --trace the chosen policy would ignore is a mistake to point out, not to drop."""
    if predictor_path and policy != "predicted":
        raise click.UsageError(f"--predictor is for --policy predicted (got --policy {policy})")
    if trace_path and policy not in ("probability", "predicted"):
        raise click.UsageError(f"--trace is for --policy probability or predicted (got --policy {policy})")


def _popularity(trace_path: str | None, layout) -> dict[str, float] | None:
    """Per-layer popularity from a trace of this store's model; a trace of another model is refused by name."""
    from routing.moe_trace import Trace

    if not trace_path:
        return None
    return Trace.load(trace_path).popularity_for(layout.model, f"--trace {trace_path}", layout)


@llm.command("generate")
@click.option("--model", "-m", "model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Store written by 'coe-agent llm import'.")
@click.option("--prompt", "-p", required=True, help="Prompt text.")
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(1, 100_000),
              help="Tokens to generate after the prompt.")
@click.option("--memory", default=None, help="Expert pool budget: a size (2GB, 512MiB) or a share of all "
              "experts (25%).  Default: every expert fits.")
@click.option("--policy", default="gate-score", show_default=True, type=_POLICY,
              help="Eviction policy (gate-score: the router's windowed score; predicted: a token predictor's "
                   "next-token probability, needs --predictor, plus per-layer popularity from --trace; lru is the "
                   "mixtral-offloading baseline).")
@click.option("--quota", default="shared", show_default=True, type=click.Choice(["shared", "per-layer"]),
              help="One pool for all layers, or an equal share per layer.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N] (a CUDA pool behind pinned host).")
@click.option("--trace", "trace_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A trace (coe-agent llm trace) whose per-layer popularity ranks experts for --policy probability "
                   "(and joins the next-token probability for --policy predicted).")
@click.option("--window", default=8, show_default=True, type=click.IntRange(1, 10_000),
              help="Decode steps the gate-score policy averages over.")
@click.option("--predictor", "predictor_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A token predictor (coe-agent llm train-predictor) for --policy predicted.")
@click.option("--alpha", default=0.0, show_default=True, type=click.FloatRange(0, 1, max_open=True),
              help="Importance-driven substitution threshold; 0 is exact, > 0 is approximate.")
@click.option("--prefetch", default="none", show_default=True, type=click.Choice(["none", "next-layer"]),
              help="Load the next layer's predicted experts in the background.")
@click.option("--split/--no-split", default=False, show_default=True,
              help="Decode: compute low-score missing experts where their weights are instead of loading them "
                   "(how many from measured costs).  CPU: from the file's memory map.  CUDA (Fiddler): on a CPU "
                   "thread from the host tier's copy or the memory map while the loads proceed.")
@click.option("--admission/--no-admission", default=False, show_default=True,
              help="A missing expert the policy ranks below what it would push out is computed for that use "
                   "on the CPU over its file's memory map, and the residents stay; one expert of --memory (on CUDA: "
                   "of --host-memory) is set aside for it.  Exact on the CPU.  For a policy that ranks by value "
                   "(predicted, probability, lfu, gate-score) and --quota shared, above all where prompts' "
                   "prefills would otherwise sweep the pool; off under lru or fifo, which never decline.  On "
                   "CUDA it ran at 0.67-0.74x without it (an H200): there a miss is a cheap host-to-GPU copy.")
@click.option("--host-memory", default=None,
              help="A host tier in front of the pool (a size or a share of the experts), pinned on CUDA; --split "
                   "computes on its copies.  Default: none (a staging buffer).")
@click.option("--host-mode", default="inclusive", show_default=True, type=click.Choice(HOST_MODES),
              help="--host-memory's tier keeps a copy of each load (inclusive) or holds the pool's victims "
                   "(exclusive, a victim cache: the pool and the tier hold more distinct experts).")
@click.option("--prefill", default="batched", show_default=True, type=click.Choice(["batched", "balance", "queues"]),
              help="batched: every expert of the prompt runs through the pool on all its tokens at once.  "
                   "balance (CUDA only): each expert goes to the GPU when T_CPU(n) > T_GPU(n) + T_load "
                   "(costs profiled at load), else the CPU computes it; loads stream through two staging buffers.  "
                   "queues (CUDA only): the same costs, the GPU's and the CPU thread's queues balanced.")
@_fail_clearly
def llm_generate(model: str, prompt: str, max_new_tokens: int, memory: str | None, policy: str, quota: str,
                 device: str, trace_path: str | None, window: int, predictor_path: str | None, alpha: float,
                 prefetch: str, split: bool, admission: bool, host_memory: str | None, host_mode: str,
                 prefill: str) -> None:
    """Generate text greedily, streaming tokens, with experts paged SSD -> memory under a budget.

    Ends with the offload stats: hit rate, bytes read, load seconds, tokens/s.

    \b
    Example:
      coe-agent llm generate --model var/llm/qwen-moe --prompt "def fib(n):" --memory 2GB --policy lfu
      coe-agent llm generate -m var/llm/qwen-moe -p "def fib(n):" --memory 25% --policy predicted \\
          --predictor var/llm/qwen.predictor --trace var/llm/qwen.trace --admission
      coe-agent llm generate -m var/llm/qwen-moe -p "def fib(n):" --memory 25% --device cuda \\
          --host-memory 50% --host-mode exclusive --split --prefill balance
    """
    _need_transformers()
    import torch

    from coe.moe import MoELayout
    from executors.moe_model import load_pooled

    _check_policy_inputs(policy, predictor_path, trace_path)
    root = _store(model)
    layout = MoELayout.load(root)
    popularity = _popularity(trace_path, layout)
    pm = load_pooled(root, memory=_memory(memory, layout), policy=policy, quota=quota, device=device,
                     popularity=popularity, window=window, alpha=alpha, prefetch=prefetch, split=split,
                     host_memory=_memory(host_memory, layout, "--host-memory") if host_memory else 0, host_mode=host_mode,
                     prefill=prefill, admission=admission,
                     predictor=predictor_path)
    tok = pm.tokenizer()
    ids = torch.tensor([tok.encode(prompt)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise CoEError("--prompt encodes to no tokens")
    context = getattr(pm.model.config, "max_position_embeddings", None)
    if isinstance(context, int) and ids.shape[1] + max_new_tokens - 1 > context:   # the last token is not fed back
        pm.close()
        raise CoEError(f"--prompt ({ids.shape[1]} tokens) and --max-new-tokens {max_new_tokens} pass the model's "
                       f"context of {context} tokens (max_position_embeddings)")
    out: list[int] = []
    shown = [0]

    def stream(t: int) -> None:
        out.append(t)
        text = tok.decode(out, skip_special_tokens=True)
        click.echo(text[shown[0]:], nl=False)
        shown[0] = len(text)
        sys.stdout.flush()

    click.echo(prompt, nl=False)
    _, stats = pm.generate(ids, max_new_tokens, on_token=stream)
    click.echo("")
    budget = sum(p.capacity for p in pm.pools)
    click.echo(f"[{policy}, {quota}, pool {budget / 2**20:.1f} MiB of {layout.expert_bytes / 2**20:.1f} MiB experts] "
               + stats.line(), err=True)
    if pm.host is not None:
        tiers = [p.source for p in pm.pools if getattr(p.source, "exclusive", False)]   # the pools' TierSources
        how = ("every pool load was a copy from it" if host_mode == "inclusive" else
               f"{sum(t.promoted for t in tiers)} pool loads were copies from it, {sum(t.staged for t in tiers)} "
               f"read from their files around it; {pm.host.stats().admits} experts moved down into it")
        click.echo(f"host tier ({host_mode}, {pm.host.capacity / 2**20:.1f} MiB): {how}; "
                   f"{pm.file_bytes() / 2**20:.1f} MiB read from expert files", err=True)
    if pm.prefetcher is not None:
        st = pm.prefetcher.stats
        click.echo(f"prefetch: precision {st.precision:.2f}, recall {st.recall:.2f}, {st.issued} read in "
                   f"({st.useful} used; {st.adopted} of them still being read when their layer asked, and joined), "
                   f"{st.paused} pauses for the layers' own reads, {st.yielded} stopped (their layer did not ask), "
                   f"{st.dropped} dropped (no room, too late or failed)", err=True)
    if pm.split is not None:
        sp, reads = pm.split.stats, pm.in_place.weights.reads
        where = "on a CPU thread (Fiddler)" if pm.in_place.threaded else "from the memory map"
        click.echo(f"load/compute split: {sp.in_place} misses computed in place {where} ({reads.from_host} from the "
                   f"host tier, {reads.from_file} from the file), {sp.loaded} loaded", err=True)
    if admission:           # off under lru and fifo, which never decline (nothing was set aside)
        click.echo(f"admission: {stats.bypassed} misses declined and computed over their files' memory maps "
                   f"({stats.bypassed_bytes / 2**20:.1f} MiB), never entering the pool", err=True)
    if pm.prefill is not None:
        pf = pm.prefill.stats
        click.echo(f"prefill balance ({pm.prefill.costs.source}): {pf.resident} experts on the GPU from the pool, "
                   f"{pf.streamed} streamed ({pf.bytes_streamed / 2**20:.1f} MiB), {pf.cpu} on the CPU", err=True)
    if alpha > 0:
        click.echo(f"substitution (alpha {alpha}): {pm.tap.substituted} experts replaced by resident ones, "
                   f"{pm.tap.missing_low} missing low-score experts seen (approximate generation)", err=True)
    pm.close()


@llm.command("trace")
@click.option("--model", "-m", "model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Store written by 'coe-agent llm import'.")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False),
              help="UTF-8 text file, one prompt per line (blank lines and lines starting with # are skipped).")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Trace file to write.")
@click.option("--max-new-tokens", "-n", default=32, show_default=True, type=click.IntRange(0, 100_000),
              help="Decode steps per prompt after its prefill.")
@click.option("--memory", default=None, help="Expert pool budget while tracing (default: every expert fits).")
@_fail_clearly
def llm_trace(model: str, prompts: str, out: str, max_new_tokens: int, memory: str | None) -> None:
    """Record, per token and per MoE layer, the full router probabilities and the chosen experts.

    \b
    Example:
      coe-agent llm trace --model var/llm/qwen-moe --prompts prompts.txt --out var/llm/qwen.trace
    """
    _need_transformers()
    import torch
    from tqdm import tqdm

    from coe.moe import MoELayout
    from executors.moe_model import load_pooled, record_trace

    root = _store(model)
    layout = MoELayout.load(root)
    texts = read_prompts(prompts)
    pm = load_pooled(root, memory=_memory(memory, layout), policy="lru")
    tok = pm.tokenizer()
    ids = []
    for i, text in enumerate(texts):
        ids.append(torch.tensor(tok.encode(text), dtype=torch.long))
        if ids[-1].numel() == 0:
            raise CoEError(f"{prompts}: prompt {i + 1} encodes to no tokens")
    with tqdm(total=len(ids), desc="tracing", unit=" prompts", disable=None) as bar:
        trace = record_trace(pm, ids, max_new_tokens, progress=lambda n: bar.update(n - bar.n))
    trace.save(out)
    pm.close()
    click.echo(f"traced {len(texts)} prompts: {trace.tokens} tokens x {len(trace.layers)} MoE layers x "
               f"{trace.num_experts} experts (top-{trace.top_k}) -> {out}")


def read_prompts(path: str) -> list[str]:
    """One prompt per line of a UTF-8 file; blank lines and '#' comments skipped; a clear error otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CoEError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise CoEError(f"{path}: cannot read: {exc.strerror or exc}") from None
    prompts = [ln.rstrip("\n") for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise CoEError(f"{path}: no prompts (one per line; blank lines and '#' comments are skipped)")
    return prompts


@llm.command("make-model")
@click.option("--trained", "kind", flag_value="trained", help="Train a small MoE on this machine's stdlib sources.")
@click.option("--generated", "kind", flag_value="generated", help="Generate a big Mixtral-style MoE (random weights).")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Hugging Face model dir to write.")
@click.option("--steps", default=None, type=click.IntRange(1, 10_000_000),
              help="--trained: optimizer steps (reproducible: the same seed, steps, Python, torch, threads and CPU "
                   f"instruction set give the same weights) [default: {BENCH_TRAIN_STEPS}, llm bench's, about 9 min "
                   "on 2 cores]")
@click.option("--seconds", default=None, type=click.FloatRange(1, 36_000),
              help="--trained: train for this long instead of a step count (how many steps fit depends on the "
                   "box and its load).")
@click.option("--expert-gb", default=2.0, show_default=True, type=click.FloatRange(0.001, 1000),
              help="--generated: size of all experts on disk.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the weights (--generated); with --trained, of the first weights, the stdlib files' "
                   "train/held-out split and the batches.")
@_fail_clearly
def llm_make_model(kind: str | None, out: str, steps: int | None, seconds: float | None, expert_gb: float,
                   seed: int) -> None:
    """Make an MoE checkpoint here (nothing can be downloaded), in the Hugging Face format.

    \b
    Example:
      coe-agent llm make-model --trained --out var/llm/trained-hf          # ~9 min on 2 cores (3500 steps)
      coe-agent llm make-model --generated --expert-gb 2 --out var/llm/big-hf
      coe-agent llm import var/llm/trained-hf --out var/llm/trained
    """
    _need_transformers()
    from .llm_models import generated_model

    if kind is None:
        raise CoEError("say which: --trained or --generated")
    if kind == "generated" and (steps is not None or seconds is not None):
        raise CoEError("--steps and --seconds train a model: they go with --trained")
    if steps is not None and seconds is not None:
        raise CoEError("give --steps or --seconds, not both")
    if kind == "generated":
        info = generated_model(out, expert_gb=expert_gb, seed=seed)
        click.echo(f"generated {info['layers']} layers x {info['experts_per_layer']} experts, "
                   f"{info['expert_bytes'] / 1e9:.2f} GB of experts -> {out}")
        return
    if seconds is None and steps is None:
        steps = BENCH_TRAIN_STEPS
    info = _train(out, steps=steps, seconds=seconds, seed=seed)
    click.echo(f"trained {info['steps']} steps ({info['tokens']} tokens) in {info['seconds']:.0f} s: "
               f"loss {info['loss']:.3f} ({info['bits_per_byte']:.2f} bits/byte) -> {out}")


def _train(out: str | Path, *, steps: int | None, seconds: float | None, seed: int = 0) -> dict:
    """`train_model` with a progress bar, over steps or seconds (whichever bounds it)."""
    from tqdm import tqdm

    from .llm_models import train_model

    total, unit = (steps, " steps") if steps is not None else (int(seconds), " s")
    with tqdm(total=total, desc="training", unit=unit, disable=None) as bar:
        def progress(step: int, loss: float, elapsed: float) -> None:
            bar.set_postfix(step=step, loss=f"{loss:.3f}")
            bar.update(min(step if steps is not None else int(elapsed), total) - bar.n)
        return train_model(out, steps=steps, seconds=seconds, seed=seed, progress=progress)


def _summarise_e2e(doc: dict, runs: list[dict], mem: dict, coe_runs: list[dict], layout, speed: float, cuda: bool,
                   host_share: float) -> None:
    """(c)'s verdict lines and JSON: the best coe-edge run against accelerate, the SSD-bound limit and RSS."""
    from . import llm_bench as lb

    best = max(coe_runs, key=lambda r: r["tokens_per_second"])
    ram = next(r for r in runs if r["system"] == "ram")
    acc = next(r for r in runs if r["system"] == "accelerate")
    resident = next((r for r in runs if r["system"] == "coe-resident"), None)
    lim = lb.ssd_limits(best, resident, speed)
    vs_acc = best["tokens_per_second"] / acc["tokens_per_second"] if acc["tokens_per_second"] else None
    versus = (f"{vs_acc:.2f}x accelerate disk offload (target 3x)" if vs_acc is not None else
              "accelerate's disk offload could not run within the same memory at any max_memory share")
    if vs_acc is not None and len(coe_runs) > 1:    # the best of several policies against one accelerate run:
        versus += " (every policy: " + ", ".join(   # each one's own ratio beside it
            f"{r['policy']} {r['tokens_per_second'] / acc['tokens_per_second']:.2f}x" for r in coe_runs) + ")"
    if cuda:
        limit = "bytes into the GPU pool come from the host tier or the SSD, so no SSD-bound limit is given; "
    elif lim["ssd_bound"] is None:
        limit = "it read no expert, so no SSD-bound limit applies; "
    else:
        limit = (f"SSD-bound limit {lim['ssd_bound']:.2f} tokens/s (every missed byte at {speed / 1e9:.2f} GB/s, "
                 f"prefill included): {lim['of_ssd_bound']:.2f} of it (target 0.8); ")
    click.echo(f"best coe-edge ({best['policy']}): {versus}; {limit}every weight in {'GPU' if cuda else 'RAM'} (transformers' eager experts, not a proven bound) "
               f"{ram.get('tokens_per_second', 0):.2f} tokens/s")
    if not cuda and lim["ssd_bound"] is not None:
        _echo_limits(lim, resident)
    # the host memory a system may hold: the budget on the CPU; on a GPU the host tier (the budget is GPU memory)
    budget_rss = (host_share if cuda else 0.25) * layout.expert_bytes + layout.resident_nbytes
    above = "met" if best["rss_peak_above_base"] <= 1.15 * budget_rss else "not met"
    absolute = "met" if best["rss_peak"] <= 1.15 * budget_rss else "not met"
    what = "host tier + non-expert weights" if cuda else "budget + non-expert weights"
    click.echo(f"peak RSS while generating: {best['rss_peak'] / 1e6:.0f} MB in all, {best['rss_peak_above_base'] / 1e6:.0f}"
               f" MB above the baseline ({mem['baseline'] / 1e6:.0f} MB: interpreter, torch"
               f"{', the CUDA context' if cuda else ''} and the model's code, no weights), vs {what} "
               f"{budget_rss / 1e6:.0f} MB (+15%: {1.15 * budget_rss / 1e6:.0f} MB): {above} above the baseline, "
               f"{absolute} in absolute terms")
    if mem.get("ram_host_rss"):    # what any generation on the GPU holds on the host: the 'ram' run's memory
        over_ram = best["rss_peak"] - mem["ram_host_rss"]
        click.echo(f"    above the 'ram' run's host memory ({mem['ram_host_rss'] / 1e6:.0f} MB, every weight on the "
                   f"GPU: the CUDA context and its kernels): {over_ram / 1e6:.0f} MB, "
                   f"{'met' if over_ram <= 1.15 * budget_rss else 'not met'}")
    doc["c"] = {"runs": runs, "memory": mem, "best": best["policy"], "vs_accelerate": vs_acc,
                "vs_accelerate_each": ({r["policy"]: r["tokens_per_second"] / acc["tokens_per_second"]
                                        for r in coe_runs} if vs_acc is not None else None),
                "ssd_bound_tokens_per_s": None if cuda else lim["ssd_bound"],
                "of_ssd_bound": None if cuda else lim["of_ssd_bound"],
                "limits": None if cuda else lim,
                "budget_plus_resident_bytes": budget_rss}


def _echo_limits(lim: dict, resident: dict | None) -> None:
    """(c)'s SSD-bound figures beside the target's: decode alone, and with compute counted (`llm_bench.ssd_limits`)."""
    def of(key: str) -> str:
        return f"{lim[key]:.2f} tokens/s, reached {lim['of_' + key]:.2f}" if lim.get(key) else "-"
    if resident is None or "failed" in resident:
        why = resident["failed"] if resident else "not run"
        click.echo(f"    no coe-resident run ({why}): no compute-and-SSD limit")
    else:
        click.echo(f"    coe-resident (a pool of every expert, warmed): {resident['tokens_per_second']:.2f} tokens/s, "
                   f"coe-edge's compute alone on these tokens")
        click.echo(f"    compute-and-SSD limit (the reads and that compute overlapped perfectly; no schedule of the "
                   f"same reads beats it): {of('compute_and_ssd')}")
    if "decode_ssd_bound" in lim:
        click.echo(f"    decode steps alone ({lim['decode_tokens_per_second']:.2f} tokens/s, after the prompt's "
                   f"prefill and first token): SSD-bound {of('decode_ssd_bound')}; compute-and-SSD "
                   f"{of('decode_compute_and_ssd')}")


@llm.command("bench")
@click.option("--work", default="var/llm", show_default=True, type=click.Path(file_okay=False),
              help="Where the models, stores and traces are made (reused when present).")
@click.option("--part", "parts", default="a,b,c,d", show_default=True,
              help="Which parts: a (trace replay), b (trace-driven real decode), c (end to end), d (ablation: "
                   "each technique on top of the one before), e (GPU only: the Fiddler split and the prefill "
                   "balance; not in the default).")
@click.option("--prompts", default=40, show_default=True, type=click.IntRange(4, 10_000),
              help="Held-out prompts to trace on the trained model (half profile, half replay).")
@click.option("--decode", default=32, show_default=True, type=click.IntRange(1, 10_000),
              help="Decode steps per traced prompt.")
@click.option("--train-steps", default=None, type=click.IntRange(1, 10_000_000),
              help="(a), (b), (d): optimizer steps to train the small MoE, when --work holds no trained-hf yet "
                   f"(reproducible with the same Python, torch, threads and CPU instruction set; training.json "
                   f"records them) [default: {BENCH_TRAIN_STEPS}, about 9 min on 2 cores]")
@click.option("--train-seconds", default=None, type=click.FloatRange(1, 36_000),
              help="(a), (b), (d): train for this long instead (the step count then depends on the box).")
@click.option("--mixtral-data", default=None, type=click.Path(exists=True, file_okay=False),
              help="Mixtral popularity dir (default: the copy in configs/moe/mixtral-expert-popularity).")
@click.option("--tokens", default=256, show_default=True, type=click.IntRange(8, 1_000_000),
              help="Tokens per synthetic Mixtral trace.")
@click.option("--expert-gb", default=2.2, show_default=True, type=click.FloatRange(0.001, 1000),
              help="(b), (c): size of the generated model's experts on disk.")
@click.option("--decode-tokens", default=200, show_default=True, type=click.IntRange(1, 100_000),
              help="(b): decode steps replayed per policy.")
@click.option("--e2e-tokens", default=24, show_default=True, type=click.IntRange(1, 100_000),
              help="(c): tokens each system generates.")
@click.option("--device", default="cpu", show_default=True, callback=torch_device,
              help="(b), (c), (d): cpu, or cuda[:N] for a GPU pool at the budget behind a pinned host tier.")
@click.option("--host-share", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="With --device cuda: the pinned host tier, as a share of the experts.")
@click.option("--host-mode", default="inclusive", show_default=True, type=click.Choice(HOST_MODES),
              help="With --device cuda: the host tier keeps a copy of each load (inclusive) or holds the GPU "
                   "pool's victims (exclusive: GPU and host memory hold more distinct experts).")
@_fail_clearly
def llm_bench(work: str, parts: str, prompts: int, decode: int, train_steps: int | None, train_seconds: float | None,
              mixtral_data: str | None,
              tokens: int, expert_gb: float, decode_tokens: int, e2e_tokens: int, device: str,
              host_share: float, host_mode: str) -> None:
    """Benchmark the MoE offload: (a) hit rates, (b) real decode per policy, (c) end to end.

    \b
    (a) Trace replay on real pools (simulation: no bytes) at 12.5/25/50% of the
        experts, on traces of a small MoE trained here and on synthetic traces
        with Mixtral's measured per-layer popularity.
    (b) Real decode: a generated model with >= 2 GB of experts, routing from
        the trained model's trace, page cache dropped, every miss read from
        SSD, real expert matmuls on this CPU; tokens/s per policy at 25%.
    (c) End to end: greedy generation at the same 25% budget for coe-edge
        (each policy), accelerate's disk offload and everything in RAM, each
        in its own process, plus coe-edge with a warmed pool of every expert
        (its compute alone; a reference, never the best); the SSD-bound limit
        at the measured disk speed, a compute-and-SSD limit (no schedule of
        the same reads beats it), and both for the decode steps alone.
    (d) Ablation as (b): gate-score eviction, then substitution, then
        predicted eviction (next token + popularity) in its place, then
        token-wise prefetch, then the load/compute split, each on top of the
        one before; then predicted eviction at alpha 0.5 (an alternative, not
        on top of the split); LRU runs first and last, and a ceiling row
        (every expert resident) ends it.
    (e) GPU box only: prefill and decode tokens/s on the generated model
        with the Fiddler split and the prefill balance, each on and off.
    With --device cuda, (b) and (c) hold the 25% budget in GPU memory behind
    a pinned host tier of --host-share of the experts.  (c) bounds each
    process (RSS and page cache) with a memory cgroup where the box allows
    one (cgroup v1 or v2, as root): on the CPU the budget, on a GPU the host
    tier, each over a baseline (on a GPU, the host memory of the 'ram' run).  Prints tables and one
    JSON line.

    \b
    Example:
      coe-agent llm bench --work var/llm                # all parts: ~25 min on 2 cores, first run trains
      coe-agent llm bench --part a --prompts 20
      coe-agent llm bench --part e                      # on a GPU box
      coe-agent llm bench --part b,c,d --device cuda    # (b), (c), (d) with a CUDA pool
    """
    _need_transformers()
    import json

    from tqdm import tqdm

    from coe.moe import MoELayout
    from routing.moe_trace import Trace
    from storage.llm_import import import_checkpoint

    from . import llm_bench as lb
    from .llm_models import generated_model

    want = {p.strip() for p in parts.split(",") if p.strip()}
    if not want or want - {"a", "b", "c", "d", "e"}:
        raise CoEError(f"--part {parts!r}: give a comma-separated subset of a, b, c, d, e")
    if train_steps is not None and train_seconds is not None:
        raise CoEError("give --train-steps or --train-seconds, not both")
    cuda = device.startswith("cuda")
    if cuda and "a" in want:
        raise CoEError(f"--device {device} applies to (b), (c) and (d); (a) is a simulation: run it without it")
    if host_mode == "exclusive" and not (cuda and host_share > 0):
        raise CoEError("--host-mode exclusive makes the host tier a victim cache of a GPU pool: give --device cuda "
                       "and a --host-share above 0")
    if "e" in want or cuda:
        import torch

        if cuda and not torch.cuda.is_available():
            raise CoEError(f"--device {device}: no CUDA device here")
        if "e" in want and not torch.cuda.is_available():
            raise CoEError("--part e measures the Fiddler split and the prefill balance on a GPU: no CUDA device here")
    work_dir = Path(work)
    doc: dict = {"bench": "llm"}
    if want & {"a", "b", "d"}:
        profile, rep = lb.split_trace(Trace.load(_trained_trace(work_dir, prompts, decode, train_steps,
                                                                 train_seconds)))
        doc["trained_model"] = _training_record(work_dir / "trained-hf")
    if "a" in want:
        data = Path(mixtral_data) if mixtral_data else lb.mixtral_data_dir()
        mprof, mrep = lb.mixtral_traces(data, tokens=tokens)
        rows = []
        with tqdm(total=2 * len(lb.SIZES) * len(lb.QUOTAS) * len(lb.POLICIES), desc="(a) replaying",
                  disable=None) as bar:
            sizes = {"trained": MoELayout.load(work_dir / "trained").layers[0].expert_nbytes,
                     "mixtral": lb.MIXTRAL_EXPERT_BYTES}
            for kind, p, r in (("trained", profile, rep), ("mixtral", mprof, mrep)):
                rows += lb.run_replays(kind, p, r, expert_nbytes=sizes[kind], progress=lambda _: bar.update(1))
        click.echo("(a) hit rate per policy (simulation on real pools; belady = offline oracle, a bound; +a: with "
                   "admission, a miss worth less than what it would push out is read for its one use and never "
                   "enters the pool, with one expert of the memory set aside for it, shared quota only; belady+a "
                   "bounds those)")
        click.echo(f"    trained: {len(rep.layers)} layers x {rep.num_experts} experts, top-{rep.top_k}, replay "
                   f"{rep.tokens} tokens, profile {profile.tokens}; mixtral: {len(mrep.layers)} x "
                   f"{mrep.num_experts}, top-{mrep.top_k}, {mrep.tokens} tokens, no temporal locality assumed")
        click.echo(lb.table(rows))
        summ = lb.summary(rows)
        for kind, s in summ.items():
            verdict = "meets" if s["miss_ratio_vs_lru"] is not None and s["miss_ratio_vs_lru"] <= 0.7 else "misses"
            click.echo(f"at 25% on {kind}: LRU {s['lru_hit_rate']:.1%} hits; best {s['best']} ({s['best_quota']}) "
                       f"{s['best_hit_rate']:.1%}, misses {s['miss_ratio_vs_lru']}x LRU ({verdict} the 0.7x "
                       f"target); oracle {s['belady_hit_rate']:.1%} ({s['belady_miss_ratio_vs_lru']}x); moved "
                       f"{s['lru_gib_moved']:.2f} GiB (LRU) vs {s['best_gib_moved']:.2f} GiB")
            sh, pl = s["best_shared_hit_rate"], s["best_per_layer_hit_rate"]
            if sh is not None and pl is not None:
                click.echo(f"  quotas on {kind} at 25%: one shared budget {sh:.1%} vs per-layer {pl:.1%} (best "
                           f"realisable policy each): {'shared' if sh >= pl else 'per-layer'} is better")
        doc["a"] = {"summary": summ, "rows": lb.as_json(rows)}
    if want & {"b", "c", "d", "e"}:
        big_hf, big = work_dir / "big-hf", work_dir / "big"
        if not (big_hf / "config.json").is_file():
            click.echo(f"generating a {expert_gb} GB model -> {big_hf}", err=True)
            shape = ({"layers": len(rep.layers), "experts": rep.num_experts, "top_k": rep.top_k}
                     if want & {"b", "d"} else {})
            generated_model(big_hf, expert_gb=expert_gb, **shape)
        if not (big / "llm.json").is_file():
            import_checkpoint(big_hf, big, name="big")
        layout = MoELayout.load(big)
        speed = lb.store_read_speed(big, layout)
        res = (f"pool {0.25 * layout.expert_bytes / 1e9:.2f} GB (25% of {layout.expert_bytes / 1e9:.2f} GB of "
               f"experts) + {layout.resident_nbytes / 1e6:.0f} MB resident; disk {speed / 1e9:.2f} GB/s cold")
        if cuda:
            res += (f"; pool and resident weights on {torch_device_name()}, behind a pinned {host_mode} host tier "
                    f"of {host_share * layout.expert_bytes / 1e9:.2f} GB ({host_share:.0%} of the experts)")
        if want & {"b", "c", "d"}:
            doc["device"] = torch_device_name() if cuda else "cpu"     # where (b), (c) and (d) ran; (e) says its own
        doc["resources"] = res
        doc["disk_bytes_per_s"] = speed
    if "c" in want:   # the import's memory target sits with (c)'s: one checkpoint import in its own process
        imp = lb.import_peak(big_hf)
        click.echo(f"import of the {imp['checkpoint_bytes'] / 1e9:.2f} GB checkpoint: {imp['seconds']:.0f} s, peak RSS "
                   f"{imp['rss_peak_above_base'] / 1e6:.0f} MB above the baseline ({imp['rss_base'] / 1e6:.0f} MB: "
                   f"interpreter, torch and the model's code) = "
                   f"{imp['rss_peak_above_base'] / imp['checkpoint_bytes']:.1%} of the checkpoint (target < 25%); "
                   f"{imp['rss_peak'] / 1e6:.0f} MB in all = {imp['rss_peak'] / imp['checkpoint_bytes']:.0%}")
        doc["import"] = imp
    if "b" in want:
        trace = lb.decode_only(rep, decode_tokens)
        with tqdm(total=len(lb.DECODE_POLICIES), desc="(b) decoding", disable=None) as bar:
            drows = lb.run_decode(big, profile, trace, device=device, host_share=host_share if cuda else 0.0,
                                  host_mode=host_mode, progress=lambda _: bar.update(1))
        n_dec = int((trace.step > 0).sum())
        click.echo(f"(b) trace-driven real decode, {n_dec} decode tokens of the trained trace (their prompts' "
                   f"prefills seed the router statistics, not computed), real run on {doc['device']}: {res}")
        lru = lb.lru_baseline(drows)              # LRU runs first and last: the box's drift favours no policy
        click.echo(f"{'policy':20} {'tokens/s':>9} {'hit rate':>9} {'GiB read':>9} {'of files':>9} {'load s':>7} "
                   f"{'x LRU':>6}  (x LRU: against the mean of the first and last LRU runs, {lru:.2f} tokens/s; "
                   f"of files: read from expert files, the rest copied from the host tier)")
        for i, r in enumerate(drows):
            name = "lru (last)" if r.policy == "lru" and i > 0 else (
                "belady (oracle)" if r.policy == "belady" else r.policy)     # offline: knows the future
            click.echo(f"{name:20} {r.tokens_per_second:>9.2f} {r.hit_rate:>9.1%} {r.gib_read:>9.2f} "
                       f"{r.gib_from_files:>9.2f} {r.load_seconds:>7.1f} {r.tokens_per_second / lru:>6.2f}")
        best = max((r for r in drows if r.policy not in ("belady", "lru")), key=lambda r: r.tokens_per_second)
        click.echo(f"best {best.policy}: {best.tokens_per_second / lru:.2f}x LRU tokens/s (target 1.3x)")
        doc["b"] = {"rows": [dataclasses.asdict(r) for r in drows], "best": best.policy, "lru_baseline": lru,
                    "best_vs_lru": best.tokens_per_second / lru}
    if "c" in want:
        tok_ids = list(range(40, 56))
        with tqdm(total=len(lb.E2E_POLICIES) + len(lb.REFERENCES) + 1, desc="(c) end to end", disable=None) as bar:
            runs, mem = lb.run_e2e(big_hf, big, tok_ids, e2e_tokens, device=device,
                                   host_share=host_share if cuda else 0.0, host_mode=host_mode,
                                   progress=lambda _: bar.update(1))
        click.echo(f"(c) end to end, {e2e_tokens} tokens greedy, each system in its own process, real run on "
                   f"{doc['device']}: {res}")
        click.echo(f"    memory: {mem['note']}")
        click.echo("    accelerate (N%): max_memory = N% of budget + non-expert weights, the largest share whose "
                   "process fits the bound")
        click.echo("    load + gen s: from_pretrained / load_pooled and the generation, both timed (accelerate writes "
                   "its offload files while it loads; coe-edge loads experts as tokens ask for them)")
        click.echo(f"{'system':18} {'tokens/s':>9} {'load + gen s':>13} {'hit rate':>9} {'RSS gen MB':>11} "
                   f"{'above base':>11} {'RSS load MB':>12} {'same tokens':>12}")
        ram = next(r for r in runs if r["system"] == "ram")
        for r in runs:
            name = r["system"] + (f"/{r['policy']}" if r.get("policy") else "")
            if "failed" in r:
                click.echo(f"{name:18} failed: {r['failed']}")
                continue
            hr = f"{r['hit_rate']:.1%}" if "hit_rate" in r else "-"
            if "max_memory_share" in r:
                name += f" ({r['max_memory_share']:.0%})"
            click.echo(f"{name:18} {r['tokens_per_second']:>9.2f} {r['load_seconds_model'] + r['seconds']:>13.2f} "
                       f"{hr:>9} {r['rss_peak'] / 1e6:>11.0f} "
                       f"{r['rss_peak_above_base'] / 1e6:>11.0f} {r['rss_load_peak'] / 1e6:>12.0f} "
                       f"{str(r['output'] == ram.get('output')):>12}")
        coe_runs = lb.compared_coe_runs(runs)
        if not coe_runs:
            click.echo("no coe-edge run finished within the bound: no comparison")
            doc["c"] = {"runs": runs, "memory": mem, "best": None}
        else:
            _summarise_e2e(doc, runs, mem, coe_runs, layout, speed, cuda, host_share)
        for r in runs:
            r.pop("output", None)       # the tokens were compared above; the JSON line gives the figures
    if "d" in want:
        trace = lb.decode_only(rep, decode_tokens)
        with tqdm(total=len(lb.ABLATION) + 1, desc="(d) ablation", disable=None) as bar:   # + the ceiling
            arows = lb.run_ablation(big, profile, trace, device=device, host_share=host_share if cuda else 0.0,
                                    host_mode=host_mode, progress=lambda _: bar.update(1), on_row=_echo_row)
        click.echo(f"(d) ablation, each row on top of the one before (the two prefetch rows are alternatives; "
                   f"from 'next token + popularity' on, that eviction replaces the gate score's; the alpha 0.5 and "
                   f"0.7 rows are that row's settings with a wider substitution band, not on top of the split, and "
                   f"'no substitution' is that eviction alone): "
                   f"trace-driven real decode as (b), real run on {doc['device']}: {res}"
                   + ("; GiB read: bytes into the GPU pool, from the host tier or the disk" if cuda else ""))
        base = lb.lru_baseline(arows)
        click.echo(f"{'row':46} {'tokens/s':>9} {'hit rate':>9} {'GiB read':>9} {'of files':>9} {'x LRU':>6}  notes "
                   f"(x LRU: against the mean of the two LRU rows, {base:.2f} tokens/s; of files: read from "
                   f"expert files, the rest copied from the host tier)")
        for r in arows:
            notes = [f"{r['substituted']} substituted" if r.get("alpha") else "",
                     f"{r['in_place']} computed in place ({r['gib_in_place']:.2f} GiB read from their files), "
                     f"{r['loaded']} layers loaded" if "in_place" in r else "",
                     f"prefetch precision {r['prefetch_precision']:.2f} recall {r['prefetch_recall']:.2f}, "
                     f"{r['prefetch_useful']} of {r['prefetch_issued']} read in used ({r.get('prefetch_adopted', 0)} "
                     f"joined midway), {r.get('prefetch_paused', 0)} pauses, {r.get('prefetch_yielded', 0)} stopped "
                     f"(layer ran without it {r.get('prefetch_stopped_ran', 0)}, room wanted "
                     f"{r.get('prefetch_stopped_room', 0)}, paused too long {r.get('prefetch_stopped_limit', 0)}), "
                     f"{r.get('prefetch_dropped', 0)} dropped"
                     if "prefetch_precision" in r else ""]
            note = "; ".join(n for n in notes if n)
            click.echo(f"{r['row']:46} {r['tokens_per_second']:>9.2f} {r['hit_rate']:>9.1%} {r['gib_read']:>9.2f} "
                       f"{r.get('gib_from_files', 0.0):>9.2f} {r['tokens_per_second'] / base:>6.2f}  {note}")
        click.echo("    not a row: next-layer prefetch (needs real hidden states; see bench/moe_real_decode.py)")
        click.echo("    oracle rows: the token-wise prefetch guessing the trace's own next token (every expert it asks "
                   "for, or only those substitution would not replace): not realisable, a bound on what prefetch "
                   "pays on this box with a perfect predictor")
        ratios = lb.oracle_ratios(arows)
        if ratios:
            click.echo("    oracle rows against the same without prefetch (LRU, or the best row's settings: the mean "
                       "of their two runs): " + ", ".join(f"{name.removeprefix('oracle: ')} {x:.2f}x"
                                                         for name, x in ratios.items()))
            doc["d_oracle_ratios"] = ratios
        ceiling = next((r for r in arows if r["row"] == lb.CEILING), None)
        if ceiling is not None:
            # the alpha 0.5 and 0.7 rows trade some quality for their speed: not candidates for "best", said apart
            best = lb.best_row(arows)
            click.echo(f"    best row at alpha <= 0.3: {best['row']} at {best['tokens_per_second'] / base:.2f}x LRU; "
                       f"with every expert resident the same decode runs at "
                       f"{ceiling['tokens_per_second'] / base:.2f}x LRU (a ceiling no technique here can pass)")
            for wide in (r for r in arows if r["row"] in lb.WIDE_ROWS):
                click.echo(f"    at alpha {wide['alpha']} (a wider band: more substitution, less agreement with "
                           f"alpha 0; measure it with llm tune-alpha) {wide['tokens_per_second'] / base:.2f}x LRU")
            cuts = lb.latency_cuts(arows)
            for c in cuts:
                click.echo(f"    decode latency at alpha {c['alpha']} ({c['row']}): {-c['vs_lru']:+.1%} against LRU, "
                           f"{-c['vs_best_baseline']:+.1%} against the best row without substitution "
                           f"({c['best_baseline']})")
            doc["d_latency_cuts"] = cuts
        doc["d"] = arows
        doc["d_lru_baseline"] = base
        if not cuda:        # on a GPU box the prefill split is (e)'s
            pf = lb.prefill_batching(big, list(range(40, 168)))
            click.echo(f"prefill split on this CPU box = batching a prompt's tokens per expert: 128-token prompt in "
                       f"one pass {pf['batched']['tokens_per_second']:.1f} tokens/s ({pf['batched']['gib_read']:.2f} "
                       f"GiB read) vs token by token {pf['token-by-token']['tokens_per_second']:.1f} tokens/s "
                       f"({pf['token-by-token']['gib_read']:.2f} GiB): {pf['speedup']:.1f}x")
            doc["prefill"] = pf
    if "e" in want:
        rows = lb.gpu_split_bench(big, list(range(40, 168)), min(decode_tokens, 64), device="cuda",
                                  progress=lambda what: click.echo(f"(e) {what}", err=True))
        click.echo(f"(e) on {torch_device_name()}: the Fiddler split (decode) and the prefill balance, pool 25%, "
                   "pinned host tier 50%, 128-token prompt")
        click.echo(f"{'split':8} {'prefill':8} {'prefill tok/s':>13} {'decode tok/s':>12} {'hit rate':>9}  notes")
        for r in rows:
            note = (f"{r['in_place']} in place ({r['from_host']} host, {r['from_file']} file), "
                    f"{r['loaded']} layers loaded, {r['costs']}" if "in_place" in r else "") + (
                f"; prefill {r['prefill_gpu_resident']} resident, {r['prefill_streamed']} streamed "
                f"({r['prefill_admitted']} kept by the host tier), {r['prefill_cpu']} CPU" if "prefill_streamed" in r
                else "") + (f"; {r['host_misses']} file reads" if "host_misses" in r else "") + (
                f"; decode alone {r['decode_only_tokens_per_second']:.1f} tok/s, {r['decode_only_misses']} pool misses"
                + (f", {r['decode_only_host_misses']} file reads" if "decode_only_host_misses" in r else ""))
            click.echo(f"{r['split']:8} {r['prefill']:8} {r['prefill_tokens_per_second']:>13.1f} "
                       f"{r['decode_tokens_per_second']:>12.2f} {r['hit_rate']:>9.1%}  {note}")
        doc["e"] = {"device": torch_device_name(), "rows": rows}
    click.echo(json.dumps(doc))


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _echo_row(row: dict) -> None:
    """One (d) row on stderr as it ends: a run stopped by a time limit keeps the rows it finished."""
    click.echo(f"(d) row done: {row['row']}: {row['tokens_per_second']:.2f} tokens/s, hit rate {row['hit_rate']:.1%}, "
               f"{row['gib_read']:.2f} GiB read", err=True)


def trace_prompts(hf: Path, prompts: int) -> list[str]:
    """The trained model's trace prompts: `prompts` evenly spaced 160-character slices of its held-out text."""
    held = (hf / "heldout.txt").read_bytes().decode("utf-8", "replace")
    step = max(1, len(held) // prompts)
    return [held[i * step:i * step + 160] for i in range(prompts)]


def _training_record(hf: Path) -> dict:
    """How `hf` was trained (its training.json), said on stderr: a figure off a model is only re-derivable with
    it.  A model trained before the record existed was trained for a time budget: said so."""
    import json

    from .llm_models import TRAINING_FILE

    try:
        rec = json.loads((hf / TRAINING_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        click.echo(f"trained model {hf}: no readable {TRAINING_FILE} (trained by an older version, for a time "
                   "budget: another box trains another model); `rm -r` it to train a reproducible one", err=True)
        return {"record": None}
    if not isinstance(rec, dict):
        return {"record": None}
    click.echo(f"trained model {hf}: {rec.get('steps')} steps ({rec.get('stopped_by')}), seed {rec.get('seed')}, "
               f"Python {rec.get('python')}, torch {rec.get('torch')}, {rec.get('threads')} threads, "
               f"{rec.get('cpu_capability', 'unknown')} kernels, corpus "
               f"{str(rec.get('corpus_sha256'))[:12]}, loss {rec.get('loss')}", err=True)
    return {"record": rec}


def _trained_trace(work_dir: Path, prompts: int, decode: int, train_steps: int | None,
                   train_seconds: float | None) -> Path:
    """The trained small MoE's trace on held-out text: trained, imported and traced on first use, then reused."""
    import torch
    from tqdm import tqdm

    from coe.moe import MoELayout
    from executors.moe_model import load_pooled, record_trace
    from storage.llm_import import import_checkpoint

    hf, store = work_dir / "trained-hf", work_dir / "trained"
    trace_path = work_dir / f"trained-{prompts}x{decode}.trace"
    if not (hf / "config.json").is_file():
        if train_steps is None and train_seconds is None:
            train_steps = BENCH_TRAIN_STEPS
        click.echo(f"training the small MoE for {f'{train_steps} steps' if train_steps else f'{train_seconds:.0f} s'}"
                   f" -> {hf}", err=True)
        _train(hf, steps=train_steps, seconds=train_seconds)
    if not (store / "llm.json").is_file():
        import_checkpoint(hf, store, name="trained")
    if not trace_path.is_file():
        layout = MoELayout.load(store)
        pm = load_pooled(store, memory=layout.expert_bytes, policy="lru")
        tok = pm.tokenizer()
        ids = [torch.tensor(tok.encode(t), dtype=torch.long) for t in trace_prompts(hf, prompts)]
        with tqdm(total=len(ids), desc="tracing the trained model", unit=" prompts", disable=None) as bar:
            record_trace(pm, ids, decode, progress=lambda n: bar.update(n - bar.n)).save(trace_path)
        pm.close()
    return trace_path


@llm.command("train-predictor")
@click.option("--trace", "trace_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Trace to learn from (coe-agent llm trace).")
@click.option("--eval", "eval_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Held-out trace to score on (default: the second half of --trace's prompts, not trained on).")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Predictor file to write.")
@_fail_clearly
def llm_train_predictor(trace_path: str, eval_path: str | None, out: str) -> None:
    """Train the token-wise expert predictor (SMoE): next token's experts at each layer from this token's scores.

    Prints precision and recall on held-out traces at m = k and m = 2k guesses.

    \b
    Example:
      coe-agent llm train-predictor --trace var/llm/trained-40x32.trace --out var/llm/trained.predictor
    """
    from routing.moe_predictor import TokenPredictor
    from routing.moe_trace import Trace

    from .llm_bench import split_trace

    trace = Trace.load(trace_path)
    if eval_path:
        train, held = trace, Trace.load(eval_path)
    else:
        train, held = split_trace(trace)
    pred = TokenPredictor.train(train)
    scores = [pred.evaluate(held, m) for m in (pred.top_k, 2 * pred.top_k)]
    pred.save(out, {"trained_on": trace_path, "held_out": scores})
    for s in scores:
        click.echo(f"held-out, top-{s['m']} guesses: precision {s['precision']:.2f}, recall {s['recall']:.2f} "
                   f"({s['pairs']} next-token pairs)")
    click.echo(f"predictor for {len(pred.layers)} layers x {pred.num_experts} experts ({pred.features} inputs) -> "
               f"{out}")
    click.echo(f"use it: coe-agent llm generate --model STORE --prompt ... --policy predicted --predictor {out} "
               f"--trace {trace_path}")


@llm.command("tune-alpha")
@click.option("--model", "-m", "model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Store written by 'coe-agent llm import'.")
@click.option("--budget-ms", required=True, type=click.FloatRange(0, min_open=True), help="Target ms per token.")
@click.option("--text", "text_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Held-out UTF-8 text (default: the model dir's heldout.txt).")
@click.option("--memory", default="25%", show_default=True, help="Expert pool budget.")
@click.option("--alphas", default="0,0.1,0.2,0.3,0.4,0.5", show_default=True, help="Alphas to measure.")
@click.option("--tokens", default=400, show_default=True, type=click.IntRange(16, 100_000),
              help="Held-out tokens decoded per alpha.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False), help="Write the alpha curve as a PNG.")
@click.option("--policy", default="gate-score", show_default=True, type=_POLICY,
              help="Eviction policy while decoding: what is resident decides what substitution can use.")
@click.option("--trace", "trace_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A trace whose per-layer popularity ranks experts (--policy probability or predicted).")
@click.option("--predictor", "predictor_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A token predictor (coe-agent llm train-predictor) for --policy predicted.")
@_fail_clearly
def llm_tune_alpha(model: str, budget_ms: float, text_path: str | None, memory: str, alphas: str, tokens: int,
                   plot: str | None, policy: str, trace_path: str | None, predictor_path: str | None) -> None:
    """Pick the smallest substitution threshold alpha whose ms/token meets a budget.

    Decodes held-out text token by token at each alpha (teacher forcing), measures
    ms/token, perplexity and next-token agreement with alpha = 0, fits ms/token
    with a low-degree polynomial and searches it (the importance paper's Eq. 5).

    \b
    Example:
      coe-agent llm tune-alpha --model var/llm/trained --budget-ms 20 --plot alpha.png
      coe-agent llm tune-alpha -m var/llm/trained --budget-ms 12 --policy predicted \\
          --predictor var/llm/trained.predictor --trace var/llm/trained-40x32.trace
    """
    _need_transformers()
    from coe.moe import MoELayout
    from executors.moe_model import load_pooled
    from executors.moe_quality import decode_quality, pick_alpha

    _check_policy_inputs(policy, predictor_path, trace_path)
    root = _store(model)
    layout = MoELayout.load(root)
    popularity = _popularity(trace_path, layout)
    try:
        grid = sorted({float(a) for a in alphas.split(",") if a.strip()})
    except ValueError:
        raise CoEError(f"--alphas {alphas!r}: expected numbers separated by commas") from None
    if not grid or grid[0] != 0.0 or any(not 0 <= a < 1 for a in grid):
        raise CoEError("--alphas: must start at 0 (the exact reference) and stay below 1")
    text = Path(text_path).read_text(encoding="utf-8", errors="replace") if text_path else _heldout(layout, root)
    rows, base = [], None
    for a in grid:
        pm = load_pooled(root, memory=_memory(memory, layout), policy=policy, alpha=a, popularity=popularity,
                         predictor=predictor_path)
        ids = pm.tokenizer().encode(text)[:tokens + 1]
        if len(ids) < 2:       # perplexity and agreement need a token to predict after the first
            pm.close()
            raise CoEError(f"--text {text_path or 'held-out'}: {len(ids)} token(s); tune-alpha needs at least 2 "
                           "(give it a paragraph of text like the model's)")
        q = decode_quality(pm, [ids])
        st = pm.stats()
        pm.close()
        base = base or q
        rows.append({"alpha": a, "ms_per_token": 1000 * q.seconds / max(q.tokens, 1), "perplexity": q.perplexity,
                     "agreement": q.agreement(base), "loads": st.misses})
        click.echo(f"alpha {a:.2f}: {rows[-1]['ms_per_token']:.1f} ms/token, perplexity {q.perplexity:.3f} "
                   f"({(q.perplexity / base.perplexity - 1):+.2%}), agreement {rows[-1]['agreement']:.1%}, "
                   f"{st.misses} loads")
    best, coef = pick_alpha([r["alpha"] for r in rows], [r["ms_per_token"] for r in rows], budget_ms)
    if plot:
        _plot_alpha(rows, plot, budget_ms)
    if best is None:
        click.echo(f"no alpha up to {grid[-1]} meets {budget_ms} ms/token (fit {coef})")
    else:
        click.echo(f"smallest alpha meeting {budget_ms} ms/token: {best:.3f}" + (" (exact)" if best == 0 else ""))


def _heldout(layout, root: Path) -> str:
    src = Path(layout.extra.get("source", "")) / "heldout.txt"
    if not src.is_file():
        raise CoEError(f"no held-out text: pass --text FILE (looked for {src})")
    return src.read_text(encoding="utf-8", errors="replace")


def _plot_alpha(rows: list[dict], path: str, budget_ms: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = [r["alpha"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    ax[0].plot(a, [r["ms_per_token"] for r in rows], "o-")
    if budget_ms:
        ax[0].axhline(budget_ms, color="grey", ls="--", label="budget")
        ax[0].legend()
    ax[0].set_xlabel("substitution threshold alpha")
    ax[0].set_ylabel("ms per token")
    base = rows[0]["perplexity"]
    ax[1].plot(a, [100 * (r["perplexity"] / base - 1) for r in rows], "o-", label="perplexity rise %")
    ax[1].plot(a, [100 * (1 - r["agreement"]) for r in rows], "s-", label="next-token disagreement %")
    ax[1].set_xlabel("substitution threshold alpha")
    ax[1].legend()
    fig.suptitle("Importance-driven substitution: speed and quality against alpha")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
