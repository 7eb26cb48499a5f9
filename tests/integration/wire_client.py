"""A raw Tinker-protocol client for tests that need to control seq_ids and resends exactly."""

from __future__ import annotations

import time
from typing import Any

import httpx
from tinker import types
from tinker.proto import response_conv
from tinker.proto.request_conv import forward_backward_request_to_proto


class WireClient:
    def __init__(self, base_url: str, api_key: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": api_key}, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(f"/api/v1/{path}", json=body)

    def create_model(self, base_model: str = "treadle/tiny-debug", rank: int = 4) -> str:
        session_id = self.post("create_session", {"tags": []}).json()["session_id"]
        future = self.post(
            "create_model",
            {"session_id": session_id, "model_seq_id": 0, "base_model": base_model,
             "lora_config": {"rank": rank, "seed": 0}},
        ).json()  # fmt: skip
        self.result(future["request_id"])
        return str(future["model_id"])

    def forward_backward(
        self,
        model_id: str,
        seq_id: int,
        datums: list[types.Datum],
        loss_fn: str = "cross_entropy",
        config: dict[str, float] | None = None,
        *,
        forward_only: bool = False,
    ) -> httpx.Response:
        """POST forward_backward; with `forward_only`, what the SDKs' `forward` sends."""
        body = forward_backward_body(model_id, seq_id, datums, loss_fn, config, forward_only)
        return self.http.post(
            "/api/v1/forward_backward",
            content=body,
            headers={"Content-Type": "application/x-protobuf"},
        )

    def optim_step(self, model_id: str, seq_id: int, lr: float = 1e-3) -> httpx.Response:
        return self.post(
            "optim_step",
            {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": lr}},
        )

    def result(self, request_id: str, timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.post("retrieve_future", {"request_id": request_id})
            if r.status_code == 408:  # still running (routes_futures.STILL_RUNNING)
                continue
            r.raise_for_status()
            if r.headers["content-type"].startswith("application/x-protobuf"):
                try:
                    return response_conv.deserialize_forward_backward_output(r.content)
                except Exception:
                    return response_conv.deserialize_sample_response(r.content)
            body = r.json()
            if body.get("type") != "try_again":
                return body
        raise TimeoutError(f"{request_id} did not finish in {timeout} s")


def forward_backward_body(
    model_id: str,
    seq_id: int,
    datums: list[types.Datum],
    loss_fn: str = "cross_entropy",
    config: dict[str, float] | None = None,
    forward_only: bool = False,
) -> bytes:
    """A forward_backward request body as the SDKs send it (protobuf); with `forward_only`, a
    `forward`."""
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(
            data=datums, loss_fn=loss_fn, loss_fn_config=config
        ),
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()  # type: ignore[no-any-return]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
