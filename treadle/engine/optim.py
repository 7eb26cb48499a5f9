"""The optimizer: AdamW over an adapter's tensors, its settings (`AdamSpec`) and their checks.

An adapter's tensors sit in two parameter groups, the A matrices (and any other tensor) and the
B matrices, so a step can give B its own learning rate (LoRA+); the state stays per tensor.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treadle.platform.errors import ValidationError

__all__ = ["OPTIMIZERS", "AdamSpec", "adamw", "check_adam", "step"]

# The optimizers an adapter can train with, chosen at its creation (tinker's optimizer_config
# `type`): AdamW here, Dimuon in `dimuon`.
OPTIMIZERS = ("adamw", "dimuon")


@dataclass(frozen=True)
class AdamSpec:
    """AdamW's settings for one step. `lora_plus_lr_ratio` is LoRA+ (Hayou et al. 2024,
    arXiv 2402.12354; SageMaker's loraPlusLrRatio): every B matrix learns at `learning_rate`
    times it, every A matrix at `learning_rate`."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    lora_plus_lr_ratio: float = 1.0


# The optimizer's parameter groups: the A matrices (and any other adapter tensor) learn at the
# step's learning rate, the B matrices at that times `lora_plus_lr_ratio` (LoRA+).
_A_GROUP, _B_GROUP = 0, 1


def adamw(a_params: Sequence[torch.Tensor], b_params: Sequence[torch.Tensor]) -> torch.optim.AdamW:
    """AdamW over an adapter: `a_params` in the first group, `b_params` (the B matrices) in the
    second; every setting is set afresh by each `step`."""
    return torch.optim.AdamW(
        [{"params": list(a_params)}, {"params": list(b_params)}]  # _A_GROUP, _B_GROUP
    )


def step(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], adam: AdamSpec
) -> dict[str, float]:
    """Apply the accumulated grads of `params` with AdamW(`adam`) (after clipping their global
    norm to `grad_clip_norm`, if > 0), then zero them: the B matrices with learning rate
    `learning_rate * lora_plus_lr_ratio` (their weight decay too, as AdamW ties it to the rate),
    everything else with `learning_rate`. Returns the norm before clipping and `learning_rate`
    (the A matrices')."""
    check_adam(adam)
    grad_norm = clipped_grads(params, adam.grad_clip_norm)
    # A ratio of 1 gives B exactly the learning rate (x * 1.0 == x), so the step is the one a
    # single group made before LoRA+ existed, bit for bit: AdamW updates each tensor alone.
    rates = {
        _A_GROUP: adam.learning_rate,
        _B_GROUP: adam.learning_rate * adam.lora_plus_lr_ratio,
    }
    for index, group in enumerate(optimizer.param_groups):
        group.update(
            lr=rates[index],
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm:mean": float(grad_norm), "learning_rate:mean": adam.learning_rate}


def clipped_grads(params: Sequence[torch.Tensor], clip_norm: float) -> torch.Tensor:
    """Give every parameter a grad (zeros where none reached it) and clip their global norm to
    `clip_norm` (if > 0), in place; returns the norm before clipping. Both optimizers' first
    step (`step`, `dimuon.step`)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if clip_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip_norm, grad_norm)
    return grad_norm


def check_adam(adam: AdamSpec) -> None:
    problems = []
    if not adam.learning_rate >= 0:
        problems.append(f"learning_rate {adam.learning_rate} must be 0 or more")
    for name, beta in (("beta1", adam.beta1), ("beta2", adam.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{name} {beta} must be in [0, 1)")
    for name, value in (
        ("eps", adam.eps),
        ("weight_decay", adam.weight_decay),
        ("grad_clip_norm", adam.grad_clip_norm),
    ):
        if not value >= 0:
            problems.append(f"{name} {value} must be 0 or more")
    if not (math.isfinite(adam.lora_plus_lr_ratio) and adam.lora_plus_lr_ratio >= 1):
        problems.append(
            f"lora_plus_lr_ratio {adam.lora_plus_lr_ratio} must be a finite number, 1 or more "
            "(1 trains A and B at the same rate)"
        )
    if problems:
        raise ValidationError("invalid Adam parameters: " + "; ".join(problems))
