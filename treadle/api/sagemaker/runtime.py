"""SageMaker's runtime (rest-json): training and sampling operations submitted to a named
training session, and their results, onto the platform's one admission path.

A training operation's `sequenceNumber` is the session's seq_id (seq 0 is the session's own
`create_model`), so it runs in that order, recovers, meters and replays like a Tinker client's;
its `clientToken` makes a resubmission answer the first operation id, and a token or number
reused for a different request is refused. A refused submit has its number remembered, so the
next ones run. Sampling operations get their own seq_ids on a sampler per weights (the base
model, or one model package). A result is kept in the log, fetched as often as asked; a poll of
a pending operation long-polls up to TREADLE_LONG_POLL_SECONDS.
Imports platform only; never torch.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa

from treadle.api.admission import expect_seq, submit
from treadle.api.context import principal, services
from treadle.api.sagemaker import convert, protocol
from treadle.api.sagemaker.protocol import AwsError
from treadle.api.sagemaker.shapes import ServiceShapes
from treadle.platform import db
from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.operations import operations
from treadle.platform.operations.operations import CANCELLED, Admission, OperationRow
from treadle.platform.sagemaker import arns, packages, runtime_ops, training_sessions
from treadle.platform.sagemaker.runtime_ops import Kind
from treadle.platform.sagemaker.training_sessions import TrainingSession
from treadle.platform.sessions import sessions as sessions_core

SERVICE = "sagemakertrainingsessionruntime"
# A runtime request renews its session's idle timer at most this often per API process.
TOUCH_EVERY_SECONDS = 30.0
# An operation that failed because its session stopped before it ran never ran: "Skipped".
_NEVER_RAN = ("session_stopped", CANCELLED)

_touched: dict[str, float] = {}
_touched_lock = threading.Lock()
_samplers: set[str] = set()  # samplers this process knows exist


def execute_training_operation(name: str) -> Any:
    params = protocol.read_json()
    found = accepting(name)
    session = found.session
    seq = params.get("sequenceNumber")
    expect_seq(session.id, seq)  # a refusal from here on is remembered: later numbers run
    validate("ExecuteTrainingOperation", params, trainingSessionName=name)
    ((kind_name, config),) = params["operationConfig"].items()
    kind = Kind(kind_name)
    model = services().models.get(session.base_model)
    if kind == Kind.LOAD_STATE:
        with db.reading(services().db) as conn:
            package = packages.get_package(
                conn, principal(), arns.parse_package(config["modelPackageArn"])
            )
        payload: optypes.Payload = convert.load_state(package, session, config["loadOptimizer"])
    else:
        payload = convert.training_payload(kind, config, session, model, seq)
    token = params.get("clientToken")
    repeated = _repeated(session, seq, token, payload)
    if repeated is not None:
        return protocol.answer({"operationId": repeated})
    admission = submit(session.id, seq, payload, with_request=_recorded(kind, token))
    return protocol.answer({"operationId": admission.request_id})


def _repeated(
    session: sessions_core.SessionRow, seq: int, token: str | None, payload: optypes.Payload
) -> str | None:
    """The operation a resubmission repeats (same token, number and request), None for a new
    one; ValidationException for a token or a number already used by a different request."""
    digest = operations.payload_hash(payload.identity())
    with db.reading(services().db) as conn:
        by_token = None if token is None else runtime_ops.by_token(conn, session.id, token)
        at_seq = operations.training_op_at(conn, session.id, seq)
    if by_token is not None:
        if by_token.seq_id == seq and by_token.payload_hash == digest:
            return by_token.request_id
        raise ValidationError(
            f"clientToken {token} was already used by operation {by_token.request_id} "
            f"(sequenceNumber {by_token.seq_id}) for a different request; use a new token for "
            "a new operation"
        )
    if at_seq is not None and token is not None:
        raise ValidationError(
            f"sequenceNumber {seq} was already used by operation {at_seq.request_id}; each "
            "operation needs the next unused sequence number"
        )
    return None


def _recorded(kind: Kind, token: str | None) -> Any:
    def record(conn: sa.Connection, admission: Admission) -> None:
        runtime_ops.record(conn, admission.request_id, admission.session_id, kind, token)

    return record


def execute_sampling_operation(name: str) -> Any:
    params = protocol.read_json()
    found = accepting(name)
    validate("ExecuteSamplingOperation", params, trainingSessionName=name)
    session = found.session
    ((kind_name, config),) = params["operationConfig"].items()
    kind = Kind(kind_name)
    model = services().models.get(session.base_model)
    snapshot_id = prefix = None
    arn = config.get("modelPackageArn")
    if arn:
        snapshot_id, prefix = package_weights(session, arn)
    payload: optypes.Payload
    if kind == Kind.SAMPLE:
        payload = convert.sample(config, model, snapshot_id=snapshot_id, checkpoint_prefix=prefix)
    elif kind == Kind.COMPUTE_LOGPROBS:
        payload = convert.compute_logprobs(
            config, model, snapshot_id=snapshot_id, checkpoint_prefix=prefix
        )
    else:
        assert snapshot_id is not None and prefix is not None, "modelPackageArn is required"
        payload = optypes.LoadSamplerWeights(snapshot_id=snapshot_id, checkpoint_prefix=prefix)
    sampler = _sampler(session, snapshot_id, prefix)
    with services().db.begin() as conn:
        seq = sessions_core.next_sampler_seq(conn, sampler)
    admission = submit(
        session.id, seq, payload, sampler_id=sampler, with_request=_recorded(kind, None)
    )
    return protocol.answer({"operationId": admission.request_id})


def package_weights(session: sessions_core.SessionRow, arn: str) -> tuple[str, str]:
    """The snapshot id and storage prefix a sampling operation samples package `arn` with."""
    with db.reading(services().db) as conn:
        package = packages.get_package(conn, principal(), arns.parse_package(arn))
    checkpoint = package.checkpoint
    if package.base_model != session.base_model:
        raise ValidationError(
            f"{arn} was trained on {package.base_model}; this session serves "
            f"{session.base_model}: sample it from a session of its base model"
        )
    if checkpoint.is_merged:
        raise ValidationError(
            f"{arn} is a merged model (saveWeights with mergeWeights), which this server does "
            "not load for sampling; sample a package saved without mergeWeights"
        )
    return f"checkpoint:{checkpoint.path}", checkpoint.storage_prefix


def _sampler(session: sessions_core.SessionRow, snapshot_id: str | None, prefix: str | None) -> str:
    """The session's runtime sampler on `snapshot_id`, created on first use."""
    sampler = runtime_ops.sampler(session.id, snapshot_id)
    if sampler not in _samplers:
        with services().db.begin() as conn:
            sessions_core.create_sampler(
                conn,
                principal(),
                sampler=sampler,
                client_session_id=session.client_session_id,
                session_id=session.id,
                base_model=session.base_model,
                snapshot_id=snapshot_id,
                checkpoint_prefix=prefix,
            )
        _samplers.add(sampler)
    return sampler


# --- results -------------------------------------------------------------------------------


def get_training_operation_result(name: str, operation_id: str) -> Any:
    return _result("GetTrainingOperationResult", name, operation_id, training=True)


def get_sampling_operation_result(name: str, operation_id: str) -> Any:
    return _result("GetSamplingOperationResult", name, operation_id, training=False)


def _result(operation: str, name: str, operation_id: str, *, training: bool) -> Any:
    validate(operation, {}, trainingSessionName=name, operationId=operation_id)
    svc, who = services(), principal()
    found = _session(name)
    with db.reading(svc.db) as conn:
        op, kind = runtime_ops.get(conn, who, found.session.id, operation_id)
    if kind.is_training != training:
        where = "GetTrainingOperationResult" if kind.is_training else "GetSamplingOperationResult"
        raise NotFoundError(
            f"operation {operation_id} is a {kind} operation; fetch it with {where}"
        )
    if not op.is_done:

        def check() -> OperationRow | None:
            with db.reading(svc.db) as conn:
                now = operations.get_operation(conn, who, operation_id)
            return now if now.is_done else None

        op = svc.notices.wait_until(operation_id, check, svc.config.long_poll_seconds) or op
    return protocol.answer(_outcome(op, kind, found))


def _outcome(op: OperationRow, kind: Kind, found: TrainingSession) -> dict[str, Any]:
    if op.status == OpStatus.PENDING:
        session = found.session
        running = kind.is_training and op.seq_id == session.last_applied_seq + 1
        return {"status": "InProgress" if running or not kind.is_training else "Pending"}
    if op.status == OpStatus.FAILED:
        error = op.error or {}
        status = "Skipped" if error.get("code") in _NEVER_RAN else "Failed"
        return {"status": status, "errorDetails": str(error.get("message", "failed"))}
    if not kind.is_training:
        return {"status": "Completed", "operationResult": convert.sampling_result(kind, op.result)}
    package = None
    if kind in (Kind.SAVE_WEIGHTS, Kind.SAVE_STATE):
        who = principal()
        with db.reading(services().db) as conn:
            group, version = packages.saved_as(conn, who, op.result["path"])
        package = arns.package_arn(protocol.region(), who.tenant_id, group, version)
    answer: dict[str, Any] = {
        "status": "Completed",
        "operationResult": convert.training_result(kind, op.result, package),
    }
    return answer


# --- the session ---------------------------------------------------------------------------


def _session(name: str) -> TrainingSession:
    """The caller's session called `name`, its idle timer renewed."""
    svc, who = services(), principal()
    with db.reading(svc.db) as conn:
        found = training_sessions.get(conn, who, name)
    client_session = found.session.client_session_id
    now = time.monotonic()
    with _touched_lock:
        due = now - _touched.get(client_session, -TOUCH_EVERY_SECONDS) >= TOUCH_EVERY_SECONDS
        if due:
            _touched[client_session] = now
    if due and found.session.is_active:
        with svc.db.begin() as conn:
            training_sessions.touch(conn, found.session)
    return found


def accepting(name: str) -> TrainingSession:
    """The session called `name`, which must accept operations (ConflictException otherwise)."""
    found = _session(name)
    status = training_sessions.status_of(found.session)
    if status not in training_sessions.STOPPABLE:
        raise AwsError(
            "ConflictException",
            f"training session {name} is {status}; it accepts operations only while Running "
            "or Blocked: create a new session (from a saved state) to continue",
            409,
        )
    return found


def validate(operation: str, params: dict[str, Any], **uri: Any) -> None:
    """Check a request against the runtime's service model: its body's members and those of
    its URI and headers (`uri`), which the body may not repeat."""
    if repeated := sorted(set(params) & set(uri)):
        raise ValidationError(
            f"the body has {repeated}, which the request's path or headers carry; remove it"
        )
    ServiceShapes.of(SERVICE).validate_input(operation, {**params, **uri})
