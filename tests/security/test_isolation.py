"""Tenant isolation, route by route: every route of the URL map has a case here (a new route
without one fails `test_every_route_has_a_case`). With another tenant's key, a route that takes
an id answers 404 exactly like a missing object (403 where the role decides first), shows
nothing of the object, and changes nothing; a listing shows none of another tenant's objects."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.integration.wire_client import datum
from tests.secure_app import SecureApp
from treadle.platform.checkpoints import checkpoints
from treadle.platform.tenancy import keys, tenants

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
# Only tenant A's objects hold these: no answer to tenant B may contain them.
MARKERS = ("a-private-run-name", "a-private-metadata", "a-private-group")


@dataclass
class World:
    """Tenant A's objects, and keys of A and of B (each a tenant admin)."""

    secure: SecureApp
    a_key: str
    b_key: str
    ids: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    json: dict[str, Any] | None = None
    data: bytes | None = None
    expect: int = 404  # what tenant B gets
    own_not_404: bool = True  # tenant A's own key finds the object (a read-only route)


def _key(secure: SecureApp, tenant_id: str) -> tuple[str, str]:
    """(key id, plaintext) of a new admin key of a new tenant."""
    with secure.engine.begin() as conn:
        tenants.ensure_tenant(conn, tenant_id)
        return keys.create_tenant_key(conn, tenant_id, "admin")


def _ok(response: Any) -> Any:
    assert response.status_code < 300, response.get_data(as_text=True)
    return response.get_json()


@pytest.fixture(scope="module")
def world(secure: SecureApp) -> World:
    secure.keep_worker_alive()
    suffix = secure.data_dir.name[-6:].lower().replace("_", "-")
    a_tenant = f"iso-a-{suffix}"
    a_key_id, a_key = _key(secure, a_tenant)
    w = World(secure, a_key, _key(secure, f"iso-b-{suffix}")[1])
    call = secure.call
    session = _ok(call("POST", "/api/v1/create_session", w.a_key, json={"tags": []}))
    model = _ok(
        call(
            "POST",
            "/api/v1/create_model",
            w.a_key,
            json={
                "session_id": session["session_id"],
                "model_seq_id": 0,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 4},
                "training_session_name": MARKERS[0],
                "user_metadata": {"note": MARKERS[1]},
                "model_package_group": MARKERS[2],
            },
        )  # fmt: skip
    )
    sampler = _ok(
        call(
            "POST",
            "/api/v1/create_sampling_session",
            w.a_key,
            json={
                "session_id": session["session_id"],
                "sampling_session_seq_id": 0,
                "base_model": BASE_MODEL,
            },
        )  # fmt: skip
    )
    b_session = _ok(call("POST", "/api/v1/create_session", w.b_key, json={"tags": []}))
    model_id = model["model_id"]
    path = checkpoints.CheckpointPath(model_id, "weights", "a-ckpt")
    with secure.engine.begin() as conn:  # a registered checkpoint (files are not needed here)
        tenant_id = conn.execute(
            sa.text("SELECT tenant_id FROM sessions WHERE id = :id"), {"id": model_id}
        ).scalar_one()
        checkpoints.register(
            conn, tenant_id=tenant_id, path=path, storage_prefix=f"tenants/{tenant_id}/x",
            size_bytes=1, has_optimizer=True, is_merged=False, ttl_seconds=None,
        )  # fmt: skip
    w.ids = {
        "session": session["session_id"],
        "b_session": b_session["session_id"],
        "model": model_id,
        "request": model["request_id"],
        "sampler": sampler["sampling_session_id"],
        "checkpoint": str(path),
        "checkpoint_id": path.checkpoint_id,
        "tenant": a_tenant,
        "key": a_key_id,
    }
    return w


def _fb(model_id: str) -> bytes:
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=1,
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum([1, 2, 3])], loss_fn="cross_entropy"
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


NO_ID = "no id: nothing of another tenant to reach"
Cases = Callable[[dict[str, str]], list[Case]]

SIGNED = (
    "signed with SigV4, not X-API-Key: tests/security/test_sagemaker_surface.py "
    "(test_another_tenants_names_and_operations_do_not_exist) reaches for tenant A's names, "
    "operations and packages with tenant B's access key"
)

# endpoint -> the requests tenant B makes with tenant A's ids (or why there are none).
CASES: dict[str, Cases | str] = {
    "sagemaker.dispatch": SIGNED,
    "sagemaker.execute_training_operation": SIGNED,
    "sagemaker.get_training_operation_result": SIGNED,
    "sagemaker.execute_sampling_operation": SIGNED,
    "sagemaker.get_sampling_operation_result": SIGNED,
    "sagemaker.sample_training_session": SIGNED,
    "sagemaker.sample_training_session_with_response_stream": SIGNED,
    "sessions.healthz": NO_ID,
    "docs.openapi_document": NO_ID,
    "metrics.prometheus_metrics": "counts by route, type and reason only: no id to name",
    "sessions.client_config": NO_ID,
    "sessions.dynamic_config": NO_ID,
    "sessions.server_capabilities": NO_ID,
    "sessions.create_session": NO_ID,
    "sessions.telemetry": NO_ID,
    # The base models are the platform's, the same for every tenant; only the operator
    # registers and retires them.
    "models.list_models": NO_ID,
    "models.describe_model": NO_ID,
    "models.register_model": lambda i: [
        Case(
            "POST",
            "/api/v1/treadle/base_models",
            {"name": "acme/m", "path": "/nonexistent"},
            expect=403,
            own_not_404=False,
        )  # fmt: skip
    ],
    "models.retire_model": lambda i: [
        Case(
            "POST",
            f"/api/v1/treadle/base_models/{BASE_MODEL}/retire",
            {},
            expect=403,
            own_not_404=False,
        )  # fmt: skip
    ],
    "treadle.tokenizer": NO_ID,
    # Public tokenizer files of catalogue models, the same for every tenant (routes_hf).
    **dict.fromkeys(
        ("hf.model_info", "hf.model_info_at_revision", "hf.tree", "hf.tree_path", "hf.resolve"),
        NO_ID,
    ),
    "sessions.session_heartbeat": lambda i: [
        Case("POST", "/api/v1/session_heartbeat", {"session_id": i["session"]}, own_not_404=False)
    ],
    "sessions.finish_session": lambda i: [
        Case("POST", f"/api/v1/sessions/{i['session']}/finish", {}, own_not_404=False)
    ],
    "training.create_model": lambda i: [
        Case(
            "POST",
            "/api/v1/create_model",
            {"session_id": i["session"], "model_seq_id": 9, "base_model": BASE_MODEL},
            own_not_404=False,
        )  # fmt: skip
    ],
    "training.get_info": lambda i: [Case("POST", "/api/v1/get_info", {"model_id": i["model"]})],
    "training.forward_backward": lambda i: [
        Case("POST", "/api/v1/forward_backward", data=_fb(i["model"]), own_not_404=False)
    ],
    "training.optim_step": lambda i: [
        Case(
            "POST", "/api/v1/optim_step", {"model_id": i["model"], "seq_id": 1}, own_not_404=False
        )  # fmt: skip
    ],
    "checkpoints.save_weights": lambda i: [
        Case(
            "POST",
            "/api/v1/save_weights",
            {"model_id": i["model"], "seq_id": 1, "path": "b-save"},
            own_not_404=False,
        )  # fmt: skip
    ],
    "checkpoints.save_weights_for_sampler": lambda i: [
        Case(
            "POST",
            "/api/v1/save_weights_for_sampler",
            {"model_id": i["model"], "seq_id": 1, "sampling_session_seq_id": 7},
            own_not_404=False,
        )  # fmt: skip
    ],
    "checkpoints.load_weights": lambda i: [
        Case(
            "POST",
            "/api/v1/load_weights",
            {"path": i["checkpoint"], "session_id": i["b_session"], "model_seq_id": 0},
            own_not_404=False,
        ),
        Case(
            "POST",
            "/api/v1/load_weights",
            {"path": i["checkpoint"], "model_id": i["model"], "seq_id": 1},
            own_not_404=False,
        ),
    ],  # fmt: skip
    "sampling.create_sampling_session": lambda i: [
        Case(
            "POST",
            "/api/v1/create_sampling_session",
            {
                "session_id": i["b_session"],
                "sampling_session_seq_id": 1,
                "model_path": i["checkpoint"],
            },
            own_not_404=False,
        ),
        Case(
            "POST",
            "/api/v1/create_sampling_session",
            {"session_id": i["session"], "sampling_session_seq_id": 1, "base_model": BASE_MODEL},
            own_not_404=False,
        ),
    ],  # fmt: skip
    "sampling.get_sampler": lambda i: [Case("GET", f"/api/v1/samplers/{i['sampler']}")],
    "sampling.asample": lambda i: [
        Case(
            "POST",
            "/api/v1/asample",
            {
                "sampling_session_id": i["sampler"],
                "seq_id": 0,
                "prompt": {"chunks": [{"tokens": [1, 2]}]},
            },
            own_not_404=False,
        )  # fmt: skip
    ],
    "futures.retrieve_future": lambda i: [
        Case("POST", "/api/v1/retrieve_future", {"request_id": i["request"]})
    ],
    "checkpoints.training_runs": lambda i: [Case("GET", "/api/v1/training_runs", expect=200)],
    "checkpoints.training_run": lambda i: [Case("GET", f"/api/v1/training_runs/{i['model']}")],
    "checkpoints.run_checkpoints": lambda i: [
        Case("GET", f"/api/v1/training_runs/{i['model']}/checkpoints")
    ],
    "checkpoints.all_checkpoints": lambda i: [
        Case("GET", "/api/v1/checkpoints", expect=200),
        Case("GET", f"/api/v1/checkpoints?model_package_group={MARKERS[2]}", expect=200),
    ],
    "checkpoints.delete_checkpoint": lambda i: [
        Case(
            "DELETE",
            f"/api/v1/training_runs/{i['model']}/checkpoints/{i['checkpoint_id']}",
            own_not_404=False,
        )  # fmt: skip
    ],
    "checkpoints.checkpoint_ttl": lambda i: [
        Case(
            method,
            f"/api/v1/training_runs/{i['model']}/checkpoints/{i['checkpoint_id']}/ttl",
            {"ttl_seconds": 60},
            own_not_404=False,
        )
        for method in ("PUT", "POST")
    ],  # fmt: skip
    "checkpoints.weights_info": lambda i: [
        Case("POST", "/api/v1/weights_info", {"tinker_path": i["checkpoint"]})
    ],
    "checkpoints.checkpoint_files": lambda i: [
        Case(
            "GET", f"/api/v1/treadle/checkpoints/files?path={i['checkpoint']}", own_not_404=False
        )  # fmt: skip
    ],
    "checkpoints.checkpoint_file": lambda i: [
        Case(
            "GET",
            f"/api/v1/treadle/checkpoints/file?path={i['checkpoint']}"
            "&name=adapter_model.safetensors",
            own_not_404=False,
        )  # fmt: skip
    ],
    "treadle.describe": lambda i: [Case("GET", f"/api/v1/treadle/sessions/{i['model']}")],
    "treadle.session_events": lambda i: [
        Case("GET", f"/api/v1/treadle/sessions/{i['model']}/events")
    ],
    "treadle.session_timeline": lambda i: [
        Case("GET", f"/api/v1/treadle/sessions/{i['model']}/timeline")
    ],
    "treadle.list_sessions": lambda i: [
        Case("GET", "/api/v1/treadle/sessions", expect=200),
        Case("GET", f"/api/v1/treadle/sessions?tenant={i['tenant']}", expect=403),
        Case("GET", "/api/v1/treadle/sessions?tenant=*", expect=403),
    ],
    "lineage.open_fork": lambda i: [
        Case(
            "POST",
            f"/api/v1/treadle/sessions/{i['model']}/fork",
            {"session_id": i["b_session"], "model_seq_id": 7, "at_seq": 0},
            own_not_404=False,
        )  # fmt: skip
    ],
    "lineage.open_replay": lambda i: [
        Case(
            "POST",
            f"/api/v1/treadle/sessions/{i['model']}/replay",
            {"session_id": i["b_session"], "model_seq_id": 8},
            own_not_404=False,
        )  # fmt: skip
    ],
    "lineage.rebuild_report": lambda i: [
        Case("GET", f"/api/v1/treadle/sessions/{i['model']}/rebuild")
    ],
    "treadle.stop": lambda i: [
        Case("POST", f"/api/v1/treadle/sessions/{i['model']}/stop", {}, own_not_404=False)
    ],
    # Tenants are the operator's: a tenant admin is refused before any id is looked at.
    "admin.create_tenant": lambda i: [
        Case(
            "POST", "/api/v1/treadle/tenants", {"id": i["tenant"]}, expect=403, own_not_404=False
        )  # fmt: skip
    ],
    "admin.list_tenants": lambda i: [Case("GET", "/api/v1/treadle/tenants", expect=403)],
    # The platform's status is the operator's too: it shows every tenant's session counts.
    "openai.list_models": lambda i: [Case("GET", "/v1/models", expect=200, own_not_404=False)],
    "openai.completions": lambda i: [
        Case("POST", "/v1/completions", {"model": m, "prompt": "hi"})
        for m in (i["model"], i["checkpoint"])
    ],
    "openai.chat_completions": lambda i: [
        Case(
            "POST",
            "/v1/chat/completions",
            {"model": m, "messages": [{"role": "user", "content": "hi"}]},
        )  # fmt: skip
        for m in (i["model"], i["checkpoint"])
    ],
    "oai.list_models": lambda i: [Case("GET", "/oai/api/v1/models", expect=200, own_not_404=False)],
    "oai.completions": lambda i: [
        Case("POST", "/oai/api/v1/completions", {"model": m, "prompt": "hi"})
        for m in (i["model"], i["checkpoint"])
    ],
    "oai.chat_completions": lambda i: [
        Case(
            "POST",
            "/oai/api/v1/chat/completions",
            {"model": m, "messages": [{"role": "user", "content": "hi"}]},
        )  # fmt: skip
        for m in (i["model"], i["checkpoint"])
    ],
    "anthropic.messages": lambda i: [
        Case(
            "POST",
            "/anthropic/api/v1/messages",
            {"model": m, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        )  # fmt: skip
        for m in (i["model"], i["checkpoint"])
    ],
    "anthropic.count_tokens": lambda i: [
        Case(
            "POST",
            "/anthropic/api/v1/messages/count_tokens",
            {"model": m, "messages": [{"role": "user", "content": "hi"}]},
        )  # fmt: skip
        for m in (i["model"], i["checkpoint"])
    ],
    "status.platform_status": lambda i: [Case("GET", "/api/v1/treadle/status", expect=403)],
    "admin.disable_tenant": lambda i: [
        Case(
            "POST",
            f"/api/v1/treadle/tenants/{i['tenant']}/disable",
            {},
            expect=403,
            own_not_404=False,
        )  # fmt: skip
    ],
    "admin.enable_tenant": lambda i: [
        Case(
            "POST",
            f"/api/v1/treadle/tenants/{i['tenant']}/enable",
            {},
            expect=403,
            own_not_404=False,
        )  # fmt: skip
    ],
    # Keys: another tenant's are out of reach (403 to mint or list them, 404 for one by id).
    "admin.create_key": lambda i: [
        Case(
            "POST",
            "/api/v1/treadle/keys",
            {"tenant_id": i["tenant"], "role": "member"},
            expect=403,
            own_not_404=False,
        )  # fmt: skip
    ],
    "admin.list_keys": lambda i: [
        Case("GET", f"/api/v1/treadle/keys?tenant_id={i['tenant']}", expect=403)
    ],
    "admin.get_key": lambda i: [Case("GET", f"/api/v1/treadle/keys/{i['key']}")],
    "admin.revoke_key": lambda i: [  # never with A's own key: it would revoke it
        Case("POST", f"/api/v1/treadle/keys/{i['key']}/revoke", {}, own_not_404=False)
    ],
    # Billing: prices are platform-wide; another tenant's quota, usage and bill are refused
    # (403, like keys), its session's usage is a 404, and the Tinker routes show B's own only.
    "billing.list_prices": NO_ID,
    "billing.set_prices": lambda i: [
        Case(
            "POST",
            "/api/v1/treadle/prices",
            {"base_model": BASE_MODEL, "train": 1},
            expect=403,
            own_not_404=False,
        )
    ],
    "billing.get_quota": lambda i: [
        Case("GET", f"/api/v1/treadle/quotas/{i['tenant']}", expect=403)
    ],
    "billing.set_quota": lambda i: [
        Case(
            "PATCH",
            f"/api/v1/treadle/quotas/{i['tenant']}",
            {"max_sessions": 0},
            expect=403,
            own_not_404=False,
        )
    ],
    "billing.usage_report": lambda i: [
        Case("GET", f"/api/v1/treadle/usage?tenant={i['tenant']}", expect=403),
        Case("GET", "/api/v1/treadle/usage?tenant=*", expect=403),
        Case("GET", "/api/v1/treadle/usage?by=tenant,session,key", expect=200),
    ],
    "billing.bill": lambda i: [
        Case("GET", f"/api/v1/treadle/bill?tenant={i['tenant']}", expect=403),
        Case("GET", "/api/v1/treadle/bill", expect=200),
    ],
    "billing.session_usage": lambda i: [
        Case("GET", f"/api/v1/treadle/sessions/{i['model']}/usage")
    ],
    "tinker_billing.usage_events": lambda i: [
        Case("GET", f"/api/v1/billing/usage/events?{_this_hour()}", expect=200)
    ],
    "tinker_billing.checkpoint_storage": lambda i: [
        Case("GET", "/api/v1/billing/usage/checkpoints/current", expect=200)
    ],
    "tinker_sessions.list_sessions": lambda i: [
        Case("GET", "/api/v1/sessions?access_scope=accessible", expect=200)
    ],
    "tinker_sessions.get_session": lambda i: [
        Case("GET", f"/api/v1/sessions/{i['session']}?access_scope=accessible")
    ],
    "tinker_sessions.search_sessions": lambda i: [
        Case(
            "POST",
            "/api/v1/sessions/search",
            {"session_id": i["session"], "owner": {"type": "accessible"}},
            expect=200,
        ),
    ],
    "tinker_sessions.trace_export": lambda i: [
        Case("GET", f"/api/v1/sessions/{i['session']}/trace_export")
    ],
    "tinker_sessions.download_trace": "a secret token, not an id (tests/integration/"
    "test_tinker_sessions.py: an unknown or expired one is a 404)",
    "tinker_sessions.audit": lambda i: [Case("GET", "/api/v1/audit", expect=200)],
    # The rest of the Tinker surface (docs/tinker-compatibility.md).
    "checkpoints.save_weights_external": lambda i: [
        Case(
            "POST",
            "/api/v1/save_weights_external",
            {"model_id": i["model"], "seq_id": 1, "path": "b-export"},
            own_not_404=False,
        )  # fmt: skip
    ],
    "checkpoint_sharing.publish": lambda i: [
        Case(
            "POST",
            f"/api/v1/training_runs/{i['model']}/checkpoints/{i['checkpoint_id']}/publish",
            own_not_404=False,
        )  # fmt: skip
    ],
    "checkpoint_sharing.unpublish": lambda i: [
        Case(
            "DELETE",
            f"/api/v1/training_runs/{i['model']}/checkpoints/{i['checkpoint_id']}/publish",
            own_not_404=False,
        )  # fmt: skip
    ],
    "checkpoint_sharing.copy_weights": lambda i: [
        Case(
            "POST",
            "/api/v1/copy_weights",
            {"source_path": i["checkpoint"], "destination_project_id": i["tenant"]},
            own_not_404=False,
        )  # fmt: skip
    ],
    "checkpoint_sharing.external_weights_urls": lambda i: [  # A's own: a 400, not external
        Case(
            "GET",
            f"/api/v1/training_runs/{i['model']}/checkpoints/{i['checkpoint_id']}"
            "/external_weights_urls",
        )  # fmt: skip
    ],
    "checkpoint_sharing.download_file": "a secret token, not an id (tests/compat/"
    "test_tinker_routes.py: an unknown one is a 404, an unpublished one's too)",
    "tinker_futures.retrieve_futures": lambda i: [
        Case(
            "POST",
            "/api/v1/retrieve_futures",
            {"target": {"sampling_session_id": i["sampler"]}, "timeout": 0},
        )  # fmt: skip
    ],
    "tinker_futures.cancel_future": lambda i: [
        Case("POST", "/api/v1/cancel_future", {"request_id": i["request"]}, own_not_404=False)
    ],
    "tinker_extras.assign_session_project": lambda i: [
        Case("PUT", f"/api/v1/sessions/{i['session']}/project", {"project_id": i["tenant"]})
    ],
    "tinker_extras.join_sampling_session": lambda i: [
        Case(
            "POST",
            "/api/v1/join_sampling_session",
            {"sampling_session_id": i["sampler"]},
            own_not_404=False,
        )  # fmt: skip
    ],
    "tinker_extras.api_key_me": "the presented key's own metadata: no id to name",
    "tinker_extras.delete_api_key_me": "revokes the presented key itself: no id to name",
    "tinker_extras.auth_token": "refused for every key (400): no id to name",
    "tinker_custom_losses.create_custom_loss": lambda i: [
        Case(
            "POST",
            "/api/v1/create_custom_loss",
            {
                "session_id": i["session"],
                "custom_loss_seq_id": 0,
                "name": "total",
                "inputs": [{"name": "logprobs", "rank": 1}],
                "graph": {
                    "format": 1,
                    "nodes": [
                        {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                        {
                            "op": "call_method",
                            "name": "s",
                            "target": "sum",
                            "args": [{"ref": "logprobs"}],
                        },
                        {
                            "op": "output",
                            "name": "output",
                            "target": "output",
                            "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}],
                        },
                    ],
                },
            },
        )  # fmt: skip
    ],
}


def _this_hour() -> str:
    """The Tinker billing window of the current UTC hour, as query parameters."""
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    end = start + timedelta(hours=1)
    return f"starting_on={start:%Y-%m-%dT%H:00:00Z}&ending_before={end:%Y-%m-%dT%H:00:00Z}"


def test_every_route_has_a_case(secure: SecureApp) -> None:
    served = {rule.endpoint for rule in secure.app.url_map.iter_rules()}
    assert sorted(served - set(CASES)) == [], "routes with no isolation case: add one"
    assert sorted(set(CASES) - served) == [], "cases for routes the app no longer serves"


def _cases(world: World) -> list[tuple[str, Case]]:
    return [
        (endpoint, case)
        for endpoint, make in CASES.items()
        if not isinstance(make, str)
        for case in make(world.ids)
    ]


def test_another_tenant_gets_404_sees_nothing_and_changes_nothing(world: World) -> None:
    secure = world.secure
    wrong: list[str] = []
    before = secure.event_count()
    for endpoint, case in _cases(world):
        response = secure.call(
            case.method, case.path, world.b_key, json=case.json, data=case.data,
            headers={"Content-Type": "application/x-protobuf"} if case.data else {},
        )  # fmt: skip
        text = response.get_data(as_text=True)
        if response.status_code != case.expect:
            wrong.append(f"{endpoint} {case.method} {case.path}: {response.status_code} {text}")
        leaked = [m for m in MARKERS if m in text]
        if leaked:
            wrong.append(f"{endpoint} {case.method} {case.path} shows {leaked}")
    assert wrong == []
    assert secure.event_count() == before, "another tenant's request changed the log"


def test_the_owner_finds_what_another_tenant_cannot(world: World) -> None:
    """The 404s above are about the tenant, not a malformed request: the same read-only
    requests with tenant A's own key find the objects."""
    missing = [
        f"{endpoint} {case.method} {case.path}"
        for endpoint, case in _cases(world)
        if case.own_not_404 and case.expect == 404
        and world.secure.call(case.method, case.path, world.a_key, json=case.json).status_code
        == 404
    ]  # fmt: skip
    assert missing == []
