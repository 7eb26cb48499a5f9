"""A fake of the network under the SDK: a Tinker-protocol server on 127.0.0.1 that answers the
requests a training session's setup, saves and forward_backward make, each at once, and records
every request (path and body; a forward_backward's protobuf body decoded as Treadle's server
decodes it). The tinker SDK and Treadle's SDK above it run unchanged."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from treadle.api.tinker.wire import decode_forward_backward, encode_forward_backward_output

PROTO = "application/x-protobuf"
BASE_MODEL = "treadle/tiny-debug"


@dataclass
class FakeTinker:
    base_url: str = ""
    requests: list[tuple[str, Any]] = field(default_factory=list)
    results: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    ids: Iterator[int] = field(default_factory=itertools.count)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def bodies(self, path: str) -> list[Any]:
        """The bodies of the requests made to `path`, in order."""
        with self.lock:
            return [body for p, body in self.requests if p == path]

    def answer(self, path: str, body: Any) -> tuple[int, str, bytes]:
        if path == "/api/v1/retrieve_future":
            content_type, payload = self.results[body["request_id"]]
            return 200, content_type, payload
        if path in FUTURES:
            request_id = f"req-{next(self.ids)}"
            result = FUTURES[path](body)
            self.results[request_id] = (
                (PROTO, result)
                if isinstance(result, bytes)
                else ("application/json", _json(result))
            )
            return 200, "application/json", _json({"request_id": request_id})
        if path.startswith("/api/v1/samplers/"):
            sampler = path.removeprefix("/api/v1/samplers/")
            return 200, "application/json", _json({"sampler_id": sampler, "base_model": BASE_MODEL})
        return 200, "application/json", _json(ANSWERS.get(path, lambda _: {})(body))


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _model_id(body: dict[str, Any]) -> str:
    return f"{body['session_id']}:train:{body['model_seq_id']}"


def _fb_output(body: dict[str, Any]) -> bytes:
    outputs = [
        {"logprobs": {"dtype": "float32", "shape": [n], "data": [0.0] * n}}
        for n in (len(d["loss_fn_inputs"]["target_tokens"]["data"]) for d in body["data"])
    ]
    return encode_forward_backward_output({"loss_fn_outputs": outputs, "metrics": {"loss:sum": 0}})


# Requests answered with a future, and the result each future resolves to.
FUTURES: dict[str, Any] = {
    "/api/v1/create_model": lambda b: {"model_id": _model_id(b), "type": "create_model"},
    "/api/v1/save_weights": lambda b: {
        "path": f"tinker://{b['model_id']}/weights/{b['path']}",
        "type": "save_weights",
    },
    "/api/v1/save_weights_for_sampler": lambda b: {
        "path": f"tinker://{b['model_id']}/sampler_weights/{b['path']}",
        "type": "save_weights_for_sampler",
    },
    "/api/v1/forward_backward": lambda b: _fb_output(b["payload"]),
}
ANSWERS: dict[str, Any] = {
    "/api/v1/client/config": lambda _: {
        "use_pyqwest_transport": False,
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": False,
    },
    "/api/v1/client/dynamic_config": lambda _: {
        "refresh_interval_sec": 300,
        "sample_cancel_enabled": False,
        "sample_cancel_max_batch_size": 64,
    },
    "/api/v1/create_session": lambda _: {"session_id": "sess-fake"},
    "/api/v1/session_heartbeat": lambda _: {"type": "session_heartbeat"},
    "/api/v1/get_info": lambda b: {
        "model_id": b["model_id"],
        "model_data": {"arch": "qwen3", "model_name": BASE_MODEL, "tokenizer_id": BASE_MODEL},
        "is_lora": True,
        "lora_rank": 32,
    },
    "/api/v1/create_sampling_session": lambda b: {
        "sampling_session_id": f"{b['session_id']}:sample:{b['sampling_session_seq_id']}"
    },
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeTinker

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = self.path.split("?")[0]
        if path == "/api/v1/forward_backward":
            body: Any = decode_forward_backward(raw)
        else:
            body = json.loads(raw) if raw else {}
        with self.fake.lock:
            self.fake.requests.append((path, body))
            status, content_type, payload = self.fake.answer(path, body)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@contextmanager
def fake_tinker() -> Iterator[FakeTinker]:
    fake = FakeTinker()
    handler = type("Handler", (_Handler,), {"fake": fake})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    fake.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
