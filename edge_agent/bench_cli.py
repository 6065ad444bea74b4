"""`coe-agent bench`: the CLI over edge_agent.bench."""
from __future__ import annotations

from pathlib import Path

import click

from executors.systems import DEFAULT

from .cli import _config, _fail_clearly, line_options


@click.command("bench")
@click.option("--workload", "-w", default="A1,A2,B1,B2", show_default=True,
              help="Tasks, comma separated: A1 A2 (board A, 352 types) B1 B2 (board B, 342 types).")
@click.option("--sim/--real", default=True, help="Simulate on a profile (default) or run real experts here.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False),
              help="Profile for --sim (default: configs/profiles/gpu-class.json, documented assumptions).")
@click.option("--policies", default=",".join(DEFAULT), show_default=True,
              help="Systems to compare, comma separated.")
@click.option("--init", type=click.Choice(["warm", "cold"]), default="warm", show_default=True,
              help="Pools filled by usage probability before the task (warm) or empty (cold), for every system.")
@click.option("--skew", type=float, help="Zipf skew of component-type frequency (default 0.8).")
@click.option("--types", type=int, help="Component types on the board (default: 352 / 342).")
@click.option("--detector-share", type=float, help="Share of types followed by a detector (default 0.5).")
@click.option("--requests", type=int, help="Override the task's request count.")
@click.option("--load", "load", default="0.5,0.8", show_default=True, callback=lambda c, p, v: _loads(v),
              help="Also run coserve, coserve-paper and samba with frames arriving evenly at F x the highest rate "
                   "each sustains (see README) and report p50/p99 there; comma-separated F in (0, 1], or 'none'.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 20),
              help="--real: run both systems this many times, side by side, and report the spread.")
@click.option("--out", type=click.Path(file_okay=False), help="Where the PNG goes (default: {data_dir}/bench).")
@click.option("--json", "as_json", is_flag=True, help="Only the JSON line.")
@line_options
@_fail_clearly
def bench(workload: str, sim: bool, profile_path: str | None, policies: str, init: str, skew: float | None,
          types: int | None, detector_share: float | None, requests: int | None, load: tuple[float, ...],
          repeats: int, out: str | None, as_json: bool, line: str, config_path: str | None) -> None:
    """Compare CoServe with Samba-CoE and the ablations: throughput, switches, p99, bound.

    \b
    Example:
      coe-agent bench --workload A1,B2 --sim
      coe-agent bench --sim --load 0.5,0.8 --skew 1.2 --types 120
      coe-agent bench --sim --profile var/line-A/profile.json --policies coserve,samba --json
      coe-agent bench --real
    """
    from executors.profile import Profile

    from . import bench as B

    cfg = _config(line, config_path)
    out_dir = Path(out) if out else Path(cfg.data_dir) / "bench"
    if not sim:
        runs, info = B.run_real(Path(cfg.data_dir), repeats=repeats,
                                progress=lambda m: None if as_json else click.echo(m, err=True))
        tables = [B.table(reports) for reports in runs]
        if not as_json:
            click.echo(f"real run on {B.machine()}: {info['requests']} frames, {info['experts']} experts "
                       f"({info['zoo_mb']} MB), {info['memory_mb']:.0f} MB per system, cold SSD loads; "
                       f"costs from {info['profile']}")
            for i, rows in enumerate(tables):
                click.echo(B.format_table(f"repetition {i + 1}/{len(tables)}:", rows))
                for r in rows:
                    click.echo(f"  {r['system']}: scheduling {r['sched_share'] * 100:.3f}% and expert management "
                               f"{r['manage_share'] * 100:.3f}% of executor time; {r['decision_us']:.1f} us per "
                               f"decision")
            ratios = info["ratios"]
            click.echo(f"CoServe vs Samba-CoE (real): {min(ratios):.2f}x to {max(ratios):.2f}x over "
                       f"{len(ratios)} repetition(s) (target >= 3x)")
        click.echo(B.dumps({"bench": "coserve", "mode": "real", "machine": B.machine(), "info": info,
                            "runs": tables}))
        return
    prof = Profile.load(profile_path or B.GPU_CLASS)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if "samba" not in names:
        names.append("samba")
    overrides = {k: v for k, v in {"skew": skew, "types": types, "detector_share": detector_share,
                                   "requests": requests}.items() if v is not None}
    wls = [w.strip().upper() for w in workload.split(",") if w.strip()]
    results = B.run_sim(wls, prof, names, init=init, overrides=overrides, loads=load)
    rows = {wl: B.table(reps) for wl, reps in results.items()}
    mean_decision = B.overhead(prof)
    png = B.plot(rows, out_dir / "bench-throughput.png", f"simulation on profile: {prof.source[:90]}")
    if not as_json:
        click.echo(f"simulation (virtual clock, profiled costs) on profile: {prof.source}")
        for wl, r in rows.items():
            click.echo("")
            click.echo(B.format_table(f"task {wl}:", r))
        co = [r for rs in rows.values() for r in rs if r["system"] == "coserve"]
        if co:
            click.echo("")
            for line_ in B.summary(co, load):
                click.echo(line_)
            click.echo(f"scheduler: {mean_decision * 1e6:.1f} us per decision with 3,500 queued requests "
                       f"(measured here, real CPU time); scheduling "
                       f"{max(r['sched_share'] for r in co) * 100:.3f}% and expert management "
                       f"{max(r['manage_share'] for r in co) * 100:.4f}% of executor time at most")
        click.echo(f"chart: {png}")
    click.echo(B.dumps({"bench": "coserve", "mode": "sim", "profile": prof.source, "init": init, "loads": list(load),
                        "overrides": overrides, "decision_us_3500_queued": round(mean_decision * 1e6, 2),
                        "tasks": rows, "chart": str(png)}))


def _loads(value: str) -> tuple[float, ...]:
    if value.strip().lower() in ("", "none", "0"):
        return ()
    try:
        loads = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated fractions like 0.5,0.8, got {value!r}") from None
    if any(not 0 < f <= 1 for f in loads):
        raise click.BadParameter(f"each F must be in (0, 1] (a fraction of the saturation throughput), got {value!r}")
    return loads
