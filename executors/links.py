"""Network links from the front box to the other boxes of a line (issue 15, DESIGN.md §11).

A remote executor's requests cross a link before they compute: the frame goes
to the executor's node and the output comes back.  The scheduler must see
that, or it would rank a remote executor as if the frame were already there.
`Link` is the cost of one link (bytes per second plus a one-way latency);
`Links` is the set measured against each node (`coe-agent profile` and
`coe-agent cluster profile` write `{data_dir}/links.json`) or stated for a simulation (`bench --sim
--boxes`).  The front box itself has no link: its executors read frames from
the ingest's memory.

No ray, no torch: the cost model and the simulator read this.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from coe import CoEError
from coe.errors import shown
from coe.files import write_json_atomic

# a component crop as the AOI sends it raw: 224 x 224 x 3 bytes (a JPEG is 10-20x smaller: this is the worst case)
DEFAULT_FRAME_BYTES = 224 * 224 * 3


@dataclass(frozen=True)
class Link:
    """One link's cost: `bandwidth_bps` bytes/s once data flows, plus `latency_s` per message.

    `latency_s` is what one batch call adds besides its frames' transfer: a
    measured link's is a real call's round trip through Ray (a call that
    waits for work on the node, not an empty echo); a stated one's is the
    network's one-way latency.  A batch of n frames sent in one message costs
    latency + n x frame / bandwidth;
    the bandwidth part holds the link (the next batch to the same node waits for
    it), the latency does not.
    """

    bandwidth_bps: float
    latency_s: float
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise ValueError(f"link bandwidth must be a positive number of bytes/s, got {self.bandwidth_bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be >= 0 seconds, got {self.latency_s}")

    def per_request(self, frame_bytes: int) -> float:
        """Seconds of link time one frame takes (the bandwidth part)."""
        return frame_bytes / self.bandwidth_bps

    def batch_seconds(self, n: int, frame_bytes: int) -> float:
        """Seconds until n frames sent as one message have arrived (an idle link)."""
        return self.latency_s + n * self.per_request(frame_bytes)

    @staticmethod
    def ethernet(gbps: float, latency_ms: float, source: str = "") -> "Link":
        """A stated link: `gbps` gigabits/s, `latency_ms` one way."""
        return Link(gbps * 1e9 / 8, latency_ms / 1e3, source or f"stated: {gbps:g} Gb/s, {latency_ms:g} ms one way")


@dataclass
class Links:
    """Per node: the link to it and the frame size it was priced at; what the cost model reads."""

    links: dict[str, Link] = field(default_factory=dict)
    frame_bytes: int = DEFAULT_FRAME_BYTES
    source: str = ""

    def get(self, node: str | None) -> Link | None:
        return None if node is None else self.links.get(node)

    def to_json(self) -> dict:
        return {"source": self.source, "frame_bytes": self.frame_bytes,
                "links": {n: asdict(l) for n, l in self.links.items()}}

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_json(), sort_keys=False)

    @classmethod
    def load(cls, path: str | Path) -> "Links":
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(raw, dict) or not isinstance(raw.get("links", {}), dict):
                raise ValueError("expected an object with a 'links' object of node -> link")
            links = {}
            for n, v in raw.get("links", {}).items():
                try:
                    links[str(n)] = Link(_number(v, "bandwidth_bps"), _number(v, "latency_s"),
                                         str(v.get("source", "")))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"links.{n}: {exc}") from None
            frame_bytes = raw.get("frame_bytes", DEFAULT_FRAME_BYTES)
            # the cost model divides it by a bandwidth: an integer no float can hold would raise there instead
            if (not isinstance(frame_bytes, int) or isinstance(frame_bytes, bool) or frame_bytes < 1
                    or frame_bytes > _MAX_FRAME_BYTES):
                raise ValueError(f"frame_bytes: must be a positive integer up to 2**53, got {shown(frame_bytes)}")
            return cls(links, frame_bytes, str(raw.get("source", "")))
        except FileNotFoundError:
            raise CoEError(f"{path}: no link profile (run `coe-agent profile` or `coe-agent cluster profile`)") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:     # UnicodeDecodeError is a ValueError
            raise CoEError(f"{path}: malformed link profile: {exc}") from None
        except OSError as exc:          # a folder, a file this user cannot read
            raise CoEError(f"{path}: cannot read the link profile: {exc.strerror or exc}") from None


_MAX_FRAME_BYTES = 2 ** 53       # exact as a float, and far beyond any frame


def _number(v: dict, key: str) -> float:
    """`v[key]` as a float: a JSON number or a numeric string, not a boolean (`true` is no bandwidth) nor an
    integer too large for a float (which float() answers with OverflowError, not ValueError)."""
    x = v[key]
    if isinstance(x, bool):
        raise ValueError(f"{key}: must be a number, got {x!r}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{key}: {shown(x)} is too large") from None
