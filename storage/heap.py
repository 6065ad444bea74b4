"""Hand the C heap's free pages back to the OS.

glibc keeps memory that `free()` returned when it came from the heap rather
than its own mapping (a large free region left by earlier allocations can
serve a big request), so a process's RSS stays up after a model's loader has
freed its scratch, or after a test evicted an expert.  `malloc_trim(0)`
releases every whole free page.  A no-op on another libc.
"""
from __future__ import annotations

import ctypes


def trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
