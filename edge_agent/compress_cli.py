"""`coe-agent experts compress`: turn a store's exponent compression on or off, expert by expert.

Each expert is rewritten atomically (decode or encode, check the sha256 of
the plain bytes, replace), so an interrupted run leaves a store that mixes
plain and compressed experts, which reads fine, and running the command again
finishes the job.  The table shows each expert's ratio next to its entropy
bound, the fewest bytes any exponent coder could reach, so a ratio far above
its bound says the coder, not the weights, is the problem.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from coe import CoEError

from .experts_cli import _MB, _open, _store, _table, _targets, experts
from .cli import _fail_clearly, line_options

if TYPE_CHECKING:
    from storage.expert_store import ExpertStore, ManifestEntry


def ratio_cells(entry: "ManifestEntry") -> tuple[str, str]:
    """(ratio, bound) as `experts ls` and `experts compress` print them."""
    if entry.compression == "none":
        return "1.000", "-"
    return f"{entry.ratio:.3f}", (f"{entry.bound:.3f}" if entry.bound is not None else "-")


def _open_store(line: str, config_path: str | None, store_dir: str | None,
                ids: tuple[str, ...]) -> tuple["ExpertStore", list[str]]:
    from storage.expert_store import ExpertStore

    if store_dir is not None:
        if not Path(store_dir).is_dir():
            raise CoEError(f"--store {store_dir}: no such directory")
        if not (Path(store_dir) / "manifest.json").is_file():   # opening it would make any folder a store
            raise CoEError(f"--store {store_dir}: not an expert store (no manifest.json)")
        store = ExpertStore(store_dir)
        unknown = [i for i in ids if not store.has(i)]
        if unknown:
            raise CoEError(f"not in the expert store {store.root}: {', '.join(unknown)}")
        return store, list(ids) or [e.id for e in store.entries()]
    cfg, model = _open(line, config_path)
    store = _store(cfg)
    return store, _targets(store, model, ids)


@experts.command("compress")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@line_options
@click.option("--store", "store_dir", type=click.Path(file_okay=False),
              help="An expert store directory instead of the line's (e.g. an imported LLM).")
@click.option("--off", is_flag=True, help="Store the experts plain again (decompress).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per expert per line.")
@_fail_clearly
def experts_compress(ids: tuple[str, ...], line: str, config_path: str | None, store_dir: str | None,
                     off: bool, as_json: bool) -> None:
    """Compress the store's experts losslessly (exponent-zstd), or with --off decompress them.

    The store remembers the setting: experts written later (zoo build,
    experts import, llm import) are compressed too.  Loads decode on the
    loader threads; `coe-agent profile` says whether that pays on this box.

    \b
    Example:
      coe-agent experts compress --line A
      coe-agent experts compress --store var/llm/trained
      coe-agent experts compress --line A --off
    """
    from tqdm import tqdm

    store, targets = _open_store(line, config_path, store_dir, ids)
    store.set_compression("none" if off else "exponent-zstd")
    entries = []
    for eid in tqdm(targets, desc="decompress" if off else "compress", unit="expert", disable=None):
        entries.append(store.recompress(eid))
    if as_json:
        for e in entries:
            click.echo(json.dumps({"id": e.id, "dtype": e.dtype, "compression": e.compression,
                                   "plain_bytes": e.plain_nbytes, "stored_bytes": e.stored_nbytes,
                                   "ratio": round(e.ratio, 4), "bound": e.bound and round(e.bound, 4)}))
        return
    rows = [[e.id, e.dtype, f"{e.plain_nbytes / _MB:.1f}", f"{e.stored_nbytes / _MB:.1f}", *ratio_cells(e)]
            for e in entries]
    for text in _table(("id", "dtype", "plain MB", "stored MB", "ratio", "bound"), rows,
                       right={"plain MB", "stored MB", "ratio", "bound"}):
        click.echo(text)
    plain = sum(e.plain_nbytes for e in entries)
    stored = sum(e.stored_nbytes for e in entries)
    bound = sum(e.bound_nbytes or e.stored_nbytes for e in entries)
    click.echo(f"{len(entries)} experts, {plain / _MB:.1f} MB plain -> {stored / _MB:.1f} MB stored "
               f"(ratio {stored / plain if plain else 1:.3f}"
               + (f", entropy bound {bound / plain:.3f})" if not off and plain else ")")
               + f"; store compression: {store.compression}")
