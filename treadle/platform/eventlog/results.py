"""The operations' results: one typed class per `OpType`, beside its payload (`optypes`).

The worker's handlers build them; the log stores `result.to_json()` as the operation's result
(its row and its `OperationCompleted`); readers (the Tinker wire, the OpenAI answers, SageMaker's
results, audit, recorded samples) parse a stored result once (`read`, or the class's own
`model_validate`) and read its fields. The stored JSON is exactly what the worker wrote before
these types: every key it always wrote is written (None as null), and an optional part that was
not asked for is left out, not written as null (`OMITTED_WHEN_NONE`), so results already in the
log parse, and the types change nothing a client or a replay reads.
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from treadle.platform.eventlog.optypes import OpType, Tensor

TopkRows = list[list[tuple[int, float]]]  # per position: (token id, logprob), likeliest first


class _Stored(BaseModel):
    """A result, or a part of one, as the log stores it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    # Optional parts whose key the stored JSON leaves out when they are None.
    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self.OMITTED_WHEN_NONE:
            if name in data and data[name] is None:
                del data[name]
        return data


class Result(_Stored):
    """An operation's result."""

    TYPE: ClassVar[OpType]

    def to_json(self) -> dict[str, Any]:
        """The result as the log stores it: Python values as the engine gave them (not pydantic's
        JSON mode, which would write a NaN as null where the log stored what it was given)."""
        return self.model_dump()


class CreateModelOutput(Result):
    TYPE = OpType.CREATE_MODEL
    model_id: str


class LoadWeightsOutput(Result):
    TYPE = OpType.LOAD_WEIGHTS
    model_id: str
    path: str


class RebuildOutput(Result):
    TYPE = OpType.REBUILD
    model_id: str
    report: dict[str, Any]  # the verified replay's report (worker/recovery.py's `Rebuilt`)


class ForwardBackwardOutput(Result):
    """Per datum its outputs by name (`logprobs`, `elementwise_loss`: float32 [T_i], or
    [T_i, K] for cross_entropy's top-K targets), and the request's metrics named
    `name:reduction` (`loss:sum`, the sampler-vs-trainer `kl_sample_train_*`). `pass_tokens`
    is the pass budget the engine ran it with (padded tokens a pass): the grouping of the data
    into passes changes the float rounding, so recovery, replay and fork run it again with
    this budget, whatever the worker that does so is configured with (absent from results
    written before it was recorded: those ran with the CPU's rule, the engine's default
    there)."""

    TYPE = OpType.FORWARD_BACKWARD
    OMITTED_WHEN_NONE = frozenset({"pass_tokens"})
    loss_fn_outputs: list[dict[str, Tensor]]
    metrics: dict[str, float]
    pass_tokens: int | None = None


class OptimStepOutput(Result):
    TYPE = OpType.OPTIM_STEP
    metrics: dict[str, float]  # grad_norm:mean, learning_rate:mean


class SaveWeightsOutput(Result):
    """The checkpoint's `tinker://` path; the settlement's registration adds the model package
    version it registered (absent from results settled by a worker that did not record it)."""

    TYPE = OpType.SAVE_WEIGHTS
    OMITTED_WHEN_NONE = frozenset({"model_package_group", "version"})
    path: str
    model_package_group: str | None = None
    version: int | None = None


class SaveWeightsForSamplerOutput(Result):
    TYPE = OpType.SAVE_WEIGHTS_FOR_SAMPLER
    sampling_session_id: str
    snapshot_id: str


class LoadSamplerWeightsOutput(Result):
    TYPE = OpType.LOAD_SAMPLER_WEIGHTS
    snapshot_id: str


class SampledSequence(_Stored):
    """One sampled sequence: its tokens, each token's logprob and, if asked for, the k likeliest
    alternatives at each position (`topk_logprobs`, left out when not asked for)."""

    OMITTED_WHEN_NONE = frozenset({"topk_logprobs"})
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk_logprobs: TopkRows | None = None


class TargetLogprobs(_Stored):
    """target_prompt_logprobs' answer: a logprob in place of each id the request listed, in its
    layout (dense [rows, k] row-major, or CSR with its row pointers and column indices)."""

    rows: int
    k: int
    crow_indices: list[int] | None = None
    col_indices: list[int] | None = None
    values: list[float]


class PromptAltTokens(_Stored):
    """prompt_alt_tokens' answer: [P - 1][k] token ids drawn after each prompt prefix, and their
    logprobs."""

    k: int
    tokens: list[list[int]]
    logprobs: list[list[float]]


class SampleOutput(Result):
    """A sample's (or compute_logprobs') sequences and prompt scores: `prompt_logprobs[i]` the
    logprob of prompt token i (None where not scored), `topk_prompt_logprobs[i]` its k likeliest
    alternatives ([] where not scored); both null when not asked for. `target_prompt_logprobs`
    and `prompt_alt_tokens` are left out when not asked for."""

    TYPE = OpType.SAMPLE
    OMITTED_WHEN_NONE = frozenset({"target_prompt_logprobs", "prompt_alt_tokens"})
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: TopkRows | None = None
    target_prompt_logprobs: TargetLogprobs | None = None
    prompt_alt_tokens: PromptAltTokens | None = None


RESULTS: dict[OpType, type[Result]] = {
    cls.TYPE: cls
    for cls in (
        CreateModelOutput,
        LoadWeightsOutput,
        ForwardBackwardOutput,
        OptimStepOutput,
        SaveWeightsOutput,
        SaveWeightsForSamplerOutput,
        SampleOutput,
        LoadSamplerWeightsOutput,
        RebuildOutput,
    )
}
assert set(RESULTS) == set(OpType), "every operation type needs a result type"


def read(op_type: str, data: Any) -> Result:
    """A stored result as its typed class. Raises ValueError naming the operation type if the
    data does not fit it (a bug or a damaged log: the worker wrote it)."""
    cls = RESULTS[OpType(op_type)]
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ValueError(f"a stored {op_type} result does not fit its type: {exc}") from None
