"""`coe-agent profile`: measure the line's experts on this machine and write profile.json.

A thin layer over `executors.profiler` (the measuring) and, where it exists,
`executors.tuning.tune` (the memory-split and executor-count searches).

The command object is created before `.cli` is imported, and the options and
error handling it shares with the other commands are attached right after:
`cli.py` imports this module at its end to register `profile`, and defining
it first keeps that working whichever of the two modules is imported first
(as `experts_cli.py` does for its group).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from coe import CoEError, load_spec

if TYPE_CHECKING:
    from executors.profile import Profile

_MB = 1e6


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that refuses nan and inf too: nan fails no comparison, so FloatRange lets it through (and
    it reached the JSON output as NaN, which is not JSON).  Shared by the commands' float options."""

    def convert(self, value, param, ctx):
        import math

        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def _batch_sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers like 1,2,4,8, got {value!r}") from None
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise click.BadParameter(f"need at least two distinct positive batch sizes, got {value!r}")
    return tuple(sorted(set(sizes)))


@click.command()
@click.option("--out", "-o", type=click.Path(dir_okay=False),
              help="Where to write the profile (default: {data_dir}/profile.json); plots go next to it.")
@click.option("--batch-sizes", default="1,2,4,8,16,32", show_default=True, callback=_batch_sizes,
              help="Batch sizes to time, comma-separated.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Timed rounds per batch size, and loads per tier (the median is kept).")
@click.option("--concurrency-seconds", default=0.5, show_default=True, type=FiniteFloatRange(min=0, min_open=True),
              help="How long k executors run together for each point of a device's concurrency curve.")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Write PNG plots next to the profile.")
@click.option("--link-rounds", default=50, show_default=True, type=click.IntRange(5, 10_000),
              help="With a `cluster:` section: round trips per node for each link probe.")
def profile(line: str, config_path: str | None, out: str | None, batch_sizes: tuple[int, ...], repeats: int,
            concurrency_seconds: float, plots: bool, link_rounds: int) -> None:
    """Microbenchmark the line's experts on this machine and write profile.json.

    Each (architecture, device) of the line is profiled once, with one of its
    experts loaded through the real tiers: batch latency K*n+B, the max useful
    batch, weight and per-sample activation bytes, and load latency from SSD
    (cold) and from host memory.  Then each device's concurrency curve: the
    aggregate throughput of 1..k executors running at once, relative to one.
    Then the box's storage: the raw disk read rate (cold reads of the same
    expert files), the exponent decoder's rate per thread on a bf16 sample
    (alone, and with as many threads decoding at once as one compressed load
    uses), and the decode rate and ratio of the line's own experts
    compressed; the output says whether compression pays on this box (it
    does when decoding is faster than the disk), with the figures.  Then the memory-split and
    executor-count searches run where they are available, and the profile
    keeps their outcome (executors and expert memory per device).  The
    scheduler and the simulated device read the result.  A line with a
    `cluster:` section also has the link to each executor node measured
    (as `coe-agent cluster profile` does) into {data_dir}/links.json, which
    prices the frames a remote executor is sent.

    \b
    Example:
      coe-agent profile --line A
      coe-agent profile --line A --batch-sizes 1,4,16 --repeats 5 --out /tmp/profile.json
    """
    from tqdm import tqdm

    from executors.profiler import check_devices, plan_targets, plot_profile, profile_line, step_count
    from executors.storage_profiler import verdict
    from storage.expert_store import ExpertStore

    cfg = _config(line, config_path)
    check_devices(cfg)
    model = load_spec(cfg.spec_path)
    if not cfg.store_path.is_dir():
        raise CoEError(f"no expert store at {cfg.store_path} (run: coe-agent zoo build --line {cfg.line})")
    store = ExpertStore(cfg.store_path, verify=cfg.expert_verify)
    path = Path(out) if out else Path(cfg.data_dir) / "profile.json"
    # the searches count a split in experts' bytes, the store's (a spec has none): every expert's, checked
    # before minutes of profiling
    sizes = {e.id: e.nbytes for e in store.entries()}
    missing = sorted(set(model.experts) - set(sizes))
    if missing:
        raise CoEError(f"{len(missing)} expert(s) of the spec are not in {cfg.store_path} (e.g. '{missing[0]}'): "
                       f"run coe-agent zoo build --line {cfg.line}")

    targets = plan_targets(cfg, model, store)
    click.echo(f"profiling line {cfg.line}: {len(targets)} (arch, device) pair(s), batch sizes "
               f"{','.join(map(str, batch_sizes))}, {repeats} repeat(s)")
    bar = tqdm(total=step_count(targets, batch_sizes, repeats, cfg), desc="profiling", unit="step")

    def step(msg: str) -> None:
        bar.update(1)
        bar.write(msg)
    try:
        prof = profile_line(cfg, model, store, batch_sizes=batch_sizes, repeats=repeats, progress=step,
                            concurrency_seconds=concurrency_seconds)
    finally:
        bar.close()

    tune = _tuner()
    if tune is None:
        click.echo("memory-split and executor-count searches skipped: executors.tuning is not available yet; "
                   "the profile keeps the config's executor counts and budgets")
    else:
        click.echo("running the memory-split and executor-count searches ...")
        prof = tune(prof, model.with_sizes(sizes), cfg)

    from executors.profile import Profile, box_identity, spec_digest

    prof.made_for = {"line": cfg.line, "spec": spec_digest(cfg.spec_path),
                     "box": box_identity(sorted({ex.device for ex in cfg.executors if not ex.node}))}
    Profile.from_json(prof.to_json(), str(path))   # what the agent will refuse at start is refused here, unsaved
    prof.save(path)
    links = _profile_links(cfg, link_rounds) if cfg.cluster is not None else []
    written = plot_profile(prof, path.parent) if plots else []
    click.echo("")
    for row in format_table(prof):
        click.echo(row)
    click.echo(verdict(prof.storage))
    if prof.storage is not None:
        click.echo(f"storage: {prof.storage.source}")
    click.echo(f"\n{prof.source}")
    for note in prof.notes:
        click.echo(f"note: {note}")
    click.echo(f"profile: {path}")
    for row in links:
        click.echo(row)
    for p in written:
        click.echo(f"plot:    {p}")


def _profile_links(cfg, rounds: int) -> list[str]:
    """The links to the line's executor nodes into {data_dir}/links.json, at the frame size already chosen there
    (`coe-agent cluster profile --frame-bytes`), else a raw 224x224 crop's."""
    from executors.links import DEFAULT_FRAME_BYTES, Links

    from .cluster import describe_links, links_path, profile_links

    path = links_path(cfg)
    frame_bytes = Links.load(path).frame_bytes if path.is_file() else DEFAULT_FRAME_BYTES
    click.echo(f"measuring the link to each executor node ({rounds} round trips per probe) ...")
    links = profile_links(cfg, rounds=rounds, frame_bytes=frame_bytes, command="coe-agent profile")
    return [*(f"link {row}" for row in describe_links(links)), f"links:   {links.save(path)}"]


def _tuner():
    """`executors.tuning.tune` if that module exists; None if it does not (yet).

    Only the module's own absence counts: an import error inside it is a bug
    and propagates.
    """
    try:
        from executors.tuning import tune
    except ImportError as exc:
        if exc.name != "executors.tuning":
            raise
        return None
    return tune


def format_table(prof: "Profile") -> list[str]:
    """The profile's per-(arch, device) figures as aligned text rows, then one row per device.

    A device row gives its executor count and expert memory (the searches'
    outcome when they ran), and one more its concurrency curve with where it
    came from.
    """
    cols = ("arch", "device", "K ms", "B ms", "max batch", "weights MB", "act MB/sample", "SSD load ms",
            "host load ms")

    def ms(secs: float | None) -> str:
        return "-" if secs is None else f"{secs * 1e3:.2f}"
    rows = [[a.arch, a.device, ms(a.K), ms(a.B), str(a.max_batch), f"{a.weight_bytes / _MB:.1f}",
             f"{a.activation_bytes / _MB:.2f}", ms(a.load_seconds.get("ssd")), ms(a.load_seconds.get("host"))]
            for _, a in sorted(prof.archs.items())]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]

    def fmt(vals) -> str:
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths))).rstrip()
    out = [fmt(cols), *(fmt(r) for r in rows)]
    for name, d in sorted(prof.devices.items()):
        experts = "-" if d.expert_memory is None else f"{d.expert_memory / _MB:.0f} MB"
        out.append(f"{name}: {d.executors} executor(s), experts {experts} of {d.memory / _MB:.0f} MB")
        if d.concurrency:
            out.append(f"{name} concurrency: {' '.join(f'{c:.2f}' for c in d.concurrency)} ({d.concurrency_source})")
    return out


from .cli import _config, _fail_clearly, line_options  # noqa: E402  (after `profile`: see the module doc)

line_options(profile)
profile.params[:0] = [profile.params.pop(), profile.params.pop()]  # --line, --config first, as elsewhere
profile.callback = _fail_clearly(profile.callback)
