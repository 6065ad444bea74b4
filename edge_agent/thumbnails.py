"""Small JPEG thumbnails of defect frames, for the status page and `/api/frames/<id>`.

Only defects get one, and only while retention keeps them (the result writer
stores them with the verdict and prunes them with the other rows), so the
database never becomes an image archive of the product.  At most
`MAX_SIDE` pixels a side, a few kilobytes each, encoded on the executor thread
that decided the verdict: a defect is rare, and the resize and encode take
well under a millisecond for a component crop, though tens of milliseconds
for a whole 4096 x 4096 frame (measured with random pixels: 0.02 ms at 64 x 64,
0.5 ms at 224 x 224, 40-60 ms at 4096 x 4096).
"""
from __future__ import annotations

import numpy as np

MAX_SIDE = 96
MIME = "image/jpeg"


def make_thumbnail(image: np.ndarray | None, *, max_side: int = MAX_SIDE, quality: int = 85) -> bytes | None:
    """An RGB HxWx3 uint8 frame -> JPEG bytes at most `max_side` px a side (never enlarged); None without an image,
    or for any other shape or dtype (a float or bool frame would make OpenCV raise on the executor thread, or
    encode a black picture)."""
    import cv2

    if image is None or image.ndim != 3 or image.shape[2] != 3 or image.size == 0 or image.dtype != np.uint8:
        return None
    h, w = image.shape[:2]
    scale = min(1.0, max_side / max(h, w))
    if scale < 1.0:
        image = cv2.resize(image, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_AREA)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    return buf.tobytes() if ok else None
