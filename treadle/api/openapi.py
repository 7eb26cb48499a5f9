"""The OpenAPI 3.1 document of the HTTP API (`GET /api/v1/openapi.json`).

Built from the app's URL map and one table, `ROUTES`, that says for every endpoint what it does
and which request model it parses (the same pydantic models the views use), so the document's
request schemas are the validation itself. A test checks that the URL map and the table name the
same endpoints: a new route without an entry fails it. Protobuf bodies and results (the Tinker
SDK's `forward_backward` request, its results and `asample`'s) are documented as binary.
Imports platform only; never torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from flask import Flask
from pydantic import BaseModel

from treadle.api.anthropic import schemas as schemas_anthropic
from treadle.api.chat import schemas as schemas_openai
from treadle.api.tinker import schemas
from treadle.api.tinker import schemas_client_sessions as schemas_sessions
from treadle.api.tinker import schemas_extras as schemas_tinker_extras
from treadle.api.treadle import schemas_admin, schemas_billing, schemas_lineage, schemas_models

PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class RouteDoc:
    summary: str
    tag: str
    body: type[BaseModel] | None = None  # the JSON request body the view parses
    protobuf_body: bool = False
    future: bool = False  # answers {request_id, model_id}; the result via retrieve_future
    query: tuple[tuple[str, str, bool], ...] = ()  # (name, type, required)
    public: bool = False  # no API key needed
    errors: tuple[int, ...] = (400, 401, 404)
    extra: dict[str, Any] = field(default_factory=dict)


PAGING = (("limit", "integer", False), ("offset", "integer", False))

ROUTES: dict[str, RouteDoc] = {
    # -- client bootstrap and sessions (Tinker)
    "sessions.healthz": RouteDoc(
        "Health: PostgreSQL, Redis and the live workers (503 unless all are fine)",
        "health", public=True, errors=(503,),
    ),
    "metrics.prometheus_metrics": RouteDoc(
        "Prometheus metrics of the API (text exposition format; docs/operations.md, Metrics)",
        "health", public=True, errors=(),
    ),
    "sessions.client_config": RouteDoc("Client transport settings for the tinker SDK", "client"),
    "sessions.dynamic_config": RouteDoc("Client settings refreshed while it runs", "client"),
    "sessions.server_capabilities": RouteDoc("The base models this server trains", "client"),
    "sessions.create_session": RouteDoc(
        "Open a client session (groups the models and samplers one client creates)", "sessions",
        body=schemas.CreateSession,
    ),
    "sessions.session_heartbeat": RouteDoc(
        "Keep a client session alive (410 once it is finished)", "sessions",
        body=schemas.SessionRef, errors=(400, 401, 404, 410),
    ),
    "sessions.finish_session": RouteDoc(
        "Finish a client session: every model it opened stops", "sessions",
        body=schemas.FinishSession,
    ),
    "sessions.telemetry": RouteDoc("Client telemetry (accepted and dropped)", "client"),
    # -- training (Tinker)
    "training.create_model": RouteDoc(
        "Create a training session: a base model plus a LoRA adapter", "training",
        body=schemas.CreateModel, future=True, errors=(400, 401, 404, 503),
    ),
    "training.get_info": RouteDoc("A model's base model and LoRA settings", "training",
                                  body=schemas.ModelRef),
    "training.forward_backward": RouteDoc(
        "Forward (and backward) pass with a loss; the body is a tinker_public "
        "ForwardBackwardRequest", "training", protobuf_body=True, future=True,
    ),
    "training.optim_step": RouteDoc("Apply the accumulated gradients with Adam", "training",
                                    body=schemas.OptimStep, future=True),
    "checkpoints.save_weights": RouteDoc(
        "save_state: adapter and optimizer state as tinker://<model>/weights/<name>",
        "checkpoints", body=schemas.SaveWeights, future=True,
    ),
    "checkpoints.save_weights_for_sampler": RouteDoc(
        "Weights for sampling: an ephemeral sampler, or tinker://<model>/sampler_weights/<name>",
        "checkpoints", body=schemas.SaveWeightsForSampler, future=True,
    ),
    "checkpoints.load_weights": RouteDoc(
        "Create a model from a checkpoint, or load one into a model", "checkpoints",
        body=schemas.LoadWeights, future=True, errors=(400, 401, 404, 503),
    ),
    # -- sampling (Tinker)
    "sampling.create_sampling_session": RouteDoc(
        "A sampler on a base model or a sampler checkpoint", "sampling",
        body=schemas.CreateSamplingSession, errors=(400, 401, 404, 503),
    ),
    "sampling.get_sampler": RouteDoc("A sampler's base model and checkpoint", "sampling"),
    "sampling.asample": RouteDoc("Sample continuations of a prompt", "sampling",
                                 body=schemas.Sample, future=True),
    "futures.retrieve_future": RouteDoc(
        "The result of an operation (long-polled; protobuf for forward_backward and sample "
        "results; 408 {type: try_again} while it runs)", "futures", body=schemas.RetrieveFuture,
        errors=(400, 401, 404, 408),
    ),
    # -- the checkpoint registry (Tinker REST)
    "checkpoints.training_runs": RouteDoc("The tenant's training runs", "registry",
                                          query=PAGING),
    "checkpoints.training_run": RouteDoc("One training run and its newest checkpoint",
                                         "registry"),
    "checkpoints.run_checkpoints": RouteDoc("A run's checkpoints", "registry"),
    "checkpoints.all_checkpoints": RouteDoc(
        "The tenant's checkpoints", "registry",
        query=(("model_package_group", "string", False), *PAGING),
    ),
    "checkpoints.delete_checkpoint": RouteDoc("Delete a checkpoint and its files", "registry"),
    "checkpoints.checkpoint_ttl": RouteDoc("Set or clear a checkpoint's time to live",
                                           "registry", body=schemas.CheckpointTtl),
    "checkpoints.weights_info": RouteDoc("A checkpoint's base model and LoRA settings",
                                         "registry", body=schemas.WeightsInfo),
    # -- Treadle's extensions
    "treadle.tokenizer": RouteDoc("A base model's tokenizer files (base64)", "treadle",
                                  query=(("base_model", "string", True),)),
    "treadle.describe": RouteDoc("A session's status, LoRA settings and last applied seq",
                                 "treadle"),
    "treadle.session_events": RouteDoc(
        "A session's events after a position (a page; large payloads summarised unless full)",
        "treadle", query=(("after", "integer", False), ("limit", "integer", False),
                          ("type", "string", False), ("full", "boolean", False)),
    ),
    "treadle.session_timeline": RouteDoc(
        "A session's operations (actor, queue wait, execution, tokens, outcome) and session "
        "events, after a seq (a page)", "treadle",
        query=(("after", "integer", False), ("limit", "integer", False)),
    ),
    "treadle.list_sessions": RouteDoc(
        "Sessions, newest first, with owner, operations, tokens and cost (the operator: any "
        "tenant, or '*')", "treadle", errors=(400, 401, 403, 404),
        query=(("tenant", "string", False), ("status", "string", False),
               ("kind", "string", False), ("since", "string", False), *PAGING),
    ),
    "treadle.stop": RouteDoc("Stop a session (its running operation is cancelled)", "treadle"),
    "lineage.open_replay": RouteDoc(
        "Replay a session's log in a read-only, never billed sandbox, verifying every step",
        "lineage", body=schemas_lineage.OpenReplay, future=True, errors=(400, 401, 404, 410, 503),
    ),
    "lineage.open_fork": RouteDoc(
        "Fork a session: a new training session equal to it right after a seq_id", "lineage",
        body=schemas_lineage.OpenFork, future=True, errors=(400, 401, 402, 404, 410, 429, 503),
    ),
    "lineage.rebuild_report": RouteDoc(
        "How a replay's or fork's rebuild went: operations replayed, steps verified, the first "
        "divergence", "lineage",
    ),
    # -- tenants and keys (Treadle)
    "admin.create_tenant": RouteDoc(
        "Create a tenant and its first admin key, shown once (operator)", "admin",
        body=schemas_admin.CreateTenant, errors=(400, 401, 403, 409),
    ),
    "admin.list_tenants": RouteDoc("Every tenant (operator)", "admin", errors=(401, 403)),
    "admin.disable_tenant": RouteDoc(
        "Disable a tenant: its keys are refused from the next request (operator)", "admin",
        errors=(401, 403, 404, 409),
    ),
    "admin.enable_tenant": RouteDoc("Enable a disabled tenant again (operator)", "admin",
                                    errors=(401, 403, 404)),
    "admin.create_key": RouteDoc(
        "Create a key, shown once (a tenant admin for its tenant; the operator for any); "
        "aws: also an access key pair for SigV4, its secret shown once (409 without "
        "TREADLE_SECRETS_KEY)",
        "admin", body=schemas_admin.CreateKey, errors=(400, 401, 403, 404, 409),
    ),
    "admin.list_keys": RouteDoc("A tenant's keys, never their secrets", "admin",
                                query=(("tenant_id", "string", False),), errors=(400, 401, 403)),
    "admin.get_key": RouteDoc("One key", "admin"),
    "admin.revoke_key": RouteDoc(
        "Revoke a key: refused from its next request", "admin", errors=(400, 401, 403, 404, 409),
    ),
    # -- the model registry (Treadle)
    "models.list_models": RouteDoc(
        "The base models in service, built-in then registered (include_retired=1: retired "
        "ones too)", "models", query=(("include_retired", "boolean", False),),
    ),
    "models.describe_model": RouteDoc(
        "One base model: what its files say and what the operator set", "models",
        errors=(401, 404),
    ),
    "models.register_model": RouteDoc(
        "Register a base model from a folder or a cached hub id at a pinned revision "
        "(operator)", "models", body=schemas_models.RegisterModel, errors=(400, 401, 403, 409),
    ),
    "models.retire_model": RouteDoc(
        "Retire a registered base model: no new sessions on it (operator)", "models",
        errors=(400, 401, 403, 404),
    ),
    # -- OpenAI-compatible serving (docs/openai.md; Authorization: Bearer <key> also works)
    "openai.list_models": RouteDoc("OpenAI: the models this key may sample", "openai"),
    "openai.completions": RouteDoc(
        "OpenAI: a completion of a prompt (stream: server-sent events)", "openai",
        body=schemas_openai.CompletionRequest, errors=(400, 401, 402, 404, 429),
    ),
    "openai.chat_completions": RouteDoc(
        "OpenAI: a chat completion through the model's chat template", "openai",
        body=schemas_openai.ChatCompletionRequest, errors=(400, 401, 402, 404, 429),
    ),
    # Tinker's documented path of the same routes (docs/openai.md): one view, two paths
    "oai.list_models": RouteDoc("OpenAI (at /oai/api/v1): the models this key may sample",
                                "openai"),
    "oai.completions": RouteDoc(
        "OpenAI (at /oai/api/v1): a completion of a prompt (stream: server-sent events)",
        "openai", body=schemas_openai.CompletionRequest, errors=(400, 401, 402, 404, 429),
    ),
    "oai.chat_completions": RouteDoc(
        "OpenAI (at /oai/api/v1): a chat completion through the model's chat template",
        "openai", body=schemas_openai.ChatCompletionRequest, errors=(400, 401, 402, 404, 429),
    ),
    # -- Anthropic Messages (docs/anthropic.md; x-api-key or Authorization: Bearer <key>)
    "anthropic.messages": RouteDoc(
        "Anthropic: a message through the model's chat template (stream: server-sent events)",
        "anthropic", body=schemas_anthropic.MessagesRequest, errors=(400, 401, 402, 404, 429),
    ),
    "anthropic.count_tokens": RouteDoc(
        "Anthropic: the input tokens a message would be metered with", "anthropic",
        body=schemas_anthropic.CountTokensRequest,
    ),
    "status.platform_status": RouteDoc(
        "Workers (heartbeat age, alive, sessions held, queue depth), live sessions per tenant, "
        "pending operations and the oldest one (operator)", "admin", errors=(401, 403),
    ),
    "checkpoints.checkpoint_files": RouteDoc("A checkpoint's files", "registry",
                                             query=(("path", "string", True),)),
    "checkpoints.checkpoint_file": RouteDoc(
        "One file of a checkpoint (binary)", "registry",
        query=(("path", "string", True), ("name", "string", True)),
    ),
    # -- prices, quotas, usage and bills (Treadle)
    "billing.list_prices": RouteDoc(
        "Every price version (USD per million tokens) with its status", "billing",
        query=(("base_model", "string", False),), errors=(400, 401),
    ),
    "billing.set_prices": RouteDoc(
        "Set a base model's prices from a time on, never retroactively (operator)", "billing",
        body=schemas_billing.SetPrices, errors=(400, 401, 403),
    ),
    "billing.get_quota": RouteDoc(
        "A tenant's quota and this month's spend (its own keys; the operator any)", "billing",
        errors=(400, 401, 403, 404),
    ),
    "billing.set_quota": RouteDoc(
        "Change a tenant's quota, effective from its next request (operator)", "billing",
        body=schemas_billing.SetQuota, errors=(400, 401, 403, 404),
    ),
    "billing.usage_report": RouteDoc(
        "Usage over a time range grouped by tenant, session, key, base model, day or op type",
        "billing", errors=(400, 401, 403, 404),
        query=(("month", "string", False), ("since", "string", False),
               ("until", "string", False), ("by", "string", False), ("tenant", "string", False)),
    ),
    "billing.bill": RouteDoc(
        "A tenant's monthly bill: one line per base model x token class x unit price, the total",
        "billing", errors=(400, 401, 403, 404),
        query=(("month", "string", False), ("tenant", "string", False)),
    ),
    "billing.session_usage": RouteDoc("A session's usage, spend and spend cap so far", "billing"),
    # -- billing (Tinker)
    "tinker_billing.usage_events": RouteDoc(
        "Hourly usage buckets: tokens by class with cost, storage in GB-hours", "billing",
        query=(("starting_on", "string", True), ("ending_before", "string", True)),
        errors=(400, 401),
    ),
    "tinker_billing.checkpoint_storage": RouteDoc(
        "Live checkpoint storage now", "billing", query=(("project_id", "string", False),),
        errors=(400, 401),
    ),
    # -- client sessions, traces and the audit log (Tinker)
    "tinker_sessions.list_sessions": RouteDoc(
        "The caller's client session ids, newest first (access_scope: owned = its key's, "
        "accessible = its tenant's)", "sessions", errors=(400, 401),
        query=(*PAGING, ("access_scope", "string", False)),
    ),
    "tinker_sessions.get_session": RouteDoc(
        "A client session's training runs, samplers and user_metadata", "sessions",
        query=(("access_scope", "string", False),),
    ),
    "tinker_sessions.search_sessions": RouteDoc(
        "Search the tenant's client sessions, newest first, by id, metadata, status, owner "
        "(cursor paging)", "sessions", body=schemas_sessions.SearchSessions, errors=(400, 401),
    ),
    "tinker_sessions.trace_export": RouteDoc(
        "A one-hour download link of a client session's trace (Chrome JSON trace events)",
        "sessions",
    ),
    "tinker_sessions.download_trace": RouteDoc(
        "Download a trace by the token of its link (no API key)", "sessions", public=True,
        errors=(404,),
    ),
    "tinker_sessions.audit": RouteDoc(
        "The tenant's audit log of one UTC day, at most 10,000 entries (an admin key)",
        "audit", errors=(400, 401, 403),
        query=(("event_type", "string", False), ("day", "string", False)),
    ),
    "docs.openapi_document": RouteDoc("This document", "docs", public=True, errors=()),
    # -- tokenizers for hub clients (HF_ENDPOINT=<treadle>/hf; no API key)
    "hf.model_info": RouteDoc("Hub model info of a tokenizer repo", "hf", public=True,
                              errors=(404,)),
    "hf.model_info_at_revision": RouteDoc("Hub model info of a tokenizer repo at a revision",
                                          "hf", public=True, errors=(404,)),
    "hf.tree": RouteDoc("The files of a tokenizer repo", "hf", public=True, errors=(404,)),
    "hf.tree_path": RouteDoc("A folder of a tokenizer repo (there are none: 404)", "hf",
                             public=True, errors=(404,)),
    "hf.resolve": RouteDoc(
        "Download a tokenizer file (GET or HEAD; ETag, X-Repo-Commit, byte ranges)", "hf",
        public=True, errors=(404,),
    ),
    # -- the rest of the Tinker surface (docs/tinker-compatibility.md)
    "checkpoints.save_weights_external": RouteDoc(
        "A PEFT adapter folder of the model as tinker://<model>/external_weights/<name>; with "
        "age_encryption_recipients, each file age-encrypted to them as <file>.age",
        "checkpoints", body=schemas_tinker_extras.SaveWeightsExternal, future=True,
    ),
    "checkpoint_sharing.publish": RouteDoc(
        "Publish a checkpoint: any tenant's keys may read it (idempotent; the owner's keys)",
        "registry",
    ),
    "checkpoint_sharing.unpublish": RouteDoc(
        "Unpublish a checkpoint: its own tenant's only again (idempotent; the owner's keys)",
        "registry",
    ),
    "checkpoint_sharing.copy_weights": RouteDoc(
        "Copy a checkpoint you may read into a new run of your tenant, with its own files "
        "(X-Idempotency-Key: a resent copy answers the first)", "registry",
        body=schemas_tinker_extras.CopyWeights, errors=(400, 401, 404, 410),
    ),
    "checkpoint_sharing.external_weights_urls": RouteDoc(
        "One-hour download links, one per file, of an external weights checkpoint", "registry",
    ),
    "checkpoint_sharing.download_file": RouteDoc(
        "Download a file by the token of its link (no API key)", "registry", public=True,
        errors=(404,),
    ),
    "tinker_futures.retrieve_futures": RouteDoc(
        "Which requests of a sampling-session client settled after a cursor (long-polled)",
        "futures", body=schemas_tinker_extras.RetrieveFutures,
    ),
    "tinker_futures.cancel_future": RouteDoc(
        "Cancel a pending request: it fails with 'cancelled' and a running one stops",
        "futures", body=schemas_tinker_extras.CancelFuture,
    ),
    "tinker_extras.assign_session_project": RouteDoc(
        "Put a client session in a project: the caller's tenant is its only one", "sessions",
        body=schemas_tinker_extras.AssignProject,
    ),
    "tinker_extras.join_sampling_session": RouteDoc(
        "The next clone number of a sampling session", "sampling",
        body=schemas_tinker_extras.JoinSamplingSession,
    ),
    "tinker_extras.api_key_me": RouteDoc("The presented key's public metadata", "auth",
                                         errors=(401,)),
    "tinker_extras.delete_api_key_me": RouteDoc(
        "Revoke the presented key (not an operator's)", "auth", errors=(401, 403),
    ),
    "tinker_extras.auth_token": RouteDoc(
        "JWT exchange: refused (400), Treadle takes the tml- key itself", "auth",
        errors=(400, 401),
    ),
    "tinker_custom_losses.create_custom_loss": RouteDoc(
        "Upload a custom loss's traced graph (checked against the allowlist); its id through "
        "retrieve_future, then forward_backward with loss_fn custom",
        "training", body=schemas_tinker_extras.CreateCustomLoss, future=True, errors=(400, 401, 404),
    ),
}  # fmt: skip

_CONVERTER = re.compile(r"<(?:[a-z_]+:)?([a-z_]+)>")


# SageMaker's routes speak AWS's protocols, signed with SigV4: botocore's service models
# (`sagemaker`, `sagemakertrainingsessionruntime`) describe them, and the surface validates
# every request against those (api/sagemaker/shapes.py), so this document leaves them out.
SIGNED_BLUEPRINTS = ("sagemaker",)


def undocumented(app: Flask) -> tuple[list[str], list[str]]:
    """(endpoints the app serves that ROUTES does not describe, entries of ROUTES it lacks)."""
    served = {
        rule.endpoint
        for rule in app.url_map.iter_rules()
        if rule.endpoint.partition(".")[0] not in SIGNED_BLUEPRINTS
    }
    return sorted(served - set(ROUTES)), sorted(set(ROUTES) - served)


def document(app: Flask, *, title: str = "Treadle", version: str = "1") -> dict[str, Any]:
    """The OpenAPI document of every route of `app` that ROUTES describes."""
    components: dict[str, Any] = {
        "securitySchemes": {"apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["code", "message"],
                        "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                    }
                },
            },
            "Future": {
                "type": "object",
                "required": ["request_id"],
                "properties": {"request_id": {"type": "string"}, "model_id": {"type": "string"}},
            },
        },
    }
    paths: dict[str, dict[str, Any]] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        doc = ROUTES.get(rule.endpoint)
        if doc is None:
            continue
        path = _CONVERTER.sub(r"{\1}", rule.rule)
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            paths.setdefault(path, {})[method.lower()] = _operation(
                rule.endpoint, method, list(rule.arguments), doc, components
            )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "The Tinker protocol's HTTP routes plus Treadle's extensions.",
        },
        "servers": [{"url": "/"}],
        "security": [{"apiKey": []}],
        "paths": paths,
        "components": components,
    }


def _operation(
    endpoint: str, method: str, arguments: list[str], doc: RouteDoc, components: dict[str, Any]
) -> dict[str, Any]:
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in sorted(arguments)
    ] + [
        {"name": name, "in": "query", "required": required, "schema": {"type": kind}}
        for name, kind, required in doc.query
    ]
    ok: dict[str, Any] = {"description": "OK"}
    if doc.future:
        ok["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/Future"}}}
    elif endpoint == "futures.retrieve_future":
        ok["content"] = {"application/json": {"schema": {"type": "object"}},
                         PROTOBUF: {"schema": {"type": "string", "format": "binary"}}}  # fmt: skip
    elif endpoint in (
        "checkpoints.checkpoint_file",
        "hf.resolve",
        "checkpoint_sharing.download_file",
    ):
        ok["content"] = {"application/octet-stream": {"schema": {"type": "string",
                                                                 "format": "binary"}}}  # fmt: skip
    elif endpoint == "metrics.prometheus_metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    else:
        ok["content"] = {"application/json": {"schema": {"type": "object"}}}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    responses: dict[str, Any] = {"200": ok}
    for status in sorted({*doc.errors, 503} if not doc.public else set(doc.errors)):
        responses[str(status)] = {"description": _REASONS.get(status, "error"), "content": error}
    operation: dict[str, Any] = {
        "operationId": f"{endpoint.replace('.', '_')}_{method.lower()}",
        "summary": doc.summary,
        "tags": [doc.tag],
        "parameters": parameters,
        "responses": responses,
    }
    if doc.public:
        operation["security"] = []
    if doc.body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _schema_ref(doc.body, components)}},
        }
    elif doc.protobuf_body:
        operation["requestBody"] = {
            "required": True,
            "content": {PROTOBUF: {"schema": {"type": "string", "format": "binary"}}},
        }
    return operation


def _schema_ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        components["schemas"][name] = definition
    components["schemas"][model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


_REASONS = {
    400: "the request is invalid: the message names the field and the rule",
    401: "no key, or an unknown or revoked one",
    403: "the key's role may not do this",
    404: "not found (or another tenant's)",
    408: "still running after one long-poll: poll again (body {type: try_again})",
    409: "it exists already",
    410: "finished",
    413: "the body is too large",
    503: "a dependency is unreachable, or no worker is alive: retry after Retry-After",
}
