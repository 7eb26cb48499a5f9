"""What each loss takes: its float inputs (besides `target_tokens`) and its `loss_fn_config`
keys with default and accepted range. The API validates against it; the engine builds its loss
functions from it, so there is one source of truth. Formulas: reference/semantics.md.
Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from treadle.platform.errors import ValidationError

__all__ = ["LOSS_SPECS", "LossSpec", "get_loss_spec", "resolve_config"]


@dataclass(frozen=True)
class LossSpec:
    name: str
    float_inputs: tuple[str, ...]
    # key -> (default, lowest, highest), the range inclusive
    config: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ("target_tokens", *self.float_inputs)


_RL_INPUTS = ("logprobs", "advantages")
# Clip ranges as SageMaker accepts them: low in [0, 1], high in [1, 10].
_CLIP = {"clip_low_threshold": (0.8, 0.0, 1.0), "clip_high_threshold": (1.2, 1.0, 10.0)}

LOSS_SPECS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("weights",)),
        LossSpec("importance_sampling", _RL_INPUTS),
        LossSpec("ppo", _RL_INPUTS, _CLIP),
        LossSpec("cispo", _RL_INPUTS, _CLIP),
        LossSpec("dro", _RL_INPUTS, {"beta": (0.05, 0.0, float("inf"))}),
    )
}


def get_loss_spec(name: str) -> LossSpec:
    """The loss called `name`; ValidationError listing the known ones otherwise."""
    try:
        return LOSS_SPECS[name]
    except KeyError:
        known = ", ".join(sorted(LOSS_SPECS))
        raise ValidationError(f"unknown loss_fn {name!r}; choose one of: {known}") from None


def resolve_config(spec: LossSpec, config: Mapping[str, float] | None) -> dict[str, float]:
    """`config` completed with the loss's defaults; unknown keys and out-of-range values raise."""
    given = dict(config or {})
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        accepted = ", ".join(sorted(spec.config)) or "none"
        raise ValidationError(
            f"loss_fn_config has unknown keys {unknown} for {spec.name}; accepted keys: {accepted}"
        )
    resolved = {key: default for key, (default, _, _) in spec.config.items()}
    for key, value in given.items():
        _, low, high = spec.config[key]
        if not (math.isfinite(value) and low <= value <= high):
            bound = f"at least {low}" if high == math.inf else f"between {low} and {high}"
            raise ValidationError(
                f"loss_fn_config[{key!r}] = {value} is out of range for {spec.name}; "
                f"it must be {bound}"
            )
        resolved[key] = float(value)
    if resolved.get("clip_low_threshold", 0.0) > resolved.get("clip_high_threshold", 1.0):
        raise ValidationError(
            f"clip_low_threshold ({resolved['clip_low_threshold']}) must not exceed "
            f"clip_high_threshold ({resolved['clip_high_threshold']})"
        )
    return resolved
