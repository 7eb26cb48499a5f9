"""What a training pass keeps for its backward per token, measured on the model itself.

Owns `TokenCost` (bytes a padded token keeps until the backward: in all the decoder layers,
and in one) and `token_cost(model)`, which the checkpointing threshold and the CUDA pass budget
read (`chunked_logprobs.wants_checkpointing`, `passes.token_bytes`). It is measured once per
model (cached while the model lives): the decoder runs forward with grads on probes of
PROBE_TOKENS and 2 x PROBE_TOKENS tokens, its embeddings taking grads (as earlier layers' LoRA
makes them in a pass), with a rank-1 adapter in the adapter's compute dtype on every attention
and MLP target its LoRA host resolves (`lora.adapters`), and the storages autograd saves are
counted (`saved_bytes`: each once, the model's weights left out); the difference of the two
probes over their difference in tokens is the cost, so what does not grow with a pass's tokens
(weights, rotary tables) cancels. An attention that keeps [T, T] scores (eager) costs more per
token in longer passes than this measures; SDPA's kernels keep per-token tensors only.

A model that cannot be probed here gets `estimated_cost`, the formula the engine used before:
one on the meta device (admission's footprint, built from a config) or sharded across a worker
group (a probe on one rank would run the group's collectives alone).
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from treadle.engine.lora.adapters import (
    LoraHost,
    LoraLinear,
    LoraSpec,
    LoraWeights,
    compute_dtype,
)

__all__ = [
    "ACTIVATION_VALUES_PER_HIDDEN",
    "PROBE_TOKENS",
    "TokenCost",
    "estimated_cost",
    "measured_cost",
    "saved_bytes",
    "token_cost",
]

# The estimate's count (`estimated_cost`): a decoder layer keeps roughly this many values per
# token, in units of the hidden size, for its backward (Korthikanti et al., "Reducing Activation
# Recomputation in Large Transformer Models", 2022, count ~17 at 16 bits without the attention
# scores), besides its adapted linears' inputs.
ACTIVATION_VALUES_PER_HIDDEN = 20
# The shorter probe's tokens; the longer one has twice as many.
PROBE_TOKENS = 16


@dataclass(frozen=True)
class TokenCost:
    """Bytes one padded token of a training pass keeps for the backward: `layers` in all the
    decoder layers together, `layer` in one (`layers` / their number)."""

    layers: int
    layer: int
    measured: bool  # False: `estimated_cost`


_MEASURED: weakref.WeakKeyDictionary[nn.Module, TokenCost] = weakref.WeakKeyDictionary()


def token_cost(model: PreTrainedModel) -> TokenCost:
    """`model`'s cost per token: measured once (`measured_cost`, kept while the model lives)
    where it can be probed here, else `estimated_cost` (see the module's docstring). The engine
    wraps a model in its LoRA host when it loads it, before anything asks."""
    cost = _MEASURED.get(model)  # asked before every training pass: looked up first
    if cost is not None:
        return cost
    if not _probeable(model):
        return estimated_cost(model)
    cost = _MEASURED[model] = measured_cost(model)
    return cost


def measured_cost(model: PreTrainedModel) -> TokenCost:
    """The cost measured on probes of PROBE_TOKENS and twice as many tokens (the module's
    docstring), uncached."""
    short = _probe(model, PROBE_TOKENS)
    long = _probe(model, 2 * PROBE_TOKENS)
    per_token = max(0, (long - short) // PROBE_TOKENS)
    layers = _layers(model)
    return TokenCost(layers=per_token, layer=per_token // layers, measured=True)


def estimated_cost(model: PreTrainedModel) -> TokenCost:
    """Per layer ACTIVATION_VALUES_PER_HIDDEN hidden-sized values in the model's dtype plus the
    summed input features of the layer's linears in the adapter's compute dtype (each one an
    adapter may target keeps its input for the LoRA's gradient; shared inputs counted once per
    linear, rank-sized products left out)."""
    config = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    element = dtype.itemsize
    lora = _linear_inputs(model) * compute_dtype(dtype).itemsize
    layer = ACTIVATION_VALUES_PER_HIDDEN * config.hidden_size * element + lora
    return TokenCost(layers=config.num_hidden_layers * layer, layer=layer, measured=False)


def saved_bytes(run: Callable[[], object], skip: Collection[int] = ()) -> int:
    """Bytes of the storages autograd saves for the backward while `run` runs, each storage
    once, those whose data pointers are in `skip` (weights) left out; what `run` returns is
    kept until they are counted (its graph holds them)."""
    sizes: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        out = run()
    del out
    return sum(sizes.values())


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _probe(model: PreTrainedModel, tokens: int) -> int:
    """Bytes saved by the decoder's forward over `tokens` tokens, as the module's docstring
    says."""
    first = next(model.parameters())
    ids_B_T = (torch.arange(tokens, device=first.device) % model.config.vocab_size)[None]
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    host = _host(model)
    probe = None
    if host is not None and host.rows is None:
        probe = _probe_weights(host, first.device, first.dtype)
        if probe is not None:
            skip |= {p.untyped_storage().data_ptr() for p in probe.parameters()}

    def run() -> torch.Tensor:
        with torch.no_grad():
            embeds_B_T_H = model.get_input_embeddings()(ids_B_T)
        embeds_B_T_H.requires_grad_(True)
        decoder = model.get_decoder()
        if host is None or probe is None:
            return decoder(inputs_embeds=embeds_B_T_H, use_cache=False).last_hidden_state
        with host.use(probe):
            return decoder(inputs_embeds=embeds_B_T_H, use_cache=False).last_hidden_state

    with torch.enable_grad():
        return saved_bytes(run, skip)


def _probe_weights(host: LoraHost, device: torch.device, dtype: torch.dtype) -> LoraWeights | None:
    """A rank-1 adapter on every attention and MLP target `host` resolves (None: none it can
    train), in the compute dtype of a model in `dtype`."""
    targets = host.targets
    unknown = {category for category, _ in targets.unknown}
    attn = bool(targets.attn) and "attn" not in unknown
    mlp = bool(targets.mlp) and "mlp" not in unknown
    if not (attn or mlp):
        return None
    spec = LoraSpec(rank=1, alpha=1.0, train_attn=attn, train_mlp=mlp, train_unembed=False)
    return host.new_weights(spec, device).in_dtype(compute_dtype(dtype))


def _host(model: nn.Module) -> LoraHost | None:
    """The LoRA host that wrapped `model`'s linears (None: a model without one)."""
    for module in model.modules():
        if isinstance(module, LoraLinear):
            return module.host
    return None


def _probeable(model: nn.Module) -> bool:
    """On a real device and not sharded (a DTensor has `to_local`)."""
    first = next(model.parameters())
    return first.device.type != "meta" and not any(
        hasattr(p, "to_local") for p in model.parameters()
    )


def _layers(model: PreTrainedModel) -> int:
    return max(1, int(model.config.get_text_config().num_hidden_layers))


def _linear_inputs(model: PreTrainedModel) -> int:
    """The summed input features of one decoder layer's linears (the first layer's)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return 0
    return sum(m.in_features for m in layers[0].modules() if isinstance(m, nn.Linear))
