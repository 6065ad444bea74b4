"""One end-to-end generation run in its own process, for `coe-agent llm bench` part (c).

Each system runs in a fresh process so its peak resident memory is its own:
- `coe`: `load_pooled` at the budget, greedy decoding;
- `accelerate`: transformers `from_pretrained(device_map='auto', max_memory=
  {'cpu': budget + non-expert bytes}, offload_folder=...)`, accelerate's disk
  offload, which is what a user would reach for;
- `ram`: the whole model in memory, transformers' eager experts;
- `coe-resident`: coe-edge with a pool of every expert, warmed by one
  untimed generation: its own path with no miss (its compute alone), the
  reference the compute-and-SSD limit needs.
The bench runs each at the budget in a memory cgroup where the box allows
one, so the page cache (which accelerate's offload reads through) counts
against the same memory as the pools; the two references ('ram',
'coe-resident') hold every weight and run unbounded.  Prints one JSON line.  `python -m edge_agent.llm_e2e --help`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from coe.moe import HOST_MODES


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class PeakRSS:
    """Samples this process's resident set every few milliseconds; `peak` is the largest seen.

    (ru_maxrss would do, but Linux carries it across exec from the parent.)
    """

    def __init__(self, every: float = 0.005) -> None:
        import threading

        import psutil

        self._proc, self._every = psutil.Process(), every
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak


def _bound(cgroup: str | None, limit: int) -> None:
    """Free the loader's scratch back to the OS, then lower this process's memory cgroup to `limit` (if bounded)."""
    from storage.heap import trim_heap

    from .memory_cgroup import lower_limit

    trim_heap()     # transformers' loader and ours free their scratch; glibc would keep it, counted by the bound
    if cgroup:
        lower_limit(cgroup, limit, _rss())


def run(system: str, hf_dir: str, store: str, memory: int, prompt_ids: list[int], tokens: int, policy: str,
        offload_dir: str | None, drop_after_read: bool = False, accelerate_share: float = 1.0,
        bound_cgroup: str | None = None, bound: int = 0, device: str = "cpu", host_memory: int = 0,
        host_mode: str = "inclusive", warm: bool = False) -> dict:
    import torch

    torch.set_grad_enabled(False)
    from transformers import AutoModelForCausalLM  # noqa: F401  (imported before the baseline is taken)

    from coe.moe import MoELayout
    from executors.moe_model import load_pooled

    # the baseline: the interpreter with torch and the model's transformers code loaded (a meta-device model
    # builds the classes and holds no weights), so what is above it is weights, pools, caches and activations
    from storage.llm_import import load_config, meta_model

    meta_model(load_config(Path(hf_dir)))
    if device.startswith("cuda"):   # the CUDA context's host memory is part of every GPU run's baseline
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    base = _rss()
    if system == "probe":
        return {"system": "probe", "rss_base": base}
    if system == "import":
        from storage.llm_import import import_checkpoint

        peak = PeakRSS()
        t0 = time.perf_counter()
        import_checkpoint(hf_dir, store, name="import-check")
        seconds = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors"))
        top = peak.stop()
        return {"system": "import", "seconds": seconds, "checkpoint_bytes": size, "rss_base": base,
                "rss_peak": top, "rss_peak_above_base": top - base}
    peak = PeakRSS()
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out: dict = {"system": system, "policy": policy if system in ("coe", "coe-resident") else None, "memory": memory}
    t0 = time.perf_counter()
    if system == "coe-resident":    # the reference: a pool of every expert, warmed before it is timed
        memory, warm = MoELayout.load(store).expert_bytes, True
        out["memory"] = memory
    if system in ("coe", "coe-resident"):
        pm = load_pooled(store, memory=memory, policy=policy, drop_after_read=drop_after_read, device=device,
                         host_memory=host_memory, host_mode=host_mode)
        out["load_seconds_model"] = time.perf_counter() - t0
        _bound(bound_cgroup, bound)
        out["rss_load_peak"] = peak.stop()
        peak = PeakRSS()
        if warm:    # every expert the generation asks for is resident before it is timed (a pool of them all)
            pm.generate(ids, tokens, min_new_tokens=tokens)
            peak.stop()
            peak = PeakRSS()
        first: dict = {}

        def mark(_tok: int) -> None:    # the first token ends the prompt's prefill: decode starts after it
            if not first:
                s = pm.stats()
                first.update(t=time.perf_counter(), bytes_in=s.bytes_in + s.bypassed_bytes)
        t1 = time.perf_counter()
        # as many tokens as the baselines, which transformers forces with min_new_tokens (end tokens masked)
        toks, stats = pm.generate(ids, tokens, on_token=mark, min_new_tokens=tokens)
        end, after = time.perf_counter(), pm.stats()
        out.update(tokens=stats.tokens, seconds=stats.seconds, hit_rate=stats.hit_rate,
                   bytes_in=stats.bytes_in + stats.bypassed_bytes, expert_load_seconds=stats.load_seconds,
                   output=toks, warm=warm,
                   # the prefill (the prompt and the first token) and the decode steps after it, apart
                   prefill_seconds=first["t"] - t1, decode_tokens=stats.tokens - 1, decode_seconds=end - first["t"],
                   decode_bytes_in=after.bytes_in + after.bypassed_bytes - first["bytes_in"])
    else:
        from transformers import AutoModelForCausalLM

        cuda = device.startswith("cuda")
        if system == "accelerate":
            layout = MoELayout.load(store)
            fast = int(accelerate_share * (memory + layout.resident_nbytes))
            # on a GPU: the budget on the GPU, the host memory coe-edge's host tier gets in RAM, the rest on disk
            max_memory = {torch.device(device).index or 0: fast, "cpu": host_memory} if cuda else {"cpu": fast}
            model = AutoModelForCausalLM.from_pretrained(
                hf_dir, device_map="auto", max_memory=max_memory,
                offload_folder=offload_dir, dtype=getattr(torch, layout.dtype), experts_implementation="eager")
            out["device_map"] = sorted(set(getattr(model, "hf_device_map", {}).values()))
            out["max_memory_share"] = accelerate_share
        elif system == "ram":   # the upper bound: every weight in the fast memory (the GPU on a CUDA run)
            model = AutoModelForCausalLM.from_pretrained(hf_dir, experts_implementation="eager",
                                                         **({"device_map": {"": device}} if cuda else {}))
        else:
            raise SystemExit(f"unknown system {system!r}")
        model.eval()
        out["load_seconds_model"] = time.perf_counter() - t0
        _bound(bound_cgroup, bound)
        out["rss_load_peak"] = peak.stop()
        peak = PeakRSS()
        t1 = time.perf_counter()
        res = model.generate(ids.to(device) if cuda else ids, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
        seconds = time.perf_counter() - t1
        toks = res[0, ids.shape[1]:].tolist()
        out.update(tokens=len(toks), seconds=seconds, output=toks)
    out["tokens_per_second"] = out["tokens"] / out["seconds"] if out["seconds"] else 0.0
    out["rss_base"] = base
    out["rss_peak"] = peak.stop()           # while generating, after loading
    out["rss_peak_above_base"] = out["rss_peak"] - base
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python -m edge_agent.llm_e2e --system coe --hf var/llm/big-hf "
                                        "--store var/llm/big --memory 600000000 --prompt-ids 3,4,5 --tokens 16")
    ap.add_argument("--system", required=True, choices=["coe", "coe-resident", "accelerate", "ram", "probe", "import"])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--memory", required=True, type=int)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--bound-cgroup", default=None, help="memory cgroup (v1 or v2) this process runs in")
    ap.add_argument("--bound", type=int, default=0, help="memory limit applied to it once the model is loaded")
    ap.add_argument("--accelerate-share", type=float, default=1.0,
                    help="accelerate: max_memory as a share of (budget + non-expert weights)")
    ap.add_argument("--drop-after-read", action="store_true",
                    help="coe: drop each expert file from the page cache once read (when no cgroup bounds memory)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the budget (and coe-edge's pool) is")
    ap.add_argument("--host-memory", type=int, default=0,
                    help="with --device cuda: the pinned host tier (coe) / max_memory['cpu'] (accelerate), bytes")
    ap.add_argument("--host-mode", default="inclusive", choices=HOST_MODES,
                    help="coe: the host tier keeps a copy of each load, or holds the GPU pool's victims")
    ap.add_argument("--warm", action="store_true",
                    help="coe: generate once untimed first, so the timed run finds resident what it asks for "
                         "(with --memory of every expert: coe-edge's own compute with no miss)")
    a = ap.parse_args(argv)
    ids = [int(x) for x in a.prompt_ids.split(",") if x]
    print(json.dumps(run(a.system, a.hf, a.store, a.memory, ids, a.tokens, a.policy, a.offload_dir,
                         a.drop_after_read, a.accelerate_share, a.bound_cgroup, a.bound, a.device, a.host_memory,
                         a.host_mode, a.warm)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
