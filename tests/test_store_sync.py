"""A node's side of `experts sync` (no Ray: the actor class is plain Python) and the front's snapshot.

Real expert stores on real files.  The node takes a promotion in one step: a store opened on the node while the
files arrive (an actor starting) must not delete them, and a manifest never arrives ahead of its files.
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from test_expert_store import expert, tensors

from coe import CoEError
from edge_agent.cluster import _snapshot, _StoreWriter
from storage.expert_store import ExpertStore


def _promoted_front(tmp_path):
    """A front store whose expert was promoted once."""
    front = tmp_path / "front"
    store = ExpertStore(front)
    store.write(expert(), tensors(0))
    store.write(expert(), tensors(1), version=2)           # a versioned file of its own, as a promotion writes
    return front, store


def test_a_store_opened_on_the_node_mid_sync_keeps_the_files_and_the_manifest_comes_with_them(tmp_path):
    front = tmp_path / "front"
    store = ExpertStore(front)
    store.write(expert(), tensors(0))
    node = tmp_path / "node"
    first = _StoreWriter(str(node))
    for name, sha in _snapshot(front, "T")[1].items():
        first.put(name, (front / name).read_bytes(), sha)
    first.commit()                                         # the node serves version 1
    store.write(expert(), tensors(1), version=2)           # a promotion: a versioned file of its own
    _, files = _snapshot(front, "T")
    w = _StoreWriter(str(node))
    for name, sha in files.items():
        if w.digests().get(name) == sha:
            continue
        w.put(name, (front / name).read_bytes(), sha)
        ExpertStore(node)                                  # an actor starting now: its sweep runs on version 1's
        assert ExpertStore(node).entry("cls-a").version == 1   # manifest, and version 1 is what it serves
    assert w.commit() == 2                                 # the new file and the manifest
    got = ExpertStore(node)
    assert got.entry("cls-a").version == 2 and got.entry("cls-a").file == store.entry("cls-a").file
    assert torch.equal(got.read("cls-a")["fc.bias"], tensors(1)["fc.bias"])
    have = w.digests()
    assert all(have[n] == sha for n, sha in files.items())
    assert not list(node.glob(".sync.*"))


def test_two_syncs_into_one_node_never_write_into_each_others_files(tmp_path):
    front, _ = _promoted_front(tmp_path)
    _, files = _snapshot(front, "T")
    node = tmp_path / "node"
    a, b = _StoreWriter(str(node)), _StoreWriter(str(node))
    name = next(n for n in files if n != "manifest.json")
    data, sha = (front / name).read_bytes(), files[name]
    a.put(name, data, sha)
    b.put(name, data[: len(data) // 2], hashlib.sha256(data[: len(data) // 2]).hexdigest())   # another's bytes
    assert a.commit() == 1
    assert hashlib.sha256((node / name).read_bytes()).hexdigest() == sha   # a's file is whole, b's not mixed in


def test_the_snapshot_is_the_manifest_and_exactly_the_files_it_names(tmp_path):
    front, store = _promoted_front(tmp_path)
    (front / "notes.txt").write_text("not the store's")
    manifest, files = _snapshot(front, "T")
    named = {e["file"] for e in json.loads(manifest)["experts"]}
    assert set(files) == named | {"manifest.json"}
    for name, sha in files.items():
        assert hashlib.sha256((front / name).read_bytes()).hexdigest() == sha


def test_a_node_refuses_a_file_name_that_leaves_its_store_or_bytes_that_arrive_changed(tmp_path):
    w = _StoreWriter(str(tmp_path / "node"))
    for bad in ("../x", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="refusing store file name"):
            w.put(bad, b"x", hashlib.sha256(b"x").hexdigest())
    with pytest.raises(ValueError, match="bytes arrived corrupted"):
        w.put("x.safetensors", b"x", hashlib.sha256(b"y").hexdigest())


def test_a_front_store_without_a_readable_manifest_sends_nothing(tmp_path):
    front = tmp_path / "front"
    front.mkdir()
    with pytest.raises(CoEError, match="has no manifest.json"):
        _snapshot(front, "T")
    (front / "manifest.json").write_text("{not json")
    with pytest.raises(CoEError, match="is unreadable .*nothing was sent"):
        _snapshot(front, "T")
