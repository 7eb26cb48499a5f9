"""SageMaker's API in process, against a real PostgreSQL and Redis and a worker that is only a
heartbeat (operations stay pending): every request signed by botocore's SigV4 signer. The
control plane's lifecycle and its wording, the Hub, the registry's groups, the runtime's
ordering bookkeeping (client tokens, refused numbers), tenant isolation and the AWS error shapes
of both protocols. Results of operations that run need a worker: tests/compat."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.sagemaker_wire import JSON_11, SignedClient
from tests.secure_app import SecureApp
from treadle.platform.sagemaker import arns

pytestmark = pytest.mark.integration

ROLE = "arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole"
TINY_ARN = arns.hub_content_arn("us-west-2", "treadle--tiny-debug")
GROUP_ARN = "arn:aws:sagemaker:us-west-2:123456789012:model-package-group/grpo"


def new_client(secure: SecureApp) -> SignedClient:
    """A new tenant's access key pair, minted through the API as `treadle keys create --aws`."""
    tenant = f"sm-{secrets.token_hex(4)}"
    made = secure.call("POST", "/api/v1/treadle/tenants", secure.operator_key, json={"id": tenant})
    assert made.status_code == 201, made.get_data(as_text=True)
    minted = secure.call(
        "POST", "/api/v1/treadle/keys", made.get_json()["api_key"], json={"aws": True}
    )
    assert minted.status_code == 201, minted.get_data(as_text=True)
    body = minted.get_json()
    return SignedClient(secure.app, body["access_key_id"], body["secret_access_key"])


@pytest.fixture
def client(secure: SecureApp) -> Iterator[SignedClient]:
    secure.keep_worker_alive()
    yield new_client(secure)


def create(client: SignedClient, name: str, **overrides: Any) -> Any:
    body = {
        "TrainingSessionName": name,
        "ModelPackageGroupArn": GROUP_ARN,
        "LoraConfig": {"Rank": 8, "Alpha": 16},
        "RoleArn": ROLE,
        "ModelConfig": {"BaseModelArn": TINY_ARN},
        "OutputConfig": {"S3Location": {"Path": "s3://bucket/out"}},
        **overrides,
    }
    return client.control("CreateTrainingSession", body)


def describe(client: SignedClient, name: str) -> Any:
    return client.control("DescribeTrainingSession", {"TrainingSessionName": name})


def datum(n: int = 4, **extra: Any) -> dict[str, Any]:
    tokens = list(range(5, 5 + n))
    return {
        "modelInput": {"chunks": [{"tokens": tokens, "type": "encoded_text"}]},
        "lossFnInputs": {
            "target_tokens": {"data": [t + 1 for t in tokens], "dtype": "int64"},
            "weights": {"data": [1.0] * n, "dtype": "float32"},
            **extra,
        },
    }


def fb(seq: int, token: str | None, *datums: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "sequenceNumber": seq,
        "operationConfig": {
            "forwardBackward": {"lossFnName": "cross_entropy", "datumList": list(datums)}
        },
    }
    if token is not None:
        body["clientToken"] = token
    return body


def session_id(secure: SecureApp, name: str) -> str:
    with secure.engine.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT session_id FROM sagemaker_sessions WHERE name = :n"),
                {"n": name},
            ).scalar_one()
        )


# --- the Hub --------------------------------------------------------------------------------


def test_the_hub_lists_each_base_model_as_the_sdk_reads_it(client: SignedClient) -> None:
    listed = client.control(
        "ListHubContents", {"HubName": "SageMakerPublicHub", "HubContentType": "Model"}
    )
    assert listed.status == 200, listed.body
    by_name = {s["HubContentName"]: s for s in listed.body["HubContentSummaries"]}
    tiny = by_name["treadle--tiny-debug"]
    assert tiny["HubContentArn"] == TINY_ARN
    assert "@capability:training_session" in tiny["HubContentSearchKeywords"]
    assert "@huggingface-id:treadle/tiny-debug" in tiny["HubContentSearchKeywords"]
    assert "HuggingFaceTB--SmolLM2-135M-Instruct" in by_name
    described = client.control(
        "DescribeHubContent",
        {
            "HubName": "SageMakerPublicHub",
            "HubContentType": "Model",
            "HubContentName": "treadle--tiny-debug",
        },  # fmt: skip
    )
    assert described.status == 200
    assert '"HuggingfaceId": "treadle/tiny-debug"' in described.body["HubContentDocument"]


@pytest.mark.parametrize(
    "body",
    [
        {"HubName": "OtherHub", "HubContentType": "Model", "HubContentName": "treadle--tiny-debug"},
        {"HubName": "SageMakerPublicHub", "HubContentType": "Model", "HubContentName": "nope"},
        {"HubName": "SageMakerPublicHub", "HubContentType": "Model",
         "HubContentName": "treadle--tiny-debug", "HubContentVersion": "2.0.0"},
    ],
)  # fmt: skip
def test_an_unknown_hub_content_is_resource_not_found(client: SignedClient, body: Any) -> None:
    answer = client.control("DescribeHubContent", body)
    assert (answer.status, answer.code) == (400, "ResourceNotFound")
    assert answer.content_type.startswith(JSON_11)


# --- training sessions ---------------------------------------------------------------------


def test_a_created_session_describes_itself(client: SignedClient, secure: SecureApp) -> None:
    made = create(client, "demo", Tags=[{"Key": "team", "Value": "rl"}])
    assert made.status == 200, made.body
    account = arns.account_id(client_tenant(secure, client))
    assert made.body["TrainingSessionArn"] == (
        f"arn:aws:sagemaker:us-west-2:{account}:training-session/demo"
    )
    detail = describe(client, "demo").body["TrainingSessionDetail"]
    assert detail["TrainingSessionStatus"] == "Scheduled"  # placed; the fake worker never runs
    assert detail["ModelPackageGroupArn"].endswith(":model-package-group/grpo")
    assert detail["RoleArn"] == ROLE and detail["Tags"] == [{"Key": "team", "Value": "rl"}]
    assert detail["LoraConfig"] == {"Rank": 8, "Alpha": 16}
    assert detail["BillableTokenUsage"] == {
        "PrefillTokenCount": 0, "SampleTokenCount": 0, "TrainingTokenCount": 0,
    }  # fmt: skip
    assert "LastReceivedSequenceNumber" not in detail


def client_tenant(secure: SecureApp, client: SignedClient) -> str:
    with secure.engine.connect() as conn:
        return str(
            conn.execute(
                sa.text("SELECT tenant_id FROM api_keys WHERE access_key_id = :a"),
                {"a": client.access_key_id},
            ).scalar_one()
        )


def test_a_taken_name_is_resource_in_use(client: SignedClient) -> None:
    assert create(client, "twice").status == 200
    again = create(client, "twice")
    assert (again.status, again.code) == (400, "ResourceInUse")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"TrainingSessionName": "bad_name"}, "regular expression pattern"),
        ({"LoraConfig": {"Rank": 300, "Alpha": 16}}, "less than or equal to 256"),
        ({"RoleArn": "arn:aws:iam::123:role/x"}, "roleArn"),
        ({"Unknown": 1}, "Unknown member 'Unknown'"),
        ({"ModelConfig": {"BaseModelArn": TINY_ARN.replace("tiny-debug", "nope")}}, "not found"),
    ],
)
def test_a_bad_create_is_refused_and_records_nothing(
    client: SignedClient, secure: SecureApp, overrides: Any, fragment: str
) -> None:
    before = secure.event_count()
    answer = create(client, "refused", **overrides)
    assert answer.status == 400 and fragment in answer.body["message"], answer.body
    assert answer.code in ("ValidationException", "ResourceNotFound")
    assert secure.event_count() == before


def test_the_session_quota_is_resource_limit_exceeded(
    client: SignedClient, secure: SecureApp
) -> None:
    tenant = client_tenant(secure, client)
    quota = secure.call("PATCH", f"/api/v1/treadle/quotas/{tenant}", secure.operator_key,
                        json={"max_sessions": 1})  # fmt: skip
    assert quota.status_code == 200, quota.get_data(as_text=True)
    assert create(client, "first").status == 200
    second = create(client, "second")
    assert (second.status, second.code) == (400, "ResourceLimitExceeded")
    assert "limit" in second.body["message"]
    assert describe(client, "second").code == "ResourceNotFound"  # nothing was created


def test_a_spent_budget_is_a_402_the_sdk_does_not_retry(
    client: SignedClient, secure: SecureApp
) -> None:
    create(client, "budget")
    tenant = client_tenant(secure, client)
    secure.call("PATCH", f"/api/v1/treadle/quotas/{tenant}", secure.operator_key,
                json={"monthly_tokens": 2})  # fmt: skip
    answer = client.runtime("POST", "/v1/training-sessions/budget/operations", fb(1, "b", datum()))
    assert (answer.status, answer.code) == (402, "ServiceQuotaExceededException")
    assert answer.error_type == "ServiceQuotaExceededException"


def test_stop_is_final_and_a_repeat_says_so_in_sagemakers_words(client: SignedClient) -> None:
    create(client, "stopper")
    assert client.control("StopTrainingSession", {"TrainingSessionName": "stopper"}).status == 200
    assert describe(client, "stopper").body["TrainingSessionDetail"]["TrainingSessionStatus"] == (
        "Stopped"
    )
    again = client.control("StopTrainingSession", {"TrainingSessionName": "stopper"})
    assert again.code == "ValidationException"
    assert "invalid session state transition from Stopped to " in again.body["message"]
    late = client.runtime("POST", "/v1/training-sessions/stopper/operations", fb(1, None, datum()))
    assert (late.status, late.code) == (409, "ConflictException")


def test_delete_needs_a_stopped_session_and_frees_its_name(client: SignedClient) -> None:
    create(client, "doomed")
    early = client.control("DeleteTrainingSession", {"TrainingSessionName": "doomed"})
    assert early.code == "ValidationException"
    assert "invalid session state transition from Scheduled to Deleting" in early.body["message"]
    client.control("StopTrainingSession", {"TrainingSessionName": "doomed"})
    assert client.control("DeleteTrainingSession", {"TrainingSessionName": "doomed"}).status == 200
    gone = describe(client, "doomed")
    assert gone.code == "ResourceNotFound"
    assert create(client, "doomed").status == 200  # the name is free again


def test_list_pages_by_next_token_and_filters(client: SignedClient) -> None:
    for name in ("list-a", "list-b", "list-c"):
        create(client, name)
    client.control("StopTrainingSession", {"TrainingSessionName": "list-b"})
    seen: list[str] = []
    token = None
    while True:
        body: dict[str, Any] = {"MaxResults": 2, "NameContains": "list-"}
        if token:
            body["NextToken"] = token
        page = client.control("ListTrainingSessions", body).body
        seen += [
            s["TrainingSessionArn"].rsplit("/", 1)[1] for s in page["TrainingSessionSummaries"]
        ]
        token = page.get("NextToken")
        if not token:
            break
    assert sorted(seen) == ["list-a", "list-b", "list-c"]
    stopped = client.control("ListTrainingSessions", {"StatusEquals": "Stopped"}).body
    assert [s["TrainingSessionArn"].rsplit("/", 1)[1]
            for s in stopped["TrainingSessionSummaries"]] == ["list-b"]  # fmt: skip
    bad = client.control("ListTrainingSessions", {"NextToken": "not-ours"})
    assert bad.code == "ValidationException"


def test_another_tenants_names_and_operations_do_not_exist(
    client: SignedClient, secure: SecureApp
) -> None:
    """Every route, with tenant A's names, operation ids and packages and tenant B's key: each
    answers as for a missing one, and nothing of A's changes."""
    create(client, "private")
    op = client.runtime(
        "POST", "/v1/training-sessions/private/operations", fb(1, "t", datum())
    ).body["operationId"]
    other = new_client(secure)
    with secure.engine.connect() as conn:
        before = conn.execute(sa.text("SELECT max(position) FROM events")).scalar_one()
    for operation in ("DescribeTrainingSession", "StopTrainingSession", "DeleteTrainingSession"):
        answer = other.control(operation, {"TrainingSessionName": "private"})
        assert answer.code == "ResourceNotFound", (operation, answer.body)
    runtime = [
        ("POST", "/v1/training-sessions/private/operations", fb(2, "u", datum())),
        ("GET", f"/v1/training-sessions/private/operations/{op}", None),
        ("POST", "/v1/training-sessions/private/sampling-operations", SAMPLE),
        ("GET", f"/v1/training-sessions/private/sampling-operations/{op}", None),
        ("POST", "/training-sessions/private/sample", CHAT),
        ("POST", "/training-sessions/private/sample-with-response-stream", CHAT),
    ]
    for method, path, body in runtime:
        answer = other.runtime(method, path, body)
        assert (answer.status, answer.code) == (404, "ResourceNotFoundException"), path
    # A's operation id under B's own session is not found either
    create(other, "mine")
    stolen = other.runtime("GET", f"/v1/training-sessions/mine/operations/{op}")
    assert stolen.code == "ResourceNotFoundException"
    package = (
        f"arn:aws:sagemaker:us-west-2:123456789012:model-package/{GROUP_ARN.rsplit('/')[-1]}/1"
    )
    described = other.control("DescribeModelPackage", {"ModelPackageName": package})
    assert described.code == "ResourceNotFound"
    listed = other.control("ListTrainingSessions", {}).body["TrainingSessionSummaries"]
    assert [s["TrainingSessionArn"].rsplit("/", 1)[1] for s in listed] == ["mine"]
    with secure.engine.connect() as conn:
        changed = conn.execute(
            sa.text("SELECT count(*) FROM events WHERE session_id = :s AND position > :p"),
            {"s": session_id(secure, "private"), "p": before},
        ).scalar_one()
    assert changed == 0
    assert describe(client, "private").status == 200


SAMPLE = {
    "operationConfig": {
        "sample": {
            "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
            "numSamples": 1,
            "samplingParams": {"maxTokens": 512},
        }
    }
}
CHAT = {"model": "x", "messages": [{"role": "user", "content": "2+2?"}]}


# --- the runtime's bookkeeping -------------------------------------------------------------


def test_a_repeated_client_token_answers_the_first_operation(client: SignedClient) -> None:
    create(client, "tokens")
    path = "/v1/training-sessions/tokens/operations"
    first = client.runtime("POST", path, fb(1, "token-1", datum()))
    assert first.status == 200, first.body
    again = client.runtime("POST", path, fb(1, "token-1", datum()))
    assert again.body == first.body
    other_request = client.runtime("POST", path, fb(1, "token-1", datum(5)))
    assert other_request.code == "ValidationException"
    assert "already used" in other_request.body["message"]
    same_number = client.runtime("POST", path, fb(1, "token-2", datum()))
    assert same_number.code == "ValidationException"
    assert "sequenceNumber 1 was already used" in same_number.body["message"]


def test_a_refused_number_is_remembered_and_appends_nothing(
    client: SignedClient, secure: SecureApp
) -> None:
    create(client, "refusals")
    sid = session_id(secure, "refusals")
    before = secure.event_count()
    bad = datum(ref_log_prob={"data": [0.0] * 4, "dtype": "float32"})
    answer = client.runtime("POST", "/v1/training-sessions/refusals/operations", fb(1, "x", bad))
    assert (answer.status, answer.code) == (400, "ValidationException")
    assert answer.error_type == "ValidationException"  # rest-json: the header names the code
    assert "ref_log_prob" in answer.body["message"]
    assert secure.event_count() == before
    with secure.engine.connect() as conn:
        refused = conn.execute(
            sa.text("SELECT seq_id FROM refused_seqs WHERE session_id = :s"), {"s": sid}
        ).scalars()
        assert list(refused) == [1]
    detail = describe(client, "refusals").body["TrainingSessionDetail"]
    assert detail["LastReceivedSequenceNumber"] == 1


def test_a_pending_operation_polls_as_not_done(client: SignedClient) -> None:
    create(client, "polls")
    op = client.runtime("POST", "/v1/training-sessions/polls/operations", fb(1, "p", datum())).body[
        "operationId"
    ]
    answer = client.runtime("GET", f"/v1/training-sessions/polls/operations/{op}")
    assert answer.status == 200 and answer.body["status"] in ("Pending", "InProgress")
    assert "operationResult" not in answer.body
    as_sampling = client.runtime("GET", f"/v1/training-sessions/polls/sampling-operations/{op}")
    assert (as_sampling.status, as_sampling.code) == (404, "ResourceNotFoundException")
    unknown = client.runtime("GET", "/v1/training-sessions/polls/operations/req-0")
    assert unknown.code == "ResourceNotFoundException"


def test_a_sample_gets_an_operation_id(client: SignedClient) -> None:
    create(client, "samples")
    body = {
        "operationConfig": {
            "sample": {
                "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
                "numSamples": 2,
                "samplingParams": {"maxTokens": 512, "temperature": 0.7},
            }
        }
    }
    first = client.runtime("POST", "/v1/training-sessions/samples/sampling-operations", body)
    second = client.runtime("POST", "/v1/training-sessions/samples/sampling-operations", body)
    assert first.status == 200 and second.status == 200
    assert first.body["operationId"] != second.body["operationId"]
    too_short = {**body}
    too_short["operationConfig"]["sample"]["samplingParams"]["maxTokens"] = 16
    refused = client.runtime("POST", "/v1/training-sessions/samples/sampling-operations", body)
    assert refused.code == "ValidationException"
    assert "greater than or equal to 512" in refused.body["message"]


# --- the registry --------------------------------------------------------------------------


def test_model_package_groups(client: SignedClient) -> None:
    made = client.control("CreateModelPackageGroup", {"ModelPackageGroupName": "mine"})
    assert made.body["ModelPackageGroupArn"].endswith(":model-package-group/mine")
    again = client.control("CreateModelPackageGroup", {"ModelPackageGroupName": "mine"})
    assert again.code == "ResourceInUse"
    described = client.control("DescribeModelPackageGroup", {"ModelPackageGroupName": "mine"})
    assert described.body["ModelPackageGroupStatus"] == "Completed"
    listed = client.control("ListModelPackages", {"ModelPackageGroupName": made.body[
        "ModelPackageGroupArn"]})  # fmt: skip
    assert listed.body == {"ModelPackageSummaryList": []}
    missing = client.control(
        "DescribeModelPackage",
        {"ModelPackageName": "arn:aws:sagemaker:us-west-2:123456789012:model-package/mine/1"},
    )
    assert missing.code == "ResourceNotFound" and "does not exist" in missing.body["message"]


# --- the protocols' error shapes -----------------------------------------------------------


def test_an_unknown_target_is_unknown_operation(client: SignedClient) -> None:
    answer = client.control("CreateTrainingJob", {})
    assert (answer.status, answer.code) == (400, "UnknownOperationException")


def test_a_body_that_is_not_json_is_a_validation_exception(client: SignedClient) -> None:
    answer = client.send(
        "POST",
        "/",
        b"{nope",
        {"Content-Type": JSON_11, "X-Amz-Target": "SageMaker.ListTrainingSessions"},  # fmt: skip
    )
    assert (answer.status, answer.code) == (400, "ValidationException")
    runtime = client.send(
        "POST", "/v1/training-sessions/x/operations", b"[1]", {"Content-Type": "application/json"}
    )
    assert runtime.status in (400, 404) and runtime.error_type is not None


def test_hostile_bodies_are_refused_on_every_route_and_append_nothing(
    client: SignedClient, secure: SecureApp
) -> None:
    """Deep nesting, a non-object, NaN, a NUL, a huge integer: a 4xx in the route's protocol
    on every route that reads a body, never a 5xx, and nothing appended."""
    create(client, "hostile")
    routes = [
        ("/", {"Content-Type": JSON_11, "X-Amz-Target": "SageMaker.CreateTrainingSession"}),
        ("/v1/training-sessions/hostile/operations", {"Content-Type": "application/json"}),
        ("/v1/training-sessions/hostile/sampling-operations", {"Content-Type": "application/json"}),
        ("/training-sessions/hostile/sample", {"Content-Type": "application/json"}),
    ]
    bodies = [
        b"[" * 100_000 + b"]" * 100_000,
        b"[1, 2]",
        b'{"sequenceNumber": NaN}',
        rb'{"TrainingSessionName": "a\u0000b"}',
        b'{"sequenceNumber": ' + b"9" * 400 + b"}",
        b"\xff\xfe",
    ]
    before = secure.event_count()
    for path, headers in routes:
        for body in bodies:
            answer = client.send("POST", path, body, headers)
            assert 400 <= answer.status < 500, (path, body[:30], answer.body)
            assert answer.code is not None, (path, answer.body)
    assert secure.event_count() == before


def test_a_session_whose_adapter_could_not_be_made_describes_itself_failed(
    client: SignedClient, secure: SecureApp
) -> None:
    """The SDK waits for Running and gives up on Failed, with ErrorDetails as its message."""
    from treadle.platform.operations import operations

    create(client, "unmade")
    sid = session_id(secure, "unmade")
    with secure.engine.begin() as conn:
        op = operations.training_op_at(conn, sid, 0)
        lease = conn.execute(
            sa.text("SELECT worker_id, lease_epoch FROM sessions WHERE id = :s"), {"s": sid}
        ).one()
        assert op is not None
        operations.settle(
            conn, op, worker_id=lease.worker_id, lease_epoch=lease.lease_epoch, result=None,
            error={"category": "server", "code": "internal", "message": "out of memory"},
            usage={"tokens": {}},
        )  # fmt: skip
    detail = describe(client, "unmade").body["TrainingSessionDetail"]
    assert detail["TrainingSessionStatus"] == "Failed"
    assert detail["ErrorDetails"] == "out of memory"


def test_a_body_over_the_limit_is_a_413_in_the_protocols_shape(
    client: SignedClient, secure: SecureApp
) -> None:
    from dataclasses import replace

    from treadle.api.app import create_app

    small = create_app(replace(secure.app.extensions["treadle"].config,
                               sagemaker_max_body_bytes=4096))  # fmt: skip
    try:
        signed = SignedClient(small, client.access_key_id, client.secret)
        big = fb(1, "big", datum(2000))
        answer = signed.runtime("POST", "/v1/training-sessions/x/operations", big)
        assert (answer.status, answer.code) == (413, "ValidationException")
        assert "TREADLE_SAGEMAKER_MAX_BODY_BYTES" in answer.body["message"]
        control = signed.control("ListTrainingSessions", {"NameContains": "x" * 5000})
        assert (control.code, control.content_type.split(";")[0]) == (
            "ValidationException", JSON_11,
        )  # fmt: skip
    finally:
        small.extensions["treadle"].close()
