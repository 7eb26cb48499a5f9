"""A vLLM inference server for one base model: the process the vLLM sampling backend talks to.

Owns `VllmSettings` (which Python runs vLLM, or the URL of a server someone else runs, and its
LoRA limits) and `VllmServer`: vLLM's own OpenAI-compatible server
(`vllm.entrypoints.openai.api_server`) started from its own environment (`make vllm` builds it:
its pins do not fit Treadle's), serving the base model's folder with runtime LoRA loading, and
started again when it has died (`ensure`), and ending with the worker, however the worker ends
(`child_process`). Its logprobs are vLLM's "processed" ones: after the temperature (and
top-k/top-p), as Treadle's sampler reports them before truncation. Must not import flask,
sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from treadle.platform.child_process import ending_with_parent
from treadle.platform.errors import UnavailableError

__all__ = ["VllmServer", "VllmSettings"]

_HEALTH_LOOK_SECONDS = 0.5


@dataclass(frozen=True)
class VllmSettings:
    """`python`: the interpreter of vLLM's environment, which the worker starts servers with;
    `url`: instead, a server already running for the base model (nothing is started, and a
    dead one is someone else's to restart); `max_lora_rank` / `max_loras`: vLLM's LoRA slots
    (the largest rank it serves; adapters in one step); `kv_cache_gib`: vLLM's KV cache on the
    CPU (`VLLM_CPU_KVCACHE_SPACE`); `devices`: the CUDA devices a server runs on ("6,7",
    tensor parallel over them: not the training ranks' own), empty for vLLM's default;
    `startup_seconds`: how long a start may take."""

    python: str = ""
    url: str = ""
    max_lora_rank: int = 64
    max_loras: int = 8
    kv_cache_gib: int = 1
    devices: str = ""
    startup_seconds: float = 600.0


class VllmServer:
    """vLLM serving the model in `folder` (config, weights and tokenizer files side by side),
    in `dtype`, for contexts of up to `max_model_len` tokens; its log in `log_path`."""

    def __init__(
        self,
        settings: VllmSettings,
        *,
        folder: Path,
        dtype: str,
        max_model_len: int,
        log_path: Path,
    ) -> None:
        if not settings.url and not settings.python:
            raise UnavailableError(
                "the vLLM sampling backend needs vLLM's environment: run `make vllm` and set "
                "TREADLE_VLLM_PYTHON to its python (or TREADLE_VLLM_URL to a running server)"
            )
        self.settings = settings
        self._folder = folder
        self._dtype = dtype
        self._max_model_len = max_model_len
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._closed = False  # after `close`: never started again (a request in flight fails)
        self._lock = threading.Lock()
        self.url = settings.url.rstrip("/")
        self.starts = 0  # servers started, or found answering again (each without adapters)

    @property
    def pid(self) -> int | None:
        """The server process this object started (None for a server run elsewhere)."""
        return None if self._process is None else self._process.pid

    def ensure(self) -> str:
        """The server's URL, starting it first if it is not running (or has died). A server
        run elsewhere is only waited for."""
        with self._lock:
            self._refuse_closed()
            if self.settings.url:
                self._wait_healthy(None)
                return self.url
            if self._process is None or self._process.poll() is not None:
                self._start()
            return self.url

    def recover(self, seen_starts: int) -> None:
        """After a request failed on the server of start `seen_starts`: start it again if it
        is still that one and does not answer (the threads that saw it fail together restart
        it once); a server run elsewhere is waited for."""
        with self._lock:
            self._refuse_closed()
            if self.starts != seen_starts or self.healthy():
                return
            if self.settings.url:
                self._wait_healthy(None)
                self.starts += 1  # its adapters are gone
            else:
                self._start()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        """Stop the process this object started (its engine processes too), for good."""
        with self._lock:
            self._closed = True
            if self._process is not None and self._process.poll() is None:
                os.killpg(self._process.pid, signal.SIGTERM)
                try:
                    self._process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(self._process.pid, signal.SIGKILL)
                    self._process.wait()
            self._process = None

    @property
    def closed(self) -> bool:
        """Whether `close` was called (the server is never started again)."""
        return self._closed

    def _refuse_closed(self) -> None:
        if self._closed:
            raise UnavailableError("the worker is shutting down its vLLM server; retry the sample")

    def _start(self) -> None:
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)  # alive but not answering
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            # started by a thread of the backend's pool (or the sampling thread), which lives
            # as long as the worker's engine
            self._process = subprocess.Popen(
                ending_with_parent(self.command(port), python=self.settings.python),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        self.starts += 1
        self._wait_healthy(self._process)

    def command(self, port: int) -> list[str]:
        """vLLM's OpenAI-compatible server on `port`, as this worker starts it."""
        s = self.settings
        command = [
            s.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self._folder),
            "--served-model-name",
            "base",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self._dtype,
            "--max-model-len",
            str(self._max_model_len),
            "--enable-lora",
            "--max-lora-rank",
            str(s.max_lora_rank),
            "--max-loras",
            str(s.max_loras),
            # logprobs after the temperature, as Treadle's sampler reports them
            "--logprobs-mode",
            "processed_logprobs",
            "--seed",
            "0",
        ]
        if s.devices:  # one shard of the model on each device
            command += ["--tensor-parallel-size", str(len(s.devices.split(",")))]
        return command

    def environment(self) -> dict[str, str]:
        """The server's environment: the worker's, less Treadle's Python path, with its devices
        (a worker group's rank 0 has its own training device in view)."""
        s = self.settings
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        env.pop("PYTHONPATH", None)  # vLLM's environment, not Treadle's
        if s.devices:
            env["CUDA_VISIBLE_DEVICES"] = s.devices
        return env

    def _wait_healthy(self, process: subprocess.Popen[bytes] | None) -> None:
        deadline = time.monotonic() + self.settings.startup_seconds
        while not self.healthy():
            if process is not None and process.poll() is not None:
                raise UnavailableError(
                    f"the vLLM server exited with status {process.returncode} while starting; "
                    f"its log is {self._log_path}"
                )
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"the vLLM server at {self.url} did not answer within "
                    f"{self.settings.startup_seconds:.0f} s; its log is {self._log_path}"
                )
            time.sleep(_HEALTH_LOOK_SECONDS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
