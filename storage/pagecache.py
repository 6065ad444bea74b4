"""The OS page cache in front of the expert store, made controllable and observable.

A cold expert load costs an SSD read; a warm one a memory copy.  These three
calls let an operator warm the store before a shift (`coe-agent experts warm`),
drop it to measure a cold start (`experts evict`), and see which is the case
(`resident_fraction`), so cold-load benchmarks measure what they claim to.

They are advice to the kernel, not guarantees: pages that another process has
mapped, or that are dirty, stay resident; tmpfs pages are the file itself and
never leave.  Where the platform lacks the call, the functions say so by their
return value (False / None) instead of pretending.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import sys

from coe.files import open_regular

WARM_CHUNK = 8 << 20  # sequential reads of 8 MiB: large enough for readahead, small enough to reuse one buffer

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


def drop_from_page_cache(path: str | os.PathLike[str]) -> bool:
    """Ask the kernel to drop `path`'s cached pages; False where posix_fadvise does not exist, or `path` is not
    a regular file (a FIFO, a device, a folder: no pages of its own to drop).

    The file is fsynced first because dirty pages cannot be dropped; a file system that cannot fsync
    (EINVAL, EROFS: read-only, /proc) has none to write back.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = open_regular(path)
    if fd is None:
        return False
    try:
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EROFS):
                raise
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def warm_page_cache(path: str | os.PathLike[str], buffer: bytearray | None = None) -> int:
    """Read `path` once, sequentially, so its pages are cached; return the bytes read.

    Also advises WILLNEED where the platform can, so readahead starts before the
    first read returns.  `buffer` lets a caller warming many files reuse one.
    Anything but a regular file reads 0 bytes: a FIFO would block the read for
    ever, a device never end, and neither has pages to warm.
    """
    fd = open_regular(path)
    if fd is None:
        return 0
    buf = buffer if buffer is not None else bytearray(WARM_CHUNK)
    view = memoryview(buf)
    total = 0
    with open(fd, "rb", buffering=0) as fh:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        while n := fh.readinto(view):
            total += n
    return total


def resident_fraction(path: str | os.PathLike[str]) -> float | None:
    """Fraction of `path`'s pages in the page cache (0..1); None where it cannot be measured.

    Uses mmap + mincore(2) through ctypes on Linux.  Mapping does not fault pages
    in, so measuring does not change the answer.  Since Linux 5.2 mincore reports
    page-cache state only for files the caller owns or may write; the store's
    own user always can.
    """
    libc = _libc()
    if libc is None:
        return None
    fd = open_regular(path)
    if fd is None:              # a FIFO or device has no pages of its own: not measurable, not "all cached"
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 1.0
        page = os.sysconf("SC_PAGE_SIZE")
        pages = (size + page - 1) // page
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            resident = sum(b & 1 for b in vec)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return resident / pages


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc with mmap/mincore/munmap typed, loaded on first use (never at import); None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    except (OSError, AttributeError):
        return None
    return libc
