"""LoRA on MoE experts stored as 3-D parameters (transformers' `use_experts_implementation`
layout, Qwen3-MoE's and gpt-oss's): `LoraExperts` wraps an experts module and, while an adapter
targets any of its parameters, runs the experts itself with each expert's low-rank delta added to
its projections, for the tokens routed to that expert only. That is what peft's `ParamWrapper`
computes (it adds every expert's delta to the whole weight stack, then runs the experts), without
a delta the size of the stack; with no adapter on it, the experts module runs as it is.

An expert parameter's adapter tensors are laid out as peft's: A is [experts * rank, in] (expert
e's rows e*rank ... e*rank + rank - 1), B is [out, rank * experts] (peft reads it as
[out, rank, experts]: expert e's columns e, e + experts, ...). `expert_factors` gives each
expert's A [rank, in] and B [out, rank] as views.
Must not import flask, sqlalchemy, celery, treadle.api or treadle.engine.lora.adapters (which
uses it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.lora.targets import EXPERT_PROJECTIONS, expert_key

__all__ = ["ExpertAdapter", "LoraExperts", "Plan", "expert_factors", "expert_shape"]


class ExpertAdapter(Protocol):
    """What `LoraExperts` reads of an adapter (an `adapters.LoraWeights`)."""

    @property
    def scale(self) -> float: ...
    @property
    def A(self) -> Mapping[str, torch.Tensor]: ...  # noqa: N802  # peft's names
    @property
    def B(self) -> Mapping[str, torch.Tensor]: ...  # noqa: N802


# The adapters on some targets (expert keys) for a pass over N tokens, each with the tokens it
# runs ([N] mask; None: every token): `plan(keys, N, device)`, which the host answers.
Plan = Callable[
    [frozenset[str], int, torch.device], Sequence[tuple[ExpertAdapter, torch.Tensor | None]]
]


def expert_shape(module: nn.Module, parameter: str) -> tuple[int, int, int]:
    """(experts, in_features, out_features) of `module`'s 3-D parameter `parameter`, stored as
    [experts, out, in], or as [experts, in, out] where the module `is_transposed`."""
    experts, first, second = getattr(module, parameter).shape
    return (experts, first, second) if module.is_transposed else (experts, second, first)


def expert_factors(
    a: torch.Tensor, b: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's A [experts, rank, in] and B [experts, out, rank], views of peft's
    A [experts * rank, in] and B [out, rank * experts]."""
    a_E_r_in = a.view(experts, -1, a.shape[-1])
    b_E_out_r = b.view(b.shape[0], -1, experts).permute(2, 0, 1)
    return a_E_r_in, b_E_out_r


class LoraExperts(nn.Module):
    """An experts module (`base`, called with hidden states [N, H], each token's chosen experts
    [N, K] and their routing weights [N, K]) plus the deltas of the adapters `plan` says are on
    its parameters (its host's active one, or an adapter per batch row while sampling)."""

    def __init__(self, base: nn.Module, name: str, plan: Plan) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self._plan = plan
        layout: Any = base  # transformers' experts layout (`use_experts_implementation`)
        self._experts = int(layout.num_experts)
        up = "gate_up_proj" if layout.has_gate else "up_proj"
        self._keys = {role: expert_key(name, p) for p, role in EXPERT_PROJECTIONS.items()}
        self._keys["up"] = expert_key(name, up)
        self._params = {"up": up, "down": "down_proj"}

    def forward(
        self, hidden_N_H: torch.Tensor, experts_N_K: torch.Tensor, routing_N_K: torch.Tensor
    ) -> torch.Tensor:
        plan = self._plan(frozenset(self._keys.values()), hidden_N_H.shape[0], hidden_N_H.device)
        if not plan or hidden_N_H.shape[0] == 0:
            return self.base(hidden_N_H, experts_N_K, routing_N_K)  # type: ignore[no-any-return]
        base: Any = self.base  # transformers' experts layout (`use_experts_implementation`)
        tokens, k = experts_N_K.shape
        # The (token, choice) pairs sorted by expert, so each expert's pairs are one piece.
        expert_P = experts_N_K.reshape(-1)
        order_P = torch.argsort(expert_P, stable=True)
        counts = torch.bincount(expert_P, minlength=self._experts).tolist()  # one host sync
        # split and unbind, not a slice or an index per expert: their backwards each write one
        # whole gradient, where a slice's would write a zero tensor of the whole per expert
        x_E = hidden_N_H[order_P // k].split(counts)
        runs = [
            _Run(w, None if m is None else m.repeat_interleave(k)[order_P].split(counts))
            for w, m in plan
        ]
        outs: list[torch.Tensor] = []
        for expert, x_M_H in enumerate(x_E):
            if len(x_M_H) == 0:
                continue
            h_M_I = self._project("up", expert, x_M_H, runs)
            h_M_I = base._apply_gate(h_M_I) if base.has_gate else base.act_fn(h_M_I)
            outs.append(self._project("down", expert, h_M_I, runs))
        out_P_H = torch.cat(outs)
        if base.has_post_expert_norm:
            out_P_H = base.post_expert_norm(out_P_H)
        out_P_H = out_P_H * routing_N_K.reshape(-1)[order_P, None]
        unsort_P = torch.empty_like(order_P)
        unsort_P[order_P] = torch.arange(len(order_P), device=order_P.device)
        # a fixed-order sum over each token's choices (no index_add_: deterministic on CUDA)
        out_N_H = out_P_H[unsort_P].view(tokens, k, -1).sum(dim=1)
        return out_N_H.to(hidden_N_H.dtype)

    def _project(
        self, role: str, expert: int, x_M_in: torch.Tensor, runs: list[_Run]
    ) -> torch.Tensor:
        """Expert `expert`'s projection `role` of its pairs `x_M_in`, plus the delta of each
        adapter (`runs`) on the pairs it runs."""
        param = self._params[role]
        w = getattr(self.base, param)[expert]
        y_M_out = x_M_in @ w if self.base.is_transposed else F.linear(x_M_in, w)
        if self.base.has_bias:
            y_M_out = y_M_out + getattr(self.base, f"{param}_bias")[expert]
        key = self._keys[role]
        for run in runs:
            factors = run.factors(key, self._experts)
            if factors is None:
                continue
            a_r_in, b_out_r = factors[0][expert], factors[1][expert]
            if run.mask_E is None:
                y_M_out = _plus_delta(y_M_out, x_M_in, a_r_in, b_out_r, run.weights.scale)
                continue
            rows = run.mask_E[expert].nonzero()[:, 0]
            if len(rows):
                d_m_out = _plus_delta(
                    y_M_out[rows], x_M_in[rows], a_r_in, b_out_r, run.weights.scale
                )
                y_M_out = y_M_out.index_copy(0, rows, d_m_out)
        return y_M_out


def _plus_delta(
    y_M_out: torch.Tensor,
    x_M_in: torch.Tensor,
    a_r_in: torch.Tensor,
    b_out_r: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`y + scale * x @ A.T @ B.T`, in the adapter's dtype, the result in `y`'s. The scale goes
    on the rank-wide product, the smallest tensor it can; where `y` has the adapter's dtype the
    second product and the add are one `addmm`."""
    h_M_r = F.linear(x_M_in.to(a_r_in.dtype), a_r_in) * scale
    if y_M_out.dtype == a_r_in.dtype:
        return torch.addmm(y_M_out, h_M_r, b_out_r.T)
    return y_M_out + F.linear(h_M_r, b_out_r).to(y_M_out.dtype)


class _Run:
    """One adapter in one experts pass: which of each expert's pairs it runs (`mask_E`; None:
    all), and each targeted parameter's per-expert A and B, unbound once per pass."""

    def __init__(self, weights: ExpertAdapter, mask_E: Sequence[torch.Tensor] | None) -> None:
        self.weights = weights
        self.mask_E = mask_E
        self._factors: dict[str, tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None] = {}

    def factors(
        self, key: str, experts: int
    ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None:
        """Each expert's A [rank, in] and B [out, rank] of parameter `key`; None if the adapter
        does not target it."""
        if key not in self._factors:
            if key in self.weights.A:
                a_E_r_in, b_E_out_r = expert_factors(
                    self.weights.A[key], self.weights.B[key], experts
                )
                self._factors[key] = (a_E_r_in.unbind(0), b_E_out_r.unbind(0))
            else:
                self._factors[key] = None
        return self._factors[key]
