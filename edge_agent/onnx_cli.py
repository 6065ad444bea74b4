"""`coe-agent experts export-onnx`: a torch expert as an .onnx file (and, with --as, an ONNX expert in the store).

The export is checked before it is written: the ONNX model and the torch
expert run the same random batch and the largest difference of their raw
outputs (logits; or YOLO scores, and boxes as fractions of the input) is printed; above `--tolerance` the
command fails and writes nothing.
"""
from __future__ import annotations

from pathlib import Path

import click

from coe import CoEError

from executors.onnx_export import max_output_difference

from .cli import _fail_clearly, line_options
from .experts_cli import _MB, _open, _store, experts


@experts.command("export-onnx")
@click.argument("expert_id", metavar="ID")
@line_options
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="Where to write the .onnx file.")
@click.option("--as", "as_id", default=None, metavar="NEW_ID",
              help="Also store the export as ONNX expert NEW_ID (arch onnx/<model>).")
@click.option("--tolerance", type=click.FloatRange(min=0), default=1e-4, show_default=True,
              help="Largest accepted difference between torch and ONNX Runtime outputs.")
@_fail_clearly
def experts_export_onnx(expert_id: str, line: str, config_path: str | None, out: str, as_id: str | None,
                        tolerance: float) -> None:
    """Export a torchvision or ultralytics expert to ONNX, checked against the torch expert.

    The .onnx file keeps, in its metadata, how to feed it (task, input
    normalisation), so `experts import` on another box needs nothing else.
    To run it on the line, give a spec expert the arch onnx/<model> and
    import the file, or pass --as to store it here directly.

    \b
    Example:
      coe-agent experts export-onnx --line A cls-r0402 --out r0402.onnx
      coe-agent experts export-onnx --line A det-2term --out det-2term.onnx --as det-2term-onnx
    """
    from executors.onnx_export import export_onnx, onnx_expert, onnx_tensors

    cfg, model = _open(line, config_path)
    expert = model.experts.get(expert_id)
    if expert is None:
        raise CoEError(f"expert '{expert_id}' is not in the spec {cfg.spec_path}")
    from coe.spec import RESERVED_IDS

    if as_id in RESERVED_IDS:          # before anything is exported or written
        raise CoEError(f"--as {as_id}: reserved (the learned router's entry in the expert store)")
    store = _store(cfg)
    tensors = store.read(expert_id)
    blob = export_onnx(expert, tensors)
    diff = max_output_difference(expert, tensors, blob)
    if not diff <= tolerance:           # NaN too: a NaN weight makes every difference NaN, never > anything
        raise CoEError(f"expert '{expert_id}': ONNX Runtime's outputs differ from torch's by {diff:.3g} "
                       f"(> --tolerance {tolerance:g}); nothing written")
    Path(out).write_bytes(blob)
    click.echo(f"exported {expert_id} ({expert.arch}) to {out}: {len(blob) / _MB:.1f} MB, "
               f"max |torch - onnxruntime| {diff:.2e} on a random batch")
    if as_id:
        twin = model.experts.get(as_id) or onnx_expert(expert, as_id)
        if twin.family != "onnx":
            raise CoEError(f"--as {as_id}: the spec gives it arch {twin.arch}, not onnx/<model>")
        from executors.backends import get_backend

        backend = get_backend(twin.arch)     # as `experts import` does: the spec entry must take this graph
        module = backend.build(twin, onnx_tensors(blob))
        backend.check_fits(module, twin)
        del module
        entry = store.write(twin, onnx_tensors(blob),
                            version=store.entry(as_id).version + 1 if store.has(as_id) else 1)
        note = "" if as_id in model.experts else f" (not in the spec yet: add it with arch {twin.arch})"
        click.echo(f"stored {as_id} as {twin.arch}, version {entry.version}{note}")
