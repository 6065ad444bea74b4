"""The expert store against real files: round trips, corruption, manifests, ids."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from coe import CoEError, Expert, ExpertLoadError
from storage.expert_store import ExpertStore, ManifestEntry


def expert(eid: str = "cls-a") -> Expert:
    return Expert(id=eid, arch="torchvision/resnet18", kind="classifier", classes=("ok", "bad"), input_size=32)


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(2, 64, generator=g),
        "fc.bias": torch.randn(2, generator=g),
        "bn.running_mean": torch.randn(64, generator=g),
        "bn.num_batches_tracked": torch.tensor(7, dtype=torch.int64),
    }


def replace_bytes(path: Path, data: bytes) -> None:
    """Corrupt by replacing the file, as a disk error would look to a new reader.

    Rewriting in place would also change (or, truncated, SIGBUS) tensors an
    earlier read still maps; the store itself only ever replaces files.
    """
    tmp = path.with_suffix(".corrupt")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    replace_bytes(path, bytes(data))


def test_round_trip_returns_equal_tensors(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    src = tensors()
    store.write(expert(), src)
    got = store.read("cls-a")
    assert set(got) == set(src)
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], src[k])


def test_manifest_records_hash_size_and_dtype(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    src = tensors()
    entry = store.write(expert(), src, version=3)
    path = tmp_path / "cls-a.safetensors"
    assert entry == ManifestEntry(id="cls-a", arch="torchvision/resnet18", kind="classifier",
                                  file="cls-a.safetensors", sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                  nbytes=(2 * 64 + 2 + 64) * 4 + 8, dtype="float32", version=3,
                                  stored_nbytes=path.stat().st_size, plain_nbytes=path.stat().st_size)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["experts"] == [{"id": "cls-a", "arch": "torchvision/resnet18", "kind": "classifier",
                                   "file": "cls-a.safetensors", "sha256": entry.sha256, "nbytes": entry.nbytes,
                                   "dtype": "float32", "version": 3, "compression": "none",
                                   "stored_nbytes": path.stat().st_size, "plain_nbytes": path.stat().st_size,
                                   "bound_nbytes": 0}]
    assert on_disk["version"] == 1 and on_disk["compression"] == "none"   # nothing compressed: old builds read it
    assert store.nbytes("cls-a") == entry.nbytes and store.path("cls-a") == path
    assert sorted(os.listdir(tmp_path)) == [".manifest.lock", "cls-a.safetensors", "manifest.json"]  # no temp files


def test_flipped_byte_is_a_sha256_mismatch_naming_expert_and_file(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert(), tensors())
    flip_last_byte(tmp_path / "cls-a.safetensors")
    with pytest.raises(ExpertLoadError) as err:
        store.read("cls-a")
    msg = str(err.value)
    assert "sha256 mismatch" in msg and "cls-a" in msg and "cls-a.safetensors" in msg
    assert err.value.expert_id == "cls-a" and err.value.path.endswith("cls-a.safetensors")


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert(), tensors())
    path = tmp_path / "cls-a.safetensors"
    replace_bytes(path, path.read_bytes()[:-100])
    with pytest.raises(ExpertLoadError, match="sha256"):
        store.read("cls-a")


def test_verify_never_skips_the_hash_but_still_refuses_a_truncated_file(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path, verify="never")
    src = tensors()
    store.write(expert(), src)
    path = tmp_path / "cls-a.safetensors"
    flip_last_byte(path)  # the last byte is tensor data: unverified, it loads with a changed value
    got = store.read("cls-a")
    assert not all(torch.equal(got[k], src[k]) for k in src)
    replace_bytes(path, path.read_bytes()[:-100])
    with pytest.raises(ExpertLoadError, match="truncated or corrupt safetensors"):
        store.read("cls-a")


def test_garbage_file_is_reported_as_corrupt_safetensors(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path, verify="never")
    store.write(expert(), tensors())
    replace_bytes(tmp_path / "cls-a.safetensors", b"\x80\x04not a safetensors file at all")
    with pytest.raises(ExpertLoadError, match="truncated or corrupt safetensors"):
        store.read("cls-a")


def test_verify_first_hashes_once_and_always_hashes_every_read(tmp_path: Path, monkeypatch) -> None:
    import storage.expert_store as es

    hashed = []
    real = es._sha256
    monkeypatch.setattr(es, "_sha256", lambda p: hashed.append(p) or real(p))
    first = ExpertStore(tmp_path, verify="first")
    first.write(expert(), tensors())
    always = ExpertStore(tmp_path, verify="always")
    hashed.clear()
    for _ in range(3):
        first.read("cls-a")
    assert len(hashed) == 1                        # verified once in this process: not hashed again
    always.read("cls-a")
    always.read("cls-a")
    assert len(hashed) == 3
    flip_last_byte(tmp_path / "cls-a.safetensors")
    with pytest.raises(ExpertLoadError, match="sha256"):
        always.read("cls-a")
    # a file changed since it was verified (another inode, mtime or size) is verified again
    with pytest.raises(ExpertLoadError, match="sha256"):
        first.read("cls-a")


def test_rewrite_replaces_content_and_needs_fresh_verification(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert(), tensors(0))
    store.read("cls-a")
    entry = store.write(expert(), tensors(1), version=2)
    assert entry.version == 2 and store.entry("cls-a") == entry
    assert entry.file != "cls-a.safetensors" and not (tmp_path / "cls-a.safetensors").exists()  # a file of its own
    assert torch.equal(store.read("cls-a")["fc.bias"], tensors(1)["fc.bias"])
    flip_last_byte(store.path("cls-a"))
    store2 = ExpertStore(tmp_path)
    with pytest.raises(ExpertLoadError, match="sha256"):
        store2.read("cls-a")


def test_unknown_and_missing_experts_are_load_errors(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    with pytest.raises(ExpertLoadError, match="not in the expert store"):
        store.read("nope")
    assert not store.has("nope")
    store.write(expert(), tensors())
    (tmp_path / "cls-a.safetensors").unlink()
    with pytest.raises(ExpertLoadError, match="missing"):
        store.read("cls-a")


@pytest.mark.parametrize("content, words", [
    ("{not json", ["manifest.json", "not valid JSON"]),
    ('{"format": "coe-edge/expert-store", "version": 1, "experts": {}}', ["'experts' must be a list"]),
    ('{"format": "coe-edge/expert-store", "version": 1, "experts": [{"id": "x"}]}', ["experts[0]", "missing 'arch'"]),
    ('{"format": "coe-edge/expert-store", "version": 99, "experts": []}', ["version 99"]),
    ('[]', ["manifest.json", "format"]),
])
def test_malformed_manifest_is_a_coe_error_naming_file_and_reason(tmp_path: Path, content: str,
                                                                  words: list[str]) -> None:
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(CoEError) as err:
        ExpertStore(tmp_path)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("bad_id", ["../evil", "a/b", "a\\b", "..", ".hidden", ""])
def test_path_escaping_ids_are_refused(tmp_path: Path, bad_id: str) -> None:
    store = ExpertStore(tmp_path / "store")
    with pytest.raises(CoEError, match="cannot name a store file"):
        store.write(expert(bad_id), tensors())
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["store"]


def test_manifest_file_escaping_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = ExpertStore(root)
    store.write(expert(), tensors())
    doc = json.loads((root / "manifest.json").read_text())
    doc["experts"][0]["file"] = "../outside.safetensors"
    (root / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CoEError, match="not a file directly inside the store root"):
        ExpertStore(root)


def test_reopened_store_sees_the_entries(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    a = store.write(expert("cls-a"), tensors(0))
    b = store.write(expert("cls-b"), tensors(1))
    again = ExpertStore(tmp_path)
    assert again.entries() == [a, b]
    assert torch.equal(again.read("cls-b")["fc.weight"], tensors(1)["fc.weight"])


def test_two_stores_on_one_root_do_not_lose_each_others_entries(tmp_path: Path) -> None:
    one, two = ExpertStore(tmp_path), ExpertStore(tmp_path)
    one.write(expert("cls-a"), tensors(0))
    two.write(expert("cls-b"), tensors(1))  # re-reads the manifest before rewriting it
    assert [e.id for e in ExpertStore(tmp_path).entries()] == ["cls-a", "cls-b"]
    assert not one.has("cls-b")
    one.reload()
    assert one.has("cls-b")


def test_unknown_verify_policy_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CoEError, match="verify"):
        ExpertStore(tmp_path, verify="sometimes")


def test_same_tensors_give_the_same_file(tmp_path: Path) -> None:
    """Content hashes are stable: rewriting identical tensors must not change the sha256."""
    store = ExpertStore(tmp_path)
    shas = {store.write(expert(), tensors(0)).sha256 for _ in range(5)}
    assert len(shas) == 1
    assert store.write(expert(), tensors(1)).sha256 not in shas


@pytest.mark.parametrize("compression", ["none", "exponent-zstd"])
def test_write_many_switches_a_set_of_experts_in_one_manifest_write(tmp_path: Path, compression: str) -> None:
    store = ExpertStore(tmp_path)
    if compression != "none":
        store.set_compression(compression)
    for eid in ("cls-a", "det-b"):
        store.write(expert(eid), tensors(0), version=1)
    reader = ExpertStore(tmp_path)                        # another process's view, loaded before the change
    before = {eid: reader.read(eid)["fc.weight"].clone() for eid in ("cls-a", "det-b")}
    old_files = {e.file for e in store.entries()}
    out = store.write_many([(expert("cls-a"), tensors(1), 2), (expert("det-b"), tensors(2), 2)])
    assert [e.version for e in out] == [2, 2]
    assert not any((tmp_path / f).exists() for f in old_files)          # the old files went after the switch
    assert not list(tmp_path.glob(".*.tmp"))
    fresh = ExpertStore(tmp_path)
    assert {e.id: e.version for e in fresh.entries()} == {"cls-a": 2, "det-b": 2}
    assert torch.equal(fresh.read("cls-a")["fc.weight"], tensors(1)["fc.weight"])
    # the stale reader finds its file gone, re-reads the manifest and gets the new set, labelled as such
    assert torch.equal(reader.read("det-b")["fc.weight"], tensors(2)["fc.weight"])
    assert reader.entry("det-b").version == 2 and reader.entry("cls-a").version == 2
    assert torch.equal(before["det-b"], tensors(0)["fc.weight"])      # what it read before was the old set


@pytest.mark.parametrize("how", ["read", "read_flat", "layout"])
def test_a_read_that_loses_the_race_with_a_promotion_is_retried_on_the_new_entry(tmp_path: Path, how: str) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    reader = ExpertStore(tmp_path)
    stale = reader.entry("cls-a")
    real = reader._current
    calls = []

    def checked_then_unlinked(eid, entry=None):   # the file was there when checked, gone when opened
        calls.append(eid)
        if len(calls) == 1:
            return stale, tmp_path / stale.file
        return real(eid, entry)
    reader._current = checked_then_unlinked
    reader._existing = lambda entry: tmp_path / entry.file
    store.write_many([(expert("cls-a"), tensors(1), 2)])
    assert not (tmp_path / stale.file).exists()
    got = getattr(reader, how)("cls-a")
    if how == "layout":
        assert got.nbytes == reader.layout("cls-a").nbytes
    else:
        weights = got if how == "read" else got.tensors()
        assert torch.equal(weights["fc.weight"], tensors(1)["fc.weight"])
    assert reader.entry("cls-a").version == 2


def test_a_write_many_that_fails_part_way_changes_nothing(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    manifest = store.manifest_path.read_bytes()
    with pytest.raises(CoEError, match="refusing to store an expert with no tensors"):
        store.write_many([(expert("cls-a"), tensors(1), 2), (expert("det-b"), {}, 1)])
    assert store.manifest_path.read_bytes() == manifest and not list(tmp_path.glob(".*.tmp"))
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["cls-a.safetensors"]
    with pytest.raises(CoEError, match="named twice in one change: cls-a"):
        store.write_many([(expert("cls-a"), tensors(1), 2), (expert("cls-a"), tensors(2), 3)])


def test_files_a_crashed_write_many_left_unrecorded_are_swept_on_open(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    kept = store.write_many([(expert("cls-a"), tensors(0), 1)])[0].file
    orphan = tmp_path / "det-b.v2-0a1b2c.safetensors"          # renamed into place, manifest never written
    orphan.write_bytes(b"x")
    mine = tmp_path / "notes.v1-000000.txt"                    # not the store's pattern: left alone
    mine.write_bytes(b"y")
    ExpertStore(tmp_path)
    assert not orphan.exists() and (tmp_path / kept).exists() and mine.exists()


def test_a_promotion_keeps_the_old_files_a_live_reader_needs_until_it_has_switched(tmp_path: Path) -> None:
    """An agent (a registered reader) finishes frames in flight on the old versions after the manifest switched."""
    store = ExpertStore(tmp_path)
    for eid in ("cls-a", "det-b"):
        store.write(expert(eid), tensors(0), version=1)
    agent = ExpertStore(tmp_path)
    agent.register_reader()
    old = {e.id: e.file for e in agent.entries()}
    store.write_many([(expert("cls-a"), tensors(1), 2), (expert("det-b"), tensors(2), 2)])
    assert all((tmp_path / f).is_file() for f in old.values())            # kept: a live reader may need them
    assert sorted(json.loads(store.manifest_path.read_text())["retired"]) == sorted(old.values())
    # the agent has not switched: it still reads version 1, from the kept files, with no reload behind its back
    assert torch.equal(agent.read("det-b")["fc.weight"], tensors(0)["fc.weight"])
    assert agent.read_flat("cls-a").version == 1 and agent.entry("det-b").version == 1
    assert agent.release_retired() == 0                                  # its own entries still name them...
    assert all((tmp_path / f).is_file() for f in old.values())            # ...so they stay
    agent.reload()                                                        # the switch
    assert agent.release_retired() == 2
    assert not any((tmp_path / f).exists() for f in old.values())
    assert "retired" not in json.loads(store.manifest_path.read_text())
    assert torch.equal(agent.read("det-b")["fc.weight"], tensors(2)["fc.weight"])
    agent.close_reader()
    assert not list((tmp_path / ".readers").iterdir())


def test_retired_files_stay_while_another_reader_lives_and_go_with_no_reader(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    a, b = ExpertStore(tmp_path), ExpertStore(tmp_path)
    a.register_reader()
    b.register_reader()
    first = store.entry("cls-a").file
    store.write_many([(expert("cls-a"), tensors(1), 2)])
    a.reload()
    assert a.release_retired() == 0 and (tmp_path / first).is_file()     # b has not switched yet
    b.close_reader()                                                      # b stopped
    assert a.release_retired() == 1 and not (tmp_path / first).exists()
    a.close_reader()
    second = store.entry("cls-a").file
    store.write_many([(expert("cls-a"), tensors(2), 3)])                  # no reader: the old file goes at once
    assert not (tmp_path / second).exists() and "retired" not in json.loads(store.manifest_path.read_text())


def test_a_killed_reader_does_not_keep_old_files(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    code = ("import sys, time; sys.path.insert(0, %r); from storage.expert_store import ExpertStore; "
            "s = ExpertStore(%r); s.register_reader(); print('up', flush=True); time.sleep(60)"
            % (str(Path(__file__).resolve().parents[1]), str(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        first = store.entry("cls-a").file
        store.write_many([(expert("cls-a"), tensors(1), 2)])
        assert (tmp_path / first).is_file()                               # a live reader: kept
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        ExpertStore(tmp_path)                                             # the next open finds no live reader
        assert not (tmp_path / first).exists()
        assert not list((tmp_path / ".readers").glob("*.lock"))           # the dead reader's lock file went too
        assert "retired" not in json.loads(store.manifest_path.read_text())
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("retired, error", [
    ("x.safetensors", "retired: malformed expert store manifest: must be a list of file names"),
    ([3], "retired: malformed expert store manifest: must be a list of file names"),
    (["../x.safetensors"], r"retired\[0\]\.file: '../x.safetensors' is not a file directly inside"),
])
def test_a_malformed_retired_list_is_a_clear_error(tmp_path: Path, retired, error: str) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    doc = json.loads(store.manifest_path.read_text())
    doc["retired"] = retired
    store.manifest_path.write_text(json.dumps(doc))
    with pytest.raises(CoEError, match=error):
        ExpertStore(tmp_path)


@pytest.mark.parametrize("verify", ["first", "never"])
def test_write_of_a_held_expert_leaves_the_live_file_to_a_reader_and_retires_it(tmp_path: Path, verify: str) -> None:
    """`write` (imports, zoo rebuilds, twins) of a new version never replaces the file a live reader serves."""
    ExpertStore(tmp_path).write(expert("cls-a"), tensors(0), version=1)
    agent = ExpertStore(tmp_path, verify=verify, reader=True)
    assert agent.read_flat("cls-a").version == 1
    first = agent.entry("cls-a").file
    writer = ExpertStore(tmp_path)
    second = writer.write(expert("cls-a"), tensors(1), version=2)
    # the agent has not switched: version 1's bytes, named version 1 (never version 2's bytes under v1)
    flat = agent.read_flat("cls-a")
    assert flat.version == 1 and torch.equal(flat.tensors()["fc.weight"], tensors(0)["fc.weight"])
    assert torch.equal(agent.read("cls-a")["fc.weight"], tensors(0)["fc.weight"])
    assert second.file != first and (tmp_path / first).is_file() and writer.retired == [first]
    agent.reload()                                                        # its switch
    assert agent.release_retired() == 1 and not (tmp_path / first).exists()
    assert agent.read_flat("cls-a").version == 2
    third = writer.write(expert("cls-a"), tensors(2), version=3)          # and again: never a reused name
    assert len({first, second.file, third.file}) == 3
    agent.close_reader()


def test_a_reader_whose_file_went_reads_the_new_entry_without_switching_the_set(tmp_path: Path) -> None:
    """A reader follows a new manifest only through `reload` (its watcher's switch), not behind a failed read."""
    store = ExpertStore(tmp_path)
    for eid in ("cls-a", "det-b"):
        store.write(expert(eid), tensors(0), version=1)
    agent = ExpertStore(tmp_path, reader=True)
    old = agent.entry("cls-a").file
    store.write_many([(expert("cls-a"), tensors(1), 2), (expert("det-b"), tensors(2), 2)])
    (tmp_path / old).unlink()                     # gone anyway (an older build's promote did not keep it)
    got = agent.read_flat("cls-a")
    assert got.version == 2 and torch.equal(got.tensors()["fc.weight"], tensors(1)["fc.weight"])  # named as what ran
    assert torch.equal(agent.read("cls-a")["fc.weight"], tensors(1)["fc.weight"])
    assert agent.entry("cls-a").version == 1 and agent.entry("det-b").version == 1      # the set has not switched
    assert agent.read_flat("det-b").version == 1                          # its frames in flight stay on v1
    agent.reload()
    assert agent.entry("det-b").version == 2 and agent.read_flat("det-b").version == 2
    agent.close_reader()


def _files(root: Path) -> set[str]:
    return {p.name for p in root.glob("*.safetensors")}


def test_retired_files_go_once_every_live_reader_has_switched_past_them(tmp_path: Path) -> None:
    """Two agents on one store, several promotions: the last to switch removes the files; none pile up."""
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    a, b = ExpertStore(tmp_path, reader=True), ExpertStore(tmp_path, reader=True)
    for version in (2, 3, 4):
        before = store.entry("cls-a").file
        store.write_many([(expert("cls-a"), tensors(version), version)])
        a.reload()                                                        # a switches first
        assert a.release_retired() == 0 and (tmp_path / before).is_file()  # b still serves the old version
        assert b.read_flat("cls-a").version == version - 1
        b.reload()
        assert b.release_retired() == 1 and not (tmp_path / before).exists()
        assert _files(tmp_path) == {store.entry("cls-a").file} and ExpertStore(tmp_path).retired == []
    # no one releases: the next promotion removes what every live reader has passed, and keeps what it retires
    a.reload(), b.reload()
    kept = store.entry("cls-a").file
    store.write_many([(expert("cls-a"), tensors(5), 5)])
    a.reload(), b.reload()
    last = store.entry("cls-a").file
    store.write_many([(expert("cls-a"), tensors(6), 6)])
    assert not (tmp_path / kept).exists() and (tmp_path / last).is_file() and store.retired == [last]
    a.close_reader(), b.close_reader()


def test_a_dead_reader_counts_as_switched(tmp_path: Path) -> None:
    """A reader's lock file whose lock is free (its process died) holds back nothing, and goes too."""
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    a = ExpertStore(tmp_path, reader=True)
    readers = tmp_path / ".readers"
    (readers / "4242-deadbeef.lock").write_text("0\n")       # what a SIGKILLed reader on generation 0 leaves
    first = store.entry("cls-a").file
    store.write_many([(expert("cls-a"), tensors(1), 2)])
    assert (tmp_path / first).is_file()                      # a is live and has not switched
    a.reload()
    assert a.release_retired() == 1 and not (tmp_path / first).exists()
    assert [p.name for p in readers.glob("*.lock")] == [a._reader.name]
    a.close_reader()


def test_a_reader_records_the_generation_it_serves(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    agent = ExpertStore(tmp_path, reader=True)
    lock = tmp_path / ".readers" / agent._reader.name
    assert agent.generation == json.loads(store.manifest_path.read_text())["generation"] == 1
    assert lock.read_text() == "1\n"
    store.write_many([(expert("cls-a"), tensors(1), 2)])
    doc = json.loads(store.manifest_path.read_text())
    assert doc["generation"] == 2 and doc["retired_in"] == {doc["retired"][0]: 2}
    assert lock.read_text() == "1\n"                          # not switched yet
    agent.reload()
    assert lock.read_text() == "2\n" and agent.generation == 2
    agent.close_reader()


@pytest.mark.parametrize("key, value, error", [
    ("generation", -1, "generation: malformed expert store manifest: must be a non-negative integer"),
    ("generation", "2", "generation: malformed expert store manifest"),
    ("retired_in", ["x"], "retired_in: malformed expert store manifest: must map file names to generations"),
    ("retired_in", {"x": "2"}, "retired_in: malformed expert store manifest"),
])
def test_a_malformed_generation_is_a_clear_error(tmp_path: Path, key: str, value, error: str) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert("cls-a"), tensors(0), version=1)
    doc = json.loads(store.manifest_path.read_text())
    doc[key] = value
    store.manifest_path.write_text(json.dumps(doc))
    with pytest.raises(CoEError, match=error) as err:
        ExpertStore(tmp_path)
    assert "manifest.json" in str(err.value)


def test_a_header_whose_shape_disagrees_with_its_bytes_is_named(tmp_path: Path) -> None:
    """Unverified (or written badly and hashed as written): a tensor whose shape needs other bytes than its offsets
    span must fail at the read, naming the expert, the file and the tensor, not at the first batch in torch."""
    import json
    import struct

    store = ExpertStore(tmp_path, verify="never")
    store.write(expert(), tensors())
    header = json.dumps({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 8]}}).encode()
    replace_bytes(tmp_path / "cls-a.safetensors", struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ExpertLoadError, match=r"cls-a.*tensor 'w' of shape \[3, 4\] float32 needs 48 bytes, its "
                                              r"offsets span 8") as err:
        store.read_flat("cls-a")
    assert err.value.path.endswith("cls-a.safetensors")
