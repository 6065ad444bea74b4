"""What a token-wise expert predictor could read: top-k recall of the next token's experts from several inputs.

Issue 11's prefetch did not pay on this box with the retrained small model, though exact guesses did
(docs/llm.md): the predictor (top-k recall 0.65 on the replay half) is what holds it back.  This asks
which inputs would predict better, and when each is known.  It replays the trained model's trace
prompts through the unmodified Hugging Face model (greedy, as `llm bench` traced them; it checks
that every router choice matches the trace), records each layer's router input, and fits the same
kind of per-layer logistic regression on the profile half's decode tokens for each input set:

- this token's router scores (layers so far) and the previous token's (the rest): the predictor's
  `freshest` input, known when layer j routes token t, a whole token before token t+1 reaches layer j;
- token t's hidden state at layer j (the router's input, 128 numbers instead of 16 scores);
- token t+1's id, and the id with token t's scores at every layer: known only once token t+1 is
  sampled, so a prefetch has layers 0..j-1 of token t+1 to load layer j's guesses in (none for layer 0).

Scores are on the replay half's decode tokens: top-k recall per layer and over all layers, and the
precision and recall of the guesses a prefetch at p >= 0.5 would load.  An offline measurement on the
trace (no decode is timed).

Usage:  python bench/moe_predictor_inputs.py [--work var/llm]   (needs `coe-agent llm bench --part a` once)
Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import edge_agent.cli  # noqa: E402,F401  (loads the CLI package first: llm_cli imports it)
from edge_agent.llm_bench import split_trace  # noqa: E402
from edge_agent.llm_cli import trace_prompts  # noqa: E402
from routing.moe_predictor import inputs as predictor_inputs  # noqa: E402
from routing.moe_trace import Trace  # noqa: E402

PROMPTS, DECODE = 40, 32          # the trace `llm bench` records (trained-40x32.trace)
INPUTS = {
    "freshest": ("scores: this token's so far + the previous token's", "token t, layer j"),
    "hidden": ("token t's hidden state at layer j", "token t, layer j"),
    "next-id": ("token t+1's id", "token t+1 sampled"),
    "next-id+scores": ("token t+1's id + token t's scores", "token t+1 sampled"),
}


def replay(hf: Path, store: Path, trace: Trace):
    """(router inputs [N, L, H], router scores [N, L, E], input id of each row [N]) for the trace's rows."""
    from transformers import AutoModelForCausalLM

    from executors.moe_model import load_pooled

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, local_files_only=True).eval()
    pm = load_pooled(store, memory=10**12, policy="lru")
    tok = pm.tokenizer()
    pm.close()
    layers = model.model.layers
    seen: dict[int, list] = {}
    for i, layer in enumerate(layers):
        layer.mlp.gate.register_forward_hook(
            lambda m, args, out, i=i: seen.setdefault(i, []).append(args[0].detach().reshape(-1, args[0].shape[-1])))
    hidden, ids = [], []
    with torch.no_grad():
        for text in trace_prompts(hf, PROMPTS):
            prompt = torch.tensor(tok.encode(text), dtype=torch.long)[None]
            seen.clear()
            out = model.generate(prompt, max_new_tokens=DECODE, do_sample=False, use_cache=True)
            h = torch.stack([torch.cat(seen[i]) for i in range(len(layers))], 1)
            hidden.append(h.numpy())
            ids.append(out[0, :len(h)].numpy())
    H = np.concatenate(hidden)
    if len(H) != trace.tokens:
        sys.exit(f"replayed {len(H)} tokens but the trace has {trace.tokens}: is {hf} the model that was traced?")
    W = np.stack([layers[i].mlp.gate.weight.detach().numpy() for i in range(len(layers))])   # [L, E, H]
    logits = np.einsum("nlh,leh->nle", H, W)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.sort(np.argsort(-probs, -1)[..., :trace.top_k], -1)
    agree = float((chosen == np.sort(trace.chosen.astype(int), -1)).all(-1).mean())
    if agree < 0.999:
        sys.exit(f"the replay's router choices match the trace's on {agree:.1%} of (token, layer): not this model")
    return H, probs, np.concatenate(ids), int(model.config.vocab_size)


def features(kind: str, trace: Trace, rows: np.ndarray, j: int, H, probs, ids, vocab: int) -> np.ndarray:
    """Inputs for predicting row t+1's experts at layer j, for each row t in `rows`."""
    E = probs.shape[2]
    if kind == "freshest":      # exactly what the shipped predictor reads
        return predictor_inputs(trace, rows, j, "freshest")
    if kind == "hidden":
        return H[rows, j]
    onehot = np.eye(vocab, dtype=np.float32)[ids[rows + 1]]
    if kind == "next-id":
        return onehot
    return np.concatenate([onehot, probs[rows].reshape(len(rows), -1) * E], 1)


def fit(x: np.ndarray, y: np.ndarray, epochs: int = 400):
    """Per-expert logistic regression on standardised inputs (Adam, weight decay 1e-3); returns a scorer."""
    torch.manual_seed(0)
    xt, yt = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    mu, sd = xt.mean(0), xt.std(0) + 1e-6
    lin = torch.nn.Linear(x.shape[1], y.shape[1])
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-3)
    xs = (xt - mu) / sd
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(lin(xs), yt).backward()
        opt.step()
    return lambda z: lin((torch.tensor(z, dtype=torch.float32) - mu) / sd).detach().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="var/llm", help="llm bench's work dir (trained-hf, trained, the trace)")
    args = ap.parse_args()
    work = Path(args.work)
    hf, store, trace_path = work / "trained-hf", work / "trained", work / f"trained-{PROMPTS}x{DECODE}.trace"
    for need in (hf / "config.json", store / "llm.json", trace_path):
        if not need.is_file():
            sys.exit(f"{need} is missing: run `coe-agent llm bench --work {work} --part a` once first")
    trace = Trace.load(trace_path)
    H, probs, ids, vocab = replay(hf, store, trace)
    profile, _ = split_trace(trace)
    cut = int(profile.seq.max())
    seq, step, k, L = trace.seq, trace.step, trace.top_k, len(trace.layers)
    pairs = np.flatnonzero((seq[1:] == seq[:-1]) & (step[1:] > 0))    # t -> t+1, t+1 a decode token
    train, test = pairs[seq[pairs] <= cut], pairs[seq[pairs] > cut]
    chosen = trace.chosen.astype(np.int64)
    results = {}
    for kind in INPUTS:
        per_layer, hits, total, tp, guessed = [], 0, 0, 0, 0
        for j in range(L):
            ytr = np.zeros((len(train), probs.shape[2]), np.float32)
            np.put_along_axis(ytr, chosen[train + 1, j], 1.0, axis=1)
            yte = np.zeros((len(test), probs.shape[2]), np.float32)
            np.put_along_axis(yte, chosen[test + 1, j], 1.0, axis=1)
            scorer = fit(features(kind, trace, train, j, H, probs, ids, vocab), ytr)
            score = scorer(features(kind, trace, test, j, H, probs, ids, vocab))
            top = np.argsort(-score, 1)[:, :k]
            got = int(np.take_along_axis(yte, top, 1).sum())
            per_layer.append(got / yte.sum())
            hits, total = hits + got, total + int(yte.sum())
            sure = np.take_along_axis(1 / (1 + np.exp(-score)), top, 1) >= 0.5
            tp += int((np.take_along_axis(yte, top, 1) * sure).sum())
            guessed += int(sure.sum())
        results[kind] = {"recall_top_k": round(hits / total, 3), "per_layer": [round(float(r), 3) for r in per_layer],
                         "precision_p50": round(tp / guessed, 3) if guessed else 0.0,
                         "recall_p50": round(tp / total, 3), "known": INPUTS[kind][1]}
    print(f"trained small MoE ({L} layers, {probs.shape[2]} experts, top-{k}); fitted on {len(train)} decode tokens "
          f"of the profile half, scored on {len(test)} of the replay half; offline, on the trace")
    print(f"{'inputs':52} {'known when':18} {'top-k recall':>12} {'per layer':>26} {'p>=0.5: prec':>12} {'rec':>5}")
    for kind, r in results.items():
        print(f"{INPUTS[kind][0]:52} {r['known']:18} {r['recall_top_k']:12.3f} "
              f"{' / '.join(f'{x:.2f}' for x in r['per_layer']):>26} {r['precision_p50']:12.3f} {r['recall_p50']:5.3f}")
    print(json.dumps({"bench": "moe_predictor_inputs", "trace": str(trace_path), "train_pairs": len(train),
                      "test_pairs": len(test), "results": results}))


if __name__ == "__main__":
    main()
