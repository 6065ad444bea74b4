"""The pooled model computes with one core left to its expert loads on a CPU box (executors.moe_threads)."""
from __future__ import annotations

import pytest

from executors.moe_threads import compute_threads

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("cores,device,current,want", [
    (2, "cpu", 2, 1),      # this box: the loaders get the second core
    (16, "cpu", 16, 15),
    (16, "cpu", 4, 4),     # a user who asked for fewer keeps fewer
    (1, "cpu", 1, 1),      # never zero
    (8, "cuda", 8, 8),     # a GPU computes on the device: host threads untouched
])
def test_compute_threads_leaves_one_core_to_the_loaders_on_a_cpu_box(cores, device, current, want):
    assert compute_threads(cores, device, current) == want


def test_generate_computes_with_fewer_threads_and_gives_them_back(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from moe_models import build

    from executors import moe_threads
    from executors.moe_model import load_pooled
    from storage.llm_import import import_checkpoint

    monkeypatch.setattr(moe_threads, "usable_cores", lambda: 3)
    build("mixtral", tmp_path / "hf")
    layout = import_checkpoint(tmp_path / "hf", tmp_path / "store")
    pm = load_pooled(tmp_path / "store", memory=layout.layers[0].expert_nbytes * (layout.top_k + 1), policy="lru")
    seen = []
    pm.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        tokens, _ = pm.generate(torch.tensor([[5, 6, 7]]), 3)
        assert len(tokens) >= 1
        assert seen and set(seen) == {2}           # 3 cores: two compute, one for the loads
        assert torch.get_num_threads() == 3        # and the caller's setting is back afterwards
        # a model on the line agent's shared pools leaves the agent's thread count alone (its executors'
        # threads would take a lowered count as their default)
        pm.owns_pools = False
        seen.clear()
        pm.generate(torch.tensor([[5, 6, 7]]), 2)
        assert seen and set(seen) == {3}
    finally:
        pm.owns_pools = True
        torch.set_num_threads(before)
        pm.close()
