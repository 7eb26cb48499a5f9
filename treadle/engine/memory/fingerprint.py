"""Fingerprints of tensors, computed on the device where they live.

A tensor's fingerprint is the sum, modulo 2**64, of its elements' bit patterns (read as
integers) times fixed pseudo-random 64-bit weights; a list of named tensors hashes every name,
dtype, shape and fingerprint with sha256. Integer sums do not depend on the order of addition, so
the result is the same on every device and thread count, and it costs one pass over the tensors
where they are (no copy to the host, which a byte hash of the adapter after every operation would
need). Two tensors that differ in any bit collide with probability at most 2**-32 (the weights
are uniform; a difference is a nonzero integer below 2**32 in each element): enough to catch a
replay that went astray, not meant to resist an adversary. Fingerprints are logged with the
operations that changed the state, so a tensor's never changes; `of` computes small tensors'
together (a dozen operations each would cost more than their elements), to the same values.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence

import torch

__all__ = ["fingerprints_together", "of", "tensor_fingerprint"]

VERSION = "fp1"
_BLOCK = 1 << 16
_CPU_CHUNK = 1 << 18
# At most this many elements, a tensor's fingerprint costs its operations rather than its
# elements: `of` fingerprints such tensors of one dtype and device together.
_SMALL = 1 << 14
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
        # A copy even of 64-bit elements (`to` returns those as they are): the product is in
        # place, and must not be in the tensor fingerprinted.
        total += bits[i : i + chunk].to(torch.int64, copy=True).mul_(weights[i : i + chunk]).sum()
    return int(total)


def fingerprints_together(tensors: Sequence[torch.Tensor]) -> list[int]:
    """`tensor_fingerprint` of each of `tensors` (one dtype, one device, none empty), in a few
    operations for all of them: their bits side by side, each times its own weights, and each
    one's sum the difference of a running sum at its ends (exact, modulo 2**64)."""
    numels = [t.numel() for t in tensors]
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1) for t in tensors])
    bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    weights = _weights_for(max(numels), flat.device)
    bits.mul_(torch.cat([weights[:n] for n in numels]))
    ends = torch.tensor(numels, device=flat.device).cumsum(0) - 1
    running = bits.cumsum(0)[ends]
    return [int(fp) for fp in torch.cat([running[:1], running[1:] - running[:-1]]).tolist()]


def of(named: Iterable[tuple[str, torch.Tensor | None]]) -> str:
    """One hex digest over named tensors (None: a tensor that holds nothing yet), in order."""
    pairs = list(named)
    small: dict[tuple[torch.device, torch.dtype], dict[int, torch.Tensor]] = {}
    for i, (_, tensor) in enumerate(pairs):
        if tensor is not None and 0 < tensor.numel() <= _SMALL:
            small.setdefault((tensor.device, tensor.dtype), {})[i] = tensor
    known: dict[int, int] = {}
    for group in small.values():
        known.update(zip(group, fingerprints_together(list(group.values())), strict=True))
    digest = hashlib.sha256()
    for i, (name, tensor) in enumerate(pairs):
        if tensor is None:
            digest.update(f"{name}:none;".encode())
        else:
            fp = known[i] if i in known else tensor_fingerprint(tensor)
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}:{fp};".encode())
    return f"{VERSION}:{digest.hexdigest()[:32]}"
