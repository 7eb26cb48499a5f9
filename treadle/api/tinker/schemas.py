"""Request bodies of the Tinker protocol's JSON routes, as pydantic models (`body.Body`: unknown
fields are ignored, as the protocol's evolving clients expect). Parsing failures become a 400
naming the field.

Every field is bounded (limits in platform.validation, listed in docs/api.md): ids and names in
length, integers in range (seeds fit 64 bits), sampling parameters within what the worker can
do, user_metadata and tags in size; numbers are finite. Bodies reach `parse` through
`body.read_json`, which has already bounded their nesting, size and number literals.
Imports platform only; never torch.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from treadle.api.body import MAX_ID, MAX_TTL, Body, Id
from treadle.platform.models.validation import (
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_METADATA_KEYS,
    MAX_NUM_SAMPLES,
    MAX_PROMPT_ALT_TOKENS_K,
    MAX_SAMPLE_TOKENS,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_LENGTH,
    MAX_TAG_LENGTH,
    MAX_TAGS,
    MAX_TARGET_PROMPT_CELLS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOP_K,
    MAX_TOPK_LOGPROBS,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)
from treadle.platform.models.vision import MAX_IMAGE_BYTES

MAX_DETAIL_LENGTH = 4096


def _metadata(value: dict[str, Any]) -> dict[str, Any]:
    """user_metadata: a small JSON object of finite numbers, strings, booleans and nulls."""
    if len(value) > MAX_METADATA_KEYS:
        raise ValueError(f"{len(value)} keys; send at most {MAX_METADATA_KEYS}")
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_METADATA_BYTES:  # checked first: it bounds the walk below
        raise ValueError(
            f"{size} bytes as JSON; at most {MAX_METADATA_BYTES} are allowed: keep large data "
            "elsewhere and store a reference to it"
        )
    stack: list[tuple[str, Any, int]] = [("user_metadata", value, 1)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, dict | list) and depth > MAX_METADATA_DEPTH:
            raise ValueError(
                f"{path} nests objects and arrays {depth} levels deep; at most "
                f"{MAX_METADATA_DEPTH} are allowed"
            )
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{path} is {item}; numbers must be finite")
        if isinstance(item, dict):
            stack.extend((f"{path}.{k}", v, depth + 1) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v, depth + 1) for i, v in enumerate(item))
    return value


def _finish_reason(value: dict[str, Any]) -> dict[str, Any]:
    kind = value.get("type", "success")
    if not isinstance(kind, str) or len(kind) > 64:
        raise ValueError("reason.type must be a short string such as 'success' or 'errored'")
    return value


def _temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(
            f"{value} is below {MIN_TEMPERATURE}; use 0 for greedy decoding, or a temperature "
            f"between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}"
        )
    return value


def _stop(value: str | list[str] | list[int] | None) -> str | list[str] | list[int] | None:
    items: list[str] | list[int] = [value] if isinstance(value, str) else value or []
    if len(items) > MAX_STOP:
        raise ValueError(f"{len(items)} entries; send at most {MAX_STOP}")
    for item in items:
        if isinstance(item, str) and len(item) > MAX_STOP_LENGTH:
            raise ValueError(
                f"a stop string of {len(item)} characters; each has at most {MAX_STOP_LENGTH}"
            )
        if isinstance(item, int) and not 0 <= item <= MAX_TOKEN_ID:
            raise ValueError(f"stop token id {item} is not a token id; ids are in [0, 2**31)")
    return value


def _top_p(value: float) -> float:
    if not MIN_TOP_P <= value <= 1:
        raise ValueError(
            f"{value} is outside [{MIN_TOP_P}, 1]; a top_p of {MIN_TOP_P} (or top_k=1) already "
            "keeps only the likeliest token, and 1 keeps them all"
        )
    return value


Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]  # unsigned 64-bit
Metadata = Annotated[dict[str, Any], AfterValidator(_metadata)]
Tag = Annotated[str, Field(max_length=MAX_TAG_LENGTH)]


class CreateSession(Body):
    tags: list[Tag] = Field(default_factory=list, max_length=MAX_TAGS)
    user_metadata: Metadata = Field(default_factory=dict)
    display_name: Id | None = None


class SessionRef(Body):
    session_id: Id


class FinishSession(Body):
    reason: Annotated[dict[str, Any], AfterValidator(_finish_reason)] = Field(default_factory=dict)
    detail: str | None = Field(None, max_length=MAX_DETAIL_LENGTH)


class LoraConfig(Body):
    rank: int = Field(32, ge=1, le=512)
    alpha: float | None = Field(None, gt=0)
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Body):
    """tinker's optimizer_config: the optimizer a training model keeps for life."""

    type: Id
    version: int | None = None


class DimuonParams(BaseModel):
    """tinker's DimuonParams (SDK 0.38.0's fields; anything else is refused, not ignored)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    type: Literal["dimuon"] = "dimuon"
    learning_rate: float = Field(ge=0)
    grad_clip_norm: float = 0.0
    beta1: float = Field(0.9, ge=0, lt=1)


class CreateModel(Body):
    session_id: Id
    model_seq_id: int = Field(ge=0, le=MAX_ID)
    base_model: Id
    user_metadata: Metadata | None = None
    lora_config: LoraConfig = Field(default_factory=lambda: LoraConfig())
    optimizer_config: OptimizerConfig | None = None
    training_session_name: Id | None = None
    model_package_group: Id | None = None
    # Treadle: the session refuses operations that could take its spend past this (402).
    max_cost_usd: float | None = Field(None, ge=0, le=1e9)


class ModelRef(Body):
    model_id: Id


class AdamParams(Body):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStep(Body):
    model_id: Id
    seq_id: int = Field(ge=1, le=MAX_ID)
    adam_params: AdamParams = Field(default_factory=lambda: AdamParams())
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsForSampler(Body):
    model_id: Id
    seq_id: int = Field(ge=1, le=MAX_ID)
    path: Id | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0, le=MAX_ID)
    kind: Id | None = None
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)
    merge_weights: bool = False


class SaveWeights(Body):
    model_id: Id
    seq_id: int = Field(ge=1, le=MAX_ID)
    path: Id
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)
    overwrite: bool = False


class LoadWeights(Body):
    path: Id
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None
    # create-via-load (create_training_client_from_state[_with_optimizer])
    session_id: Id | None = None
    model_seq_id: int | None = Field(None, ge=0, le=MAX_ID)
    base_model: Id | None = None
    # legacy load_state into an existing model
    model_id: Id | None = None
    seq_id: int | None = Field(None, ge=1, le=MAX_ID)


class CheckpointTtl(Body):
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)


class WeightsInfo(Body):
    tinker_path: Id


class CreateSamplingSession(Body):
    session_id: Id
    sampling_session_seq_id: int = Field(ge=0, le=MAX_ID)
    base_model: Id | None = None
    model_path: Id | None = None


class Chunk(Body):
    """An encoded_text chunk (`tokens`) or an image chunk (`data`: the file, base64; `format`;
    `expected_tokens`, optional in a prompt), as the tinker SDK sends ModelInput's chunks."""

    type: Id = "encoded_text"
    tokens: list[int] = Field(default_factory=list)
    data: str | None = Field(None, max_length=MAX_IMAGE_BYTES * 4 // 3 + 4)
    format: Id | None = None
    expected_tokens: int | None = Field(None, ge=1, le=MAX_ID)


class ModelInput(Body):
    chunks: list[Chunk]


class SamplingParams(Body):
    max_tokens: int | None = Field(None, ge=1, le=MAX_SAMPLE_TOKENS)
    seed: Seed | None = None
    stop: Annotated[str | list[str] | list[int] | None, AfterValidator(_stop)] = None
    temperature: Annotated[float, AfterValidator(_temperature)] = Field(
        1.0, ge=0, le=MAX_TEMPERATURE
    )
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K)
    top_p: Annotated[float, AfterValidator(_top_p)] = Field(
        1.0, json_schema_extra={"minimum": MIN_TOP_P, "maximum": 1}
    )


PromptCell = Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)]  # a token id, or -1: none
Index = Annotated[int, Field(ge=0, le=MAX_ID)]


class PromptIdTable(Body):
    """target_prompt_logprobs: the tinker SDK's TensorData JSON, an int64 [len(prompt) - 1, K]
    table of token ids (-1: nothing), dense or sparse CSR."""

    data: list[PromptCell] = Field(max_length=MAX_TARGET_PROMPT_CELLS)
    dtype: Id
    shape: list[Index] | None = Field(None, max_length=2)
    sparse_crow_indices: list[Index] | None = Field(None, max_length=MAX_TARGET_PROMPT_CELLS + 1)
    sparse_col_indices: list[Index] | None = Field(None, max_length=MAX_TARGET_PROMPT_CELLS)


class Sample(Body):
    sampling_session_id: Id | None = None
    base_model: Id | None = None
    model_path: Id | None = None
    seq_id: int = Field(0, ge=0, le=MAX_ID)
    num_samples: int = Field(1, ge=1, le=MAX_NUM_SAMPLES)
    prompt: ModelInput
    sampling_params: SamplingParams = Field(default_factory=lambda: SamplingParams())
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_ID)
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_PROMPT_ALT_TOKENS_K)
    prompt_logprobs_last_n: int | None = Field(None, ge=1, le=MAX_ID)
    target_prompt_logprobs: PromptIdTable | None = None
    record_stability_info: bool | None = None

    @model_validator(mode="after")
    def _bounded_work(self) -> Sample:
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is not None and self.num_samples * max_tokens > MAX_SAMPLE_TOKENS:
            raise ValueError(
                f"num_samples x sampling_params.max_tokens = {self.num_samples} x {max_tokens} = "
                f"{self.num_samples * max_tokens} tokens; one request samples at most "
                f"{MAX_SAMPLE_TOKENS}: lower either, or send several requests"
            )
        return self


class RetrieveFuture(Body):
    request_id: Id
    allow_metadata_only: bool = False
