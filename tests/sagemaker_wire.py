"""SageMaker's two wire protocols from a test, in process: each request signed by botocore's own
SigV4 signer (the SDK's), then sent to a Flask app's test client; answers as (status, error code,
JSON body). For the surface's refusals and bookkeeping, which need no worker; the SDK itself
runs against a live platform in tests/compat."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from flask import Flask

JSON_11 = "application/x-amz-json-1.1"


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any
    error_type: str | None  # rest-json's x-amzn-ErrorType header
    content_type: str

    @property
    def code(self) -> str | None:
        """The AWS error code: the header's (rest-json), else the body's `__type`."""
        if self.error_type:
            return self.error_type
        return self.body.get("__type") if isinstance(self.body, dict) else None


@dataclass
class SignedClient:
    app: Flask
    access_key_id: str
    secret: str
    region: str = "us-west-2"

    def send(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Answer:
        request = AWSRequest(
            method=method, url=f"http://localhost{path}", data=body, headers=headers or {}
        )
        SigV4Auth(Credentials(self.access_key_id, self.secret), "sagemaker", self.region).add_auth(
            request
        )
        response = self.app.test_client().open(
            path, method=method, data=body, headers=dict(request.headers.items())
        )
        raw = response.get_data()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw
        return Answer(
            response.status_code,
            parsed,
            response.headers.get("x-amzn-ErrorType"),
            response.headers.get("Content-Type", ""),
        )

    def control(self, operation: str, body: dict[str, Any] | None = None) -> Answer:
        """A json 1.1 call: `POST /`, X-Amz-Target: SageMaker.<operation>."""
        headers = {"Content-Type": JSON_11, "X-Amz-Target": f"SageMaker.{operation}"}
        return self.send("POST", "/", json.dumps(body or {}).encode(), headers)

    def runtime(self, method: str, path: str, body: dict[str, Any] | None = None) -> Answer:
        """A rest-json call of the runtime."""
        data = b"" if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        return self.send(method, path, data, headers)
