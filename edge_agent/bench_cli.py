"""`coe-agent bench`: the CLI over edge_agent.bench."""
from __future__ import annotations

from pathlib import Path

import click

from coe.errors import CoEError
from executors.systems import DEFAULT

from .cli import _config, _fail_clearly, _given, line_options, torch_device
from .profile_cli import FiniteFloatRange


@click.command("bench")
@click.option("--workload", "-w", default="A1,A2,B1,B2", show_default=True, callback=lambda c, p, v: _workloads(v),
              help="Tasks, comma separated: A1 A2 (board A, 352 types) B1 B2 (board B, 342 types).")
@click.option("--sim/--real", default=True, help="Simulate on a profile (default) or run real experts here.")
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False),
              help="Profile for --sim (default: configs/profiles/gpu-class.json, documented assumptions).")
@click.option("--policies", default=",".join(DEFAULT), show_default=True,
              help="Systems to compare, comma separated.")
@click.option("--init", type=click.Choice(["warm", "cold"]), default="warm", show_default=True,
              help="Pools filled by usage probability before the task (warm) or empty (cold), for every system.")
@click.option("--skew", type=FiniteFloatRange(0, 10), help="Zipf skew of component-type frequency (default 0.8).")
@click.option("--types", type=click.IntRange(min=1), help="Component types on the board (default: 352 / 342).")
@click.option("--board-size", type=click.IntRange(min=1), help="Component placements on the board (default 500): with many --types "
              "give at least as many, or most types never appear.")
@click.option("--detector-share", type=FiniteFloatRange(0, 1), help="Share of types followed by a detector (default 0.5).")
@click.option("--requests", type=click.IntRange(min=1), help="Override the task's request count.")
@click.option("--load", "load", default="0.5,0.8", show_default=True, callback=lambda c, p, v: _loads(v),
              help="Also run coserve, coserve-paper and samba with frames arriving evenly at F x the highest rate "
                   "each sustains (see README) and report p50/p99 there; comma-separated F in (0, 1], or 'none'.")
@click.option("--device", default="cpu", show_default=True, callback=torch_device,
              help="--real: cpu, or cuda[:N]: each system's GPU executor gets 400 MB of GPU memory behind a 400 MB "
                   "pinned host tier; CoServe adds a 400 MB CPU executor, which Samba-CoE gets as host tier.")
@click.option("--arrival-ms", type=FiniteFloatRange(0, min_open=True),
              help="--real: one frame every this many ms (default: the task's, 4 ms). A GPU box keeps up with "
                   "4 ms, so its throughput is the arrival rate: 0.5 measures it saturated.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 20),
              help="--real: run both systems this many times, side by side, and report the spread.")
@click.option("--compression-ratio", type=FiniteFloatRange(0, 1, min_open=True),
              help="--sim: also run every system with each expert stored exponent-compressed at this ratio "
                   "(stored/plain bytes, e.g. 0.66 for bf16) and report the throughput of both side by side.")
@click.option("--decode-rate", callback=lambda c, p, v: _decode_rate(v),
              help="With --compression-ratio: decoded bytes/s per decode thread (e.g. 1.3e9), or 'here' to measure "
                   "it on this machine now (default: the profile's, from `coe-agent profile`).")
@click.option("--decode-threads", type=click.IntRange(min=1),
              help="With --compression-ratio: threads one load decodes with, at the per-thread rate (default: the "
                   "profile's; with --decode-rate here, this machine's; else 1).  A profile's decode rate measured "
                   "on the line's own experts already counts its threads.")
@click.option("--boxes", callback=lambda c, p, v: _boxes(v),
              help="--sim: run on 1..N boxes, each with the profile's GPU, CPU, SSD and host tier, the front box "
                   "reaching the others over a link (e.g. 1,2,4); reports throughput and switches per box count.")
@click.option("--link-gbps", type=FiniteFloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="With --boxes: the link's bandwidth to each other box, Gb/s.")
@click.option("--link-ms", type=FiniteFloatRange(min=0), default=0.1, show_default=True,
              help="With --boxes: the link's one-way latency, ms.")
@click.option("--frame-bytes", type=click.IntRange(min=1),
              help="With --boxes: bytes one frame takes on the link (default 150528: a raw 224x224 RGB crop).")
@click.option("--out", type=click.Path(file_okay=False), help="Where the PNG goes (default: {data_dir}/bench).")
@click.option("--json", "as_json", is_flag=True, help="Only the JSON line.")
@line_options
@_fail_clearly
def bench(workload: str, sim: bool, profile_path: str | None, policies: str, init: str, skew: float | None,
          types: int | None, board_size: int | None, detector_share: float | None, requests: int | None,
          load: tuple[float, ...], device: str, arrival_ms: float | None,
          repeats: int, compression_ratio: float | None, decode_rate: float | str | None,
          decode_threads: int | None, boxes: list[int] | None, link_gbps: float, link_ms: float,
          frame_bytes: int | None, out: str | None, as_json: bool, line: str, config_path: str | None) -> None:
    """Compare CoServe with Samba-CoE and the ablations: throughput, switches, p99, bound.

    \b
    Example:
      coe-agent bench --workload A1,B2 --sim
      coe-agent bench --sim --load 0.5,0.8 --skew 1.2 --types 120
      coe-agent bench --sim --profile var/line-A/profile.json --policies coserve,samba --json
      coe-agent bench --sim --compression-ratio 0.66 --decode-rate here --load none
      coe-agent bench --sim --boxes 1,2,4 --types 2000 --board-size 2000 -w A2 --init cold
      coe-agent bench --real
      coe-agent bench --real --device cuda --arrival-ms 0.5
    """
    from executors.profile import Profile

    from . import bench as B

    _refuse_what_does_not_apply(sim, boxes is not None)
    cfg = _config(line, config_path)
    out_dir = Path(out) if out else Path(cfg.data_dir) / "bench"
    if sim and (device != "cpu" or arrival_ms is not None):
        raise CoEError("--device and --arrival-ms are for --real runs; --sim takes the devices from --profile")
    if not sim:
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise CoEError(f"--device {device}: no CUDA device here")
        runs, info = B.run_real(Path(cfg.data_dir), repeats=repeats, device=device,
                                interval=arrival_ms / 1e3 if arrival_ms is not None else None,
                                progress=lambda m: None if as_json else click.echo(m, err=True))
        tables = [B.table(reports) for reports in runs]
        if not as_json:
            click.echo(f"real run on {B.machine()}: {info['requests']} frames, {info['experts']} experts "
                       f"({info['zoo_mb']} MB), one frame every {info['interval_ms']:g} ms, "
                       f"{info['memory_mb']:.0f} MB per executor, cold SSD loads; "
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
    if (decode_rate is not None or decode_threads is not None) and compression_ratio is None:
        raise click.UsageError("--decode-rate and --decode-threads only apply with --compression-ratio")
    prof = Profile.load(profile_path or B.GPU_CLASS)
    if boxes is not None:
        _bench_boxes(B, prof, boxes, workload, policies if _given("policies") else None, init, skew, types,
                     board_size, detector_share, requests, link_gbps, link_ms, frame_bytes, as_json)
        return
    if load and requests is not None and requests < 2:
        raise click.UsageError(f"--requests {requests}: the sustained rate of --load needs frames arriving over "
                               f"time, at least 2 (or --load none)")
    comp = None
    if compression_ratio is not None:
        try:
            comp = B.sim_compression(prof, compression_ratio, decode_rate, decode_threads)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if "samba" not in names:
        names.append("samba")
    overrides = {k: v for k, v in {"skew": skew, "types": types, "board_size": board_size,
                                   "detector_share": detector_share,
                                   "requests": requests}.items() if v is not None}
    wls = [w.strip().upper() for w in workload.split(",") if w.strip()]
    results = B.run_sim(wls, prof, names, init=init, overrides=overrides, loads=load)
    rows = {wl: B.table(reps) for wl, reps in results.items()}
    packed = compared = None
    if comp is not None:
        packed = {wl: B.table(reps) for wl, reps in
                  B.run_sim(wls, prof, names, init=init, overrides=overrides, loads=load, compression=comp).items()}
        factor = min(comp.load_factors(prof).values(), default=1.0)
        compared = {wl: B.compare(rows[wl], packed[wl], factor) for wl in rows}
    mean_decision = B.overhead(prof)
    png = B.plot(rows, out_dir / "bench-throughput.png", f"simulation on profile: {prof.source}")
    if not as_json:
        click.echo(f"simulation (virtual clock, profiled costs) on profile: {prof.source}")
        click.echo(f"init: {init} ({_INIT[init]}), for every system")
        if comp is not None:
            _echo_compression(comp, prof, compared)
        else:
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
    extra = {}
    if comp is not None:
        st = comp.storage
        extra = {"compression": {"ratio": comp.ratio,
                                 "decode_bps_per_thread": round(st.decode_bps) if st.decode_bps else None,
                                 "decode_threads": st.decode_threads, "decode_bps": round(st.decode_total_bps),
                                 "disk_bps": round(st.disk_bps) if st.disk_bps else None, "source": st.source,
                                 "load_factor": {k: round(v, 4) for k, v in comp.load_factors(prof).items()}},
                 "compressed_tasks": packed, "compression_gain": compared}
    click.echo(B.dumps({"bench": "coserve", "mode": "sim", "profile": prof.source, "init": init, "loads": list(load),
                        "overrides": overrides, "decision_us_3500_queued": round(mean_decision * 1e6, 2),
                        "tasks": rows, "chart": str(png), **extra}))


def _bench_boxes(B, prof, boxes: list[int], workload: str, policies: str | None, init: str, skew, types, board_size,
                 detector_share, requests, link_gbps: float, link_ms: float, frame_bytes: int | None, as_json: bool) -> None:
    """`bench --sim --boxes`: the same frames on 1..N simulated boxes; CoServe alone unless --policies says
    (`policies` None: not given)."""
    from executors.links import DEFAULT_FRAME_BYTES, Link

    names = ["coserve"] if policies is None else [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise click.BadParameter(f"name at least one system, got {policies!r}", param_hint="'--policies'")
    frame_bytes = frame_bytes or DEFAULT_FRAME_BYTES
    link = Link.ethernet(link_gbps, link_ms)
    overrides = {k: v for k, v in {"skew": skew, "types": types, "board_size": board_size,
                                   "detector_share": detector_share,
                                   "requests": requests}.items() if v is not None}
    wls = [w.strip().upper() for w in workload.split(",") if w.strip()]
    try:
        rows = B.run_boxes(wls, prof, boxes, names, link, overrides=overrides, frame_bytes=frame_bytes, init=init)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not as_json:
        click.echo(f"simulation (virtual clock, profiled costs, not a measurement) on profile: {prof.source}")
        click.echo(f"link to each other box: {link.source}; {frame_bytes} bytes a frame on it; frames arrive one "
                   f"every 4 ms / {max(boxes)} (a flood for every box count)")
        click.echo(f"init: {init} ({_INIT[init]}), for every box count")
        for wl, r in rows.items():
            click.echo("")
            click.echo(B.format_boxes(f"task {wl}" + (f" with {overrides}" if overrides else "") + ":", r))
    click.echo(B.dumps({"bench": "boxes", "mode": "sim", "profile": prof.source, "link": {
        "bandwidth_bps": link.bandwidth_bps, "latency_s": link.latency_s}, "frame_bytes": frame_bytes, "init": init,
        "overrides": overrides, "tasks": rows}))


_INIT = {"warm": "pools filled by usage probability before the task", "cold": "pools empty at the start"}

# the options each mode does not use (--device and --arrival-ms with --sim are refused in `bench` itself)
_SIM_ONLY = ("workload", "profile_path", "policies", "init", "skew", "types", "board_size", "detector_share",
             "requests", "load", "compression_ratio", "decode_rate", "decode_threads", "boxes", "out")
_BOXES_ONLY = ("link_gbps", "link_ms", "frame_bytes")
_REAL_ONLY = ("repeats",)
_NOT_WITH_BOXES = ("load", "compression_ratio", "decode_rate", "decode_threads", "out")


def _refuse_what_does_not_apply(sim: bool, boxes: bool) -> None:
    """A usage error naming every option given on the command line that the chosen mode would ignore."""
    ctx = click.get_current_context()
    flags = {p.name: max(p.opts, key=len) for p in ctx.command.params}

    def refuse(names: tuple[str, ...], why: str) -> None:
        given = [flags[n] for n in names if _given(n)]
        if given:
            raise click.UsageError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply {why}")
    if not sim:
        refuse(_SIM_ONLY + _BOXES_ONLY, "to --real (it runs its own task of real experts on this machine and takes "
                                        "--device, --arrival-ms, --repeats and --json)")
        return
    refuse(_REAL_ONLY, "to --sim (it is for --real)")
    if boxes:
        refuse(_NOT_WITH_BOXES, "with --boxes (it reports the flood throughput per box count, with no chart)")
    else:
        refuse(_BOXES_ONLY, "without --boxes (they set the link between boxes)")


def _workloads(value: str) -> str:
    """--workload: comma-separated task names (A1 A2 B1 B2), at least one."""
    from coe.workload import TASKS

    wls = [w.strip().upper() for w in value.split(",") if w.strip()]
    if not wls:
        raise click.BadParameter(f"name at least one task ({', '.join(sorted(TASKS))}), got {value!r}")
    unknown = [w for w in wls if w not in TASKS]
    if unknown:
        raise click.BadParameter(f"unknown task {unknown[0]!r} (known: {', '.join(sorted(TASKS))})")
    return ",".join(wls)


def _boxes(value: str | None) -> list[int] | None:
    """--boxes: comma-separated box counts, each >= 1."""
    if value is None:
        return None
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated box counts like 1,2,4, got {value!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise click.BadParameter(f"each box count must be >= 1, got {value!r}")
    return counts


def _echo_compression(comp, prof, compared: dict[str, list[dict]]) -> None:
    """The what-if's terms, a side-by-side table per task, and the gain against the bytes saved."""
    from . import bench as B

    st = comp.storage
    factors = comp.load_factors(prof)
    lo, hi = min(factors.values(), default=1.0), max(factors.values(), default=1.0)
    disk = f"{st.disk_bps / 1e9:.2f} GB/s" if st.disk_bps else "each arch's profiled SSD load rate"
    how = ("measured on the line's experts" if st.load_decode_bps else
           f"{st.decode_bps / 1e9:.2f} GB/s per thread x {st.decode_threads} thread(s)")
    click.echo(f"compression what-if: every expert stored at ratio {comp.ratio:.2f} (stored/plain bytes) and "
               f"decoded at {st.decode_total_bps / 1e9:.2f} GB/s ({how}); disk {disk}; an SSD load's transfer costs "
               f"max(stored/disk, decoded/decode) = {lo:.2f}x" + (f" to {hi:.2f}x" if hi - lo > 5e-3 else "")
               + " the plain one")
    click.echo(f"  ({st.source})")
    for wl, rows in compared.items():
        click.echo("")
        click.echo(B.format_compare(f"task {wl}: plain store vs compressed at ratio {comp.ratio:.2f}:", rows))
    click.echo("")
    ceiling = 1 / lo
    for name in [r["system"] for r in next(iter(compared.values()))]:
        gains = [r["gain"] for rows in compared.values() for r in rows if r["system"] == name]
        click.echo(f"compression gain, {name}: {min(gains):.2f}x to {max(gains):.2f}x over {', '.join(compared)} "
                   f"(ceiling if wholly SSD-bound: {ceiling:.2f}x)")


def _decode_rate(value: str | None) -> float | str | None:
    """--decode-rate: 'here', or a positive number of decoded bytes per second per thread."""
    if value is None:
        return None
    if value.strip().lower() == "here":
        return "here"
    try:
        rate = float(value)
    except ValueError:
        raise click.BadParameter(f"expected decoded bytes per second per thread (e.g. 1.3e9) or 'here', "
                                 f"got {value!r}") from None
    if not (rate > 0 and rate < float("inf")):
        raise click.BadParameter(f"must be a positive number of decoded bytes per second per thread, got {value!r}")
    return rate


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
