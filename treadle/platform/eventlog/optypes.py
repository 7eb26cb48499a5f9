"""The operation vocabulary: one `OpType` per operation, one typed payload class each.

The routes build these payloads, the log stores `payload.to_json()` in `OperationRequested`, and
the worker reads them back with `parse_payload` and dispatches on `OpType` through one table.
Whether an operation runs in the session's seq_id order, whether it changes the adapter (so its
state hash is recorded and verified on replay) and whether recovery replays it are properties of
the payload, not lists of strings kept in step by hand.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, ClassVar, Literal

import pydantic
from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)


class OpType(StrEnum):
    CREATE_MODEL = "create_model"
    LOAD_WEIGHTS = "load_weights"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAMPLE = "sample"
    LOAD_SAMPLER_WEIGHTS = "load_sampler_weights"
    REBUILD = "rebuild"


class OpStatus(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


class Payload(BaseModel):
    """An operation's request, as the log stores it."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())
    TYPE: ClassVar[OpType]
    # Training operations run strictly in the session's seq_id order; samples as they come.
    is_ordered: ClassVar[bool] = True

    @property
    def changes_state(self) -> bool:
        """Whether it changes the adapter's weights, grads or optimizer state: its state hash is
        recorded when it first runs and checked whenever it is replayed."""
        return False

    @property
    def is_replayed(self) -> bool:
        """Whether rebuilding the session from the log runs it again."""
        return self.changes_state

    @property
    def state_parts(self) -> tuple[str, ...]:
        """The parts of the adapter's state it changes, whose hashes its completion records."""
        return ()

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def identity(self) -> dict[str, Any]:
        """What makes two requests with the same seq_id the same request: a client's retry of
        an operation must match it here, or it is refused as a different one."""
        return self.to_json()


# The optimizers a training session can be created with (tinker's optimizer_config `type`).
Optimizer = Literal["adamw", "dimuon"]


class LoraConfig(BaseModel):
    """A training session's adapter, and the optimizer it trains with for life. Written without
    `optimizer` where it is AdamW, so logs and projections from before Dimuon read the same."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rank: int
    alpha: float
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    optimizer: Optimizer = "adamw"

    @model_serializer(mode="wrap")
    def _omit_adamw(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("optimizer") == "adamw":
            del data["optimizer"]
        return data


class CreateModel(Payload):
    TYPE = OpType.CREATE_MODEL
    base_model: str
    lora_config: LoraConfig

    @property
    def changes_state(self) -> bool:
        return True

    @property
    def state_parts(self) -> tuple[str, ...]:
        return ("weights",)


class LoadWeights(Payload):
    """Load a training checkpoint: into a new session (`create`, seq 0) or a live one."""

    TYPE = OpType.LOAD_WEIGHTS
    path: str
    prefix: str  # the checkpoint's storage prefix, resolved at admission
    optimizer: bool
    base_model: str
    lora_config: LoraConfig
    create: bool = False

    @property
    def changes_state(self) -> bool:
        return True

    @property
    def state_parts(self) -> tuple[str, ...]:
        return ("weights", "grads", "optimizer")


class Tensor(BaseModel):
    """A `loss_fn_inputs` tensor (or a result's `loss_fn_outputs` one): row-major `data` of
    `shape`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    dtype: Literal["float32", "int64"]
    shape: list[int]
    data: list[Any]

    @model_validator(mode="after")
    def _sized(self) -> Tensor:
        if math.prod(self.shape) != len(self.data):
            raise ValueError(f"shape {self.shape} does not hold {len(self.data)} values")
        return self


class ProvenanceSpan(BaseModel):
    """Positions [offset, offset + length) of a recorded sequence: of its request's prompt
    (`prompt`) or of its sampled tokens (`sampled`). Spans tile the field they annotate."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


class Provenance(BaseModel):
    """Where a datum's tokens came from (Datum.with_provenance), checked against the recorded
    sequences at admission, and what the platform recorded for its targets: the sampler's own
    logprob of each sampled target (None for a prompt token)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    model_input: list[ProvenanceSpan]
    targets: list[ProvenanceSpan]
    sampler_logprobs: list[float | None]


class Image(BaseModel):
    """An image of a vision-language model's datum or prompt: `tokens` copies of the model's
    image token from `at` stand for it (`platform.models.vision`); `data` is the encoded file,
    base64."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    at: int
    tokens: int
    format: Literal["jpeg", "png"]
    data: str


class Datum(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens: list[int]
    loss_fn_inputs: dict[str, Tensor]
    provenance: Provenance | None = None  # kept only for losses that read it
    # For a loss that takes the sampler's logprobs but not provenance: which targets the datum's
    # provenance spans mark sampled (1) or prompt (0), where they tile its targets; only the
    # sampler-vs-trainer KL metric reads it (absent from operations logged before it was kept).
    sampled_targets: list[int] | None = None
    images: list[Image] | None = None  # logged only where the datum has some


class CustomLossInput(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    rank: Literal[0, 1]


class CustomLoss(BaseModel):
    """A loss made with create_custom_loss, whole: its id is `closs-` + the sha256 of the
    canonical JSON of the rest (`platform.models.custom_losses`), so the event that runs it
    carries the content its id names and replay needs nothing else."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    loss_id: str
    name: str
    inputs: list[CustomLossInput]
    nodes: list[dict[str, Any]]


class ForwardBackward(Payload):
    TYPE = OpType.FORWARD_BACKWARD
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[Datum]
    custom_loss: CustomLoss | None = None  # with loss_fn "custom"

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.custom_loss is None:  # as forward_backward was recorded before custom losses
            del out["custom_loss"]
        for datum in out["data"]:  # and before images
            if datum.get("images") is None:
                datum.pop("images", None)
        return out

    @property
    def changes_state(self) -> bool:
        return not self.forward_only  # forward alone accumulates no gradient

    @property
    def state_parts(self) -> tuple[str, ...]:
        return ("grads",) if self.changes_state else ()


class OptimStep(Payload):
    """One optimizer step with the session's optimizer: AdamW's settings, or (`optimizer`
    "dimuon") Dimuon's, which are `learning_rate`, `beta1` and `grad_clip_norm` alone. Logged
    without `optimizer` for AdamW (as before Dimuon) and with only its own fields for Dimuon."""

    TYPE = OpType.OPTIM_STEP
    optimizer: Optimizer = "adamw"
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    # LoRA+ (SageMaker's loraPlusLrRatio): each B matrix learns at learning_rate times this.
    lora_plus_lr_ratio: float = 1.0

    @model_validator(mode="after")
    def _dimuon_fields(self) -> OptimStep:
        if self.optimizer == "dimuon":
            adam_only = [
                name
                for name in _ADAM_ONLY
                if getattr(self, name) != OptimStep.model_fields[name].default
            ]
            if adam_only:
                raise ValueError(
                    f"{', '.join(adam_only)} are AdamW settings; a Dimuon step takes "
                    "learning_rate, beta1 and grad_clip_norm"
                )
        return self

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if self.optimizer == "adamw":
            del data["optimizer"]
        else:
            for name in _ADAM_ONLY:
                del data[name]
        return data

    @property
    def changes_state(self) -> bool:
        return True

    @property
    def state_parts(self) -> tuple[str, ...]:
        return ("weights", "grads", "optimizer")


_ADAM_ONLY = ("beta2", "eps", "weight_decay", "lora_plus_lr_ratio")


class SaveWeights(Payload):
    """Write a checkpoint (`weights/<name>`, `sampler_weights/<name>` or
    `external_weights/<name>`) and register it."""

    TYPE = OpType.SAVE_WEIGHTS
    path: str
    prefix: str
    ttl_seconds: int | None
    with_optimizer: bool
    merge_weights: bool
    description: str | None = None  # kept with the checkpoint (SageMaker's `description`)
    # external weights only: every file stored age-encrypted to these public keys, as <name>.age
    age_encryption_recipients: list[str] | None = None


class SaveWeightsForSampler(Payload):
    """Freeze the adapter's current weights as an ephemeral sampler's snapshot: its own
    (`snapshot`), or the session's one inflight snapshot (`inflight_snapshot_id`), which every
    inflight sampler of the session shares and each inflight save replaces."""

    TYPE = OpType.SAVE_WEIGHTS_FOR_SAMPLER
    sampler_id: str
    snapshot_id: str | None = None  # None: the sampler's own snapshot, named like it

    @property
    def snapshot(self) -> str:
        return self.snapshot_id or self.sampler_id

    def identity(self) -> dict[str, Any]:
        """Everything but the sampler's id. The tinker SDK numbers an unnamed sampler inside
        its retry loop, so each retry of one save names a new sampler
        (`sampling_session_seq_id`); a retry whose first answer was lost must still find the
        save it repeats (and its sampler) instead of a conflict. Whether it is an inflight
        sampler stays part of it (`snapshot_id`)."""
        return {"snapshot_id": self.snapshot_id}

    @property
    def is_replayed(self) -> bool:
        return True  # a rebuilt session's samplers need their snapshots back


def inflight_snapshot_id(session_id: str) -> str:
    """The snapshot a training session's inflight samplers share."""
    return f"{session_id}#inflight"


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | list[int] | None = None


class PromptTargets(BaseModel):
    """target_prompt_logprobs: an int64 [rows, k] table of token ids (-1: nothing), dense
    (`ids` row-major) or sparse CSR (`ids` holds the listed cells only), as the client sent it;
    the result mirrors its layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rows: int
    k: int
    ids: list[int]
    crow_indices: list[int] | None = None
    col_indices: list[int] | None = None


class Sample(Payload):
    TYPE = OpType.SAMPLE
    is_ordered = False
    prompt: list[int]
    snapshot_id: str | None
    checkpoint_prefix: str | None
    num_samples: int
    prompt_logprobs: bool
    topk_prompt_logprobs: int = 0
    params: SamplingParams
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: PromptTargets | None = None
    prompt_alt_tokens_k: int = 0
    topk_sample_logprobs: int = 0
    # Its sequences are recorded (platform/operations/recorded_samples.py) for stable_reinforce's provenance.
    record_stability_info: bool = False
    images: list[Image] | None = None  # the prompt's, for a vision-language model

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        if self.images is None:  # as samples were recorded before images
            del out["images"]
        return out


class LoadSamplerWeights(Payload):
    """Make a checkpoint's adapter ready for sampling on the session's worker (SageMaker's
    loadWeightsForSampling): its files are read once, so the samples that name it next start at
    once. Changes no training state; a sampler's operation, so it needs no seq_id order."""

    TYPE = OpType.LOAD_SAMPLER_WEIGHTS
    is_ordered = False
    snapshot_id: str
    checkpoint_prefix: str


class RebuildMode(StrEnum):
    REPLAY = "replay"  # a read-only sandbox, verified from the source's first operation
    FORK = "fork"  # a new training session, from the source's newest recovery point


class Rebuild(Payload):
    """The first operation of a replay or a fork: build the adapter as `source_session_id`'s
    stood right after its seq `to_seq`, by a verified replay of its log."""

    TYPE = OpType.REBUILD
    source_session_id: str
    to_seq: int
    mode: RebuildMode
    base_model: str
    lora_config: LoraConfig

    @property
    def changes_state(self) -> bool:
        return True

    @property
    def state_parts(self) -> tuple[str, ...]:
        return ("weights", "grads", "optimizer")


PAYLOADS: dict[OpType, type[Payload]] = {
    cls.TYPE: cls
    for cls in (
        CreateModel,
        LoadWeights,
        ForwardBackward,
        OptimStep,
        SaveWeights,
        SaveWeightsForSampler,
        Sample,
        LoadSamplerWeights,
        Rebuild,
    )
}


def parse_payload(op_type: str, data: Any) -> Payload:
    """A logged payload as its typed class. Raises ValueError naming the operation type if the
    data does not fit it (a bug or a damaged log, never user input: the API built it)."""
    cls = PAYLOADS[OpType(op_type)]
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ValueError(f"a logged {op_type} payload does not fit its type: {exc}") from None
