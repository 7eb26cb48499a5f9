"""SamplingClient: the tinker SDK's sampling client, taking prompts as plain token lists.

Imports nothing from the server side.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import tinker
from tinker import types

from treadle.client.refusals import translated
from treadle.client.tokenizer import fetch_tokenizer


def as_model_input(prompt: Sequence[int] | types.ModelInput) -> types.ModelInput:
    if isinstance(prompt, types.ModelInput):
        return prompt
    return types.ModelInput.from_ints([int(t) for t in prompt])


class SamplingClient:
    """Samples from a base model or a training session's weights.

    Example:
        res = sc.sample([1, 2, 3], num_samples=2, sampling_params=SamplingParams(max_tokens=8))
        print(res.result().sequences[0].tokens)
    """

    def __init__(
        self, inner: tinker.SamplingClient, *, base_url: str, api_key: str, base_model: str
    ):
        self._inner = inner
        self._base_url = base_url
        self._api_key = api_key
        self.base_model = base_model

    def sample(
        self,
        prompt: Sequence[int] | types.ModelInput,
        num_samples: int = 1,
        sampling_params: types.SamplingParams | None = None,
        *,
        include_prompt_logprobs: bool = False,
    ) -> Any:
        """Sample `num_samples` continuations; returns a future of a SampleResponse.

        Args:
            prompt: token ids (or a tinker ModelInput).
            num_samples: how many independent continuations.
            sampling_params: max_tokens, temperature, top_k, top_p, stop, seed.
            include_prompt_logprobs: also return each prompt token's logprob.
        Raises:
            tinker.RequestFailedError (from .result()) when the server rejects the request;
            treadle.QuotaExceededError (from .result()) when a budget is spent.
        """
        return translated(
            self._inner.sample(
                as_model_input(prompt),
                num_samples=num_samples,
                sampling_params=sampling_params or types.SamplingParams(),
                include_prompt_logprobs=include_prompt_logprobs,
            )
        )

    def compute_logprobs(self, prompt: Sequence[int] | types.ModelInput) -> Any:
        """Future of each prompt token's logprob given its prefix (the first is None)."""
        return translated(self._inner.compute_logprobs(as_model_input(prompt)))

    def get_tokenizer(self) -> Any:
        return fetch_tokenizer(self._base_url, self._api_key, self.base_model)

    def result(self, timeout: float | None = None) -> SamplingClient:
        """This client. The tinker SDK hands sampling clients back as futures of the client;
        Treadle hands back the client, and this keeps code that resolves the future working."""
        return self

    def __await__(self) -> Generator[Any, None, SamplingClient]:
        """`await` gives this client, as awaiting the tinker SDK's future of it does."""
        return self._itself().__await__()

    async def _itself(self) -> SamplingClient:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
