"""Seeded procedural component images, and a maker of synthetic recordings.

There are no real AOI images in the repository, yet the agent, the replay
client and the learned router need frames whose component type can be seen in
the pixels.  `draw_component` draws a top view of a component crop with cv2:
PCB green with noise, the board's silkscreen, copper/solder pads, and a body
whose colour, shape, size and leads depend on the family (name prefix) and
package code.  Defects change the picture the way an AOI would see them (no
body, body shifted off its pads, a body of another family).  The silkscreen is
printed on the board, not on the part, so it stays whatever the label: an
outline whose shape follows the package, and in the top-left corner a
reference-designator glyph for the family plus a small barcode derived from the
full name.  That keeps the type visible when the part is missing or replaced
(an R0603 and a C0603 have identical pads).  Everything random comes from the
injected generator, so the same seed draws the same pixels.
"""
from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from coe.errors import CoEError
from coe.spec import CoEModel

from .recording import RecordingWriter

DEFECTS = ("missing", "misaligned", "wrong_part")
LABELS = ("ok",) + DEFECTS
_EXTENSIONS = {"png": "png", "jpeg": "jpg", "raw": "raw"}
EPOCH = 1_700_000_000.0
FRAME_INTERVAL_S = 0.004
JPEG_QUALITY = 90
_SS = 4  # supersampling: draw at 4x and shrink, so small parts keep sub-pixel shape

RGB = tuple[int, int, int]
PCB_GREEN: RGB = (28, 92, 48)
COPPER: RGB = (196, 150, 84)
SOLDER: RGB = (188, 188, 182)
TIN: RGB = (206, 206, 200)
LEAD: RGB = (200, 200, 196)
BLACK: RGB = (26, 26, 28)
CATHODE_BAND: RGB = (196, 196, 200)  # a diode's polarity mark
LED_MARK: RGB = (40, 170, 60)        # an LED's green cathode mark
SILK: RGB = (226, 228, 218)  # silkscreen ink: white epoxy, a little grey


@dataclass(frozen=True)
class Shape:
    """One filled primitive in unit coordinates: (0, 0) is the crop centre, 1.0 the crop side."""

    kind: str  # rect | circle | stadium (rect with round ends along its long side)
    cx: float
    cy: float
    w: float
    h: float
    color: RGB


@dataclass(frozen=True)
class Footprint:
    """What a component type looks like: pads on the board, and the body (with its leads)."""

    family: str
    pads: tuple[Shape, ...]
    body: tuple[Shape, ...]


# -- geometry per family -----------------------------------------------------------

def family_of(component: str) -> str:
    """The family from the name prefix: R, C, L, F, D, LED, Q, U, X, J, or GENERIC."""
    name = component.upper()
    if name.startswith("LED"):
        return "LED"
    if name and name[0] in "RCLFDQUXJ":
        return name[:1]
    return "GENERIC"


def _package(component: str) -> str:
    name = component.upper()
    name = name[3:] if name.startswith("LED") else name[1:]
    return name.lstrip("-_")


NO_LEAD_PACKAGES = ("QFN",)


def no_leads(component: str) -> bool:
    """True for a no-lead package (QFN): its terminals sit under the body's edge, so no lead can lift."""
    return family_of(component) == "U" and _package(component).startswith(NO_LEAD_PACKAGES)


def _chip_size(code: str) -> tuple[float, float]:
    """Body (length, width) in crop units from an imperial chip code like 0402 (0.04 x 0.02 in)."""
    m = re.match(r"(\d{2})(\d{2})", code)
    l_mm, w_mm = (int(m.group(1)) * 0.254, int(m.group(2)) * 0.254) if m else (1.6, 0.8)
    l_mm, w_mm = max(l_mm, 0.3), max(w_mm, 0.15)
    length = min(0.2 + 0.15 * l_mm, 0.85)
    return length, min(length * w_mm / l_mm, 0.6)


MAX_PINS = 256     # a package code's pin count is clamped to it: 'U-SOIC2000000000' draws 256 leads, not 2e9


def _pins(component: str, default: int) -> int:
    """The pin count a package code ends with ('SOIC8': 8), at most MAX_PINS; `default` if it ends in no digits."""
    m = re.search(r"(\d+)$", component)
    if m is None:
        return default
    digits = m.group(1).lstrip("0") or "0"
    return MAX_PINS if len(digits) > 3 else min(int(digits), MAX_PINS)


def _hash01(text: str, salt: int) -> float:
    """A stable number in [0, 1) per name (blake2b: not the salted built-in hash, and unlike
    crc32 it makes near-identical names like T-0001 and T-0002 look unrelated)."""
    digest = hashlib.blake2b(f"{salt}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / float(1 << 64)


def _chip(l: float, w: float, body: RGB, caps: RGB, marks: tuple[Shape, ...] = ()) -> Footprint:
    pl, pw = 0.42 * l, 1.2 * w
    px = l / 2 - 0.2 * pl
    pads = (Shape("rect", -px, 0, pl, pw, COPPER), Shape("rect", px, 0, pl, pw, COPPER))
    cap = 0.18 * l
    shapes = (Shape("rect", 0, 0, l, w, body),
              Shape("rect", -(l - cap) / 2, 0, cap, w, caps),
              Shape("rect", (l - cap) / 2, 0, cap, w, caps)) + marks
    return Footprint("", pads, shapes)


def _two_terminal(fam: str, component: str) -> Footprint:
    l, w = _chip_size(_package(component))
    if fam == "R":
        marks = (Shape("rect", 0, 0, 0.42 * l, 0.2 * w, (232, 232, 226)),)
        return _chip(l, w, (34, 32, 30), TIN, marks)
    if fam == "C":
        return _chip(l, w, (176, 126, 74), TIN)
    if fam == "L":
        marks = (Shape("circle", 0, 0, 0.45 * w, 0.45 * w, (40, 44, 60)),)
        return _chip(l, w, (104, 112, 138), TIN, marks)
    if fam == "F":
        marks = (Shape("rect", 0, 0, 0.12 * l, 0.6 * w, (40, 40, 40)),
                 Shape("rect", 0.1 * l, 0, 0.12 * l, 0.6 * w, (40, 40, 40)))
        return _chip(l, w, (228, 222, 196), TIN, marks)
    # LED: pale translucent lens, a bright die in the middle, green cathode mark
    marks = (Shape("circle", 0, 0, 0.55 * w, 0.55 * w, (250, 210, 40)),
             Shape("rect", -0.28 * l, 0, 0.07 * l, 0.8 * w, LED_MARK))
    return _chip(l, w, (236, 232, 196), TIN, marks)


def _diode(component: str) -> Footprint:
    pkg = _package(component)
    l, w = {"SOD123": (0.46, 0.26), "SOD323": (0.34, 0.22), "SOD523": (0.26, 0.16)}.get(
        pkg, (0.3 + 0.2 * _hash01(pkg, 1), 0.2))
    lead_l, lead_w = 0.12 * l + 0.04, 0.45 * w
    x = l / 2 + lead_l / 2 - 0.02
    pads = (Shape("rect", -x, 0, lead_l + 0.06, lead_w + 0.06, COPPER),
            Shape("rect", x, 0, lead_l + 0.06, lead_w + 0.06, COPPER))
    body = (Shape("rect", -x, 0, lead_l, lead_w, LEAD), Shape("rect", x, 0, lead_l, lead_w, LEAD),
            Shape("rect", 0, 0, l, w, BLACK),
            Shape("rect", -0.32 * l, 0, 0.13 * l, w, CATHODE_BAND))
    return Footprint("D", pads, body)


def _sot(component: str) -> Footprint:
    pkg = _package(component)
    body: list[Shape] = []
    pads: list[Shape] = []
    if pkg.startswith("SOT223"):
        bw, bh, lw, lh = 0.58, 0.3, 0.08, 0.13
        ys = bh / 2 + lh / 2 - 0.01
        for x in (-0.19, 0.0, 0.19):
            body.append(Shape("rect", x, ys, lw, lh, LEAD))
            pads.append(Shape("rect", x, ys + 0.02, lw + 0.05, lh + 0.06, COPPER))
        body.append(Shape("rect", 0, -ys, 0.3, lh, LEAD))
        pads.append(Shape("rect", 0, -ys - 0.02, 0.35, lh + 0.06, COPPER))
    else:  # SOT23 and relatives: two leads below, one above
        bw, bh, lw, lh = 0.4, 0.2, 0.07, 0.12
        ys = bh / 2 + lh / 2 - 0.01
        for x, y in ((-0.13, ys), (0.13, ys), (0.0, -ys)):
            body.append(Shape("rect", x, y, lw, lh, LEAD))
            pads.append(Shape("rect", x, y + (0.02 if y > 0 else -0.02), lw + 0.05, lh + 0.06, COPPER))
    body.append(Shape("rect", 0, 0, bw, bh, BLACK))
    body.append(Shape("rect", 0, 0, 0.35 * bw, 0.12 * bh, (92, 92, 96)))  # laser marking
    return Footprint("Q", tuple(pads), tuple(body))


def _ic(component: str) -> Footprint:
    pkg = _package(component)
    pins = _pins(pkg, 8)
    quad = pkg.startswith(("QFN", "QFP", "LQFP", "TQFP"))
    leadless = no_leads(component)
    if quad:
        per_side = max(pins // 4, 2)
        bw = bh = 0.62 if leadless else 0.54
    else:
        per_side = max(pins // 2, 1)
        thin = pkg.startswith(("TSSOP", "MSOP", "SSOP"))
        bw = min(0.16 + (0.052 if thin else 0.09) * per_side, 0.84)
        bh = 0.24 if thin else 0.32
    span = bw * 0.84
    pitch = span / per_side
    lw = 0.55 * pitch
    lh = 0.05 if leadless else (0.09 if quad else 0.12)
    body: list[Shape] = []
    pads: list[Shape] = []
    sides = ("top", "bottom", "left", "right") if quad else ("top", "bottom")
    for s in sides:
        for i in range(per_side):
            off = -span / 2 + pitch * (i + 0.5)
            if s in ("top", "bottom"):
                edge = bh / 2 + (lh / 2 - 0.03 if leadless else lh / 2 - 0.01)
                y = -edge if s == "top" else edge
                body.append(Shape("rect", off, y, lw, lh, LEAD))
                pads.append(Shape("rect", off, y + (0.015 if y > 0 else -0.015), lw * 1.3, lh + 0.05, COPPER))
            else:
                edge = bw / 2 + (lh / 2 - 0.03 if leadless else lh / 2 - 0.01)
                x = -edge if s == "left" else edge
                body.append(Shape("rect", x, off, lh, lw, LEAD))
                pads.append(Shape("rect", x + (0.015 if x > 0 else -0.015), off, lh + 0.05, lw * 1.3, COPPER))
    color = (52, 52, 58) if leadless else BLACK
    body.append(Shape("rect", 0, 0, bw, bh, color))
    body.append(Shape("circle", -bw / 2 + 0.07, -bh / 2 + 0.07, 0.06, 0.06, (150, 150, 150)))  # pin 1
    body.append(Shape("rect", 0.03, 0, 0.4 * bw, 0.05, (96, 96, 100)))  # laser marking
    body.append(Shape("rect", 0.03, 0.07, 0.3 * bw, 0.04, (96, 96, 100)))
    return Footprint("U", tuple(pads), tuple(body))


def _crystal(component: str) -> Footprint:
    pkg = _package(component)
    if pkg.startswith("HC49"):
        w, h = 0.8, 0.3
        pads = (Shape("rect", -0.3, 0, 0.22, 0.22, COPPER), Shape("rect", 0.3, 0, 0.22, 0.22, COPPER))
        body = (Shape("stadium", 0, 0, w, h, (150, 152, 158)),
                Shape("stadium", 0, 0, w - 0.05, h - 0.05, (206, 208, 214)),
                Shape("rect", 0, -0.04, w - 0.3, 0.05, (240, 240, 244)))
    else:  # small SMD crystal: square metal lid over four pads
        w = h = 0.4 + 0.2 * _hash01(pkg, 2)
        pads = tuple(Shape("rect", sx * w * 0.38, sy * h * 0.38, 0.16, 0.16, COPPER)
                     for sx in (-1, 1) for sy in (-1, 1))
        body = (Shape("rect", 0, 0, w, h, (200, 202, 208)), Shape("rect", 0, 0, w * 0.8, h * 0.8, (222, 224, 230)))
    return Footprint("X", pads, body)


def _connector(component: str) -> Footprint:
    pkg = _package(component)
    if pkg.startswith("USB"):
        w, h = 0.74, 0.42
        n = 12
    else:
        w, h = 0.5 + 0.3 * _hash01(pkg, 3), 0.3
        n = 4 + int(8 * _hash01(pkg, 4))
    pitch = w * 0.8 / n
    pads: list[Shape] = []
    body: list[Shape] = []
    y = -h / 2 - 0.05
    for i in range(n):
        x = -w * 0.4 + pitch * (i + 0.5)
        pads.append(Shape("rect", x, y - 0.01, pitch * 0.6, 0.1, COPPER))
        body.append(Shape("rect", x, y, pitch * 0.4, 0.08, LEAD))
    for sx in (-1, 1):  # shell mounting tabs
        pads.append(Shape("rect", sx * (w / 2 + 0.02), 0.05, 0.1, 0.2, COPPER))
        body.append(Shape("rect", sx * (w / 2 + 0.01), 0.05, 0.06, 0.14, LEAD))
    body.append(Shape("rect", 0, 0, w, h, (168, 170, 176)))
    body.append(Shape("rect", 0, h / 2 - 0.07, w * 0.82, 0.1, (40, 40, 44)))  # plug opening
    body.append(Shape("rect", 0, -0.04, w * 0.9, 0.03, (214, 216, 222)))
    return Footprint("J", tuple(pads), tuple(body))


def _generic(component: str) -> Footprint:
    """A look for names outside the known families: stable per name, different between names."""
    hue = (85 + int(130 * _hash01(component, 5))) % 180  # any hue but PCB green (OpenCV hue 35..85)
    hsv = np.uint8([[[hue, 140 + int(100 * _hash01(component, 6)), 90 + int(140 * _hash01(component, 7))]]])
    color = tuple(int(c) for c in cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)[0, 0])
    w = 0.25 + 0.5 * _hash01(component, 8)
    h = 0.15 + 0.35 * _hash01(component, 9)
    n = int(6 * _hash01(component, 10))
    pads: list[Shape] = []
    body: list[Shape] = []
    if n == 0:
        for sx in (-1, 1):
            pads.append(Shape("rect", sx * w / 2, 0, 0.12, h * 1.1, COPPER))
            body.append(Shape("rect", sx * (w / 2 - 0.04), 0, 0.08, h, TIN))
    else:
        pitch = w * 0.8 / n
        for i in range(n):
            x = -w * 0.4 + pitch * (i + 0.5)
            for sy in (-1, 1):
                pads.append(Shape("rect", x, sy * (h / 2 + 0.05), pitch * 0.7, 0.12, COPPER))
                body.append(Shape("rect", x, sy * (h / 2 + 0.04), pitch * 0.45, 0.09, LEAD))
    body.append(Shape("rect", 0, 0, w, h, color))
    return Footprint("GENERIC", tuple(pads), tuple(body))


@functools.lru_cache(maxsize=4096)
def footprint(component: str) -> Footprint:
    """The drawing recipe for a component type (pure: depends on the name only).

    An IC's lead count comes from the digits its package code ends with, clamped to
    MAX_PINS (a name is data: 'U-SOIC2000000000' must not draw two billion leads).
    """
    fam = family_of(component)
    if fam in ("R", "C", "L", "F", "LED"):
        fp = _two_terminal(fam, component)
        return Footprint(fam, fp.pads, fp.body)
    builders = {"D": _diode, "Q": _sot, "U": _ic, "X": _crystal, "J": _connector, "GENERIC": _generic}
    return builders[fam](component)


# A representative of each family, used to draw a "wrong_part" body.
_WRONG_PARTS = {"R": "R0603", "C": "C0805", "L": "L0603", "F": "F0603", "D": "D-SOD123",
                "LED": "LED0603", "Q": "Q-SOT23", "U": "U-SOIC8", "X": "X-HC49", "J": "J-USBC"}


# -- silkscreen --------------------------------------------------------------------

SILK_LINE = 0.026  # outline stroke width, crop units (about 1.7 px at 64 px)
GLYPH_CELL = 0.04  # side of one cell of the 3x5 designator glyph, crop units
GLYPH_ORIGIN = (-0.46, -0.46)  # top-left corner of the designator, clear of every body
CODE_BITS = 5

# The reference-designator letter of each family as a 3x5 bitmap ('#' is ink); an LED is a
# D, as on most boards.  The letters of R, C, L, F and LED (whose chip pads are identical)
# differ in at least 4 cells even when one is shifted by a cell against the other.
_GLYPHS = {
    "R": ("##.", "#.#", "##.", "#.#", "#.#"),
    "C": (".##", "#..", "#..", "#..", ".##"),
    "L": ("#..", "#..", "#..", "#..", "###"),
    "F": ("###", "#..", "###", "#..", "#.."),
    "D": ("##.", "#.#", "#.#", "#.#", "##."),
    "LED": ("##.", "#.#", "#.#", "#.#", "##."),
    "Q": ("###", "#.#", "#.#", "###", "..#"),
    "U": ("#.#", "#.#", "#.#", "#.#", "###"),
    "X": ("#.#", "#.#", ".#.", "#.#", "#.#"),
    "J": ("..#", "..#", "..#", "#.#", "###"),
}


@dataclass(frozen=True)
class Silkscreen:
    """What the board prints around a footprint, in unit coordinates like `Shape`."""

    lines: tuple[tuple[tuple[float, float], ...], ...]  # open polylines (outline, polarity)
    marks: tuple[Shape, ...]  # filled: designator glyph, name code, pin-1 dot


def _glyph(component: str) -> tuple[str, ...]:
    fam = family_of(component)
    if fam in _GLYPHS:
        return _GLYPHS[fam]
    bits = int(_hash01(component, 11) * (1 << 15))  # a stable 3x5 pattern per unknown name
    rows = tuple("".join("#" if bits >> (3 * r + c) & 1 else "." for c in range(3)) for r in range(5))
    return rows[:2] + ("###",) + rows[3:]  # never blank: the middle row is always inked


def _name_code(component: str) -> tuple[int, ...]:
    h = int(_hash01(component, 12) * (1 << CODE_BITS))
    return tuple(h >> i & 1 for i in range(CODE_BITS))


def designator(component: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mark printed in the corner: the family's 3x5 glyph rows ('#' is ink) and
    `CODE_BITS` bits hashed from the full name (printed as long 1 / short 0 strokes)."""
    return _glyph(component), _name_code(component)


def _box(shapes: tuple[Shape, ...]) -> tuple[float, float, float, float]:
    return (min(s.cx - s.w / 2 for s in shapes), min(s.cy - s.h / 2 for s in shapes),
            max(s.cx + s.w / 2 for s in shapes), max(s.cy + s.h / 2 for s in shapes))


def _rect(x0: float, y0: float, x1: float, y1: float) -> tuple[tuple[float, float], ...]:
    return ((x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0))


def _ellipse(x0: float, y0: float, x1: float, y1: float, n: int = 32) -> tuple[tuple[float, float], ...]:
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
    t = np.linspace(0.0, 2 * np.pi, n + 1)
    return tuple((float(cx + rx * np.cos(a)), float(cy + ry * np.sin(a))) for a in t)


@functools.lru_cache(maxsize=4096)
def silkscreen(component: str) -> Silkscreen:
    """The silkscreen printed for a component type (pure: depends on the name only).

    The outline follows the package, with the family's usual extras (bracket
    caps, a round coil, the line through a fuse, a cathode bar, a pin-1 dot);
    the designator in the top-left corner is the family glyph and, to its
    right, a row of strokes coding the full name.
    """
    fp = footprint(component)
    fam = fp.family
    main = max(fp.body, key=lambda sh: sh.w * sh.h)  # the package itself, without leads
    lim = 0.45
    if fam in ("U", "Q", "J"):  # leaded parts: outline the package, the pads cross it
        m = 0.035
        x0, y0, x1, y1 = _box((main,))
    else:  # chips, diodes, crystals: the outline goes round pads and body
        m = 0.04
        x0, y0, x1, y1 = _box(fp.pads + (main,))
    x0, y0, x1, y1 = max(x0 - m, -lim), max(y0 - m, -lim), min(x1 + m, lim), min(y1 + m, lim)
    lines: list[tuple[tuple[float, float], ...]] = []
    marks: list[Shape] = []
    bar = 0.05  # a thick polarity bar (cathode, connector edge)
    if fam == "C":  # two brackets, open in the middle of the long sides
        e = 0.3 * (x1 - x0)
        lines += [((x0 + e, y0), (x0, y0), (x0, y1), (x0 + e, y1)),
                  ((x1 - e, y0), (x1, y0), (x1, y1), (x1 - e, y1))]
    elif fam == "L" or (fam == "X" and main.kind == "stadium"):  # coil and HC49 can: round
        lines.append(_ellipse(x0 - 0.02, y0 - 0.02, x1 + 0.02, y1 + 0.02))
    elif fam == "F":  # the fuse symbol: a box with a line through it
        lines += [_rect(x0, y0, x1, y1), ((x0 - 0.07, (y0 + y1) / 2), (x1 + 0.07, (y0 + y1) / 2))]
    elif fam in ("D", "LED"):  # a cathode bar on the left side
        lines.append(_rect(x0, y0, x1, y1))
        marks.append(Shape("rect", x0 - bar / 2, (y0 + y1) / 2, bar, y1 - y0, SILK))
        if fam == "LED":  # and a little arrow pointing at it under the part
            lines.append(((x0 + 0.06, y1 + 0.06), (x0, y1 + 0.06), (x0 + 0.03, y1 + 0.09)))
    elif fam == "Q":  # side brackets: the leads leave through top and bottom
        lines += [((x0 + 0.05, y0), (x0, y0), (x0, y1), (x0 + 0.05, y1)),
                  ((x1 - 0.05, y0), (x1, y0), (x1, y1), (x1 - 0.05, y1))]
    elif fam == "U":  # box with a pin-1 dot outside its first corner
        lines.append(_rect(x0, y0, x1, y1))
        marks.append(Shape("circle", x0 - 0.03, y0 - 0.03, 0.045, 0.045, SILK))
    elif fam == "J":  # box with the board edge drawn as a bar behind the plug opening
        lines.append(_rect(x0, y0, x1, y1))
        marks.append(Shape("rect", (x0 + x1) / 2, min(y1 + 0.03, lim), x1 - x0, 0.03, SILK))
    else:  # R, SMD crystals, unknown names: a plain box
        lines.append(_rect(x0, y0, x1, y1))

    gx, gy = GLYPH_ORIGIN
    c = GLYPH_CELL
    glyph, code = designator(component)
    for r, row in enumerate(glyph):
        for col, ink in enumerate(row):
            if ink == "#":
                marks.append(Shape("rect", gx + (col + 0.5) * c, gy + (r + 0.5) * c, c, c, SILK))
    sx = gx + 3 * c + 0.05  # the name code starts right of the glyph
    for i, bit in enumerate(code):
        h = 5 * c if bit else 2 * c
        marks.append(Shape("rect", sx + i * 0.042, gy + h / 2, 0.022, h, SILK))
    return Silkscreen(tuple(lines), tuple(marks))


# -- rendering ---------------------------------------------------------------------

def _draw(img: np.ndarray, shapes: tuple[Shape, ...], centre: tuple[float, float], scale: float,
          color: RGB | None = None) -> None:
    """Fill `shapes` into `img` (in place); `color` overrides each shape's own (for masks)."""
    cx0, cy0 = centre
    for s in shapes:
        c = color if color is not None else s.color
        x, y = cx0 + s.cx * scale, cy0 + s.cy * scale
        hw, hh = max(s.w * scale / 2, 1.0), max(s.h * scale / 2, 1.0)
        if s.kind == "circle":
            cv2.circle(img, (round(x), round(y)), max(round(hw), 1), c, -1, cv2.LINE_AA)
        elif s.kind == "stadium":
            r = min(hw, hh)
            if hw >= hh:
                cv2.rectangle(img, (round(x - hw + r), round(y - hh)), (round(x + hw - r), round(y + hh)), c, -1)
                for ex in (x - hw + r, x + hw - r):
                    cv2.circle(img, (round(ex), round(y)), round(r), c, -1, cv2.LINE_AA)
            else:
                cv2.rectangle(img, (round(x - hw), round(y - hh + r)), (round(x + hw), round(y + hh - r)), c, -1)
                for ey in (y - hh + r, y + hh - r):
                    cv2.circle(img, (round(x), round(ey)), round(r), c, -1, cv2.LINE_AA)
        else:
            cv2.rectangle(img, (round(x - hw), round(y - hh)), (round(x + hw), round(y + hh)), c, -1)


def _draw_silk(img: np.ndarray, silk: Silkscreen, centre: tuple[float, float], scale: float) -> None:
    """Print `silk` into `img` (in place): outline strokes, then the filled marks."""
    cx0, cy0 = centre
    thick = max(round(SILK_LINE * scale), 1)
    polys = [np.array([[round(cx0 + x * scale), round(cy0 + y * scale)] for x, y in line], np.int32)
             for line in silk.lines]
    cv2.polylines(img, polys, False, SILK, thick, cv2.LINE_AA)
    _draw(img, silk.marks, centre, scale)


@dataclass(frozen=True)
class Scene:
    """A replacement for a footprint's pads and body, plus shapes drawn over everything.

    How `storage.solder` draws a soldering defect on an otherwise ok part
    (a tombstoned body, a lifted lead, a bridge of solder).
    """

    pads: tuple[Shape, ...]
    body: tuple[Shape, ...]
    overlay: tuple[Shape, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where a drawing put the footprint in the output image: pixel = centre + unit * scale."""

    cx: float
    cy: float
    scale: float

    def box(self, x0: float, y0: float, x1: float, y1: float, size: int) -> tuple[float, float, float, float]:
        """A box in unit coordinates as pixels (x1, y1, x2, y2), clipped to the `size` x `size` image."""
        def px(v: float, c: float) -> float:
            return float(min(max(c + v * self.scale, 0.0), size))
        return (px(x0, self.cx), px(y0, self.cy), px(x1, self.cx), px(y1, self.cy))


def draw_component(component: str, label: str, rng: np.random.Generator, size: int = 64, *,
                   silk: bool = True, scene: Callable[[Footprint], Scene] | None = None) -> np.ndarray:
    """A `size` x `size` x 3 uint8 RGB crop of `component` showing `label` (see `render`)."""
    return render(component, label, rng, size, silk=silk, scene=scene)[0]


def render(component: str, label: str, rng: np.random.Generator, size: int = 64, *,
           silk: bool = True, scene: Callable[[Footprint], Scene] | None = None) -> tuple[np.ndarray, Placement]:
    """A `size` x `size` x 3 uint8 RGB crop of `component` showing `label`, and where the part is.

    The type is visible (family colour and shape, package size, lead count, and
    the silkscreen printed round the footprint); the label changes the body
    (absent, shifted and rotated off the pads, or another family's) but never
    the board's silkscreen or pads; jitter in position, scale, brightness and
    noise makes every draw differ.  `silk=False` leaves the silkscreen out (a
    bare footprint); it draws no random numbers, so the rest of the picture is
    the same for the same generator state.  `scene(footprint)` (only with
    label ok) swaps the pads and body drawn and adds an overlay; it is called
    after the position jitter is drawn, so it may draw random numbers itself.
    """
    if label not in LABELS:
        raise ValueError(f"label must be one of {', '.join(LABELS)}, got {label!r}")
    if not isinstance(size, int) or isinstance(size, bool) or not 16 <= size <= 1024:
        raise ValueError(f"size must be an integer in 16..1024, got {size!r}")
    if not isinstance(component, str) or not component:
        raise ValueError(f"component must be a non-empty string, got {component!r}")
    if scene is not None and label != "ok":
        raise ValueError(f"a scene is drawn on an ok part, not on label {label!r}")
    fp = footprint(component)
    big = size * _SS
    scale = big * rng.uniform(0.95, 1.05)
    centre = (big / 2 + rng.uniform(-0.03, 0.03) * big, big / 2 + rng.uniform(-0.03, 0.03) * big)
    tint = rng.uniform(-5, 5, 3)
    bg = tuple(int(v) for v in np.clip(np.array(PCB_GREEN) + tint, 0, 255))
    canvas = np.empty((big, big, 3), np.uint8)
    cv2.rectangle(canvas, (0, 0), (big - 1, big - 1), bg, -1)  # ~15x faster than np.full here
    if silk:
        _draw_silk(canvas, silkscreen(component), centre, scale)  # printed on the board, under everything
    drawn = scene(fp) if scene is not None else Scene(fp.pads, fp.body)
    _draw(canvas, drawn.pads, centre, scale)

    if label == "missing":
        # bare pads wetted with solder, each with a specular highlight
        solder = tuple(Shape("rect", p.cx, p.cy, p.w * 0.8, p.h * 0.8, SOLDER) for p in fp.pads)
        shine = tuple(Shape("circle", p.cx, p.cy, min(p.w, p.h) * 0.35, 0, (240, 240, 236)) for p in fp.pads)
        _draw(canvas, solder + shine, centre, scale)
    else:
        body = drawn.body
        if label == "wrong_part":
            others = sorted(f for f in _WRONG_PARTS if f != fp.family)
            body = footprint(_WRONG_PARTS[others[int(rng.integers(len(others)))]]).body
        if label == "misaligned":
            # draw the body on its own layer, then move it off the pads as one piece
            layer = np.zeros_like(canvas)
            mask = np.zeros((big, big), np.uint8)
            _draw(layer, body, centre, scale)
            _draw(mask, body, centre, scale, color=255)
            angle = float(rng.uniform(12, 35)) * (1 if rng.random() < 0.5 else -1)
            shift = rng.uniform(0.08, 0.16, 2) * big * np.where(rng.random(2) < 0.5, -1, 1)
            m = cv2.getRotationMatrix2D(centre, angle, 1.0)
            m[:, 2] += shift
            layer = cv2.warpAffine(layer, m, (big, big), flags=cv2.INTER_LINEAR)
            mask = cv2.warpAffine(mask, m, (big, big), flags=cv2.INTER_LINEAR)
            np.copyto(canvas, layer, where=(mask > 127)[:, :, None])
        else:
            _draw(canvas, body, centre, scale)
            _draw(canvas, drawn.overlay, centre, scale)

    small = cv2.resize(canvas, (size, size), interpolation=cv2.INTER_AREA).astype(np.float32)
    small *= rng.uniform(0.94, 1.06)
    small += rng.normal(0.0, 3.0, small.shape)
    # in edge coordinates (pixel i spans [i, i + 1)) big x + 0.5 shrinks to (x + 0.5) / SS
    where = Placement((centre[0] + 0.5) / _SS, (centre[1] + 0.5) / _SS, scale / _SS)
    return np.clip(small, 0, 255).astype(np.uint8), where


# -- recordings --------------------------------------------------------------------

def board_layout(model: CoEModel, n: int, rng: np.random.Generator) -> list[str]:
    """`n` component names drawn with probability proportional to each component's frequency."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"a board needs at least one component, got {n!r}")
    names = sorted(model.components)
    freq = np.array([model.components[c].frequency for c in names], dtype=np.float64)
    idx = rng.choice(len(names), size=n, p=freq / freq.sum())
    return [names[i] for i in idx]


def _draw_label(model: CoEModel, component: str) -> tuple[list[str], np.ndarray, dict[str, str]]:
    """The classifier's labels, their prior shares, and the picture each label is drawn as."""
    expert = model.experts[model.components[component].classifier]
    labels = list(expert.classes)
    p = np.array([expert.prior(lb) for lb in labels], dtype=np.float64)
    if p.sum() <= 0:
        raise CoEError(f"{model.source}: expert '{expert.id}' has no priors to draw truth labels from")
    looks: dict[str, str] = {}
    for lb in labels:
        if lb in LABELS:
            looks[lb] = lb
        elif lb in expert.pass_labels:
            looks[lb] = "ok"
        elif p[labels.index(lb)] > 0:
            raise CoEError(f"{model.source}: expert '{expert.id}' label '{lb}' cannot be drawn "
                           f"(synthetic images know {', '.join(LABELS)})")
    return labels, p / p.sum(), looks


def _solder_defects(model: CoEModel, components: set[str]) -> dict[tuple[str, str], tuple[str, ...]]:
    """(component, pass label) -> soldering defects its next detector knows and the part can show."""
    from .solder import applicable

    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for comp in components:
        cls = model.experts[model.components[comp].classifier]
        for label in cls.pass_labels:
            nxt = cls.next.get(label)
            if nxt is not None:
                known = model.experts[nxt].classes
                out[(comp, label)] = tuple(d for d in applicable(comp) if d in known)
    return out


def _draw_solder(component: str, defect: str, rng: np.random.Generator, size: int) -> np.ndarray:
    from .solder import draw_solder_defect

    return draw_solder_defect(component, defect, rng, size)[0]


def encode_image(img: np.ndarray, encoding: str) -> bytes:
    """Encode an RGB uint8 image as a wire payload (png/jpeg via BGR, raw as plain bytes)."""
    if encoding == "raw":
        return np.ascontiguousarray(img, dtype=np.uint8).tobytes()
    bgr = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    if encoding == "png":
        ok, buf = cv2.imencode(".png", bgr)
    elif encoding == "jpeg":
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
    else:
        raise ValueError(f"encoding must be one of {', '.join(_EXTENSIONS)}, got {encoding!r}")
    if not ok:
        raise CoEError(f"cv2 could not encode a {img.shape} image as {encoding}")
    return buf.tobytes()


def record_synthetic(model: CoEModel, out: str | Path, frames: int, *, line: str, seed: int = 0,
                     size: int = 64, encoding: str = "png", omit_component: bool = False,
                     boards_components: int = 40, overwrite: bool = False, solder_rate: float = 0.0,
                     progress: Callable[[int], None] | None = None) -> Path:
    """Write a recording of exactly `frames` frames, board after board in layout order.

    Every board of the recording shares one seeded layout.  Each frame's pixels
    and truth label come from a generator seeded by (seed, frame index), so the
    same seed gives byte-identical output and a longer recording starts with
    the frames of a shorter one.  With `solder_rate` > 0, that share of the
    frames whose part is ok shows a soldering defect instead (`storage.solder`),
    drawn from the classes of the detector the classifier hands ok parts to;
    the truth is then the defect's name.  At 0 no extra random number is drawn,
    so older recordings stay byte-identical.
    """
    if not isinstance(solder_rate, (int, float)) or isinstance(solder_rate, bool) or not 0 <= solder_rate <= 1:
        raise ValueError(f"solder_rate must be a number in 0..1, got {solder_rate!r}")
    if not isinstance(frames, int) or isinstance(frames, bool) or frames < 0:
        raise ValueError(f"frames must be a non-negative integer, got {frames!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(line, str) or not line:
        raise ValueError(f"line must be a non-empty string, got {line!r}")
    if encoding not in _EXTENSIONS:
        raise ValueError(f"encoding must be one of {', '.join(_EXTENSIONS)}, got {encoding!r}")
    layout = board_layout(model, boards_components, np.random.default_rng([seed, 0]))
    draws = {c: _draw_label(model, c) for c in set(layout)}
    solder = _solder_defects(model, set(layout)) if solder_rate > 0 else {}
    width = max(3, len(str(len(layout))))
    out = Path(out)
    with RecordingWriter(out, overwrite=overwrite) as writer:
        for i in range(frames):
            board, pos = divmod(i, len(layout))
            comp = layout[pos]
            rng = np.random.default_rng([seed, 1, i])
            labels, p, looks = draws[comp]
            truth = labels[int(rng.choice(len(labels), p=p))]
            defects = solder.get((comp, truth), ())
            if defects and rng.random() < solder_rate:
                truth = defects[int(rng.integers(len(defects)))]
                img = _draw_solder(comp, truth, rng, size)
            else:
                img = draw_component(comp, looks[truth], rng, size)
            board_id = f"B{board + 1:06d}"
            header: dict = {"v": 1, "frame_id": f"{line}-{board_id}-{pos + 1:0{width}d}", "line": line,
                            "board_id": board_id}
            if not omit_component:
                header["component"] = comp
            header["ts"] = round(EPOCH + i * FRAME_INTERVAL_S, 6)
            header["encoding"] = encoding
            if encoding == "raw":
                header["shape"] = list(img.shape)
                header["dtype"] = "uint8"
            writer.add(header, encode_image(img, encoding), _EXTENSIONS[encoding], truth=truth,
                       truth_component=comp if omit_component else None)
            if progress is not None and ((i + 1) % 100 == 0 or i + 1 == frames):
                progress(i + 1)
    return out
