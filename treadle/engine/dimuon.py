"""Dimuon: Tinker's Muon-style optimizer for LoRA matrices (`DimuonSpec`, `Dimuon`, `msign`).

Every adapter tensor is a LoRA matrix (A [rank, in] or B [out, rank]; an experts module's tensor
holds one pair per expert, each orthogonalised on its own). A step: clip the global grad norm
(as AdamW's), momentum M <- beta1 * M + (1 - beta1) * G, direction O = msign(M) by five quintic
Newton-Schulz iterations (Keller Jordan's coefficients, in float64), rescaled to Frobenius norm
sqrt(rank), and W <- W - learning_rate * O. No weight decay, no Nesterov, no rank correction;
docs/losses-and-sampling.md states each choice. Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treadle.engine.optim import clipped_grads
from treadle.platform.errors import ValidationError

__all__ = ["NS_COEFFICIENTS", "NS_EPS", "NS_STEPS", "Dimuon", "DimuonSpec", "check_dimuon", "msign"]

# The matrix-sign iteration (Tinker: "iteration count and normalization epsilon are internal
# constants"): Muon's quintic Newton-Schulz with its published coefficients, five steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


@dataclass(frozen=True)
class DimuonSpec:
    """One Dimuon step's settings (tinker's `DimuonParams`)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    grad_clip_norm: float = 0.0


def check_dimuon(spec: DimuonSpec) -> None:
    problems = []
    if not (math.isfinite(spec.learning_rate) and spec.learning_rate >= 0):
        problems.append(f"learning_rate {spec.learning_rate} must be 0 or more")
    if not 0 <= spec.beta1 < 1:
        problems.append(f"beta1 {spec.beta1} must be in [0, 1)")
    if not math.isfinite(spec.grad_clip_norm):
        problems.append(f"grad_clip_norm {spec.grad_clip_norm} must be finite (0 or less: none)")
    if problems:
        raise ValidationError("invalid Dimuon parameters: " + "; ".join(problems))


def msign(m: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor of the 2-D `m` (U V^T of its SVD), approximately: `m` scaled to
    Frobenius norm <= 1, then NS_STEPS quintic Newton-Schulz iterations on the wide orientation.
    In float64: each iteration multiplies a small singular value's rounding error by up to
    3.4, so float32 would leave ~1e-5 of noise in the direction; a LoRA matrix has `rank` rows
    or columns, so the products are cheap. A zero matrix gives zeros."""
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + NS_EPS)
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _direction(m: torch.Tensor, rank: int) -> torch.Tensor:
    """msign(m) rescaled to Frobenius norm sqrt(rank) (Tinker's "direction with Frobenius norm
    sqrt(rank)"); zeros stay zeros."""
    o = msign(m)
    return o * (math.sqrt(rank) / (torch.linalg.matrix_norm(o) + NS_EPS))


class Dimuon(torch.optim.Optimizer):
    """Dimuon over LoRA matrices, one parameter group per tensor: `layout` "A" ([experts * rank,
    in], expert e's rows e*rank..) or "B" ([out, rank * experts], expert e's columns e, e +
    experts, ..: peft's layout, `lora.experts.expert_factors`), `experts` pairs, `rank` each.
    State per tensor: `momentum_buffer`. Settings come with each `step`."""

    def __init__(self, matrices: Sequence[tuple[torch.Tensor, str, int, int]]) -> None:
        groups = [
            {"params": [p], "layout": layout, "experts": experts, "rank": rank}
            for p, layout, experts, rank in matrices
        ]
        super().__init__(groups, {"lr": 0.0, "beta1": 0.9})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "Dimuon takes no closure"
        for group in self.param_groups:
            (p,) = group["params"]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            m = state["momentum_buffer"]
            m.mul_(group["beta1"]).add_(grad, alpha=1 - group["beta1"])
            update = torch.empty_like(p)
            for m_block, u_block in zip(
                _blocks(m, group["layout"], group["experts"]),
                _blocks(update, group["layout"], group["experts"]),
                strict=True,
            ):
                u_block.copy_(_direction(m_block, group["rank"]))  # back to p's dtype
            p.add_(update, alpha=-group["lr"])


def _blocks(t: torch.Tensor, layout: str, experts: int) -> list[torch.Tensor]:
    """Views of each expert's matrix in `t` (the whole tensor when `experts` is 1)."""
    if experts == 1:
        return [t]
    if layout == "A":
        return list(t.view(experts, -1, t.shape[-1]).unbind(0))
    return list(t.view(t.shape[0], -1, experts).permute(2, 0, 1).unbind(0))


def step(optimizer: Dimuon, params: Sequence[torch.Tensor], spec: DimuonSpec) -> dict[str, float]:
    """Apply the accumulated grads of `params` with Dimuon(`spec`) (after clipping their global
    norm to `grad_clip_norm`, if > 0), then zero them. Returns the norm before clipping and
    `learning_rate`."""
    check_dimuon(spec)
    grad_norm = clipped_grads(params, spec.grad_clip_norm)
    for group in optimizer.param_groups:
        group.update(lr=spec.learning_rate, beta1=spec.beta1)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm:mean": float(grad_norm), "learning_rate:mean": spec.learning_rate}
