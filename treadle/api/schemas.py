"""Request bodies of the JSON routes, as pydantic models (unknown fields are ignored, as the
Tinker protocol's evolving clients expect). Parsing failures become a 400 naming the field.
Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from treadle.platform.errors import ValidationError

MAX_ID = 2**62  # seq ids and counters fit a BIGINT with room to spare
MAX_TTL = 10 * 365 * 24 * 3600


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class CreateSession(Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] = Field(default_factory=dict)


class SessionRef(Body):
    session_id: str


class FinishSession(Body):
    reason: dict[str, Any] = Field(default_factory=dict)
    detail: str | None = None


class LoraConfig(Body):
    rank: int = Field(32, ge=1, le=512)
    alpha: float | None = Field(None, gt=0)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(Body):
    session_id: str
    model_seq_id: int = Field(ge=0, le=MAX_ID)
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig = Field(default_factory=lambda: LoraConfig())
    training_session_name: str | None = None
    model_package_group: str | None = None


class ModelRef(Body):
    model_id: str


class AdamParams(Body):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStep(Body):
    model_id: str
    seq_id: int = Field(ge=1, le=MAX_ID)
    adam_params: AdamParams = Field(default_factory=lambda: AdamParams())
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsForSampler(Body):
    model_id: str
    seq_id: int = Field(ge=1, le=MAX_ID)
    path: str | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0, le=MAX_ID)
    kind: str | None = None
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)
    merge_weights: bool = False


class SaveWeights(Body):
    model_id: str
    seq_id: int = Field(ge=1, le=MAX_ID)
    path: str
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)
    overwrite: bool = False


class LoadWeights(Body):
    path: str
    optimizer: bool = False
    # create-via-load (create_training_client_from_state[_with_optimizer])
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0, le=MAX_ID)
    base_model: str | None = None
    # legacy load_state into an existing model
    model_id: str | None = None
    seq_id: int | None = Field(None, ge=1, le=MAX_ID)


class CheckpointTtl(Body):
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)


class WeightsInfo(Body):
    tinker_path: str


class CreateSamplingSession(Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0, le=MAX_ID)
    base_model: str | None = None
    model_path: str | None = None


class Chunk(Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInput(Body):
    chunks: list[Chunk]


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=1, le=MAX_ID)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class Sample(Body):
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int = Field(0, ge=0, le=MAX_ID)
    num_samples: int = Field(1, ge=1, le=128)
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=lambda: SamplingParams())
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_ID)
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_ID)
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_ID)
    prompt_logprobs_last_n: int | None = None


class RetrieveFuture(Body):
    request_id: str
    allow_metadata_only: bool = False


class CreateTenant(Body):
    id: str
    name: str | None = None
    role: Literal["admin", "member"] = "member"


B = TypeVar("B", bound=Body)


def reject_nul(value: Any, where: str = "body") -> None:
    """PostgreSQL text cannot hold NUL; no identifier or name of ours may contain it."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValidationError(f"{where} contains a NUL character; remove it")
    elif isinstance(value, dict):
        for key, item in value.items():
            reject_nul(key, where)
            reject_nul(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            reject_nul(item, f"{where}[{i}]")


def parse(model: type[B], payload: Any) -> B:
    """Validate a JSON body; a failure is a 400 that names each bad field."""
    if not isinstance(payload, dict):
        raise ValidationError("the request body must be a JSON object")
    reject_nul(payload)
    try:
        return model.model_validate(payload)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise ValidationError(f"invalid {model.__name__} request: {problems}") from None
