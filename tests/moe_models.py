"""Tiny MoE models of five transformers families, built from their configs with generated weights.

Three families route to k >= 3 experts: with k = 2 every summation order gives the same float, so only
k >= 3 lets the exactness tests catch an expert-order (accumulation-order) bug.

Nothing is downloaded: each model is built from its config, initialised by
transformers with a fixed seed and saved with `save_pretrained` into a temp
dir, which is the real loading path for the importer.
"""
from __future__ import annotations

from pathlib import Path

VOCAB = 320
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def configs() -> dict:
    from transformers import (DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig)

    return {
        "mixtral": MixtralConfig(**_COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=8,
                                 num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_hidden_layers=3, num_experts=8,
                                    num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[1],
                                    norm_topk_prob=False),
        "olmoe": OlmoeConfig(**_COMMON, intermediate_size=32, num_hidden_layers=2, num_experts=8,
                             num_experts_per_tok=3),
        "qwen3_moe": Qwen3MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                                    num_experts=8, num_experts_per_tok=4, head_dim=16, norm_topk_prob=True),
        "deepseek_v3": DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                        moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
                                        topk_group=2, num_attention_heads=4, num_key_value_heads=4,
                                        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0),
    }


def build(family: str, out: Path, *, seed: int = 0, dtype=None, max_shard_size=None):
    """Save a tiny `family` model into `out`; returns the eager reference model (fp32 unless `dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = configs()[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():   # routers of some families start at zero: give every family a real routing
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or "e_score_correction_bias" in name:
                p.normal_(0, 0.5)
    if dtype is not None:
        model = model.to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    ref = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager", dtype=dtype or torch.float32)
    return ref.eval()
