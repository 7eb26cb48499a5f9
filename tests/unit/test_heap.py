"""The worker's heap keeps freed pages for the next allocation (`heap.keep_freed_pages`): a
block that grows a little at every step, as a KV cache does while decoding, is served from
pages already mapped instead of a fresh mapping faulted in page by page; glibc's malloc
tunables in the environment win."""

from __future__ import annotations

import subprocess
import sys

from treadle.gpu_worker import heap

GROWING_BLOCKS = """
import resource, sys
import torch
from treadle.gpu_worker import heap
if sys.argv[1] == "tuned":
    assert heap.keep_freed_pages({})
block = None
for step in range(200):  # 1 MiB growing by 4 KiB a step, each step's block written once
    block = torch.empty(2**18 + 1024 * step, dtype=torch.float32).fill_(1.0)
    if step == 9:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", GROWING_BLOCKS, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def test_a_growing_block_reuses_the_pages_freed_before_it() -> None:
    default, tuned = _faults("default"), _faults("tuned")
    print(f"minor page faults over 190 steps: {default} default, {tuned} kept")
    assert default > 190 * 256  # every step's 1 MiB+ block faulted in afresh
    assert tuned < default / 10


def test_glibc_tunables_in_the_environment_win() -> None:
    assert not heap.keep_freed_pages({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert not heap.keep_freed_pages({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
