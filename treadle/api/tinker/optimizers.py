"""The optimizer a Tinker training model is created with, and the optimizer step it is sent.

Translates tinker's `optimizer_config` (AdamOptimizerConfig, DimuonOptimizerConfig) into the name
the session's `lora_config` records (absent for AdamW), back into the `optimizer_config` that
get_info and weights_info answer with, and an optim_step body (`adam_params` or
`optimizer_params`) into the logged `OptimStep`. Imports platform only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError as PydanticError

from treadle.api.tinker.schemas import DimuonParams, OptimizerConfig, OptimStep
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import optypes

__all__ = ["config_json", "name_of", "optim_step_payload", "session_optimizer", "with_optimizer"]

# tinker's optimizer_config `type` -> the version each accepts (None: any or none)
_VERSIONS: dict[str, int | None] = {"adamw": None, "dimuon": 1}


def name_of(config: OptimizerConfig | None) -> str:
    """The optimizer `config` selects ("adamw" when None); a 400 for one not served."""
    if config is None:
        return "adamw"
    if config.type not in _VERSIONS:
        raise ValidationError(
            f"optimizer_config.type {config.type!r} is not served; use AdamOptimizerConfig "
            "('adamw') or DimuonOptimizerConfig ('dimuon')"
        )
    want = _VERSIONS[config.type]
    if want is not None and config.version not in (None, want):
        raise ValidationError(
            f"optimizer_config {config.type!r} version {config.version} is not served; this "
            f"server runs version {want}"
        )
    return config.type


def session_optimizer(lora_config: Mapping[str, Any]) -> str:
    """The optimizer a session's recorded `lora_config` trains with."""
    return str(lora_config.get("optimizer", "adamw"))


def with_optimizer(lora_config: Mapping[str, Any], optimizer: str) -> dict[str, Any]:
    """`lora_config` training with `optimizer` (recorded only where it is not AdamW)."""
    out = {k: v for k, v in lora_config.items() if k != "optimizer"}
    if optimizer != "adamw":
        out["optimizer"] = optimizer
    return out


def config_json(lora_config: Mapping[str, Any]) -> dict[str, Any]:
    """The `optimizer_config` tinker's GetInfoResponse / WeightsInfoResponse carry."""
    name = session_optimizer(lora_config)
    return {"type": "dimuon", "version": 1} if name == "dimuon" else {"type": "adamw"}


def optim_step_payload(body: OptimStep, raw: Mapping[str, Any]) -> optypes.OptimStep:
    """The logged step for an optim_step body: `adam_params` (AdamW) or `optimizer_params`
    (DimuonParams); a 400 saying what to send for anything else."""
    params = body.optimizer_params
    if params is None:
        return optypes.OptimStep(**body.adam_params.model_dump())
    if raw.get("adam_params") is not None:
        raise ValidationError("send adam_params or optimizer_params, not both")
    kind = params.get("type")
    if kind != "dimuon":
        raise ValidationError(
            f"optimizer_params.type {kind!r} is not served; send DimuonParams (type 'dimuon') "
            "to a model created with DimuonOptimizerConfig, or adam_params to an AdamW one"
        )
    try:
        dimuon = DimuonParams.model_validate(params)
    except PydanticError as exc:
        problems = "; ".join(
            f"optimizer_params.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors()
        )
        raise ValidationError(
            f"invalid DimuonParams: {problems} (fields: learning_rate, beta1, grad_clip_norm)"
        ) from None
    return optypes.OptimStep(
        optimizer="dimuon",
        learning_rate=dimuon.learning_rate,
        beta1=dimuon.beta1,
        grad_clip_norm=dimuon.grad_clip_norm,
    )
