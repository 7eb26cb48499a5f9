"""The gradient of a forward_backward, summed in one fixed order whoever computes its parts.

A request runs in parts (`losses.microbatches`). Their LoRA gradients are added in a pairwise
tree whose shape depends only on the number of parts: parts 0..n-1 are split into aligned
power-of-two blocks, largest first (the binary digits of n), each block summed as a perfect
binary tree, the blocks then added left to right. Floating-point addition is commutative, so
the tree fixes every rounding: the sum is the same bit for bit however the parts are spread.

`units_of` cuts that tree into subtrees that ranks compute alone (a rank keeps one running
`PairwiseSum` per unit: at most log2(unit) + 1 flat buffers, never one per part), and
`PairwiseSum` with sizes puts the units' sums back together into the same tree; a group
exchanges only the units' sums (`distributed.group`: O(adapter) bytes per rank, whatever the
number of parts). Gradients travel as one flat float32 buffer per sum (`flatten`, `unflatten`).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PairwiseSum", "combine", "flatten", "unflatten", "units_of"]


class PairwiseSum:
    """The canonical tree's sum of consecutive terms pushed in order: equal-sized subtrees are
    added as soon as both exist (earlier + later), and `total` adds what is left left to right
    (larger, earlier blocks first). A term may stand for a subtree of `size` parts, as a unit's
    sum does."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []

    def push(self, term: torch.Tensor, size: int = 1) -> None:
        assert size > 0 and size & (size - 1) == 0, f"a subtree of {size} parts is not a tree"
        while self._stack and self._stack[-1][0] == size:
            _, earlier = self._stack.pop()
            term = earlier.add_(term)  # `earlier` is this sum's own buffer
            size *= 2
        self._stack.append((size, term))

    @property
    def held(self) -> int:
        """Buffers this sum holds now."""
        return len(self._stack)

    def total(self) -> torch.Tensor | None:
        """The sum of every term pushed (None: nothing was)."""
        if not self._stack:
            return None
        (_, total), *rest = self._stack
        for _, term in rest:
            total = total.add_(term)
        self._stack = []
        return total


def _blocks(n: int) -> list[range]:
    """Parts 0..n-1 as aligned power-of-two blocks, largest first."""
    blocks, start = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            blocks.append(range(start, start + (1 << bit)))
            start += 1 << bit
    return blocks


def units_of(n: int, world_size: int) -> list[range]:
    """Parts 0..n-1 cut into subtrees of the canonical tree, in order: each block split into
    pieces of 2^k parts for the smallest k that leaves at most 2 x `world_size` pieces (or the
    blocks whole, where they already outnumber that)."""
    blocks = _blocks(n)
    for k in range(max(1, n).bit_length() + 1):
        pieces = [
            range(start, min(start + (1 << k), block.stop))
            for block in blocks
            for start in range(block.start, block.stop, 1 << k)
        ]
        if len(pieces) <= max(2 * world_size, len(blocks)):
            return pieces
    raise AssertionError("unreachable: the blocks whole are at most len(blocks) pieces")


def combine(sums: dict[int, torch.Tensor], units: Sequence[range]) -> torch.Tensor | None:
    """The request's gradient from every unit's sum (`sums[u]` for each of `units`; none at
    all in a forward only), added as the canonical tree adds them."""
    if not sums:
        return None
    assert sorted(sums) == list(range(len(units))), (sorted(sums), len(units))
    total = PairwiseSum()
    for u, unit in enumerate(units):
        total.push(sums[u], len(unit))
    return total.total()


def flatten(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One part's gradient as a flat float32 buffer (zeros where a parameter got none; a
    bfloat16 grad, of an adapter's copy in a bfloat16 model's dtype, converted exactly)."""
    out = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
    start = 0
    for grad, param in zip(grads, params, strict=True):
        if grad is not None:
            out[start : start + param.numel()].copy_(grad.reshape(-1))
        start += param.numel()
    return out


def unflatten(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut back into tensors shaped as `params` (views of it)."""
    return [
        piece.view_as(param)
        for piece, param in zip(flat.split([p.numel() for p in params]), params, strict=True)
    ]
