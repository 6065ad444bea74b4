"""Models made here: the trained model widened to a big model's expert size computes what it computes."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from edge_agent.llm_models import inflated_model, small_config  # noqa: E402


@pytest.fixture()
def small_dir(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = small_config(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, num_local_experts=4, output_router_logits=False)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path / "small"
    model.save_pretrained(out)
    (out / "heldout.txt").write_text("held out")
    return out


def test_a_widened_model_routes_and_predicts_as_the_small_one(small_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    made = inflated_model(small_dir, tmp_path / "wide", expert_mb=0.05)
    assert made["from_intermediate"] == 16 and made["intermediate"] == 128   # 50 kB / (3 x 32 x 4 B) = 130, down to 16s
    small = AutoModelForCausalLM.from_pretrained(small_dir)
    wide = AutoModelForCausalLM.from_pretrained(tmp_path / "wide")
    experts = wide.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 2 * made["intermediate"], 32)
    assert tuple(experts.down_proj.shape) == (4, 32, made["intermediate"])
    # the padding is real data where it cannot matter, zero where it must be
    assert float(experts.gate_up_proj[:, 16:made["intermediate"]].abs().sum()) > 0
    assert float(experts.gate_up_proj[:, made["intermediate"] + 16:].abs().sum()) == 0
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])
    with torch.no_grad():
        a = small(ids, output_router_logits=True)
        b = wide(ids, output_router_logits=True)
    assert torch.allclose(a.logits, b.logits, atol=1e-5) and made["max_logit_diff"] < 1e-4
    for ra, rb in zip(a.router_logits, b.router_logits):       # the same experts chosen, layer by layer
        assert torch.equal(ra.topk(2, dim=-1).indices, rb.topk(2, dim=-1).indices)
    assert (tmp_path / "wide" / "heldout.txt").read_text() == "held out"


def test_widening_refuses_a_family_whose_intermediate_size_is_not_the_experts(small_dir, tmp_path):
    import json

    cfg = json.loads((small_dir / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "qwen2_moe", ["Qwen2MoeForCausalLM"]
    (small_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Mixtral-style.*'qwen2_moe'"):
        inflated_model(small_dir, tmp_path / "wide", expert_mb=0.05)
    assert not (tmp_path / "wide").exists()


@pytest.mark.parametrize("mb", [0.0, -1.0, float("nan"), 0.001])
def test_widening_to_a_size_below_the_experts_own_is_refused(small_dir, tmp_path, mb):
    with pytest.raises(ValueError, match="already takes"):
        inflated_model(small_dir, tmp_path / "wide", expert_mb=mb)


def test_training_by_steps_is_reproducible_and_says_how_it_was_trained(tmp_path):
    """A time budget trains a box-dependent model; a step count gives the same weights (same seed, Python and torch,
    thread count), and training.json records what an outsider needs to train it again."""
    import hashlib
    import json

    from edge_agent.llm_models import TRAINING_FILE, train_model

    tiny = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_local_experts=4)
    digests = []
    for run in ("a", "b"):
        info = train_model(tmp_path / run, steps=2, batch=2, seq_len=16, **tiny)
        digests.append(hashlib.sha256((tmp_path / run / "model.safetensors").read_bytes()).hexdigest())
        rec = json.loads((tmp_path / run / TRAINING_FILE).read_text())
        assert rec == json.loads(json.dumps(info)) and rec["steps"] == 2 and rec["stopped_by"] == "steps"
        assert rec["seed"] == 0 and len(rec["corpus_sha256"]) == 64 and rec["python"] and rec["threads"] >= 1
    assert digests[0] == digests[1]
    other = train_model(tmp_path / "c", steps=2, batch=2, seq_len=16, seed=1, **tiny)
    assert other["corpus_sha256"] != rec["corpus_sha256"] or \
        hashlib.sha256((tmp_path / "c" / "model.safetensors").read_bytes()).hexdigest() != digests[0]
    with pytest.raises(ValueError, match="exactly one of seconds and steps"):
        train_model(tmp_path / "d", steps=2, seconds=1.0)
    with pytest.raises(ValueError, match="exactly one of seconds and steps"):
        train_model(tmp_path / "d")
