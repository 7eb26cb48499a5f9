"""The vLLM sampling backend of one base model: its server, its adapters, its requests.

Owns `VllmBackend`: the `VllmServer` of the base model, the snapshots it has been handed (each
written as the peft folder Treadle writes for checkpoints and loaded under a name made from its
weights' digest, so a name never serves other weights: vLLM keeps serving the old weights of a
name loaded again with new files; unloaded when the snapshot is released and no job in flight
uses it: snapshots are released by training calls that run beside samples), and `run`, which
sends one job's requests (its samples streamed: their tokens readable as they come) and, when
the server died under them (or did not start), starts it again and sends them again (the seed is
fixed when the job joins, so the answer is the same).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from treadle.engine.lora.adapters import LoraSpec, LoraWeights
from treadle.engine.lora.files import write_adapter
from treadle.engine.sampling import vllm_requests
from treadle.engine.sampling.decode import SampleJob
from treadle.engine.sampling.rules import EosIds, SampleResult
from treadle.engine.sampling.vllm_server import VllmServer
from treadle.platform.errors import UnavailableError, ValidationError

__all__ = ["VllmBackend"]

# A job whose server died under it is sent again, to a new server, at most this many times.
_ATTEMPTS = 3
# After a server that did not start, the next try waits this long.
_START_PAUSE_SECONDS = 5.0
_REQUEST_SECONDS = 3600.0


class _ServerFailed(Exception):
    """The server did not answer, or answered that its engine failed."""


class VllmBackend:
    """Jobs on `server`'s base model, `base_model` (its end-of-sequence ids `eos_token_id`);
    adapter folders under `adapter_dir`; `threads` jobs in flight at once."""

    def __init__(
        self,
        server: VllmServer,
        *,
        base_model: str,
        eos_token_id: EosIds,
        adapter_dir: Path,
        threads: int = 64,
    ) -> None:
        self.server = server
        self.base_model = base_model
        self._eos = eos_token_id
        self._adapter_dir = adapter_dir
        self._lock = threading.Lock()
        self._names: dict[str, tuple[int, str]] = {}  # snapshot -> (id of its weights, name)
        self._loaded: set[str] = set()  # names loaded into the server of start `_generation`
        self._using: Counter[str] = Counter()  # name -> jobs handed it and not yet done
        self._released: set[str] = set()  # names whose snapshots went while jobs used them
        self._generation = -1
        # vLLM (0.32) fails its engine when a step computes prompt logprobs beside any other
        # sequence with LoRA enabled (its LoRA output head indexes the step's samples, not the
        # prompt's positions): a scoring request runs alone, samples wait meanwhile
        self._gate = _Gate()
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vllm")

    def adapter(self, snapshot_id: str, weights: LoraWeights) -> str:
        """The name the snapshot's weights (or another adapter's, by an id of its own) are
        served under, their folder written if new, held for one job: `run` it with this name
        (which lets it go when done)."""
        with self._lock:
            name = self._name(snapshot_id, weights)
            self._using[name] += 1
            self._released.discard(name)
            return name

    def _name(self, snapshot_id: str, weights: LoraWeights) -> str:
        known = self._names.get(snapshot_id)
        if known is not None and known[0] == id(weights):
            return known[1]
        name = "snap-" + _digest(weights)
        folder = self._adapter_dir / name
        if not (folder / "adapter_config.json").is_file():
            rank = next(iter(weights.A.values())).shape[0]
            spec = LoraSpec(rank=rank, alpha=weights.scale * rank)
            write_adapter(folder, self.base_model, spec, weights, None)
        self._names[snapshot_id] = (id(weights), name)
        return name

    def release(self, snapshot_id: str) -> None:
        """Unload a released snapshot's adapter and delete its folder (unless another
        snapshot has the same weights), at once or, while jobs use it, when the last is
        done."""
        with self._lock:
            known = self._names.pop(snapshot_id, None)
            if known is None or any(n == known[1] for _, n in self._names.values()):
                return
            if self._using[known[1]]:
                self._released.add(known[1])
            else:
                self._unload(known[1])

    def _unload(self, name: str) -> None:
        if name in self._loaded and self._generation == self.server.starts:
            # a server that does not answer is started afresh, without it
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(
                    f"{self.server.url}/v1/unload_lora_adapter",
                    json={"lora_name": name},
                    timeout=60.0,
                )
        self._loaded.discard(name)
        shutil.rmtree(self._adapter_dir / name, ignore_errors=True)

    def run(
        self, job: SampleJob, adapter: str, seed: int, streamed: vllm_requests.Streamed
    ) -> SampleResult:
        """The job's result, from the server (started again if it died, and the job resent),
        sampled with `adapter` (a name `adapter` gave, let go once done); its samples' tokens
        gathered in `streamed` as they come (restarted when the job is sent again: the same
        seed draws the same tokens, which the settled result has the last word on)."""
        try:
            seen = None
            for attempt in range(_ATTEMPTS):
                try:
                    if seen is not None:
                        self.server.recover(seen)
                    url = self.server.ensure()
                except UnavailableError:
                    # it did not start (memory short for a moment, say): try again shortly,
                    # unless the worker is closing it or this was the last try
                    if self.server.closed or attempt == _ATTEMPTS - 1:
                        raise
                    time.sleep(_START_PAUSE_SECONDS)
                    continue
                seen = self.server.starts
                try:
                    streamed.restart()
                    return self._run_once(url, job, adapter, seed, streamed)
                except _ServerFailed as exc:
                    if attempt == _ATTEMPTS - 1:
                        raise UnavailableError(
                            f"the vLLM server failed {_ATTEMPTS} times under this sample "
                            f"({exc}); retry it"
                        ) from exc
            raise AssertionError("unreachable")
        finally:
            with self._lock:
                self._using[adapter] -= 1
                if not self._using[adapter]:
                    del self._using[adapter]
                    if adapter in self._released:
                        self._released.discard(adapter)
                        self._unload(adapter)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.close()

    def _run_once(
        self,
        url: str,
        job: SampleJob,
        adapter: str,
        seed: int,
        streamed: vllm_requests.Streamed,
    ) -> SampleResult:
        model = self._load(url, adapter)
        prompt = list(job.prompt)
        params = job.params
        samples = []
        if params.max_tokens > 0 and job.num_samples > 0:
            body = vllm_requests.sample_body(
                model,
                prompt,
                job.num_samples,
                params,
                seed=seed,
                eos_token_id=self._eos,
                topk_logprobs=job.topk_sample_logprobs,
            )
            with self._gate.shared():
                self._stream(url, "/v1/completions", body, streamed)
            samples = vllm_requests.sequences(streamed.answer(), job.topk_sample_logprobs)
        scoring = job.scoring
        scores = None
        if scoring.logprobs or scoring.topk:
            body = vllm_requests.scoring_body(model, prompt, scoring)
            with self._gate.alone():
                answer = self._post(url, "/v1/completions", body)
            scores = vllm_requests.prompt_scores(answer, prompt, scoring)
        return SampleResult(
            sequences=samples,
            prompt_logprobs=None if scores is None else scores.prompt_logprobs,
            prefill_tokens=len(prompt),
            sample_tokens=sum(len(s.tokens) for s in samples),
            topk_prompt_logprobs=None if scores is None else scores.topk_prompt_logprobs,
        )

    def _load(self, url: str, name: str) -> str:
        """`name` loaded into the server at `url` (again, after the server was started anew)."""
        with self._lock:
            if self._generation != self.server.starts:
                self._generation, self._loaded = self.server.starts, set()
            if name in self._loaded:
                return name
            body = {"lora_name": name, "lora_path": str(self._adapter_dir / name)}
            self._post(url, "/v1/load_lora_adapter", body, json_answer=False)
            self._loaded.add(name)
            return name

    def _post(self, url: str, path: str, body: dict[str, Any], *, json_answer: bool = True) -> Any:
        try:
            response = httpx.post(url + path, json=body, timeout=_REQUEST_SECONDS)
        except httpx.TransportError as exc:
            raise _ServerFailed(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise _ServerFailed(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:
            raise ValidationError(f"vLLM refused the request: {_message(response)}")
        return response.json() if json_answer else response.text

    def _stream(
        self, url: str, path: str, body: dict[str, Any], streamed: vllm_requests.Streamed
    ) -> None:
        """Send a streamed request; its chunks go to `streamed` as they come."""
        try:
            with httpx.stream("POST", url + path, json=body, timeout=_REQUEST_SECONDS) as answer:
                if answer.status_code >= 400:
                    answer.read()
                    if answer.status_code >= 500:
                        raise _ServerFailed(f"HTTP {answer.status_code}: {answer.text[:200]}")
                    raise ValidationError(f"vLLM refused the request: {_message(answer)}")
                ended = False
                for line in answer.iter_lines():
                    data = line.removeprefix("data: ").strip()
                    if not line.startswith("data: ") or not data:
                        continue
                    if data == "[DONE]":
                        ended = True
                        break
                    streamed.add(json.loads(data))
        except (httpx.TransportError, RuntimeError, json.JSONDecodeError) as exc:
            # not ValueError: a refusal (ValidationError) is one, and is the client's to see
            raise _ServerFailed(f"{type(exc).__name__}: {exc}") from exc
        if not ended:
            raise _ServerFailed("the stream ended before vLLM's [DONE]")


class _Gate:
    """Requests that may run together (`shared`) and requests that must run alone (`alone`,
    served first once asked for, so a stream of samples does not starve them)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._alone = False
        self._waiting_alone = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting_alone += 1
            self._cond.wait_for(lambda: not self._alone and not self._shared)
            self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


def _digest(weights: LoraWeights) -> str:
    h = hashlib.sha256(repr(weights.scale).encode())
    for name, tensor in weights.tensors():
        h.update(name.encode())
        h.update(tensor.detach().to("cpu").contiguous().float().numpy().tobytes())
    return h.hexdigest()[:24]


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error", {})
        return str(error.get("message") if isinstance(error, dict) else error)[:500]
    except ValueError:
        return response.text[:500]
