"""Many LoRA adapters on one frozen base model, one active at a time (or one per batch row).

Owns `LoraSpec` (an adapter's rank, alpha, seed and targets), `LoraHost` (wraps the base model's
target linears, and its MoE experts modules (`lora.experts`), once, as `lora_targets.resolve`
finds them, and refuses a spec the model cannot train), `LoraWeights` (one adapter's A/B
matrices as plain tensors) and
`TrainableLora` (weights plus accumulated grads and AdamW state, movable between the accelerator
and host memory as a unit, releasable and restorable as a unit for paging to disk, its Adam state
readable and restorable exactly). Adapters and snapshots
are just `LoraWeights`; activating one is a pointer swap, so adding an adapter never re-injects
modules and a frozen copy for sampling costs only its tensors. This is peft's multi-adapter LoRA
with the bookkeeping Treadle needs (per-adapter targets and rank, seeded init, snapshots); tensor
names follow peft's so weights can be exported.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treadle.engine.dimuon import Dimuon, DimuonSpec
from treadle.engine.dimuon import step as dimuon_step
from treadle.engine.lora.experts import LoraExperts, expert_shape
from treadle.engine.lora.targets import (
    LoraTargets,
    is_expert_key,
    peft_module_paths,
    resolve,
    split_expert_key,
)
from treadle.engine.models import cpu_linear
from treadle.engine.optim import OPTIMIZERS, AdamSpec, adamw
from treadle.engine.optim import step as adam_step
from treadle.platform.errors import ValidationError

__all__ = [
    "LoraHost",
    "LoraLinear",
    "LoraSpec",
    "LoraWeights",
    "RowAdapters",
    "TrainableLora",
    "compute_dtype",
]


def compute_dtype(activations: torch.dtype) -> torch.dtype:
    """The dtype an adapter computes in on a model whose activations are `activations`: theirs
    where it is narrower than float32 (bfloat16, float16), so the LoRA's products keep no
    float32 copies of activations for the backward; float32 otherwise."""
    if activations.is_floating_point and torch.finfo(activations).bits < 32:
        return activations
    return torch.float32


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    optimizer: str = "adamw"  # fixed for the adapter's life: "adamw" or "dimuon" (OPTIMIZERS)


@dataclass
class LoraWeights:
    """One adapter: `A[name]` is [rank, in_features], `B[name]` is [out_features, rank], float32
    (the master weights; `in_dtype` gives the copy a lower-precision model computes with).

    The delta added to module `name`'s output is `scale * x @ A.T @ B.T`, `scale = alpha / rank`.
    An experts module's 3-D parameter (`name` an `expert_key`, `module:parameter`) has one such
    pair per expert, stored as peft stores them: A [experts * rank, in], B [out, rank * experts]
    (`lora.experts.expert_factors`). The keys keep the model's order (peft's names of expert
    tensors depend on it: `tensors()`).
    """

    scale: float
    A: dict[str, torch.Tensor]
    B: dict[str, torch.Tensor]
    # the copy in a narrower dtype (`in_dtype`), made when first asked for
    _copy: LoraWeights | None = field(default=None, repr=False, compare=False)

    def in_dtype(self, dtype: torch.dtype) -> LoraWeights:
        """The weights a model computing in `dtype` (`compute_dtype`) runs: these themselves in
        float32; else a copy in `dtype` (leaves that take grads, on these tensors' device), made
        from these once and kept, so every pass and every sample of them runs the same copy.
        Whoever changes these tensors refreshes or drops it (`refresh_copy`, `drop_copy`)."""
        if dtype == torch.float32:
            return self
        if self._copy is None or self._copy.dtype != dtype or self._copy.device != self.device:
            self._copy = LoraWeights(
                scale=self.scale,
                A={k: nn.Parameter(v.detach().to(dtype)) for k, v in self.A.items()},
                B={k: nn.Parameter(v.detach().to(dtype)) for k, v in self.B.items()},
            )
        return self._copy

    def refresh_copy(self) -> None:
        """Write these tensors' values into the copy `in_dtype` made (rounded to its dtype), in
        place, so its tensors stay the same objects; nothing when there is none."""
        if self._copy is None:
            return
        with torch.no_grad():
            for (_, copy), (_, master) in zip(self._copy.tensors(), self.tensors(), strict=True):
                copy.copy_(master)

    def drop_copy(self) -> None:
        """Forget the copy `in_dtype` made (made again when next asked for)."""
        self._copy = None

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.A.values())).dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.A.values())).device

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor with its peft name, in a fixed order (module order, A before B). An
        expert parameter's are named by the `ParamWrapper` peft nests around its module for it
        (`peft_module_paths`)."""
        named: list[tuple[str, torch.Tensor]] = []
        for name, path in zip(self.A, peft_module_paths(list(self.A)), strict=True):
            named.append((f"base_model.model.{path}.lora_A.weight", self.A[name]))
            named.append((f"base_model.model.{path}.lora_B.weight", self.B[name]))
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

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite every tensor with `arrays` (peft names, as `tensors()` gives them).
        ValidationError, changing nothing, on a missing, extra, misshapen or non-finite tensor."""
        named = dict(self.tensors())
        missing, extra = sorted(set(named) - set(arrays)), sorted(set(arrays) - set(named))
        if missing or extra:
            raise ValidationError(
                f"adapter weights do not match this adapter: missing {missing}, unexpected "
                f"{extra}; load weights saved from an adapter with the same rank and targets"
            )
        for name, tensor in named.items():
            if tuple(np.shape(arrays[name])) != tuple(tensor.shape):
                raise ValidationError(
                    f"adapter weight {name} has shape {list(np.shape(arrays[name]))}; this "
                    f"adapter needs {list(tensor.shape)}"
                )
            if not np.isfinite(arrays[name]).all():
                raise ValidationError(f"adapter weight {name} holds NaN or infinite values")
        with torch.no_grad():
            for name, tensor in named.items():
                tensor.copy_(torch.as_tensor(np.asarray(arrays[name], np.float32)))


class LoraLinear(nn.Module):
    """A frozen linear plus the delta of whichever adapter its host has active (if it targets
    this module). While sampling (an adapter per row), the frozen product runs on `packed`, the
    base weight packed for oneDNN, where the host has packed it (`LoraHost.pack_for_sampling`)."""

    def __init__(self, base: nn.Linear, name: str, host: LoraHost) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self._host = host
        self.packed: torch.Tensor | None = None

    @property
    def host(self) -> LoraHost:
        return self._host

    @property
    def weight(self) -> torch.Tensor:  # transformers reads lm_head.weight (weight tying)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._host.rows is not None:  # sampling: no gradient
            if self.packed is None:
                y = self.base(x)
            else:
                y = cpu_linear.linear(x, self.packed, self.base.bias)
            return self._host.rows.apply(self.name, x, y)
        y = self.base(x)
        active = self._host.active
        if active is None or self.name not in active.A:
            return y
        return y + _delta(active, self.name, x).to(y.dtype)


def _delta(weights: LoraWeights, name: str, x: torch.Tensor) -> torch.Tensor:
    a_r_in, b_out_r = weights.A[name], weights.B[name]
    return F.linear(F.linear(x.to(a_r_in.dtype), a_r_in), b_out_r) * weights.scale


def _plus_delta(weights: LoraWeights, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`y + _delta(weights, name, x)` for sampling: where `y` has the adapter's dtype (float32,
    the CPU's), the second product, its scale and the add are one `addmm`, which writes no
    intermediate [tokens, out] tensors."""
    a_r_in, b_out_r = weights.A[name], weights.B[name]
    if y.dtype != a_r_in.dtype:
        return y + _delta(weights, name, x).to(y.dtype)
    h_N_r = F.linear(x.reshape(-1, x.shape[-1]), a_r_in)
    y_N_out = y.reshape(-1, y.shape[-1])
    return torch.addmm(y_N_out, h_N_r, b_out_r.T, alpha=weights.scale).view(y.shape)


class RowAdapters:
    """Which adapter each batch row runs (None: the bare base model), for `LoraHost.use_rows`.

    One adapter on every row takes the single-adapter path. Otherwise the rows fall into slots
    of equal width M, and each module applies every slot at once: the rows' activations as
    [G, M*T, in], two batched matmuls against the slots' A and B stacked along G (transposed,
    ranks zero-padded to the largest), the deltas added back to their rows. When the rows are
    runs of one adapter, all of one length and covering every row (16 requests on 16 sessions;
    n samples each of k requests), a slot is a run and activations and deltas are plain views.
    Otherwise a slot is a distinct adapter, padded to its largest group of rows, and both are
    gathered by index. The stacks are built once per module and shared with the `RowAdapters`
    that follows (`previous`) when it has the same slots, so a batch pays for them only when
    its set of adapters changes.
    """

    def __init__(
        self,
        weights_R: Sequence[LoraWeights | None],
        device: torch.device,
        previous: RowAdapters | None = None,
    ) -> None:
        self.weights_R = list(weights_R)
        self._device = device
        runs = _runs(self.weights_R)
        slots: list[LoraWeights] = []
        self._uniform = all(w is not None for w, _ in runs) and len({n for _, n in runs}) == 1
        if self._uniform:  # each run its own slot, a view of the batch
            slots = [w for w, _ in runs if w is not None]
            rows_G = []
            start = 0
            for _, n in runs:
                rows_G.append(list(range(start, start + n)))
                start += n
        else:  # each distinct adapter a slot, its rows gathered
            rows_G = []
            for row, weights in enumerate(self.weights_R):
                if weights is None:
                    continue
                g = next((i for i, w in enumerate(slots) if w is weights), None)
                if g is None:
                    g = len(slots)
                    slots.append(weights)
                    rows_G.append([])
                rows_G[g].append(row)
        self.slots = tuple(slots)
        self.only = slots[0] if len(runs) == 1 and runs[0][0] is not None else None
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        if (
            previous is not None
            and len(previous.slots) == len(slots)
            and all(a is b for a, b in zip(previous.slots, slots, strict=True))
        ):
            self._stacks = previous._stacks  # the same adapters in the same slots
        width = max((len(r) for r in rows_G), default=0)
        self._width = width
        gather_G_M = [r + [0] * (width - len(r)) for r in rows_G]
        self._gather_G_M = torch.tensor(gather_G_M, dtype=torch.long, device=device)
        # where each row's delta sits in the flattened [G*M] deltas; the row past the end (a
        # zero row) for rows that run the base model alone
        place_R = [len(slots) * width] * len(self.weights_R)
        for g, rows in enumerate(rows_G):
            for m, row in enumerate(rows):
                place_R[row] = g * width + m
        self._place_R = torch.tensor(place_R, dtype=torch.long, device=device)
        # in the slots' dtype, so a bfloat16 product stays bfloat16 (a float32 tensor promotes)
        dtype = slots[0].dtype if slots else torch.float32
        scale_G = torch.tensor([w.scale for w in slots], dtype=dtype, device=device)
        self._scale_G11 = scale_G[:, None, None]

    def selected(self, keep: list[int]) -> RowAdapters:
        """The adapters of rows `keep` only, reusing these stacks where it can."""
        return RowAdapters([self.weights_R[i] for i in keep], self._device, self)

    def merged(self, other: RowAdapters) -> RowAdapters:
        """These rows and then `other`'s."""
        return RowAdapters(self.weights_R + other.weights_R, self._device, self)

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base module's output for `x`, [R, T, out]) plus each row's delta."""
        if self.only is not None:
            return y if name not in self.only.A else _plus_delta(self.only, name, x, y)
        stacks = self._stack(name)
        if stacks is None:
            return y
        a_G_in_r, b_G_r_out = stacks
        groups, width, tokens = len(self.slots), self._width, x.shape[1]
        if self._uniform:
            x_G_MT_in = x.reshape(groups, width * tokens, -1)
        else:
            x_G_MT_in = x[self._gather_G_M].reshape(groups, width * tokens, -1)
        # each slot's scale on the rank-wide products, the smallest tensor it can go on
        h_G_MT_r = torch.bmm(x_G_MT_in.to(a_G_in_r.dtype), a_G_in_r) * self._scale_G11
        if self._uniform and y.dtype == b_G_r_out.dtype:  # the product added in one call
            y_G_MT_out = y.reshape(groups, width * tokens, -1)
            return torch.baddbmm(y_G_MT_out, h_G_MT_r, b_G_r_out).view(y.shape)
        d_G_MT_out = torch.bmm(h_G_MT_r, b_G_r_out)
        if self._uniform:
            return y + d_G_MT_out.reshape(y.shape).to(y.dtype)
        d_GM_T_out = d_G_MT_out.reshape(groups * width, tokens, -1)
        d_GM_T_out = torch.cat([d_GM_T_out, d_GM_T_out.new_zeros(1, *d_GM_T_out.shape[1:])])
        return y + d_GM_T_out[self._place_R].to(y.dtype)

    def _stack(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Module `name`'s A.T [G, in, r] and B.T [G, r, out] of every slot (zeros for an
        adapter that does not target it, ranks padded with zeros); None when none targets it."""
        if name not in self._stacks:
            present = [w for w in self.slots if name in w.A]
            if not present:
                self._stacks[name] = None
            else:
                rank = max(w.A[name].shape[0] for w in present)
                a, b = present[0].A[name], present[0].B[name]
                a_G = a.new_empty(len(self.slots), a.shape[1], rank)
                b_G = b.new_empty(len(self.slots), rank, b.shape[0])
                for g, w in enumerate(self.slots):
                    r = w.A[name].shape[0] if name in w.A else 0
                    if r:
                        a_G[g, :, :r] = w.A[name].T
                        b_G[g, :r] = w.B[name].T
                    if r < rank:  # rank padding, or all of an adapter not targeting it
                        a_G[g, :, r:] = 0
                        b_G[g, r:] = 0
                self._stacks[name] = (a_G, b_G)
        return self._stacks[name]


def _runs(weights_R: list[LoraWeights | None]) -> list[tuple[LoraWeights | None, int]]:
    """(adapter, how many rows) for each run of consecutive rows running the same one."""
    runs: list[tuple[LoraWeights | None, int]] = []
    for w in weights_R:
        if runs and runs[-1][0] is w:
            runs[-1] = (w, runs[-1][1] + 1)
        else:
            runs.append((w, 1))
    return runs


class LoraHost:
    """Wraps every attention, MLP and unembedding linear of `model` (`targets`, as
    `lora_targets.resolve` finds them) in a `LoraLinear`, and every experts module whose 3-D
    parameters are targets in a `LoraExperts`, in place."""

    def __init__(self, model: nn.Module) -> None:
        self.targets: LoraTargets = resolve(model)
        self.active: LoraWeights | None = None
        self.rows: RowAdapters | None = None  # when set, an adapter per row (`use_rows`)
        self.shapes: dict[str, tuple[int, int]] = {}  # module name -> (in_features, out_features)
        # expert key -> (experts, in_features, out_features)
        self.expert_shapes: dict[str, tuple[int, int, int]] = {}
        self.linears: dict[str, LoraLinear] = {}
        self.experts: dict[str, LoraExperts] = {}
        for name in self.targets.linears:
            module = model.get_submodule(name)
            assert isinstance(module, nn.Linear), name
            self.linears[name] = LoraLinear(module, name, self)
            _replace(model, name, self.linears[name])
            self.shapes[name] = (module.in_features, module.out_features)
        for key in self.targets.experts:
            name, parameter = split_expert_key(key)
            if name not in self.experts:
                module = model.get_submodule(name)
                self.experts[name] = LoraExperts(module, name, self._expert_plan)
                _replace(model, name, self.experts[name])
            self.expert_shapes[key] = expert_shape(self.experts[name].base, parameter)

    def _expert_plan(
        self, keys: frozenset[str], tokens: int, device: torch.device
    ) -> list[tuple[LoraWeights, torch.Tensor | None]]:
        """The adapters on any of `keys` (an experts module's) for a pass over `tokens` tokens,
        each with the tokens it runs ([tokens] mask; None: every token): the active adapter, or
        while sampling each row's own (the MoE block flattens [R, T] tokens row by row)."""
        rows = self.rows
        if rows is None:
            active = self.active
            return [(active, None)] if active is not None and keys & set(active.A) else []
        if rows.only is not None:
            return [(rows.only, None)] if keys & set(rows.only.A) else []
        per_row = tokens // len(rows.weights_R)
        plan: list[tuple[LoraWeights, torch.Tensor | None]] = []
        for weights in rows.slots:
            if keys & set(weights.A):
                mask_R = torch.tensor([w is weights for w in rows.weights_R], device=device)
                plan.append((weights, mask_R.repeat_interleave(per_row)))
        return plan

    def pack_for_sampling(self) -> bool:
        """Pack every wrapped linear's frozen weight for oneDNN (`cpu_linear`), which sampling
        then runs on: float32 CPU weights only, and only where `cpu_linear.available()`. True if
        packed. Costs the linears' weights again in memory."""
        weights = [linear.base.weight for linear in self.linears.values()]
        if not weights or not all(
            w.device.type == "cpu" and w.dtype == torch.float32 for w in weights
        ):
            return False
        if not cpu_linear.available():
            return False
        for linear in self.linears.values():
            linear.packed = cpu_linear.pack(linear.base.weight)
        return True

    @contextlib.contextmanager
    def use(self, weights: LoraWeights | None) -> Iterator[None]:
        """Run the model with `weights` active (None: the bare base model)."""
        previous, self.active = self.active, weights
        try:
            yield
        finally:
            self.active = previous

    @contextlib.contextmanager
    def use_rows(self, rows: RowAdapters) -> Iterator[None]:
        """Run the model with each batch row's own adapter (or none), as `rows` says."""
        previous, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = previous

    def new_weights(self, spec: LoraSpec, device: torch.device) -> LoraWeights:
        """Fresh trainable weights: A uniform in +-1/sqrt(in_features) (peft's default) drawn from
        a CPU generator seeded with `spec.seed` in module order, so the same seed gives the same A
        on every device; B = 0, so the adapter starts as the base model.

        Raises ValidationError for rank < 1, alpha <= 0, no part selected to train, or a part
        this model cannot train (`LoraTargets.for_spec`).
        """
        rank = spec.rank
        if rank < 1:
            raise ValidationError(f"LoRA rank is {rank}; it must be at least 1")
        if not spec.alpha > 0:
            raise ValidationError(f"LoRA alpha is {spec.alpha}; it must be positive")
        generator = torch.Generator(device="cpu").manual_seed(spec.seed)
        a: dict[str, torch.Tensor] = {}
        b: dict[str, torch.Tensor] = {}
        for name in self.targets.for_spec(spec):  # the model's order: A drawn in it
            if is_expert_key(name):  # one LoRA per expert, in peft's layout
                experts, in_features, out_features = self.expert_shapes[name]
            else:
                (in_features, out_features), experts = self.shapes[name], 1
            bound = 1.0 / math.sqrt(in_features)
            a_r_in = torch.empty(experts * rank, in_features)
            a_r_in.uniform_(-bound, bound, generator=generator)
            a[name] = nn.Parameter(a_r_in.to(device))
            b[name] = nn.Parameter(torch.zeros(out_features, rank * experts, device=device))
        return LoraWeights(scale=spec.alpha / rank, A=a, B=b)


# The state each optimizer keeps per tensor, as `optimizer_state` names it.
STATE_KEYS = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "dimuon": {"momentum_buffer"}}


class TrainableLora:
    """One adapter under training: its weights, the grads accumulated since the last step and its
    AdamW state, kept together on one device, all float32 (the master weights). On a model
    computing in a narrower dtype the passes run `weights.in_dtype(...)`, a copy in that dtype
    (`compute_dtype`), and their grads are added to the masters' float32 grads
    (`training.forward_backward`); every change of the masters here refreshes the copy (`step`,
    `load`) or drops it (`move_to`, `release`).

    Its optimizer is AdamW or Dimuon (`LoraSpec.optimizer`, fixed for its life; Dimuon keeps one
    parameter group per matrix, `dimuon.Dimuon`, and a `momentum_buffer` per tensor).
    AdamW holds the tensors in two parameter groups, the A matrices and the B matrices, so a step
    can give B its own learning rate (LoRA+). Its state is per tensor and keyed by tensor name
    wherever it leaves this object (`optimizer_state`, `optimizer_tensors`, `state_tensors`), so
    the groups change no saved format; their settings are set afresh by every `step`."""

    def __init__(self, weights: LoraWeights, optimizer: str = "adamw", rank: int = 0) -> None:
        """`optimizer` is the adapter's optimizer for life (`OPTIMIZERS`); Dimuon needs `rank`
        (each LoRA matrix's, per expert) to orthogonalise an experts tensor expert by expert."""
        if optimizer not in OPTIMIZERS:
            raise ValidationError(f"unknown optimizer {optimizer!r}; use one of {OPTIMIZERS}")
        self.weights = weights
        self.kind = optimizer
        b_ids = {id(t) for t in weights.B.values()}
        params = weights.parameters()
        self.optimizer: torch.optim.Optimizer
        if optimizer == "dimuon":
            assert rank > 0, "Dimuon needs the adapter's rank"
            self.optimizer = Dimuon(
                [(a, "A", a.shape[0] // rank, rank) for a in weights.A.values()]
                + [(b, "B", b.shape[1] // rank, rank) for b in weights.B.values()]
            )
        else:
            self.optimizer = adamw(
                [p for p in params if id(p) not in b_ids], [p for p in params if id(p) in b_ids]
            )
        self.is_released = False  # its tensors are freed (paged out) until `restore`

    @property
    def device(self) -> torch.device:
        return next(iter(self.weights.A.values())).device

    def numel(self) -> int:
        """The adapter's parameters (weights only)."""
        return sum(t.numel() for t in self.weights.parameters())

    def grads(self) -> list[tuple[str, torch.Tensor]]:
        """The accumulated grad of every tensor (zeros where none yet), named as `tensors()`."""
        return [
            (name, t.grad if t.grad is not None else torch.zeros_like(t))
            for name, t in self.weights.tensors()
        ]

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite every tensor (see `LoraWeights.load`); grads and optimizer state are kept."""
        self.weights.load(arrays)
        self.weights.refresh_copy()

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """A CPU copy of the AdamW state (`step`, `exp_avg`, `exp_avg_sq`) of every tensor that
        has any yet, keyed by the tensor's peft name; empty before the first step."""
        out = {}
        for name, p in self.weights.tensors():
            state = self.optimizer.state.get(p)
            if state:
                out[name] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        return out

    def optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every AdamW state tensor, named `<tensor name>.<key>`, in a fixed order (no copies)."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, p in self.weights.tensors():
            state = self.optimizer.state.get(p, {})
            out.extend((f"{name}.{key}", state[key]) for key in sorted(state))
        return out

    def load_optimizer_state(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace the AdamW state with `state` (as `optimizer_state` gives it), exactly.
        ValidationError, changing nothing, on an unknown tensor or a misshapen entry."""
        named = dict(self.weights.tensors())
        if unknown := sorted(set(state) - set(named)):
            raise ValidationError(f"optimizer state for unknown adapter tensors {unknown}")
        want_keys = STATE_KEYS[self.kind]
        for name, entries in state.items():
            if set(entries) != want_keys:
                raise ValidationError(
                    f"optimizer state {name} holds {sorted(entries)}, not the {self.kind} state "
                    f"{sorted(want_keys)} this adapter trains with; an adapter keeps the optimizer "
                    "it was created with (load the weights without the optimizer state instead)"
                )
            shape = tuple(named[name].shape)
            for key, value in entries.items():
                want = () if key == "step" else shape
                if tuple(value.shape) != want or not torch.isfinite(value).all():
                    raise ValidationError(
                        f"optimizer state {name}.{key} has shape {list(value.shape)} or holds "
                        f"non-finite values; this adapter needs shape {list(want)}"
                    )
        groups = self.optimizer.state_dict()["param_groups"]
        # state_dict numbers the parameters in group order (A's, then B's), not tensors() order
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        number = {id(p): i for i, p in enumerate(order)}
        as_saved = {
            number[id(named[name])]: {k: v.clone() for k, v in e.items()}
            for name, e in state.items()
        }
        # load_state_dict moves moments to each parameter's device and dtype; `step` stays as is.
        self.optimizer.load_state_dict({"state": as_saved, "param_groups": groups})

    def step(self, spec: AdamSpec | DimuonSpec) -> dict[str, float]:
        """Apply the accumulated grads with the adapter's optimizer (`spec` must be its kind's
        settings), then zero them (`optim.step`, `dimuon.step`), and refresh the compute copy
        from the stepped masters. ValidationError, changing nothing, for the other kind's."""
        given = "dimuon" if isinstance(spec, DimuonSpec) else "adamw"
        if given != self.kind:
            raise ValidationError(
                f"this adapter trains with {self.kind}, not {given}; send "
                f"{'DimuonParams' if self.kind == 'dimuon' else 'AdamParams'} to optim_step"
            )
        if isinstance(spec, DimuonSpec):
            assert isinstance(self.optimizer, Dimuon)
            metrics = dimuon_step(self.optimizer, self.weights.parameters(), spec)
        else:
            metrics = adam_step(self.optimizer, self.weights.parameters(), spec)
        self.weights.refresh_copy()
        return metrics

    def move_to(self, device: torch.device) -> None:
        """Move weights, pending grads and Adam moments to `device`, in place: the parameter
        objects stay (the optimizer's state is keyed by them), so nothing is lost either way.
        Adam's step counters stay on the CPU, where AdamW keeps them. No-op if already there."""
        if _same_device(self.device, device):
            return
        self.weights.drop_copy()
        for p in self.weights.parameters():
            grad, p.grad = p.grad, None
            p.data = p.data.to(device)
            if grad is not None:
                p.grad = grad.to(device)
            state = self.optimizer.state.get(p, {})
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the training state under a stable name, without copies: the weights
        (`weight:<name>`), pending grads (`grad:<name>`, where there are any) and the AdamW state
        (`adam:<name>:<key>`, where AdamW has any yet), `<name>` as `tensors()` gives it."""
        assert not self.is_released, "the adapter is paged out; restore it first"
        out = {}
        for name, p in self.weights.tensors():
            out[f"weight:{name}"] = p.data
            if p.grad is not None:
                out[f"grad:{name}"] = p.grad
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"adam:{name}:{key}"] = value
        return out

    def release(self) -> None:
        """Free every tensor of the training state (save `state_tensors()` first). The parameter
        objects stay, so the optimizer's settings and the state's keys survive; nothing may use
        the adapter until `restore`."""
        self.weights.drop_copy()
        for p in self.weights.parameters():
            p.grad = None
            p.data = torch.empty(0, device=p.device)
            self.optimizer.state.pop(p, None)
        self.is_released = True

    def restore(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take back, as they are (same bits, same device), the tensors `state_tensors()` gave
        before `release`."""
        assert self.is_released, "restore follows release"
        adam: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("adam:"):
                name, _, part = key.removeprefix("adam:").rpartition(":")
                adam.setdefault(name, {})[part] = value
        for name, p in self.weights.tensors():
            p.data = tensors[f"weight:{name}"]
            grad = tensors.get(f"grad:{name}")
            if grad is not None:
                p.grad = grad
            if name in adam:
                self.optimizer.state[p] = adam[name]
        self.is_released = False


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` in `model` where `name` is."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal, reading a missing index ("cuda") as the current device, without initialising CUDA
    to ask which that is (the one process-wide device a worker uses)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
