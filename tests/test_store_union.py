"""Several expert stores seen as one (`storage.store_union`): each id from one store, and stays so."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from coe import CoEError, Expert  # noqa: E402
from storage.expert_store import ExpertStore  # noqa: E402
from storage.store_union import StoreUnion  # noqa: E402


def _expert(eid: str) -> Expert:
    return Expert(id=eid, arch="torchvision/resnet18", kind="classifier", classes=("ok", "bad"), input_size=64)


def test_a_union_lists_each_id_once_and_refuses_to_write_an_id_another_store_serves(tmp_path):
    line, llm = ExpertStore(tmp_path / "line"), ExpertStore(tmp_path / "llm")
    line.write(_expert("a"), {"w": torch.zeros(2)})
    llm.write(_expert("b"), {"w": torch.ones(3)})
    union = StoreUnion(line, llm)
    assert [e.id for e in union.entries()] == ["a", "b"] and union.entry("b").nbytes == llm.entry("b").nbytes
    with pytest.raises(CoEError, match=r"expert 'b' is served from .*llm; writing it into .*line would put it in "
                                       r"two stores"):
        union.write(_expert("b"), {"w": torch.zeros(3)})
    assert not line.has("b") and [e.id for e in union.entries()] == ["a", "b"]
    union.write(_expert("a"), {"w": torch.ones(2)}, 2)          # its own: a new version
    assert union.entry("a").version == 2 and [e.id for e in union.entries()] == ["a", "b"]
    line.write(_expert("b"), {"w": torch.zeros(3)})             # behind the union's back: refused at reload
    with pytest.raises(CoEError, match="expert 'b' is in two stores"):
        union.reload()
