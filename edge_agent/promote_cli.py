"""`coe-agent experts promote`: swap a candidate expert set into the line's store, live."""
from __future__ import annotations

from pathlib import Path

import click

from coe import CoEError

from .cli import _fail_clearly, line_options
from .experts_cli import _open, _store, experts


@experts.command("promote")
@click.argument("candidate", type=click.Path(file_okay=False))
@click.argument("ids", nargs=-1, metavar="[ID]...")
@line_options
@_fail_clearly
def experts_promote(candidate: str, ids: tuple[str, ...], line: str, config_path: str | None) -> None:
    """Write a candidate store's experts (or the named ones) into the line's store as new versions.

    Safe while the line's agent runs: each expert is replaced atomically, the
    agent notices within `store_poll_s`, batches already running finish on
    the version they started with, and the next batch of each expert loads
    the new one.  Every inference row records the version that ran.  Judge
    the candidate first: coe-agent replay REC --candidate DIR --report OUT --gate ...

    \b
    Example:
      coe-agent experts promote --line A new-experts/
      coe-agent experts promote --line A new-experts/ cls-r0402 cls-c0402
    """
    from storage.expert_store import ExpertStore
    from storage.promote import promote

    if not Path(candidate).is_dir() or not (Path(candidate) / "manifest.json").is_file():
        raise CoEError(f"{candidate}: not an expert store (no manifest.json)")
    cfg, model = _open(line, config_path)
    done = promote(_store(cfg), ExpertStore(candidate), model, list(ids) or None)
    for p in done:
        click.echo(f"promoted {p.expert_id}: version {p.old_version or '-'} -> {p.new_version}")
    click.echo(f"{len(done)} expert(s) promoted into {cfg.store_path}; a running agent picks them up within "
               f"{cfg.store_poll_s:g} s")
