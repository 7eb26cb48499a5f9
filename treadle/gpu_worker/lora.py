"""Many LoRA adapters on one frozen base model, one active at a time.

Owns `LoraHost` (wraps the base model's target linears once) and `LoraWeights` (one adapter's A/B
matrices as plain tensors). Adapters and snapshots are just `LoraWeights`; activating one is a
pointer swap, so adding an adapter never re-injects modules and a frozen copy for sampling costs
only its tensors. This is peft's multi-adapter LoRA with the bookkeeping Treadle needs (per-adapter
targets and rank, seeded init, snapshots); tensor names follow peft's so weights can be exported.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ATTN_TARGETS",
    "MLP_TARGETS",
    "UNEMBED_TARGETS",
    "LoraHost",
    "LoraLinear",
    "LoraWeights",
]

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)


@dataclass
class LoraWeights:
    """One adapter: `A[name]` is [rank, in_features], `B[name]` is [out_features, rank], float32.

    The delta added to module `name`'s output is `scale * x @ A.T @ B.T`, `scale = alpha / rank`.
    """

    scale: float
    A: dict[str, torch.Tensor]
    B: dict[str, torch.Tensor]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor with its peft-style name, in a fixed order (module order, A before B)."""
        named: list[tuple[str, torch.Tensor]] = []
        for module in self.A:
            named.append((f"base_model.model.{module}.lora_A.weight", self.A[module]))
            named.append((f"base_model.model.{module}.lora_B.weight", self.B[module]))
        return named

    def parameters(self) -> list[torch.Tensor]:
        return [tensor for _, tensor in self.tensors()]

    def frozen_copy(self) -> LoraWeights:
        """A detached copy that later training of `self` cannot change."""
        return LoraWeights(
            scale=self.scale,
            A={k: v.detach().clone() for k, v in self.A.items()},
            B={k: v.detach().clone() for k, v in self.B.items()},
        )


class LoraLinear(nn.Module):
    """A frozen linear plus the delta of whichever adapter its host has active (if it targets
    this module)."""

    def __init__(self, base: nn.Linear, name: str, host: LoraHost) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self._host = host

    @property
    def weight(self) -> torch.Tensor:  # transformers reads lm_head.weight (weight tying)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        active = self._host.active
        if active is None or self.name not in active.A:
            return y
        a_r_in, b_out_r = active.A[self.name], active.B[self.name]
        delta = F.linear(F.linear(x.to(a_r_in.dtype), a_r_in), b_out_r) * active.scale
        return y + delta.to(y.dtype)


class LoraHost:
    """Wraps every attention, MLP and unembedding linear of `model` in a `LoraLinear`, in place."""

    def __init__(self, model: nn.Module) -> None:
        self.active: LoraWeights | None = None
        self.shapes: dict[str, tuple[int, int]] = {}  # module name -> (in_features, out_features)
        targets = ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS
        found = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
        ]
        for name, module in found:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoraLinear(module, name, self))
            self.shapes[name] = (module.in_features, module.out_features)
        assert self.shapes, "no LoRA target modules found in the base model"

    @contextlib.contextmanager
    def use(self, weights: LoraWeights | None) -> Iterator[None]:
        """Run the model with `weights` active (None: the bare base model)."""
        previous, self.active = self.active, weights
        try:
            yield
        finally:
            self.active = previous

    def new_weights(
        self,
        *,
        rank: int,
        alpha: float,
        seed: int,
        train_attn: bool,
        train_mlp: bool,
        train_unembed: bool,
        device: torch.device,
    ) -> LoraWeights:
        """Fresh trainable weights: A uniform in +-1/sqrt(in_features) (peft's default) drawn from
        a CPU generator seeded with `seed` in module order, so the same seed gives the same A on
        every device; B = 0, so the adapter starts as the base model."""
        suffixes = (
            (ATTN_TARGETS if train_attn else ())
            + (MLP_TARGETS if train_mlp else ())
            + (UNEMBED_TARGETS if train_unembed else ())
        )
        generator = torch.Generator(device="cpu").manual_seed(seed)
        a: dict[str, torch.Tensor] = {}
        b: dict[str, torch.Tensor] = {}
        for name, (in_features, out_features) in self.shapes.items():
            if name.rsplit(".", 1)[-1] not in suffixes:
                continue
            bound = 1.0 / math.sqrt(in_features)
            a_r_in = torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)
            a[name] = nn.Parameter(a_r_in.to(device))
            b[name] = nn.Parameter(torch.zeros(out_features, rank, device=device))
        return LoraWeights(scale=alpha / rank, A=a, B=b)
