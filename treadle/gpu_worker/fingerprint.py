"""Fingerprints of tensors, computed on the device where they live.

A tensor's fingerprint is the sum, modulo 2**64, of its elements' bit patterns (read as
integers) times fixed pseudo-random 64-bit weights; a list of named tensors hashes every name,
dtype, shape and fingerprint with sha256. Integer sums do not depend on the order of addition, so
the result is the same on every device and thread count, and it costs one pass over the tensors
where they are (no copy to the host, which a byte hash of the adapter after every operation would
need). Two tensors that differ in any bit collide with probability at most 2**-32 (the weights
are uniform; a difference is a nonzero integer below 2**32 in each element): enough to catch a
replay that went astray, not meant to resist an adversary.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import torch

__all__ = ["of", "tensor_fingerprint"]

VERSION = "fp1"
_BLOCK = 1 << 16
_CPU_CHUNK = 1 << 18
_SEED = 0x7EAD1E
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}
_lock = threading.Lock()


def _weights_for(numel: int, device: torch.device) -> torch.Tensor:
    """The first `numel` weights on `device`. Block b always comes from seed _SEED + b, so a
    weight depends only on its index, never on how many were asked for before."""
    with _lock:
        have = _weights.get(device)
        if have is None or have.numel() < numel:
            start = 0 if have is None else have.numel() // _BLOCK
            blocks = [] if have is None else [have]
            for b in range(start, -(-numel // _BLOCK)):
                g = torch.Generator().manual_seed(_SEED + b)
                block = torch.randint(
                    -(2**63), 2**63 - 1, (_BLOCK,), generator=g, dtype=torch.int64
                )
                blocks.append(block.to(device))
            have = torch.cat(blocks)
            _weights[device] = have
        return have[:numel]


def tensor_fingerprint(tensor: torch.Tensor) -> int:
    """The 64-bit fingerprint of one tensor's bits (as a signed int)."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_VIEW[flat.element_size()])
    weights = _weights_for(flat.numel(), flat.device)
    # Chunks that stay in the CPU's cache are several times faster than one pass; on an
    # accelerator one launch per tensor is.
    chunk = _CPU_CHUNK if flat.device.type == "cpu" else max(1, flat.numel())
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for i in range(0, flat.numel(), chunk):
        total += bits[i : i + chunk].to(torch.int64).mul_(weights[i : i + chunk]).sum()
    return int(total)


def of(named: Iterable[tuple[str, torch.Tensor | None]]) -> str:
    """One hex digest over named tensors (None: a tensor that holds nothing yet), in order."""
    digest = hashlib.sha256()
    for name, tensor in named:
        if tensor is None:
            digest.update(f"{name}:none;".encode())
        else:
            fp = tensor_fingerprint(tensor)
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}:{fp};".encode())
    return f"{VERSION}:{digest.hexdigest()[:32]}"
