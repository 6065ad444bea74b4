"""Promote a candidate expert set into the line's store, expert by expert, while the line runs.

Each expert is written through `ExpertStore.write` (temp file, fsync, atomic
rename, manifest update) with the next version number, so a running agent
sees either the old or the new version of every expert, never half of one.
The agent notices the manifest change (`StoreWatcher` in the agent) and drops
resident copies whose version is stale once no batch holds them: a batch
that is running finishes on the bytes it started with, the next one loads
the new version, and every inference row names the version it ran.
"""
from __future__ import annotations

from dataclasses import dataclass

from coe import CoEError, CoEModel

from .expert_store import ExpertStore


@dataclass(frozen=True)
class Promotion:
    expert_id: str
    old_version: int | None
    new_version: int


def promote(line: ExpertStore, candidate: ExpertStore, model: CoEModel,
            ids: list[str] | None = None) -> list[Promotion]:
    """Copy the candidate's experts (all of them, or `ids`) into `line` as new versions.

    Every expert is checked first (in the spec, same arch and kind as the
    spec says, present in the candidate), so a bad candidate changes nothing.
    """
    targets = list(dict.fromkeys(ids or [e.id for e in candidate.entries()]))   # an id named twice: one version
    if not targets:
        raise CoEError(f"candidate store {candidate.root} holds no experts")
    problems = []
    for eid in targets:
        spec = model.experts.get(eid)
        if not candidate.has(eid):
            problems.append(f"'{eid}' is not in the candidate store {candidate.root}")
        elif spec is None:
            problems.append(f"'{eid}' is not in the line's spec")
        elif (candidate.entry(eid).arch, candidate.entry(eid).kind) != (spec.arch, spec.kind):
            e = candidate.entry(eid)
            problems.append(f"'{eid}' is a {e.arch} {e.kind} in the candidate, the spec says {spec.arch} {spec.kind}")
    if problems:
        raise CoEError("cannot promote: " + "; ".join(problems))
    out = []
    for eid in targets:
        tensors = candidate.read(eid)
        old = line.entry(eid).version if line.has(eid) else None
        entry = line.write(model.experts[eid], tensors, version=(old or 0) + 1)
        out.append(Promotion(eid, old, entry.version))
    return out
