"""The base model's linears on the CPU through oneDNN, with each weight packed once.

PyTorch's CPU `F.linear` sends float32 products to MKL's sgemm, which on some x86 CPUs (AMD's
Zen, the development machine's) runs a path two to four times slower than oneDNN's kernels for
the same product: a decoding step's [16, 576] x [576, 49,152] unembedding took 17-25 ms in MKL
and 4-5 ms in oneDNN (docs/benchmarks.md, "Sampling"). `pack` lays a frozen weight out once in
the blocked layout oneDNN's inner product reads, and `linear` computes x @ W.T (+ bias) with it:
float32 throughout (its error against float64 is within twice MKL's), deterministic, and a row's
result does not depend on the rows beside it (a request decoded alone and in a batch gets the
same logits). The packed copy costs the weight's size again in memory.

The engine packs for sampling only: a forward pass that needs no gradient. Training keeps
`F.linear`, whose results its replays and recorded state hashes already fix. `available` says
whether this torch build has the kernels and they agree with `F.linear` (checked once); where
not, callers keep `F.linear`. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["PACKED_FOR_ROWS", "available", "linear", "pack"]

# The batch size the layout is chosen for: decoding steps run a few to a few dozen rows, and in
# measurements the layout for 16 was as fast as any other from 1 to 384 rows.
PACKED_FOR_ROWS = 16


@functools.cache
def available() -> bool:
    """True if oneDNN's packed inner product is there and agrees with `F.linear` on a small
    product (to float32 rounding)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 40, generator=generator)
        bias = torch.randn(48, generator=generator)
        x = torch.randn(2, 3, 40, generator=generator)
        got = linear(x, pack(weight), bias)
    except (AttributeError, RuntimeError):  # no such op in this build, or not on this CPU
        return False
    return bool(torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in], float32, on the CPU) in oneDNN's layout for `linear`: a new tensor
    that later changes to `weight` do not reach."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) for `packed` = `pack(W)`; `x` is [..., in]. No gradient flows."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
