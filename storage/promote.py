"""Promote a candidate expert set into the line's store, all at once, while the line runs.

The experts are written through `ExpertStore.write_many` with the next
version numbers: every new file lands beside the live one, then one manifest
write switches the whole set, so a running agent sees either every old
version or every new one, never half of a set (nor half of one expert).
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
        elif line.has(eid):
            why = _shape_problem(line, candidate, eid)
            if why:
                problems.append(why)
    if problems:
        raise CoEError("cannot promote: " + "; ".join(problems))
    olds = {eid: (line.entry(eid).version if line.has(eid) else None) for eid in targets}
    entries = line.write_many([(model.experts[eid], candidate.read(eid), (olds[eid] or 0) + 1) for eid in targets])
    return [Promotion(e.id, olds[e.id], e.version) for e in entries]


def _shape_problem(line: ExpertStore, candidate: ExpertStore, eid: str) -> str:
    """Why the candidate's `eid` would not load where the line's loads (its tensors' names and shapes differ:
    every load on the line would then fail, and every frame on that expert with it), or ''."""
    try:
        got = {s.name: s.shape for s in candidate.layout(eid).specs}
    except CoEError as exc:
        return f"'{eid}': {exc}"
    try:
        have = {s.name: s.shape for s in line.layout(eid).specs}
    except CoEError:     # the line's own file is broken: nothing to compare with, and promoting is the fix
        return ""
    missing, extra = sorted(have.keys() - got.keys()), sorted(got.keys() - have.keys())
    if missing or extra:
        return (f"'{eid}' in the candidate lacks {len(missing)} tensor(s) the line's has "
                f"({', '.join(missing[:3]) or 'none'}) and has {len(extra)} it does not ({', '.join(extra[:3]) or 'none'})")
    wrong = sorted(n for n in have if tuple(have[n]) != tuple(got[n]))
    if wrong:
        n = wrong[0]
        return f"'{eid}': tensor {n} is {list(got[n])} in the candidate, {list(have[n])} on the line"
    return ""
