"""Server-side custom losses through the unmodified tinker SDK against the served platform
(`treadle up`, real workers): `ServiceClient.create_custom_loss` uploads a traced DPO loss, and
`forward_backward_custom` with its handle runs in one forward_backward that equals the SDK's
client-side path (a forward, the loss in this process, a linearised backward) within 1e-6 in
loss, metrics and the weights after optim_step; the event carries the graph, so a replay
verifies; a graph calling anything outside the allowlists is a 400 naming the node, and nothing
is stored or recorded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import tinker
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

import treadle
from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.platform import db
from treadle.platform.eventlog.schema import events

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
BETA = 0.1
STEPS = 2
LR = 5e-2
RANKS: dict[str, types.CustomLossInputRank] = {
    "logprobs": 1,
    "weights": 1,
    "ref_logprobs": 1,
    "side": 0,
}


def dpo_side(logprobs, weights, ref_logprobs, side):  # type: ignore[no-untyped-def]
    """DPO's sigmoid loss (tinker_cookbook.preference.train_dpo.compute_dpo_loss's
    -logsigmoid(beta * log ratio)) on one datum's weighted log ratio against the reference,
    `side` +1 for a chosen reply and -1 for a rejected one: the handle's loss is per datum."""
    log_ratio = torch.dot(logprobs.float(), weights.float()) - torch.dot(
        ref_logprobs.float(), weights.float()
    )
    reward = BETA * side * log_ratio
    loss = -F.logsigmoid(reward)
    return loss, {
        "custom/dpo_loss:mean": loss,
        "custom/accuracy:mean": (reward > 0).float(),
        "custom/reward:sum": reward,
    }


def client_side_dpo(
    data: list[types.Datum], logprobs_list: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The same loss as a plain callable, as the cookbook's DPO passes its loss: the SDK runs it
    client-side (a forward, then a cross_entropy backward with the loss's gradient)."""
    total = torch.zeros(())
    sums: dict[str, float] = {}
    for datum, logprobs in zip(data, logprobs_list, strict=True):
        inputs = [datum.loss_fn_inputs[n].to_torch() for n in ("weights", "ref_logprobs", "side")]
        loss, metrics = dpo_side(logprobs, *inputs)
        total = total + loss
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value.item()
    return total, {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}


@pytest.fixture(scope="module")
def tenant(platform: Platform) -> Iterator[tuple[str, str]]:
    admin = AdminClient(platform.base_url, platform.admin_key)
    tenant_id = f"custom-loss-{secrets.token_hex(3)}"
    key = admin.create_tenant(tenant_id)["api_key"]
    admin.close()
    yield tenant_id, key


@pytest.fixture(scope="module")
def service(platform: Platform, tenant: tuple[str, str]) -> Iterator[tinker.ServiceClient]:
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=tenant[1])
    yield svc
    svc.close("success").result()


def _pairs(tc: tinker.TrainingClient) -> list[types.Datum]:
    """Two preference pairs (chosen, rejected) with the reference model's logprobs."""
    gen = torch.Generator().manual_seed(5)
    data = []
    for pair in range(2):
        prompt = torch.randint(10, 4000, (5,), generator=gen).tolist()
        for side in (1.0, -1.0):
            reply = torch.randint(10, 4000, (3 + pair,), generator=gen).tolist()
            tokens = prompt + reply
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(reply)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "weights": weights,
                        "side": types.TensorData(data=[side], dtype="float32", shape=[]),
                    },
                )
            )
    plain = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")},
        )
        for d in data
    ]
    ref = tc.forward(plain, "cross_entropy").result()  # before any step: the reference model
    for datum, out in zip(data, ref.loss_fn_outputs, strict=True):
        datum.loss_fn_inputs["ref_logprobs"] = types.TensorData(
            data=out["logprobs"].data, dtype="float32", shape=[len(out["logprobs"].data)]
        )
    return data


def _weights(svc: treadle.ServiceClient, tc: tinker.TrainingClient, folder: Path) -> dict:  # type: ignore[type-arg]
    path = tc.save_state(f"after-{secrets.token_hex(2)}").result().path
    svc.checkpoints.download(path, folder)
    found = load_file(folder / "adapter_model.safetensors")
    assert found
    return found


def _requested(platform: Platform, model_id: str) -> list[dict[str, Any]]:
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(events.c.data)
                .where(
                    events.c.session_id == model_id,
                    events.c.type == "OperationRequested",
                    events.c.data["type"].astext == "forward_backward",
                )
                .order_by(events.c.position)
            ).scalars()
            return [dict(r) for r in rows]
    finally:
        engine.dispose()


def test_a_dpo_step_on_the_server_equals_the_client_side_path_and_replays(
    platform: Platform,
    tenant: tuple[str, str],
    service: tinker.ServiceClient,
    tmp_path: Path,
) -> None:
    handle = service.create_custom_loss(dpo_side, RANKS).result()
    assert handle.loss_id is not None and handle.loss_id.startswith("closs-")
    # stored under the tenant's prefix (the refusals below find nothing at such a path)
    assert list(platform.data_dir.rglob(f"*{tenant[0]}*/custom_losses/{handle.loss_id}"))
    server = service.create_lora_training_client(BASE_MODEL, rank=4, seed=11).result()
    client = service.create_lora_training_client(BASE_MODEL, rank=4, seed=11).result()
    data = _pairs(server)
    for _ in range(STEPS):
        on_server = server.forward_backward_custom(data, handle).result()
        server.optim_step(types.AdamParams(learning_rate=LR)).result()
        on_client = client.forward_backward_custom(data, client_side_dpo).result()
        client.optim_step(types.AdamParams(learning_rate=LR)).result()
        assert "surrogate_loss:sum" in on_client.metrics  # it did run client-side
        keys = {"loss:sum", "custom/dpo_loss:mean", "custom/accuracy:mean", "custom/reward:sum"}
        assert keys <= on_server.metrics.keys()
        for key in keys:
            assert on_server.metrics[key] == pytest.approx(on_client.metrics[key], abs=1e-6), key
        for a, b in zip(on_server.loss_fn_outputs, on_client.loss_fn_outputs, strict=True):
            assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-6)
    assert on_server.metrics["custom/reward:sum"] != 0.0  # the second step moved off the ref

    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=tenant[1])
    try:
        after_server = _weights(svc, server, tmp_path / "server")
        after_client = _weights(svc, client, tmp_path / "client")
        assert after_server.keys() == after_client.keys()
        moved = 0.0
        for name, tensor in after_server.items():
            assert torch.allclose(tensor, after_client[name], atol=1e-6, rtol=0), name
            moved = max(moved, float(tensor.abs().max()))
        assert moved > 0

        # One forward_backward a step on the server (the reference forward aside); the
        # client-side path sends two (its forward, then its backward).
        on_server_log = _requested(platform, server.model_id)
        assert len(on_server_log) == 1 + STEPS
        recorded = [e["payload"] for e in on_server_log if e["payload"]["loss_fn"] == "custom"]
        assert len(recorded) == STEPS
        assert len(_requested(platform, client.model_id)) == 2 * STEPS
        # The event carries the graph, content-addressed by the id the SDK was given.
        loss = recorded[0]["custom_loss"]
        assert loss["loss_id"] == handle.loss_id
        content = {k: loss[k] for k in ("name", "inputs", "nodes")}
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
        assert handle.loss_id == "closs-" + hashlib.sha256(canonical).hexdigest()

        report = svc.replay(server.model_id).report
        assert report.matched, str(report)
        assert report.verified >= 2 * STEPS  # every forward_backward and optim_step
    finally:
        svc.close()


def _graph_with(node_change: dict[str, Any]) -> dict[str, Any]:
    """The uploaded form of a valid loss with its first call_function node changed."""
    handle = trace_loss(dpo_side, RANKS, "s")
    graph = encode_graph(handle).model_dump(mode="json")
    bad = copy.deepcopy(graph)
    node = next(n for n in bad["nodes"] if n["op"] == "call_function")
    node.update(node_change)
    return {"node": node["name"], "graph": bad, "inputs": [x.model_dump() for x in handle.inputs]}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"target": "builtins.open", "args": ["/etc/passwd"]}, "builtins.open"),
        ({"target": "builtins.eval", "args": ["1"]}, "builtins.eval"),
        ({"target": "torch.ops.aten.empty.memory_format", "args": [[1 << 40]]}, "torch.ops"),
        ({"target": "torch.load", "args": ["x"]}, "torch.load"),
        ({"target": "getattr", "args": [{"ref": "logprobs"}, "__class__"]}, "getattr"),
        ({"op": "get_attr", "target": "torch.nn", "args": []}, "get_attr"),
        ({"op": "call_module", "target": "os.system", "args": ["ls"]}, "call_module"),
        (
            {"op": "call_method", "target": "__reduce__", "args": [{"ref": "logprobs"}]},
            "__reduce__",
        ),
    ],
    ids=[
        "open",
        "eval",
        "torch-ops",
        "torch-load",
        "dunder-getattr",
        "get-attr",
        "module",
        "dunder",
    ],
)
def test_a_graph_calling_outside_the_allowlist_is_a_400_naming_it_and_stores_nothing(
    platform: Platform, change: dict[str, Any], named: str
) -> None:
    admin = AdminClient(platform.base_url, platform.admin_key)
    tenant_id = f"custom-loss-refused-{secrets.token_hex(3)}"
    key = admin.create_tenant(tenant_id)["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    try:
        session_id = svc.holder.get_session_id()
        bad = _graph_with(change)
        body = {
            "session_id": session_id,
            "custom_loss_seq_id": 0,
            "name": "dpo_side",
            "inputs": bad["inputs"],
            "graph": bad["graph"],
            "type": "create_custom_loss",
        }
        with httpx.Client(base_url=platform.base_url, headers={"X-API-Key": key}) as http:
            answer = http.post("/api/v1/create_custom_loss", json=body)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert repr(bad["node"]) in message and named in message, message
    finally:
        svc.close("success").result()
    # nothing stored for the tenant, nothing in its log
    assert not list(platform.data_dir.rglob(f"*{tenant_id}*/custom_losses"))
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            count = conn.execute(
                sa.select(sa.func.count()).where(
                    events.c.tenant_id == tenant_id, events.c.type == "OperationRequested"
                )
            ).scalar_one()
    finally:
        engine.dispose()
    assert count == 0
