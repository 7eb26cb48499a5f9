"""The operations SageMaker's runtime submitted: which runtime operation each was (`kind`), and
its client token, so that a resubmission with the same token answers the same operation id.

An operation id is the platform's request id; the row is written in the admission's
transaction, so it exists exactly when the operation does. Samplers of a session's runtime
(`sampler`) are per weights: the base model, or one model package. Owns `sagemaker_operations`.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum

import sqlalchemy as sa

from treadle.platform.errors import NotFoundError
from treadle.platform.eventlog.schema import operations, sagemaker_operations
from treadle.platform.operations import operations as operations_core
from treadle.platform.operations.operations import OperationRow
from treadle.platform.tenancy.tenants import Principal


class Kind(StrEnum):
    """The runtime's operations, as its OperationConfig / SampleOperationConfig name them."""

    FORWARD = "forward"
    FORWARD_BACKWARD = "forwardBackward"
    OPTIMIZER_STEP = "optimizerStep"
    SAVE_WEIGHTS = "saveWeights"
    SAVE_STATE = "saveState"
    LOAD_STATE = "loadState"
    SAMPLE = "sample"
    COMPUTE_LOGPROBS = "computeLogprobs"
    LOAD_WEIGHTS_FOR_SAMPLING = "loadWeightsForSampling"

    @property
    def is_training(self) -> bool:
        return self not in SAMPLING_KINDS


SAMPLING_KINDS = (Kind.SAMPLE, Kind.COMPUTE_LOGPROBS, Kind.LOAD_WEIGHTS_FOR_SAMPLING)


# Built once: it runs in every runtime operation's admission, where building a statement costs
# more CPU than PostgreSQL takes to run it.
_RECORD = sagemaker_operations.insert()


def record(
    conn: sa.Connection, request_id: str, session_id: str, kind: Kind, client_token: str | None
) -> None:
    row = {"request_id": request_id, "session_id": session_id, "kind": str(kind)}
    conn.execute(_RECORD, {**row, "client_token": client_token})


@dataclass(frozen=True)
class Submitted:
    request_id: str
    seq_id: int
    payload_hash: str
    kind: Kind


def by_token(conn: sa.Connection, session_id: str, client_token: str) -> Submitted | None:
    """The operation submitted to the session with `client_token`, if any."""
    row = conn.execute(
        sa.select(
            operations.c.request_id,
            operations.c.seq_id,
            operations.c.payload_hash,
            sagemaker_operations.c.kind,
        )
        .join(operations, operations.c.request_id == sagemaker_operations.c.request_id)
        .where(
            sagemaker_operations.c.session_id == session_id,
            sagemaker_operations.c.client_token == client_token,
        )
    ).first()
    return None if row is None else Submitted(row[0], row[1], row[2], Kind(row[3]))


def token_of(conn: sa.Connection, request_id: str) -> str | None:
    """The client token operation `request_id` was submitted with (None: none, or not the
    runtime's)."""
    return conn.execute(
        sa.select(sagemaker_operations.c.client_token).where(
            sagemaker_operations.c.request_id == request_id
        )
    ).scalar_one_or_none()


def get(
    conn: sa.Connection, principal: Principal, session_id: str, request_id: str
) -> tuple[OperationRow, Kind]:
    """The runtime operation `request_id` of the caller's session `session_id`; NotFoundError
    for one of another session, another tenant, or not submitted through the runtime."""
    op = operations_core.get_operation(conn, principal, request_id)
    kind = conn.execute(
        sa.select(sagemaker_operations.c.kind).where(
            sagemaker_operations.c.request_id == request_id
        )
    ).scalar_one_or_none()
    if op.session_id != session_id or kind is None:
        raise NotFoundError(f"operation {request_id} not found in this training session")
    return op, Kind(kind)


def sampler(session_id: str, snapshot_id: str | None) -> str:
    """The id of the sampler running a session's runtime samples on `snapshot_id` (None: the
    base model)."""
    digest = hashlib.sha256((snapshot_id or "base").encode()).hexdigest()[:16]
    return f"{session_id}:sagemaker:{digest}"
