"""Request bodies of the rest of the Tinker surface: copy_weights, save_weights_external,
cancel_future, retrieve_futures, join_sampling_session, a session's project and create_custom_loss, as pydantic
models shaped like the tinker SDK's own request types (tinker/types/*_request.py). Unknown fields
are ignored, as in `schemas`; every field is bounded. Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from treadle.api.body import MAX_ID, MAX_TTL, Body, Id
from treadle.platform.checkpoints.age_encryption import MAX_RECIPIENTS
from treadle.platform.operations.futures import CLONE_BLOCK

MAX_ACKNOWLEDGED = 10_000
Recipient = Annotated[str, Field(max_length=4096)]


class SaveWeightsExternal(Body):
    model_id: Id
    path: Id  # a name: the checkpoint is tinker://<model_id>/external_weights/<path>
    seq_id: int = Field(ge=1, le=MAX_ID)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)
    age_encryption_recipients: list[Recipient] | None = Field(None, max_length=MAX_RECIPIENTS)


class CopyWeights(Body):
    source_path: Id
    destination_project_id: Id | None = None
    session_id: Id | None = None
    model_seq_id: int | None = Field(None, ge=0, le=MAX_ID)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL)
    weights_access_token: str | None = Field(None, max_length=4096)


class CancelFuture(Body):
    request_id: Id


class FuturesTarget(Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: Id
    cloned_sampler_id: int = Field(0, ge=0, lt=CLONE_BLOCK)


class RetrieveFutures(Body):
    target: FuturesTarget
    prev_cursor: int = Field(0, ge=0, le=MAX_ID)
    timeout: float | None = Field(None, ge=0, le=3600)
    retrieved_request_ids: list[Id] = Field(default_factory=list, max_length=MAX_ACKNOWLEDGED)


class JoinSamplingSession(Body):
    sampling_session_id: Id


class AssignProject(Body):
    project_id: Id


class CreateCustomLoss(Body):
    """The SDK's CreateCustomLossRequest; `inputs` and `graph` are checked node by node by
    `treadle.platform.models.custom_losses.validate_loss`."""

    session_id: Id
    custom_loss_seq_id: int = Field(ge=0, le=MAX_ID)
    name: str = Field(max_length=128)
    inputs: list[dict[str, Any]] = Field(max_length=32)
    graph: dict[str, Any]
