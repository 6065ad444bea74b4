"""Error types shared by every package.

Each error carries where it came from (a file, a key, a frame) so that a line
engineer reading a log line knows what to fix without opening the code.
"""
from __future__ import annotations

import reprlib
from typing import Any

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxlong = 2, 6, 4, 60, 40


def shown(value: Any) -> str:
    """`value` for an error message, cut short: a list built of YAML aliases can be gigabytes written out, and a
    400-digit number says nothing more than its first digits."""
    return _SHORT.repr(value)


class CoEError(Exception):
    """Base of all coe-edge errors."""


class SpecError(CoEError):
    """A CoE model spec or line config is invalid: names the file, the key and the reason."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        self.source, self.key, self.reason = source, key, reason
        super().__init__(f"{source}: key '{key}': {reason}")


class ExpertLoadError(CoEError):
    """An expert's weights could not be loaded (missing, corrupt, wrong shape)."""

    def __init__(self, expert_id: str, path: str, reason: str) -> None:
        self.expert_id, self.path, self.reason = expert_id, path, reason
        super().__init__(f"expert '{expert_id}' ({path}): {reason}")
