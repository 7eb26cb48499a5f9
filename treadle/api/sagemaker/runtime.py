"""SageMaker's runtime (rest-json): training and sampling operations submitted to a named
training session, and their results, onto the platform's one admission path.

A training operation's `sequenceNumber` is the session's seq_id (seq 0 is the session's own
`create_model`), so it runs in that order, recovers, meters and replays like a Tinker client's.
Its `clientToken` is recorded in the admission's transaction (unique per session): a
resubmission with the same token and request answers the first operation id; a token or a
number reused for a different request is refused. A refused submit has its number remembered,
so the next ones run. Sampling operations get their own seq_ids, allocated in the admission's
transaction, on a sampler per weights (the base model, or one model package). A result is kept
in the log and fetched as often as asked; a poll of a pending operation long-polls up to
TREADLE_LONG_POLL_SECONDS, and the first poll of an operation this process admitted is answered
from its completion notice without reading the database.
Imports platform only; never torch.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from treadle.api.admission import expect_seq, submit
from treadle.api.context import principal, services
from treadle.api.sagemaker import convert, protocol
from treadle.api.sagemaker.protocol import AwsError
from treadle.api.sagemaker.shapes import ServiceShapes
from treadle.platform import db
from treadle.platform.errors import InactiveSessionError, NotFoundError, ValidationError
from treadle.platform.eventlog import optypes
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.eventlog.results import SaveWeightsOutput
from treadle.platform.operations import operations
from treadle.platform.operations.operations import CANCELLED, Admission, Outcome
from treadle.platform.sagemaker import arns, packages, runtime_ops, training_sessions
from treadle.platform.sagemaker.runtime_ops import Kind
from treadle.platform.sagemaker.training_sessions import TrainingSession
from treadle.platform.sessions import sessions as sessions_core

SERVICE = "sagemakertrainingsessionruntime"
# A runtime request renews its session's idle timer at most this often per API process.
TOUCH_EVERY_SECONDS = 30.0
# An operation that failed because its session stopped before it ran never ran: "Skipped".
_NEVER_RAN = ("session_stopped", CANCELLED)
TOKEN_INDEX = "uq_sagemaker_operations_token"
MAX_REMEMBERED = 100_000


@dataclass(frozen=True)
class _Submitted:
    tenant_id: str
    session_id: str
    kind: Kind


class _Memory:
    """What this API process knows without reading: the sessions its callers named (a name's
    session changes only when one is deleted and another created: then an admission finds the
    old one stopped and the name is read again), the operations it admitted, the samplers it
    made, the packages it sampled, and when it last renewed each session's idle timer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[tuple[str, str], TrainingSession] = {}
        self.submitted: OrderedDict[str, _Submitted] = OrderedDict()
        self.samplers: set[str] = set()
        self.packages: dict[tuple[str, str], packages.Package] = {}
        self.touched: dict[str, float] = {}

    def remember(self, request_id: str, submitted: _Submitted) -> None:
        with self.lock:
            self.submitted[request_id] = submitted
            if len(self.submitted) > MAX_REMEMBERED:
                self.submitted.popitem(last=False)

    def due(self, client_session_id: str) -> bool:
        """Whether the session's idle timer is due for renewal (and count it renewed)."""
        now = time.monotonic()
        with self.lock:
            if (
                now - self.touched.get(client_session_id, -TOUCH_EVERY_SECONDS)
                < TOUCH_EVERY_SECONDS
            ):
                return False
            if len(self.touched) > MAX_REMEMBERED:
                self.touched.clear()
            self.touched[client_session_id] = now
            return True


_memory = _Memory()


def execute_training_operation(name: str) -> Any:
    params = protocol.read_json()
    found = session(name)
    seq = params.get("sequenceNumber")
    expect_seq(found.session.id, seq)  # a refusal from here on is remembered: later ones run
    validate("ExecuteTrainingOperation", params, trainingSessionName=name)
    ((kind_name, config),) = params["operationConfig"].items()
    kind = Kind(kind_name)
    token = params.get("clientToken")

    def admit(found: TrainingSession) -> Admission:
        payload = _training_payload(kind, config, found.session, seq)
        return submit(found.session.id, seq, payload, with_request=_recorded(kind, token))

    try:
        admission = _admitted(name, found, admit, seq)
    except sa.exc.IntegrityError as exc:
        if _constraint(exc) != TOKEN_INDEX:
            raise
        raise _token_reused(found.session.id, str(token)) from None
    if not admission.is_new and token is not None:
        _check_same_token(admission, str(token), seq)
    _memory.remember(
        admission.request_id, _Submitted(principal().tenant_id, admission.session_id, kind)
    )
    return protocol.answer({"operationId": admission.request_id})


def _training_payload(
    kind: Kind, config: dict[str, Any], session: sessions_core.SessionRow, seq: int
) -> optypes.Payload:
    if kind == Kind.LOAD_STATE:
        with db.reading(services().db) as conn:
            package = packages.get_package(
                conn, principal(), arns.parse_package(config["modelPackageArn"])
            )
        return convert.load_state(package, session, config["loadOptimizer"])
    model = services().models.get(session.base_model)
    return convert.training_payload(kind, config, session, model, seq)


def _admitted(
    name: str,
    found: TrainingSession,
    admit: Callable[[TrainingSession], Admission],
    seq: Any = None,
) -> Admission:
    """`admit(found)`; a session that no longer runs is read again by name (one deleted and
    created again is another session), else the runtime's ConflictException."""
    try:
        return admit(found)
    except InactiveSessionError:
        fresh = session(name, fresh=True)
        if fresh.session.id == found.session.id:
            raise _not_accepting(name, fresh) from None
    expect_seq(fresh.session.id, seq)
    return _admitted(name, fresh, admit, seq)


def _not_accepting(name: str, found: TrainingSession) -> AwsError:
    status = training_sessions.status_of(found.session)
    return AwsError(
        "ConflictException",
        f"training session {name} is {status}; it accepts operations only while Running or "
        "Blocked: create a new session (from a saved state) to continue",
        409,
    )


def _recorded(kind: Kind, token: str | None) -> Callable[[sa.Connection, Admission], None]:
    def record(conn: sa.Connection, admission: Admission) -> None:
        runtime_ops.record(conn, admission.request_id, admission.session_id, kind, token)

    return record


def _constraint(exc: sa.exc.IntegrityError) -> str | None:
    diag = getattr(exc.orig, "diag", None)
    return getattr(diag, "constraint_name", None)


def _token_reused(session_id: str, token: str) -> ValidationError:
    with db.reading(services().db) as conn:
        first = runtime_ops.by_token(conn, session_id, token)
    where = (
        "" if first is None else f" by operation {first.request_id} (sequenceNumber {first.seq_id})"
    )
    return ValidationError(
        f"clientToken {token} was already used{where} for a different request; use a new token "
        "for a new operation"
    )


def _check_same_token(admission: Admission, token: str, seq: int) -> None:
    """A request equal to the one already at its sequence number repeats it only if it is the
    same client request: the same token."""
    with db.reading(services().db) as conn:
        first = runtime_ops.token_of(conn, admission.request_id)
    if first != token:
        raise ValidationError(
            f"sequenceNumber {seq} was already used by operation {admission.request_id}; each "
            "operation needs the next unused sequence number"
        )


def execute_sampling_operation(name: str) -> Any:
    params = protocol.read_json()
    validate("ExecuteSamplingOperation", params, trainingSessionName=name)
    ((kind_name, config),) = params["operationConfig"].items()
    kind = Kind(kind_name)
    arn = config.get("modelPackageArn")

    def admit(found: TrainingSession) -> Admission:
        current = found.session
        model = services().models.get(current.base_model)
        snapshot_id = prefix = None
        if arn:
            snapshot_id, prefix = package_weights(current, arn)
        payload: optypes.Payload
        if kind == Kind.SAMPLE:
            payload = convert.sample(config, model, snapshot_id=snapshot_id,
                                     checkpoint_prefix=prefix)  # fmt: skip
        elif kind == Kind.COMPUTE_LOGPROBS:
            payload = convert.compute_logprobs(config, model, snapshot_id=snapshot_id,
                                               checkpoint_prefix=prefix)  # fmt: skip
        else:
            assert snapshot_id is not None and prefix is not None, "modelPackageArn is required"
            payload = optypes.LoadSamplerWeights(snapshot_id=snapshot_id, checkpoint_prefix=prefix)
        sampler = _sampler(current, snapshot_id, prefix)

        def seq(conn: sa.Connection) -> int:  # allocated in the admission's transaction
            return sessions_core.next_sampler_seq(conn, sampler)

        return submit(current.id, seq, payload, sampler_id=sampler,
                      with_request=_recorded(kind, None))  # fmt: skip

    admission = _admitted(name, session(name), admit)
    _memory.remember(
        admission.request_id, _Submitted(principal().tenant_id, admission.session_id, kind)
    )
    return protocol.answer({"operationId": admission.request_id})


def package_weights(session: sessions_core.SessionRow, arn: str) -> tuple[str, str]:
    """The snapshot id and storage prefix a sampling operation samples package `arn` with (a
    package never changes, so this process reads each once; one deleted since fails at the
    worker, its files gone)."""
    key = (principal().tenant_id, arn)
    package = _memory.packages.get(key)
    if package is None:
        with db.reading(services().db) as conn:
            package = packages.get_package(conn, principal(), arns.parse_package(arn))
        with _memory.lock:
            if len(_memory.packages) > MAX_REMEMBERED:
                _memory.packages.clear()
            _memory.packages[key] = package
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
    if sampler not in _memory.samplers:
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
        with _memory.lock:
            _memory.samplers.add(sampler)
    return sampler


# --- results -------------------------------------------------------------------------------


def get_training_operation_result(name: str, operation_id: str) -> Any:
    return _result("GetTrainingOperationResult", name, operation_id, training=True)


def get_sampling_operation_result(name: str, operation_id: str) -> Any:
    return _result("GetSamplingOperationResult", name, operation_id, training=False)


def _result(operation: str, name: str, operation_id: str, *, training: bool) -> Any:
    validate(operation, {}, trainingSessionName=name, operationId=operation_id)
    svc, who = services(), principal()
    found = session(name)
    known = _memory.submitted.get(operation_id)
    if known is not None and (known.tenant_id, known.session_id) == (
        who.tenant_id,
        found.session.id,
    ):
        kind = known.kind
    else:  # admitted by another API process, or before this one started
        with db.reading(svc.db) as conn:
            kind = runtime_ops.get(conn, who, found.session.id, operation_id)[1]
    if kind.is_training != training:
        where = "GetTrainingOperationResult" if kind.is_training else "GetSamplingOperationResult"
        raise NotFoundError(
            f"operation {operation_id} is a {kind} operation; fetch it with {where}"
        )

    def check() -> Outcome | None:
        with db.reading(svc.db) as conn:
            op = operations.get_operation(conn, who, operation_id)
        return Outcome.of(op) if op.is_done else None

    outcome = svc.notices.wait_until(
        operation_id,
        check,
        svc.config.long_poll_seconds,
        tenant_id=who.tenant_id,
        from_outcome=operations.outcome_of_notice,  # this process admitted it: no read
    )
    return protocol.answer(_answer(outcome, kind))


def _answer(outcome: Outcome | None, kind: Kind) -> dict[str, Any]:
    if outcome is None:
        return {"status": "Pending"}
    if outcome.status == OpStatus.FAILED:
        error = outcome.error or {}
        status = "Skipped" if error.get("code") in _NEVER_RAN else "Failed"
        return {"status": status, "errorDetails": str(error.get("message", "failed"))}
    if not kind.is_training:
        result = convert.sampling_result(kind, outcome.result)
        return {"status": "Completed", "operationResult": result}
    package = None
    if kind in (Kind.SAVE_WEIGHTS, Kind.SAVE_STATE):
        who, saved = principal(), SaveWeightsOutput.model_validate(outcome.result)
        if saved.model_package_group is not None and saved.version is not None:
            # the version the save registered, recorded with its result
            group, version = saved.model_package_group, saved.version
        else:  # settled by a worker that did not record it
            with db.reading(services().db) as conn:
                group, version = packages.saved_as(conn, who, saved.path)
        package = arns.package_arn(protocol.region(), who.tenant_id, group, version)
    result = convert.training_result(kind, outcome.result, package)
    return {"status": "Completed", "operationResult": result}


# --- the session ---------------------------------------------------------------------------


def session(name: str, *, fresh: bool = False) -> TrainingSession:
    """The caller's session called `name` (as this process last read it, unless `fresh`), its
    idle timer renewed."""
    svc, who = services(), principal()
    key = (who.tenant_id, name)
    found = None if fresh else _memory.sessions.get(key)
    if found is None:
        with db.reading(svc.db) as conn:
            try:
                found = training_sessions.get(conn, who, name)
            except NotFoundError:
                _memory.sessions.pop(key, None)
                raise
        with _memory.lock:
            if len(_memory.sessions) > MAX_REMEMBERED:
                _memory.sessions.clear()
            _memory.sessions[key] = found
    if _memory.due(found.session.client_session_id):
        with svc.db.begin() as conn:
            training_sessions.touch(conn, found.session)
    return found


def accepting(name: str) -> TrainingSession:
    """The session called `name`, which must accept operations (ConflictException otherwise)."""
    found = session(name, fresh=True)
    if training_sessions.status_of(found.session) not in training_sessions.STOPPABLE:
        raise _not_accepting(name, found)
    return found


def validate(operation: str, params: dict[str, Any], **uri: Any) -> None:
    """Check a request against the runtime's service model: its body's members and those of
    its URI and headers (`uri`), which the body may not repeat."""
    if repeated := sorted(set(params) & set(uri)):
        raise ValidationError(
            f"the body has {repeated}, which the request's path or headers carry; remove it"
        )
    ServiceShapes.of(SERVICE).validate_input(operation, {**params, **uri})
