"""What each loss takes: its float inputs (besides `target_tokens`), the optional ones with the
value a datum that omits them gets, its `loss_fn_config` keys with default and accepted range,
and which of those keys a datum may also give per token as a `loss_fn_inputs` tensor. The API
validates against it; the engine builds its loss functions from it, so there is one source of
truth. Formulas and sources: docs/losses-and-sampling.md.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from treadle.platform.errors import ValidationError

__all__ = [
    "LOSS_SPECS",
    "RECORDED_INPUTS",
    "UNSERVED_LOSSES",
    "LossSpec",
    "check_config_values",
    "get_loss_spec",
    "resolve_config",
]


@dataclass(frozen=True)
class LossSpec:
    name: str
    float_inputs: tuple[str, ...]
    # key -> (default, lowest, highest), the range inclusive
    config: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    # config keys a datum may also send as a float32 [T] loss_fn_inputs tensor, one value per
    # token, overriding loss_fn_config for that datum (the tinker SDK types these inputs)
    per_token_config: tuple[str, ...] = ()
    # float32 [T] inputs a datum may omit -> the value every token gets when it does (the RL
    # losses' per-token `weights` mask, which SageMaker's API sends: absent, every token weighs 1)
    optional_inputs: Mapping[str, float] = field(default_factory=dict)
    # float inputs that must mark (hold a nonzero value at) at least one token of each datum
    nonzero_inputs: tuple[str, ...] = ()
    # loss_fn_inputs a datum may send that this loss does not read (stable_reinforce takes the
    # sampler's logprobs from the platform's record, not from the `logprobs` the client sends)
    ignored_inputs: tuple[str, ...] = ()
    # Whether the loss reads the datum's provenance: every datum must name recorded sequences
    # (Datum.with_provenance), which the API checks and resolves into RECORDED_INPUTS.
    reads_provenance: bool = False
    # inputs a datum may send as [T, K] instead of [T] (all of them the same shape, K >= 1):
    # cross_entropy's top-K targets, -sum_t sum_k w_tk * lp(x_tk), with [T, K] logprobs out
    rank2_inputs: tuple[str, ...] = ()

    @property
    def inputs(self) -> tuple[str, ...]:
        """The loss_fn_inputs every datum must carry."""
        return ("target_tokens", *self.float_inputs)

    @property
    def accepted_inputs(self) -> tuple[str, ...]:
        """Every loss_fn_inputs name a datum may send: the required ones, then the optional."""
        return (*self.inputs, *self.optional_inputs, *self.per_token_config, *self.ignored_inputs)

    @property
    def tensor_inputs(self) -> tuple[str, ...]:
        """The per-token float arrays the loss computes with, besides `target_tokens`."""
        recorded = RECORDED_INPUTS if self.reads_provenance else ()
        return (*self.float_inputs, *self.optional_inputs, *self.per_token_config, *recorded)


# Per target token, from the sequences the datum's provenance names: the sampler's own logprob
# (0 where the target was not sampled) and whether it was sampled (1) or a prompt token (0).
RECORDED_INPUTS = ("sampler_logprobs", "sampled_mask")

_RL_INPUTS = ("logprobs", "advantages")
# A per-token mask on the loss (each token's term times its weight); omitted, every weight is 1.
_WEIGHTS = {"weights": 1.0}
# Clip ranges as SageMaker accepts them: low in [0, 1], high in [1, 10].
_CLIP = {"clip_low_threshold": (0.8, 0.0, 1.0), "clip_high_threshold": (1.2, 1.0, 10.0)}
_CLIP_KEYS = tuple(_CLIP)

LOSS_SPECS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("weights",), rank2_inputs=("target_tokens", "weights")),
        LossSpec("importance_sampling", _RL_INPUTS, optional_inputs=_WEIGHTS),
        LossSpec("ppo", _RL_INPUTS, _CLIP, per_token_config=_CLIP_KEYS, optional_inputs=_WEIGHTS),
        LossSpec("cispo", _RL_INPUTS, _CLIP, per_token_config=_CLIP_KEYS, optional_inputs=_WEIGHTS),
        LossSpec("dro", _RL_INPUTS, {"beta": (0.05, 0.0, float("inf"))}),
        LossSpec(
            "gspo",
            (*_RL_INPUTS, "sequence_ratio_mask"),
            _CLIP,
            per_token_config=_CLIP_KEYS,
            nonzero_inputs=("sequence_ratio_mask",),
        ),
        # Treadle's definition (docs/losses-and-sampling.md): REINFORCE on the sampled tokens,
        # each weighted by its importance ratio against the recorded sampler logprob,
        # truncated at truncation_threshold and masked (0) outside [mask_low, mask_high] (their
        # ranges meet at 1, so low never exceeds high).
        LossSpec(
            "stable_reinforce",
            ("advantages",),
            {
                "truncation_threshold": (2.0, 1.0, 100.0),
                "mask_low_threshold": (0.0, 0.0, 1.0),
                "mask_high_threshold": (10.0, 1.0, 1000.0),
            },
            ignored_inputs=("logprobs",),
            reads_provenance=True,
        ),
    )
}

# Names the tinker SDK's LossFnType lists that this server refuses, and why (a 400 naming them).
UNSERVED_LOSSES: dict[str, str] = {
    "custom": (
        "loss_fn 'custom' runs a loss made with ServiceClient.create_custom_loss and needs "
        "its loss_fn_config['loss_id']: pass the LossHandle to forward_backward_custom "
        "(Tinker protocol only), or a Python function, which runs the loss on the client"
    ),
}


def get_loss_spec(name: str) -> LossSpec:
    """The loss called `name`; ValidationError naming it and listing the known ones otherwise."""
    if name in UNSERVED_LOSSES:
        raise ValidationError(UNSERVED_LOSSES[name])
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
        check_config_values(spec, key, [value], where=f"loss_fn_config[{key!r}]")
        resolved[key] = float(value)
    if resolved.get("clip_low_threshold", 0.0) > resolved.get("clip_high_threshold", 1.0):
        raise ValidationError(
            f"clip_low_threshold ({resolved['clip_low_threshold']}) must not exceed "
            f"clip_high_threshold ({resolved['clip_high_threshold']})"
        )
    return resolved


def check_config_values(spec: LossSpec, key: str, values: Iterable[float], *, where: str) -> None:
    """Every value of config key `key` (one, or a per-token list) finite and inside its range;
    ValidationError naming `where` and the accepted range otherwise."""
    _, low, high = spec.config[key]
    for value in values:
        number = float(value)
        if not (math.isfinite(number) and low <= number <= high):
            bound = f"at least {low}" if high == math.inf else f"between {low} and {high}"
            raise ValidationError(
                f"{where} = {number} is out of range for {spec.name}; it must be {bound}"
            )
