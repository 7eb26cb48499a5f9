"""The worker's dispatch table: one handler per `OpType`, shared by live execution and replay.

A handler runs one operation's payload on the engine against `call.adapter_id` and returns its
`Outcome` (the result the client sees, tokens by class, and what to register in the settlement's
transaction). In replay (`call.live` false) it writes no files and registers nothing: the log
already holds what it did; and it runs as its recorded result says it first ran (`call.recorded`:
a forward_backward's pass budget, which decides its float rounding). A `rebuild` (the first operation of a replay or a fork) reads another
session's log, so the host passes it in as `call.rebuild`. Imports platform and the engine;
never api.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa

from treadle.engine import (
    AdamSpec,
    DimuonSpec,
    EngineAPI,
    EngineDatum,
    EngineImage,
    Interrupt,
    LoraSpec,
    PromptScoring,
    PromptTargets,
    SampleRequest,
    SampleResult,
    SamplingSpec,
)
from treadle.platform.checkpoints import auto_checkpoints
from treadle.platform.checkpoints.storage import ObjectStore
from treadle.platform.eventlog import optypes, results
from treadle.platform.eventlog.optypes import (
    CreateModel,
    ForwardBackward,
    LoadSamplerWeights,
    LoadWeights,
    OptimStep,
    OpType,
    Payload,
    Rebuild,
    Sample,
    SaveWeights,
    SaveWeightsForSampler,
)
from treadle.worker import checkpoint_io

# Runs in the settlement's transaction; returns fields to add to the result (or None).
Registration = Callable[[sa.Connection], Mapping[str, Any] | None]


def no_tokens() -> dict[str, int]:
    return {"prefill": 0, "sample": 0, "train": 0}


@dataclass
class Outcome:
    result: results.Result  # stored as `result.to_json()`, with what `also` adds
    tokens: dict[str, int] = field(default_factory=no_tokens)
    also: Registration | None = None  # runs in the settlement's transaction if it succeeded
    point: auto_checkpoints.AutoCheckpoint | None = None  # a recovery point it wrote


@dataclass(frozen=True)
class Call:
    """What a handler runs against: the session's adapter (or a scratch one, in a rebuild)."""

    engine: EngineAPI
    store: ObjectStore
    tenant_id: str
    session_id: str
    base_model: str
    adapter_id: str
    seq_id: int
    live: bool
    interrupt: Interrupt | None = None
    # Builds call.adapter_id from another session's log (live calls only); returns the report.
    rebuild: Callable[[Call, Rebuild], dict[str, Any]] | None = None
    # In replay: the result the operation stored when it first ran (what it must run as again).
    recorded: Mapping[str, Any] | None = None


def create_model(call: Call, p: CreateModel) -> Outcome:
    if call.engine.has_adapter(call.adapter_id):
        call.engine.drop_adapter(call.adapter_id)
    call.engine.create_adapter(
        call.adapter_id, p.base_model, LoraSpec(**p.lora_config.model_dump())
    )
    return Outcome(results.CreateModelOutput(model_id=call.session_id))


def load_weights(call: Call, p: LoadWeights) -> Outcome:
    checkpoint_io.load(
        call.engine,
        call.store,
        call.adapter_id,
        p.base_model,
        p.prefix,
        with_optimizer=p.optimizer,
        optimizer=p.lora_config.optimizer,
    )
    outcome = Outcome(results.LoadWeightsOutput(model_id=call.session_id, path=p.path))
    if call.live:
        # Keep a copy: recovery must not depend on a file the user can delete or let expire.
        _keep_copy(call, outcome)
    return outcome


def rebuild(call: Call, p: Rebuild) -> Outcome:
    if call.rebuild is None:  # replaying the session's own log: its copy at seq 0 is gone
        raise FileNotFoundError(
            f"the copy of the state this {p.mode} was built from ({p.source_session_id} at seq "
            f"{p.to_seq}) is gone"
        )
    report = call.rebuild(call, p)
    outcome = Outcome(results.RebuildOutput(model_id=call.session_id, report=report))
    # Its own copy: the replay or fork never needs the source's files again.
    _keep_copy(call, outcome)
    return outcome


def _keep_copy(call: Call, outcome: Outcome) -> None:
    """Write the adapter as it stands as a `loaded` recovery point at this seq_id, recorded in
    the settlement's transaction."""
    prefix = auto_checkpoints.storage_prefix(call.tenant_id, call.session_id, call.seq_id)
    size = checkpoint_io.write_point(call.engine, call.store, call.adapter_id, prefix)
    state = call.engine.state_hashes(call.adapter_id)
    point = auto_checkpoints.AutoCheckpoint(
        call.session_id, call.seq_id, auto_checkpoints.LOADED, prefix, state, size
    )
    outcome.point = point
    outcome.also = lambda conn: auto_checkpoints.record(
        conn, tenant_id=call.tenant_id, checkpoint=point
    )


def forward_backward(call: Call, p: ForwardBackward) -> Outcome:
    data = [
        EngineDatum(
            tokens=tuple(d.tokens),
            loss_fn_inputs={
                name: np.asarray(t.data, dtype=t.dtype).reshape(t.shape)
                for name, t in d.loss_fn_inputs.items()
            },
            sampler_logprobs=None
            if d.provenance is None
            else np.array(
                [np.nan if q is None else q for q in d.provenance.sampler_logprobs], np.float32
            ),
            sampled_targets=None
            if d.sampled_targets is None
            else np.asarray(d.sampled_targets, bool),
            images=_images(d.images),
        )
        for d in p.data
    ]
    pass_tokens = None  # live: the engine's own budget
    if call.recorded is not None:  # replay: the passes it first ran as, for the same bits
        pass_tokens = results.ForwardBackwardOutput.model_validate(call.recorded).pass_tokens
    out = call.engine.forward_backward(
        call.adapter_id,
        data,
        p.loss_fn,
        p.loss_fn_config,
        forward_only=p.forward_only,
        pass_tokens=pass_tokens,
        interrupt=call.interrupt,
        custom_loss=None if p.custom_loss is None else p.custom_loss.model_dump(mode="json"),
    )
    tokens = no_tokens()
    tokens["prefill" if p.forward_only else "train"] = out.train_tokens
    outputs = [{name: _tensor(arr) for name, arr in per_datum.items()} for per_datum in out.outputs]
    result = results.ForwardBackwardOutput(
        loss_fn_outputs=outputs, metrics=out.metrics, pass_tokens=out.pass_tokens
    )
    return Outcome(result, tokens)


def optim_step(call: Call, p: OptimStep) -> Outcome:
    spec: AdamSpec | DimuonSpec
    if p.optimizer == "dimuon":
        spec = DimuonSpec(p.learning_rate, p.beta1, p.grad_clip_norm)
    else:
        spec = AdamSpec(**p.model_dump(exclude={"optimizer"}))
    metrics = call.engine.optim_step(call.adapter_id, spec)
    return Outcome(results.OptimStepOutput(metrics=metrics))


def save_weights(call: Call, p: SaveWeights) -> Outcome:
    assert call.live, "a checkpoint save is never replayed"
    result, register = checkpoint_io.save(
        call.engine, call.store, call.adapter_id, call.tenant_id, p
    )
    return Outcome(result, also=register)


def save_weights_for_sampler(call: Call, p: SaveWeightsForSampler) -> Outcome:
    call.engine.snapshot(call.adapter_id, p.snapshot)
    return Outcome(
        results.SaveWeightsForSamplerOutput(
            sampling_session_id=p.sampler_id, snapshot_id=p.snapshot
        )
    )


def sample(call: Call, p: Sample) -> Outcome:
    (out,) = call.engine.sample_batch([sample_request(call, p)], interrupt=call.interrupt)
    if isinstance(out, Exception):
        raise out
    return sample_outcome(p, out)


def load_sampler_weights(call: Call, p: LoadSamplerWeights) -> Outcome:
    checkpoint_io.ensure_snapshot(
        call.engine, call.store, p.snapshot_id, call.base_model, p.checkpoint_prefix
    )
    return Outcome(results.LoadSamplerWeightsOutput(snapshot_id=p.snapshot_id))


def sample_request(call: Call, p: Sample) -> SampleRequest:
    """What the engine samples for `p` (its checkpoint's weights loaded first if needed); the
    worker batches these across sessions and turns each result into `sample_outcome`."""
    params = p.params
    stop: tuple[str, ...] | tuple[int, ...] | None = None
    if params.stop is not None:  # a list on the wire
        stop = tuple(params.stop)  # type: ignore[assignment]  # all str or all int (validated)
    spec = SamplingSpec(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop=stop,
    )
    if p.checkpoint_prefix:
        assert p.snapshot_id is not None, "a checkpoint sampler always names its snapshot"
        checkpoint_io.ensure_snapshot(
            call.engine, call.store, p.snapshot_id, call.base_model, p.checkpoint_prefix
        )
    targets = p.target_prompt_logprobs
    scoring = PromptScoring(
        logprobs=p.prompt_logprobs,
        topk=p.topk_prompt_logprobs,
        last_n=p.prompt_logprobs_last_n,
        targets=None if targets is None else _prompt_targets(targets),
        alt_k=p.prompt_alt_tokens_k,
    )
    return SampleRequest(
        call.base_model,
        p.snapshot_id,
        p.prompt,
        p.num_samples,
        spec,
        scoring,
        p.topk_sample_logprobs,
        call.interrupt,
        _images(p.images),
    )


def _images(images: list[optypes.Image] | None) -> tuple[EngineImage, ...]:
    """A datum's or prompt's logged images as the engine takes them (the bytes decoded)."""
    return tuple(
        EngineImage(i.at, i.tokens, i.format, base64.b64decode(i.data)) for i in images or ()
    )


def sample_outcome(p: Sample, out: SampleResult) -> Outcome:
    """The client's result and the tokens to meter for `p`, sampled as `out`."""
    sequences = [
        results.SampledSequence(
            tokens=s.tokens,
            logprobs=s.logprobs,
            stop_reason=s.stop_reason,
            topk_logprobs=s.topk_logprobs,
        )
        for s in out.sequences
    ]
    targets, target_logprobs = p.target_prompt_logprobs, None
    if targets is not None:  # the request's layout, with a logprob in place of each id
        assert out.target_prompt_logprobs is not None, "asked for, so scored"
        target_logprobs = results.TargetLogprobs(
            rows=targets.rows,
            k=targets.k,
            crow_indices=targets.crow_indices,
            col_indices=targets.col_indices,
            values=out.target_prompt_logprobs,
        )
    alt = None
    if out.prompt_alt_tokens is not None:
        assert out.prompt_alt_logprobs is not None, "drawn with their logprobs"
        alt = results.PromptAltTokens(
            k=p.prompt_alt_tokens_k, tokens=out.prompt_alt_tokens, logprobs=out.prompt_alt_logprobs
        )
    result = results.SampleOutput(
        sequences=sequences,
        prompt_logprobs=out.prompt_logprobs,
        topk_prompt_logprobs=out.topk_prompt_logprobs,
        target_prompt_logprobs=target_logprobs,
        prompt_alt_tokens=alt,
    )
    tokens = {"prefill": out.prefill_tokens, "sample": out.sample_tokens, "train": 0}
    return Outcome(result, tokens)


def _prompt_targets(targets: optypes.PromptTargets) -> PromptTargets:
    return PromptTargets(
        rows=targets.rows,
        k=targets.k,
        ids=tuple(targets.ids),
        crow_indices=None if targets.crow_indices is None else tuple(targets.crow_indices),
        col_indices=None if targets.col_indices is None else tuple(targets.col_indices),
    )


HANDLERS: dict[OpType, Callable[[Call, Any], Outcome]] = {
    OpType.CREATE_MODEL: create_model,
    OpType.LOAD_WEIGHTS: load_weights,
    OpType.FORWARD_BACKWARD: forward_backward,
    OpType.OPTIM_STEP: optim_step,
    OpType.SAVE_WEIGHTS: save_weights,
    OpType.SAVE_WEIGHTS_FOR_SAMPLER: save_weights_for_sampler,
    OpType.SAMPLE: sample,
    OpType.LOAD_SAMPLER_WEIGHTS: load_sampler_weights,
    OpType.REBUILD: rebuild,
}
assert set(HANDLERS) == set(OpType), "every operation type needs a handler"


def run(call: Call, payload: Payload) -> Outcome:
    return HANDLERS[payload.TYPE](call, payload)


def _tensor(array: np.ndarray) -> optypes.Tensor:
    dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
    return optypes.Tensor(dtype=dtype, shape=list(array.shape), data=array.reshape(-1).tolist())
