"""TrainingClient: the tinker SDK's training client plus Treadle's ergonomics.

Every GPU-bound call returns a future at once; operations run in call order, so `optim_step`
may be sent before `forward_backward` finishes. `stop()` (or leaving a `with` block) stops the
session. Saves need no name (each gets one unique in the session), dtype-less TensorData take
their key's dtype when sent, and `create_sampling_client()` with no path samples the base
model, as in SageMaker's SDK. Imports nothing from the server side.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import httpx
import tinker
from tinker import types
from tinker.lib.api_future_impl import _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.retry_handler import RetryConfig

from treadle.client.billing import BillingClient, SessionUsage
from treadle.client.refusals import refusals_translated, translated
from treadle.client.sampling import SamplingClient
from treadle.client.tokenizer import fetch_tokenizer
from treadle.client.types import as_sent

# Default checkpoint names, numbered per training client (one per session) from 1.
DEFAULT_NAMES = {"state": "state-{:04d}", "sampler_weights": "weights-{:04d}"}


class TrainingClient:
    """A live training session: a base model plus a LoRA adapter on a worker.

    Example:
        with svc.create_lora_training_client("treadle/tiny-debug", rank=8, alpha=16) as tc:
            tc.forward_backward(datums, loss_fn="cross_entropy").result()
    """

    def __init__(
        self,
        inner: tinker.TrainingClient,
        *,
        base_url: str,
        api_key: str,
        base_model: str,
        name: str | None,
    ) -> None:
        self._inner = inner
        self._base_url = base_url
        self._api_key = api_key
        self.base_model = base_model
        self.training_session_name = name
        self._stopped = False
        self._saved: set[tuple[str, str]] = set()  # (kind, name) of each save through this client

    @property
    def model_id(self) -> str:
        return str(self._inner.model_id)

    def forward_backward(
        self,
        data: Sequence[types.Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
    ) -> Any:
        """Compute the loss and accumulate gradients; returns a future of ForwardBackwardOutput.

        Args:
            data: the datums (model_input + loss_fn_inputs, targets already shifted). A
                treadle.TensorData built without a dtype is sent as int64 under
                `target_tokens` and float32 under any other key.
            loss_fn: the loss name, e.g. "cross_entropy".
            loss_fn_config: numeric options of the loss (e.g. PPO clip thresholds).
        Returns:
            a future of ForwardBackwardOutput (`.metrics`, `.loss_fn_outputs`).
        Raises:
            ValueError: non-integer values in a dtype-less `target_tokens`.
            tinker.RequestFailedError (from .result()) when the server rejects the operation;
            treadle.QuotaExceededError (from .result()) when a budget is spent.
        Example:
            fb = tc.forward_backward(datums, loss_fn="ppo")
            print(fb.result().metrics["loss:sum"])
        """
        sent = [as_sent(d) for d in data]
        future = self._inner.forward_backward(sent, loss_fn, loss_fn_config)  # type: ignore[arg-type]
        return translated(future)

    def forward(
        self,
        data: Sequence[types.Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
    ) -> Any:
        """Like forward_backward, with no gradient and no state change."""
        sent = [as_sent(d) for d in data]
        future = self._inner.forward(sent, loss_fn, loss_fn_config)  # type: ignore[arg-type]
        return translated(future)

    def optim_step(self, adam_params: types.OptimParams | None = None) -> Any:
        """Apply the accumulated gradients with the session's optimizer: AdamParams (default)
        or, for a session created with DimuonOptimizerConfig, DimuonParams; returns a future
        of OptimStepResponse."""
        return translated(self._inner.optim_step(adam_params or types.AdamParams()))

    def save_state(self, name: str | None = None, ttl_seconds: int | None = None) -> Any:
        """Save adapter + optimizer state as `tinker://<model id>/weights/<name>` (resumable
        with ServiceClient.create_training_client_from_state_with_optimizer).

        Each save is registered as a new version of the session's model package group.

        Args:
            name: the checkpoint's name; default `state-0001`, `state-0002`, ... numbered per
                session from 1, skipping names this client already saved under.
            ttl_seconds: delete the checkpoint after this long (default: never).
        Returns:
            a future of SaveWeightsResponse; its `.path` is the checkpoint's path.
        Example:
            path = tc.save_state().result().path
            resumed = svc.create_training_client_from_state_with_optimizer(path)
        """
        name = self._name("state", name)
        return translated(self._inner.save_state(name, ttl_seconds=ttl_seconds))

    def load_state(self, path: str) -> Any:
        """Load a training checkpoint's weights into this session (fresh optimizer state)."""
        with _supported_by_treadle():
            return translated(self._inner.load_state(path))

    def load_state_with_optimizer(self, path: str) -> Any:
        """Load a training checkpoint's weights and optimizer state into this session."""
        with _supported_by_treadle():
            return translated(self._inner.load_state_with_optimizer(path))

    def save_weights_for_sampler(
        self,
        name: str | None = None,
        *,
        merge_weights: bool = False,
        ttl_seconds: int | None = None,
    ) -> Any:
        """Save weights for sampling as `tinker://<model id>/sampler_weights/<name>`, registered
        as a new version of the session's model package group.

        With `merge_weights=True` the checkpoint is a full Hugging Face model folder (the adapter
        merged into the base weights) that `transformers` loads with no Treadle code; download it
        with `treadle checkpoints download PATH DIR`.

        Args:
            name: the checkpoint's name; default `weights-0001`, `weights-0002`, ... numbered
                per session from 1, skipping names this client already saved under.
            merge_weights: save the merged model instead of the adapter.
            ttl_seconds: delete the checkpoint after this long (default: never).
        Returns:
            a future whose `.path` is the checkpoint's path.
        Example:
            path = tc.save_weights_for_sampler(merge_weights=True).result().path
            sc = svc.create_sampling_client(path)
        """
        name = self._name("sampler_weights", name)
        if not merge_weights:
            return translated(self._inner.save_weights_for_sampler(name, ttl_seconds=ttl_seconds))
        return translated(self._save_merged(name, ttl_seconds))

    def _name(self, kind: str, name: str | None) -> str:
        """`name`, or the first default name of `kind` this client has not saved under."""
        if not name:
            number = 1
            while (kind, DEFAULT_NAMES[kind].format(number)) in self._saved:
                number += 1
            name = DEFAULT_NAMES[kind].format(number)
        self._saved.add((kind, name))
        return name

    def _save_merged(self, name: str, ttl_seconds: int | None) -> Any:
        inner = self._inner
        holder = inner.holder
        request_id = inner._get_request_id()
        body: dict[str, Any] = {
            "model_id": self.model_id,
            "path": name,
            "seq_id": request_id + 1,
            "merge_weights": True,
            "type": "save_weights_for_sampler",
        }
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds

        async def send() -> Any:
            start = time.time()

            async def post() -> Any:
                with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
                    return await client.post(
                        "/api/v1/save_weights_for_sampler",
                        body=body,
                        cast_to=types.UntypedAPIFuture,
                    )

            async with inner._take_turn(request_id):
                future = await holder.execute_with_retries(post)
            result = await _APIFuture(
                types.SaveWeightsForSamplerResponseInternal,
                holder,
                future,
                start,
                "SaveWeightsForSampler",
            ).result_async()
            return types.SaveWeightsForSamplerResponse(path=result.path)

        return holder.run_coroutine_threadsafe(send())

    def save_weights_and_get_sampling_client(self) -> SamplingClient:
        """Snapshot the current weights and return a SamplingClient on them (waits for the save)."""
        with refusals_translated():
            inner = self._inner.save_weights_and_get_sampling_client().result()
        return SamplingClient(
            inner, base_url=self._base_url, api_key=self._api_key, base_model=self.base_model
        )

    def create_sampling_client(
        self,
        model_path: str = "",
        retry_config: RetryConfig | None = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """A sampler on a saved checkpoint, or with no path on the session's base model (an
        empty `model_package_arn` means the same in SageMaker's SDK).

        Takes the tinker SDK's arguments. The tinker SDK returns a future of the client; this
        returns the client, which also answers `.result()` and `await` with itself, so code
        written for either SDK runs.

        Args:
            model_path: a `tinker://...` checkpoint path; "" for the base model.
            retry_config: the tinker SDK's RetryConfig for the sampler's requests.
            record_stability_info: record each sample's stability information (for
                stable_reinforce).
        Returns:
            a SamplingClient.
        Raises:
            tinker.BadRequestError / tinker.NotFoundError: an unknown or unreadable checkpoint.
        Example:
            sc = tc.create_sampling_client()  # the base model
            print(sc.sample([1, 2, 3], num_samples=2).result().sequences[0].tokens)
        """
        with refusals_translated():
            inner = tinker.SamplingClient.create(
                self._inner.holder,
                model_path=model_path or None,
                base_model=None if model_path else self.base_model,
                retry_config=retry_config,
                record_stability_info=record_stability_info,
            ).result()
        return SamplingClient(
            inner, base_url=self._base_url, api_key=self._api_key, base_model=self.base_model
        )

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer, served by the platform (no hub access)."""
        return fetch_tokenizer(self._base_url, self._api_key, self.base_model)

    def get_info(self) -> Any:
        return self._inner.get_info()

    def get_usage(self) -> SessionUsage:
        """This session's usage so far: tokens by class, their cost, and its spend cap.

        Returns:
            a SessionUsage (`usage.tokens`, `usage.cost_usd`, `max_cost_usd`, `spent_usd`,
            `reserved_usd`: what its running operations may still cost).
        Example:
            print(tc.get_usage())  # sess-...:train:0: prefill 0, sample 0, train 3,072 tokens; ...
        """
        client = BillingClient(self._base_url, self._api_key)
        try:
            return client.session_usage(self.model_id)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the session: its worker frees the adapter. Idempotent."""
        if self._stopped:
            return
        response = httpx.post(
            f"{self._base_url}/api/v1/treadle/sessions/{self.model_id}/stop",
            headers={"X-API-Key": self._api_key},
            timeout=30,
        )
        response.raise_for_status()
        self._stopped = True

    def __enter__(self) -> TrainingClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _supported_by_treadle() -> Iterator[None]:
    """The tinker SDK warns that load_state* may leave its hosted service; Treadle serves it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*load_state.*deprecated", category=FutureWarning
        )
        yield
