"""Soldering defects drawn on an ok part, each with its box: what the demo's detectors learn.

A classifier tells whether the right part sits on its pads; a detector then
looks at the joints.  `draw_solder_defect` draws an ok part (`synthetic.render`)
with one defect the way an AOI camera sees it from above, and returns the
defect's box in the image's pixels, so the same code is a labelled detection
set (`edge_agent.zoo_train`) and the truth of a recording
(`synthetic.record_synthetic(solder_rate=...)`):

- solder_bridge: a bar of solder joining neighbouring pads (three leads on a
  fine pitch; for a two-terminal chip, along one side of its body);
- tombstone: a two-terminal part standing on one end: one pad bare and wetted,
  the body's end cap seen from above on the other, with its shadow;
- insufficient_solder: one pad dull, unwetted copper with dark voids;
- lifted_lead: one lead bent up off its pad: bright, shifted outwards over
  its shadow, the pad's solder left as a bare shiny blob;
- polarity_mark: the part placed reversed: its polarity mark (pin-1 dot,
  cathode band) at the wrong end.

A defect applies only where the part has what it needs (a tombstone needs two
terminals, a lifted lead needs leads, which a QFN has not); `applicable` says which.  Boxes cover
the defect and the pad(s) it sits on, at least `MIN_BOX` crop units a side, so
a 64-pixel crop still gives the detector something to find.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from .synthetic import (CATHODE_BAND, LEAD, LED_MARK, SOLDER, TIN, Footprint, Scene, Shape, family_of,
                        footprint, no_leads, render)

SOLDER_DEFECTS = ("solder_bridge", "tombstone", "insufficient_solder", "lifted_lead", "polarity_mark")
MIN_BOX = 0.2            # crop units: 12.8 pixels of a 64-pixel crop, so stride-8 anchors always fall inside
_SHINE = (240, 240, 236)
_DULL = (104, 70, 42)     # oxidised, unwetted copper
_VOID = (34, 26, 20)
_SHADOW = (14, 44, 24)    # a lead's shadow on the green board
_LIFTED = (238, 238, 234)  # a lifted lead catches the light

Box = tuple[float, float, float, float]


def _bbox(shapes: tuple[Shape, ...]) -> Box:
    return (min(s.cx - s.w / 2 for s in shapes), min(s.cy - s.h / 2 for s in shapes),
            max(s.cx + s.w / 2 for s in shapes), max(s.cy + s.h / 2 for s in shapes))


def _at_least(box: Box, side: float = MIN_BOX) -> Box:
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    hw, hh = max(x1 - x0, side) / 2, max(y1 - y0, side) / 2
    return (cx - hw, cy - hh, cx + hw, cy + hh)


def _leads(fp: Footprint) -> list[int]:
    """Indices of the body shapes that are leads sitting on a pad."""
    out = []
    for i, s in enumerate(fp.body):
        if s.color == LEAD and any(abs(s.cx - p.cx) < p.w / 2 and abs(s.cy - p.cy) < p.h / 2 for p in fp.pads):
            out.append(i)
    return out


def _polarity_mark(fp: Footprint) -> int | None:
    """Index of the body shape that marks polarity (pin-1 dot, cathode band), if the family has one."""
    fam = fp.family
    for i, s in enumerate(fp.body):
        if fam == "U" and s.kind == "circle":
            return i
        if fam == "D" and s.kind == "rect" and s.color == CATHODE_BAND:
            return i
        if fam == "LED" and s.color == LED_MARK:
            return i
    return None


def applicable(component: str) -> tuple[str, ...]:
    """The soldering defects that can be drawn on `component`."""
    fp = footprint(component)
    out = ["solder_bridge", "insufficient_solder"]
    if len(fp.pads) == 2 and family_of(component) not in ("X",):
        out.append("tombstone")
    if _leads(fp) and not no_leads(component):   # a QFN's terminals sit under its edge: nothing to lift
        out.append("lifted_lead")
    if _polarity_mark(fp) is not None:
        out.append("polarity_mark")
    return tuple(d for d in SOLDER_DEFECTS if d in out)


# -- one scene per defect: (pads, body, overlay) and the box in crop units ---------------

def _bridge(fp: Footprint, rng: np.random.Generator) -> tuple[Scene, Box]:
    pairs = list(itertools.combinations(range(len(fp.pads)), 2))
    dist = np.array([np.hypot(fp.pads[a].cx - fp.pads[b].cx, fp.pads[a].cy - fp.pads[b].cy) for a, b in pairs])
    # on a fine pitch (8 pads or more) the bridge runs over three leads: one gap is a pixel at 64 px
    span = 2.0 if len(fp.pads) >= 8 else 1.0
    near = [p for p, d in zip(pairs, dist) if abs(d - span * dist.min()) <= 0.01 * dist.min()]
    if not near:    # a quad of two pads a side (QFP8) has no three in a row: the bar joins two neighbours
        span = 1.0
        near = [p for p, d in zip(pairs, dist) if abs(d - dist.min()) <= 0.01 * dist.min()]
    a, b = (fp.pads[i] for i in near[int(rng.integers(len(near)))])
    horizontal = abs(a.cx - b.cx) >= abs(a.cy - b.cy)
    if horizontal:
        thick = (0.45 if span == 1 else 0.6) * min(a.h, b.h)
        y = (a.cy + b.cy) / 2
        if len(fp.pads) == 2:   # a chip: the bar runs along one side of the body, from pad to pad
            y += (1 if rng.random() < 0.5 else -1) * (min(a.h, b.h) / 2 - thick / 2)
        length = abs(a.cx - b.cx) + (a.w if span > 1 else 0.0)
        bar = Shape("rect", (a.cx + b.cx) / 2, y, length, thick, SOLDER)
        shine = Shape("rect", bar.cx, y - thick / 4, length * 0.6, thick / 4, _SHINE)
    else:
        thick = (0.45 if span == 1 else 0.6) * min(a.w, b.w)
        x = (a.cx + b.cx) / 2
        if len(fp.pads) == 2:
            x += (1 if rng.random() < 0.5 else -1) * (min(a.w, b.w) / 2 - thick / 2)
        length = abs(a.cy - b.cy) + (a.h if span > 1 else 0.0)
        bar = Shape("rect", x, (a.cy + b.cy) / 2, thick, length, SOLDER)
        shine = Shape("rect", x - thick / 4, bar.cy, thick / 4, length * 0.6, _SHINE)
    return Scene(fp.pads, fp.body, (bar, shine)), _at_least(_bbox((bar,)))


def _tombstone(fp: Footprint, rng: np.random.Generator) -> tuple[Scene, Box]:
    up, down = (0, 1) if rng.random() < 0.5 else (1, 0)
    stand, bare = fp.pads[up], fp.pads[down]
    body = _bbox(fp.body)
    depth = 0.35 * (body[3] - body[1])          # the body's thickness, seen from above when it stands
    side = -1.0 if stand.cx < bare.cx else 1.0
    face = Shape("rect", stand.cx, stand.cy, depth, body[3] - body[1], TIN)
    shadow = Shape("rect", stand.cx - side * depth, stand.cy + 0.01, depth, body[3] - body[1], (16, 40, 24))
    wet = Shape("rect", bare.cx, bare.cy, bare.w * 0.8, bare.h * 0.8, SOLDER)
    shine = Shape("circle", bare.cx, bare.cy, min(bare.w, bare.h) * 0.35, 0, _SHINE)
    return Scene(fp.pads, (), (wet, shine, shadow, face)), _at_least(_bbox(fp.pads + fp.body))


def _insufficient(fp: Footprint, rng: np.random.Generator) -> tuple[Scene, Box]:
    i = int(rng.integers(len(fp.pads)))
    pad = fp.pads[i]
    pads = fp.pads[:i] + (replace(pad, color=_DULL),) + fp.pads[i + 1:]
    # dark voids along the pad's outer edge, where no body covers it (outer: away from the part's centre)
    along_x = abs(pad.cx) >= abs(pad.cy)
    sign = 1.0 if (pad.cx if along_x else pad.cy) >= 0 else -1.0
    r = 0.3 * min(pad.w, pad.h)
    voids = []
    for k in (-1, 0, 1):
        if along_x:
            voids.append(Shape("circle", pad.cx + sign * pad.w * 0.3, pad.cy + k * pad.h * 0.28, r, r, _VOID))
        else:
            voids.append(Shape("circle", pad.cx + k * pad.w * 0.28, pad.cy + sign * pad.h * 0.3, r, r, _VOID))
    return Scene(pads, fp.body, tuple(voids)), _at_least(_bbox((pad,)))


def _lifted(fp: Footprint, rng: np.random.Generator) -> tuple[Scene, Box]:
    leads = _leads(fp)
    i = leads[int(rng.integers(len(leads)))]
    lead = fp.body[i]
    pad = next(p for p in fp.pads if abs(lead.cx - p.cx) < p.w / 2 and abs(lead.cy - p.cy) < p.h / 2)
    # outwards: away from the body's centre along the lead's long axis
    if lead.h >= lead.w:
        dx, dy = 0.0, (1.0 if lead.cy > 0 else -1.0) * 0.7 * lead.h
    else:
        dx, dy = (1.0 if lead.cx > 0 else -1.0) * 0.7 * lead.w, 0.0
    # the pad keeps its solder, now a bare shiny blob; the lead floats outwards over its own dark shadow
    wet = Shape("rect", pad.cx, pad.cy, pad.w * 0.8, pad.h * 0.8, SOLDER)
    shine = Shape("circle", pad.cx, pad.cy, min(pad.w, pad.h) * 0.3, 0, _SHINE)
    # the shadow is wider than the lead, so a fine-pitch lead still leaves a visible dark gap
    shadow = Shape("rect", lead.cx + dx * 0.6, lead.cy + dy * 0.6, lead.w * 1.6, lead.h * 1.3, _SHADOW)
    up = Shape("rect", lead.cx + dx, lead.cy + dy, lead.w * 0.8, lead.h * 0.8, _LIFTED)
    body = fp.body[:i] + fp.body[i + 1:]
    return Scene(fp.pads, body, (wet, shine, shadow, up)), _at_least(_bbox((pad, shadow, up)))


def _reversed(fp: Footprint, rng: np.random.Generator) -> tuple[Scene, Box]:
    i = _polarity_mark(fp)
    assert i is not None
    mark = fp.body[i]
    moved = replace(mark, cx=-mark.cx, cy=-mark.cy if fp.family == "U" else mark.cy)
    body = fp.body[:i] + fp.body[i + 1:] + (moved,)
    return Scene(fp.pads, body), _at_least(_bbox((moved,)))


_SCENES = {"solder_bridge": _bridge, "tombstone": _tombstone, "insufficient_solder": _insufficient,
           "lifted_lead": _lifted, "polarity_mark": _reversed}


def draw_solder_defect(component: str, defect: str, rng: np.random.Generator, size: int = 64
                       ) -> tuple[np.ndarray, Box]:
    """An RGB crop of an ok `component` with `defect`, and the defect's box (x1, y1, x2, y2) in pixels."""
    if defect not in SOLDER_DEFECTS:
        raise ValueError(f"defect must be one of {', '.join(SOLDER_DEFECTS)}, got {defect!r}")
    can = applicable(component)
    if defect not in can:
        raise ValueError(f"cannot draw {defect} on {component} (it can show: {', '.join(can)})")
    got: dict[str, Box] = {}

    def scene(fp: Footprint) -> Scene:
        sc, got["box"] = _SCENES[defect](fp, rng)
        return sc

    img, where = render(component, "ok", rng, size, scene=scene)
    return img, where.box(*got["box"], size)
