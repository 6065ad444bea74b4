"""`coe-agent llm import|generate|trace|bench` on tiny models made in a temp dir."""
from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402
from moe_models import build  # noqa: E402

from coe.moe import MoELayout  # noqa: E402
from edge_agent.cli import cli  # noqa: E402
from edge_agent.llm_models import byte_tokenizer  # noqa: E402
from routing.moe_trace import Trace  # noqa: E402


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("llmcli")
    ref = build("mixtral", root / "hf")
    byte_tokenizer().save_pretrained(root / "hf")
    (root / "hf" / "heldout.txt").write_text("def add(a, b):\n    return a + b\n" * 40, encoding="utf-8")
    return root, ref


def _run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_import_generate_and_trace(hf_model, tmp_path):
    root, ref = hf_model
    store = tmp_path / "store"
    res = _run("llm", "import", str(root / "hf"), "--out", str(store), "--name", "tiny")
    assert res.exit_code == 0, res.output
    assert "16 experts in 2 MoE layers, top-2" in res.output
    layout = MoELayout.load(store)

    res = _run("llm", "generate", "--model", str(store), "--prompt", "def ", "-n", "6", "--memory", "25%",
               "--policy", "lfu")
    assert res.exit_code == 0, res.output
    tok = byte_tokenizer()
    ids = torch.tensor([tok.encode("def ")])
    want = ref.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert res.output.startswith("def " + tok.decode(want, skip_special_tokens=True))
    assert "hit rate" in res.output and "tokens/s" in res.output
    assert f"pool {4 * layout.layers[0].expert_nbytes / 2**20:.1f} MiB" in res.output   # 25% of 16 experts = 4
    res = _run("llm", "generate", "--model", str(store), "--prompt", "def ", "-n", "6", "--memory", "50%",
               "--policy", "lfu", "--admission")
    assert res.exit_code == 0 and res.output.startswith("def " + tok.decode(want, skip_special_tokens=True))
    line = next(x for x in res.output.splitlines() if x.startswith("admission: "))
    declined = int(line.split()[1])
    assert declined > 0 and f"{declined} declined" in res.output                 # counted in the hit rate too
    assert f"pool {7 * layout.layers[0].expert_nbytes / 2**20:.1f} MiB" in res.output   # 8 experts, one set aside
    res = _run("llm", "generate", "--model", str(store), "--prompt", "def ", "-n", "6", "--memory", "50%",
               "--policy", "lru", "--admission")                                 # lru never declines: no-op
    assert res.exit_code == 0 and res.output.startswith("def " + tok.decode(want, skip_special_tokens=True))
    assert "admission: 0 misses declined" in res.output and f"pool {8 * layout.layers[0].expert_nbytes / 2**20:.1f}" \
        in res.output
    res = _run("llm", "generate", "--model", str(store), "--prompt", "def ", "-n", "6", "--memory", "25%",
               "--policy", "lru", "--prefetch", "next-layer")
    assert res.exit_code == 0 and res.output.startswith("def " + tok.decode(want, skip_special_tokens=True))
    assert "prefetch: precision" in res.output
    res = _run("llm", "generate", "--model", str(store), "--prompt", "def ", "-n", "6", "--memory", "25%",
               "--host-memory", "50%", "--host-mode", "exclusive")
    assert res.exit_code == 0 and res.output.startswith("def " + tok.decode(want, skip_special_tokens=True))
    line = next(x for x in res.output.splitlines() if x.startswith("host tier (exclusive"))
    moved = int(line.split("; ")[1].split(" experts moved down")[0])
    assert "MiB read from expert files" in line and moved > 0                  # victims moved down into it

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# a comment\nimport os\n\nclass A:\n", encoding="utf-8")
    out = tmp_path / "t.trace"
    res = _run("llm", "trace", "--model", str(store), "--prompts", str(prompts), "--out", str(out), "-n", "3")
    assert res.exit_code == 0, res.output
    trace = Trace.load(out)
    assert sorted(set(trace.seq.tolist())) == [0, 1]
    assert trace.tokens == len(tok.encode("import os")) + 3 + len(tok.encode("class A:")) + 3 - 2  # last step not fed
    assert trace.chosen.shape[1:] == (2, 2)


def test_import_dtype_bf16_then_generate(hf_model, tmp_path):
    from storage.expert_store import ExpertStore

    root, ref = hf_model
    store = tmp_path / "store"
    res = _run("llm", "import", str(root / "hf"), "--out", str(store), "--name", "tiny", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert "(mixtral, bfloat16)" in res.output
    assert MoELayout.load(store).dtype == "bfloat16"
    assert {e.dtype for e in ExpertStore(store).entries()} == {"bfloat16"}
    res = _run("llm", "generate", "--model", str(store), "--prompt", "def ", "-n", "4", "--memory", "50%")
    assert res.exit_code == 0, res.output
    tok = byte_tokenizer()
    ids = torch.tensor([tok.encode("def ")])
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)      # a copy: the fixture's fp32 model serves other tests
    want = ref16.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert res.output.startswith("def " + tok.decode(want[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    res = CliRunner().invoke(cli, ["llm", "import", str(root / "hf"), "--out", str(tmp_path / "x"), "--dtype", "fp8"])
    assert res.exit_code == 2 and "'fp8' is not one of 'fp32', 'fp16', 'bf16'" in res.output


def test_clear_errors(hf_model, tmp_path):
    root, _ = hf_model
    res = CliRunner().invoke(cli, ["llm", "generate", "--model", str(root / "hf"), "--prompt", "x"])
    assert res.exit_code != 0 and "run 'coe-agent llm import" in res.output
    store = tmp_path / "store"
    assert _run("llm", "import", str(root / "hf"), "--out", str(store)).exit_code == 0
    for bad, msg in (("lots", "expected a size"), ("0%", "share must be"), ("1KB", "cannot hold one token")):
        res = CliRunner().invoke(cli, ["llm", "generate", "--model", str(store), "--prompt", "x", "--memory", bad])
        assert res.exit_code != 0 and msg in res.output, (bad, res.output)
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n\n", encoding="utf-8")
    res = CliRunner().invoke(cli, ["llm", "trace", "--model", str(store), "--prompts", str(empty), "--out",
                                   str(tmp_path / "x.trace")])
    assert res.exit_code != 0 and "no prompts" in res.output
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"ok\n\xff\xfe\n")
    res = CliRunner().invoke(cli, ["llm", "trace", "--model", str(store), "--prompts", str(binary), "--out",
                                   str(tmp_path / "x.trace")])
    assert res.exit_code != 0 and "not UTF-8" in res.output
    res = CliRunner().invoke(cli, ["llm", "make-model", "--out", str(tmp_path / "m")])
    assert res.exit_code != 0 and "--trained or --generated" in res.output
    res = CliRunner().invoke(cli, ["llm", "make-model", "--trained", "--steps", "5", "--seconds", "5", "--out",
                                   str(tmp_path / "m")])
    assert res.exit_code != 0 and "--steps or --seconds, not both" in res.output
    res = CliRunner().invoke(cli, ["llm", "make-model", "--generated", "--steps", "5", "--out", str(tmp_path / "m")])
    assert res.exit_code != 0 and "they go with --trained" in res.output
    res = CliRunner().invoke(cli, ["llm", "bench", "--work", str(tmp_path / "w"), "--part", "a", "--train-steps", "5",
                                   "--train-seconds", "5"])
    assert res.exit_code != 0 and "--train-steps or --train-seconds, not both" in res.output
    assert not (tmp_path / "m").exists() and not (tmp_path / "w").exists()
    # a generation past the model's context, and a tune-alpha text with nothing to predict
    context = hf_model[1].config.max_position_embeddings
    res = CliRunner().invoke(cli, ["llm", "generate", "--model", str(store), "--prompt", "x" * 10,
                                   "-n", str(context - 8)])           # 10 + context - 8 - 1 = context + 1
    assert res.exit_code == 1 and f"pass the model's context of {context} tokens" in res.output, res.output
    one = tmp_path / "one.txt"
    one.write_text("x", encoding="utf-8")
    res = CliRunner().invoke(cli, ["llm", "tune-alpha", "--model", str(store), "--budget-ms", "10",
                                   "--text", str(one)])
    assert res.exit_code == 1 and "needs at least 2" in res.output, res.output
    # another model's files under this model's ids: refused, not served as weights of the wrong shape
    import shutil

    from storage.expert_store import ExpertStore

    other = tmp_path / "other"
    shutil.copytree(store, other)
    s = ExpertStore(other)
    eid = next(iter(s.entries())).id
    tensors = {k: v[:, :-2].contiguous() for k, v in s.read(eid).items()}
    entry = s.entry(eid)
    s.write(__import__("coe").Expert(id=eid, arch=entry.arch, kind=entry.kind, classes=(), input_size=1), tensors,
            version=2)
    res = CliRunner().invoke(cli, ["llm", "generate", "--model", str(other), "--prompt", "x", "-n", "2"])
    assert res.exit_code == 1 and f"expert {eid} holds" in res.output and "llm.json says" in res.output, res.output


def test_bench_part_a_prints_a_table_and_one_json_line(hf_model, tmp_path):
    root, _ = hf_model
    work = tmp_path / "work"
    work.mkdir()
    (work / "trained-hf").symlink_to(root / "hf", target_is_directory=True)
    res = _run("llm", "bench", "--work", str(work), "--part", "a", "--prompts", "4", "--decode", "2", "--tokens", "16")
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["bench"] == "llm" and set(doc["a"]["summary"]) == {"trained", "mixtral"} and "b" not in doc
    for s in doc["a"]["summary"].values():
        assert 0 <= s["lru_hit_rate"] <= s["belady_hit_rate"] <= 1      # the oracle is never beaten
        assert not s["best"].startswith("belady")                                 # never the oracle
        assert s["best_gib_moved"] > 0 and s["lru_gib_moved"] > 0                  # real expert sizes, not 1 byte
    rows = doc["a"]["rows"]
    plain = {"lru", "fifo", "lfu", "gate-score", "predicted", "probability", "belady"}
    admitting = {"lfu", "gate-score", "probability", "predicted", "belady"}
    assert {r["policy"] for r in rows} == plain | {f"{p}+admission" for p in admitting}
    assert any(r["hit_rate"] is not None for r in rows if "+admission" in r["policy"])
    # mixtral: 32 layers x 8 experts, so a per-layer share of 12.5% (one expert) cannot hold top-2: n/a, not a crash
    assert all(r["hit_rate"] is None for r in rows if r["trace"] == "mixtral" and r["size"] == 0.125
               and r["quota"] == "per-layer")
    assert any("at 25% on trained" in ln for ln in lines)


def test_bench_parts_b_and_d_compare_with_the_mean_of_lru_run_first_and_last(hf_model, tmp_path):
    import edge_agent.llm_bench as lb_rows

    """(b) and (d) on a tiny generated model: LRU runs first and last, every ratio is against their mean, and
    neither LRU run is reported as the best row or policy."""
    root, _ = hf_model
    work = tmp_path / "work"
    work.mkdir()
    (work / "trained-hf").symlink_to(root / "hf", target_is_directory=True)
    res = _run("llm", "bench", "--work", str(work), "--part", "b,d", "--prompts", "4", "--decode", "3",
               "--expert-gb", "0.002", "--decode-tokens", "6")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output.strip().splitlines()[-1])
    b, d = doc["b"], doc["d"]
    lru_b = [r["tokens_per_second"] for r in b["rows"] if r["policy"] == "lru"]
    assert len(lru_b) == 2 and b["lru_baseline"] == pytest.approx(sum(lru_b) / 2)
    assert b["best"] not in ("lru", "belady")
    best = next(r for r in b["rows"] if r["policy"] == b["best"])
    assert b["best_vs_lru"] == pytest.approx(best["tokens_per_second"] / b["lru_baseline"])
    lru_d = [r["tokens_per_second"] for r in d if r["policy"] == "lru" and not r.get("prefetch")]   # not the oracle
    assert len(lru_d) == 2 and doc["d_lru_baseline"] == pytest.approx(sum(lru_d) / 2)
    line = next(ln for ln in res.output.splitlines() if "best row at alpha <= 0.3:" in ln)
    named = line.split("best row at alpha <= 0.3:")[1].split(" at ")[0]
    assert "LRU" not in named and "alpha 0.5" not in named and "alpha 0.7" not in named   # nor a wide band
    assert not named.startswith("oracle") and {r["row"] for r in d} >= set(lb_rows.ORACLE_ROWS)   # nor a bound
    assert any(ln.strip().startswith("at alpha 0.5") for ln in res.output.splitlines())   # that one is said apart
    cuts = doc["d_latency_cuts"]
    assert [c["row"] for c in cuts] == ["+ substitution (alpha 0.3)", "eviction by next token + popularity",
                                        lb_rows.ALPHA_WIDE, lb_rows.ALPHA_WIDER]   # no prefetch, split or LRU row
    plain = [r for r in d if r["row"] in ("eviction by windowed gate score", lb_rows.NO_SUBSTITUTION)]
    want = max(plain, key=lambda r: r["tokens_per_second"])         # the faster of the two rows without substitution
    wider = next(r for r in d if r["row"] == lb_rows.ALPHA_WIDER)
    assert len(plain) == 2 and cuts[-1]["best_baseline"] == want["row"]
    assert cuts[-1]["vs_best_baseline"] == pytest.approx(1 - want["tokens_per_second"] / wider["tokens_per_second"])


def test_latency_cuts_compare_each_substituting_row_with_lru_and_the_best_row_without_substitution():
    """The importance paper's figure: decode latency against its best baseline; ours against LRU too."""
    from edge_agent.llm_bench import latency_cuts

    rows = [{"row": "LRU", "policy": "lru", "tokens_per_second": 20.0},
            {"row": "gate", "policy": "gate-score", "tokens_per_second": 24.0},
            {"row": "pred", "policy": "predicted", "tokens_per_second": 25.0},
            {"row": "pred a0.5", "policy": "predicted", "alpha": 0.5, "tokens_per_second": 40.0},
            {"row": "+ prefetch", "policy": "predicted", "alpha": 0.3, "prefetch": "token", "tokens_per_second": 50.0},
            {"row": "split only", "policy": "predicted", "split": True, "tokens_per_second": 30.0},
            {"row": "alpha 0", "policy": "predicted", "alpha": 0.0, "tokens_per_second": 26.0},
            {"row": "LRU again", "policy": "lru", "tokens_per_second": 22.0},
            {"row": "ceiling", "policy": None, "tokens_per_second": 60.0}]
    (cut,) = latency_cuts(rows)          # prefetch and split rows and the ceiling are neither side
    assert cut["row"] == "pred a0.5" and cut["best_baseline"] == "alpha 0"   # alpha 0 is exact: no substitution
    assert cut["vs_lru"] == pytest.approx(1 - 21.0 / 40.0) and cut["vs_best_baseline"] == pytest.approx(1 - 26 / 40)
    with pytest.raises(ValueError, match="no row without substitution"):
        latency_cuts([r for r in rows if r["policy"] in ("lru", None) or r.get("alpha") or r.get("split")])


def test_tune_alpha_measures_each_alpha_and_plots(hf_model, tmp_path, monkeypatch):
    root, _ = hf_model
    store = tmp_path / "store"
    assert _run("llm", "import", str(root / "hf"), "--out", str(store)).exit_code == 0
    text = tmp_path / "held.txt"
    text.write_text("import os\nimport sys\n" * 20, encoding="utf-8")
    png = tmp_path / "alpha.png"
    res = _run("llm", "tune-alpha", "--model", str(store), "--budget-ms", "100000", "--text", str(text),
               "--alphas", "0,0.3", "--tokens", "24", "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert "alpha 0.00:" in res.output and "alpha 0.30:" in res.output and "agreement 100.0%" in res.output
    assert "smallest alpha meeting 100000.0 ms/token: 0.000 (exact)" in res.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(cli, ["llm", "tune-alpha", "--model", str(store), "--budget-ms", "5", "--text",
                                   str(text), "--alphas", "0.1,0.2"])
    assert bad.exit_code != 0 and "must start at 0" in bad.output
    # under predicted eviction: a predictor and popularity from a trace of the same store
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\nclass A:\ndef f(x):\nfor i in range(3):\n", encoding="utf-8")
    trace, pred = tmp_path / "t.trace", tmp_path / "t.predictor"
    assert _run("llm", "trace", "--model", str(store), "--prompts", str(prompts), "--out", str(trace),
                "--max-new-tokens", "6").exit_code == 0
    assert _run("llm", "train-predictor", "--trace", str(trace), "--out", str(pred)).exit_code == 0
    import executors.moe_model as moe_model
    from routing.moe_trace import Trace
    seen, real = [], moe_model.load_pooled

    def spy(root, **kw):
        seen.append(kw)
        return real(root, **kw)
    monkeypatch.setattr(moe_model, "load_pooled", spy)
    res = _run("llm", "tune-alpha", "--model", str(store), "--budget-ms", "100000", "--text", str(text),
               "--alphas", "0,0.3", "--tokens", "24", "--policy", "predicted", "--predictor", str(pred),
               "--trace", str(trace))
    assert res.exit_code == 0, res.output
    assert "alpha 0.30:" in res.output
    assert [kw["policy"] for kw in seen] == ["predicted", "predicted"]          # one decode per alpha
    assert all(str(kw["predictor"]) == str(pred) and kw["popularity"] == Trace.load(trace).popularity()
               for kw in seen)
    res = _run("llm", "tune-alpha", "--model", str(store), "--budget-ms", "5", "--text", str(text),
               "--predictor", str(pred))
    assert res.exit_code == 2 and "--predictor is for --policy predicted (got --policy gate-score)" in res.output
    res = _run("llm", "tune-alpha", "--model", str(store), "--budget-ms", "5", "--text", str(text),
               "--trace", str(trace))
    assert res.exit_code == 2 and "--trace is for --policy probability or predicted" in res.output
    other = Trace.load(trace)
    other.model = "another-model"
    other.save(tmp_path / "other.trace")
    for cmd in (["tune-alpha", "--budget-ms", "5", "--text", str(text)], ["generate", "--prompt", "x"]):
        res = _run("llm", *cmd, "--model", str(store), "--policy", "probability", "--trace",
                   str(tmp_path / "other.trace"))
        assert res.exit_code != 0 and "of model 'another-model'" in res.output, res.output


def test_generate_refuses_a_predictor_without_the_predicted_policy(tmp_path):
    (tmp_path / "p.predictor").write_bytes(b"x")
    res = _run("llm", "generate", "-m", str(tmp_path), "-p", "hi", "--predictor", str(tmp_path / "p.predictor"))
    assert res.exit_code == 2 and "--predictor is for --policy predicted (got --policy gate-score)" in res.output


def test_bench_device_is_checked_before_anything_is_made(tmp_path):
    """--device takes cpu/cuda/cuda:N; CUDA applies to (b), (c) and (d), not (a); nothing is generated when refused."""
    import torch

    work = tmp_path / "work"
    res = CliRunner().invoke(cli, ["llm", "bench", "--work", str(work), "--part", "b", "--device", "gpu0"])
    assert res.exit_code == 2 and "give cpu, cuda or cuda:N" in res.output
    res = CliRunner().invoke(cli, ["llm", "bench", "--work", str(work), "--part", "a,d", "--device", "cuda"])
    assert res.exit_code == 1 and "applies to (b), (c) and (d); (a) is a simulation" in res.output
    if not torch.cuda.is_available():
        res = CliRunner().invoke(cli, ["llm", "bench", "--work", str(work), "--part", "c", "--device", "cuda:0"])
        assert res.exit_code == 1 and "--device cuda:0: no CUDA device here" in res.output
    assert not work.exists()


def test_the_end_to_end_summary_gives_every_policys_ratio_beside_the_best(capsys):
    """(c) divided the best of several coe-edge policies by one accelerate run; each policy's own ratio is now
    printed (and in the JSON) beside it, and the SSD-bound fraction says it counts the prefill."""
    from types import SimpleNamespace

    from edge_agent.llm_cli import _summarise_e2e

    def run(system, policy, tps):
        return {"system": system, "policy": policy, "tokens_per_second": tps, "tokens": 24, "bytes_in": 2e9,
                "rss_peak": 1e9, "rss_peak_above_base": 5e8}
    coe = [run("coe", "lru", 9.0), run("coe", "gate-score", 12.0)]
    runs = [*coe, run("accelerate", None, 3.0), run("ram", None, 30.0)]
    doc: dict = {}
    _summarise_e2e(doc, runs, {"baseline": 1e9}, coe, SimpleNamespace(expert_bytes=2e9, resident_nbytes=5e7),
                   2e9, False, 0.25)
    out = capsys.readouterr().out
    assert "best coe-edge (gate-score): 4.00x accelerate" in out and "(every policy: lru 3.00x, gate-score 4.00x)" in out
    assert "prefill included" in out
    assert doc["c"]["vs_accelerate_each"] == {"lru": 3.0, "gate-score": 4.0}
    assert "no coe-resident run (not run): no compute-and-SSD limit" in out
    best = {**coe[1], "decode_tokens": 23, "decode_seconds": 2.0, "decode_bytes_in": 1e9}
    resident = {**run("coe-resident", "lru", 24.0), "seconds": 1.0, "decode_seconds": 0.5, "bytes_in": 0}
    _summarise_e2e(doc, [coe[0], best, resident, *runs[2:]], {"baseline": 1e9}, [coe[0], best],
                   SimpleNamespace(expert_bytes=2e9, resident_nbytes=5e7), 2e9, False, 0.25)
    out = capsys.readouterr().out
    assert "best coe-edge (gate-score)" in out                  # the resident reference is never the best
    assert "compute-and-SSD limit" in out and "24.00 tokens/s, reached 0.50" in out    # 24 / max(1 s, 1 s)
    assert "decode steps alone (11.50 tokens/s" in out and "SSD-bound 46.00 tokens/s, reached 0.25" in out
    assert doc["c"]["limits"]["compute_and_ssd"] == 24.0
    from edge_agent.llm_bench import compared_coe_runs
    failed = {**run("coe", "fifo", 0.0), "failed": "killed at the memory bound"}
    assert compared_coe_runs([coe[0], best, resident, failed, *runs[2:]]) == [coe[0], best]   # not the reference


def test_ssd_limits_count_reads_alone_and_reads_overlapped_with_the_resident_runs_compute():
    """The SSD-bound limit is tokens over read time; the compute-and-SSD limit over max(read, resident compute)."""
    from edge_agent.llm_bench import ssd_limits

    run = {"tokens": 24, "tokens_per_second": 8.0, "bytes_in": 2e9, "decode_tokens": 23, "decode_seconds": 2.3,
           "decode_bytes_in": 1e9}
    resident = {"seconds": 1.5, "decode_seconds": 0.8}
    lim = ssd_limits(run, resident, speed=1e9)            # 2 s of reads; 1 s in decode
    assert lim["ssd_bound"] == 12.0 and lim["of_ssd_bound"] == 8.0 / 12.0
    assert lim["compute_and_ssd"] == 12.0                 # reads (2 s) outlast the compute (1.5 s)
    assert lim["decode_tokens_per_second"] == 10.0
    assert lim["decode_ssd_bound"] == 23.0 and lim["of_decode_ssd_bound"] == 10.0 / 23.0
    slow = ssd_limits(run, {"seconds": 4.0, "decode_seconds": 2.0}, speed=1e9)
    assert slow["compute_and_ssd"] == 6.0 and slow["decode_compute_and_ssd"] == 11.5   # compute outlasts the reads
    assert slow["of_compute_and_ssd"] == 8.0 / 6.0
    alone = ssd_limits(run, None, speed=1e9)
    assert alone["compute_and_ssd"] is None and alone["decode_compute_and_ssd"] is None and alone["ssd_bound"] == 12.0
    failed = ssd_limits(run, {"failed": "killed"}, speed=1e9)
    assert failed["compute_and_ssd"] is None
    none = ssd_limits({**run, "bytes_in": 0, "decode_bytes_in": 0}, None, speed=1e9)
    assert none["ssd_bound"] is None and none["of_ssd_bound"] is None          # nothing read: no disk limit
