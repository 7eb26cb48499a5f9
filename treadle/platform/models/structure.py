"""Admission by structure: whether Treadle can train and sample a causal LM, read from its folder.

Owns `check_structure(config, shapes, lora_targets)`. A decoder-only causal LM registers when
(1) the installed transformers builds it with `AutoModelForCausalLM` (its model_type is in
transformers' causal-LM table, naming the class config.json names), (2) every layer is one the
sampler caches (full or sliding-window attention with a standard KV cache: no linear attention,
Mamba/SSM, convolution or other recurrent layers), and (3) every linear weight in a decoder layer
resolves under the LoRA target rules of `lora_names`: in an attention or MLP block with a name of
its category, or an MoE router. Otherwise the ValidationError names each layer type, config key
or module that did not resolve. Reads only config.json and the safetensors headers' tensor names
and shapes; must not import torch or transformers (transformers' table is parsed from its source).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from treadle.platform.errors import ValidationError
from treadle.platform.models.lora_names import (
    BLOCK_NAMES,
    ROUTER_NAMES,
    Category,
    suffixes,
)

__all__ = ["CACHED_LAYER_TYPES", "Structure", "causal_lm_classes", "check_structure"]

# The layer types (transformers' `layer_types`) the sampler's KV pool serves; the
# sampler reads them from here (treadle/engine/sampling/decode.py `_LAYER_TYPES`).
CACHED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# config.json keys that describe recurrent or linear-attention layers (Mamba/SSM hybrids such
# as Jamba, Bamba, Nemotron-H, Falcon-H1; Qwen3-Next's gated delta net).
_RECURRENT_KEY = re.compile(
    r"^(mamba_\w+|ssm_\w+|linear_(conv|key|value|num)\w*|hybrid_override_pattern|"
    r"attn_layer_(period|offset)|layers_block_type)$"
)
_BLOCKS: tuple[Category, ...] = ("attn", "mlp")
_LISTED = 4  # modules named in a refusal before "and N more"


@dataclass(frozen=True)
class Structure:
    """What registration learns from a model's structure: `moe_experts`, its MLP blocks hold
    experts (3-D parameters once transformers 5 loads them), and how many decoder layers."""

    moe_experts: bool
    layers: int


def check_structure(
    architecture: str,
    config: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]],
    lora_targets: Sequence[str],
) -> Structure:
    """The structure of the model `config` describes, whose weights are `shapes` (tensor name
    -> shape, from the safetensors headers), for an adapter policy of `lora_targets`.

    Raises ValidationError naming what does not resolve: a model_type transformers has no causal
    LM for (or one that loads another class than `architecture`), layer types the sampler cannot
    cache, config keys of recurrent layers, and linear weights of decoder layers outside any
    attention or MLP block or with names the target rules do not know (inside a block of a
    category `lora_targets` leaves out, those are allowed: that category is never trained).
    """
    text = config.get("text_config")
    text_config: Mapping[str, Any] = text if isinstance(text, dict) else config
    model_type = str(text_config.get("model_type") or config.get("model_type") or "")
    vision = isinstance(config.get("vision_config"), dict)
    _check_transformers_builds(architecture, str(config.get("model_type") or ""), vision)
    problems = _layer_type_problems(text_config)
    if vision:  # the language model's layers: LoRA never adapts the vision tower
        shapes = {n: s for n, s in shapes.items() if ".language_model." in f".{n}"}
    stack = _decoder_stack(shapes)
    if stack is None:
        raise ValidationError(
            f"{architecture}'s weights hold no stack of numbered decoder layers (tensor names "
            "like model.layers.0.self_attn.q_proj.weight); Treadle trains decoder-only causal "
            "LMs saved with save_pretrained"
        )
    prefix, layers = stack
    unresolved, moe = _unresolved_weights(shapes, prefix, model_type, set(lora_targets))
    for where, names in unresolved.items():
        shown = ", ".join(names[:_LISTED]) + (
            f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
        )
        problems.append(f"{where}: {shown}")
    if problems:
        raise ValidationError(
            f"{architecture} (model_type {model_type!r}) is not a structure Treadle can train "
            "and sample: " + "; ".join(problems) + ". Treadle admits decoder-only causal LMs "
            "whose layers are full or sliding-window attention with a standard KV cache and "
            "whose attention and MLP linears have names the LoRA target rules know "
            "(treadle/platform/models/lora_names.py); linears of a category the registration's "
            "lora_targets leaves out need not resolve"
        )
    return Structure(moe_experts=moe, layers=layers)


@functools.cache
def causal_lm_classes(
    table: str = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
) -> tuple[str, dict[str, str]] | None:
    """(version, model_type -> class) of the installed transformers' `AutoModelForCausalLM`
    table (or another of its auto tables: `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, the
    vision-language models'), read from its source without importing it (importing
    transformers imports torch); None where transformers is not installed in this process or its
    table is not where transformers 4.x and 5.x keep it (then the workers' load is the only
    check)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(spec.submodule_search_locations[0]) / "models" / "auto" / "modeling_auto.py"
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == table for t in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
        ):
            try:
                pairs = ast.literal_eval(node.value.args[0])
                return metadata.version("transformers"), {str(k): str(v) for k, v in pairs}
            except (ValueError, TypeError, metadata.PackageNotFoundError):
                return None
    return None


def _check_transformers_builds(architecture: str, model_type: str, vision: bool) -> None:
    """ValidationError unless the installed transformers' AutoModelForCausalLM (for a
    vision-language model, AutoModelForImageTextToText) builds `architecture` for `model_type`
    (without remote code). Where the API process has no transformers, the workers' load is the
    check."""
    auto = "AutoModelForImageTextToText" if vision else "AutoModelForCausalLM"
    table = causal_lm_classes(
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"
        if vision
        else "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
    )
    if table is None:
        return
    version, classes = table
    built = classes.get(model_type)
    if built is None:
        kind = "vision-language model" if vision else "causal LM"
        raise ValidationError(
            f"transformers {version} has no {kind} for model_type {model_type!r} "
            f"({architecture}); Treadle loads models with {auto}, without remote "
            "code: register a model whose model_type transformers knows"
        )
    if built != architecture:
        raise ValidationError(
            f"config.json names {architecture}, but transformers {version} builds {built} for "
            f"its model_type {model_type!r}; fix config.json's architectures or model_type"
        )


def _layer_type_problems(config: Mapping[str, Any]) -> list[str]:
    """What in `config` makes layers the sampler cannot cache, as transformers' cache reads it
    (`get_layer_types_and_kwargs`): layer types other than full and sliding-window attention,
    chunked attention, layers sharing another's cache, and keys of recurrent layers."""
    problems = []
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        where: dict[str, list[int]] = {}
        for i, kind in enumerate(layer_types):
            if kind not in CACHED_LAYER_TYPES:
                where.setdefault(str(kind), []).append(i)
        for kind, layers in sorted(where.items()):
            problems.append(f"{_layers(layers)} {'is' if len(layers) == 1 else 'are'} {kind}")
    elif config.get("attention_chunk_size") is not None:
        problems.append("its layers are chunked_attention (attention_chunk_size)")
    modes = config.get("kv_sharing_modes")
    if isinstance(modes, list) and "reuse" in modes:
        problems.append("some layers reuse another layer's KV cache (kv_sharing_modes)")
    recurrent = sorted(k for k in config if _RECURRENT_KEY.match(k))
    if recurrent:
        keys = ", ".join(recurrent[:3]) + (", ..." if len(recurrent) > 3 else "")
        problems.append(f"config.json describes recurrent layers ({keys})")
    return problems


def _layers(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")
    return f"layer{'s' if len(indices) > 1 else ''} {shown}"


def _decoder_stack(shapes: Mapping[str, Sequence[int]]) -> tuple[str, int] | None:
    """(prefix, layer count) of the decoder stack: of the prefixes followed by a layer number
    (`model.layers` in `model.layers.3.mlp.up_proj.weight`), the one whose tensors hold the most
    elements, as the engine picks the ModuleList holding the most parameters."""
    sizes: dict[str, int] = {}
    indices: dict[str, set[int]] = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        numel = 1
        for n in shape:
            numel *= int(n)
        for i, part in enumerate(parts[1:-1], start=1):
            if part.isdigit():
                prefix = ".".join(parts[:i])
                sizes[prefix] = sizes.get(prefix, 0) + numel
                indices.setdefault(prefix, set()).add(int(part))
    if not sizes:
        return None
    best = max(sizes, key=lambda p: (sizes[p], -len(p)))
    return best, len(indices[best])


def _unresolved_weights(
    shapes: Mapping[str, Sequence[int]], stack: str, model_type: str, wanted: set[str]
) -> tuple[dict[str, list[str]], bool]:
    """The decoder layers' weights the target rules do not resolve, by why (each module once,
    its layer number as `*`), and whether an MLP block holds experts."""
    known = {c: suffixes(c, model_type) for c in _BLOCKS}
    words = {"attn": "attention", "mlp": "MLP"}
    unresolved: dict[str, list[str]] = {}
    moe = False

    def add(why: str, module: str) -> None:
        names = unresolved.setdefault(why, [])
        if module not in names:
            names.append(module)

    for name, shape in sorted(shapes.items()):
        if not name.startswith(stack + "."):
            continue
        layer, _, rest = name[len(stack) + 1 :].partition(".")
        if not layer.isdigit() or not rest:
            continue
        parts = rest.split(".")
        module = f"{stack}.*.{'.'.join(parts[:-1] if parts[-1] == 'weight' else parts)}"
        block = _block(parts)
        if block == "mlp" and ("experts" in parts or len(shape) >= 3):
            # Experts, saved per expert (Qwen3-MoE) or stacked (gpt-oss): transformers 5 loads
            # them as 3-D parameters, not linears (the engine's `experts_3d`).
            moe = True
            continue
        if len(shape) >= 3:
            add("weights of 3 or more dimensions outside MLP experts (convolutions?)", module)
            continue
        if len(shape) != 2 or parts[-1] != "weight" or "norm" in parts[-2]:
            continue  # biases, norms (Cohere's are [heads, head_dim]), scalars
        if block == "mlp" and ROUTER_NAMES & set(parts[1:-1]):
            continue
        suffix = parts[-2]
        if block is None:
            category = next((c for c in _BLOCKS if suffix in known[c]), None)
            if category is None:
                add("linears outside any attention or MLP block", module)
        elif suffix not in known[block] and block in wanted:
            add(f"{words[block]} linears the LoRA target rules do not know", module)
    return unresolved, moe


def _block(parts: list[str]) -> Category | None:
    """The kind of block the weight at `parts` (below its layer) sits in: the first module on
    its path whose name marks one (registration sees no class names)."""
    for part in parts[:-2]:
        for category in _BLOCKS:
            if part in BLOCK_NAMES[category]:
                return category
    return None
