"""The worker's C heap (glibc's malloc, under the CPU allocator's tensors): when its freed pages
go back to the OS.

`keep_freed_pages` (once, at the worker's start): blocks up to `MMAP_THRESHOLD` come from the
heap and freed memory stays there for the next allocation, up to `TRIM_THRESHOLD` of it at the
heap's top. glibc's defaults give each block over 128 KiB a mapping of its own, unmapped when
it is freed, and raise that limit only to the largest block freed so far; a KV cache that grows
by a column each decoding step always outgrows it, so each step's blocks (and each new batch's
adapter stacks) were fresh pages, each faulted in by the kernel (a few microseconds a page on
a virtual machine; docs/benchmarks.md, "The worker's heap"). `return_free_memory` (after large
passes and page-outs) hands back every free page, so a limit on memory still shows in the
worker's RSS. Both are no-ops where the C library is not glibc.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_pages", "return_free_memory"]

MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: blocks above it are still mapped on their own
TRIM_THRESHOLD = 512 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    glibc = hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt")
    return libc if glibc else None


_LIBC = _libc()


def keep_freed_pages(environ: Mapping[str, str] = os.environ) -> bool:
    """Set the heap's thresholds (see above) unless `environ` sets glibc's malloc tunables
    (`GLIBC_TUNABLES`, `MALLOC_*_`), which win; True if they were set."""
    if _LIBC is None or any(k == "GLIBC_TUNABLES" or k.startswith("MALLOC_") for k in environ):
        return False
    return bool(
        _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        and _LIBC.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def return_free_memory() -> None:
    """Hand the pages just freed back to the OS. The CPU allocator returns a freed tensor to
    glibc's heap, which keeps its pages mapped (and counted in the process's RSS) for reuse;
    `malloc_trim` releases free pages, so the limit shows in the worker's memory, not only in its
    heap's free lists."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
