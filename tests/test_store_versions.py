"""A version names one set of bytes: writers with a stale view, or the default version, never reuse one; a
rewrite in another encoding never undoes a promotion; a store without its manifest keeps its files.

Real expert stores on real files; two `ExpertStore` objects on one root stand for two processes (the agent and a
CLI), as `tests/test_expert_store.py` does.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from test_expert_store import expert, tensors

from storage.expert_store import ChangedOnDisk, ExpertStore


def test_a_writer_with_a_stale_view_gets_a_version_above_the_disks(tmp_path: Path) -> None:
    stale = ExpertStore(tmp_path)
    stale.write(expert(), tensors(0))                                   # v1
    ExpertStore(tmp_path).write(expert(), tensors(1), version=2)        # another process promotes: v2
    got = stale.write(expert(), tensors(2), version=stale.entry("cls-a").version + 1)   # it thinks 1 -> 2
    assert got.version == 3
    fresh = ExpertStore(tmp_path)
    assert fresh.entry("cls-a").version == 3
    assert torch.equal(fresh.read("cls-a")["fc.bias"], tensors(2)["fc.bias"])


def test_new_bytes_under_the_default_version_are_a_new_version_and_the_same_bytes_are_not(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    first = store.write(expert(), tensors(0))
    assert store.write(expert(), tensors(0)).version == first.version == 1     # the same bytes: the same version
    again = ExpertStore(tmp_path).write(expert(), tensors(1))                  # a zoo rebuilt, a re-import
    assert again.version == 2 and ExpertStore(tmp_path).entry("cls-a").sha256 == again.sha256


@pytest.mark.parametrize("compression", ["exponent-zstd", "none"])
def test_a_rewrite_in_another_encoding_never_undoes_a_promotion_that_lands_meanwhile(tmp_path: Path,
                                                                                      compression: str) -> None:
    base = ExpertStore(tmp_path)
    if compression == "none":          # decompressing: start from a compressed store
        base.set_compression("exponent-zstd")
    base.write(expert(), tensors(0))
    comp = ExpertStore(tmp_path)
    comp.set_compression(compression)
    promoted = []
    encode = comp._compressed if compression != "none" else None
    real_sha = comp._existing

    def promote_once() -> None:
        if not promoted:                # lands after the rewrite read the old file, before it is installed
            promoted.append(ExpertStore(tmp_path).write(expert(), tensors(1), version=2))

    if encode is not None:
        def racing(*a, **k):
            out = encode(*a, **k)
            promote_once()
            return out
        comp._compressed = racing
    else:
        def racing_existing(entry):
            path = real_sha(entry)
            promote_once()
            return path
        comp._existing = racing_existing
    got = comp.recompress("cls-a")
    assert promoted and got.version == 2 and got.compression == compression
    fresh = ExpertStore(tmp_path)
    assert fresh.entry("cls-a").version == 2 and fresh.entry("cls-a").sha256 == promoted[0].sha256
    assert torch.equal(fresh.read("cls-a")["fc.bias"], tensors(1)["fc.bias"])


def test_a_rewrite_that_loses_its_last_race_says_so_and_replaces_nothing(tmp_path: Path) -> None:
    ExpertStore(tmp_path).write(expert(), tensors(0))
    comp = ExpertStore(tmp_path)
    comp.set_compression("exponent-zstd")
    encode = comp._compressed

    def racing(*a, **k):
        out = encode(*a, **k)
        ExpertStore(tmp_path).write(expert(), tensors(1), version=2)   # a promotion lands meanwhile
        return out
    comp._compressed = racing
    with pytest.raises(ChangedOnDisk, match="cls-a: changed on disk while being rewritten .was version 1, now "
                                            "version 2.; not replaced"):
        comp.recompress("cls-a", attempts=1)
    fresh = ExpertStore(tmp_path)
    assert fresh.entry("cls-a").version == 2
    assert torch.equal(fresh.read("cls-a")["fc.bias"], tensors(1)["fc.bias"])
    assert not list(tmp_path.glob(".*.tmp"))


def test_opening_a_store_whose_manifest_is_not_there_yet_deletes_no_file(tmp_path: Path) -> None:
    store = ExpertStore(tmp_path)
    store.write(expert(), tensors(0))
    store.write(expert(), tensors(1), version=2)           # a versioned file of its own
    promoted = tmp_path / store.entry("cls-a").file
    aside = tmp_path.parent / "manifest.aside"
    shutil.move(tmp_path / "manifest.json", aside)        # a copy or restore that has not reached it yet
    ExpertStore(tmp_path)
    shutil.move(aside, tmp_path / "manifest.json")
    assert promoted.exists()
    assert torch.equal(ExpertStore(tmp_path).read("cls-a")["fc.bias"], tensors(1)["fc.bias"])


def test_two_writers_of_a_new_expert_never_share_its_file(tmp_path: Path) -> None:
    """Both saw no such expert and chose the plain name: the second gets a file (and a version) of its own, so
    the first writer's entry never names bytes it did not write."""
    a, b = ExpertStore(tmp_path), ExpertStore(tmp_path)
    first = a.write(expert(), tensors(0))
    b._holds = lambda eid: False                        # b looked before a wrote: the expert was new to it
    second = b.write(expert(), tensors(1))
    assert first.file == "cls-a.safetensors" and second.file != first.file and second.version == 2
    fresh = ExpertStore(tmp_path)
    assert fresh.entry("cls-a") == second
    assert torch.equal(fresh.read("cls-a")["fc.bias"], tensors(1)["fc.bias"])


def test_temp_files_a_killed_writer_left_go_at_the_next_open_and_a_live_writers_stay(tmp_path: Path) -> None:
    import os

    ExpertStore(tmp_path).write(expert(), tensors(0))
    gone_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1   # no process can have it
    old = 1_000_000_000                                    # 2001: untouched for long
    leftovers = [tmp_path / f".cls-b.safetensors.{gone_pid}.0badc0de.tmp", tmp_path / f".big.safetensors.{gone_pid}.tmp"]
    fresh = tmp_path / f".cls-c.safetensors.{gone_pid}.0badc0df.tmp"      # just written: may be another namespace's
    live = tmp_path / f".cls-d.safetensors.{os.getpid()}.0badc0e0.tmp"     # this process is alive
    for p in (*leftovers, fresh, live):
        p.write_bytes(b"x" * 1000)
    for p in (*leftovers, live):
        os.utime(p, (old, old))
    ExpertStore(tmp_path)
    assert [p.exists() for p in leftovers] == [False, False] and fresh.exists() and live.exists()
    assert torch.equal(ExpertStore(tmp_path).read("cls-a")["fc.bias"], tensors(0)["fc.bias"])


def test_a_plain_name_a_retired_file_still_has_is_never_written_over(tmp_path: Path) -> None:
    """cls-a.safetensors was version 1's file; a promotion retired it while a reader still maps it.  A writer
    that saw no such expert (plain name) must not replace that file: the reader would read other bytes."""
    first = ExpertStore(tmp_path)
    first.write(expert(), tensors(0))
    reader = ExpertStore(tmp_path, reader=True)              # a live agent, still on version 1
    ExpertStore(tmp_path).write(expert(), tensors(1), version=2)
    plain = tmp_path / "cls-a.safetensors"
    kept = plain.read_bytes()
    late = ExpertStore(tmp_path)
    late._holds = lambda eid: False                          # it looked before the expert existed
    got = late.write(expert(), tensors(2))
    assert got.file != "cls-a.safetensors" and got.version == 3
    assert plain.read_bytes() == kept                        # the reader's file is as it was
    assert torch.equal(ExpertStore(tmp_path).read("cls-a")["fc.bias"], tensors(2)["fc.bias"])
    reader.close_reader()
