"""`coe-agent`: a thin command line over the library.

Every domain error becomes a one-line message naming what is wrong (a file, a
key, a frame), never a traceback.  Every command's help ends with an example.
"""
from __future__ import annotations


import functools
import json
import logging
import sys
from pathlib import Path

import click

from coe import CoEError, load_spec

from .config import LineConfig, find_config, load_config


def _fail_clearly(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (CoEError, FileNotFoundError, OSError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        except ImportError as exc:      # an optional package missing or half-installed (onnxruntime, onnx, ray)
            raise click.ClickException(f"{exc}: this command needs it; reinstall coe-edge (pip install -e .) or "
                                       f"the extra that brings it") from None
    return wrapper


def _from_above(ctx: click.Context, param: click.Parameter, value):
    """--line/--config given before the command (`coe-agent --line B experts ls`) reach the command: they were
    ignored, and the command ran on line A (a promotion, into line A's live store).  Given on both sides and
    different, it is a usage error."""
    from click.core import ParameterSource

    key = f"coe-edge.{param.name}"
    if ctx.get_parameter_source(param.name) in (None, ParameterSource.DEFAULT):
        return ctx.meta.get(key, value)
    above = ctx.meta.get(key)
    if above is not None and above != value:
        flag = "--line" if param.name == "line" else "--config"
        raise click.UsageError(f"{flag} {above} before the command and {flag} {value} after it: give it once")
    ctx.meta[key] = value
    return value


def line_options(fn):
    """--line and --config, shared by every command that works on a line (and the group: given before the
    command, they are the command's)."""
    fn = click.option("--config", "config_path", type=click.Path(dir_okay=False), callback=_from_above,
                      help="Line config file (default: configs/line-<LINE>.yaml).")(fn)
    fn = click.option("--line", "-l", default="A", show_default=True, callback=_from_above,
                      help="Production line name.")(fn)
    return fn


def dtype_option(default_is: str):
    """--dtype: the dtype experts are stored in (fp32, fp16, bf16); `default_is` says what happens without it."""
    from storage.dtypes import STORED_DTYPES

    return click.option("--dtype", type=click.Choice(STORED_DTYPES, case_sensitive=False), default=None,
                        help=f"Store the weights as this dtype (default: {default_is}).")


def torch_device(ctx, param, value: str) -> str:
    """A click callback: 'cpu', 'cuda' or 'cuda:N' (what a benchmark's --device takes), else a usage error."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise click.BadParameter(f"{value!r}: give cpu, cuda or cuda:N")
    return value


def _config(line: str, config_path: str | None) -> LineConfig:
    cfg = load_config(find_config(line, config_path))
    if config_path and cfg.line != line and _given("line"):
        # both given and they disagree: which line the user meant is not ours to guess
        raise click.UsageError(f"--line {line}, but --config {config_path} is the config of line {cfg.line}: "
                               "give one of them (or the config of line " + line + ")")
    return cfg


def _given(param: str) -> bool:
    """Was `param` given on the command line (or its environment variable), in this command or a group above?"""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        if param in ctx.params and ctx.get_parameter_source(param) not in (None, ParameterSource.DEFAULT):
            return True
        ctx = ctx.parent
    return False


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@line_options
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.pass_context
def cli(ctx: click.Context, line: str, config_path: str | None, verbose: int) -> None:
    """coe-edge line agent: serves Collaboration-of-Experts vision pipelines.

    Without a command it runs the agent for --line until SIGINT/SIGTERM.

    \b
    Example:
      coe-agent demo --line A          # build a demo zoo, serve, replay, summarise
      coe-agent --line A               # run the line agent
    """
    _setup_logging(verbose)
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose
    if ctx.invoked_subcommand is None:
        ctx.invoke(run, line=line, config_path=config_path)


@cli.command()
@line_options
@_fail_clearly
def run(line: str, config_path: str | None) -> None:
    """Run the line agent until SIGINT/SIGTERM, then drain and exit 0.

    \b
    Example:
      coe-agent run --line A
      COE_METRICS__PORT=9200 coe-agent run --line A
    """
    from .agent import Agent

    cfg = _config(line, config_path)
    if logging.getLogger().level > logging.INFO:
        logging.getLogger("edge_agent").setLevel(logging.INFO)
    agent = Agent(cfg)
    code = agent.run_forever()
    sys.exit(code)


@cli.command()
@line_options
@click.option("--frames", default=600, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Frames in the synthetic recording.")
@click.option("--seed", default=0, show_default=True,
              help="Seed for the recording (and the generated weights of a zoo built now); training uses seed 0.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Replay rate in frames/s (default: as fast as acked).")
@click.option("--recording", type=click.Path(file_okay=False, exists=True), help="Replay this recording instead.")
@click.option("--json", "as_json", is_flag=True, help="Also print the summary as one JSON line.")
@click.option("--no-train", is_flag=True, help="Keep the zoo's generated weights (skip zoo train).")
@_fail_clearly
def demo(line: str, config_path: str | None, frames: int, seed: int, rate: float | None,
         recording: str | None, as_json: bool, no_train: bool) -> None:
    """Build and train the demo zoo and a recording if absent, serve, replay, and summarise.

    The classifiers and the detectors are trained on synthetic frames on the
    first run (several minutes on 2 cores) and reused after that.  The
    recording draws 5% of the ok parts with a soldering defect for the
    detectors to find; the summary says how many verdicts were right against
    the recording's truth, with the recall of every defect label.

    \b
    Example:
      coe-agent demo --line A
      coe-agent demo --line A --seed 1          # a held-out recording
      coe-agent demo --line A --frames 2000 --rate 250 --json
    """
    from .demo import format_summary, results_command, run_demo, summary_json

    cfg = _config(line, config_path)
    model = load_spec(cfg.spec_path)
    result = run_demo(cfg, model, frames=frames, seed=seed, rate=rate,
                      recording=Path(recording) if recording else None, train=not no_train)
    click.echo(f"\ncoe-edge demo, line {cfg.line} (real run on {'/'.join(e.device for e in cfg.executors)}):")
    click.echo(format_summary(result.summary))
    click.echo(f"\nits verdicts: {results_command(cfg, config_path)}")
    if as_json:
        click.echo(summary_json(result.summary))
    if not result.ok:
        raise click.ClickException("not every frame got exactly one verdict; see the errors table in "
                                   + result.summary["database"])


@cli.group()
def zoo() -> None:
    """The demo expert zoo: build the spec's experts with generated weights, or train them here.

    \b
    Example:
      coe-agent zoo build --line A
      coe-agent zoo train --line A
    """


@zoo.command("train")
@line_options
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1),
              help="Training steps per classifier group, at most: a group stops once a validation draw scores 99%.")
@click.option("--batch", default=48, show_default=True, type=click.IntRange(min=2),
              help="Synthetic frames per classifier step (BatchNorm trains on 2 or more).")
@click.option("--detector-steps", default=None, type=int,
              help="Training steps per detector (default: 500); 0 leaves detectors alone.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed for the frames and the initial weights.")
@click.option("--force", is_flag=True, help="Retrain experts that are already trained.")
@click.option("--workers", default=None, type=click.IntRange(min=1),
              help="Training processes side by side (default: one per core, at most one per job).")
@_fail_clearly
def zoo_train(line: str, config_path: str | None, steps: int, batch: int, detector_steps: int | None, seed: int,
              force: bool, workers: int | None) -> None:
    """Train the spec's classifiers and detectors on synthetic frames of their component types.

    Classifiers sharing an architecture, classes and input size are trained
    as one network on all their component types and written to each of them.
    Each detector learns the soldering defects of its classes, drawn with
    their boxes on the parts its classifiers pass to it; its held-out recall
    (IoU >= 0.5) and false alarms on clean parts are printed.  An expert
    already trained with the same recipe is kept.  The groups and detectors
    train side by side, one process per core.

    \b
    Example:
      coe-agent zoo train --line A
      coe-agent zoo train --line A --steps 300 --detector-steps 400 --force
    """
    from storage.expert_store import ExpertStore

    from .progress import step_bars
    from .zoo_train import DETECTOR_STEPS, train_zoo

    cfg = _config(line, config_path)
    model = load_spec(cfg.spec_path)
    store = ExpertStore(cfg.store_path, verify=cfg.expert_verify)
    det_steps = DETECTOR_STEPS if detector_steps is None else detector_steps
    if det_steps < 0:
        raise click.BadParameter(f"must be 0 or more, got {det_steps}", param_hint="--detector-steps")
    with step_bars() as tick:
        results, detectors = train_zoo(model, store, steps=steps, batch=batch, det_steps=det_steps, seed=seed,
                                       force=force, workers=workers, progress=tick)
    for r in results:
        state = "kept (already trained)" if r.skipped else f"trained {r.steps} steps in {r.seconds:.0f} s"
        click.echo(f"{r.arch}: {len(r.experts)} classifier(s), {len(r.components)} component type(s), {state}; "
                   f"held-out accuracy {100 * r.heldout_accuracy:.1f}%")
    for d in detectors:
        click.echo(d.describe())


@zoo.command("build")
@line_options
@click.option("--seed", default=0, show_default=True, help="Seed for the generated weights.")
@click.option("--force", is_flag=True, help="Rebuild experts already in the store.")
@dtype_option("fp32, as generated; stored experts are kept whatever their dtype")
@_fail_clearly
def zoo_build(line: str, config_path: str | None, seed: int, force: bool, dtype: str | None) -> None:
    """Write every expert of the line's spec into its expert store.

    Real architectures (torchvision, ultralytics YOLO from yaml) with locally
    generated weights, stored as safetensors with a sha256 manifest.  With
    --dtype the weights are cast once before they are written (fp16 and bf16
    halve the bytes each expert switch reads); an expert stored in another
    dtype is cast to it, its weights (trained ones too) kept.

    \b
    Example:
      coe-agent zoo build --line A
      coe-agent zoo build --line A --dtype fp16
    """
    from tqdm import tqdm

    from storage.expert_store import ExpertStore

    from .demo import sample_images_for
    from .zoo import build_zoo

    cfg = _config(line, config_path)
    model = load_spec(cfg.spec_path)
    store = ExpertStore(cfg.store_path, verify=cfg.expert_verify)
    with tqdm(total=len(model.experts), desc="building expert zoo", unit="expert") as bar:   # closed on an error
        entries = build_zoo(model, store, seed=seed, force=force, sample_images=sample_images_for(model, seed=seed),
                            progress=lambda eid: bar.update(1), dtype=dtype)
    total = sum(e.nbytes for e in store.entries() if e.id in model.experts)
    click.echo(f"{len(entries)} expert(s) written, {len(model.experts)} in spec, {total / 1e6:.1f} MB "
               f"in {cfg.store_path}")


@cli.command()
@line_options
@click.option("--synthetic", is_flag=True, required=True, help="Draw frames procedurally (the only source so far).")
@click.option("--frames", "-n", default=500, show_default=True, type=click.IntRange(min=1), help="Number of frames.")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False), help="Recording directory to write.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Seed of the board layout and of every frame's pixels and truth: the same seed gives the same "
                   "recording, byte for byte.")
@click.option("--encoding", type=click.Choice(["png", "jpeg", "raw"]), default="png", show_default=True,
              help="How each frame's image is stored and sent: png (lossless), jpeg (quality 90) or raw "
                   "(uncompressed RGB bytes).")
@click.option("--size", default=64, show_default=True, type=click.IntRange(16, 1024),
              help="Image side in pixels (16 to 1024).")
@click.option("--omit-component", is_flag=True, help="Leave 'component' out of headers (learned routing).")
@click.option("--board-components", default=40, show_default=True,
              help="Components per board layout (use about --frames for a stream that follows the spec's "
                   "frequencies, e.g. to train a router).")
@click.option("--overwrite", is_flag=True, help="Replace an existing recording.")
@click.option("--solder-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Share of ok parts drawn with a soldering defect their detector should find.")
@_fail_clearly
def record(line: str, config_path: str | None, synthetic: bool, frames: int, out: str, seed: int,
           encoding: str, size: int, omit_component: bool, board_components: int, overwrite: bool,
           solder_rate: float) -> None:
    """Make a seeded synthetic recording of the line's component types, in board order.

    \b
    Example:
      coe-agent record --synthetic --line A --frames 500 --out rec/A-500
      coe-agent record --synthetic --line A --frames 3000 --board-components 3000 --omit-component --out rec/train
      coe-agent record --synthetic --line A --frames 600 --seed 1 --solder-rate 0.05 --out rec/A-heldout
    """
    from tqdm import tqdm

    from storage.synthetic import record_synthetic

    cfg = _config(line, config_path)
    model = load_spec(cfg.spec_path)
    done = [0]
    with tqdm(total=frames, desc="recording", unit="frame") as bar:   # closed on an error: it ends its line

        def tick(n: int) -> None:
            bar.update(n - done[0])
            done[0] = n
        path = record_synthetic(model, out, frames, line=cfg.line, seed=seed, size=size, encoding=encoding,
                                omit_component=omit_component, boards_components=board_components,
                                overwrite=overwrite, solder_rate=solder_rate, progress=tick)
    click.echo(f"wrote {frames} frame(s) to {path}")


@cli.command()
@click.argument("recording", type=click.Path(file_okay=False, exists=True))
@line_options
@click.option("--endpoint", help="Agent ingest address (default: the config's ingest endpoint).")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Frames per second (default: as fast as acked).")
@click.option("--window", default=256, show_default=True, type=click.IntRange(min=1),
              help="Frames in flight without an ack.")
@click.option("--ack-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds before an unacked frame is resent.")
@click.option("--deadline", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Give up on unacked frames after this many seconds.")
@click.option("--client-key", type=click.Path(dir_okay=False, exists=True),
              help="CURVE: this client's secret certificate (with --server-key).")
@click.option("--server-key", type=click.Path(dir_okay=False, exists=True),
              help="CURVE: the agent's public certificate.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as one JSON line.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False),
              help="Judge the verdicts against the recording's truth; write report.md, confusion.png, latency.png, "
                   "report.json.")
@click.option("--results", "results_db", type=click.Path(dir_okay=False),
              help="The results database the verdicts land in (default: the line config's).")
@click.option("--baseline", "baseline_db", type=click.Path(dir_okay=False, exists=True),
              help="Another run's results database of the same recording (e.g. a --candidate run's "
                   "REPORT/results.db): report the frames whose verdict changed. Regressions, fixed and changed count only when it covers every frame with a verdict.")
@click.option("--gate", default=None, help="Conditions on the report, e.g. 'accuracy>=0.97,regressions<=0' "
                                          "(quote it: the shell reads < and > as redirections); "
                                          "exit 3 when one fails. Metrics: accuracy, regressions, fixed, changed, "
                                          "compared (frames the baseline covers), errors, missing, p99_ms.")
@click.option("--candidate", "candidate_dir", type=click.Path(file_okay=False, exists=True),
              help="Run the recording against this expert store instead, in an agent of its own started here "
                   "(own results database in --report, loopback ports): the line is not touched.")
@click.option("--verdict-timeout", default=120.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds to wait, after the last ack, for every verdict to reach the database.")
@_fail_clearly
def replay(recording: str, line: str, config_path: str | None, endpoint: str | None, rate: float | None,
           window: int, ack_timeout: float, deadline: float, client_key: str | None, server_key: str | None,
           as_json: bool, report_dir: str | None, results_db: str | None, baseline_db: str | None,
           gate: str | None, candidate_dir: str | None, verdict_timeout: float) -> None:
    """Send a recording to a running agent; wait for every ack, resend what was not acked.

    With --report, once every verdict is in, the run is judged against the
    recording's truth (accuracy, confusion per component and label, latency,
    expert versions), and against --baseline's verdicts (fixed, broken,
    changed).  --gate makes the exit code say whether the expert set may go
    on the line.

    \b
    Example:
      coe-agent replay rec/A-500 --line A --rate 250
      coe-agent replay rec/A-500 --line A --candidate var/line-A/experts --report out/run1
      coe-agent replay rec/A-500 --line A --candidate new-experts/ --report out/run2 \\
          --baseline out/run1/results.db --gate 'accuracy>=0.97,regressions<=0'
    """
    from tqdm import tqdm

    from storage.recording import Recording

    from .config import endpoint_parts
    from .replay import replay as do_replay

    rec = Recording(recording)
    conditions = None
    if gate is not None:
        from .judge import parse_gate

        conditions = parse_gate(gate)          # a bad gate fails before a frame is sent
        if report_dir is None:
            raise click.UsageError("--gate needs --report (the gate judges the report)")
    if baseline_db and report_dir is None:
        raise click.UsageError("--baseline needs --report")
    if candidate_dir and report_dir is None:
        raise click.UsageError("--candidate needs --report (its verdicts go into the report's own database)")
    cfg = _config(line, config_path) if (endpoint is None or report_dir) else None
    if candidate_dir:
        remote = [i for i, ex in enumerate(cfg.executors) if ex.node]
        if remote:   # their nodes read the line's own store: the report would judge the line's experts
            raise click.UsageError(f"--candidate runs the candidate on this box, but executors.{remote[0]} runs on "
                                   f"node '{cfg.executors[remote[0]].node}' from that node's store; replay with a "
                                   "config of local executors")
        cfg = cfg.model_copy(update={
            "llm": None, "expert_store": str(candidate_dir), "results_db": str(Path(report_dir) / "results.db"),
            "data_dir": str(Path(report_dir)), "ingest": "router+bind:tcp://127.0.0.1:*",
            "publish": "pub+bind:tcp://127.0.0.1:*", "metrics": cfg.metrics.model_copy(update={"port": 0})})
        if cfg.db_path.exists():
            raise click.UsageError(f"{cfg.db_path} exists: give --report a fresh directory for the candidate run")
        results_db = str(cfg.db_path)
    if baseline_db and report_dir:
        judged_db = Path(results_db) if results_db else cfg.db_path
        if judged_db.exists() and judged_db.samefile(baseline_db):
            raise click.UsageError(f"--baseline {baseline_db} is the database this run writes: compare with "
                                   f"another run's database")
    if endpoint is None:
        endpoint = endpoint_parts(cfg.ingest)[2]
    else:
        _check_endpoint(endpoint)
    if len(rec) == 0:
        raise click.UsageError(f"{recording}: the recording holds no frames")
    problem = _first_unreadable(rec)          # every image before any is sent: no half-sent recording
    if problem:
        raise click.ClickException(problem)
    if baseline_db:
        from .judge import check_baseline

        check_baseline(rec, Path(baseline_db))     # a database it cannot use fails now, not after the replay
    setup = None
    if client_key or server_key:
        if not (client_key and server_key):
            raise click.UsageError("CURVE needs both --client-key and --server-key")
        from .security import client_setup
        setup = client_setup(client_key, server_key)
    candidate = None
    if candidate_dir:                          # built last: every check above fails with nothing to clean up
        from .agent import Agent

        candidate = Agent(cfg, load_spec(cfg.spec_path))
    replayed = False
    try:
        if candidate is not None:
            try:
                endpoint = candidate.start().endpoints["ingest"]
            except BaseException:
                _remove_database(cfg.db_path)  # the failed run's empty database must not block the next try
                raise
        bar = tqdm(total=len(rec), desc="replaying (acked)", unit="frame")
        report = do_replay(rec, endpoint, rate=rate, window=window, ack_timeout=ack_timeout, deadline=deadline,
                           socket_setup=setup, progress=lambda r: bar.update(r.acked - bar.n))
        bar.close()
        if candidate is not None:
            candidate.wait_verdicts(report.accepted, timeout=verdict_timeout)
        replayed = True
    finally:
        if candidate is not None:
            try:
                candidate.stop()
            except Exception as exc:  # noqa: BLE001 - the replay's own error, if any, is the one to show
                if replayed:             # nothing else went wrong: a candidate that did not close is the error
                    raise
                click.echo(f"warning: the candidate agent did not close cleanly: {exc}", err=True)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        reasons = ", ".join(f"{k} {v}" for k, v in report.reasons.most_common()) or "-"
        click.echo(f"sent {report.sent}  accepted {report.accepted}  duplicate {report.duplicate}  "
                   f"rejected {report.rejected} ({reasons})  busy {report.busy}  resent {report.resent}  "
                   f"unacked {len(report.unacked)}  in {report.seconds:.1f} s")
    if report.malformed_acks:
        click.echo(f"warning: {report.malformed_acks} answer(s) from {endpoint} were not acks (is it a coe-edge agent "
                   f"of this version?), e.g. {'; '.join(report.malformed[:3])}", err=True)
    if report.unacked:
        unsent = f", {report.unsent} of them never sent before the deadline" if report.unsent else ""
        raise click.ClickException(f"{len(report.unacked)} frame(s) never acked{unsent}, e.g. {report.unacked[:3]} "
                                   f"(is the agent running on {endpoint}?)")
    if report.accepted == 0 and report.duplicate == 0:
        why = ", ".join(f"{k} {v}" for k, v in report.reasons.most_common()) or "no answer"
        raise click.ClickException(f"the agent accepted none of the {report.sent} frame(s) sent ({why}): "
                                   "is the recording of this line?")
    if report_dir and report.duplicate:
        raise click.ClickException(
            f"{report.duplicate} of {len(rec)} frame(s) were already in the results database (an earlier replay of "
            f"this recording): their verdicts are the old ones, so no report was written; judge a fresh database "
            f"(--candidate DIR, or a line whose results_db is new)")
    if report_dir:
        _judge_replay(rec, cfg, Path(results_db) if results_db else cfg.db_path, baseline_db, report_dir,
                      conditions, verdict_timeout, rejected=set(report.rejected_ids))


def _remove_database(db: Path) -> None:
    """A results database (and its WAL files) a failed candidate start created: nothing of it is a result."""
    for p in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        p.unlink(missing_ok=True)


def _check_endpoint(endpoint: str) -> None:
    """--endpoint: a ZeroMQ address a client can connect to, checked before anything is sent."""
    import re

    m = re.fullmatch(r"tcp://([^\s:]+|\[[0-9a-fA-F:]+\]):(\d+)|ipc://\S+|inproc://\S+", endpoint)
    if not m:
        raise click.BadParameter(f"{endpoint!r}: expected tcp://HOST:PORT (or ipc://PATH)", param_hint="--endpoint")
    if m.group(2) is not None and not 1 <= int(m.group(2)) <= 65535:
        raise click.BadParameter(f"{endpoint!r}: port {m.group(2)} is out of range 1-65535", param_hint="--endpoint")


def _first_unreadable(rec) -> str | None:
    """The first frame of `rec` whose image cannot be read as the manifest says, in words; None if all can."""
    from coe import CoEError

    for f in rec:
        try:
            rec.payload(f)
        except (CoEError, OSError, ValueError) as exc:
            return f"{exc}; nothing was sent"
    return None


def _judge_replay(rec, cfg, db: Path, baseline_db: str | None, report_dir: str, conditions, timeout: float, *,
                  rejected: set[str] = frozenset()) -> None:
    """Wait for the recording's verdicts, judge them, write the report, apply the gate (exit 3 on failure).

    Frames the agent rejected (`rejected`) get no verdict: they are not waited for, and count as missing."""
    import sqlite3
    import time

    from coe import load_spec

    from .judge import failed_conditions, judge, write_report

    ids = {f.header["frame_id"] for f in rec} - set(rejected)
    if rejected:
        click.echo(f"replay report: {len(rejected)} frame(s) the agent rejected have no verdict and count as "
                   f"missing (e.g. {', '.join(sorted(rejected)[:3])})", err=True)
    until = time.monotonic() + timeout
    while True:
        have = 0
        if db.is_file():
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                have = sum(1 for (fid,) in con.execute("SELECT frame_id FROM verdicts") if fid in ids)
            except sqlite3.Error:
                have = 0
            finally:
                con.close()
        if have >= len(ids):
            break
        if time.monotonic() > until:
            click.echo(f"replay report: waited {timeout:g} s and {len(ids) - have} of {len(ids)} frame(s) still have "
                       f"no verdict; judging what is there (they count as missing)", err=True)
            break
        time.sleep(0.2)
    j = judge(load_spec(cfg.spec_path), rec, db, baseline_db=baseline_db,  # versions: what the rows name
              baseline_checked=True)                                        # by `check_baseline`, before sending
    md = write_report(j, report_dir, conditions)
    click.echo(f"judged {j.judged} of {j.frames} frames: accuracy {100 * j.accuracy:.2f}%, missing {j.missing}, "
               f"errors {j.errors}" + (f"; vs baseline fixed {len(j.fixed)}, broken {len(j.broken)}, "
                                        f"changed {len(j.changed)}" if baseline_db else "") + f"; report {md}")
    click.echo(json.dumps({"replay_report": str(md), "accuracy": round(j.accuracy, 5) if j.judged else None, **{
        k: (None if v != v else v) for k, v in j.metrics().items() if k != "accuracy"}}))   # NaN: not measured
    failed = failed_conditions(j, conditions) if conditions else []
    if failed:
        click.echo("gate FAILED: " + "; ".join(failed), err=True)
        raise SystemExit(3)


@cli.command()
@line_options
@click.option("--verdict", type=click.Choice(["pass", "defect", "error"]), help="Only this verdict.")
@click.option("--board", help="Only this board_id.")
@click.option("--component", help="Only this component type.")
@click.option("--since", help="Only verdicts decided at or after this time (epoch seconds or ISO 8601).")
@click.option("--limit", default=20, show_default=True, help="Rows per page (1..1000).")
@click.option("--next", "cursor", help="Start after this cursor (printed under a full page; as the API's `next`).")
@click.option("--db", type=click.Path(dir_okay=False), help="Database file (default: the config's results_db).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@_fail_clearly
def results(line: str, config_path: str | None, verdict: str | None, board: str | None, component: str | None,
            since: str | None, limit: int, cursor: str | None, db: str | None, as_json: bool) -> None:
    """Query verdicts from the line's results database, newest first.

    The same query as the status page's /api/verdicts (storage.queries), so
    both list the same rows for the same filters.  Before the line's agent has
    run, the demo's database (written by `coe-agent demo`) is used, and said so.

    \b
    Example:
      coe-agent results --line A --verdict defect --limit 10
      coe-agent results --line A --board B000003 --json
      coe-agent results --line A --since 2025-01-31T06:00:00 --component R0402
    """
    from storage.queries import QueryError, VerdictQuery, parse_cursor, parse_since, query_verdicts
    from storage.results import ResultStore

    path = Path(db) if db else _line_results_db(_config(line, config_path))
    try:
        q = VerdictQuery(verdict=verdict, component=component, board=board,
                         since=parse_since(since) if since is not None else None, limit=limit,
                         after=parse_cursor(cursor) if cursor else None)
    except QueryError as exc:
        raise click.BadParameter(exc.message, param_hint=f"'--{exc.param}'") from None
    import sqlite3

    if not path.is_file():
        raise click.ClickException(f"{path}: no results database there")
    try:
        rs = ResultStore(path, readonly=True)
        try:
            page = query_verdicts(rs.db.conn, q)
        finally:
            rs.close()
    except sqlite3.Error as exc:
        raise click.ClickException(f"{path}: not a coe-edge results database ({exc})") from None
    if as_json:
        for r in page.rows:
            click.echo(json.dumps(r))
        return
    if not page.rows:
        click.echo("no verdicts match")
        return
    cols = ("frame_id", "board_id", "component", "verdict", "latency_ms", "reason")
    table = [[r["frame_id"], r["board_id"] or "", r["component"] or "", r["verdict"],
              f"{r['latency_ms']:.1f}" if r["latency_ms"] is not None else "", r["reason"] or ""] for r in page.rows]
    widths = [max(len(c), *(len(str(t[i])) for t in table)) for i, c in enumerate(cols)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        click.echo("  ".join(str(v).ljust(w) for v, w in zip(t, widths)))
    if page.next:
        click.echo(f"more: add --next {page.next}", err=True)


def _line_results_db(cfg: LineConfig) -> Path:
    """The line's results database; before the agent has run there, the demo's (with a note on stderr)."""
    path = cfg.db_path
    if not path.is_file():
        from .demo import demo_db_path

        demo = demo_db_path(cfg)
        if demo.is_file():
            click.echo(f"(no results in {path} yet: showing the demo's, {demo})", err=True)
            return demo
    return path


from .experts_cli import experts  # noqa: E402
cli.add_command(experts)
from .profile_cli import profile  # noqa: E402
cli.add_command(profile)


from .bench_cli import bench  # noqa: E402

cli.add_command(bench)
from .router_cli import router, probabilities  # noqa: E402
cli.add_command(router)
cli.add_command(probabilities)
from .llm_cli import llm  # noqa: E402
cli.add_command(llm)
from .cluster_cli import cluster  # noqa: E402
cli.add_command(cluster)


@cli.group()
def keys() -> None:
    """CURVE keys for factory networks.

    \b
    Example:
      coe-agent keys generate server --out keys/
      coe-agent keys generate aoi-1 --out keys/
    """


@keys.command("generate")
@click.argument("name")
@click.option("--out", "-o", default="keys", show_default=True, type=click.Path(file_okay=False),
              help="Folder for NAME.key and NAME.key_secret (a new folder is created owner-only; an existing one "
                   "keeps its mode).")
@click.option("--force", is_flag=True,
              help="Replace an existing keypair (clients that trust the old public key are then refused).")
@_fail_clearly
def keys_generate(name: str, out: str, force: bool) -> None:
    """Make NAME.key (public: give to the other side) and NAME.key_secret (keep; owner-only).

    \b
    Example:
      coe-agent keys generate server --out /etc/coe/keys
      coe-agent keys generate aoi-1 --out /etc/coe/keys
    """
    from .security import generate

    public, secret = generate(out, name, force=force)
    click.echo(f"public: {public}\nsecret: {secret}")


def quiet_third_party(env=None) -> None:
    """Keep libraries' chatter off the terminal: ultralytics' settings-file notes, its online checks.

    Set at the start of the command, before anything imports ultralytics (it
    reads these when first imported); a variable already set wins.
    """
    import os

    env = os.environ if env is None else env
    env.setdefault("YOLO_VERBOSE", "False")
    env.setdefault("YOLO_OFFLINE", "1")


def main() -> None:
    quiet_third_party()
    cli(prog_name="coe-agent")


if __name__ == "__main__":
    main()
