"""Judge a replay: join the agent's verdicts with the recording's truth, compare with a baseline, gate.

A recorded frame's truth is its classifier label, or the class of the defect a
later step (a detector) should find (`truth` in the recording);
its true verdict is `pass` when that label is one of the classifier's pass
labels and `defect` otherwise.  The report covers accuracy, a confusion per
component type and per truth label, latency percentiles, and, against a
baseline run's database, the frames whose verdict changed: `fixed` (now
right, was wrong), `broken` (now wrong, was right) and `changed` (different,
both wrong or no truth).  `--gate` conditions turn the report into an exit
code, so a script can refuse to deploy an expert set that got worse.

A baseline only says "no regressions" about the frames it has verdicts for:
one from another recording, or one that lost frames, would compare nothing and
pass `regressions<=0`.  So the baseline metrics (regressions, fixed, changed)
count only when the baseline covers every frame this run has a verdict for;
otherwise they are not measured, and fail every gate condition on them.
"""
from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from coe import CoEError, CoEModel

from storage.recording import Recording

GATE_METRICS = ("accuracy", "regressions", "fixed", "changed", "compared", "errors", "missing", "p99_ms")
BASELINE_METRICS = ("regressions", "fixed", "changed")   # measured only when the baseline covers every frame
_GATE = re.compile(r"^\s*([a-z0-9_]+)\s*(>=|<=|==|>|<)\s*([0-9.eE+-]+)\s*$")


@dataclass
class Judgement:
    frames: int                              # recorded frames
    judged: int                              # with a verdict and a truth
    correct: int
    missing: int                             # recorded frames without a verdict in the database
    errors: int                              # verdict 'error'
    p50_ms: float | None
    p99_ms: float | None
    confusion_by_component: dict = field(default_factory=dict)   # component -> {true verdict -> {verdict: n}}
    confusion_by_label: dict = field(default_factory=dict)       # truth label -> {verdict: n}
    wrong: list = field(default_factory=list)                    # a few frame ids judged wrong
    fixed: list = field(default_factory=list)
    broken: list = field(default_factory=list)
    changed: list = field(default_factory=list)
    baseline: str | None = None
    compared: int = 0                        # frames with a verdict here and in the baseline
    expert_versions: dict = field(default_factory=dict)
    latencies_ms: list = field(default_factory=list, repr=False)  # per frame, for the latency figure

    @property
    def with_verdict(self) -> int:
        """The frames a baseline should cover: those this run has a verdict for (the rest are `missing`)."""
        return self.frames - self.missing

    @property
    def baseline_complete(self) -> bool:
        """A baseline was given and has a verdict for every frame this run has one for (at least one)."""
        return self.baseline is not None and 0 < self.with_verdict == self.compared

    def coverage(self) -> str:
        """'compared N of M frames', for the report and the gate's reason."""
        return f"compared {self.compared} of {self.with_verdict} frames"

    @property
    def accuracy(self) -> float:
        return self.correct / self.judged if self.judged else 0.0

    def metrics(self) -> dict[str, float]:
        """The gate's metrics; a metric that was not measured is NaN, which fails every condition."""
        nan = float("nan")
        full = self.baseline_complete
        return {"accuracy": self.accuracy if self.judged else nan,
                "regressions": len(self.broken) if full else nan, "fixed": len(self.fixed) if full else nan,
                "changed": len(self.changed) if full else nan,
                "compared": self.compared if self.baseline is not None else nan,
                "errors": self.errors, "missing": self.missing,
                "p99_ms": self.p99_ms if self.p99_ms is not None else nan}

    def not_measured(self, metric: str) -> str:
        """Why `metric` is NaN, for the gate's failing line."""
        if metric in BASELINE_METRICS or metric == "compared":
            if self.baseline is None:
                return "no --baseline"
            return f"baseline covers {self.compared} of {self.with_verdict} frames"
        return {"accuracy": "no frame with a truth", "p99_ms": "no latencies"}.get(metric, "no data")

    def to_json(self) -> dict:
        out = asdict(self)
        del out["latencies_ms"]                  # in latency.png; hundreds of numbers do not belong in one line
        out["accuracy"] = round(self.accuracy, 5) if self.judged else None     # not measured, not 0
        out["with_verdict"] = self.with_verdict
        out["baseline_coverage"] = self.coverage() if self.baseline is not None else None
        for k in ("fixed", "broken", "changed"):
            out[k] = {"count": len(getattr(self, k)), "frames": getattr(self, k)[:20]}
        return out


def true_verdict(model: CoEModel, component: str | None, truth: str | None) -> str | None:
    """'pass' or 'defect' from a frame's component and truth label; None when either is unknown."""
    if truth is None or component is None:
        return None
    comp = model.components.get(component)
    if comp is None:
        return None
    expert = model.experts[comp.classifier]
    if truth in expert.classes:
        return "pass" if truth in expert.pass_labels else "defect"
    # a defect a later step of the chain finds (a soldering defect on a part the classifier calls ok)
    for label in expert.pass_labels:
        nxt = expert.next.get(label)
        if nxt is not None and truth in model.experts[nxt].classes:
            return "defect"
    return None                          # a label no step can say: not judged, never a silent defect


def _verdicts(db: Path) -> dict[str, tuple[str, float | None]]:
    if not Path(db).is_file():
        raise CoEError(f"{db}: no results database there")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT frame_id, verdict, latency_ms FROM verdicts").fetchall()
    except sqlite3.Error as exc:
        raise CoEError(f"{db}: not a coe-edge results database ({exc})") from None
    finally:
        con.close()
    return {f: (v, lat) for f, v, lat in rows}


def _images(db: Path) -> dict[str, str]:
    """frame_id -> sha256 of the image the run accepted (empty for a database from before it was kept)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        if "payload_sha256" not in {r[1] for r in con.execute("PRAGMA table_info(frames)")}:
            return {}
        return {f: h for f, h in con.execute("SELECT frame_id, payload_sha256 FROM frames") if h}
    except sqlite3.Error as exc:
        raise CoEError(f"{db}: not a coe-edge results database ({exc})") from None
    finally:
        con.close()


def check_baseline(recording: Recording, baseline_db: Path) -> None:
    """Before a replay: a baseline that is not a results database, or a run of another recording, fails now
    (CoEError), not after every frame was sent."""
    _verdicts(baseline_db)
    _same_recording(recording, baseline_db)


def _same_recording(recording: Recording, baseline_db: Path) -> None:
    """Refuse a baseline that ran another recording under the same frame ids (synthetic recordings of other
    seeds share them): compared frame by frame, its regressions and fixes would be about other images."""
    import hashlib

    images = _images(baseline_db)
    if not images:
        return                            # no image hashes kept: the coverage rule is all that can be checked
    differ = []
    for frame in recording:
        fid = frame.header["frame_id"]
        if fid in images and hashlib.sha256(recording.payload(frame)).hexdigest() != images[fid]:
            differ.append(fid)
    if differ:
        raise CoEError(f"--baseline {baseline_db} is a run of another recording: {len(differ)} frame(s) under the "
                       f"same ids had other images (e.g. {', '.join(differ[:3])}); compare runs of one recording")


def versions_that_ran(db: str | Path, frames: set[str] | None = None) -> dict[str, dict[str, int]]:
    """expert -> {store version: inferences} from the run's own rows (what really produced the verdicts)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        cols = {r[1] for r in con.execute("PRAGMA table_info(inferences)")}
        if "expert_version" not in cols:
            return {}
        rows = con.execute("SELECT frame_id, expert_id, expert_version FROM inferences").fetchall()
    except sqlite3.Error:
        return {}
    finally:
        con.close()
    out: dict[str, Counter] = defaultdict(Counter)
    for fid, eid, ver in rows:
        if frames is None or fid in frames:
            out[eid]["?" if ver is None else str(ver)] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def _change(before: str, now: str, want: str | None) -> str | None:
    """How a frame's verdict moved against the baseline: fixed, broken, changed, or None when it held."""
    if before == now:
        return None
    if now == "error":                   # a verdict the line had, now none: worse whatever the truth
        return "broken"
    if want is not None and now == want:
        return "fixed"
    if want is not None and before == want:
        return "broken"
    return "changed"                     # both wrong, or no truth to say which is right


def judge(model: CoEModel, recording: Recording, results_db: str | Path, *, baseline_db: str | Path | None = None,
          expert_versions: dict | None = None, show: int = 10, baseline_checked: bool = False) -> Judgement:
    """The report of one replay's verdicts (in `results_db`) against the recording's truth.

    `baseline_checked`: the caller ran `check_baseline` on this recording and baseline already (the replay
    command does, before sending), so the recording's images are not hashed again.

    `expert_versions` defaults to the versions the run's inference rows name.
    """
    import numpy as np

    got = _verdicts(Path(results_db))
    if expert_versions is None:
        expert_versions = versions_that_ran(results_db, {f.header["frame_id"] for f in recording})
    base = _verdicts(Path(baseline_db)) if baseline_db is not None else None
    if base is not None:
        if not baseline_checked:
            _same_recording(recording, Path(baseline_db))
    by_comp: dict = defaultdict(lambda: defaultdict(Counter))
    by_label: dict = defaultdict(Counter)
    judged = correct = missing = errors = compared = 0
    wrong, fixed, broken, changed, lat = [], [], [], [], []
    for frame in recording:
        fid = frame.header["frame_id"]
        comp = frame.header.get("component") or frame.truth_component
        want = true_verdict(model, comp, frame.truth)
        if fid not in got:
            missing += 1
            continue
        verdict, latency = got[fid]
        errors += verdict == "error"
        if latency is not None:
            lat.append(latency)
        if want is not None:
            judged += 1
            correct += verdict == want
            if verdict != want and len(wrong) < show:
                wrong.append(fid)
            by_comp[comp][want][verdict] += 1
            by_label[frame.truth][verdict] += 1
        if base is not None and fid in base:
            compared += 1
            change = _change(base[fid][0], verdict, want)
            if change is not None:
                {"fixed": fixed, "broken": broken, "changed": changed}[change].append(fid)
    p = (lambda q: float(np.percentile(lat, q))) if lat else (lambda q: None)   # rounded only where shown
    return Judgement(frames=len(recording), judged=judged, correct=correct, missing=missing, errors=errors,
                     p50_ms=p(50), p99_ms=p(99),
                     confusion_by_component={c: {t: dict(v) for t, v in d.items()} for c, d in sorted(by_comp.items())},
                     confusion_by_label={k: dict(v) for k, v in sorted(by_label.items())}, wrong=wrong,
                     fixed=fixed, broken=broken, changed=changed,
                     baseline=str(baseline_db) if baseline_db is not None else None, compared=compared,
                     expert_versions=dict(expert_versions or {}), latencies_ms=lat)


@dataclass(frozen=True)
class Condition:
    metric: str
    op: str
    value: float

    def holds(self, metrics: dict[str, float]) -> bool:
        x = metrics[self.metric]
        return {">=": x >= self.value, "<=": x <= self.value, "==": x == self.value,
                ">": x > self.value, "<": x < self.value}[self.op]

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value!r}".removesuffix(".0")


def parse_gate(text: str) -> list[Condition]:
    """'accuracy>=0.97,regressions<=0' -> conditions; CoEError naming the bad clause otherwise."""
    out = []
    for clause in filter(None, (c.strip() for c in text.split(","))):
        m = _GATE.match(clause)
        if not m:
            raise CoEError(f"--gate: cannot read {clause!r}: write METRIC OP NUMBER, e.g. accuracy>=0.97 "
                           f"(metrics: {', '.join(GATE_METRICS)}; ops: >= <= == > <)")
        metric, op, value = m.groups()
        if metric not in GATE_METRICS:
            raise CoEError(f"--gate: unknown metric {metric!r} in {clause!r} (metrics: {', '.join(GATE_METRICS)})")
        try:
            number = float(value)
        except ValueError:
            raise CoEError(f"--gate: {value!r} in {clause!r} is not a number") from None
        if metric == "accuracy" and number > 1:
            hint = f" (write accuracy>={number / 100!r} for {value}%)" if number <= 100 else ""
            raise CoEError(f"--gate: accuracy is a fraction in 0..1, got {value} in {clause!r}{hint}")
        out.append(Condition(metric, op, number))
    if not out:
        raise CoEError("--gate: no conditions given (e.g. --gate 'accuracy>=0.97,regressions<=0')")
    if not any(c.metric == "missing" for c in out):
        # a frame without a verdict is neither right nor a regression: unless the gate says how many
        # may be missing, none may, or a candidate that drops frames would pass on the ones it kept
        out.append(Condition("missing", "<=", 0.0))
    return out


def failed_conditions(j: Judgement, gate: list[Condition]) -> list[str]:
    """The conditions that fail, each with the value it got or why that metric was not measured."""
    metrics = j.metrics()
    return [f"{c} (got {metrics[c.metric]:g})" if metrics[c.metric] == metrics[c.metric]
            else f"{c} (not measured: {j.not_measured(c.metric)})" for c in gate if not c.holds(metrics)]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def write_report(j: Judgement, out: str | Path, gate: list[Condition] | None = None) -> Path:
    """report.md, confusion.png, latency.png and report.json in `out`; returns the Markdown path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    failed = failed_conditions(j, gate) if gate else []
    lines = ["# Replay report", "",
             f"- frames recorded: {j.frames}; judged against truth: {j.judged}; without a verdict: {j.missing}",
             (f"- **accuracy: {100 * j.accuracy:.2f}%** ({j.correct} of {j.judged})" if j.judged else
              "- **accuracy: not measured** (no frame has a truth the chain can say)") + f"; error verdicts: {j.errors}",
             f"- latency p50 / p99: {_ms(j.p50_ms)} / {_ms(j.p99_ms)} ms"]
    if j.baseline:
        lines.append(f"- against baseline {j.baseline}: {j.coverage()}; fixed {len(j.fixed)}, "
                     f"broken {len(j.broken)}, changed {len(j.changed)}")
        if not j.baseline_complete:
            lines.append(f"- **the baseline does not cover this run** ({j.coverage()}): regressions, fixed and "
                         f"changed are not measured, and fail any gate on them")
    if gate:
        lines.append(f"- gate {', '.join(map(str, gate))}: " + ("**FAILED**: " + "; ".join(failed) if failed
                                                                 else "passed"))
    lines += ["", "## Confusion by truth label (verdicts)", "", "| truth | pass | defect | error |", "|---|---|---|---|"]
    for label, counts in j.confusion_by_label.items():
        lines.append(f"| {label} | {counts.get('pass', 0)} | {counts.get('defect', 0)} | {counts.get('error', 0)} |")
    lines += ["", "## Confusion by component (true verdict → verdicts)", "",
              "| component | true | pass | defect | error |", "|---|---|---|---|---|"]
    for comp, rows in j.confusion_by_component.items():
        for want, counts in rows.items():
            lines.append(f"| {comp} | {want} | {counts.get('pass', 0)} | {counts.get('defect', 0)} | "
                         f"{counts.get('error', 0)} |")
    if j.wrong:
        lines += ["", f"Frames judged wrong (first {len(j.wrong)}): {', '.join(j.wrong)}"]
    if j.broken:
        lines += ["", f"Broken against the baseline (first 20): {', '.join(j.broken[:20])}"]
    if j.expert_versions:
        def fmt(v) -> str:
            return ", ".join(f"v{ver} ({n} inferences)" for ver, n in v.items()) if isinstance(v, dict) else f"v{v}"
        lines += ["", "## Expert versions that ran", "",
                  *(f"- {k}: {fmt(v)}" for k, v in sorted(j.expert_versions.items()))]
    lines += ["", "## Figures", "", "![verdicts by truth label](confusion.png)", "",
              "![latency per frame, p50 and p99 marked](latency.png)"]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot(j, out / "confusion.png")
    _plot_latency(j, out / "latency.png")
    (out / "report.json").write_text(json.dumps({**j.to_json(), "gate_failed": failed}) + "\n", encoding="utf-8")
    return md


def _plot(j: Judgement, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(j.confusion_by_label)
    verdicts = ("pass", "defect", "error")
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.45 * max(1, len(labels))))
    left = [0] * len(labels)
    for v, color in zip(verdicts, ("#4c9a2a", "#c0392b", "#7f8c8d")):
        vals = [j.confusion_by_label[lab].get(v, 0) for lab in labels]
        ax.barh(labels, vals, left=left, color=color, label=f"verdict {v}")
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("frames")
    ax.set_title(f"verdicts by truth label (accuracy {100 * j.accuracy:.1f}%)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_latency(j: Judgement, path: Path) -> None:
    """A histogram of per-frame latency with p50 and p99 marked: the tail a percentile pair hides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    if j.latencies_ms:
        ax.hist(j.latencies_ms, bins=min(50, max(5, len(j.latencies_ms) // 10)), color="#5b7db1")
        for q, value, style in (("p50", j.p50_ms, "--"), ("p99", j.p99_ms, ":")):
            ax.axvline(value, color="#c0392b", linestyle=style, label=f"{q} {value:g} ms")
        ax.legend(loc="upper right", fontsize=8)
    else:                                # still a figure, so report.md never links a missing file
        ax.text(0.5, 0.5, "no latencies recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("latency per frame (ms)")
    ax.set_ylabel("frames")
    ax.set_title(f"latency of {len(j.latencies_ms)} frames")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
