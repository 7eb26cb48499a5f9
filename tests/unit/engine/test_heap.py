"""The worker's heap keeps freed pages for the next allocation (`heap.keep_freed_pages`): a
block that grows a little at every step, as a KV cache does while decoding, and a block larger
than any glibc would take from its heap by default, as a microbatch's logits are, are served
from pages already mapped instead of fresh mappings faulted in page by page; what the heap keeps
free is handed back past a limit (`heap.release_excess`); glibc's malloc tunables in the
environment win."""

from __future__ import annotations

import subprocess
import sys

from treadle.engine.memory import heap

GROWING_BLOCKS = """
import resource, sys
import torch
from treadle.engine.memory import heap
if sys.argv[1] == "tuned":
    assert heap.keep_freed_pages({})
block = None
for step in range(200):  # 1 MiB growing by 4 KiB a step, each step's block written once
    block = torch.empty(2**18 + 1024 * step, dtype=torch.float32).fill_(1.0)
    if step == 9:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

LARGE_BLOCKS = """
import resource, sys
import torch
from treadle.engine.memory import heap
if sys.argv[1] == "tuned":
    assert heap.keep_freed_pages({})
for step in range(40):  # 64 MiB, over glibc's largest threshold for mapping a block alone
    block = torch.empty(2**24, dtype=torch.float32).fill_(1.0)
    small = torch.ones(100)  # what the program allocates meanwhile
    del block
    if step == 19:  # the heap has settled
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

RELEASED = """
import torch
from treadle.engine.memory import heap
def rss():
    status = open("/proc/self/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024
assert heap.keep_freed_pages({})
block = torch.empty(2**24, dtype=torch.float32).fill_(1.0)  # 64 MiB
del block
free, before = heap.free_bytes(), rss()
kept = not heap.release_excess(keep=2**27)  # 128 MiB may stay free: nothing to do
still = rss()
released = heap.release_excess(keep=2**20)
print(free, before - still, kept, before - rss(), released)
"""


def _run(script: str, *args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_a_growing_block_reuses_the_pages_freed_before_it() -> None:
    default, tuned = (
        int(_run(GROWING_BLOCKS, "default")[-1]),
        int(_run(GROWING_BLOCKS, "tuned")[-1]),
    )
    print(f"minor page faults over 190 steps: {default} default, {tuned} kept")
    assert default > 190 * 256  # every step's 1 MiB+ block faulted in afresh
    assert tuned < default / 10


def test_a_large_block_reuses_the_pages_freed_before_it() -> None:
    default, tuned = int(_run(LARGE_BLOCKS, "default")[-1]), int(_run(LARGE_BLOCKS, "tuned")[-1])
    print(f"minor page faults over 20 blocks of 64 MiB: {default} default, {tuned} kept")
    assert default > 20 * 16384  # each block mapped alone and faulted in afresh
    assert tuned < default / 2


def test_free_pages_go_back_only_past_the_limit() -> None:
    free, kept_drop, kept, released_drop, released = _run(RELEASED)
    assert int(free) >= 2**26  # the 64 MiB block stayed in the heap, free
    assert kept == "True" and int(kept_drop) < 2**20  # under the limit: its pages stay
    # Past it: handed back, all but the page or two that hold the free block's boundary tags
    # (trimming frees whole pages only) and what the interpreter faults in meanwhile.
    assert released == "True" and int(released_drop) >= 2**26 - 2**20


def test_glibc_tunables_in_the_environment_win() -> None:
    assert not heap.keep_freed_pages({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert not heap.keep_freed_pages({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})


KEPT_AS_SET = """
import os, sys
from treadle.engine.memory import heap
# read without allocating from the C heap: a buffer left above the block would keep glibc
# from trimming the heap's top when the block is freed
status, buf = os.open("/proc/self/status", os.O_RDONLY), bytearray(8192)
def rss():
    n = os.preadv(status, [buf], 0)
    at = buf.find(b"VmRSS:", 0, n)
    return int(bytes(buf[at + 6 : buf.find(b"kB", at, n)])) * 1024
assert heap.keep_freed_pages({}, keep=int(sys.argv[1]))
# 64 MiB at the heap's top, and nothing of the C heap above it: a tensor's would not do, as
# torch allocates its bookkeeping after its data, and those small blocks, freed into glibc's
# per-thread cache, stay above it
block = bytearray(2**26)
before = rss()
del block  # glibc trims the top past the kept amount by itself
print(before - rss(), heap.free_bytes(), heap.release_excess())
"""


def test_the_worker_keeps_the_free_heap_it_is_set_to() -> None:
    """TREADLE_WORKER_FREE_HEAP reaches keep_freed_pages: under it a freed 64 MiB block stays
    (and release_excess, by default, leaves it); over it the heap hands it back at once."""
    dropped, free, released = _run(KEPT_AS_SET, str(2**28))  # 256 MiB kept
    assert int(dropped) < 2**20 and int(free) >= 2**26 and released == "False"
    dropped, free, released = _run(KEPT_AS_SET, str(2**20))  # 1 MiB kept
    assert int(dropped) >= 2**26 - 2**20 and int(free) < 2**21 and released == "False"
