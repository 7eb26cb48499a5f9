"""The training and sampling engine: LoRA adapters on shared base models, addressed by id.

Owns adapters (weights, accumulated grads, Adam state), snapshots for sampling, and the base
models they share (one per name, loaded lazily). Knows token ids, not HTTP or databases: a
prepared batch goes in, one result or one error comes out. Losses live in `losses`, the decode
loop in `sampler`, the LoRA mechanics in `lora`.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from treadle.gpu_worker import sampler
from treadle.gpu_worker.lora import LoraHost, LoraWeights
from treadle.gpu_worker.losses import (
    EngineDatum,
    batch_loss,
    get_loss,
    microbatches,
    resolve_config,
    validate_data,
)
from treadle.gpu_worker.models import load_base_model
from treadle.gpu_worker.sampler import SampledSequence, SampleResult, SamplingSpec
from treadle.platform.catalog import BaseModelInfo, get_base_model
from treadle.platform.errors import ConflictError, NotFoundError, ValidationError
from treadle.platform.tokenizers import load_tokenizer

__all__ = [
    "AdamSpec",
    "Engine",
    "EngineDatum",
    "ForwardBackwardResult",
    "LoraSpec",
    "SampleResult",
    "SampledSequence",
    "SamplingSpec",
]


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class AdamSpec:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class ForwardBackwardResult:
    outputs: list[dict[str, np.ndarray]]  # per datum: logprobs, elementwise_loss; float32 [T_i]
    metrics: dict[str, float]  # "loss:sum"
    train_tokens: int


@dataclass
class _Base:
    info: BaseModelInfo
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    host: LoraHost


@dataclass
class _Adapter:
    base_model: str
    weights: LoraWeights
    optimizer: torch.optim.AdamW
    snapshots: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Snapshot:
    adapter_id: str
    base_model: str
    weights: LoraWeights


class Engine:
    """LoRA training and sampling for many adapters in one process. Thread-safe (one call runs
    at a time); each adapter's weights, grads and optimizer state are its own."""

    def __init__(self, *, cache_dir: Path, device: str | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self._bases: dict[str, _Base] = {}
        self._adapters: dict[str, _Adapter] = {}
        self._snapshots: dict[str, _Snapshot] = {}
        self._tokenizers: dict[str, PreTrainedTokenizerFast] = {}
        self._lock = threading.RLock()

    # -- models and adapters ------------------------------------------------------------------

    def tokenizer(self, base_model: str) -> PreTrainedTokenizerFast:
        """`base_model`'s tokenizer, without loading the model itself."""
        with self._lock:
            if base_model in self._bases:
                return self._bases[base_model].tokenizer
            if base_model not in self._tokenizers:
                get_base_model(base_model)  # ValidationError for unknown names
                self._tokenizers[base_model] = load_tokenizer(base_model, self.cache_dir)
            return self._tokenizers[base_model]

    def create_adapter(self, adapter_id: str, base_model: str, lora: LoraSpec) -> None:
        """A fresh adapter (B = 0: it starts as the base model) with its own Adam state."""
        _check_lora(lora)
        with self._lock:
            if adapter_id in self._adapters:
                raise ConflictError(f"adapter {adapter_id!r} already exists; drop it first")
            base = self._base(base_model)
            weights = base.host.new_weights(
                rank=lora.rank,
                alpha=lora.alpha,
                seed=lora.seed,
                train_attn=lora.train_attn,
                train_mlp=lora.train_mlp,
                train_unembed=lora.train_unembed,
                device=self.device,
            )
            optimizer = torch.optim.AdamW(weights.parameters())
            self._adapters[adapter_id] = _Adapter(base_model, weights, optimizer)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def drop_adapter(self, adapter_id: str) -> None:
        """Forget the adapter, its grads, optimizer state and the snapshots taken from it."""
        with self._lock:
            adapter = self._adapter(adapter_id)
            for snapshot_id in adapter.snapshots:
                self._snapshots.pop(snapshot_id, None)
            del self._adapters[adapter_id]

    def adapter_weights(self, adapter_id: str) -> dict[str, np.ndarray]:
        """A copy of the adapter's tensors as float32 arrays, under peft's names, in a fixed
        order."""
        with self._lock:
            weights = self._adapter(adapter_id).weights
            return {
                name: t.detach().to("cpu", torch.float32, copy=True).numpy()
                for name, t in weights.tensors()
            }

    def weight_hash(self, adapter_id: str) -> str:
        """sha256 (hex) over the adapter's names, shapes and float32 bytes, in a fixed order."""
        digest = hashlib.sha256()
        for name, array in self.adapter_weights(adapter_id).items():
            digest.update(f"{name}:{list(array.shape)};".encode())
            digest.update(np.ascontiguousarray(array, dtype="<f4").tobytes())
        return digest.hexdigest()

    # -- training -----------------------------------------------------------------------------

    def forward_backward(
        self,
        adapter_id: str,
        data: Sequence[EngineDatum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        forward_only: bool = False,
    ) -> ForwardBackwardResult:
        """Per-datum target logprobs and losses; unless `forward_only`, add the gradient of the
        summed loss to the adapter's accumulated grads."""
        loss = get_loss(loss_fn)
        config = resolve_config(loss, loss_fn_config)
        with self._lock:
            adapter = self._adapter(adapter_id)
            base = self._bases[adapter.base_model]
            arrays = validate_data(
                data,
                loss,
                vocab_size=base.model.config.vocab_size,
                max_context_length=base.info.max_context_length,
            )
            outputs: list[dict[str, np.ndarray]] = []
            total = 0.0
            with base.host.use(adapter.weights), torch.set_grad_enabled(not forward_only):
                for chunk in microbatches(arrays):
                    chunk_outputs, chunk_loss = batch_loss(base.model, chunk, loss, config)
                    if not forward_only:
                        chunk_loss.backward()
                    outputs.extend(chunk_outputs)
                    total += float(chunk_loss.detach())
        return ForwardBackwardResult(
            outputs=outputs,
            metrics={"loss:sum": total},
            train_tokens=sum(len(a["tokens"]) for a in arrays),
        )

    def optim_step(self, adapter_id: str, adam: AdamSpec) -> dict[str, float]:
        """Apply the grads accumulated since the last step with AdamW(`adam`), then zero them."""
        _check_adam(adam)
        with self._lock:
            adapter = self._adapter(adapter_id)
            params = adapter.weights.parameters()
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
            if adam.grad_clip_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, grad_norm)
            group = adapter.optimizer.param_groups[0]
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
            adapter.optimizer.step()
            adapter.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": float(grad_norm), "learning_rate:mean": adam.learning_rate}

    # -- sampling -----------------------------------------------------------------------------

    def snapshot(self, adapter_id: str, snapshot_id: str) -> None:
        """Freeze a copy of the adapter's current weights under `snapshot_id` (replacing any
        snapshot of that id) for sampling; later training does not change it."""
        with self._lock:
            adapter = self._adapter(adapter_id)
            self.drop_snapshot(snapshot_id)
            frozen = adapter.weights.frozen_copy()
            self._snapshots[snapshot_id] = _Snapshot(adapter_id, adapter.base_model, frozen)
            adapter.snapshots.add(snapshot_id)

    def has_snapshot(self, snapshot_id: str) -> bool:
        return snapshot_id in self._snapshots

    def drop_snapshot(self, snapshot_id: str) -> None:
        """Forget a snapshot; no-op if there is none of that id."""
        with self._lock:
            snap = self._snapshots.pop(snapshot_id, None)
            if snap is not None and snap.adapter_id in self._adapters:
                self._adapters[snap.adapter_id].snapshots.discard(snapshot_id)

    def sample(
        self,
        base_model: str,
        snapshot_id: str | None,
        prompt: Sequence[int],
        num_samples: int,
        params: SamplingSpec,
        *,
        prompt_logprobs: bool = False,
    ) -> SampleResult:
        """`num_samples` continuations of `prompt` under the snapshot's weights (None: the base
        model alone). Touches no adapter's weights or grads."""
        with self._lock:
            base = self._base(base_model)
            weights = None
            if snapshot_id is not None:
                snap = self._snapshots.get(snapshot_id)
                if snap is None:
                    raise NotFoundError(f"snapshot {snapshot_id!r} not found; save weights first")
                if snap.base_model != base_model:
                    raise ValidationError(
                        f"snapshot {snapshot_id!r} belongs to base model {snap.base_model!r}, "
                        f"not {base_model!r}; sample it with its own base model"
                    )
                weights = snap.weights
            tokens = sampler.validate_sampling(
                prompt,
                num_samples,
                params,
                vocab_size=base.model.config.vocab_size,
                max_context_length=base.info.max_context_length,
            )
            with base.host.use(weights):
                return sampler.generate(
                    base.model,
                    tokens,
                    num_samples,
                    params,
                    eos_token_id=base.tokenizer.eos_token_id,
                    decode=lambda ids: str(base.tokenizer.decode(ids)),
                    want_prompt_logprobs=prompt_logprobs,
                )

    # -- internals ----------------------------------------------------------------------------

    def _base(self, name: str) -> _Base:
        with self._lock:
            if name not in self._bases:
                info = get_base_model(name)
                model, tokenizer = load_base_model(name, self.cache_dir, self.device, self.dtype)
                self._bases[name] = _Base(info, model, tokenizer, LoraHost(model))
            return self._bases[name]

    def _adapter(self, adapter_id: str) -> _Adapter:
        try:
            return self._adapters[adapter_id]
        except KeyError:
            raise NotFoundError(f"adapter {adapter_id!r} not found; create it first") from None


def _check_lora(lora: LoraSpec) -> None:
    if lora.rank < 1:
        raise ValidationError(f"LoRA rank is {lora.rank}; it must be at least 1")
    if not lora.alpha > 0:
        raise ValidationError(f"LoRA alpha is {lora.alpha}; it must be positive")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise ValidationError(
            "train_attn, train_mlp and train_unembed are all false; enable at least one"
        )


def _check_adam(adam: AdamSpec) -> None:
    problems = []
    if not adam.learning_rate >= 0:
        problems.append(f"learning_rate {adam.learning_rate} must be 0 or more")
    for name, beta in (("beta1", adam.beta1), ("beta2", adam.beta2)):
        if not 0 <= beta < 1:
            problems.append(f"{name} {beta} must be in [0, 1)")
    for name, value in (
        ("eps", adam.eps),
        ("weight_decay", adam.weight_decay),
        ("grad_clip_norm", adam.grad_clip_norm),
    ):
        if not value >= 0:
            problems.append(f"{name} {value} must be 0 or more")
    if problems:
        raise ValidationError("invalid Adam parameters: " + "; ".join(problems))
