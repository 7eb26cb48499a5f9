"""The worker's C heap (glibc's malloc, under the CPU allocator's tensors): which blocks it maps
on their own, and when its freed pages go back to the OS.

`keep_freed_pages` (once, at the worker's start, with how much free heap to keep: the worker's
setting, `KEEP_FREE_BYTES` by default): every block comes from the heap, none is mapped on its
own, and up to that much (at most `TOP_KEEP_BYTES`) freed at the heap's top stays there for the
next allocation (glibc trims the top past that by itself). glibc's defaults map each block over 128 KiB on its own and unmap it when it is
freed (raising that limit only to the largest block freed so far, and never past 32 MiB), so
each of a pass's large tensors (a microbatch's logits and their gradients are 100 MB each on
SmolLM2), a KV cache growing by a column each decoding step and each new batch's adapter
stacks were fresh pages, each faulted in by the kernel: a few microseconds a page on a virtual
machine, a third of a `forward_backward`'s time (docs/benchmarks.md, "The worker's heap").

`release_excess` (after large passes and page-outs) hands the free pages back once the heap
holds more than the kept amount of them: the next pass of the same size reuses what the last
one freed, and the heap cannot keep more than that much beyond what is in use, so a limit on
memory still shows in the worker's RSS. Both are no-ops where the C library is not glibc.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

__all__ = ["KEEP_FREE_BYTES", "TOP_KEEP_BYTES", "free_bytes", "keep_freed_pages", "release_excess"]

# Free heap kept for the next passes: a SmolLM2 `forward_backward` of 8 x 256 tokens leaves
# about 2.5 GB free (its microbatches' activations, logits and gradients).
KEEP_FREE_BYTES = 4 * 2**30
TOP_KEEP_BYTES = 2**31 - 1  # the most mallopt takes (a C int)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("malloc_trim", "mallopt", "mallinfo2")):
        return None  # not glibc, or one older than 2.33
    libc.mallinfo2.restype = _MallInfo2
    return libc


_LIBC = _libc()


_kept = KEEP_FREE_BYTES  # what release_excess keeps by default: keep_freed_pages's `keep`


def keep_freed_pages(environ: Mapping[str, str] = os.environ, keep: int = KEEP_FREE_BYTES) -> bool:
    """Serve every block from the heap and keep up to `keep` bytes of freed pages there (see
    above), unless `environ` sets glibc's malloc tunables (`GLIBC_TUNABLES`, `MALLOC_*_`), which
    win; True if set."""
    global _kept
    _kept = keep
    if _LIBC is None or any(k == "GLIBC_TUNABLES" or k.startswith("MALLOC_") for k in environ):
        return False
    top = min(keep, TOP_KEEP_BYTES)
    return bool(_LIBC.mallopt(_M_MMAP_MAX, 0) and _LIBC.mallopt(_M_TRIM_THRESHOLD, top))


def free_bytes() -> int:
    """Bytes the heap holds free (in every arena), mapped and counted in the process's RSS
    wherever they were touched; 0 where the C library is not glibc."""
    return 0 if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


def release_excess(keep: int | None = None) -> bool:
    """Hand every free page back to the OS if the heap holds more than `keep` bytes free (None:
    what `keep_freed_pages` was given); True if it did. The CPU allocator returns a freed tensor to glibc's heap, which keeps its
    pages mapped for reuse; past `keep` they would only hold memory the worker may need for
    sessions, so `malloc_trim` releases them."""
    if _LIBC is None or free_bytes() <= (_kept if keep is None else keep):
        return False
    _LIBC.malloc_trim(0)
    return True
