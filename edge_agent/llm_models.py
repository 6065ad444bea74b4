"""MoE models made here, since nothing can be downloaded: a trained small one and generated big ones.

- `train_model`: a small Mixtral-style MoE trained on this machine's own
  text (the Python standard library's sources), with a byte-level tokenizer,
  saved in the Hugging Face format.  Its routing is learned, so its traces are
  the realistic workload for the benchmarks.
- `generated_model`: a model of any size from a family's config with
  generated weights (for memory and bandwidth figures, where only the bytes
  matter), written shard by shard as a real checkpoint.
Both save with `save_pretrained`, so importing them exercises the same path
as a user's checkpoint.
"""
from __future__ import annotations

import hashlib
import math
import random
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from coe.files import write_json_atomic

SPECIALS = ("<pad>", "<s>", "</s>")
TRAINING_FILE = "training.json"   # beside a trained model: how it was trained (steps, seed, corpus digest, ...)
BENCH_TRAIN_STEPS = 3500   # `llm bench`'s small MoE: 524 s on this quiet 2-core box (two runs: identical weights)


def byte_tokenizer():
    """A byte-level tokenizer: 3 special tokens then the 256 bytes (ids 3..258), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(byte_chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


VOCAB = len(SPECIALS) + 256


def stdlib_corpus(max_bytes: int = 8 * 2**20, seed: int = 0) -> tuple[bytes, bytes]:
    """(train, held-out) text from the standard library's .py sources on this machine, split by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    random.Random(seed).shuffle(files)
    train, held = bytearray(), bytearray()
    for i, f in enumerate(files):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        (held if i % 10 == 0 else train).extend(data + b"\n")
        if len(train) >= max_bytes:
            break
    return bytes(train), bytes(held)


def small_config(**overrides):
    from transformers import MixtralConfig

    kw = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=512,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, router_aux_loss_coef=0.02,
              output_router_logits=True)
    kw.update(overrides)
    return MixtralConfig(**kw)


def train_model(out: str | Path, *, seconds: float | None = None, steps: int | None = None, seq_len: int = 128,
                batch: int = 16, seed: int = 0, progress: Callable[[int, float, float], None] | None = None,
                **config) -> dict:
    """Train a small MoE on stdlib text for `steps` optimizer steps, or for `seconds`; save model, tokenizer and
    `training.json` to `out`. Returns a summary (what `training.json` holds).

    A step count makes the model reproducible: the same seed, steps, Python
    (whose stdlib is the corpus: its digest is recorded), torch build,
    thread count and CPU instruction set (torch picks its matmul kernels by
    it: AVX2 and AVX-512 round differently) give the same weights, bit for
    bit; all are recorded.  A time budget gives a box-dependent number of
    steps (a faster or busier box trains another model), which is why
    `llm bench` trains by steps.
    """
    import platform

    import torch
    from transformers import AutoModelForCausalLM

    if (seconds is None) == (steps is None):
        raise ValueError("train_model: give exactly one of seconds and steps")
    if steps is not None and steps < 1:
        raise ValueError(f"train_model: steps must be at least 1, got {steps}")
    torch.manual_seed(seed)
    cfg = small_config(**config)
    model = AutoModelForCausalLM.from_config(cfg)
    tok = byte_tokenizer()
    train, held = stdlib_corpus(seed=seed)
    data = torch.tensor(list(train), dtype=torch.long) + len(SPECIALS)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    rng = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    step, loss_avg = 0, None
    model.train()
    while step < steps if steps is not None else time.perf_counter() - start < seconds:
        idx = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=rng)
        x = torch.stack([data[i:i + seq_len] for i in idx.tolist()])
        lr = 3e-3 * min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = lr
        res = model(input_ids=x, labels=x)
        opt.zero_grad()
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_avg = res.loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * res.loss.item()
        step += 1
        if progress:
            progress(step, loss_avg, time.perf_counter() - start)
    model.eval()
    model.config.output_router_logits = False
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "heldout.txt").write_bytes(held[:200_000])
    info = {"steps": step, "loss": loss_avg, "bits_per_byte": (loss_avg or 0) / math.log(2),
            "seconds": time.perf_counter() - start, "tokens": step * batch * seq_len,
            "stopped_by": "steps" if steps is not None else "seconds", "seed": seed, "batch": batch,
            "seq_len": seq_len, "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cpu_capability": _cpu_capability(torch),
            "cpu": platform.processor() or platform.machine(),
            "corpus_sha256": hashlib.sha256(train + b"\0" + held).hexdigest()}
    write_json_atomic(out / TRAINING_FILE, info)
    return info


def _cpu_capability(torch) -> str:
    """The instruction set torch's CPU kernels use here ('AVX2', 'AVX512', ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an older torch: recorded as unknown
        return "unknown"


def generated_model(out: str | Path, *, expert_gb: float, layers: int = 4, experts: int = 16, top_k: int = 2,
                    hidden: int = 1024, seed: int = 0, dtype: str = "float32") -> dict:
    """A Mixtral-style model whose experts take about `expert_gb` GB on disk, with generated weights.

    The shape (layers x experts, top-k) is fixed so that routing traces of the
    trained small model can drive it; the intermediate size is chosen to
    reach the size.  Saved shard by shard with `save_pretrained`.
    """
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    item = torch.finfo(getattr(torch, dtype)).bits // 8
    inter = max(16, int(expert_gb * 1e9 / (3 * hidden * item * layers * experts)) // 16 * 16 + 16)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=4, num_local_experts=experts,
                        num_experts_per_tok=top_k, max_position_embeddings=1024, tie_word_embeddings=True,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():   # routers that spread tokens over every expert, as a trained model's do
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 4.0 / math.sqrt(hidden))
    out = Path(out)
    model.save_pretrained(out, max_shard_size="500MB")
    byte_tokenizer().save_pretrained(out)
    return {"experts_per_layer": experts, "layers": layers, "intermediate": inter,
            "expert_bytes": 3 * hidden * inter * item * experts * layers}


def inflated_model(src: str | Path, out: str | Path, *, expert_mb: float, seed: int = 0) -> dict:
    """The trained small MoE at a big model's expert size: its routing, hidden states and outputs, big bytes.

    The generated big model (`generated_model`) has random weights, so its
    router gives a predictor nothing to learn and its hidden states are noise;
    traces of the trained model stand in for its routing, which leaves out
    whatever needs real hidden states (the next-layer prefetch).  This widens
    each expert of the trained model at `src` to about `expert_mb` MB with
    padding that adds nothing: the intermediate size grows from I to I';
    the new gate rows and down columns are random, the new up rows are zero,
    so the new units' activation silu(g) * 0 is zero and their contribution
    down[:, i] * 0 is zero.  The model computes what the small one computes
    (up to float summation order: the logits agree to about 1e-5), at a big
    expert's cost in bytes and matmul time.  One third of the padding is
    zeros; reading zeros measured no faster than random bytes on this disk.
    It holds both models in memory while it works: about twice the widened
    model's size.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src, out = Path(src), Path(out)
    cfg = AutoConfig.from_pretrained(src)
    if cfg.model_type != "mixtral":     # elsewhere intermediate_size is a dense MLP's, not the experts'
        raise ValueError(f"{src}: widening is for Mixtral-style models, whose experts' width is "
                         f"intermediate_size; this is '{cfg.model_type}'")
    small = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    inter_small, hidden = cfg.intermediate_size, cfg.hidden_size
    inter = int(expert_mb * 1e6 / (3 * hidden * 4)) // 16 * 16 if expert_mb == expert_mb else 0   # 16s: grouped mm
    if inter < inter_small:
        raise ValueError(f"expert_mb {expert_mb}: an expert of {src} already takes "
                         f"{3 * hidden * inter_small * 4 / 1e6:.3f} MB; widening needs a larger size")
    cfg.intermediate_size = inter
    cfg.dtype = "float32"
    big = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    sd, wide = small.state_dict(), {}
    for key, param in big.state_dict().items():
        have = sd[key]
        if key.endswith("experts.gate_up_proj"):                     # [E, 2I, H]: gate rows, then up rows
            t = torch.zeros(param.shape)
            t[:, :inter_small] = have[:, :inter_small]
            t[:, inter_small:inter] = torch.randn(have.shape[0], inter - inter_small, hidden, generator=gen) * 0.05
            t[:, inter:inter + inter_small] = have[:, inter_small:]  # the new up rows stay zero
            wide[key] = t
        elif key.endswith("experts.down_proj"):                      # [E, H, I]
            t = torch.randn(param.shape, generator=gen) * 0.05
            t[:, :, :inter_small] = have
            wide[key] = t
        elif have.shape != param.shape:
            raise ValueError(f"{src}: {key} has shape {tuple(have.shape)}, the widened model wants "
                             f"{tuple(param.shape)}; only the experts' intermediate size may grow")
        else:
            wide[key] = have
    big.load_state_dict(wide)
    big.save_pretrained(out, max_shard_size="500MB")
    byte_tokenizer().save_pretrained(out)
    if (src / "heldout.txt").exists():
        (out / "heldout.txt").write_bytes((src / "heldout.txt").read_bytes())
    ids = torch.tensor([[1] + [b + len(SPECIALS) for b in b"def main(self):\n    return "]])
    with torch.no_grad():
        diff = float((small(ids).logits - big(ids).logits).abs().max())
    layers, experts = cfg.num_hidden_layers, cfg.num_local_experts
    return {"intermediate": inter, "from_intermediate": inter_small, "max_logit_diff": diff,
            "expert_bytes": 3 * hidden * inter * 4 * experts * layers}
