"""The training and sampling engine: LoRA adapters on shared base models, addressed by id.

Owns adapters (weights, accumulated grads, Adam state), snapshots for sampling and the base models
they share (one per name, loaded lazily). Idle adapters page out and come back on use, never
dropped (`paging`): at most `max_resident_adapters` on the accelerator, at most
`max_loaded_adapters` in memory at all, the rest in spill files on local disk; snapshots the same
way, at most `max_loaded_snapshots` in memory (`snapshots`).
Knows token ids, not HTTP or databases: a prepared batch goes in, one result or one error comes
out. It satisfies `protocol.EngineAPI` for one process; a worker group's rank 0 wraps it in
`distributed.executor.GroupExecutor`, and the group is applied to its compute as its
`parallel`. The training bodies live in `training`, losses in `losses/`, the decode loop in
`sampling/decode`, the LoRA mechanics in `lora/`, paging in `memory/`.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

import treadle.engine.training as training
from treadle.engine.dimuon import DimuonSpec
from treadle.engine.lora import files as adapter_files
from treadle.engine.lora.adapters import (
    LoraHost,
    LoraSpec,
    LoraWeights,
    TrainableLora,
    compute_dtype,
)
from treadle.engine.lora.snapshots import Snapshot, Snapshots
from treadle.engine.losses import custom_graph, passes
from treadle.engine.losses.functions import (
    EngineDatum,
    LossFn,
    custom_arrays,
    get_loss,
    validate_data,
)
from treadle.engine.losses.sampler_kl import kl_sample_train
from treadle.engine.memory import fingerprint
from treadle.engine.memory.capacity import device_memory_in_use
from treadle.engine.memory.paging import Paging
from treadle.engine.models import determinism, vision
from treadle.engine.models.loading import load_base_model, load_deferred, serving_dir
from treadle.engine.models.threads import threads_for
from treadle.engine.models.weight_files import WeightFiles
from treadle.engine.optim import AdamSpec
from treadle.engine.protocol import (
    ALONE,
    STATE_PARTS,
    ForwardBackwardResult,
    Interrupt,
    Parallelism,
    Topology,
    decode_all,
)
from treadle.engine.sampling import decode as batching
from treadle.engine.sampling import rules as sampler
from treadle.engine.sampling.decode import SampleJob, SampleRequest
from treadle.engine.sampling.rules import (
    PromptScoring,
    PromptTargets,
    SampleResult,
    SamplingSpec,
)
from treadle.engine.sampling.vllm_backend import VllmBackend
from treadle.engine.sampling.vllm_batch import BASE_ADAPTER, VllmBatch
from treadle.engine.sampling.vllm_server import VllmServer, VllmSettings
from treadle.engine.training import Base
from treadle.platform.config import DEFAULT_SAMPLER_KV_TOKENS
from treadle.platform.errors import (
    ConflictError,
    NotFoundError,
    UnavailableError,
    ValidationError,
)
from treadle.platform.models.catalog import BaseModelInfo, get_base_model
from treadle.platform.models.losses import resolve_config
from treadle.platform.models.tokenizers import load_tokenizer, safe_name, tokenizer_files

__all__ = ["Engine", "SampleBatch"]


@dataclass
class _Adapter:
    base_model: str
    spec: LoraSpec
    lora: TrainableLora
    snapshots: set[str] = field(default_factory=set)


class Engine:
    """LoRA training and sampling for many adapters in one process. Thread-safe (one call runs
    at a time); each adapter's weights, grads and optimizer state are its own.

    `device` None picks CUDA (bfloat16 base weights) when available, else the CPU (float32;
    `dtype` chooses otherwise). Adapters' weights, grads and Adam state are float32 everywhere;
    on a bfloat16 model training and sampling run a bfloat16 copy of the weights
    (`TrainableLora`), so the LoRA computes in the activations' dtype. At most `max_resident_adapters` adapters stay on a CUDA
    device; the least recently used others wait in host memory (on the CPU nothing moves). With
    `max_loaded_adapters`, at most that many adapters' weights, grads and Adam state stay in
    memory (the accelerator's included); the least recently used others are written to one file
    each under `spill_dir` (see `paging`) and read back, bit for bit, when next used. Snapshots
    for sampling do not count toward that limit: with `max_loaded_snapshots`, at most that many
    stay in memory and the least recently used others page out the same way (`snapshots`).
    With `pack_cpu_weights` (a float32 model on the CPU), sampling runs the base model's
    linears on a copy of their weights packed for oneDNN (`cpu_linear`): two to four times
    faster than `F.linear` on some CPUs, for the linears' size again in memory.
    """

    def __init__(
        self,
        *,
        cache_dir: Path,
        device: str | None = None,
        max_resident_adapters: int = 16,
        max_loaded_adapters: int | None = None,
        max_loaded_snapshots: int | None = None,
        spill_dir: Path | None = None,
        pack_cpu_weights: bool = True,
        activation_checkpointing: bool | None = None,
        models: Callable[[str], BaseModelInfo] = get_base_model,
        parallel: Parallelism = ALONE,
        microbatch_tokens: int | None = None,
        dtype: torch.dtype | None = None,
        sampler_kv_tokens: int = DEFAULT_SAMPLER_KV_TOKENS,
        vllm: VllmSettings | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        # A base model's registry entry by name (the worker's `ModelRegistry.get`; the built-ins
        # alone by default).
        self.models = models
        # How the compute is spread (`protocol.Parallelism`): `ALONE`, or the worker group this
        # engine is a rank of, whose forward_backward computes its share of the parts and gets
        # the others', and whose sharded layout splits base models' decoder layers.
        self.parallel = parallel
        # The operator's pass budget: padded tokens per part of a forward_backward, and the
        # grain a worker group splits a request at (None: the device's, `passes.pass_tokens`).
        self.microbatch_tokens = microbatch_tokens
        self.pack_cpu_weights = pack_cpu_weights
        # The sampler's KV budget, in tokens per attention layer: a sample batch holds at most
        # this many tokens' keys and values (`sampling.kv_pool`); requests beyond it wait.
        self.sampler_kv_tokens = sampler_kv_tokens
        # Sample with vLLM servers (one per base model, `sampling.vllm_backend`) instead of the
        # reference decode loop; None: the reference loop.
        self.vllm = vllm
        self._vllm: dict[str, VllmBackend] = {}
        self._zero: dict[str, LoraWeights] = {}  # per base model: a LoRA whose B is 0
        # Recompute each decoder layer in the backward instead of keeping its activations (same
        # grads, a third more compute); None: where a training pass is big enough to save memory
        # (`chunked_logprobs.wants_checkpointing`).
        self.activation_checkpointing = activation_checkpointing
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # before any CUDA work: cuBLAS reads its workspace setting when it starts
        determinism.apply(self.device)
        # The base models' dtype (a registered model's own on CUDA where its entry names one):
        # None picks bfloat16 on CUDA, float32 on the CPU; tests run bfloat16 on the CPU too.
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.max_resident_adapters = max_resident_adapters
        self.max_loaded_adapters = max_loaded_adapters
        self._bases: dict[str, Base] = {}
        self._adapters: dict[str, _Adapter] = {}
        self._paging = Paging(
            lambda adapter_id: self._adapters[adapter_id].lora,
            device=self.device,
            max_resident=max_resident_adapters,
            max_loaded=max_loaded_adapters,
            spill_dir=spill_dir,
        )
        self._snapshots = Snapshots(
            device=self.device, max_loaded=max_loaded_snapshots, spill_dir=spill_dir
        )
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}
        self._lock = threading.RLock()

    # -- models and adapters ------------------------------------------------------------------

    def has_base(self, base_model: str) -> bool:
        """Whether `base_model` is loaded here, without waiting for the running call: the
        worker's heartbeat asks it (`worker/lease_keeper.py`), and a heartbeat held up for the
        length of a long sample let another worker take this one's sessions. A dict's
        membership test is atomic; a base being loaded counts once it is."""
        return base_model in self._bases

    def load_base(self, base_model: str) -> None:
        """Load `base_model` now if it is not (a group whose layout shards it loads it on every
        rank together: `GroupExecutor.open_batch`). ValidationError for an unknown name."""
        self._base(base_model)

    def tokenizer(self, base_model: str) -> PreTrainedTokenizerBase:
        """`base_model`'s tokenizer, without loading the model itself."""
        with self._lock:
            if base_model in self._bases:
                return self._bases[base_model].tokenizer
            if base_model not in self._tokenizers:
                info = self.models(base_model)  # ValidationError for unknown names
                self._tokenizers[base_model] = load_tokenizer(info, self.cache_dir)
            return self._tokenizers[base_model]

    def create_adapter(self, adapter_id: str, base_model: str, lora: LoraSpec) -> None:
        """A fresh adapter (B = 0: it starts as the base model) with its own Adam state."""
        with self._lock:
            if adapter_id in self._adapters:
                raise ConflictError(f"adapter {adapter_id!r} already exists; drop it first")
            weights = self._base(base_model).host.new_weights(lora, self.device)
            self._adapters[adapter_id] = _Adapter(
                base_model, lora, TrainableLora(weights, lora.optimizer, lora.rank)
            )
            self._use(adapter_id)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def drop_adapter(self, adapter_id: str, *, keep_snapshots: bool = False) -> None:
        """Forget the adapter, its grads, optimizer state and (unless `keep_snapshots`) the
        snapshots taken from it."""
        with self._lock:
            adapter = self._record(adapter_id)
            for snapshot_id in adapter.snapshots:
                if keep_snapshots:
                    self._snapshots.orphan(snapshot_id)
                else:
                    self._snapshots.drop(snapshot_id)
                    self._released(snapshot_id)
            del self._adapters[adapter_id]
            self._paging.forget(adapter_id)  # and its spill file

    def resident_adapters(self) -> list[str]:
        """Ids of the adapters counted as on the accelerator, least recently used first."""
        with self._lock:
            return self._paging.resident()

    def loaded_adapters(self) -> list[str]:
        """Ids of the adapters in memory (accelerator or host), least recently used first."""
        with self._lock:
            return self._paging.loaded()

    def spilled_adapters(self) -> dict[str, Path]:
        """The adapters paged out to disk, each with its spill file."""
        with self._lock:
            return self._paging.spilled()

    def adapter_counts(self) -> tuple[int, int]:
        """(adapters in memory, adapters paged out to disk), without waiting for the running
        call (see `Paging.counts`)."""
        return self._paging.counts()

    def snapshot_counts(self) -> tuple[int, int]:
        """(snapshots in memory, snapshots paged out to disk), without waiting for the running
        call."""
        return self._snapshots.counts()

    def spilled_snapshots(self) -> dict[str, Path]:
        """The snapshots paged out to disk, each with its file."""
        with self._lock:
            return self._snapshots.spilled()

    def adapter_device(self, adapter_id: str) -> torch.device:
        """Where the adapter's weights, grads and Adam moments are now (one paged out to disk
        is read back into host memory first)."""
        with self._lock:
            return self._adapter(adapter_id).lora.device

    def adapter_weights(self, adapter_id: str) -> dict[str, np.ndarray]:
        """A float32 copy of the adapter's tensors under peft's names, in a fixed order."""
        with self._lock:
            named = self._adapter(adapter_id).lora.weights.tensors()
            return {name: _numpy(t) for name, t in named}

    def set_adapter_weights(self, adapter_id: str, weights: Mapping[str, np.ndarray]) -> None:
        """Overwrite the adapter's tensors (names and shapes as `adapter_weights` gives them);
        its accumulated grads and Adam state are kept. ValidationError on a mismatch."""
        with self._lock:
            self._adapter(adapter_id).lora.load(weights)

    def adapter_grads(self, adapter_id: str) -> dict[str, np.ndarray]:
        """A copy of the grads accumulated since the last `optim_step`, as `adapter_weights`
        names them (zeros where none)."""
        with self._lock:
            return {name: _numpy(g) for name, g in self._adapter(adapter_id).lora.grads()}

    def weight_hash(self, adapter_id: str) -> str:
        """A fingerprint of the adapter's weights: equal exactly when every bit is."""
        return self.state_hashes(adapter_id, ("weights",))["weights"]

    def state_hashes(self, adapter_id: str, parts: Sequence[str] = STATE_PARTS) -> dict[str, str]:
        """Fingerprints of the asked parts of the adapter's state: its `weights`, the `grads`
        accumulated since the last step, the `optimizer`'s Adam state. Computed where the tensors
        live; equal for two adapters exactly when the part's bits are (see `fingerprint`)."""
        with self._lock:
            lora = self._adapter(adapter_id).lora
            hashes = {}
            for part in parts:
                if part == "weights":
                    named: list[tuple[str, torch.Tensor | None]] = list(lora.weights.tensors())
                elif part == "grads":
                    named = [(name, t.grad) for name, t in lora.weights.tensors()]
                elif part == "optimizer":
                    named = list(lora.optimizer_tensors())
                else:
                    raise AssertionError(f"unknown state part {part!r}")
                hashes[part] = fingerprint.of(named)
            return hashes

    # -- training -----------------------------------------------------------------------------

    def forward_backward(
        self,
        adapter_id: str,
        data: Sequence[EngineDatum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        forward_only: bool = False,
        pass_tokens: int | None = None,
        interrupt: Interrupt | None = None,
        custom_loss: Mapping[str, Any] | None = None,
    ) -> ForwardBackwardResult:
        """Per-datum target logprobs and losses; unless `forward_only`, add the gradient of the
        summed loss to the adapter's accumulated grads. The request runs in parts of at most
        `pass_tokens` padded tokens (None: this engine's budget, `pass_budget`), spread by the
        engine's `parallel` and added in their order, so the result is the same bit for bit at
        every world size (`training.forward_backward`) and for the same `pass_tokens`, which the
        result reports. `interrupt` is called between parts: what it raises ends the call with
        no gradient added. With `custom_loss` (loss_fn "custom": a recorded create_custom_loss
        graph, `custom_graph`) each datum's loss is that graph's on its logprobs, in the same
        pass, and its metrics are reported beside `loss:sum`."""
        if pass_tokens is not None and pass_tokens < 1:
            raise ValidationError(f"pass_tokens is {pass_tokens}; it must be at least 1")
        loss: LossFn | custom_graph.CustomLossGraph
        if loss_fn == "custom" and custom_loss is not None:
            loss, config = custom_graph.build(custom_loss), {}
        else:
            loss = get_loss(loss_fn)
            config = resolve_config(loss.spec, loss_fn_config)
        with self._lock:
            adapter = self._use(adapter_id)
            base = self._bases[adapter.base_model]
            vocab_size = base.model.config.vocab_size
            context, name = base.info.max_context_length, base.info.name
            if isinstance(loss, custom_graph.CustomLossGraph):
                arrays = custom_arrays(
                    data, loss, vocab_size=vocab_size, max_context_length=context, model_name=name
                )
            else:
                arrays = validate_data(
                    data,
                    loss,
                    vocab_size=vocab_size,
                    max_context_length=context,
                    config=config,
                    model_name=name,
                )
            for i, (datum, datum_arrays) in enumerate(zip(data, arrays, strict=True)):
                if datum.images:
                    datum_arrays.update(vision.model_pixels(base.info, datum.images, f"datum {i}"))
            budget = pass_tokens or self._pass_budget(base)
            outputs, total = training.forward_backward(
                base,
                adapter.lora,
                arrays,
                loss,
                config,
                parallel=self.parallel,
                device=self.device,
                pass_tokens=budget,
                checkpointing=self.activation_checkpointing,
                forward_only=forward_only,
                interrupt=interrupt,
            )
        # N tokens a datum, however many targets (cross_entropy's top-K) each position has
        train_tokens = sum(len(a["tokens"]) for a in arrays)
        metrics = {"loss:sum": total}
        if isinstance(loss, custom_graph.CustomLossGraph):
            metrics.update(custom_graph.reduce_metrics(outputs))
        else:
            metrics.update(kl_sample_train(data, arrays, outputs))
        return ForwardBackwardResult(outputs, metrics, train_tokens, budget)

    def pass_budget(self, adapter_id: str) -> int:
        """The padded tokens a pass of `adapter_id`'s forward_backward holds here unless the
        call names its own (`passes.pass_tokens`: the operator's setting, else the device's)."""
        with self._lock:
            return self._pass_budget(self._bases[self._record(adapter_id).base_model])

    def _pass_budget(self, base: Base) -> int:
        weights = 0
        if self.device.type == "cuda":  # only the accelerator's rule reads it
            weights = passes.resident_bytes((b.model for b in self._bases.values()), self.device)
        return passes.pass_tokens(
            base.model,
            self.device,
            configured=self.microbatch_tokens,
            weights_bytes=weights,
            checkpointing=self.activation_checkpointing,
        )

    def optim_step(self, adapter_id: str, adam: AdamSpec | DimuonSpec) -> dict[str, float]:
        """Apply the grads accumulated since the last step with the adapter's optimizer (AdamW
        or Dimuon, whose settings `adam` must be), then zero them. Returns `grad_norm:mean`
        (before clipping) and `learning_rate:mean`."""
        with self._lock:
            return training.optim_step(self._use(adapter_id).lora, adam, self.device)

    # -- sampling -----------------------------------------------------------------------------

    def snapshot(self, adapter_id: str, snapshot_id: str) -> None:
        """Freeze a copy of the adapter's current weights under `snapshot_id` (replacing any
        snapshot of that id) for sampling; later training does not change it."""
        with self._lock:
            adapter = self._use(adapter_id)  # so the copy is made on the accelerator
            self.drop_snapshot(snapshot_id)
            frozen = adapter.lora.weights.frozen_copy()
            self._snapshots.put(snapshot_id, Snapshot(adapter_id, adapter.base_model, frozen))
            adapter.snapshots.add(snapshot_id)

    def has_snapshot(self, snapshot_id: str) -> bool:
        return snapshot_id in self._snapshots

    def drop_snapshot(self, snapshot_id: str) -> None:
        """Forget a snapshot; no-op if there is none of that id."""
        with self._lock:
            adapter_id = self._snapshots.adapter_of(snapshot_id)
            self._snapshots.drop(snapshot_id)
            self._released(snapshot_id)
            if adapter_id in self._adapters:
                self._adapters[adapter_id].snapshots.discard(snapshot_id)

    def _released(self, snapshot_id: str) -> None:
        """A dropped snapshot's adapter leaves the vLLM servers it was handed to."""
        for backend in self._vllm.values():
            backend.release(snapshot_id)

    def sample(
        self,
        base_model: str,
        snapshot_id: str | None,
        prompt: Sequence[int],
        num_samples: int,
        params: SamplingSpec,
        *,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
        target_prompt_logprobs: PromptTargets | None = None,
        prompt_alt_tokens_k: int = 0,
        topk_sample_logprobs: int = 0,
        interrupt: Interrupt | None = None,
    ) -> SampleResult:
        """`num_samples` continuations of `prompt` under the snapshot's weights (None: the base
        model alone), with what the keywords ask about the prompt (its logprobs, their top-k,
        only the last N, chosen ids' logprobs, alternative draws: `prompt_scores`) and the top-k
        at each sampled position (`sampler`). Touches no adapter's weights or grads.
        `interrupt` is called before each decoding step."""
        scoring = PromptScoring(
            logprobs=prompt_logprobs,
            topk=topk_prompt_logprobs,
            last_n=prompt_logprobs_last_n,
            targets=target_prompt_logprobs,
            alt_k=prompt_alt_tokens_k,
        )
        request = SampleRequest(
            base_model, snapshot_id, prompt, num_samples, params, scoring, topk_sample_logprobs
        )
        (out,) = self.sample_batch([request], interrupt=interrupt)
        if isinstance(out, Exception):
            raise out
        return out

    def sample_batch(
        self, requests: Sequence[SampleRequest], *, interrupt: Interrupt | None = None
    ) -> list[SampleResult | Exception]:
        """Every request's result (as `sample` returns it) or its error, decoded together in
        one batch per base model; a request's tokens and logprobs do not depend on the others.
        `interrupt` is called before each decoding step and what it raises ends the call; each
        request's own `interrupt` ends only that request, with what it raised as its result."""
        return decode_all(self.open_batch, requests, interrupt)

    def open_batch(self, base_model: str) -> SampleBatch | VllmBatch:
        """A continuous batch of sample requests on `base_model` (loaded now if it is not):
        requests join between decoding steps and leave when done (see `batching`), decoded
        by the reference loop or, when this engine samples with vLLM, by vLLM's server."""
        if self.vllm is not None:
            return VllmBatch(self._vllm_backend(base_model), self._vllm_job)
        return SampleBatch(self, self._base(base_model))

    def samples_beside_training(self) -> bool:
        """Whether samples may run while a training call runs, from another thread: with vLLM
        (its own processes), whose batches take no lock a training call holds."""
        return self.vllm is not None

    def _vllm_backend(self, base_model: str) -> VllmBackend:
        if (backend := self._vllm.get(base_model)) is not None:
            return backend  # without the lock, as `_base`
        with self._lock:
            if base_model not in self._vllm:
                assert self.vllm is not None
                base = self._base(base_model)
                info = base.info
                server = VllmServer(
                    self.vllm,
                    folder=serving_dir(info, self.cache_dir),
                    dtype=str(self.dtype).removeprefix("torch."),
                    max_model_len=info.max_context_length,
                    log_path=self.cache_dir / "vllm" / f"{safe_name(info.name)}.log",
                )
                adapters = self.cache_dir / "vllm" / "adapters"
                adapters.mkdir(parents=True, exist_ok=True)
                zero = base.host.new_weights(LoraSpec(rank=1, alpha=1.0), torch.device("cpu"))
                self._zero[base_model] = zero
                self._vllm[base_model] = VllmBackend(
                    server,
                    base_model=base_model,
                    eos_token_id=info.eos_token_ids or base.tokenizer.eos_token_id,
                    adapter_dir=Path(tempfile.mkdtemp(prefix="engine-", dir=adapters)),
                )
            return self._vllm[base_model]

    def _vllm_job(self, request: SampleRequest) -> tuple[SampleJob, str, LoraWeights]:
        """The request validated (`_job`), and the adapter vLLM serves it with: its snapshot's
        float32 weights, or for the base model alone an adapter whose B is 0 (vLLM 0.32 on the
        CPU gives rows without an adapter the adapter of its last slot when every slot is in
        use in a step; rows that all have one are served right). Takes not the engine's lock
        but the snapshot table's own (`Snapshots`): it runs while a training call holds the
        engine's (`samples_beside_training`); the batch's base model is loaded already."""
        snap = self._snapshot_of(request)
        if request.images:
            raise ValidationError(
                "this worker samples with vLLM, which Treadle does not give images yet; sample "
                "image prompts on a worker with the reference sampler (TREADLE_SAMPLER unset)"
            )
        job = self._job(request, None)
        if snap is None:
            return job, BASE_ADAPTER, self._zero[request.base_model]
        assert request.snapshot_id is not None
        return job, request.snapshot_id, snap.weights

    def _snapshot_of(self, request: SampleRequest) -> Snapshot | None:
        """The snapshot the request samples (None: the base model alone); NotFoundError or
        ValidationError saying what is wrong."""
        if request.snapshot_id is None:
            return None
        snap = self._snapshots.get(request.snapshot_id)
        if snap is None:
            raise NotFoundError(f"snapshot {request.snapshot_id!r} not found; save weights first")
        if snap.base_model != request.base_model:
            raise ValidationError(
                f"snapshot {request.snapshot_id!r} belongs to base model {snap.base_model!r}, "
                f"not {request.base_model!r}; sample it with its own base model"
            )
        return snap

    def _reference_job(self, request: SampleRequest) -> SampleJob:
        """The request validated, with its snapshot's weights in the model's activation dtype
        (the float32 weights on a float32 model: a copy made once per snapshot, so its batches
        share one set of stacks), for the reference loop."""
        snap = self._snapshot_of(request)
        if snap is None:
            return self._job(request, None)
        dtype = compute_dtype(self._base(request.base_model).model.dtype)
        return self._job(request, snap.weights.in_dtype(dtype))

    def _job(self, request: SampleRequest, weights: LoraWeights | None) -> SampleJob:
        """The request validated, decoded with `weights`; ValidationError saying what is
        wrong."""
        base = self._base(request.base_model)
        tokens = sampler.validate_sampling(
            request.prompt,
            request.num_samples,
            request.params,
            vocab_size=base.model.config.vocab_size,
            max_context_length=base.info.max_context_length,
            model_name=base.info.name,
            scoring=request.scoring,
            topk_sample_logprobs=request.topk_sample_logprobs,
        )
        pixels = (
            vision.model_pixels(base.info, request.images, "prompt") if request.images else None
        )
        return SampleJob(
            tokens,
            request.num_samples,
            request.params,
            request.scoring,
            request.topk_sample_logprobs,
            weights,
            request.interrupt,
            pixels,
        )

    # -- files (formats in `adapter_files`) -----------------------------------------------------

    def export_adapter(self, adapter_id: str, folder: Path, *, with_optimizer: bool) -> None:
        """Write the adapter into `folder` as a peft adapter plus treadle.json, and with
        `with_optimizer` its exact Adam state (pending grads are not saved)."""
        with self._lock:
            adapter = self._adapter(adapter_id)
            optimizer = adapter.lora.optimizer_state() if with_optimizer else None
            weights, spec = adapter.lora.weights, adapter.spec
            adapter_files.write_adapter(Path(folder), adapter.base_model, spec, weights, optimizer)

    def import_adapter(
        self,
        adapter_id: str,
        base_model: str,
        folder: Path,
        *,
        with_optimizer: bool,
        optimizer: str | None = None,
    ) -> None:
        """Create `adapter_id` from an exported folder, with its exact optimizer state if asked
        (else a fresh one), training with `optimizer` (None: the one it was saved with).
        ValidationError for missing files, another base model, mismatched tensors or saved
        optimizer state of another optimizer."""
        with self._lock:
            if adapter_id in self._adapters:
                raise ConflictError(f"adapter {adapter_id!r} already exists; drop it first")
            spec, lora = self._read(folder, base_model, with_optimizer, optimizer)
            self._adapters[adapter_id] = _Adapter(base_model, spec, lora)
            self._use(adapter_id)

    def export_merged(self, adapter_id: str, folder: Path) -> None:
        """Write a Hugging Face model folder (float32, with tokenizer) with the adapter's delta
        merged into a bare float32 copy of the base weights, loadable with `transformers` alone."""
        with self._lock:
            adapter = self._adapter(adapter_id)
            base_model, weights = adapter.base_model, adapter.lora.weights.frozen_copy()
        info = self.models(base_model)
        model, _ = load_base_model(info, self.cache_dir, "cpu", torch.float32)
        files = tokenizer_files(info, self.cache_dir)
        adapter_files.write_merged(Path(folder), model, weights, files)

    def load_snapshot(self, snapshot_id: str, base_model: str, folder: Path) -> None:
        """Register an exported adapter's weights as snapshot `snapshot_id` (replacing any)."""
        with self._lock:
            _, lora = self._read(folder, base_model, optimizer=False)
            self.drop_snapshot(snapshot_id)
            self._snapshots.put(snapshot_id, Snapshot(None, base_model, lora.weights.frozen_copy()))

    # -- the process itself (a group's executor answers for the group) -----------------------

    def topology(self) -> Topology | None:
        return None

    def rank_memory(self) -> dict[int, dict[str, float]]:
        return {0: device_memory_in_use(self.device)}

    def ping(self) -> None:
        """Nothing to check: one process."""

    def close(self) -> None:
        """Stop the vLLM servers this engine started (nothing else to release)."""
        with self._lock:
            for backend in self._vllm.values():
                backend.close()
            self._vllm.clear()

    def unload(self) -> None:
        """Forget the base models (a process about to end: see `group.leave`); they load again
        when next used."""
        with self._lock:
            self._bases.clear()

    # -- internals ----------------------------------------------------------------------------

    def _base(self, name: str) -> Base:
        # A loaded base is found without the lock, which a training call holds for its length:
        # vLLM's samples run beside it (`_vllm_job`). A dict lookup is atomic, and a base is
        # put in only once it is whole.
        if (base := self._bases.get(name)) is not None:
            return base
        with self._lock:
            if name not in self._bases:
                info = self.models(name)
                sharded = self.parallel.sharded
                files: WeightFiles | None = None
                if sharded:  # each rank reads a layer at a time and keeps its shard
                    model, tokenizer, files = load_deferred(
                        info, self.cache_dir, self.device, self.dtype
                    )
                else:
                    model, tokenizer = load_base_model(
                        info, self.cache_dir, self.device, self.dtype
                    )
                parameters = sum(p.numel() for p in model.parameters())
                host = LoraHost(model)
                if sharded:
                    self.parallel.shard(model, self.device, files)
                elif self.pack_cpu_weights:
                    host.pack_for_sampling()  # a no-op off the CPU or without oneDNN
                self._bases[name] = Base(info, model, tokenizer, host, parameters)
            return self._bases[name]

    def _read(
        self, folder: Path, base_model: str, optimizer: bool, kind: str | None = None
    ) -> tuple[LoraSpec, TrainableLora]:
        saved = adapter_files.read_adapter(Path(folder), base_model, with_optimizer=optimizer)
        spec = saved.spec if kind is None else dataclasses.replace(saved.spec, optimizer=kind)
        if saved.optimizer is not None and spec.optimizer != saved.spec.optimizer:
            raise ValidationError(
                f"the checkpoint's optimizer state is {saved.spec.optimizer}'s, not "
                f"{spec.optimizer}'s; load its weights without the optimizer state"
            )
        weights = self._base(base_model).host.new_weights(spec, self.device)
        lora = TrainableLora(weights, spec.optimizer, spec.rank)
        lora.load(saved.tensors)
        if saved.optimizer is not None:
            lora.load_optimizer_state(saved.optimizer)
        return spec, lora

    def _record(self, adapter_id: str) -> _Adapter:
        """The adapter's record, wherever its tensors are (maybe paged out to disk)."""
        try:
            return self._adapters[adapter_id]
        except KeyError:
            raise NotFoundError(f"adapter {adapter_id!r} not found; create it first") from None

    def _adapter(self, adapter_id: str) -> _Adapter:
        """The adapter, in memory (read back from disk if it was paged out) but not necessarily
        on the accelerator, marked most recently used."""
        adapter = self._record(adapter_id)
        self._paging.use(adapter_id, on_device=False)
        return adapter

    def _use(self, adapter_id: str) -> _Adapter:
        """The adapter, brought onto the accelerator and marked most recently used; the least
        recently used others beyond the limits move to host memory or out to disk."""
        adapter = self._record(adapter_id)
        self._paging.use(adapter_id, on_device=True)
        return adapter


class SampleBatch:
    """Sample requests on one base model decoded together; `add` and `step` as in
    `batching.DecodeBatch`, each holding the engine's lock, with a request that fails
    validation (or names a missing snapshot) finished at once with its error."""

    def __init__(self, engine: Engine, base: Base) -> None:
        self._engine = engine
        self._base_model = base.info.name
        self._parameters = base.parameters
        tokenizer = base.tokenizer
        self._decoding = batching.DecodeBatch(
            base.model,
            base.host,
            # generation_config.json's end-of-sequence ids (Llama 3 and Qwen3 list several),
            # else the tokenizer's
            eos_token_id=base.info.eos_token_ids or tokenizer.eos_token_id,
            decode=lambda ids: str(tokenizer.decode(ids)),
            kv_tokens=engine.sampler_kv_tokens,
        )

    def __len__(self) -> int:
        return len(self._decoding)

    def __contains__(self, key: batching.Key) -> bool:
        return key in self._decoding

    def add(self, requests: Sequence[tuple[batching.Key, SampleRequest]]) -> batching.Finished:
        finished: batching.Finished = []
        jobs: list[tuple[batching.Key, SampleJob]] = []
        with self._engine._lock:
            for key, request in requests:
                try:
                    if request.base_model != self._base_model:
                        raise ValidationError(
                            f"this batch samples {self._base_model!r}, not {request.base_model!r}"
                        )
                    jobs.append((key, self._engine._reference_job(request)))
                except (ValidationError, NotFoundError, UnavailableError) as exc:
                    finished.append((key, exc))
            tokens = sum(len(job.prompt) for _, job in jobs)
            with threads_for(tokens * self._parameters, self._engine.device):
                return finished + self._decoding.add(jobs)

    def step(self, interrupt: Interrupt | None = None) -> batching.Finished:
        with self._engine._lock:
            # the rows decoding, or the prompts of those waiting that may join (an upper bound)
            rows = max(self._decoding.rows, self._decoding.waiting_prompt_tokens)
            work = rows * self._parameters
            with threads_for(work, self._engine.device):
                return self._decoding.step(interrupt)

    def drawn(self, key: batching.Key) -> tuple[list[list[int]], list[list[float]]]:
        """See `batching.DecodeBatch.drawn` (read between steps, by the thread that steps)."""
        return self._decoding.drawn(key)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32, copy=True).numpy()
