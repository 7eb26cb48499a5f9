"""SageMaker's control plane, Public Hub and model registry (json 1.1): `POST /` with
`X-Amz-Target: SageMaker.<Operation>`, one handler per operation in `OPERATIONS`.

Each body is checked against the `sagemaker` service model (every range, pattern and enum, and
no unknown member) before its handler runs; a handler calls the platform
(`platform.sagemaker`) and returns the answer's members. An operation this server does not
serve is `UnknownOperationException`. List pages are addressed by an opaque NextToken.
Imports platform only; never torch.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from flask import request

from treadle.api.context import principal, services
from treadle.api.sagemaker import protocol
from treadle.api.sagemaker.protocol import AwsError, region
from treadle.api.sagemaker.shapes import ServiceShapes
from treadle.platform import db
from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.eventlog.optypes import OpStatus
from treadle.platform.models import registry
from treadle.platform.operations import operations
from treadle.platform.sagemaker import arns, hub, packages, training_sessions
from treadle.platform.sagemaker.training_sessions import Status

SERVICE = "sagemaker"
TARGET_PREFIX = "SageMaker."
DEFAULT_PAGE = 100

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def dispatch() -> Any:
    """The operation `X-Amz-Target` names, run on the request's body."""
    target = request.headers.get("X-Amz-Target", "")
    operation = target.removeprefix(TARGET_PREFIX)
    handler = OPERATIONS.get(operation) if target.startswith(TARGET_PREFIX) else None
    if handler is None:
        raise AwsError(
            "UnknownOperationException",
            f"X-Amz-Target {target!r} is not an operation this server serves; it serves "
            + ", ".join(f"{TARGET_PREFIX}{name}" for name in OPERATIONS),
        )
    params = protocol.read_json()
    ServiceShapes.of(SERVICE).validate_input(operation, params)
    return protocol.answer(handler(params), runtime=False)


# --- training sessions ---------------------------------------------------------------------


def create_training_session(params: dict[str, Any]) -> dict[str, Any]:
    svc, who = services(), principal()
    name = params["TrainingSessionName"]
    ref = arns.parse_hub_content_arn(params["ModelConfig"]["BaseModelArn"])
    with db.reading(svc.db) as conn:
        info = hub.find(registry.list_models(conn), ref.name, ref.version)
    svc.models.require_active(info.name)
    given_group = params.get("ModelPackageGroupArn")
    group = arns.group_name(given_group) if given_group else name
    lora = params["LoraConfig"]
    attributes = {k: v for k, v in params.items() if k != "TrainingSessionName"}
    created = training_sessions.create(
        svc.deps,
        who,
        name=name,
        model=info,
        rank=lora["Rank"],
        alpha=lora["Alpha"],
        group=group,
        attributes=attributes,
    )
    _wait_for_first_operation(created.session.id)
    return {"TrainingSessionArn": arns.session_arn(region(), who.tenant_id, name)}


def _wait_for_first_operation(session_id: str) -> None:
    """Wait, up to one long-poll, for the session's adapter to be created: the SDK describes a
    new session at once and, unless it is Running by then, again only 10 s later."""
    svc, who = services(), principal()
    with db.reading(svc.db) as conn:
        op = operations.training_op_at(conn, session_id, 0)
    if op is None or op.is_done:
        return

    def settled() -> bool | None:
        with db.reading(svc.db) as conn:
            found = operations.get_operation(conn, who, op.request_id)
        return True if found.status != OpStatus.PENDING else None

    svc.notices.wait_until(op.request_id, settled, svc.config.long_poll_seconds)


def describe_training_session(params: dict[str, Any]) -> dict[str, Any]:
    svc, who = services(), principal()
    name = params["TrainingSessionName"]
    with db.reading(svc.db) as conn:
        found = training_sessions.get(conn, who, name)
        detail = training_sessions.detail(conn, found)
    session, attributes = found.session, found.attributes
    tokens = detail.tokens
    answer = {
        "TrainingSessionArn": arns.session_arn(region(), who.tenant_id, name),
        "TrainingSessionName": name,
        "TrainingSessionStatus": detail.status.value,
        "ModelPackageGroupArn": arns.group_arn(
            region(), who.tenant_id, session.model_package_group or name
        ),
        "CreationTime": found.created_at,
        "LastModifiedTime": detail.updated_at,
        "EndTime": detail.ended_at,
        "ErrorDetails": detail.error,
        "LastReceivedSequenceNumber": detail.last_received_seq,
        "BillableTokenUsage": {
            "PrefillTokenCount": tokens["prefill"],
            "SampleTokenCount": tokens["sample"],
            "TrainingTokenCount": tokens["train"],
        },
    }
    for member in ("VpcConfig", "RoleArn", "LoraConfig", "ModelConfig", "OutputConfig", "Tags"):
        if member in attributes:
            answer[member] = attributes[member]
    return {"TrainingSessionDetail": answer}


def list_training_sessions(params: dict[str, Any]) -> dict[str, Any]:
    svc, who = services(), principal()
    offset = _offset(params.get("NextToken"))
    limit = params.get("MaxResults", DEFAULT_PAGE)
    status = params.get("StatusEquals")
    with db.reading(svc.db) as conn:
        page, more = training_sessions.list_page(
            conn,
            who,
            name_contains=params.get("NameContains"),
            status=Status(status) if status else None,
            created_after=_time(params.get("CreationTimeAfter")),
            created_before=_time(params.get("CreationTimeBefore")),
            offset=offset,
            limit=limit,
        )
    summaries = [
        {
            "TrainingSessionArn": arns.session_arn(region(), who.tenant_id, item.name),
            "TrainingSessionStatus": item_status.value,
            "CreationTime": item.created_at,
            "LastModifiedTime": item.session.updated_at,
        }
        for item, item_status in page
    ]
    return {"TrainingSessionSummaries": summaries, "NextToken": _token(offset + limit, more)}


def stop_training_session(params: dict[str, Any]) -> dict[str, Any]:
    training_sessions.stop(services().deps, principal(), params["TrainingSessionName"])
    return {}


def delete_training_session(params: dict[str, Any]) -> dict[str, Any]:
    with services().db.begin() as conn:
        training_sessions.delete(conn, principal(), params["TrainingSessionName"])
    return {}


# --- the Public Hub ------------------------------------------------------------------------


def list_hub_contents(params: dict[str, Any]) -> dict[str, Any]:
    hub.check_hub(params["HubName"])
    if params["HubContentType"] != hub.CONTENT_TYPE:
        return {"HubContentSummaries": []}
    with db.reading(services().db) as conn:
        models = hub.listed(registry.list_models(conn))
    contains = (params.get("NameContains") or "").lower()
    summaries = [
        hub.summary(m, region())
        for m in models
        if contains in arns.hub_content_name(m.info.name).lower()
    ]
    key = params.get("SortBy", "HubContentName")
    if key == "CreationTime":
        summaries.sort(key=lambda s: s["CreationTime"])
    elif key == "HubContentName":
        summaries.sort(key=lambda s: s["HubContentName"])
    if params.get("SortOrder") == "Descending":
        summaries.reverse()
    offset = _offset(params.get("NextToken"))
    limit = params.get("MaxResults", DEFAULT_PAGE)
    more = len(summaries) > offset + limit
    return {
        "HubContentSummaries": summaries[offset : offset + limit],
        "NextToken": _token(offset + limit, more),
    }


def describe_hub_content(params: dict[str, Any]) -> dict[str, Any]:
    hub.check_hub(params["HubName"])
    if params["HubContentType"] != hub.CONTENT_TYPE:
        raise NotFoundError(f"Hub content {params['HubContentName']!r} not found")
    with db.reading(services().db) as conn:
        models = registry.list_models(conn)
    info = hub.find(models, params["HubContentName"], params.get("HubContentVersion"))
    model = next(m for m in models if m.info.name == info.name)
    return hub.description(model, region())


# --- the model registry --------------------------------------------------------------------


def list_model_packages(params: dict[str, Any]) -> dict[str, Any]:
    svc, who = services(), principal()
    group_param = params.get("ModelPackageGroupName")
    if group_param is None:
        raise ValidationError(
            "ModelPackageGroupName is required here: this server lists the versions of one "
            "model package group (a name or its ARN)"
        )
    group = arns.group_name(group_param, "ModelPackageGroupName")
    if params.get("ModelPackageType") == "Unversioned" or params.get("ModelApprovalStatus"):
        return {"ModelPackageSummaryList": []}  # every package here is versioned, unapproved
    offset = _offset(params.get("NextToken"))
    limit = params.get("MaxResults", DEFAULT_PAGE)
    with db.reading(svc.db) as conn:
        page, more = packages.list_packages(
            conn,
            who,
            group,
            by_name=params.get("SortBy") == "Name",
            descending=params.get("SortOrder") == "Descending",
            created_after=_time(params.get("CreationTimeAfter")),
            created_before=_time(params.get("CreationTimeBefore")),
            offset=offset,
            limit=limit,
        )
    return {
        "ModelPackageSummaryList": [_package_summary(p) for p in page],
        "NextToken": _token(offset + limit, more),
    }


def _package_summary(package: packages.Package) -> dict[str, Any]:
    checkpoint = package.checkpoint
    group = checkpoint.model_package_group
    return {
        "ModelPackageName": group,
        "ModelPackageGroupName": group,
        "ModelPackageVersion": checkpoint.version,
        "ModelPackageArn": arns.package_arn(
            region(), checkpoint.tenant_id, group, checkpoint.version
        ),
        "ModelPackageDescription": checkpoint.description,
        "CreationTime": checkpoint.created_at,
        "ModelPackageStatus": "Completed",
    }


def describe_model_package(params: dict[str, Any]) -> dict[str, Any]:
    ref = arns.parse_package(params["ModelPackageName"], "ModelPackageName")
    with db.reading(services().db) as conn:
        package = packages.get_package(conn, principal(), ref)
    checkpoint = package.checkpoint
    answer = _package_summary(package)
    answer.update(
        ModelPackageStatusDetails={"ValidationStatuses": []},
        InferenceSpecification={
            "Containers": [
                {
                    "IsCheckpoint": package.is_checkpoint,
                    "BaseModel": {
                        "HubContentName": arns.hub_content_name(package.base_model),
                        "HubContentVersion": arns.HUB_CONTENT_VERSION,
                    },
                }
            ]
        },
        # Its files live in Treadle's own store: no S3 location to hand out or delete.
        ManagedStorageType="Restricted",
        CustomerMetadataProperties={
            "TinkerPath": str(checkpoint.path),
            "Merged": str(checkpoint.is_merged).lower(),
        },
    )
    return answer


def delete_model_package(params: dict[str, Any]) -> dict[str, Any]:
    svc = services()
    ref = arns.parse_package(params["ModelPackageName"], "ModelPackageName")
    with svc.db.begin() as conn:
        package = packages.delete_package(conn, principal(), ref)
    svc.store.delete_prefix(package.checkpoint.storage_prefix + "/")
    return {}


def create_model_package_group(params: dict[str, Any]) -> dict[str, Any]:
    who = principal()
    name = params["ModelPackageGroupName"]
    with services().db.begin() as conn:
        packages.create_group(conn, who, name, params.get("ModelPackageGroupDescription"))
    return {"ModelPackageGroupArn": arns.group_arn(region(), who.tenant_id, name)}


def describe_model_package_group(params: dict[str, Any]) -> dict[str, Any]:
    who = principal()
    name = arns.group_name(params["ModelPackageGroupName"], "ModelPackageGroupName")
    with db.reading(services().db) as conn:
        group = packages.get_group(conn, who, name)
    return {
        "ModelPackageGroupName": group.name,
        "ModelPackageGroupArn": arns.group_arn(region(), who.tenant_id, group.name),
        "ModelPackageGroupDescription": group.description,
        "CreationTime": group.created_at,
        "CreatedBy": {},
        "ModelPackageGroupStatus": "Completed",
    }


# --- paging --------------------------------------------------------------------------------


def _token(offset: int, more: bool) -> str | None:
    return base64.urlsafe_b64encode(f"offset:{offset}".encode()).decode() if more else None


def _offset(token: str | None) -> int:
    if not token:
        return 0
    try:
        kind, _, number = base64.urlsafe_b64decode(token.encode()).decode().partition(":")
        if kind == "offset" and number.isdigit():
            return int(number)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise ValidationError("NextToken is not one this server gave; start the listing again")


def _time(value: Any) -> datetime | None:
    if value is None:
        return None
    try:
        if isinstance(value, int | float):
            return datetime.fromtimestamp(value, UTC)
        parsed = datetime.fromisoformat(str(value))
    except (ValueError, OverflowError, OSError):
        raise ValidationError(f"{value!r} is not a time; send seconds since the epoch") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


OPERATIONS: Mapping[str, Handler] = {
    "CreateTrainingSession": create_training_session,
    "DescribeTrainingSession": describe_training_session,
    "ListTrainingSessions": list_training_sessions,
    "StopTrainingSession": stop_training_session,
    "DeleteTrainingSession": delete_training_session,
    "ListHubContents": list_hub_contents,
    "DescribeHubContent": describe_hub_content,
    "ListModelPackages": list_model_packages,
    "DescribeModelPackage": describe_model_package,
    "DeleteModelPackage": delete_model_package,
    "CreateModelPackageGroup": create_model_package_group,
    "DescribeModelPackageGroup": describe_model_package_group,
}
