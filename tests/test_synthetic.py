"""Synthetic frames: deterministic, in board order, true to the priors, and telling types apart
(by the part, and by the board's silkscreen when the part is missing or wrong)."""
from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest

from coe import load_spec
from coe.spec import CoEModel
from storage.recording import MANIFEST, Recording, RecordingError
from storage.synthetic import (CODE_BITS, EPOCH, FRAME_INTERVAL_S, LABELS, board_layout, designator,
                               draw_component, footprint, record_synthetic, silkscreen)

SPEC = Path(__file__).resolve().parents[1] / "configs" / "specs" / "line-A.coe.yaml"


@pytest.fixture(scope="module")
def model() -> CoEModel:
    return load_spec(SPEC)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _decode(data: bytes, header: dict) -> np.ndarray:
    if header["encoding"] == "raw":
        return np.frombuffer(data, np.uint8).reshape(header["shape"])
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


# -- determinism -------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["png", "jpeg", "raw"])
def test_same_seed_gives_identical_bytes(model: CoEModel, tmp_path: Path, encoding: str) -> None:
    a = record_synthetic(model, tmp_path / "a", 30, line="A", seed=7, encoding=encoding)
    b = record_synthetic(model, tmp_path / "b", 30, line="A", seed=7, encoding=encoding)
    ta, tb = _tree(a), _tree(b)
    assert len(ta) == 31  # 30 images + manifest
    assert ta == tb


def test_different_seed_differs(model: CoEModel, tmp_path: Path) -> None:
    a = _tree(record_synthetic(model, tmp_path / "a", 30, line="A", seed=1))
    b = _tree(record_synthetic(model, tmp_path / "b", 30, line="A", seed=2))
    assert a[MANIFEST] != b[MANIFEST]
    shared = set(a) & set(b) - {MANIFEST}
    assert shared and all(a[k] != b[k] for k in shared)


def test_longer_recording_starts_with_the_shorter_one(model: CoEModel, tmp_path: Path) -> None:
    short = Recording(record_synthetic(model, tmp_path / "s", 25, line="A", seed=3, boards_components=10))
    long = Recording(record_synthetic(model, tmp_path / "l", 60, line="A", seed=3, boards_components=10))
    for fs, fl in zip(short, long.frames[:25]):
        assert (fs.header, fs.truth) == (fl.header, fl.truth)
        assert short.payload(fs) == long.payload(fl)


def test_draw_component_is_a_function_of_the_rng(model: CoEModel) -> None:
    a = draw_component("U-SOIC8", "misaligned", np.random.default_rng(5))
    b = draw_component("U-SOIC8", "misaligned", np.random.default_rng(5))
    c = draw_component("U-SOIC8", "misaligned", np.random.default_rng(6))
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


# -- shape of a recording ----------------------------------------------------------

@pytest.mark.parametrize("frames", [0, 1, 9, 10, 23])
def test_exactly_n_frames(model: CoEModel, tmp_path: Path, frames: int) -> None:
    rec = Recording(record_synthetic(model, tmp_path / "r", frames, line="A", boards_components=10,
                                     encoding="raw"))
    assert len(rec) == frames
    assert len(list((tmp_path / "r" / "frames").iterdir())) == frames


def test_board_order_ids_and_timestamps(model: CoEModel, tmp_path: Path) -> None:
    n, per_board = 57, 12
    rec = Recording(record_synthetic(model, tmp_path / "r", n, line="L7", seed=4,
                                     boards_components=per_board, size=32, encoding="raw"))
    frames = rec.frames
    ids = [f.header["frame_id"] for f in frames]
    assert len(set(ids)) == n
    assert ids[0] == "L7-B000001-001" and ids[per_board] == "L7-B000002-001" and ids[-1] == "L7-B000005-009"
    assert [f.header["board_id"] for f in frames] == [f"B{i // per_board + 1:06d}" for i in range(n)]
    layout = [f.header["component"] for f in frames[:per_board]]
    assert [f.header["component"] for f in frames] == [layout[i % per_board] for i in range(n)]
    ts = [f.header["ts"] for f in frames]
    assert ts[0] == EPOCH
    assert np.allclose(np.diff(ts), FRAME_INTERVAL_S, rtol=0, atol=1e-6)
    assert all(f.header["line"] == "L7" and f.header["v"] == 1 for f in frames)
    assert all(f.header["shape"] == [32, 32, 3] and f.header["dtype"] == "uint8" for f in frames)
    assert all(f.truth in model.experts[model.components[f.header["component"]].classifier].classes
               for f in frames)


def test_layout_follows_frequencies(model: CoEModel) -> None:
    layout = board_layout(model, 6000, np.random.default_rng(0))
    counts = Counter(layout)
    total = sum(c.frequency for c in model.components.values())
    for name, comp in model.components.items():
        assert abs(counts[name] / 6000 - comp.frequency / total) < 0.02, name
    assert counts["C0402"] > counts["U-QFP64"] * 5


def test_omit_component_keeps_truth_component(model: CoEModel, tmp_path: Path) -> None:
    kept = Recording(record_synthetic(model, tmp_path / "k", 30, line="A", seed=9))
    omitted = Recording(record_synthetic(model, tmp_path / "o", 30, line="A", seed=9, omit_component=True))
    for fk, fo in zip(kept, omitted):
        assert "component" not in fo.header
        assert fo.truth_component == fk.header["component"]
        assert fk.truth_component is None
        assert fo.truth == fk.truth
        assert omitted.payload(fo) == kept.payload(fk)  # same pixels: only the header differs


def test_truth_labels_follow_the_priors(model: CoEModel, tmp_path: Path) -> None:
    n = 2000
    rec = Recording(record_synthetic(model, tmp_path / "r", n, line="A", seed=11, size=16, encoding="raw"))
    counts = Counter(f.truth for f in rec)
    priors = model.experts["cls-r0402"].priors  # every classifier in this spec shares the priors
    assert set(counts) <= set(priors)
    for label, p in priors.items():
        assert abs(counts[label] / n - p) < 0.03, (label, counts[label] / n, p)


def test_progress_is_reported_up_to_the_total(model: CoEModel, tmp_path: Path) -> None:
    seen: list[int] = []
    record_synthetic(model, tmp_path / "r", 250, line="A", size=16, encoding="raw", progress=seen.append)
    assert seen and seen[-1] == 250
    assert seen == sorted(seen)


def test_png_and_jpeg_decode_to_the_raw_rgb_pixels(model: CoEModel, tmp_path: Path) -> None:
    raw = Recording(record_synthetic(model, tmp_path / "raw", 6, line="A", seed=2, encoding="raw"))
    png = Recording(record_synthetic(model, tmp_path / "png", 6, line="A", seed=2, encoding="png"))
    jpg = Recording(record_synthetic(model, tmp_path / "jpg", 6, line="A", seed=2, encoding="jpeg"))
    for fr, fp, fj in zip(raw, png, jpg):
        want = _decode(raw.payload(fr), fr.header)
        assert np.array_equal(_decode(png.payload(fp), fp.header), want)  # lossless, RGB not BGR
        got = _decode(jpg.payload(fj), fj.header).astype(int)
        assert np.abs(got - want).mean() < 6
        assert np.abs(got - want[:, :, ::-1]).mean() > 8  # a channel swap would show
        assert fp.file.endswith(".png") and fj.file.endswith(".jpg") and fr.file.endswith(".raw")


def test_refuses_to_overwrite_without_consent(model: CoEModel, tmp_path: Path) -> None:
    record_synthetic(model, tmp_path / "r", 3, line="A")
    with pytest.raises(RecordingError):
        record_synthetic(model, tmp_path / "r", 3, line="A")
    record_synthetic(model, tmp_path / "r", 2, line="A", overwrite=True)
    assert len(Recording(tmp_path / "r")) == 2


@pytest.mark.parametrize("kwargs,match", [({"frames": -1}, "frames must be a non-negative integer"),
                                          ({"seed": -1}, "seed must be a non-negative integer"),
                                          ({"encoding": "gif"}, "encoding must be one of"),
                                          ({"line": ""}, "line must be a non-empty string"),
                                          ({"boards_components": 0}, "a board needs at least one component")])
def test_bad_arguments_raise(model: CoEModel, tmp_path: Path, kwargs: dict, match: str) -> None:
    args = {"frames": 3, "line": "A", **kwargs}
    with pytest.raises(ValueError, match=match):      # our check, naming the argument, not a library's error
        record_synthetic(model, tmp_path / "r", **args)
    assert not (tmp_path / "r" / MANIFEST).exists()


# -- what the pictures show --------------------------------------------------------

def test_unknown_label_is_refused() -> None:
    with pytest.raises(ValueError, match="scratched"):
        draw_component("U-SOIC16", "scratched", np.random.default_rng(0))


def _dark_mask(img: np.ndarray) -> np.ndarray:
    """Pixels of a black package body: darker than the PCB green in every channel."""
    return (img.max(axis=2) < 60).astype(np.uint8)


@pytest.mark.parametrize("component,min_dark", [("U-QFN32", 600), ("R0603", 80)])
def test_missing_shows_pads_but_no_body(component: str, min_dark: int) -> None:
    for seed in range(4):
        ok = draw_component(component, "ok", np.random.default_rng(seed))
        missing = draw_component(component, "missing", np.random.default_rng(seed))
        assert _dark_mask(ok).sum() > min_dark
        assert _dark_mask(missing).sum() < 10  # silkscreen is light: no dark body anywhere
        # the silkscreen is bright too, so find the solder on the bare footprint (same draws, no print)
        # and check that it still shows where the print is: pads and solder lie on top of it
        bare = draw_component(component, "missing", np.random.default_rng(seed), silk=False)
        solder = bare.min(axis=2) > 150
        assert solder.sum() > 20
        assert (missing.min(axis=2) > 150)[solder].mean() > 0.9


def _body_box(img: np.ndarray) -> tuple[tuple[float, float], float]:
    """Centre and off-axis angle (degrees) of the largest dark blob."""
    contours, _ = cv2.findContours(_dark_mask(img), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    centre, _, angle = cv2.minAreaRect(max(contours, key=cv2.contourArea))
    return centre, min(angle % 90, 90 - angle % 90)


@pytest.mark.parametrize("component", ["U-SOIC8", "R1206", "Q-SOT223"])
def test_misaligned_body_is_shifted_and_rotated(component: str) -> None:
    for seed in range(4):
        ok_centre, ok_angle = _body_box(draw_component(component, "ok", np.random.default_rng(seed)))
        mis_centre, mis_angle = _body_box(draw_component(component, "misaligned", np.random.default_rng(seed)))
        assert ok_angle < 3
        assert mis_angle > 8
        assert np.hypot(mis_centre[0] - ok_centre[0], mis_centre[1] - ok_centre[1]) > 5


def _features(img: np.ndarray) -> np.ndarray:
    """16x16, mean removed: averages out pixel noise and global brightness, keeps the layout."""
    small = cv2.resize(img.astype(np.float32), (16, 16), interpolation=cv2.INTER_AREA)
    return small - small.mean(axis=(0, 1))


@pytest.fixture(scope="module")
def centroids(model: CoEModel) -> tuple[list[str], np.ndarray]:
    """Mean 'ok' features per component type: a nearest-centroid stand-in for a router."""
    names = sorted(model.components)
    rng = np.random.default_rng(100)
    cents = np.stack([np.mean([_features(draw_component(c, "ok", rng)) for _ in range(8)], axis=0) for c in names])
    return names, cents


def _nearest_is_own(names: list[str], cents: np.ndarray, label: str, seed: int) -> float:
    rng = np.random.default_rng(seed)
    hits = []
    for i, c in enumerate(names):
        f = np.stack([_features(draw_component(c, label, rng)) for _ in range(6)])
        d = np.abs(f[:, None] - cents[None]).mean(axis=(2, 3, 4))
        hits.extend(d.argmin(axis=1) == i)
    return float(np.mean(hits))


def test_type_is_recognisable_from_ok_images(centroids: tuple[list[str], np.ndarray]) -> None:
    assert _nearest_is_own(*centroids, "ok", seed=1) > 0.9


def test_wrong_part_looks_like_another_type(centroids: tuple[list[str], np.ndarray]) -> None:
    assert _nearest_is_own(*centroids, "wrong_part", seed=2) < 0.3


def test_footprints_follow_family_and_package() -> None:
    def leads(name: str) -> int:
        return sum(1 for sh in footprint(name).body if sh.color == (200, 200, 196))

    assert [footprint(n).family for n in ("R0402", "LED0603", "L0603", "U-QFN32", "X-HC49", "T-1")] == \
        ["R", "LED", "L", "U", "X", "GENERIC"]
    assert (leads("U-SOIC8"), leads("U-SOIC16"), leads("U-TSSOP20"), leads("U-QFP64")) == (8, 16, 20, 64)
    assert (leads("Q-SOT23"), leads("Q-SOT223")) == (3, 4)
    sizes = [footprint(f"R{code}").body[0].w for code in ("0201", "0402", "0603", "0805", "1206")]
    assert sizes == sorted(sizes) and sizes[-1] > 2 * sizes[0]


def test_unknown_names_get_a_stable_distinct_look() -> None:
    a1 = draw_component("T-0001", "ok", np.random.default_rng(0))
    a2 = draw_component("T-0001", "ok", np.random.default_rng(0))
    assert np.array_equal(a1, a2)
    others = [draw_component(f"T-{i:04d}", "ok", np.random.default_rng(0)) for i in range(2, 12)]
    assert all(np.abs(a1.astype(int) - b.astype(int)).mean() > 3 for b in others)


def _between_within(model: CoEModel, silk: bool) -> dict[tuple[str, str], float]:
    rng = np.random.default_rng(0)
    k = 8
    feats = {c: np.stack([_features(draw_component(c, "ok", rng, silk=silk)) for _ in range(k)])
             for c in model.components}

    def dist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.abs(a[:, None] - b[None]).mean(axis=(2, 3, 4))

    off_diag = ~np.eye(k, dtype=bool)
    within = {c: dist(f, f)[off_diag].mean() for c, f in feats.items()}
    return {(a, b): dist(feats[a], feats[b]).mean() / max(within[a], within[b])
            for a, b in itertools.combinations(feats, 2)}


def test_types_differ_more_between_than_within(model: CoEModel) -> None:
    # The parts themselves (pads and body) on a bare board.  With the silkscreen on, its sharp
    # strokes moving with the position jitter dominate this coarse 16x16 L1 measure for the tiny
    # 0201 pair (ratio about 1), while the 3x5 glyph that tells R from C is below its resolution;
    # that the print tells those types apart is checked by the silkscreen tests below.
    ratios = _between_within(model, silk=False)
    worst = min(ratios, key=ratios.get)
    assert ratios[worst] > 1.15, (worst, ratios[worst])
    assert np.median(list(ratios.values())) > 2.0
    assert np.median(list(_between_within(model, silk=True).values())) > 2.0


# -- the silkscreen ----------------------------------------------------------------

def _same_pads(model: CoEModel) -> list[tuple[str, str]]:
    return [(a, b) for a, b in itertools.combinations(sorted(model.components), 2)
            if footprint(a).pads == footprint(b).pads]


def test_silkscreen_is_a_function_of_the_name(model: CoEModel) -> None:
    for c in model.components:
        assert silkscreen(c) == silkscreen.__wrapped__(c)
        assert silkscreen(c).lines and silkscreen(c).marks
    assert designator("T-0001") == designator("T-0001") != designator("T-0002")


def _glyph_distance(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """Cells in which two 3x5 glyphs differ, at the best of all shifts by up to one cell."""
    def grid(g: tuple[str, ...], dy: int = 0, dx: int = 0) -> np.ndarray:
        out = np.zeros((7, 5), int)
        out[1 + dy:6 + dy, 1 + dx:4 + dx] = [[ch == "#" for ch in row] for row in g]
        return out
    return min(int(np.abs(grid(a) - grid(b, dy, dx)).sum()) for dy in (-1, 0, 1) for dx in (-1, 0, 1))


def test_types_with_identical_pads_get_different_designators(model: CoEModel) -> None:
    pairs = _same_pads(model)
    assert ("C0603", "R0603") in pairs and ("C0603", "LED0603") in pairs and len(pairs) >= 14
    for a, b in pairs:  # other families: glyphs far apart, even with the position jitter
        (ga, _), (gb, _) = designator(a), designator(b)
        assert _glyph_distance(ga, gb) >= 4, (a, b)
    codes = [designator(c)[1] for c in model.components]
    assert all(len(code) == CODE_BITS and set(code) <= {0, 1} for code in codes)
    assert len(set(codes)) > 8  # the name code varies within a family too


def test_missing_parts_with_identical_pads_now_differ(model: CoEModel) -> None:
    """An R0603 and a C0603 with the part missing: the same pads, but not the same picture."""
    for seed in range(4):
        r_bare = draw_component("R0603", "missing", np.random.default_rng(seed), silk=False)
        c_bare = draw_component("C0603", "missing", np.random.default_rng(seed), silk=False)
        assert np.array_equal(r_bare, c_bare)  # without the print nothing told them apart
        r = draw_component("R0603", "missing", np.random.default_rng(seed)).astype(int)
        c = draw_component("C0603", "missing", np.random.default_rng(seed)).astype(int)
        diff = np.abs(r - c).max(axis=2)
        assert (diff > 60).sum() > 40
        assert (diff[:20, :20] > 60).sum() > 15  # the designator corner, which no body covers
    for a, b in _same_pads(model):
        ia = draw_component(a, "missing", np.random.default_rng(0)).astype(int)
        ib = draw_component(b, "missing", np.random.default_rng(0)).astype(int)
        assert np.abs(ia - ib).mean() > 2, (a, b)


def _corner(img: np.ndarray) -> np.ndarray:
    """The designator corner (top left, 12 x 18 px of 64), clear of every body."""
    return img[:18, :12].astype(np.float32)


@pytest.mark.parametrize("label", LABELS)
def test_designator_shows_whatever_the_label(label: str) -> None:
    for seed in range(4):
        own = _corner(draw_component("R0603", label, np.random.default_rng(seed)))
        ok = _corner(draw_component("R0603", "ok", np.random.default_rng(seed)))
        other = _corner(draw_component("C0603", label, np.random.default_rng(seed)))
        assert np.abs(own - ok).mean() < 12  # noise and brightness only
        assert np.abs(own - other).mean() > 18


def test_type_is_recognisable_from_the_designator_when_the_part_is_missing_or_wrong() -> None:
    """Among chips with identical pads, a template match on the designator corner finds the type.

    Templates are the corners of a few 'ok' draws; each is compared with the test corner at
    every shift up to 4 px, which absorbs the position jitter (as a CNN's pooling does).
    """
    names = ["R0603", "C0603", "L0603", "F0603", "LED0603"]
    s = 4

    def dist(template: np.ndarray, img: np.ndarray) -> float:
        win = template[s:22 - s, s:16 - s]
        h, w = win.shape[:2]
        return min(float(np.abs(img[s + dy:s + dy + h, s + dx:s + dx + w] - win).mean())
                   for dy in range(-s, s + 1) for dx in range(-s, s + 1))

    rng = np.random.default_rng(3)
    templates = [[draw_component(c, "ok", rng).astype(np.float32)[:22, :16] for _ in range(3)] for c in names]
    hits = []
    for label in ("missing", "wrong_part", "misaligned"):
        for i, c in enumerate(names):
            for _ in range(8):
                img = draw_component(c, label, rng).astype(np.float32)
                scores = [min(dist(t, img) for t in ts) for ts in templates]
                hits.append(int(np.argmin(scores)) == i)
    assert np.mean(hits) > 0.93, np.mean(hits)

