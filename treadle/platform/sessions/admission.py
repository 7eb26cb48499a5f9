"""Admission by memory: whether a worker has room for one more session, from what its heartbeat
reports and the sessions the platform has placed on it (docs/operations.md, "Admission").

A worker reports its per-device `budget` (capacity_bytes, resident_adapters, pass_tokens,
sampler_kv_tokens, host_memory_bytes) and, per base model, a `footprints` entry that its engine
computed from the real modules (engine/memory/capacity.py): weight_bytes per device, LoRA
parameters per rank per category (`lora_per_rank`), pass_bytes (one training pass's activations
and logits) and kv_bytes (the sampler's KV budget). The device must hold, all at once:
  base models  every base model it holds (loaded, or with a session on it): weight_bytes each;
  sessions     its resident adapters: each training session's LoRA parameters x 16 bytes (fp32
               weights, grads, AdamW's two moments; 2 more on a bfloat16 model, the copy its
               passes run in: `adapter_copy_bytes`), the `resident_adapters` largest (0: all);
  working set  one training pass and the sampler's KV budget of the largest of its models, plus
               the pass's gradient buffers: 3 x 4 bytes x the largest adapter's parameters.
A worker that reports no footprint for a model is judged as before (its `refused` list alone).
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from treadle.platform.eventlog.schema import sessions
from treadle.platform.sessions.sessions import ACTIVE_STATUSES, ADAPTER_KINDS

__all__ = [
    "BYTES_PER_LORA_PARAMETER",
    "CATEGORIES",
    "GRADIENT_BUFFERS",
    "Budget",
    "Held",
    "budget",
    "bytes_per_lora_parameter",
    "held_by",
    "lora_parameters",
    "need_words",
    "room",
    "size",
]

# fp32 weight + its grad + AdamW's exp_avg and exp_avg_sq (lora/adapters.TrainableLora, optim).
BYTES_PER_LORA_PARAMETER = 16
# Dimuon keeps one moment (its momentum) where AdamW keeps two (engine/dimuon.py).
_OPTIMIZER_STATE_BYTES = {"adamw": 8, "dimuon": 4}
# A forward_backward holds, besides the adapter's own grads, a part's grads, their flat float32
# copy and the running sum (training.forward_backward, gradients.PairwiseSum): an estimate, as a
# deeper sum holds one more buffer per doubling of a rank's parts.
GRADIENT_BUFFERS = 3
CATEGORIES = ("attn", "mlp", "unembed")
_FLAGS = {"attn": "train_attn", "mlp": "train_mlp", "unembed": "train_unembed"}


@dataclass(frozen=True)
class Held:
    """A session as admission counts it: its kind, base model and LoRA config (rank, flags)."""

    session_id: str
    base_model: str
    kind: str
    lora_config: Mapping[str, Any]

    @property
    def has_adapter(self) -> bool:
        return self.kind in ADAPTER_KINDS and int(self.lora_config.get("rank") or 0) > 0


@dataclass(frozen=True)
class Budget:
    """A worker's device memory, per device, as admission adds it up."""

    worker_id: str
    capacity_bytes: int
    base_bytes: int  # weights of the base models it holds
    base_models: tuple[str, ...]
    session_bytes: int  # resident adapters: weights, grads, Adam moments
    sessions: int  # sessions with an adapter
    resident: int  # of which counted as resident
    working_bytes: int  # a training pass, its gradient buffers, the sampler's KV budget
    complete: bool  # every model involved has a reported footprint

    @property
    def used_bytes(self) -> int:
        return self.base_bytes + self.session_bytes + self.working_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def words(self) -> str:
        held = ", ".join(self.base_models) or "none"
        return (
            f"{self.worker_id} has {size(self.capacity_bytes)} per device: "
            f"{size(self.base_bytes)} held by base models ({held}), "
            f"{size(self.session_bytes)} by {self.resident} resident adapters of "
            f"{self.sessions} sessions, {size(self.working_bytes)} for a training pass and the "
            f"sampler's KV budget, {size(max(0, self.free_bytes))} free"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "base_bytes": self.base_bytes,
            "base_models": list(self.base_models),
            "session_bytes": self.session_bytes,
            "sessions": self.sessions,
            "resident_adapters": self.resident,
            "working_bytes": self.working_bytes,
            "free_bytes": self.free_bytes,
            "complete": self.complete,
        }


def lora_parameters(footprint: Mapping[str, Any], lora_config: Mapping[str, Any]) -> int:
    """LoRA parameters of an adapter with `lora_config` (rank, train_* flags, each true unless
    set false) on a model whose footprint reports `lora_per_rank`: rank x the sum, over the
    trained categories' linears, of in_features + out_features (A is [r, in], B is [out, r])."""
    per_rank = footprint.get("lora_per_rank") or {}
    rank = int(lora_config.get("rank") or 0)
    trained = (c for c in CATEGORIES if lora_config.get(_FLAGS[c], True))
    return rank * sum(int(per_rank.get(c, 0)) for c in trained)


def bytes_per_lora_parameter(
    footprint: Mapping[str, Any], lora_config: Mapping[str, Any] | None = None
) -> int:
    """What a trained adapter holds per LoRA parameter on a model with `footprint`: the fp32
    weight, its grad and AdamW's two moments (Dimuon's one, where `lora_config` names it), plus
    the copy its passes run in where the model's activations are narrower
    (`adapter_copy_bytes`: 2 on a bfloat16 model, 0 on float32)."""
    optimizer = str((lora_config or {}).get("optimizer", "adamw"))
    state = _OPTIMIZER_STATE_BYTES.get(optimizer, _OPTIMIZER_STATE_BYTES["adamw"])
    return 8 + state + int(footprint.get("adapter_copy_bytes") or 0)


def budget(worker_id: str, info: Mapping[str, Any], held: Sequence[Held]) -> Budget | None:
    """What `held` (the worker's active sessions, a candidate included) take of the worker's
    device memory; None when its heartbeat reports no budget (a worker judged as before)."""
    limits = info.get("budget")
    if not isinstance(limits, Mapping):
        return None
    footprints: Mapping[str, Any] = info.get("footprints") or {}
    models = sorted(set(info.get("loaded_models") or ()) | {h.base_model for h in held})
    complete = all(m in footprints for m in models)
    prints = [footprints[m] for m in models if m in footprints]
    parameters = [
        (lora_parameters(footprints[h.base_model], h.lora_config), footprints[h.base_model], h)
        for h in held
        if h.has_adapter and h.base_model in footprints
    ]
    adapters = sorted(
        (n * bytes_per_lora_parameter(f, h.lora_config) for n, f, h in parameters), reverse=True
    )
    limit = int(limits.get("resident_adapters") or 0)
    resident = adapters if limit <= 0 else adapters[:limit]
    largest = max((n for n, _, _ in parameters), default=0)
    pass_and_kv = max((int(f.get("pass_bytes", 0)) + int(f.get("kv_bytes", 0)) for f in prints),
                      default=0)  # fmt: skip
    return Budget(
        worker_id=worker_id,
        capacity_bytes=int(limits.get("capacity_bytes", 0)),
        base_bytes=sum(int(f.get("weight_bytes", 0)) for f in prints),
        base_models=tuple(models),
        session_bytes=sum(resident),
        sessions=len(adapters),
        resident=len(resident),
        working_bytes=pass_and_kv + GRADIENT_BUFFERS * 4 * largest if prints else 0,
        complete=complete,
    )


def room(
    worker_id: str, info: Mapping[str, Any], held: Sequence[Held], new: Held
) -> tuple[str | None, Budget | None]:
    """Why the worker has no room for `new` beside `held` (the numbers: what it has, what its
    sessions and base models hold, what `new` needs), or None if it has room or cannot be
    judged (no budget reported, or a model without a footprint yet); and its budget now."""
    held = [h for h in held if h.session_id != new.session_id]  # a resent create
    now = budget(worker_id, info, held)
    after = budget(worker_id, info, [*held, new])
    if now is None or after is None or not after.complete:
        return None, now
    if after.used_bytes <= after.capacity_bytes:
        return None, now
    return f"{now.words()}; with this session it would need {size(after.used_bytes)}", now


def need_words(info: Mapping[str, Any] | None, new: Held) -> str:
    """What `new` needs, in words, from a worker's footprint of its base model."""
    footprint = ((info or {}).get("footprints") or {}).get(new.base_model)
    if not new.has_adapter or footprint is None:
        return f"a session on {new.base_model}"
    flags = [c for c in CATEGORIES if new.lora_config.get(_FLAGS[c], True)]
    n = lora_parameters(footprint, new.lora_config)
    per = bytes_per_lora_parameter(footprint, new.lora_config)
    copy = ", and the copy its passes run in" if footprint.get("adapter_copy_bytes") else ""
    moments = (
        "Dimuon's momentum"
        if new.lora_config.get("optimizer") == "dimuon"
        else "AdamW's two moments"
    )
    return (
        f"a rank-{new.lora_config.get('rank')} LoRA session on {new.base_model} training "
        f"{', '.join(flags)} ({n:,} LoRA parameters x {per} bytes = "
        f"{size(n * per)} for fp32 weights, grads and {moments}{copy})"
    )


def held_by(conn: sa.Connection, worker_ids: Iterable[str]) -> dict[str, list[Held]]:
    """The active sessions leased to each of `worker_ids`, as admission counts them."""
    ids = list(worker_ids)
    out: dict[str, list[Held]] = {w: [] for w in ids}
    if not ids:
        return out
    rows = conn.execute(
        sa.select(
            sessions.c.id, sessions.c.worker_id, sessions.c.base_model, sessions.c.kind,
            sessions.c.lora_config,
        ).where(sessions.c.worker_id.in_(ids), sessions.c.status.in_(ACTIVE_STATUSES))
        .order_by(sessions.c.id)
    ).all()  # fmt: skip
    for row in rows:
        out[row.worker_id].append(
            Held(row.id, row.base_model, row.kind, dict(row.lora_config or {}))
        )
    return out


def size(n: int) -> str:
    """Bytes for a message: GiB from 1 GiB, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
