"""A running agent keeps the expert versions its frames started on: from its first manifest read, whoever writes."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from coe import parse_spec
from edge_agent.store_watch import StoreWatcher
from storage.expert_store import ExpertStore

from conftest import TINY_SPEC, write_line

MODEL = parse_spec(TINY_SPEC)
EID = "cls-r0402"


def _line(tiny_zoo: Path, root: Path) -> Path:
    # the shared zoo may hold other tests' reader lock files (dead readers): a copy starts with none
    shutil.copytree(tiny_zoo, root, ignore=shutil.ignore_patterns(".readers"))
    return root


def _nudged(store: ExpertStore, eid: str = EID) -> dict[str, torch.Tensor]:
    """The expert's weights, changed a little: a new version that is not the old bytes."""
    return {k: (v + 0.01 if v.is_floating_point() else v) for k, v in store.read(eid).items()}


def _readers(root: Path) -> list[Path]:
    return list((root / ".readers").glob("*.lock"))


def test_the_agent_is_a_reader_from_its_first_manifest_read(tmp_path, tiny_zoo):
    """Pools fill and journaled frames re-run before the watcher starts: a promotion then must keep their files."""
    from edge_agent.agent import Agent
    from edge_agent.config import load_config

    root = _line(tiny_zoo, tmp_path / "store")
    agent = Agent(load_config(write_line(tmp_path / "line", store=root), env={}))
    try:
        assert len(_readers(root)) == 1                       # registered before start
        old = agent.store.entry(EID).file
        writer = ExpertStore(root)
        writer.write_many([(MODEL.experts[EID], _nudged(writer), 2)])
        assert (root / old).is_file() and writer.retired == [old]
        assert agent.store.entry(EID).version == 1 and agent.store.read_flat(EID).version == 1
    finally:
        agent.stop()
    assert not _readers(root)                                  # a stop before start lets go too


def test_the_watcher_sees_a_promotion_that_landed_between_the_stores_read_and_its_start(tmp_path, tiny_zoo):
    root = _line(tiny_zoo, tmp_path / "store")
    line = ExpertStore(root, reader=True)                      # the agent's store, opened in its constructor
    writer = ExpertStore(root)
    writer.write_many([(MODEL.experts[EID], _nudged(writer), 2)])   # while the agent fills its pools
    forgotten: list[str] = []
    watch = StoreWatcher(line, lambda: [], forget=forgotten.append)
    watch.tick()
    assert forgotten == [EID] and line.entry(EID).version == 2
    line.close_reader()


def test_an_import_writes_a_new_file_beside_the_one_a_running_agent_reads(tmp_path, tiny_zoo):
    """`experts import` bumps the version through `write`: the agent's file stays until it has switched."""
    from safetensors.torch import save_file

    from executors.expert_import import import_expert

    root = _line(tiny_zoo, tmp_path / "store")
    agent = ExpertStore(root, reader=True)
    before = {k: v.clone() for k, v in agent.read(EID).items()}
    stale = ExpertStore(root)                                  # an importer's view, opened before a promotion
    promoter = ExpertStore(root)
    promoter.write(MODEL.experts[EID], _nudged(promoter), version=2)
    src = tmp_path / "trained.safetensors"
    save_file(_nudged(promoter), str(src))
    entry = import_expert(stale, MODEL.experts[EID], src)
    assert entry.version == 3                                  # the stored version + 1, not its stale view's
    assert len({e.file for e in (agent.entry(EID), promoter.entry(EID), entry)}) == 3
    got = agent.read_flat(EID)
    assert got.version == 1 and all(torch.equal(got.tensors()[k], v) for k, v in before.items())
    agent.reload()
    assert agent.release_retired() == 2 and agent.read_flat(EID).version == 3
    assert {p.name for p in root.glob(f"{EID}*")} == {entry.file}
    agent.close_reader()
