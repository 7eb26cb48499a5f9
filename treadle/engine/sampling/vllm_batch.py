"""A sample batch served by vLLM: `SampleBatchAPI` over a `VllmBackend`.

Owns `VllmBatch`: each request is validated as the reference sampler validates it, its
snapshot's adapter handed to vLLM, a seed fixed (the request's, else a fresh one, so that a
request sent again after the server died draws the same tokens) and its requests sent at once;
vLLM batches everything in flight itself (continuous batching, paged KV, several adapters per
step). `step` returns the requests that finished meanwhile (waiting at most `STEP_SECONDS`); a
request's own `interrupt` ends it at the next step. vLLM streams each request's tokens as it
draws them (`vllm_requests.Streamed`), so `drawn` gives what each sample has so far. Must not
import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

from treadle.engine.lora.adapters import LoraWeights
from treadle.engine.sampling import vllm_requests
from treadle.engine.sampling.decode import Finished, Key, SampleJob, SampleRequest
from treadle.engine.sampling.rules import SampleResult
from treadle.engine.sampling.vllm_backend import VllmBackend
from treadle.platform.errors import NotFoundError, UnavailableError, ValidationError

__all__ = ["BASE_ADAPTER", "STEP_SECONDS", "VllmBatch"]

# What `Validate` names the adapter that serves the base model alone (B = 0).
BASE_ADAPTER = "\0base"


# How long `step` waits for a request to finish when none has.
STEP_SECONDS = 0.02

Validate = Callable[[SampleRequest], tuple[SampleJob, str, LoraWeights]]


class VllmBatch:
    """Requests on `backend`'s base model; `validate` gives a request's job, the id of the
    adapter it is sampled with (its snapshot's, or `BASE_ADAPTER`) and that adapter's float32
    weights, or raises what is wrong with it."""

    def __init__(self, backend: VllmBackend, validate: Validate) -> None:
        self._backend = backend
        self._validate = validate
        # each request's job, its answer to come, and what its samples have drawn so far
        self._running: dict[
            Key, tuple[SampleJob, Future[SampleResult], vllm_requests.Streamed]
        ] = {}

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, key: Key) -> bool:
        return key in self._running

    def add(self, requests: Sequence[tuple[Key, SampleRequest]]) -> Finished:
        finished: Finished = []
        for key, request in requests:
            if key in self._running:
                continue
            try:
                if request.base_model != self._backend.base_model:
                    raise ValidationError(
                        f"this batch samples {self._backend.base_model!r}, not "
                        f"{request.base_model!r}"
                    )
                job, adapter_id, weights = self._validate(request)
                vllm_requests.check_supported(job.scoring)
                adapter = self._backend.adapter(adapter_id, weights)
            except (ValidationError, NotFoundError, UnavailableError) as exc:
                finished.append((key, exc))
                continue
            seed = job.params.seed if job.params.seed is not None else secrets.randbits(63)
            streamed = vllm_requests.Streamed(job.num_samples)
            future = self._backend.pool.submit(self._backend.run, job, adapter, seed, streamed)
            self._running[key] = (job, future, streamed)
        return finished

    def step(self, interrupt: Callable[[], None] | None = None) -> Finished:
        if interrupt is not None:
            interrupt()
        finished: Finished = []
        for key, (job, _, _) in list(self._running.items()):
            try:
                if job.interrupt is not None:
                    job.interrupt()
            except Exception as exc:  # this request only; vLLM's answer is dropped
                del self._running[key]
                finished.append((key, exc))
        futures = [future for _, future, _ in self._running.values()]
        if futures and not any(f.done() for f in futures):
            wait(futures, timeout=STEP_SECONDS, return_when=FIRST_COMPLETED)
        for key, (_, future, _) in list(self._running.items()):
            if future.done():
                del self._running[key]
                error = future.exception()
                finished.append((key, error if isinstance(error, Exception) else future.result()))
        return finished

    def drawn(self, key: Key) -> tuple[list[list[int]], list[list[float]]]:
        """Each sample's tokens so far, as vLLM streams them, and their logprobs."""
        return self._running[key][2].drawn()
