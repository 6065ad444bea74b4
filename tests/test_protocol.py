"""The wire header parser and image decoder: every malformed input maps to one reject reason."""
import json

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent import protocol as P

GOOD = {"v": 1, "frame_id": "f1", "line": "A", "board_id": "B1", "component": "R0402", "ts": 1.5,
        "encoding": "png"}


def enc(d) -> bytes:
    return json.dumps(d).encode()


def png(h=16, w=16) -> bytes:
    ok, buf = cv2.imencode(".png", np.full((h, w, 3), 120, np.uint8))
    return buf.tobytes()


def jpeg() -> bytes:
    ok, buf = cv2.imencode(".jpg", np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    return buf.tobytes()


def test_good_header():
    h = P.parse_header(enc(GOOD))
    assert (h.frame_id, h.component, h.encoding, h.ts) == ("f1", "R0402", "png", 1.5)


@pytest.mark.parametrize("raw,reason,needle", [
    (b"{not json", P.MALFORMED_JSON, "JSON"),
    (b"\xff\xfe\x00", P.MALFORMED_JSON, "UTF-8"),
    (b"[1, 2]", P.MALFORMED_JSON, "object"),
    (enc({**GOOD, "v": 2}), P.UNKNOWN_VERSION, "version 2"),
    (enc({k: v for k, v in GOOD.items() if k != "board_id"}), P.MISSING_FIELD, "board_id"),
    (enc({k: v for k, v in GOOD.items() if k != "component"}), P.MISSING_FIELD, "component"),
    (enc({**GOOD, "ts": "yesterday"}), P.BAD_FIELD, "'ts'"),
    (enc({**GOOD, "v": True}), P.BAD_FIELD, "'v'"),
    (enc({**GOOD, "frame_id": 7}), P.BAD_FIELD, "'frame_id'"),
    (enc({**GOOD, "frame_id": ""}), P.BAD_FIELD, "'frame_id'"),
    (enc({**GOOD, "encoding": "gif"}), P.BAD_FIELD, "encoding"),
    (enc({**GOOD, "encoding": "raw"}), P.MISSING_FIELD, "shape"),
    (enc({**GOOD, "encoding": "raw", "shape": [4, 4, 2]}), P.BAD_FIELD, "shape"),
    (enc({**GOOD, "encoding": "raw", "shape": [4, 4, 3], "dtype": "float32"}), P.BAD_FIELD, "dtype"),
    (enc({**GOOD, "colour": "red"}), P.BAD_FIELD, "colour"),
    (b" " * (P.MAX_HEADER_BYTES + 1), P.OVERSIZE, "header"),
])
def test_bad_headers(raw, reason, needle):
    with pytest.raises(P.Reject) as ei:
        P.parse_header(raw)
    assert ei.value.reason == reason
    assert needle in ei.value.detail


def test_reject_keeps_frame_id_when_known():
    with pytest.raises(P.Reject) as ei:
        P.parse_header(enc({**GOOD, "ts": None}))
    assert ei.value.frame_id == "f1"


def test_decode_png_jpeg_raw():
    h = P.parse_header(enc(GOOD))
    assert P.decode_image(h, png(10, 12)).shape == (10, 12, 3)
    hj = P.parse_header(enc({**GOOD, "encoding": "jpeg"}))
    assert P.decode_image(hj, jpeg()).shape == (32, 32, 3)
    hr = P.parse_header(enc({**GOOD, "encoding": "raw", "shape": [2, 3, 1]}))
    img = P.decode_image(hr, bytes(range(6)))
    assert img.shape == (2, 3, 3) and img[0, 1, 2] == 1


@pytest.mark.parametrize("encoding,payload,needle", [
    ("png", b"", "empty"),
    ("png", b"GIF89a....", "magic"),
    ("png", png()[:40], "truncated"),
    ("jpeg", jpeg()[: len(jpeg()) // 2], "truncated"),
    ("jpeg", b"\xff\xd8garbage\xff\xd9", "image header"),
])
def test_bad_images(encoding, payload, needle):
    h = P.parse_header(enc({**GOOD, "encoding": encoding}))
    with pytest.raises(P.Reject) as ei:
        P.decode_image(h, payload)
    assert ei.value.reason == P.BAD_IMAGE and needle in ei.value.detail


def test_raw_size_mismatch():
    h = P.parse_header(enc({**GOOD, "encoding": "raw", "shape": [4, 4, 3]}))
    with pytest.raises(P.Reject, match="needs 48"):
        P.decode_image(h, b"\x00" * 47)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_header_bytes_only_ever_reject(raw):
    try:
        P.parse_header(raw)
    except P.Reject as rej:
        assert rej.reason in P.REASONS


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                           max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(GOOD) + ["shape", "dtype", "x"]), json_values, max_size=10))
def test_fuzz_header_fields_only_ever_reject(fields):
    raw = json.dumps({**GOOD, **fields}, allow_nan=True).encode()
    try:
        h = P.parse_header(raw)
    except P.Reject as rej:
        assert rej.reason in P.REASONS
    else:
        assert isinstance(h.frame_id, str) and h.encoding in P.ENCODINGS
