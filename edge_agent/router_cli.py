"""`coe-agent router train|eval` and `coe-agent probabilities`: learned routing and usage probabilities.

A thin layer over `routing.train`, `routing.learned` and `coe.probabilities`.
The command objects are created before `.cli` is imported (as in
`experts_cli.py`): `cli.py` imports this module at its end to register them,
and defining them first keeps that working whichever module is imported first.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from coe import CoEError, CoEModel, load_spec

if TYPE_CHECKING:
    from storage.expert_store import ExpertStore

    from .config import LineConfig


@click.group()
def router() -> None:
    """The learned router: train it on a recording, evaluate it on another.

    \b
    Example:
      coe-agent router train --line A --data var/line-A/rec-train --epochs 20
      coe-agent router eval --line A --data var/line-A/rec-test
    """


@click.command()
@click.option("--data", type=click.Path(file_okay=False, exists=True),
              help="Also estimate them by routing this recording, and save those.")
@click.option("--out", "-o", type=click.Path(dir_okay=False),
              help="Where to save them (default: {data_dir}/probabilities.json).")
@click.option("--router", "router_kind", type=click.Choice(["auto", "rules", "learned"]), default="auto",
              show_default=True, help="Router for --data: auto is the learned one if the store holds it.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed for the chain draws of frames without a truth label.")
def probabilities(line: str, config_path: str | None, data: str | None, out: str | None, router_kind: str,
                   seed: int) -> None:
    """Print each expert's usage probability and save them where the scheduler and pools read them.

    From the spec: component frequencies walked through the chain with the
    classifiers' priors.  With --data, also from a sample run: the recording
    is routed and each expert's use counted, detector steps included; the
    table then shows both and their largest difference, and the sample is
    what gets saved.

    \b
    Example:
      coe-agent probabilities --line A
      coe-agent probabilities --line A --data var/line-A/rec-test --out var/line-A/probabilities.json
    """
    from coe import probabilities as P

    cfg, model = _open(line, config_path)
    spec = P.from_spec(model)
    path = Path(out) if out else Path(cfg.data_dir) / "probabilities.json"
    sample = None
    source = f"spec {cfg.spec_path}"
    if data is not None:
        sample, source = _sample(cfg, model, data, router_kind, seed)
    cols = ("expert", "kind", "spec") + (("sample", "diff") if sample is not None else ())
    rows = []
    for eid in sorted(model.experts, key=lambda e: (-spec[e], e)):
        row = [eid, model.experts[eid].kind, f"{spec[eid]:.4f}"]
        if sample is not None:
            row += [f"{sample[eid]:.4f}", f"{sample[eid] - spec[eid]:+.4f}"]
        rows.append(row)
    for text in _table(cols, rows, right={"spec", "sample", "diff"}):
        click.echo(text)
    if sample is not None:
        click.echo(f"max |sample - spec| = {P.compare(sample, spec):.4f}")
    saved = P.save(sample if sample is not None else spec, path, source)
    click.echo(f"saved ({source}) to {saved}")


from .cli import _config, _fail_clearly, line_options  # noqa: E402  (after the commands: see the module doc)


def _open(line: str, config_path: str | None) -> tuple["LineConfig", CoEModel]:
    cfg = _config(line, config_path)
    return cfg, load_spec(cfg.spec_path)


def _existing_store(cfg: "LineConfig") -> "ExpertStore":
    from storage.expert_store import ExpertStore

    if not cfg.store_path.is_dir():
        raise CoEError(f"no expert store at {cfg.store_path} (run: coe-agent router train --line {cfg.line} "
                       f"--data RECORDING)")
    return ExpertStore(cfg.store_path, verify=cfg.expert_verify)


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _table(cols: tuple[str, ...], rows: list[list[str]], right: set[str]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]

    def fmt(vals) -> str:
        return "  ".join(v.rjust(w) if c in right else v.ljust(w) for v, w, c in zip(vals, widths, cols)).rstrip()
    return [fmt(cols), *(fmt(r) for r in rows)]


_threshold = click.option("--threshold", type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
                          default=None, help="Confidence at or above which the network routes on its own, for "
                                             "the figures (default: the line's routing.threshold; the agent "
                                             "always uses that).")
_data = click.option("--data", "data", required=True, type=click.Path(file_okay=False, exists=True),
                     help="Recording directory (manifest.jsonl + frames/).")


@router.command("train")
@line_options
@_data
@click.option("--epochs", default=20, show_default=True, type=click.IntRange(min=1), help="Passes over the data.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0), help="Seed for weights and order.")
@_threshold
@click.option("--size", "input_size", default=32, show_default=True, type=click.IntRange(16, 128),
              help="Side in pixels the frames are resized to.")
@click.option("--allow-missing", is_flag=True,
              help="Store the router though some of the spec's component types have no frame in --data (it "
                   "will never predict them, and routes their frames to others on its own).")
@_fail_clearly
def router_train(line: str, config_path: str | None, data: str, epochs: int, seed: int, threshold: float | None,
                 input_size: int, allow_missing: bool) -> None:
    """Train the learned router on a recording and write it into the line's expert store.

    Labels are each frame's truth_component (a recording made with
    --omit-component keeps it) or its header's component.  Seeded: the same
    recording and seed give the same router.

    \b
    Example:
      coe-agent record --synthetic --line A --frames 3000 --omit-component --seed 1 --out var/line-A/rec-train
      coe-agent router train --line A --data var/line-A/rec-train --epochs 20 --seed 0
    """
    from storage.expert_store import ExpertStore
    from storage.recording import Recording

    from routing.learned import LearnedRouter
    from routing.train import EpochStats, evaluate_router, train_router

    cfg, model = _open(line, config_path)
    threshold = cfg.routing.threshold if threshold is None else threshold
    rec = Recording(data)
    _check_line(rec, cfg.line, data)
    seen = {f.truth_component or f.header.get("component") for f in rec}
    missing = [c for c in model.components if c not in seen]
    if missing and not allow_missing:   # before any epoch, and before anything is written
        raise CoEError(f"{len(missing)} component type(s) of the spec have no frame in {data}: "
                       f"{', '.join(missing)}; a router trained without them routes their frames to other "
                       "types, confidently, over correct headers. Record them too, or pass --allow-missing")
    click.echo(f"training the router of line {cfg.line} on {len(rec)} frame(s) of {data}: "
               f"{len(model.components)} component types, {epochs} epoch(s), seed {seed}, {input_size} px")

    def tick(s: EpochStats) -> None:
        click.echo(f"epoch {s.epoch:>3}/{s.epochs}  loss {s.loss:.4f}  train acc {_pct(s.accuracy)}  "
                   f"{s.seconds:.1f} s")
    net, classes, report = train_router(model, rec, epochs=epochs, seed=seed, input_size=input_size, progress=tick)
    learned = LearnedRouter(model, net, classes, input_size, threshold=threshold)
    store = ExpertStore(cfg.store_path, verify=cfg.expert_verify)
    learned.save(store)
    entry = store.entry("router")
    ev = evaluate_router(learned, rec)
    click.echo(f"router written to {store.root / entry.file} (sha256 {entry.sha256[:12]}, "
               f"{entry.nbytes / 1e3:.0f} kB) in {report.seconds:.1f} s")
    click.echo(f"accuracy on the training data: {_pct(ev.accuracy)} top-1; at threshold {threshold:.2f} the "
               f"network routes {_pct(ev.routed)} of frames on its own, {_pct(ev.routed_accuracy)} of them right")
    if report.unseen:
        click.echo(f"warning: {len(report.unseen)} component type(s) have no frame in {data}, so the router "
                   f"will never predict them: {', '.join(report.unseen)}")


@router.command("eval")
@line_options
@_data
@click.option("--png", type=click.Path(dir_okay=False),
              help="Confusion matrix image (default: {data_dir}/router-confusion.png).")
@_threshold
@click.option("--top", default=8, show_default=True, type=click.IntRange(min=1), help="Confused pairs to list.")
@_fail_clearly
def router_eval(line: str, config_path: str | None, data: str, png: str | None, threshold: float | None,
                top: int) -> None:
    """Score the line's learned router on a recording: accuracy, per-class recall, confusions.

    Accuracy is the network's top-1 component against each frame's true type;
    the threshold line says how many frames it would route without the header
    and how many of those it gets right.  Writes a PNG confusion matrix.

    \b
    Example:
      coe-agent record --synthetic --line A --frames 3000 --omit-component --seed 2 --out var/line-A/rec-test
      coe-agent router eval --line A --data var/line-A/rec-test --png var/line-A/router-confusion.png
    """
    from storage.recording import Recording

    from routing.learned import LearnedRouter
    from routing.train import evaluate_router, plot_confusion

    cfg, model = _open(line, config_path)
    threshold = cfg.routing.threshold if threshold is None else threshold
    learned = LearnedRouter.load(model, _existing_store(cfg), threshold=threshold)
    rec = Recording(data)
    _check_line(rec, cfg.line, data)
    rep = evaluate_router(learned, rec)
    click.echo(f"learned router of line {cfg.line} on {rep.n} frame(s) of {data}")
    click.echo(f"top-1 accuracy: {_pct(rep.accuracy)}")
    click.echo(f"at threshold {rep.threshold:.2f}: {_pct(rep.routed)} of frames routed by the network, "
               f"{_pct(rep.routed_accuracy)} of them right; the rest fall back to the header or are rejected")
    if rep.accuracy_by_truth:
        click.echo("accuracy by truth label: " + ", ".join(f"{t} {_pct(a)}" for t, a in rep.accuracy_by_truth.items()))
    counts = {c: sum(row) for c, row in zip(rep.classes, rep.confusion)}
    rows = [[c, str(counts[c]), _pct(r)] for c, r in sorted(rep.per_class_recall.items(), key=lambda kv: (kv[1], kv[0]))]
    click.echo("")
    for text in _table(("component", "frames", "recall"), rows, right={"frames", "recall"}):
        click.echo(text)
    absent = [c for c in rep.classes if not counts[c]]
    if absent:
        click.echo(f"(no frames of: {', '.join(absent)})")
    pairs = rep.top_confusions(top)
    click.echo("")
    if pairs:
        click.echo("most confused (true -> predicted: frames):")
        for t, p, n in pairs:
            click.echo(f"  {t} -> {p}: {n}")
    else:
        click.echo("no confusions")
    target = Path(png) if png else Path(cfg.data_dir) / "router-confusion.png"
    try:                                   # after the figures: a path it cannot write loses only the picture
        out = plot_confusion(rep, target)
    except OSError as exc:
        raise CoEError(f"--png {target}: the confusion matrix could not be written: {exc.strerror or exc} "
                       "(the figures above stand)") from None
    click.echo(f"confusion matrix: {out}")


def _check_line(rec, line: str, data: str) -> None:
    """Frames of another line: a router is trained or scored on the line it serves."""
    other = sorted({f.header.get("line") for f in rec} - {line, None})
    if other:
        raise CoEError(f"{data}: frames of line {', '.join(map(str, other))}, not of line {line}; record this "
                       "line's frames (or give --line/--config of that line)")


def _sample(cfg: "LineConfig", model: CoEModel, data: str, router_kind: str, seed: int) -> tuple[dict, str]:
    from storage.recording import Recording

    from routing import RuleRouter

    rec = Recording(data)
    kind = router_kind
    store = None
    if kind != "rules" and cfg.store_path.is_dir():
        from storage.expert_store import ExpertStore

        store = ExpertStore(cfg.store_path, verify=cfg.expert_verify)
    if kind == "auto":
        kind = "learned" if store is not None and store.has("router") else "rules"
    if kind == "learned":
        from routing.learned import LearnedRouter

        if store is None:
            store = _existing_store(cfg)
        chosen = LearnedRouter.load(model, store, threshold=cfg.routing.threshold)
    else:
        chosen = RuleRouter(model)
        if any("component" not in f.header for f in rec):
            raise CoEError(f"{data}: frames without 'component' cannot be rule-routed; train a router "
                           f"(coe-agent router train --line {cfg.line} --data RECORDING) or use --router learned")
    from routing.train import sample_probabilities

    probs = sample_probabilities(chosen, model, rec, seed)
    return probs, f"sample {data} ({len(rec)} frames, {kind} router, seed {seed})"


line_options(probabilities)
probabilities.params[:0] = [probabilities.params.pop(), probabilities.params.pop()]  # --line, --config first
probabilities.callback = _fail_clearly(probabilities.callback)
