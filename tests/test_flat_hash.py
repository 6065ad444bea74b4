"""A verified read hashes its pieces on a helper thread while it reads the next one (`storage.flat._HashBehind`).

What must hold however the hashing is scheduled: the digest is the file's
(pieces in order), a byte changed anywhere is caught, and no hashing thread
outlives its read, whether the read ends, fails or gives way.
"""
from __future__ import annotations

import hashlib
import threading

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402

from coe import ExpertLoadError  # noqa: E402
from storage import flat  # noqa: E402
from storage.flat import ReadYielded, read_flat, yield_to  # noqa: E402


_SHA256 = hashlib.sha256       # the real one: the tests patch `hashlib.sha256`, which is this module's too


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "coe-hash"]


@pytest.fixture()
def expert(tmp_path):
    """A 3.5 MiB expert: four hash pieces, the last one short."""
    path = tmp_path / "e.safetensors"
    save_file({"a": torch.arange(2**20 // 4, dtype=torch.float32),
               "b": torch.arange(5 * 2**20 // 8, dtype=torch.float32) * -1.5}, str(path))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


class _Recorded:
    """sha256 that notes which thread hashed each piece, and how big it was."""

    def __init__(self, head: bytes, log: list) -> None:
        self._h, self._log = _SHA256(head), log

    def update(self, piece) -> None:
        self._log.append((threading.current_thread().name, len(piece)))
        self._h.update(piece)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@pytest.mark.parametrize("method", ["read", "mmap"])
def test_a_verified_read_of_many_pieces_hashes_them_on_the_helper_thread_in_order(expert, method, monkeypatch):
    path, digest = expert
    plain = read_flat(path, "e", method=method)
    assert plain.nbytes > 3 * flat._HASH_CHUNK                      # more than one piece: hashed behind
    log: list = []
    monkeypatch.setattr(flat.hashlib, "sha256", lambda head=b"": _Recorded(head, log))
    verified = read_flat(path, "e", method=method, expect_sha256=digest)
    assert torch.equal(verified.buffer, plain.buffer)
    assert {name for name, _ in log} == {"coe-hash"}                # every piece on the helper, none inline
    assert sum(n for _, n in log) == plain.nbytes and max(n for _, n in log) == flat._HASH_CHUNK
    assert not _hash_threads()


@pytest.mark.parametrize("method", ["read", "mmap"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_byte_changed_in_any_piece_is_caught(expert, method, where):
    path, digest = expert
    raw = bytearray(path.read_bytes())
    at = {"first": len(raw) - read_flat(path, "e").nbytes + 7,      # inside the data section, first piece
          "middle": len(raw) // 2, "last": len(raw) - 3}[where]
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(ExpertLoadError, match="sha256 mismatch"):
        read_flat(path, "e", method=method, expect_sha256=digest)
    assert not _hash_threads()


@pytest.mark.parametrize("method", ["read", "mmap"])
def test_a_verified_read_that_gives_way_midway_leaves_no_hash_thread(expert, method):
    path, digest = expert
    checks = []

    def third_check():
        checks.append(1)
        return len(checks) > 2
    with yield_to(third_check), pytest.raises(ReadYielded):
        read_flat(path, "e", method=method, expect_sha256=digest)
    assert len(checks) == 3 and not _hash_threads()                 # it stopped between pieces, thread joined
    same = read_flat(path, "e", method=method, expect_sha256=digest)
    assert torch.equal(same.buffer, read_flat(path, "e").buffer)


class _FailsOnSecond(_Recorded):
    def update(self, piece) -> None:
        super().update(piece)
        if len(self._log) == 2:
            raise MemoryError("no room to hash")


def test_a_hasher_failing_on_the_helper_thread_fails_the_read_but_never_hides_a_give_way(expert, monkeypatch):
    path, digest = expert
    log: list = []
    monkeypatch.setattr(flat.hashlib, "sha256", lambda head=b"": _FailsOnSecond(head, log))
    with pytest.raises(MemoryError, match="no room"):
        read_flat(path, "e", expect_sha256=digest)
    assert len(log) == 2 and not _hash_threads()                    # it stopped hashing after the failure
    # a read that gives way while the hasher has failed: the caller sees the give-way it handles
    log.clear()
    checks = []

    def fourth_check():
        checks.append(1)
        return len(checks) > 3
    with yield_to(fourth_check), pytest.raises(ReadYielded):
        read_flat(path, "e", expect_sha256=digest)
    assert not _hash_threads()


def test_the_helper_thread_stops_at_the_first_failure():
    class Broken:
        calls = 0

        def update(self, piece) -> None:
            Broken.calls += 1
            if Broken.calls == 2:
                raise MemoryError("no room to hash")

    behind = flat._HashBehind(Broken())
    for _ in range(4):
        behind.update(b"x" * 10)
    with pytest.raises(MemoryError, match="no room"):
        behind.finish()
    assert Broken.calls == 2 and not _hash_threads()                # it stopped hashing after the failure
