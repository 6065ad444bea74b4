"""The ingest wire protocol (DESIGN.md §6), parsed strictly.

A DEALER client sends ``[header, payload]``; the ROUTER sees ``[identity, header,
payload]`` and answers ``[identity, frame_id, status, detail]``.  Every way a
message can be wrong maps to one `Reject` reason code, so the client, the
metrics and the `errors` table all speak the same words.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import numpy as np

VERSION = 1
ENCODINGS = ("jpeg", "png", "raw")
MAX_ID_LEN = 128
MAX_HEADER_BYTES = 64 * 1024
MAX_SIDE = 8192
MAX_PIXELS = 4096 * 4096   # a decoded frame is at most 48 MiB of RGB; a component crop is far smaller

# reason codes, stable: clients and dashboards match on them
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_field"
BAD_FIELD = "bad_field"
UNKNOWN_VERSION = "unknown_version"
WRONG_LINE = "wrong_line"
UNKNOWN_COMPONENT = "unknown_component"
BAD_IMAGE = "bad_image"
OVERSIZE = "oversize"
BAD_FRAMING = "bad_framing"
BUSY = "busy"              # not journaled: the agent is saturated; the client retries with backoff
LOW_CONFIDENCE = "low_confidence"
ID_CONFLICT = "id_conflict"  # a frame_id accepted before with other image bytes: a new frame needs a new id
REASONS = (MALFORMED_JSON, MISSING_FIELD, BAD_FIELD, UNKNOWN_VERSION, WRONG_LINE,
           UNKNOWN_COMPONENT, BAD_IMAGE, OVERSIZE, BAD_FRAMING, BUSY, LOW_CONFIDENCE, ID_CONFLICT)

ACCEPTED, DUPLICATE, REJECTED = "accepted", "duplicate", "rejected"


class Reject(Exception):
    """A frame the agent refuses; `reason` is a code from REASONS, `detail` is for people."""

    def __init__(self, reason: str, detail: str, frame_id: str = "") -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.frame_id = reason, detail, frame_id

    @property
    def ack_detail(self) -> str:
        return f"{self.reason}: {self.detail}"


@dataclass(frozen=True)
class Header:
    v: int
    frame_id: str
    line: str
    board_id: str
    component: str | None
    ts: float
    encoding: str
    shape: tuple[int, int, int] | None = None
    dtype: str | None = None

    def to_json(self) -> dict:
        d = {"v": self.v, "frame_id": self.frame_id, "line": self.line, "board_id": self.board_id,
             "ts": self.ts, "encoding": self.encoding}
        if self.component is not None:
            d["component"] = self.component
        if self.shape is not None:
            d["shape"] = list(self.shape)
            d["dtype"] = self.dtype or "uint8"
        return d


_FIELDS = {"v": int, "frame_id": str, "line": str, "board_id": str, "component": str,
           "ts": (int, float), "encoding": str, "shape": list, "dtype": str}
_REQUIRED = ("v", "frame_id", "line", "board_id", "ts", "encoding")


def parse_header(raw: bytes, *, require_component: bool = True) -> Header:
    """Parse and check a header.  Raises Reject; never anything else for bad bytes."""
    if len(raw) > MAX_HEADER_BYTES:
        raise Reject(OVERSIZE, f"header is {len(raw)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise Reject(MALFORMED_JSON, "header JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise Reject(MALFORMED_JSON, f"header is not UTF-8 JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise Reject(MALFORMED_JSON, f"header must be a JSON object, got {type(obj).__name__}")
    frame_id = obj.get("frame_id") if isinstance(obj.get("frame_id"), str) else ""
    frame_id = printable(frame_id[:MAX_ID_LEN])
    bad = _not_unicode(obj)
    if bad is not None:   # JSON's "\ud800": a string no UTF-8 store, log or ack can hold
        raise Reject(BAD_FIELD, f"{bad} holds a lone surrogate escape (not Unicode text)", frame_id)
    if "v" in obj and obj["v"] != VERSION and isinstance(obj["v"], int) and not isinstance(obj["v"], bool):
        raise Reject(UNKNOWN_VERSION, f"protocol version {obj['v']} not supported (this agent speaks v{VERSION})", frame_id)
    required = _REQUIRED + (("component",) if require_component else ())
    for name in required:
        if name not in obj or obj[name] is None:
            raise Reject(MISSING_FIELD, f"field '{name}' is required", frame_id)
    for name, typ in _FIELDS.items():
        if name in obj and obj[name] is not None:
            val = obj[name]
            if isinstance(val, bool) or not isinstance(val, typ):
                want = "number" if name == "ts" else (typ.__name__ if isinstance(typ, type) else str(typ))
                raise Reject(BAD_FIELD, f"field '{name}' must be a {want}, got {type(val).__name__}", frame_id)
    for name in ("frame_id", "line", "board_id"):
        if not obj[name] or len(obj[name]) > MAX_ID_LEN:
            raise Reject(BAD_FIELD, f"field '{name}' must be 1..{MAX_ID_LEN} characters", frame_id)
    try:
        finite = math.isfinite(float(obj["ts"]))
    except OverflowError:
        finite = False
    if not finite:
        raise Reject(BAD_FIELD, "field 'ts' must be a finite number", frame_id)
    if obj["encoding"] not in ENCODINGS:
        raise Reject(BAD_FIELD, f"field 'encoding' must be one of {', '.join(ENCODINGS)}, got '{obj['encoding']}'", frame_id)
    shape = None
    if obj["encoding"] == "raw":
        shape = _raw_shape(obj, frame_id)
    extra = sorted(set(obj) - set(_FIELDS))
    if extra:
        raise Reject(BAD_FIELD, f"unknown field(s): {', '.join(extra)}", frame_id)
    return Header(v=VERSION, frame_id=obj["frame_id"], line=obj["line"], board_id=obj["board_id"],
                  component=obj.get("component"), ts=float(obj["ts"]), encoding=obj["encoding"],
                  shape=shape, dtype=obj.get("dtype", "uint8") if shape else None)


def _not_unicode(obj: dict) -> str | None:
    """The first key or string value (one level of lists) that is not encodable text, named; None if all are."""
    for key, val in obj.items():
        if not _encodes(key):
            return f"a field name ({printable(key)!r})"
        for v in (val if isinstance(val, list) else (val,)):
            if isinstance(v, str) and not _encodes(v):
                return f"field '{printable(key)}'"
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot hold escaped as a backslash sequence, so a reject can name it."""
    return text if _encodes(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _raw_shape(obj: dict, frame_id: str) -> tuple[int, int, int]:
    shape = obj.get("shape")
    if shape is None:
        raise Reject(MISSING_FIELD, "field 'shape' is required for raw encoding", frame_id)
    if (len(shape) != 3 or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape)
            or not (0 < shape[0] <= MAX_SIDE and 0 < shape[1] <= MAX_SIDE) or shape[2] not in (1, 3)):
        raise Reject(BAD_FIELD, f"field 'shape' must be [h, w, 1|3] with sides 1..{MAX_SIDE}, got {shape}", frame_id)
    if obj.get("dtype", "uint8") != "uint8":
        raise Reject(BAD_FIELD, f"field 'dtype' must be 'uint8', got '{obj.get('dtype')}'", frame_id)
    return (shape[0], shape[1], shape[2])


def decode_image(header: Header, payload: bytes) -> np.ndarray:
    """Payload -> HxWx3 uint8 RGB.  Raises Reject(BAD_IMAGE) for anything undecodable."""
    if not payload:
        raise Reject(BAD_IMAGE, "payload is empty", header.frame_id)
    if header.encoding == "raw":
        h, w, c = header.shape  # type: ignore[misc]
        if len(payload) != h * w * c:
            raise Reject(BAD_IMAGE, f"raw payload is {len(payload)} bytes, shape {[h, w, c]} needs {h * w * c}",
                         header.frame_id)
        img = np.frombuffer(payload, dtype=np.uint8).reshape(h, w, c)
        return np.repeat(img, 3, axis=2) if c == 1 else img.copy()
    magic = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8"}[header.encoding]
    if not payload.startswith(magic):
        raise Reject(BAD_IMAGE, f"payload is not a {header.encoding} image (bad magic bytes)", header.frame_id)
    if header.encoding == "jpeg" and not payload.rstrip(b"\x00").endswith(b"\xff\xd9"):
        raise Reject(BAD_IMAGE, "jpeg payload is truncated (no end-of-image marker)", header.frame_id)
    if header.encoding == "png" and b"IEND" not in payload[-16:]:
        raise Reject(BAD_IMAGE, "png payload is truncated (no IEND chunk)", header.frame_id)
    dims = image_dims(header.encoding, payload)
    if dims is None:
        raise Reject(BAD_IMAGE, f"{header.encoding} payload has no readable image header", header.frame_id)
    w, h = dims
    if w <= 0 or h <= 0 or w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_PIXELS:
        raise Reject(BAD_IMAGE, f"image is {w}x{h}: sides must be 1..{MAX_SIDE} px and at most {MAX_PIXELS} pixels",
                     header.frame_id)
    arr = _decode_compressed(header.encoding, payload, header.frame_id)
    if arr.size == 0:
        raise Reject(BAD_IMAGE, f"{header.encoding} payload could not be decoded", header.frame_id)
    if arr.shape[0] > MAX_SIDE or arr.shape[1] > MAX_SIDE:
        raise Reject(BAD_IMAGE, f"image {arr.shape[1]}x{arr.shape[0]} is larger than {MAX_SIDE} px a side",
                     header.frame_id)
    return arr


def _decode_compressed(encoding: str, payload: bytes, frame_id: str) -> np.ndarray:
    """PNG or JPEG -> HxWx3 uint8 RGB, the decoder's complaint in the Reject's detail.

    Pillow rather than OpenCV: libpng and libjpeg inside OpenCV print their
    errors ('libpng error: IDAT: incorrect data check') straight to stderr,
    where nobody can tell which frame they belong to, while Pillow raises
    them.  The pixels are the same as OpenCV's: EXIF orientation is applied,
    alpha is dropped, 16-bit samples keep their high byte.  The format's own
    image class is used, not `Image.open`, which ultralytics replaces on import
    with one that tries to install a HEIF plugin when a file is unreadable.
    """
    from PIL import Image, ImageOps, JpegImagePlugin, PngImagePlugin, UnidentifiedImageError

    kind = PngImagePlugin.PngImageFile if encoding == "png" else JpegImagePlugin.JpegImageFile
    try:
        with kind(io.BytesIO(payload)) as im:
            im.load()
            if encoding == "jpeg":
                im = ImageOps.exif_transpose(im)
            if im.mode.startswith("I"):        # 16-bit grey (I;16*, or I on older Pillow)
                grey = (np.asarray(im, dtype=np.uint32) >> 8).astype(np.uint8)
                return np.repeat(grey[..., None], 3, axis=2)
            return np.array(im.convert("RGB"))
    except (OSError, ValueError, SyntaxError, EOFError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        why = str(exc).strip() or type(exc).__name__
        raise Reject(BAD_IMAGE, f"{encoding} payload could not be decoded: {why[:160]}", frame_id) from None


def image_dims(encoding: str, payload: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG IHDR or a JPEG SOF marker, read before decoding.

    Checking the size first keeps a small, highly compressed image from
    expanding into gigabytes inside the decoder.
    """
    if encoding == "png":
        if len(payload) < 24 or payload[12:16] != b"IHDR":
            return None
        return int.from_bytes(payload[16:20], "big"), int.from_bytes(payload[20:24], "big")
    i = 2
    while i + 9 < len(payload):
        if payload[i] != 0xFF:
            return None
        marker = payload[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = int.from_bytes(payload[i + 2:i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return int.from_bytes(payload[i + 7:i + 9], "big"), int.from_bytes(payload[i + 5:i + 7], "big")
        if length < 2:
            return None
        i += 2 + length
    return None


def encode_header(fields: dict) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode("utf-8")


def ack(frame_id: str, status: str, detail: str = "") -> list[bytes]:
    return [frame_id.encode("utf-8"), status.encode("ascii"), detail.encode("utf-8")]


def reason_of(detail: str) -> str:
    """The reason code at the front of a rejected ack's detail."""
    return detail.split(":", 1)[0]
