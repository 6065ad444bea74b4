"""Writing many experts into a store: one `write` each against `write_each` (what `llm import` uses).

Real run on this machine: N tiny experts (one 32x16 fp32 tensor each, so the
figure is the store's bookkeeping, not the bytes) written into a fresh expert
store on the local disk, both ways side by side in one run.  `write` reads,
rewrites and fsyncs the whole manifest per expert (O(N^2) in all);
`write_each` does it once per group of 256.  An MoE import writes one entry
per (layer, expert): DeepSeek-V3 has 14,848.

Usage:  python bench/store_writes.py [--experts 1024] [--dir var/bench/store_writes]
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from coe import Expert  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402


def _items(n: int):
    for i in range(n):
        yield (Expert(id=f"m.L{i // 128}.E{i % 128}", arch="transformers/x", kind="moe-ffn", classes=(),
                      input_size=16), {"w": torch.full((32, 16), float(i))}, 1)


def _run(how: str, root: Path, n: int) -> float:
    if root.exists():
        shutil.rmtree(root)
    store = ExpertStore(root)
    t0 = time.perf_counter()
    if how == "write":
        for expert, tensors, version in _items(n):
            store.write(expert, tensors, version)
    else:
        store.write_each(_items(n))
    seconds = time.perf_counter() - t0
    assert len(ExpertStore(root).entries()) == n
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=1024)
    ap.add_argument("--dir", default="var/bench/store_writes")
    args = ap.parse_args()
    base = Path(args.dir)
    got = {how: _run(how, base / how, args.experts) for how in ("write", "write_each")}
    print(f"real run, this box's disk, {args.experts} experts into a fresh store")
    print(f"{'how':<12}{'seconds':>10}{'experts/s':>12}")
    for how, s in got.items():
        print(f"{how:<12}{s:>10.2f}{args.experts / s:>12.0f}")
    print(f"write_each is {got['write'] / got['write_each']:.1f}x faster")
    print(json.dumps({"bench": "store_writes", "real_run": True, "experts": args.experts,
                      "write_s": round(got["write"], 3), "write_each_s": round(got["write_each"], 3),
                      "speedup": round(got["write"] / got["write_each"], 1)}))


if __name__ == "__main__":
    main()
