"""The runtime's operations as Treadle's: an OperationConfig / SampleOperationConfig (already
checked against the service model) becomes the platform's typed payload, and a settled
operation's result becomes the runtime's OperationResult member.

Datums: a `modelInput`'s chunks are concatenated; `lossFnInputs` are the per-token tensors the
loss reads, `target_tokens` int64 and the rest float32 whatever dtype was sent (the SageMaker
SDK sends token ids as float32 when a TensorData names no dtype). `weights` masks each token's term of ppo, cispo and
importance_sampling as it weighs cross_entropy's. `ref_log_prob` and `temperature`, which the
service model lists, are refused by name: Treadle computes no reference-model term and scores
at temperature 1. Samples: `promptLogprobs` leaves out the first prompt token (it has none), so
it holds len(prompt) - 1 numbers; `computeLogprobs` keeps it as a leading null, as the SDK
expects. Imports platform only; never torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from treadle.platform.checkpoints import checkpoints
from treadle.platform.errors import ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.eventlog.results import ForwardBackwardOutput, OptimStepOutput, SampleOutput
from treadle.platform.models import validation
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.sagemaker.packages import Package
from treadle.platform.sagemaker.runtime_ops import Kind
from treadle.platform.sessions.sessions import SessionRow

# The lossFnInputs keys the service model's documentation allows.
DATUM_KEYS = ("target_tokens", "weights", "advantages", "logprobs", "ref_log_prob", "temperature")
UNSERVED_KEYS = {
    "ref_log_prob": (
        "a reference model's logprobs (for a KL term) are not used by this server's losses; "
        "remove it, or fold the KL penalty into the advantages"
    ),
    "temperature": (
        "this server scores tokens at temperature 1; remove it (sample at any temperature and "
        "send the sampler's logprobs as `logprobs`)"
    ),
}
DTYPES = ("float32", "float16", "bfloat16", "int32", "int64")
# SageMaker's AdamParams defaults (its SDK sends all five; a raw client may not).
ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weightDecay": 0.01}


def checkpoint_path(session: SessionRow, kind: Kind, seq_id: int) -> checkpoints.CheckpointPath:
    """Where a save at `seq_id` is written: `weights/state-<seq>` for saveState (resumable),
    `sampler_weights/weights-<seq>` for saveWeights."""
    if kind == Kind.SAVE_STATE:
        return checkpoints.CheckpointPath(session.id, "weights", f"state-{seq_id:06d}")
    return checkpoints.CheckpointPath(session.id, "sampler_weights", f"weights-{seq_id:06d}")


def training_payload(
    kind: Kind, config: Mapping[str, Any], session: SessionRow, model: BaseModelInfo, seq_id: int
) -> optypes.Payload:
    """The payload of a training operation (all but loadState, see `load_state`)."""
    if kind in (Kind.FORWARD, Kind.FORWARD_BACKWARD):
        return forward_backward(config, model, forward_only=kind == Kind.FORWARD)
    if kind == Kind.OPTIMIZER_STEP:
        adam = {**ADAM_DEFAULTS, **config["adamParamsConfig"]}
        return optypes.OptimStep(
            learning_rate=adam["learningRate"],
            beta1=adam["beta1"],
            beta2=adam["beta2"],
            eps=adam["eps"],
            weight_decay=adam["weightDecay"],
            grad_clip_norm=adam.get("gradClipNorm", 0.0),
            lora_plus_lr_ratio=adam.get("loraPlusLrRatio", 1.0),
        )
    path = checkpoint_path(session, kind, seq_id)
    return optypes.SaveWeights(
        path=str(path),
        prefix=checkpoints.storage_prefix(session.tenant_id, path),
        ttl_seconds=None,
        with_optimizer=kind == Kind.SAVE_STATE,
        merge_weights=bool(config.get("mergeWeights", False)),
        description=config.get("description") or None,
    )


def load_state(package: Package, session: SessionRow, load_optimizer: bool) -> optypes.LoadWeights:
    """loadState of `package` into the session: a saveState package of the same base model."""
    checkpoint = package.checkpoint
    if not package.is_checkpoint:
        raise ValidationError(
            "modelPackageArn names a package of weights for sampling (saved by saveWeights), "
            "which holds no training state; load a package saved by saveState"
        )
    if package.base_model != session.base_model:
        raise ValidationError(
            f"the package was trained on {package.base_model}; this session trains "
            f"{session.base_model}"
        )
    if load_optimizer and not checkpoint.has_optimizer:
        raise ValidationError("the package has no optimizer state; load it without the optimizer")
    return optypes.LoadWeights(
        path=str(checkpoint.path),
        prefix=checkpoint.storage_prefix,
        optimizer=load_optimizer,
        base_model=session.base_model,
        lora_config=optypes.LoraConfig(**session.lora_config),
    )


def forward_backward(
    config: Mapping[str, Any], model: BaseModelInfo, *, forward_only: bool
) -> optypes.ForwardBackward:
    raw_config = config.get("lossFnConfig") or {}
    if not isinstance(raw_config, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in raw_config.values()
    ):
        raise ValidationError(
            "lossFnConfig must be an object of numbers, e.g. "
            '{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}'
        )
    payload: dict[str, Any] = {
        "loss_fn": config["lossFnName"],
        "loss_fn_config": {k: float(v) for k, v in raw_config.items()},
        "forward_only": forward_only,
        "data": [_datum(i, d) for i, d in enumerate(config["datumList"])],
    }
    _, payload["loss_fn_config"] = validation.validate_forward_backward(payload, model)
    return optypes.ForwardBackward.model_validate(payload)


def _datum(i: int, datum: Mapping[str, Any]) -> dict[str, Any]:
    tokens = [t for chunk in datum["modelInput"]["chunks"] for t in chunk["tokens"]]
    inputs = {}
    for name, tensor in (datum.get("lossFnInputs") or {}).items():
        if name not in DATUM_KEYS:
            raise ValidationError(
                f"datumList[{i}].lossFnInputs has {name!r}; the accepted keys are "
                f"{', '.join(DATUM_KEYS)}"
            )
        if name in UNSERVED_KEYS:
            raise ValidationError(f"datumList[{i}].lossFnInputs[{name!r}]: {UNSERVED_KEYS[name]}")
        inputs[name] = _tensor(f"datumList[{i}].lossFnInputs[{name!r}]", name, tensor)
    return {"tokens": tokens, "loss_fn_inputs": inputs}


def _tensor(where: str, name: str, tensor: Mapping[str, Any]) -> dict[str, Any]:
    """A per-token input as the platform keeps it: int64 token ids, float32 anything else. Any
    of the service's dtypes is taken (the SageMaker SDK sends a TensorData built without a dtype
    as float32, token ids included), so long as each id is a whole number."""
    data, dtype = tensor["data"], tensor["dtype"]
    is_ids = name == "target_tokens"
    if dtype not in DTYPES:
        raise ValidationError(f"{where}.dtype is {dtype!r}; send one of {', '.join(DTYPES)}")
    if not isinstance(data, list):
        raise ValidationError(f"{where}.data must be a flat list of numbers")
    for value in data:
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if is_number and isinstance(value, float) and not math.isfinite(value):
            is_number = False
        if not is_number or (is_ids and value != int(value)):
            kind = "a whole-number token id" if is_ids else "a finite number"
            raise ValidationError(
                f"{where}.data holds {str(value)[:40]}; each entry must be {kind}"
            )
    shape = tensor.get("shape")
    if shape is not None and shape != [len(data)]:
        raise ValidationError(
            f"{where}.shape is {shape} for {len(data)} values; send a flat [n] tensor, one value "
            "per model input token"
        )
    return {
        "dtype": "int64" if is_ids else "float32",
        "shape": [len(data)],
        "data": [int(v) for v in data] if is_ids else [float(v) for v in data],
    }


def prompt_tokens(model_input: Mapping[str, Any]) -> list[int]:
    return [t for chunk in model_input["chunks"] for t in chunk["tokens"]]


def sample(
    config: Mapping[str, Any],
    model: BaseModelInfo,
    *,
    snapshot_id: str | None,
    checkpoint_prefix: str | None,
) -> optypes.Sample:
    tokens = prompt_tokens(config["prompt"])
    params = config["samplingParams"]
    num_samples, max_tokens = config["numSamples"], params["maxTokens"]
    if num_samples > validation.MAX_NUM_SAMPLES:
        raise ValidationError(
            f"numSamples is {num_samples}; this server samples at most "
            f"{validation.MAX_NUM_SAMPLES} per operation: send several operations"
        )
    if num_samples * max_tokens > validation.MAX_SAMPLE_TOKENS:
        raise ValidationError(
            f"numSamples x maxTokens = {num_samples * max_tokens} tokens; one operation samples "
            f"at most {validation.MAX_SAMPLE_TOKENS}: lower either, or send several operations"
        )
    temperature = params.get("temperature", 1.0)
    if 0 < temperature < validation.MIN_TEMPERATURE:
        raise ValidationError(
            f"temperature {temperature} is below {validation.MIN_TEMPERATURE}; use 0 for greedy "
            "decoding"
        )
    top_k = params.get("topK", -1)
    if top_k < -1:
        raise ValidationError(f"topK is {top_k}; use -1 (no limit) or a positive number")
    seed = params.get("seed")
    if seed is not None and seed < 0:
        raise ValidationError(f"seed is {seed}; use a seed of 0 or more")
    stop = params.get("stop")
    if stop is not None and (
        len(stop) > validation.MAX_STOP or any(len(s) > validation.MAX_STOP_LENGTH for s in stop)
    ):
        raise ValidationError(
            f"stop holds at most {validation.MAX_STOP} strings of at most "
            f"{validation.MAX_STOP_LENGTH} characters each"
        )
    topk = config.get("topkPromptLogprobs") or 0
    if not 0 <= topk <= validation.MAX_TOPK_LOGPROBS:
        raise ValidationError(
            f"topkPromptLogprobs is {topk}; it must be between 0 and {validation.MAX_TOPK_LOGPROBS}"
        )
    validation.validate_prompt(tokens, model, max_tokens)
    return optypes.Sample(
        prompt=tokens,
        snapshot_id=snapshot_id,
        checkpoint_prefix=checkpoint_prefix,
        num_samples=num_samples,
        prompt_logprobs=bool(config.get("includePromptLogprobs")) or topk > 0,
        topk_prompt_logprobs=topk,
        params=optypes.SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            # top_p 0 keeps only the likeliest token, which the sampler's smallest top_p does
            top_p=max(params.get("topP", 1.0), validation.MIN_TOP_P),
            seed=seed,
            stop=stop or None,
        ),
    )


def compute_logprobs(
    config: Mapping[str, Any],
    model: BaseModelInfo,
    *,
    snapshot_id: str | None,
    checkpoint_prefix: str | None,
) -> optypes.Sample:
    """Each prompt token's logprob: a one-token sample with prompt logprobs, as the tinker SDK's
    compute_logprobs asks for it (and is metered the same)."""
    tokens = prompt_tokens(config["prompt"])
    validation.validate_prompt(tokens, model, 1)
    return optypes.Sample(
        prompt=tokens,
        snapshot_id=snapshot_id,
        checkpoint_prefix=checkpoint_prefix,
        num_samples=1,
        prompt_logprobs=True,
        params=optypes.SamplingParams(max_tokens=1),
    )


# --- results -------------------------------------------------------------------------------


def training_result(
    kind: Kind, stored: Mapping[str, Any], package_arn: str | None
) -> dict[str, Any]:
    """The OperationResult union of a completed training operation whose stored result is
    `stored`."""
    if kind in (Kind.FORWARD, Kind.FORWARD_BACKWARD):
        result = ForwardBackwardOutput.model_validate(stored)
        outputs = [
            {name: _tensor_out(t) for name, t in per_datum.items()}
            for per_datum in result.loss_fn_outputs
        ]
        return {kind.value: {"metrics": dict(result.metrics), "lossFnOutputs": outputs}}
    if kind == Kind.OPTIMIZER_STEP:
        return {kind.value: {"metrics": dict(OptimStepOutput.model_validate(stored).metrics)}}
    if kind in (Kind.SAVE_WEIGHTS, Kind.SAVE_STATE):
        return {kind.value: {"modelPackageArn": package_arn}}
    return {kind.value: {}}


def _tensor_out(tensor: optypes.Tensor) -> dict[str, Any]:
    return {"data": tensor.data, "dtype": tensor.dtype, "shape": tensor.shape}


def sampling_result(kind: Kind, stored: Mapping[str, Any]) -> dict[str, Any]:
    """The SampleOperationResult union of a completed sampling operation whose stored result is
    `stored`."""
    if kind == Kind.LOAD_WEIGHTS_FOR_SAMPLING:
        return {kind.value: {}}
    result = SampleOutput.model_validate(stored)
    if kind == Kind.COMPUTE_LOGPROBS:
        return {kind.value: {"logprobs": list(result.prompt_logprobs or [])}}
    answer: dict[str, Any] = {
        "sequences": [
            {"stopReason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs}
            for s in result.sequences
        ]
    }
    if result.prompt_logprobs is not None:
        answer["promptLogprobs"] = [lp for lp in result.prompt_logprobs[1:] if lp is not None]
    if result.topk_prompt_logprobs is not None:
        answer["topkPromptLogprobs"] = [
            [{"tokenId": t, "logprob": lp} for t, lp in row]
            for row in result.topk_prompt_logprobs[1:]
        ]
    return {kind.value: answer}
