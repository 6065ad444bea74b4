"""`coe-agent experts ...`: inspect, verify, import, compress, warm and evict the line's expert store.

A thin layer over `storage.expert_store`, `executors.expert_import` and
`storage.pagecache`.  The group object is created before `.cli` is imported:
`cli.py` imports this module at its end to register the group, and defining
`experts` first keeps that working whichever of the two modules is imported
first.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from coe import CoEError, CoEModel, load_spec

if TYPE_CHECKING:
    from storage.expert_store import ExpertStore

    from .config import LineConfig


@click.group()
def experts() -> None:
    """The line's expert store: list, verify, import, compress, warm and evict experts.

    \b
    Example:
      coe-agent experts ls --line A
      coe-agent experts verify --line A
    """


from .cli import _config, _fail_clearly, dtype_option, line_options  # noqa: E402  (after `experts`: see the module doc)

_MB = 1e6


def _open(line: str, config_path: str | None) -> tuple["LineConfig", CoEModel]:
    cfg = _config(line, config_path)
    return cfg, load_spec(cfg.spec_path)


def _store(cfg: "LineConfig", verify: str | None = None, create: bool = False) -> "ExpertStore":
    """The line's store; a missing store is an error with the fix, unless this command creates it."""
    from storage.expert_store import ExpertStore

    if not create and not cfg.store_path.is_dir():
        raise CoEError(f"no expert store at {cfg.store_path} (run: coe-agent zoo build --line {cfg.line}, "
                       f"or coe-agent experts import --line {cfg.line} ID FILE)")
    return ExpertStore(cfg.store_path, verify=verify or cfg.expert_verify)


def _targets(store: "ExpertStore", model: CoEModel, ids: tuple[str, ...]) -> list[str]:
    """The named experts (each must be in the store), or every spec expert the store holds."""
    if ids:
        unknown = [i for i in ids if not store.has(i)]
        if unknown:
            raise CoEError(f"not in the expert store {store.root}: {', '.join(unknown)}")
        return list(dict.fromkeys(ids))
    return [eid for eid in model.experts if store.has(eid)]


def _table(cols: tuple[str, ...], rows: list[list[str]], right: set[str]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]

    def fmt(vals: list[str] | tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if c in right else v.ljust(w) for v, w, c in zip(vals, widths, cols)).rstrip()
    return [fmt(cols), *(fmt(r) for r in rows)]


@experts.command("ls")
@line_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per expert per line.")
@_fail_clearly
def experts_ls(line: str, config_path: str | None, as_json: bool) -> None:
    """List the spec's experts with what the store holds for each.

    Shows size, dtype, the stored size with its compression ratio and entropy
    bound (see `experts compress`), version, sha256 prefix and how much of
    each file is in the OS page cache; MISSING marks a spec expert the store lacks, and
    'not in spec' a stored expert the spec does not use.

    \b
    Example:
      coe-agent experts ls --line A
      coe-agent experts ls --line A --json
    """
    from storage.expert_store import ExpertStore
    from storage.pagecache import resident_fraction

    cfg, model = _open(line, config_path)
    store = ExpertStore(cfg.store_path, verify=cfg.expert_verify) if cfg.store_path.is_dir() else None
    entries = {e.id: e for e in store.entries()} if store is not None else {}
    records = []
    for eid in [*model.experts, *sorted(set(entries) - set(model.experts))]:
        spec = model.experts.get(eid)
        entry = entries.get(eid)
        rec: dict[str, object] = {"id": eid, "kind": spec.kind if spec else entry.kind,
                                  "arch": spec.arch if spec else entry.arch}
        if entry is None:
            rec["status"] = "MISSING"
        else:
            path = store.root / entry.file
            resident = resident_fraction(path) if path.is_file() else None
            rec.update(nbytes=entry.nbytes, dtype=entry.dtype, version=entry.version, sha256=entry.sha256,
                       file=str(path), resident=resident, compression=entry.compression,
                       stored_nbytes=entry.stored_nbytes or (path.stat().st_size if path.is_file() else 0),
                       ratio=round(entry.ratio, 4), bound=entry.bound and round(entry.bound, 4))
            if spec is None:
                rec["status"] = "not in spec"
            elif not path.is_file():
                rec["status"] = "FILE MISSING"
            elif (entry.arch, entry.kind) != (spec.arch, spec.kind):
                rec["status"] = f"store holds {entry.arch} {entry.kind}"
            else:
                rec["status"] = "ok"
        records.append(rec)
    if as_json:
        for rec in records:
            click.echo(json.dumps(rec))
        return
    cols = ("id", "kind", "arch", "MB", "dtype", "stored MB", "ratio", "bound", "ver", "sha256", "cached", "status")
    rows = []
    for r in records:
        if r["status"] == "MISSING":
            rows.append([str(r["id"]), str(r["kind"]), str(r["arch"]), *["-"] * 8, "MISSING"])
            continue
        cached = "n/a" if r["resident"] is None else f"{100 * float(r['resident']):.0f}%"
        ratio = "plain" if r["compression"] == "none" else f"{float(r['ratio']):.3f}"
        bound = "-" if not r["bound"] else f"{float(r['bound']):.3f}"
        rows.append([str(r["id"]), str(r["kind"]), str(r["arch"]), f"{int(r['nbytes']) / _MB:.1f}", str(r["dtype"]),
                     f"{int(r['stored_nbytes']) / _MB:.1f}", ratio, bound,
                     str(r["version"]), str(r["sha256"])[:12], cached, str(r["status"])])
    for text in _table(cols, rows, right={"MB", "stored MB", "ratio", "bound", "ver", "cached"}):
        click.echo(text)
    in_spec = [r for r in records if r["id"] in model.experts and "nbytes" in r]
    missing = sum(r["status"] == "MISSING" for r in records)
    total = sum(int(r["nbytes"]) for r in in_spec)
    budgets = ", ".join(f"{e.count} x {e.device} {e.memory / _MB:.1f} MB" for e in cfg.executors)
    budget_total = sum(e.count * e.memory for e in cfg.executors)
    fit = "all fit in memory at once" if total <= budget_total else "they do not all fit: experts will be swapped"
    click.echo(f"{len(model.experts)} experts in spec ({missing} missing), {total / _MB:.1f} MB stored; "
               f"executor budget {budgets}: {fit}")


@experts.command("verify")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@line_options
@_fail_clearly
def experts_verify(ids: tuple[str, ...], line: str, config_path: str | None) -> None:
    """Re-hash, parse and build each expert (or the named ones); exit 1 if any fails.

    Reads every file in full, so it costs what a cold start costs.  Stored
    experts that the spec does not name are hashed and parsed, but cannot be
    built without their spec entry.

    \b
    Example:
      coe-agent experts verify --line A
      coe-agent experts verify --line A cls-r0402 det-2term
    """
    from executors.backends import get_backend

    cfg, model = _open(line, config_path)
    store = _store(cfg, verify="always")
    targets = list(dict.fromkeys(ids)) or [*model.experts,
                                            *(e.id for e in store.entries() if e.id not in model.experts)]
    failed = 0
    width = max((len(t) for t in targets), default=0)
    for eid in targets:
        spec = model.experts.get(eid)
        try:
            if not store.has(eid):
                raise CoEError(f"expert '{eid}': " + ("missing from the expert store" if spec
                                                      else "neither in the spec nor in the store"))
            entry = store.entry(eid)
            path = store.path(eid)
            tensors = store.read(eid)
            if spec is None:
                note = "hash and parse only: not in spec"
            else:
                if (entry.arch, entry.kind) != (spec.arch, spec.kind):
                    raise CoEError(f"expert '{eid}' ({path}): store holds {entry.arch} {entry.kind}, "
                                   f"spec says {spec.arch} {spec.kind}")
                module = get_backend(spec.arch).build(dataclasses.replace(spec, uri=str(path)), tensors)
                del module
                note = f"{spec.arch}, {entry.nbytes / _MB:.1f} MB"
            del tensors
            click.echo(f"OK      {eid.ljust(width)}  ({note}, sha256 {entry.sha256[:12]})")
        except CoEError as exc:
            failed += 1
            click.echo(f"FAILED  {eid.ljust(width)}  {exc}")
    if failed:
        raise click.ClickException(f"{failed} of {len(targets)} expert(s) failed verification")
    click.echo(f"{len(targets)} expert(s) verified in {store.root}")


@experts.command("import")
@click.argument("expert_id", metavar="ID")
@click.argument("src", type=click.Path(dir_okay=False, exists=True))
@line_options
@click.option("--trust", is_flag=True,
              help="Allow a pickle (.pt/.pth/.ckpt); pickles can run code when loaded.")
@dtype_option("the file's dtype")
@_fail_clearly
def experts_import(expert_id: str, src: str, line: str, config_path: str | None, trust: bool,
                   dtype: str | None) -> None:
    """Convert a weights file into the store as expert ID, once, after checking it fits.

    Accepts .safetensors, or with --trust a PyTorch pickle holding a state_dict
    (or an ultralytics checkpoint for a YOLO expert), or an .onnx model for an
    expert whose arch is onnx/<name> (checked by building its session).  The weights are built
    against the expert's arch and classes before anything is written.  With
    --dtype the floating-point weights are cast first (integer buffers keep
    theirs); a value too large for fp16 is an error, not an inf.

    \b
    Example:
      coe-agent experts import --line A cls-r0402 trained/r0402.safetensors
      coe-agent experts import --line A det-2term runs/detect/train/weights/best.pt --trust
      coe-agent experts import --line A cls-r0402 trained/r0402.safetensors --dtype bf16
      coe-agent experts import --line A cls-r0402-onnx r0402.onnx
    """
    from executors.expert_import import import_expert

    cfg, model = _open(line, config_path)
    expert = model.experts.get(expert_id)
    if expert is None:
        raise CoEError(f"expert '{expert_id}' is not in the spec {cfg.spec_path}; add it there first "
                       f"(its arch and classes decide how the weights are checked)")
    store = _store(cfg, create=True)
    entry = import_expert(store, expert, Path(src), trust=trust, dtype=dtype)
    click.echo(f"imported {entry.id} from {src}: version {entry.version}, {entry.arch}, "
               f"{entry.nbytes / _MB:.1f} MB {entry.dtype}, sha256 {entry.sha256[:12]}, file {store.root / entry.file}")


@experts.command("warm")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@line_options
@_fail_clearly
def experts_warm(ids: tuple[str, ...], line: str, config_path: str | None) -> None:
    """Read expert files into the OS page cache, so the first load after a reboot is fast.

    Without IDs, warms every spec expert the store holds.

    \b
    Example:
      coe-agent experts warm --line A
      coe-agent experts warm --line A det-2term det-ic
    """
    from storage.pagecache import WARM_CHUNK, warm_page_cache

    cfg, model = _open(line, config_path)
    store = _store(cfg)
    targets = _targets(store, model, ids)
    buf = bytearray(WARM_CHUNK)
    t0 = time.perf_counter()
    total = sum(warm_page_cache(store.path(eid), buf) for eid in targets)
    secs = time.perf_counter() - t0
    rate = f"{total / _MB / secs:.0f} MB/s" if secs > 0 else "-"
    click.echo(f"warmed {len(targets)} expert file(s): {total} bytes ({total / _MB:.1f} MB) "
               f"in {secs:.2f} s, {rate}")


@experts.command("evict")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@line_options
@_fail_clearly
def experts_evict(ids: tuple[str, ...], line: str, config_path: str | None) -> None:
    """Drop expert files from the OS page cache, to measure a cold start.

    Advice to the kernel: pages a running agent has mapped stay resident.
    Without IDs, evicts every spec expert the store holds.

    \b
    Example:
      coe-agent experts evict --line A
      coe-agent experts evict --line A cls-r0402
    """
    from storage.pagecache import drop_from_page_cache

    cfg, model = _open(line, config_path)
    store = _store(cfg)
    targets = _targets(store, model, ids)
    dropped = [eid for eid in targets if drop_from_page_cache(store.path(eid))]
    if targets and not dropped:
        raise CoEError("this platform has no posix_fadvise: cannot drop files from the page cache")
    click.echo(f"evicted {len(dropped)} expert file(s) from the page cache")


from . import compress_cli, onnx_cli, promote_cli  # noqa: E402,F401  (register more `experts` commands; they need the helpers above)


@experts.command("sync")
@click.option("--node", "nodes", multiple=True, help="Only this node (repeatable; default: every node an executor "
                                                      "names).")
@line_options
@_fail_clearly
def experts_sync(nodes: tuple[str, ...], line: str, config_path: str | None) -> None:
    """Copy this box's expert store to the expert store of each node that runs executors (`cluster:` lines).

    Files are compared by sha256 on both sides and only changed ones are sent,
    through Ray, the manifest last.  Each node's store path is `cluster.stores.NODE`
    (default: the line's `expert_store` path).

    \b
    Example:
      coe-agent experts sync --line A
      coe-agent experts sync --line A --node box-2
    """
    from .cluster import sync_store

    cfg, _ = _open(line, config_path)
    if cfg.cluster is None:
        raise CoEError(f"{cfg.source}: line {cfg.line} has no `cluster:` section: there is no other box to sync to")
    sync_store(cfg, list(nodes) or None, progress=click.echo)
