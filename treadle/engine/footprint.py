"""What one base model costs a worker's memory, per device, for admission (the platform adds it
up: platform/sessions/admission.py; the formula, and which terms are estimates, in
docs/operations.md, "Admission").

Owns `Footprint` and `model_footprint(info, ...)`: the model is built on the meta device from
its config (no weights read), its LoRA targets resolved with `lora.targets.resolve` (the
engine's own rules), and from those modules: weight bytes per device (all the parameters, or a
sharded group's rank's share at its peak, plus oneDNN's packed copy of the adapted linears where
a CPU worker packs them),
LoRA parameters per rank per category (the sum of in + out features of each category's
linears), one training pass's activations and logits at the worker's pass token budget, the
sampler's KV budget, and the host memory loading the model takes. The worker hands
`model_footprint` to `memory.capacity.Capacity` (a layer below, which must not import it).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from treadle.engine.lora.adapters import compute_dtype
from treadle.engine.lora.targets import is_expert_key, resolve, split_expert_key
from treadle.engine.losses import passes
from treadle.engine.losses.activation_cost import token_cost
from treadle.engine.losses.chunked_logprobs import CHECKPOINT_ABOVE_FRACTION, FULL_LOGITS_AT_MOST
from treadle.engine.models import cpu_linear
from treadle.engine.models.loading import tiny_debug_config
from treadle.engine.models.vocab_split import split_by_rows
from treadle.platform.models.catalog import BaseModelInfo, gguf_path
from treadle.platform.models.tokenizers import safe_name

__all__ = ["LOGITS_TENSORS", "Footprint", "PassSettings", "model_footprint", "pass_tokens"]

# float32 tensors of a pass's logits size alive at once: the logits, the unembedding adapter's
# delta, the log-softmax and its gradient (losses/functions.MICROBATCH_LOGITS says the same).
LOGITS_TENSORS = 4


@dataclass(frozen=True)
class PassSettings:
    """The worker's settings a footprint depends on."""

    device: torch.device
    dtype: torch.dtype
    shards: int = 1  # a sharded group splits the weights this many ways
    ranks_on_host: int = 1  # processes on this host that each load the model
    microbatch_tokens: int = 0  # 0: losses.MICROBATCH_TOKENS
    sampler_kv_tokens: int = 0
    checkpointing: bool | None = None  # the engine's activation_checkpointing setting
    pack_cpu_weights: bool = True
    device_bytes: int = 0  # the device's real memory (the engine's checkpointing threshold)


@dataclass(frozen=True)
class Footprint:
    """One base model's costs, bytes per device unless said otherwise."""

    weight_bytes: int
    lora_per_rank: dict[str, int]  # category -> LoRA parameters per unit of rank
    pass_tokens: int
    pass_bytes: int  # activations + logits of one training pass of pass_tokens
    checkpointed: bool  # whether such a pass checkpoints its decoder layers
    kv_bytes: int  # sampler_kv_tokens of KV cache
    load_host_bytes: int  # host memory loading it takes (0: straight into the budget's memory)
    # per LoRA parameter, the copy an adapter's passes run in (`lora.adapters.compute_dtype`: on
    # a bfloat16 model, 2; float32 passes run on the masters themselves, 0)
    adapter_copy_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pass_tokens(info: BaseModelInfo, budget: int) -> int:
    """The largest training pass, in padded tokens: datums group up to the pass budget
    (`losses.passes`), but a datum longer than that runs alone, up to the model's context."""
    return max(budget, info.max_context_length)


def model_footprint(info: BaseModelInfo, settings: PassSettings, cache_dir: Path) -> Footprint:
    """`info`'s footprint on a worker with `settings`. Raises what transformers raises for a
    config it cannot read or build."""
    config = _config(info, cache_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=settings.dtype)
    targets = resolve(model)
    lora_per_rank = {}
    for category in ("attn", "mlp", "unembed"):
        lora_per_rank[category] = sum(_lora_per_rank(model, n) for n in getattr(targets, category))
    element = torch.empty((), dtype=settings.dtype).element_size()
    compute = compute_dtype(settings.dtype)  # the dtype an adapter's passes run in
    parameters = info.parameters or sum(p.numel() for p in model.parameters())
    held, total = _held(model, settings.shards)
    weight_bytes = parameters * element * held // total
    if _packs(settings):  # LoraHost.pack_for_sampling: the adapted linears' weights again
        weight_bytes += sum(model.get_submodule(n).weight.numel() for n in targets.linears) * 4
    text = config.get_text_config()
    hidden, layers = int(text.hidden_size), int(text.num_hidden_layers)
    vocab = int(text.vocab_size)
    if settings.microbatch_tokens:  # the engine's pass budget (`losses.passes.pass_tokens`)
        budget = settings.microbatch_tokens
    elif settings.device.type == "cuda":
        budget = passes.cuda_pass_tokens(
            model, settings.device_bytes, weight_bytes, settings.checkpointing
        )
    else:
        budget = passes.cpu_pass_tokens(vocab)
    tokens = pass_tokens(info, budget)
    full_layers = token_cost(model).layers  # per token; estimated: a meta-device model
    checkpointed = settings.checkpointing
    if checkpointed is None:  # chunked_logprobs.wants_checkpointing, on the real device
        checkpointed = tokens * full_layers > CHECKPOINT_ABOVE_FRACTION * settings.device_bytes
    per_token = passes.token_bytes(model, checkpointed=bool(checkpointed))
    logits = LOGITS_TENSORS * 4 * min(tokens * vocab, FULL_LOGITS_AT_MOST)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_per_token = 2 * layers * kv_heads * head_dim * element
    load_host = 0
    if settings.device.type != "cpu":  # each rank reads the model into host memory first
        read = parameters
        layers_list = getattr(model.get_decoder(), "layers", None)
        if settings.shards > 1 and isinstance(layers_list, torch.nn.ModuleList):
            # a layer at a time (models/weight_files.py), one layer beside the rest: the final
            # norm and a tied embedding whole, this rank's rows of the others (an estimate: a
            # checkpoint transformers converts while loading is read whole)
            per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers_list]
            split = _split_parameters(model)
            read = parameters - sum(per_layer) - split + split // settings.shards
            read += max(per_layer, default=0)
        load_host = read * element * settings.ranks_on_host
    return Footprint(
        weight_bytes=weight_bytes,
        lora_per_rank=lora_per_rank,
        pass_tokens=tokens,
        pass_bytes=tokens * per_token + logits,
        checkpointed=bool(checkpointed),
        kv_bytes=kv_per_token * settings.sampler_kv_tokens,
        load_host_bytes=load_host,
        adapter_copy_bytes=0 if compute.itemsize >= 4 else compute.itemsize,
    )


def _held(model: PreTrainedModel, shards: int) -> tuple[int, int]:
    """The parameters of `model` a rank holds at its peak, and all of them: all alone; in a
    sharded group (`distributed.group.shard_layers`), its shard of every decoder layer and its
    rows of the embeddings and head that `split_by_rows` names, the rest whole (the final norm,
    a tied embedding), and beside them what it gathers at once: the whole output head
    (`distributed.vocabulary`) or two layers (the one running and the next, which FSDP gathers
    ahead in the backward), whichever is more."""
    layers = getattr(model.get_decoder(), "layers", None)
    total = sum(p.numel() for p in model.parameters())  # a tied weight once
    if shards <= 1 or not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return total, total  # a model without a layers list runs whole on every rank
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    split = _split_parameters(model)
    _, head = split_by_rows(model)
    gathered = max(2 * max(per_layer), 0 if head is None else head.weight.numel())
    held = -(-sum(per_layer) // shards) + -(-split // shards) + total - sum(per_layer) - split
    return held + gathered, total


def _split_parameters(model: PreTrainedModel) -> int:
    """Parameters of the embeddings and head a sharded group splits by vocabulary rows."""
    return sum(m.weight.numel() for m in split_by_rows(model) if m is not None)


def _lora_per_rank(model: torch.nn.Module, name: str) -> int:
    """LoRA parameters per unit of rank of target `name`: a linear's in + out features; an MoE
    experts parameter's ([experts, in, out] or [experts, out, in]) one LoRA per expert."""
    if is_expert_key(name):
        module, parameter = split_expert_key(name)
        experts, a, b = getattr(model.get_submodule(module), parameter).shape
        return int(experts * (a + b))
    linear = model.get_submodule(name)
    assert isinstance(linear, torch.nn.Linear), name
    return linear.in_features + linear.out_features


def _packs(settings: PassSettings) -> bool:
    return (
        settings.pack_cpu_weights
        and settings.device.type == "cpu"
        and settings.dtype == torch.float32
        and cpu_linear.available()
    )


def _config(info: BaseModelInfo, cache_dir: Path) -> PreTrainedConfig:
    """`info`'s transformers config, read the way `models.loading` reads its weights."""
    if info.kind == "tiny-debug":
        config: PreTrainedConfig = tiny_debug_config(info.vocab_size)
        return config
    if info.kind == "hf":
        return AutoConfig.from_pretrained(str(info.path), local_files_only=True)
    converted = Path(cache_dir) / "models" / safe_name(info.name)
    if (converted / "config.json").is_file():  # the GGUF's safetensors (`loading.model_dir`)
        return AutoConfig.from_pretrained(str(converted), local_files_only=True)
    gguf = gguf_path(info)  # reads the GGUF's metadata: a few seconds, once per process
    return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
