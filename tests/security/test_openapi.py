"""The OpenAPI document: every route the app serves is in it (and nothing else), and requests
generated from it by schemathesis never get a 5xx, nor append anything when refused."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.secure_app import SecureApp
from treadle.api import openapi

pytestmark = pytest.mark.integration


@schemathesis.serializer(openapi.PROTOBUF)
def _protobuf(ctx: Any, value: Any) -> bytes:
    """Generated protobuf bodies are arbitrary bytes: the decoder must refuse them with a 4xx."""
    return value if isinstance(value, bytes) else str(value).encode()


def test_every_route_is_documented_and_every_entry_is_a_route(secure: SecureApp) -> None:
    missing, stale = openapi.undocumented(secure.app)
    assert missing == [], "routes without an entry in treadle/api/openapi.py ROUTES"
    assert stale == [], "entries in ROUTES for routes the app does not serve"


def test_the_document_is_served_without_a_key(secure: SecureApp) -> None:
    response = secure.call("GET", "/api/v1/openapi.json", None)
    assert response.status_code == 200
    document = response.get_json()
    assert document["openapi"].startswith("3.1")
    assert "/api/v1/create_model" in document["paths"]
    body = document["paths"]["/api/v1/create_model"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CreateModel"
    }
    assert "lora_config" in document["components"]["schemas"]["CreateModel"]["properties"]


def test_generated_requests_never_get_a_5xx_nor_append_when_refused(secure: SecureApp) -> None:
    """schemathesis generates requests for every operation of the served document (valid and
    invalid ones); none may be a server error, and a refused one appends no event."""
    schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", secure.app)
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= len(openapi.ROUTES)

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=10,
            deadline=None,
            derandomize=True,  # the same cases on every run: CI cannot flake on a new one
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: Any) -> None:
            before = secure.event_count()
            response = case.call(headers={"X-API-Key": secure.operator_key})
            where = f"{case.method} {case.formatted_path}"
            if response.status_code >= 500:
                failures.append(f"{where}: {response.status_code} {response.text[:200]}")
            elif response.status_code >= 400 and secure.event_count() != before:
                failures.append(f"{where}: refused with {response.status_code} but appended")

        check()
    assert failures == []
