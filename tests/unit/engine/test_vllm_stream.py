"""How the vLLM backend reads a streamed answer (`sampling/vllm_backend.py`), against a small
HTTP server on this machine that answers as vLLM 0.32's does (its chunks recorded in
test_vllm_requests): the samples gathered from the stream's chunks; a refusal (4xx) reaches the
caller as a ValidationError at once, not retried as a server failure; a stream cut before its
[DONE], or carrying an error chunk, is a server failure, retried, and the retry's answer is the
one returned. (vLLM itself: tests/compat/test_vllm_sampling.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from treadle.engine import VllmSettings
from treadle.engine.sampling import vllm_backend, vllm_requests
from treadle.engine.sampling.decode import SampleJob
from treadle.engine.sampling.rules import SamplingSpec
from treadle.engine.sampling.vllm_server import VllmServer
from treadle.platform.errors import UnavailableError, ValidationError


def chunk(i: int, tokens: list[int], reason: str | None = None) -> dict:
    logprobs = [-0.5] * len(tokens)
    return {
        "choices": [
            {
                "index": i,
                "token_ids": tokens,
                "logprobs": {"token_logprobs": logprobs, "top_logprobs": []},
                "finish_reason": reason,
            }
        ]
    }


class Script:
    """What the stand-in server answers to each completions request, in order: a list of
    chunks, then "[DONE]" or not; or (status, body) for a refusal."""

    def __init__(self, answers: list[object]) -> None:
        self.answers = answers
        self.asked = 0


@pytest.fixture
def served() -> Iterator[tuple[str, Script]]:
    script = Script([])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # /health
            self.send_response(200)
            self.end_headers()

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/completions":  # load_lora_adapter
                self.send_response(200)
                self.end_headers()
                return
            assert json.loads(body)["stream"] is True
            answer = script.answers[script.asked]
            script.asked += 1
            if isinstance(answer, tuple):
                status, error = answer
                data = json.dumps(error).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for item in answer:  # type: ignore[attr-defined]
                text = item if isinstance(item, str) else json.dumps(item)
                self.wfile.write(f"data: {text}\n\n".encode())
                self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", script
    server.shutdown()


def backend(url: str, tmp_path: Path) -> vllm_backend.VllmBackend:
    server = VllmServer(
        VllmSettings(url=url, startup_seconds=5.0),
        folder=tmp_path,
        dtype="float32",
        max_model_len=64,
        log_path=tmp_path / "log",
    )
    return vllm_backend.VllmBackend(server, base_model="m", eos_token_id=2, adapter_dir=tmp_path)


def run(url: str, tmp_path: Path) -> tuple[object, vllm_requests.Streamed]:
    job = SampleJob(prompt=(5, 6), num_samples=2, params=SamplingSpec(max_tokens=3, seed=1))
    engine = backend(url, tmp_path)
    engine._using["a"] += 1  # held for this job, as `adapter` holds a snapshot's name
    streamed = vllm_requests.Streamed(2)
    return engine.run(job, "a", 7, streamed), streamed


STREAM = [chunk(0, [8]), chunk(1, [4]), chunk(0, [9], "length"), chunk(1, [2], "stop"), "[DONE]"]


def test_the_samples_are_gathered_from_the_streams_chunks(
    served: tuple[str, Script], tmp_path: Path
) -> None:
    url, script = served
    script.answers = [STREAM]
    result, streamed = run(url, tmp_path)
    assert [s.tokens for s in result.sequences] == [[8, 9], [4, 2]]  # type: ignore[attr-defined]
    assert [s.stop_reason for s in result.sequences] == ["length", "stop"]  # type: ignore[attr-defined]
    assert streamed.drawn()[0] == [[8, 9], [4, 2]]


def test_a_refusal_reaches_the_caller_at_once(served: tuple[str, Script], tmp_path: Path) -> None:
    url, script = served
    script.answers = [(400, {"error": {"message": "max_tokens is too large"}}), STREAM]
    with pytest.raises(ValidationError, match="vLLM refused the request: max_tokens is too large"):
        run(url, tmp_path)
    assert script.asked == 1  # not sent again


@pytest.mark.parametrize(
    "broken",
    [
        [chunk(0, [8])],  # cut before [DONE]
        [chunk(0, [8]), {"error": {"message": "EngineDeadError"}}, "[DONE]"],
        [chunk(0, [8]), "{not json"],
    ],
    ids=["cut", "error-chunk", "garbled"],
)
def test_a_broken_stream_is_sent_again_and_the_new_answer_counts(
    served: tuple[str, Script], tmp_path: Path, broken: list[object]
) -> None:
    url, script = served
    script.answers = [broken, STREAM]
    result, _ = run(url, tmp_path)
    assert script.asked == 2
    assert [s.tokens for s in result.sequences] == [[8, 9], [4, 2]]  # type: ignore[attr-defined]


def test_a_stream_broken_every_time_is_an_unavailable_error(
    served: tuple[str, Script], tmp_path: Path
) -> None:
    url, script = served
    script.answers = [[chunk(0, [8])]] * 3
    with pytest.raises(UnavailableError, match="failed 3 times"):
        run(url, tmp_path)
