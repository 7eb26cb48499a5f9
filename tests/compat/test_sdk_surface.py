"""Every public method of the pinned tinker SDK's ServiceClient, TrainingClient, SamplingClient
and RestClient against the served platform (`treadle up`, real workers), as a tenant of this
module's own.

`SURFACE` names each method's fate: an exercise here (run twice for a method with an `_async`
twin: once through each), a test elsewhere that exercises it, or why it needs no server (client-
side only) or is refused (with the docs that say so). A method the table does not name fails
`test_the_table_names_every_public_method`, so an SDK upgrade that adds one is noticed.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
TOKENS = [504, 3575, 282, 4649, 314, 7042, 30]
PROMPT = types.ModelInput.from_ints(TOKENS)
GREEDY = types.SamplingParams(max_tokens=3, temperature=0.0)
CLASSES = {
    "ServiceClient": tinker.ServiceClient,
    "TrainingClient": tinker.TrainingClient,
    "SamplingClient": tinker.SamplingClient,
    "RestClient": tinker.RestClient,
}
HERE = Path(__file__).parent


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


@dataclass
class World:
    platform: Platform
    key: str
    tenant: str
    svc: tinker.ServiceClient
    tc: tinker.TrainingClient
    sampler: tinker.SamplingClient
    rest: tinker.RestClient
    state: str  # a save_state checkpoint (weights + optimizer)
    sampler_path: str  # a save_weights_for_sampler checkpoint


@pytest.fixture(scope="module")
def world(platform: Platform) -> Iterator[World]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    created = admin.create_tenant(f"surface-{secrets.token_hex(3)}")
    admin.close()
    key = created["api_key"]
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    tc = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=2).result()
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("surface-state").result().path
    sampler_path = tc.save_weights_for_sampler("surface-sampler").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    rest = tinker.RestClient(base_url=platform.base_url, api_key=key)
    yield World(platform, key, created["tenant"]["id"], svc, tc, sampler, rest, state, sampler_path)
    svc.close("success").result()


def _call(obj: Any, name: str, via_async: bool, *args: Any, **kwargs: Any) -> Any:
    """Call `name` (or its `_async` twin, awaited on a loop of its own) and resolve a future."""
    with warnings.catch_warnings():  # the SDK marks its `_async` twins deprecated
        warnings.simplefilter("ignore")
        if via_async:
            out = asyncio.run(_awaited(getattr(obj, name + "_async")(*args, **kwargs)))
        else:
            out = getattr(obj, name)(*args, **kwargs)
        return out.result() if hasattr(out, "result") and callable(out.result) else out


async def _awaited(coroutine: Any) -> Any:
    return await coroutine


Exercise = Callable[[World, bool], None]


# --- ServiceClient ----------------------------------------------------------------------------


def _create_lora_training_client(w: World, a: bool) -> None:
    tc = _call(w.svc, "create_lora_training_client", a, BASE_MODEL, rank=4)
    assert isinstance(tc, tinker.TrainingClient) and tc.get_info().lora_rank == 4


def _create_sampling_client(w: World, a: bool) -> None:
    sc = _call(w.svc, "create_sampling_client", a, model_path=w.sampler_path)
    assert len(sc.sample(PROMPT, 1, GREEDY).result().sequences[0].tokens) == 3
    base = _call(w.svc, "create_sampling_client", a, base_model=BASE_MODEL)
    assert base.get_base_model() == BASE_MODEL


def _create_training_client_from_state(w: World, a: bool) -> None:
    tc = _call(w.svc, "create_training_client_from_state", a, w.state)
    assert tc.forward([_datum()], "cross_entropy").result().metrics


def _create_training_client_from_state_with_optimizer(w: World, a: bool) -> None:
    tc = _call(w.svc, "create_training_client_from_state_with_optimizer", a, w.state)
    assert "loss:sum" in tc.forward([_datum()], "cross_entropy").result().metrics


def _get_server_capabilities(w: World, a: bool) -> None:
    caps = _call(w.svc, "get_server_capabilities", a)
    assert BASE_MODEL in [m.model_name for m in caps.supported_models]


def _create_rest_client(w: World, a: bool) -> None:
    with warnings.catch_warnings():  # deprecated in favour of tinker.RestClient(...)
        warnings.simplefilter("ignore", FutureWarning)
        assert isinstance(w.svc.create_rest_client(), tinker.RestClient)


def _service_copy_weights(w: World, a: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_PROJECT_ID", w.tenant)  # Treadle's one project: the tenant
    copied = _call(w.svc, "copy_weights", a, w.state)
    assert copied != w.state and w.rest.get_weights_info_by_tinker_path(copied).result()


def _close(w: World, a: bool) -> None:
    svc = tinker.ServiceClient(base_url=w.platform.base_url, api_key=w.key)
    tc = svc.create_lora_training_client(BASE_MODEL, rank=4).result()
    svc.close("success").result()
    described = httpx.get(  # the platform stopped what the client session opened
        f"{w.platform.base_url}/api/v1/treadle/sessions/{tc.model_id}",
        headers={"X-API-Key": w.key},
        timeout=30,
    )
    assert described.json()["status"] == "Stopped", described.text


# --- TrainingClient ---------------------------------------------------------------------------


def _forward(w: World, a: bool) -> None:
    out = _call(w.tc, "forward", a, [_datum()], "cross_entropy")
    assert len(out.loss_fn_outputs) == 1


def _forward_backward(w: World, a: bool) -> None:
    out = _call(w.tc, "forward_backward", a, [_datum()], "cross_entropy")
    assert out.metrics["loss:sum"] > 0


def _forward_backward_custom(w: World, a: bool) -> None:
    def loss(data: list[types.Datum], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        total = sum((lp**2).sum() for lp in lps)
        return total, {"custom": float(total)}

    out = _call(w.tc, "forward_backward_custom", a, [_datum()], loss)
    assert "custom" in out.metrics


def _optim_step(w: World, a: bool) -> None:
    _call(w.tc, "forward_backward", False, [_datum()], "cross_entropy")
    out = _call(w.tc, "optim_step", a, types.AdamParams(learning_rate=1e-3))
    assert isinstance(out, types.OptimStepResponse)


def _get_info(w: World, a: bool) -> None:
    info = _call(w.tc, "get_info", a)
    assert info.model_id == w.tc.model_id and info.model_data.model_name == BASE_MODEL


def _save_state(w: World, a: bool) -> None:
    path = _call(w.tc, "save_state", a, f"save-{int(a)}").path
    assert path.endswith(f"/weights/save-{int(a)}")


def _load_state(w: World, a: bool) -> None:
    assert _call(w.tc, "load_state", a, w.state).path == w.state


def _load_state_with_optimizer(w: World, a: bool) -> None:
    assert _call(w.tc, "load_state_with_optimizer", a, w.state).path == w.state


def _save_weights_for_sampler(w: World, a: bool) -> None:
    path = _call(w.tc, "save_weights_for_sampler", a, f"sampler-{int(a)}").path
    assert path.endswith(f"/sampler_weights/sampler-{int(a)}")


def _save_weights_and_get_sampling_client(w: World, a: bool) -> None:
    sc = _call(w.tc, "save_weights_and_get_sampling_client", a)
    assert len(sc.compute_logprobs(PROMPT).result()) == len(TOKENS)


def _training_create_sampling_client(w: World, a: bool) -> None:
    sc = _call(w.tc, "create_sampling_client", a, w.sampler_path)
    assert sc.sample(PROMPT, 2, GREEDY).result().sequences[1].tokens


def _save_weights_external(w: World, a: bool) -> None:
    out = _call(w.tc, "save_weights_external", a, f"external-{int(a)}")
    urls = w.rest.get_external_weights_urls(out.path).result()
    assert urls


# --- SamplingClient ---------------------------------------------------------------------------


def _sample(w: World, a: bool) -> None:
    out = _call(w.sampler, "sample", a, PROMPT, 2, GREEDY)
    assert [len(s.tokens) for s in out.sequences] == [3, 3]


def _compute_logprobs(w: World, a: bool) -> None:
    scores = _call(w.sampler, "compute_logprobs", a, PROMPT)
    assert scores[0] is None and all(s is not None for s in scores[1:])


def _get_base_model(w: World, a: bool) -> None:
    assert _call(w.sampler, "get_base_model", a) == BASE_MODEL


def _sampler_handle(w: World, a: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_BASE_URL", w.platform.base_url)
    handle = w.sampler.get_sampler_handle()
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=w.key)
    try:
        assert (
            again.compute_logprobs(PROMPT).result() == w.sampler.compute_logprobs(PROMPT).result()
        )
    finally:
        # Its own client (a "shadow" of the handle's session), which would otherwise heartbeat
        # until the process ends, past the platform's stop.
        again.holder.close()


# --- RestClient -------------------------------------------------------------------------------


def _list_training_runs(w: World, a: bool) -> None:
    runs = _call(w.rest, "list_training_runs", a, limit=100)
    assert w.tc.model_id in [r.training_run_id for r in runs.training_runs]


def _get_training_run(w: World, a: bool) -> None:
    assert _call(w.rest, "get_training_run", a, w.tc.model_id).base_model == BASE_MODEL


def _get_training_run_by_tinker_path(w: World, a: bool) -> None:
    run = _call(w.rest, "get_training_run_by_tinker_path", a, w.state)
    assert run.training_run_id == w.tc.model_id


def _get_weights_info_by_tinker_path(w: World, a: bool) -> None:
    info = _call(w.rest, "get_weights_info_by_tinker_path", False, w.state)
    assert info.base_model == BASE_MODEL and info.lora_rank == 4


def _list_checkpoints(w: World, a: bool) -> None:
    listed = _call(w.rest, "list_checkpoints", a, w.tc.model_id)
    assert w.state in [c.tinker_path for c in listed.checkpoints]


def _list_user_checkpoints(w: World, a: bool) -> None:
    listed = _call(w.rest, "list_user_checkpoints", a, limit=1000)
    assert w.state in [c.tinker_path for c in listed.checkpoints]


def _delete_checkpoint(w: World, a: bool) -> None:
    path = w.tc.save_state(f"doomed-{int(a)}").result().path
    _call(w.rest, "delete_checkpoint", a, w.tc.model_id, f"weights/doomed-{int(a)}")
    with pytest.raises(tinker.NotFoundError):
        w.rest.get_weights_info_by_tinker_path(path).result()


def _delete_checkpoint_from_tinker_path(w: World, a: bool) -> None:
    path = w.tc.save_state(f"gone-{int(a)}").result().path
    _call(w.rest, "delete_checkpoint_from_tinker_path", a, path)
    with pytest.raises(tinker.NotFoundError):
        w.rest.get_weights_info_by_tinker_path(path).result()


def _set_checkpoint_ttl_from_tinker_path(w: World, a: bool) -> None:
    _call(w.rest, "set_checkpoint_ttl_from_tinker_path", a, w.sampler_path, 7200)
    listed = w.rest.list_checkpoints(w.tc.model_id).result().checkpoints
    assert [c.expires_at is not None for c in listed if c.tinker_path == w.sampler_path] == [True]
    _call(w.rest, "set_checkpoint_ttl_from_tinker_path", a, w.sampler_path, None)


def _publish_and_unpublish(w: World, a: bool) -> None:
    _call(w.rest, "publish_checkpoint_from_tinker_path", a, w.state)
    listed = w.rest.list_checkpoints(w.tc.model_id).result().checkpoints
    assert [c.public for c in listed if c.tinker_path == w.state] == [True]
    _call(w.rest, "unpublish_checkpoint_from_tinker_path", a, w.state)
    listed = w.rest.list_checkpoints(w.tc.model_id).result().checkpoints
    assert [c.public for c in listed if c.tinker_path == w.state] == [False]


def _rest_copy_weights(w: World, a: bool) -> None:
    copied = _call(w.rest, "copy_weights", a, w.state, w.tenant)
    assert copied != w.state


def _get_sampler(w: World, a: bool) -> None:
    session = w.rest.get_session(w.tc.model_id.split(":train:")[0]).result()
    got = _call(w.rest, "get_sampler", a, session.sampler_ids[0])
    assert got.base_model == BASE_MODEL


def _sessions(w: World, a: bool) -> None:
    client_session = w.tc.model_id.split(":train:")[0]
    assert client_session in _call(w.rest, "list_sessions", a, limit=100).sessions
    got = _call(w.rest, "get_session", a, client_session)
    assert w.tc.model_id in got.training_run_ids
    _call(w.rest, "assign_session_project", a, client_session, w.tenant)


def _search_sessions(w: World, a: bool) -> None:
    page = _call(w.rest, "search_sessions", False, types.SessionSearchRequest(limit=5))
    assert page.sessions


def _export_session_trace(w: World, a: bool) -> None:
    url = _call(w.rest, "export_session_trace", a, w.tc.model_id.split(":train:")[0])
    assert url.startswith(w.platform.base_url)


def _get_billing_usage(w: World, a: bool) -> None:
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    usage = _call(
        w.rest, "get_billing_usage", a, now - timedelta(hours=1), now + timedelta(hours=1)
    )
    assert usage is not None


def _get_current_checkpoint_storage_usage(w: World, a: bool) -> None:
    assert _call(w.rest, "get_current_checkpoint_storage_usage", a) is not None


def _get_audit_log(w: World, a: bool) -> None:  # the tenant's first key is its admin's
    log = _call(w.rest, "get_audit_log", a)
    assert any(e.event == "checkpoint_create" for e in log.entries)


def _rest_server_capabilities(w: World, a: bool) -> None:
    caps = _call(w.rest, "get_server_capabilities", False)
    assert caps.supported_models


CLIENT_SIDE = "client-side only: "
ELSEWHERE = "exercised in "
REFUSED = "refused, documented: "
SURFACE: dict[str, Exercise | str] = {
    "ServiceClient.close": _close,
    "ServiceClient.copy_weights": _service_copy_weights,  # type: ignore[dict-item]
    "ServiceClient.create_custom_loss": ELSEWHERE + "test_custom_losses.py",
    "ServiceClient.create_lora_training_client": _create_lora_training_client,
    "ServiceClient.create_rest_client": _create_rest_client,
    "ServiceClient.create_sampling_client": _create_sampling_client,
    "ServiceClient.create_training_client_from_state": _create_training_client_from_state,
    "ServiceClient.create_training_client_from_state_with_optimizer": (
        _create_training_client_from_state_with_optimizer
    ),
    "ServiceClient.get_console_url": CLIENT_SIDE + "builds a URL of Tinker's web console",
    "ServiceClient.get_server_capabilities": _get_server_capabilities,
    "ServiceClient.get_telemetry": CLIENT_SIDE + "the SDK's own telemetry object",
    "ServiceClient.holder": CLIENT_SIDE + "the SDK's connection holder (an attribute)",
    "TrainingClient.create_sampling_client": _training_create_sampling_client,
    "TrainingClient.forward": _forward,
    "TrainingClient.forward_backward": _forward_backward,
    "TrainingClient.forward_backward_custom": _forward_backward_custom,
    "TrainingClient.get_console_url": CLIENT_SIDE + "builds a URL of Tinker's web console",
    "TrainingClient.get_info": _get_info,
    "TrainingClient.get_telemetry": CLIENT_SIDE + "the SDK's own telemetry object",
    "TrainingClient.get_tokenizer": ELSEWHERE + "test_tokenizers.py",
    "TrainingClient.load_state": _load_state,
    "TrainingClient.load_state_with_optimizer": _load_state_with_optimizer,
    "TrainingClient.optim_step": _optim_step,
    "TrainingClient.save_state": _save_state,
    "TrainingClient.save_weights_and_get_sampling_client": _save_weights_and_get_sampling_client,
    "TrainingClient.save_weights_external": _save_weights_external,
    "TrainingClient.save_weights_for_sampler": _save_weights_for_sampler,
    "SamplingClient.compute_logprobs": _compute_logprobs,
    "SamplingClient.create": CLIENT_SIDE + "the constructor ServiceClient.create_sampling_client "
    "and TrainingClient.create_sampling_client call (exercised through them)",
    "SamplingClient.from_sampler_handle": _sampler_handle,  # type: ignore[dict-item]
    "SamplingClient.get_base_model": _get_base_model,
    "SamplingClient.get_sampler_handle": CLIENT_SIDE + "encodes the sampler's id (exercised "
    "with from_sampler_handle)",
    "SamplingClient.get_telemetry": CLIENT_SIDE + "the SDK's own telemetry object",
    "SamplingClient.get_tokenizer": ELSEWHERE + "test_tokenizers.py",
    "SamplingClient.on_queue_state_change": CLIENT_SIDE + "a callback that logs queue states",
    "SamplingClient.sample": _sample,
    "RestClient.assign_session_project": _sessions,
    "RestClient.copy_weights": _rest_copy_weights,
    "RestClient.delete_checkpoint": _delete_checkpoint,
    "RestClient.delete_checkpoint_from_tinker_path": _delete_checkpoint_from_tinker_path,
    "RestClient.export_session_trace": _export_session_trace,
    "RestClient.get_audit_log": _get_audit_log,
    "RestClient.get_billing_usage": _get_billing_usage,
    "RestClient.get_current_checkpoint_storage_usage": _get_current_checkpoint_storage_usage,
    "RestClient.get_external_weights_urls": _save_weights_external,
    "RestClient.get_sampler": _get_sampler,
    "RestClient.get_server_capabilities": _rest_server_capabilities,
    "RestClient.get_session": _sessions,
    "RestClient.get_telemetry": CLIENT_SIDE + "the SDK's own telemetry object",
    "RestClient.get_training_run": _get_training_run,
    "RestClient.get_training_run_by_tinker_path": _get_training_run_by_tinker_path,
    "RestClient.get_weights_info_by_tinker_path": _get_weights_info_by_tinker_path,
    "RestClient.list_checkpoints": _list_checkpoints,
    "RestClient.list_sessions": _sessions,
    "RestClient.list_training_runs": _list_training_runs,
    "RestClient.list_user_checkpoints": _list_user_checkpoints,
    "RestClient.publish_checkpoint_from_tinker_path": _publish_and_unpublish,
    "RestClient.search_sessions": _search_sessions,
    "RestClient.set_checkpoint_ttl_from_tinker_path": _set_checkpoint_ttl_from_tinker_path,
    "RestClient.unpublish_checkpoint_from_tinker_path": _publish_and_unpublish,
    "RestClient.whoami": CLIENT_SIDE + "reads the claims of the JWT the SDK holds from its auth "
    "exchange and sends no request; Treadle authenticates API keys (docs/tinker-compatibility.md)",
}


def _public(cls: type) -> list[str]:
    return sorted(n for n, _ in inspect.getmembers(cls) if not n.startswith("_"))


def _cases() -> list[tuple[str, bool]]:
    cases = []
    for name, cls in CLASSES.items():
        for method in _public(cls):
            if method.endswith("_async") or not callable(SURFACE.get(f"{name}.{method}")):
                continue
            cases.append((f"{name}.{method}", False))
            if hasattr(cls, method + "_async"):
                cases.append((f"{name}.{method}", True))
    return cases


def test_the_table_names_every_public_method() -> None:
    named = {f"{n}.{m}" for n, cls in CLASSES.items() for m in _public(cls)}
    plain = {m.removesuffix("_async") for m in named}
    assert sorted(plain - set(SURFACE)) == [], "add these methods to SURFACE"
    assert sorted(set(SURFACE) - plain) == [], "SURFACE names methods the SDK no longer has"
    for method, fate in SURFACE.items():
        if isinstance(fate, str) and fate.startswith(ELSEWHERE):
            test_file = HERE / fate.removeprefix(ELSEWHERE)
            assert method.split(".")[1] in test_file.read_text(), (method, fate)


@pytest.mark.parametrize(
    ("method", "via_async"),
    _cases(),
    ids=lambda v: v if isinstance(v, str) else ("async" if v else "sync"),
)
def test_the_method_works_against_treadle(
    world: World, method: str, via_async: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    exercise = SURFACE[method]
    assert callable(exercise)
    if "monkeypatch" in inspect.signature(exercise).parameters:
        exercise(world, via_async, monkeypatch)  # type: ignore[call-arg]
    else:
        exercise(world, via_async)
