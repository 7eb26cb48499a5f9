"""SigV4 verification (treadle/api/sagemaker/sigv4.py) against requests botocore itself signed:
SigV4Auth over AWSRequest for each request shape the SageMaker SDK sends, and boto3 clients of
both services captured before they reach the network. Each refusal carries its AWS error code."""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest, AWSResponse
from botocore.credentials import Credentials
from flask import Flask

from treadle.api.sagemaker import sigv4
from treadle.platform.errors import AuthenticationError, PermissionDeniedError
from treadle.platform.tenancy.access_keys import SecretsKeyError
from treadle.platform.tenancy.tenants import Principal

AKID = "TRDLAAAABBBBCCCCDDDD"
SECRET = "s3cr3tS3CR3Ts3cr3tS3CR3Ts3cr3tS3CR3Tab12"
DISABLED_AKID = "TRDLDISABLEDTENANT00"
REVOKED_AKID = "TRDLREVOKEDKEY000000"
PRINCIPAL = Principal(key_id="key-0123456789abcdef", tenant_id="acme", role="member")
ENDPOINT = "http://127.0.0.1:8080"
TARGET = "SageMaker.DescribeTrainingSession"


def lookup(access_key_id: str) -> tuple[Principal, str]:
    if access_key_id == AKID:
        return PRINCIPAL, SECRET
    if access_key_id == DISABLED_AKID:
        raise PermissionDeniedError("tenant acme is disabled")
    if access_key_id == REVOKED_AKID:
        raise AuthenticationError(f"access key {access_key_id} was revoked")
    raise AuthenticationError(f"unknown access key id {access_key_id!r}")


@dataclass
class Signed:
    """A signed request as the server receives it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    signed_at: datetime

    def verify(self, **overrides: Any) -> sigv4.SignedBy:
        parts: dict[str, Any] = {
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "headers": self.headers,
            "body": self.body,
            "lookup": lookup,
            "now": self.signed_at + timedelta(seconds=2),
            "regions": (),
        }
        return sigv4.verify(**{**parts, **overrides})

    def refused(self, **overrides: Any) -> sigv4.SigV4Error:
        with pytest.raises(sigv4.SigV4Error) as caught:
            self.verify(**overrides)
        return caught.value


def sign(
    method: str,
    url: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    access_key_id: str = AKID,
    secret: str = SECRET,
    region: str = "us-east-1",
    service: str = "sagemaker",
    token: str | None = None,
) -> Signed:
    """Sign with botocore's SigV4Auth, then add what the HTTP client adds (Host)."""
    request = AWSRequest(method=method, url=url, data=body, headers=dict(headers or {}))
    SigV4Auth(Credentials(access_key_id, secret, token), service, region).add_auth(request)
    parts = urlsplit(url)
    sent = {**{k: str(v) for k, v in request.headers.items()}, "Host": parts.netloc}
    signed_at = datetime.strptime(sent["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    return Signed(method, parts.path, parts.query, sent, body, signed_at)


def json11(body: dict[str, Any] | None = None, target: str = TARGET, **kwargs: Any) -> Signed:
    headers = {"X-Amz-Target": target, "Content-Type": "application/x-amz-json-1.1"}
    return sign("POST", ENDPOINT + "/", json.dumps(body or {}).encode(), headers, **kwargs)


def test_json_11_request_verifies_with_its_principal_and_region() -> None:
    signed = json11({"TrainingSessionName": "run-1"}, region="eu-west-2")
    assert signed.headers["Authorization"].count(
        "SignedHeaders=content-type;host;x-amz-date;x-amz-target"
    )
    found = signed.verify()
    assert found == sigv4.SignedBy(PRINCIPAL, AKID, "eu-west-2", "sagemaker")


def test_rest_json_post_with_a_body_and_path_parameters_verifies() -> None:
    body = json.dumps({"sequenceNumber": 3, "clientToken": "0f7c"}).encode()
    signed = sign(
        "POST",
        ENDPOINT + "/v1/training-sessions/my-run-7/training-operations",
        body,
        {"Content-Type": "application/json"},
    )
    assert signed.verify().principal == PRINCIPAL


def test_rest_json_get_verifies() -> None:
    signed = sign("GET", ENDPOINT + "/v1/training-sessions/my-run-7/operations/op-42")
    assert "content-type" not in signed.headers["Authorization"]
    assert signed.verify().region == "us-east-1"


def test_query_string_with_several_and_repeated_keys_verifies() -> None:
    url = ENDPOINT + "/v1/training-sessions?b=2&a=1&a=0&MaxResults=10&empty=&c=x%20y%2Fz"
    assert sign("GET", url).verify().access_key_id == AKID


def test_a_path_that_needs_encoding_verifies_as_botocore_encodes_it() -> None:
    signed = sign("GET", ENDPOINT + "/v1/training-sessions/a%20b~c/operations/x%2Fy")
    assert signed.verify().principal == PRINCIPAL


def test_boto3_clients_of_both_services_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real clients' requests (json 1.1 control plane, rest-json runtime), as they would
    leave the machine, without a session token."""
    for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    sent: list[Any] = []

    def capture(request: Any, **_: Any) -> AWSResponse:
        sent.append(request)
        return AWSResponse(request.url, 200, {}, None)  # type: ignore[arg-type]

    session = boto3.session.Session(
        aws_access_key_id=AKID, aws_secret_access_key=SECRET, region_name="ap-south-1"
    )
    for service, call in (
        ("sagemaker", lambda c: c.describe_training_session(TrainingSessionName="run-1")),
        (
            "sagemakertrainingsessionruntime",
            lambda c: c.get_training_operation_result(
                trainingSessionName="run-1", operationId="op-1"
            ),
        ),
    ):
        client = session.client(service, endpoint_url=ENDPOINT)
        client.meta.events.register("before-send", capture)
        with contextlib.suppress(Exception):  # the answer does not matter, the request does
            call(client)
    assert len(sent) == 2
    for request in sent:
        parts = urlsplit(request.url)
        headers = {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        headers["Host"] = parts.netloc
        found = sigv4.verify(
            method=request.method,
            path=parts.path,
            query=parts.query,
            headers=headers,
            body=request.body or b"",
            lookup=lookup,
            now=datetime.now(UTC),
        )
        assert (found.principal, found.region) == (PRINCIPAL, "ap-south-1")


def test_a_flask_request_verifies_through_the_raw_path() -> None:
    signed = sign("GET", ENDPOINT + "/v1/training-sessions/a%2Fb/operations/op-1?x=1&a=2")
    app = Flask("t")
    url = signed.path + "?" + signed.query
    with app.test_request_context(url, method="GET", headers=signed.headers):
        from flask import request

        assert sigv4.raw_path(request) == "/v1/training-sessions/a%2Fb/operations/op-1"
        found = sigv4.verify_flask_request(request, lookup, (), now=signed.signed_at)
    assert found.principal == PRINCIPAL


def test_the_wrong_secret_is_an_invalid_signature() -> None:
    error = json11(secret=SECRET[:-1] + "X").refused()
    assert error.aws_code == "InvalidSignatureException"
    assert error.message.startswith("The request signature we calculated does not match")


def test_an_unknown_key_is_unrecognized() -> None:
    assert json11(access_key_id="TRDLUNKNOWNKEY000000").refused().aws_code == (
        "UnrecognizedClientException"
    )


def test_a_revoked_key_is_unrecognized() -> None:
    error = json11(access_key_id=REVOKED_AKID).refused()
    assert error.aws_code == "UnrecognizedClientException" and "revoked" in error.message


def test_a_disabled_tenant_is_access_denied_with_403() -> None:
    error = json11(access_key_id=DISABLED_AKID).refused()
    assert error.aws_code == "AccessDeniedException"
    assert isinstance(error, PermissionDeniedError) and error.status == 403


def test_a_server_without_a_secrets_key_says_so() -> None:
    def unconfigured(access_key_id: str) -> tuple[Principal, str]:
        raise SecretsKeyError("this Treadle server has no TREADLE_SECRETS_KEY")

    error = json11().refused(lookup=unconfigured)
    assert error.aws_code == "UnrecognizedClientException"
    assert "TREADLE_SECRETS_KEY" in error.message


def test_a_signature_ten_minutes_old_has_expired() -> None:
    signed = json11()
    error = signed.refused(now=signed.signed_at + timedelta(minutes=10))
    assert error.aws_code == "InvalidSignatureException"
    assert error.message.startswith("Signature expired: ")
    assert "is now earlier than" in error.message


def test_a_signature_ten_minutes_ahead_is_not_yet_current() -> None:
    signed = json11()
    error = signed.refused(now=signed.signed_at - timedelta(minutes=10))
    assert error.aws_code == "InvalidSignatureException"
    assert error.message.startswith("Signature not yet current: ")


def test_four_minutes_of_skew_either_way_is_accepted() -> None:
    signed = json11()
    signed.verify(now=signed.signed_at + timedelta(minutes=4))
    signed.verify(now=signed.signed_at - timedelta(minutes=4))


def test_a_region_the_server_does_not_accept_is_refused() -> None:
    signed = json11(region="us-west-2")
    assert signed.verify(regions=("us-west-2", "eu-west-1")).region == "us-west-2"
    error = signed.refused(regions=("eu-west-1",))
    assert error.aws_code == "InvalidSignatureException"
    assert "region" in error.message and "TREADLE_AWS_REGIONS" in error.message


def test_a_malformed_region_is_refused_even_with_no_list() -> None:
    error = json11(region="us-east-1:evil").refused()
    assert error.aws_code == "InvalidSignatureException" and "region" in error.message


def test_another_service_is_refused() -> None:
    error = json11(service="s3").refused()
    assert error.aws_code == "InvalidSignatureException"
    assert "scoped to correct service: 'sagemaker'" in error.message


def test_a_scope_date_other_than_x_amz_date_is_refused() -> None:
    signed = json11()
    scope_date = signed.signed_at.strftime("%Y%m%d")
    other = (signed.signed_at - timedelta(days=1)).strftime("%Y%m%d")
    signed.headers["Authorization"] = signed.headers["Authorization"].replace(
        f"/{scope_date}/", f"/{other}/"
    )
    error = signed.refused()
    assert error.aws_code == "InvalidSignatureException"
    assert "Date in Credential scope does not match" in error.message


def test_another_terminator_is_refused() -> None:
    signed = json11()
    signed.headers["Authorization"] = signed.headers["Authorization"].replace(
        "/aws4_request", "/aws5_request"
    )
    assert signed.refused().aws_code == "InvalidSignatureException"


def test_a_tampered_body_is_an_invalid_signature() -> None:
    signed = json11({"TrainingSessionName": "run-1"})
    error = signed.refused(body=json.dumps({"TrainingSessionName": "run-2"}).encode())
    assert error.aws_code == "InvalidSignatureException"


def test_a_tampered_target_is_an_invalid_signature() -> None:
    signed = json11()
    signed.headers["X-Amz-Target"] = "SageMaker.DeleteTrainingSession"
    assert signed.refused().aws_code == "InvalidSignatureException"


def test_an_unsigned_target_is_an_incomplete_signature() -> None:
    signed = sign("POST", ENDPOINT + "/", b"{}", {"Content-Type": "application/x-amz-json-1.1"})
    signed.headers["X-Amz-Target"] = TARGET
    error = signed.refused()
    assert error.aws_code == "IncompleteSignatureException" and "X-Amz-Target" in error.message


def test_a_content_sha256_that_is_not_the_bodys_is_refused() -> None:
    signed = sign("POST", ENDPOINT + "/v1/x", b"{}", {"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"})
    error = signed.refused()
    assert error.aws_code == "InvalidSignatureException" and "x-amz-content-sha256" in error.message


def test_no_authorization_header_is_a_missing_token() -> None:
    signed = json11()
    del signed.headers["Authorization"]
    error = signed.refused()
    assert error.aws_code == "MissingAuthenticationTokenException"
    assert "treadle keys create --aws" in error.message


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer tml-abc",
        "AWS4-HMAC-SHA256",
        "AWS4-HMAC-SHA256 Credential=TRDLAAAABBBBCCCCDDDD/20250101/us-east-1/sagemaker/aws4_request",
        "AWS4-HMAC-SHA256 Credential=TRDLAAAABBBBCCCCDDDD/20250101/us-east-1/sagemaker, "
        "SignedHeaders=host;x-amz-date, Signature=abc",
        "AWS4-HMAC-SHA256 Credential=a/b/c/d/e SignedHeaders=host Signature=abc",
    ],
    ids=["bearer", "no-parts", "no-signature", "short-credential", "no-commas"],
)
def test_a_malformed_authorization_is_an_incomplete_signature(authorization: str) -> None:
    signed = json11()
    signed.headers["Authorization"] = authorization
    assert signed.refused().aws_code == "IncompleteSignatureException"


def test_host_and_x_amz_date_must_be_signed() -> None:
    signed = json11()
    original = signed.headers["Authorization"]
    signed.headers["Authorization"] = original.replace("content-type;host;", "content-type;")
    assert "'Host'" in signed.refused().message
    signed.headers["Authorization"] = original.replace(";x-amz-date;", ";")
    assert signed.refused().aws_code == "IncompleteSignatureException"


def test_a_missing_x_amz_date_is_an_incomplete_signature() -> None:
    signed = json11()
    del signed.headers["X-Amz-Date"]
    error = signed.refused()
    assert error.aws_code == "IncompleteSignatureException" and "X-Amz-Date" in error.message


def test_a_security_token_is_refused_with_how_to_fix_it() -> None:
    error = json11(token="FwoGZXIvYXdzEJr//////////session").refused()
    assert error.aws_code == "UnrecognizedClientException"
    assert "AWS_SESSION_TOKEN" in error.message and "no session tokens" in error.message


def test_sigv4_errors_are_authentication_errors_and_pickle() -> None:
    error = sigv4.SigV4Error("InvalidSignatureException", "nope")
    assert isinstance(error, AuthenticationError) and error.status == 401
    again = pickle.loads(pickle.dumps(error))
    assert (again.aws_code, again.message) == ("InvalidSignatureException", "nope")
    denied = pickle.loads(pickle.dumps(sigv4.SigV4AccessDeniedError("AccessDeniedException", "x")))
    assert isinstance(denied, PermissionDeniedError) and denied.aws_code == "AccessDeniedException"


@pytest.fixture(autouse=True)
def _no_aws_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[None]:
    """boto3 reads no profile or config file of this machine."""
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    yield
