"""The recording format: round trips, and a clear error for every way a manifest can be wrong."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coe.errors import CoEError
from storage.recording import MANIFEST, RecordedFrame, Recording, RecordingError, RecordingWriter


def _image(seed: int) -> np.ndarray:
    """Smooth, so that JPEG stays close; distinct per seed."""
    coarse = np.random.default_rng(seed).integers(0, 256, (3, 4, 3), dtype=np.uint8)
    return cv2.resize(coarse, (32, 24), interpolation=cv2.INTER_LINEAR)


def _encode(img: np.ndarray, encoding: str) -> tuple[bytes, str]:
    if encoding == "raw":
        return img.tobytes(), "raw"
    ext = ".png" if encoding == "png" else ".jpg"
    ok, buf = cv2.imencode(ext, cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    if not ok:
        raise RuntimeError("encode failed")
    return buf.tobytes(), ext[1:]


def _decode(data: bytes, header: dict) -> np.ndarray:
    if header["encoding"] == "raw":
        return np.frombuffer(data, np.uint8).reshape(header["shape"])
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _header(i: int, encoding: str = "png", **extra) -> dict:
    h = {"v": 1, "frame_id": f"A-B000001-{i:03d}", "line": "A", "board_id": "B000001",
         "component": "R0402", "ts": 1_700_000_000.0 + 0.004 * i, "encoding": encoding}
    if encoding == "raw":
        h.update(shape=[24, 32, 3], dtype="uint8")
    h.update(extra)
    return h


def _line(i: int, **over) -> dict:
    rec = {**_header(i), "file": f"frames/f{i}.png", "truth": "ok"}
    for k, v in over.items():
        if v is _DROP:
            rec.pop(k)
        else:
            rec[k] = v
    return rec


_DROP = object()


def _write_manifest(root: Path, lines: list) -> Path:
    """A recording dir with the given manifest lines (dicts become JSON; str is written as is)."""
    (root / "frames").mkdir(parents=True, exist_ok=True)
    for i in range(5):
        (root / "frames" / f"f{i}.png").write_bytes(b"x")
    text = "".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines)
    (root / MANIFEST).write_text(text, encoding="utf-8")
    return root


def _open_error(root: Path) -> RecordingError:
    with pytest.raises(RecordingError) as info:
        Recording(root)
    return info.value


# -- round trips -------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["png", "jpeg", "raw"])
def test_round_trip_keeps_headers_truth_and_pixels(tmp_path: Path, encoding: str) -> None:
    root = tmp_path / "rec"
    images = [_image(i) for i in range(3)]
    with RecordingWriter(root) as w:
        for i, img in enumerate(images):
            data, ext = _encode(img, encoding)
            w.add(_header(i, encoding), data, ext, truth=["ok", "missing", None][i])
    rec = Recording(root)
    assert len(rec) == 3
    assert [f.header for f in rec] == [_header(i, encoding) for i in range(3)]
    assert [f.truth for f in rec] == ["ok", "missing", None]
    assert all(f.truth_component is None for f in rec)
    for frame, img in zip(rec, images):
        assert frame.file.startswith("frames/")
        got = _decode(rec.payload(frame), frame.header)
        if encoding == "jpeg":  # lossy: close, not equal
            assert got.shape == img.shape
            assert np.abs(got.astype(int) - img.astype(int)).mean() < 8
        else:
            assert np.array_equal(got, img)


def test_header_excludes_recording_fields_and_keeps_truth_component(tmp_path: Path) -> None:
    root = tmp_path / "rec"
    hdr = _header(0)
    del hdr["component"]
    with RecordingWriter(root) as w:
        w.add(hdr, b"p", "png", truth="ok", truth_component="R0402")
    frame = Recording(root).frames[0]
    assert "component" not in frame.header
    assert set(frame.header) == {"v", "frame_id", "line", "board_id", "ts", "encoding"}
    assert (frame.truth, frame.truth_component) == ("ok", "R0402")
    assert isinstance(frame, RecordedFrame)


def test_manifest_appears_only_on_close_and_no_tmp_is_left(tmp_path: Path) -> None:
    root = tmp_path / "rec"
    w = RecordingWriter(root)
    w.add(_header(0), b"p", "png")
    assert not (root / MANIFEST).exists()
    w.close()
    assert (root / MANIFEST).is_file()
    assert sorted(p.name for p in root.iterdir()) == ["frames", MANIFEST]
    assert w.close() == root  # idempotent


def test_failed_writer_leaves_no_manifest(tmp_path: Path) -> None:
    root = tmp_path / "rec"
    with pytest.raises(ZeroDivisionError):
        with RecordingWriter(root) as w:
            w.add(_header(0), b"p", "png")
            1 / 0
    assert not (root / MANIFEST).exists()


def test_writer_refuses_non_empty_dir_unless_overwrite(tmp_path: Path) -> None:
    root = tmp_path / "rec"
    with RecordingWriter(root) as w:
        w.add(_header(0), b"old", "png")
        w.add(_header(1), b"old", "png")
    with pytest.raises(RecordingError, match="not empty"):
        RecordingWriter(root)
    with RecordingWriter(root, overwrite=True) as w:
        w.add(_header(5), b"new", "png")
    rec = Recording(root)
    assert [f.header["frame_id"] for f in rec] == ["A-B000001-005"]
    assert sorted(p.name for p in (root / "frames").iterdir()) == ["A-B000001-005.png"]


def test_writer_rejects_bad_headers_and_duplicates(tmp_path: Path) -> None:
    w = RecordingWriter(tmp_path / "rec")
    w.add(_header(0), b"p", "png")
    with pytest.raises(RecordingError, match="frame_id"):
        w.add(_header(0), b"p", "png")
    with pytest.raises(RecordingError, match="'shape'"):
        w.add({k: v for k, v in _header(1, "raw").items() if k != "shape"}, b"p", "raw")
    with pytest.raises(RecordingError, match="'file'"):
        w.add(_header(2), b"p", "../png")
    with pytest.raises(RecordingError, match="'truth'"):
        w.add({**_header(3), "truth": "ok"}, b"p", "png")
    w.close()
    assert len(Recording(tmp_path / "rec")) == 1


def test_sanitised_names_stay_inside_and_are_unique(tmp_path: Path) -> None:
    root = tmp_path / "rec"
    ids = ["../../etc/passwd", "a/b", "a_b", ".hidden", "x" * 500]
    with RecordingWriter(root) as w:
        for i, fid in enumerate(ids):
            w.add(_header(i, frame_id=fid), fid.encode()[:50], "png")
    rec = Recording(root)
    files = [f.file for f in rec]
    assert len(set(files)) == len(ids)
    assert [rec.payload(f) for f in rec] == [fid.encode()[:50] for fid in ids]
    assert all(Path(f).parent == Path("frames") and not Path(f).name.startswith(".") for f in files)
    assert not (tmp_path / "etc").exists()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=6, unique=True))
def test_any_frame_ids_round_trip(ids: list[str]) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "rec"
        with RecordingWriter(root) as w:
            for i, fid in enumerate(ids):
                w.add(_header(i, frame_id=fid), str(i).encode(), "png")
        rec = Recording(root)
        assert [f.header["frame_id"] for f in rec] == ids
        assert [rec.payload(f) for f in rec] == [str(i).encode() for i in range(len(ids))]


def test_recording_error_is_a_coe_error() -> None:
    err = RecordingError("m.jsonl", "bad", 3, "ts")
    assert isinstance(err, CoEError)
    assert str(err) == "m.jsonl: line 3: field 'ts': bad"


# -- malformed manifests -----------------------------------------------------------

def test_missing_directory_and_missing_manifest(tmp_path: Path) -> None:
    assert "does not exist" in str(_open_error(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    err = _open_error(tmp_path / "empty")
    assert MANIFEST in str(err) and "does not exist" in str(err)


def test_blank_lines_are_skipped_but_counted(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path, [_line(0), "", "   ", _line(1)])
    assert [f.file for f in Recording(root)] == ["frames/f0.png", "frames/f1.png"]
    root2 = _write_manifest(tmp_path / "b", [_line(0), "", "{not json"])
    err = _open_error(root2)
    assert err.line == 3


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    err = _open_error(_write_manifest(tmp_path, [_line(0), '{"v": 1, "frame_id": ']))
    assert (err.line, err.field) == (2, "<line>")
    assert str(tmp_path / MANIFEST) in str(err) and "line 2" in str(err) and "JSON" in str(err)


def test_non_object_line(tmp_path: Path) -> None:
    err = _open_error(_write_manifest(tmp_path, ["[1, 2]"]))
    assert (err.line, err.field) == (1, "<line>")


@pytest.mark.parametrize("field", ["v", "frame_id", "line", "board_id", "ts", "encoding", "file"])
def test_missing_field(tmp_path: Path, field: str) -> None:
    err = _open_error(_write_manifest(tmp_path, [_line(0), _line(1, **{field: _DROP})]))
    assert (err.line, err.field) == (2, field)
    assert f"field '{field}'" in str(err) and "required" in str(err)


@pytest.mark.parametrize("field,value", [
    ("v", "1"), ("v", True), ("v", 2), ("frame_id", 7), ("frame_id", ""), ("line", None),
    ("board_id", ["B1"]), ("component", 3), ("ts", "1.0"), ("ts", True), ("shape", [24, 32]),
    ("shape", [24, 32, 0]), ("shape", "24x32x3"), ("dtype", "float32"), ("truth", 1),
    ("truth_component", 5), ("file", 9),
])
def test_wrong_type_or_value(tmp_path: Path, field: str, value: object) -> None:
    err = _open_error(_write_manifest(tmp_path, [_line(0, **{field: value})]))
    assert (err.line, err.field) == (1, field)


def test_non_finite_ts(tmp_path: Path) -> None:
    err = _open_error(_write_manifest(tmp_path, ['{"v": 1, "ts": NaN}']))
    assert err.line == 1


def test_bad_encoding(tmp_path: Path) -> None:
    err = _open_error(_write_manifest(tmp_path, [_line(0, encoding="gif")]))
    assert (err.line, err.field) == (1, "encoding")
    assert "gif" in str(err)


def test_raw_without_shape(tmp_path: Path) -> None:
    err = _open_error(_write_manifest(tmp_path, [_line(0, encoding="raw")]))
    assert (err.line, err.field) == (1, "shape")


def test_unknown_field(tmp_path: Path) -> None:
    err = _open_error(_write_manifest(tmp_path, [_line(0, compnent="R0402")]))
    assert (err.line, err.field) == (1, "compnent")


def test_duplicate_frame_id(tmp_path: Path) -> None:
    dup = _line(2, frame_id=_line(0)["frame_id"])
    err = _open_error(_write_manifest(tmp_path, [_line(0), _line(1), dup]))
    assert (err.line, err.field) == (3, "frame_id")
    assert "line 1" in str(err)


@pytest.mark.parametrize("file", ["../outside.png", "frames/../../outside.png", "frames/../..",
                                  "/etc/passwd", "", ".", "frames\\..\\..\\x.png"])
def test_paths_that_escape_are_refused(tmp_path: Path, file: str) -> None:
    root = tmp_path / "rec"
    (tmp_path / "outside.png").write_bytes(b"secret")
    err = _open_error(_write_manifest(root, [_line(0), _line(1, file=file)]))
    assert (err.line, err.field) == (2, "file")


def test_absolute_path_inside_the_dir_is_still_refused(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path / "rec", [])
    err = _open_error(_write_manifest(root, [_line(0, file=str(root / "frames" / "f0.png"))]))
    assert (err.line, err.field) == (1, "file")
    assert "absolute" in str(err)


def test_symlink_outside_is_refused(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path / "rec", [])
    (tmp_path / "secret.png").write_bytes(b"secret")
    os.symlink(tmp_path / "secret.png", root / "frames" / "link.png")
    os.symlink(tmp_path, root / "up")
    err = _open_error(_write_manifest(root, [_line(0, file="frames/link.png")]))
    assert (err.line, err.field) == (1, "file") and "outside" in str(err)
    err = _open_error(_write_manifest(root, [_line(0, file="up/secret.png")]))
    assert (err.line, err.field) == (1, "file")


def test_symlink_inside_is_allowed(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path / "rec", [])
    os.symlink(root / "frames" / "f0.png", root / "frames" / "alias.png")
    rec = Recording(_write_manifest(root, [_line(0, file="frames/alias.png")]))
    assert rec.payload(rec.frames[0]) == b"x"


def test_payload_of_missing_file(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path / "rec", [_line(0), _line(1)])
    rec = Recording(root)
    (root / "frames" / "f1.png").unlink()
    assert rec.payload(rec.frames[0]) == b"x"
    with pytest.raises(RecordingError, match="missing") as info:
        rec.payload(rec.frames[1])
    assert "frames/f1.png" in str(info.value) and info.value.field == "file"


def test_payload_of_symlink_swapped_in_after_open(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path / "rec", [_line(0)])
    rec = Recording(root)
    (tmp_path / "secret.png").write_bytes(b"secret")
    (root / "frames" / "f0.png").unlink()
    os.symlink(tmp_path / "secret.png", root / "frames" / "f0.png")
    with pytest.raises(RecordingError, match="outside"):
        rec.payload(rec.frames[0])


def test_raw_payload_size_must_match_shape(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path / "rec", [_line(0, encoding="raw", shape=[2, 2, 3], dtype="uint8")])
    rec = Recording(root)
    with pytest.raises(RecordingError, match="12"):
        rec.payload(rec.frames[0])
    (root / "frames" / "f0.png").write_bytes(bytes(12))
    assert rec.payload(rec.frames[0]) == bytes(12)


def test_non_utf8_line(tmp_path: Path) -> None:
    root = _write_manifest(tmp_path / "rec", [_line(0)])
    with open(root / MANIFEST, "ab") as fh:
        fh.write(b'{"v": "\xff"}\n')
    err = _open_error(root)
    assert err.line == 2
