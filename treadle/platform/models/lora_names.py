"""The names that decide which linears of a causal LM a LoRA adapter trains, without torch.

Owns the one set of target rules: the suffix tables (standard names plus per-architecture extras,
like peft's `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`), the router names (never
targets), the names and class-name fragments that mark a decoder layer's attention and MLP
blocks, and `suffix_category`. The engine (`treadle/engine/lora/targets.py`) applies them to the
loaded modules; registration (`structure`) applies them to a folder's tensor names, so a model
the registry admits is one the engine resolves. Pure Python: imports nothing of Treadle.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "ATTN_SUFFIXES",
    "BLOCK_CLASS_HINTS",
    "BLOCK_NAMES",
    "CATEGORIES",
    "EXTRA_SUFFIXES",
    "MLP_SUFFIXES",
    "ROUTER_NAMES",
    "UNEMBED_SUFFIXES",
    "Category",
    "all_suffixes",
    "base_suffixes",
    "suffix_category",
    "suffixes",
]

Category = Literal["attn", "mlp", "unembed"]
CATEGORIES: tuple[Category, ...] = ("attn", "mlp", "unembed")

# Standard names: Llama, Qwen, Mistral, Gemma, gpt-oss, OLMo 2, StableLM, SmolLM3, GLM; Phi-3's
# and GLM's fused qkv_proj and gate_up_proj; fc1/fc2 (Phi-2, OPT-style MLPs).
ATTN_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_SUFFIXES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2")
UNEMBED_SUFFIXES = ("lm_head", "embed_out")

_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's latent attention

# Extra names by `config.model_type`, where an architecture departs from the standard ones.
EXTRA_SUFFIXES: dict[str, dict[Category, tuple[str, ...]]] = {
    "gpt_neox": {"attn": ("query_key_value", "dense"), "mlp": ("dense_h_to_4h", "dense_4h_to_h")},
    "falcon": {"attn": ("query_key_value", "dense"), "mlp": ("dense_h_to_4h", "dense_4h_to_h")},
    "phi": {"attn": ("dense",)},
    "deepseek_v2": {"attn": _MLA},
    "deepseek_v3": {"attn": _MLA},
}

# Inside an MLP block, linears on these paths choose experts; they are never LoRA targets.
ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})

# Block names (a decoder layer's child) and class-name fragments that mark each kind of block.
# Registration sees only tensor names, so it goes by BLOCK_NAMES alone.
BLOCK_NAMES: dict[Category, frozenset[str]] = {
    "attn": frozenset({"self_attn", "attn", "attention", "self_attention"}),
    "mlp": frozenset({"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe"}),
}
BLOCK_CLASS_HINTS: dict[Category, tuple[str, ...]] = {
    "attn": ("Attention",),
    "mlp": ("MLP", "Moe", "MoE", "FeedForward", "Experts"),
}


def base_suffixes(category: Category) -> tuple[str, ...]:
    """The standard names of `category`."""
    return {"attn": ATTN_SUFFIXES, "mlp": MLP_SUFFIXES, "unembed": UNEMBED_SUFFIXES}[category]


def suffixes(category: Category, model_type: str) -> frozenset[str]:
    """The names of `category` in a model of `model_type`: the standard ones and its extras."""
    extra = EXTRA_SUFFIXES.get(model_type, {}).get(category, ())
    return frozenset(base_suffixes(category) + extra)


def all_suffixes(category: Category) -> tuple[str, ...]:
    """The names of `category` in any architecture Treadle knows."""
    extras = (e.get(category, ()) for e in EXTRA_SUFFIXES.values())
    return base_suffixes(category) + tuple(s for group in extras for s in group)


def suffix_category(suffix: str) -> Category | None:
    """The category a module-name suffix belongs to in any architecture Treadle knows (None for
    an unknown one). Needs no model: for reading a peft config's `target_modules`."""
    for category in CATEGORIES:
        if suffix in all_suffixes(category):
            return category
    return None
