"""`coe-agent cluster ...`: the boxes of a line that runs executors on other boxes (issue 15).

A thin layer over `edge_agent.cluster`.  `status` reads what the running
agent writes ({data_dir}/cluster-status.json: its executors, their state and
residency) and asks Ray for the nodes' health now; `profile` measures the link
to each node into {data_dir}/links.json, which the cost model prices remote
executors with.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from coe import CoEError


@click.group()
def cluster() -> None:
    """A line's boxes: nodes, their executors, residency and health; link profile.

    \b
    Example:
      coe-agent cluster status --line A
      coe-agent cluster profile --line A
    """


from .cli import _config, _fail_clearly, line_options  # noqa: E402  (after `cluster`, as experts_cli does)


@cluster.command("status")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
@line_options
@_fail_clearly
def cluster_status(as_json: bool, line: str, config_path: str | None) -> None:
    """Nodes (alive or not), their executors, what each holds, and how each is.

    \b
    Example:
      coe-agent cluster status --line A
      coe-agent cluster status --line A --json
    """
    from .cluster import cluster_nodes, connect

    cfg = _config(line, config_path)
    if cfg.cluster is None:
        raise CoEError(f"{cfg.source}: line {cfg.line} has no `cluster:` section; every executor runs on this box")
    wanted = sorted({ex.node for ex in cfg.executors if ex.node})
    connect(cfg.cluster, [])
    nodes = cluster_nodes()
    path = Path(cfg.data_dir) / "cluster-status.json"
    agent = json.loads(path.read_text()) if path.is_file() else None
    doc = {"line": cfg.line, "address": cfg.cluster.address, "nodes": nodes, "config_nodes": wanted,
           "agent": agent, "agent_age_s": round(time.time() - agent["written_at"], 1) if agent else None}
    if as_json:
        click.echo(json.dumps(doc, default=str))
        return
    click.echo(f"cluster {cfg.cluster.address} (line {cfg.line})")
    click.echo(f"{'node':12} {'health':8} {'address':16} {'CPUs':>5} {'GPUs':>5}")
    for name in sorted(set(nodes) | set(wanted)):
        n = nodes.get(name)
        health = "missing" if n is None else ("alive" if n["alive"] else "dead")
        click.echo(f"{name:12} {health:8} {(n or {}).get('address') or '-':16} {(n or {}).get('cpus', 0):5g} "
                   f"{(n or {}).get('gpus', 0):5g}")
    if agent is None:
        click.echo(f"no agent status at {path} (is the agent running?)")
        return
    stale = " (stale: the agent is not writing it)" if doc["agent_age_s"] > 10 else ""
    click.echo(f"executors, as the agent saw them {doc['agent_age_s']} s ago{stale}:")
    click.echo(f"{'executor':22} {'node':10} {'device':8} {'state':28} {'resident MB':>11} {'experts':>7} "
               f"{'batches':>7} {'lost':>4} {'requeued':>8}")
    for e in agent["executors"]:
        click.echo(f"{e['name']:22} {e['node']:10} {e['device']:8} {str(e['state'])[:28]:28} "
                   f"{e['resident_bytes'] / 1e6:11.1f} {len(e['resident']):7d} {e.get('batches', '-')!s:>7} "
                   f"{e.get('lost', 0):4d} {e.get('requeued', 0):8d}")
        if e["resident"]:
            click.echo(f"    holds: {', '.join(e['resident'][:12])}" + (" ..." if len(e["resident"]) > 12 else ""))


@cluster.command("profile")
@click.option("--rounds", default=50, show_default=True, type=click.IntRange(5, 10_000),
              help="Round trips per node for each probe (empty, frame-sized payloads, a call with work).")
@click.option("--frame-bytes", type=click.IntRange(min=1), help="Bytes a frame takes on the link "
                                                                "(default: a raw 224x224 RGB crop, 150528).")
@line_options
@_fail_clearly
def cluster_profile(rounds: int, frame_bytes: int | None, line: str, config_path: str | None) -> None:
    """Measure the link from this box to each executor node (per-call latency, bandwidth) into
    {data_dir}/links.json.  `coe-agent profile` does the same for a line with a `cluster:` section.

    The cost model then charges a remote executor a frame's transfer per request
    and the per-call latency per batch.  Real round trips through Ray to an actor
    on each node, with frame-sized payloads.

    \b
    Example:
      coe-agent cluster profile --line A
    """
    from executors.links import DEFAULT_FRAME_BYTES

    from .cluster import describe_links, links_path, profile_links

    cfg = _config(line, config_path)
    if cfg.cluster is None:
        raise CoEError(f"{cfg.source}: line {cfg.line} has no `cluster:` section: no links to measure")
    links = profile_links(cfg, rounds=rounds, frame_bytes=frame_bytes or DEFAULT_FRAME_BYTES)
    path = links.save(links_path(cfg))
    for row in describe_links(links):
        click.echo(row)
    click.echo(f"wrote {path}")
