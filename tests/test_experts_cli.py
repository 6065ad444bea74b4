"""`coe-agent experts ...` against a real store of real models (the tiny zoo), through CliRunner."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result

from coe import Expert
from edge_agent.cli import cli
from storage.expert_store import ExpertStore
from storage.pagecache import resident_fraction

from conftest import TINY_SPEC, load_json_lines

IDS = [e["id"] for e in TINY_SPEC["experts"]]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, ["experts", *args])


def store_of(config: Path) -> ExpertStore:
    return ExpertStore(yaml.safe_load(config.read_text())["expert_store"])


def row(output: str, expert_id: str) -> list[str]:
    found = [line.split() for line in output.splitlines() if line.split()[:1] == [expert_id]]
    assert len(found) == 1, (expert_id, output)
    return found[0]


def test_every_experts_command_has_an_example():
    from edge_agent.experts_cli import experts

    assert sorted(experts.commands) == ["compress", "evict", "export-onnx", "import", "ls", "promote", "sync", "verify", "warm"]
    for name in experts.commands:
        res = CliRunner().invoke(cli, ["experts", name, "--help"])
        assert res.exit_code == 0 and "Example:" in res.output and f"coe-agent experts {name}" in res.output


def test_importing_experts_cli_first_has_no_cycle():
    code = ("import edge_agent.experts_cli as m, edge_agent.cli as c; "
            "assert c.cli.commands['experts'] is m.experts and len(m.experts.commands) == 9")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_ls_lists_spec_experts_with_sizes_and_flags_missing_and_extra(tiny_line):
    store = store_of(tiny_line)
    res = run("ls", "--config", str(tiny_line))
    assert res.exit_code == 0, res.output
    for eid in IDS:
        cols = row(res.output, eid)
        entry = store.entry(eid)
        assert cols[3] == f"{entry.nbytes / 1e6:.1f}" and cols[9] == entry.sha256[:12] and cols[-1] == "ok"
        assert cols[6] == "plain" and cols[5] == f"{entry.stored_nbytes / 1e6:.1f}"
    total = sum(store.entry(e).nbytes for e in IDS) / 1e6
    assert f"6 experts in spec (0 missing), {total:.1f} MB stored" in res.output
    assert "1 x cpu 20.0 MB" in res.output and "do not all fit" in res.output

    # remove one expert from the store; add one the spec does not know
    manifest = json.loads(store.manifest_path.read_text())
    manifest["experts"] = [e for e in manifest["experts"] if e["id"] != "det-ic"]
    store.manifest_path.write_text(json.dumps(manifest))
    (store.root / "det-ic.safetensors").unlink()
    old = Expert(id="cls-old", arch="torchvision/mobilenet_v3_small", kind="classifier", classes=("ok", "bad"),
                 input_size=32)
    ExpertStore(store.root).write(old, {"w": torch.zeros(4)})

    res = run("ls", "--config", str(tiny_line))
    assert res.exit_code == 0, res.output
    assert row(res.output, "det-ic")[-1] == "MISSING"
    assert row(res.output, "cls-old")[-3:] == ["not", "in", "spec"]
    assert "6 experts in spec (1 missing)" in res.output
    recs = {r["id"]: r for r in load_json_lines(run("ls", "--config", str(tiny_line), "--json").output)}
    assert set(recs) == {*IDS, "cls-old"} and recs["det-ic"]["status"] == "MISSING"
    assert recs["cls-r0402"]["nbytes"] == store.entry("cls-r0402").nbytes


def test_verify_passes_then_names_the_expert_and_file_with_a_flipped_byte(tiny_line):
    res = run("verify", "--config", str(tiny_line))
    assert res.exit_code == 0, res.output
    assert [line.split()[1] for line in res.output.splitlines() if line.startswith("OK")] == IDS

    store = store_of(tiny_line)
    path = store.path("cls-c0402")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)  # as a new reader sees a disk error; never rewrite a file someone may map

    res = run("verify", "--config", str(tiny_line))
    assert res.exit_code == 1
    failed = [line for line in res.output.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "cls-c0402" in failed[0] and str(path) in failed[0] and "sha256 mismatch" in failed[0]
    assert "1 of 6 expert(s) failed verification" in res.output
    assert run("verify", "--config", str(tiny_line), "cls-r0402", "det-ic").exit_code == 0  # only the named


def test_verify_builds_each_expert_against_the_spec(tiny_line):
    spec_path = tiny_line.parent / "tiny.coe.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    spec["experts"][-1]["classes"] = ["solder_bridge", "lifted_lead", "cold_joint"]  # det-ic now wants 3 classes
    spec_path.write_text(yaml.safe_dump(spec))
    res = run("verify", "--config", str(tiny_line))
    assert res.exit_code == 1
    failed = [line for line in res.output.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "det-ic" in failed[0] and "weights do not fit" in failed[0]


def test_evict_then_warm_moves_files_out_of_and_into_the_page_cache(tiny_line):
    store = store_of(tiny_line)
    files = [store.path(e) for e in IDS]
    if resident_fraction(files[0]) is None:
        pytest.skip("page-cache residency cannot be measured on this platform")

    def resident() -> float:
        sizes = [p.stat().st_size for p in files]
        return sum(resident_fraction(p) * s for p, s in zip(files, sizes)) / sum(sizes)

    res = run("evict", "--config", str(tiny_line))
    assert res.exit_code == 0 and "evicted 6 expert file(s)" in res.output, res.output
    cold = resident()
    res = run("warm", "--config", str(tiny_line))
    total = sum(p.stat().st_size for p in files)
    assert res.exit_code == 0 and f"warmed 6 expert file(s): {total} bytes" in res.output, res.output
    warm = resident()
    assert warm > 0.99
    res = run("evict", "--config", str(tiny_line), "det-2term")
    assert res.exit_code == 0 and "evicted 1 expert file(s)" in res.output
    assert resident_fraction(store.path("det-2term")) < warm and resident_fraction(store.path("det-ic")) > 0.99
    assert cold < warm
    assert run("warm", "--config", str(tiny_line), "nope").exit_code == 1


def test_import_end_to_end(tiny_line, tmp_path):
    from executors.backends import get_backend

    store = store_of(tiny_line)
    before = store.entry("cls-r0402")
    expert = Expert(id="cls-r0402", arch="torchvision/mobilenet_v3_small", kind="classifier",
                    classes=("ok", "missing", "misaligned", "wrong_part"), input_size=32)
    weights = get_backend(expert.arch).init_weights(expert, seed=99)
    src = tmp_path / "trained.pt"
    torch.save({"state_dict": weights}, src)

    res = run("import", "--config", str(tiny_line), "cls-r0402", str(src))
    assert res.exit_code == 1 and "pass --trust" in res.output
    assert store_of(tiny_line).entry("cls-r0402") == before

    res = run("import", "--config", str(tiny_line), "cls-r0402", str(src), "--trust")
    assert res.exit_code == 0, res.output
    entry = store_of(tiny_line).entry("cls-r0402")
    assert entry.version == before.version + 1 and f"version {entry.version}" in res.output
    assert entry.sha256[:12] in res.output and entry.sha256 != before.sha256
    got = store_of(tiny_line).read("cls-r0402")
    assert all(torch.equal(got[k], v) for k, v in weights.items()) and sorted(got) == sorted(weights)

    res = run("import", "--config", str(tiny_line), "cls-new", str(src), "--trust")
    assert res.exit_code == 1 and "not in the spec" in res.output
    assert run("verify", "--config", str(tiny_line), "cls-r0402").exit_code == 0


def test_missing_store_says_how_to_build_it(tiny_line, tmp_path):
    cfg = yaml.safe_load(tiny_line.read_text())
    cfg["expert_store"] = str(tmp_path / "nowhere")
    tiny_line.write_text(yaml.safe_dump(cfg))
    res = run("verify", "--config", str(tiny_line))
    assert res.exit_code == 1 and "coe-agent zoo build" in res.output
    res = run("ls", "--config", str(tiny_line))
    assert res.exit_code == 0 and all(row(res.output, e)[-1] == "MISSING" for e in IDS)
    assert not (tmp_path / "nowhere").exists()  # looking does not create a store


def test_import_with_dtype_stores_and_records_it(tiny_line, tmp_path):
    from safetensors.torch import save_file

    from executors.backends import get_backend

    expert = Expert(id="cls-r0402", arch="torchvision/mobilenet_v3_small", kind="classifier",
                    classes=("ok", "missing", "misaligned", "wrong_part"), input_size=32)
    weights = get_backend(expert.arch).init_weights(expert, seed=99)
    src = tmp_path / "trained.safetensors"
    save_file(weights, str(src))

    res = run("import", "--config", str(tiny_line), "cls-r0402", str(src), "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert "bfloat16" in res.output
    entry = store_of(tiny_line).entry("cls-r0402")
    assert entry.dtype == "bfloat16"
    got = store_of(tiny_line).read("cls-r0402")
    assert all(torch.equal(got[k], v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in weights.items())
    assert row(run("ls", "--config", str(tiny_line)).output, "cls-r0402")[4] == "bfloat16"
    assert run("verify", "--config", str(tiny_line), "cls-r0402").exit_code == 0

    res = run("import", "--config", str(tiny_line), "cls-r0402", str(src), "--dtype", "int8")
    assert res.exit_code == 2 and "'int8' is not one of 'fp32', 'fp16', 'bf16'" in res.output


def test_compress_shows_ratios_and_bounds_and_off_restores_plain_files(tiny_line):
    store = store_of(tiny_line)
    before = {e.id: e.sha256 for e in store.entries()}
    res = run("compress", "--config", str(tiny_line))
    assert res.exit_code == 0, res.output
    store.reload()
    assert store.compression == "exponent-zstd"
    for eid in IDS:
        cells = row(res.output, eid)
        ratio, bound = float(cells[-2]), float(cells[-1])
        assert 0.5 < ratio < 1.0 and bound <= ratio + 1e-9      # fp32 weights: (24+H)/32 is the floor
        assert store.entry(eid).file.endswith(".coez") and store.entry(eid).sha256 == before[eid]
    assert "store compression: exponent-zstd" in res.output
    ls = run("ls", "--config", str(tiny_line))
    assert ls.exit_code == 0 and float(row(ls.output, IDS[0])[6]) == pytest.approx(store.entry(IDS[0]).ratio, abs=1e-3)
    assert run("verify", "--config", str(tiny_line)).exit_code == 0     # decodes, hashes and builds each expert
    off = run("compress", "--config", str(tiny_line), "--off")
    assert off.exit_code == 0, off.output
    store.reload()
    assert store.compression == "none" and all(store.entry(e).file.endswith(".safetensors") for e in IDS)
    assert {e.id: e.sha256 for e in store.entries()} == before


def test_compress_errors_name_the_store_and_the_expert(tiny_line, tmp_path):
    res = run("compress", "--store", str(tmp_path / "nowhere"))
    assert res.exit_code != 0 and "--store" in res.output and "nowhere" in res.output
    res = run("compress", "--config", str(tiny_line), "no-such-expert")
    assert res.exit_code != 0 and "no-such-expert" in res.output
