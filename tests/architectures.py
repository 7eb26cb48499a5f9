"""Tiny random models of the architectures Treadle is tested on, built from transformers configs.

Each entry is a real architecture's config class with its distinguishing features kept (grouped
query attention everywhere, Qwen3's q/k norms, Mistral's sliding window, Gemma 3's hybrid
sliding/full layers, tied embeddings and logit soft-capping, Phi-3's fused `qkv_proj` and
`gate_up_proj`, Qwen3-MoE's and gpt-oss's experts stored as 3-D parameters; and four the registry
admits by structure alone, `BY_STRUCTURE`) and every size shrunk so a forward pass takes
milliseconds on the CPU. `REFUSED` are real architectures registration refuses (a block the
target rules do not resolve, layers the sampler cannot cache). `build(name, vocab_size)` makes
the model with a fixed seed, bit-identical in every process; tests save it with `save_pretrained`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    FalconH1Config,
    Gemma3TextConfig,
    GlmConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SmolLM3Config,
    StableLmConfig,
    Starcoder2Config,
)

__all__ = ["ARCHITECTURES", "BY_STRUCTURE", "MOE", "REFUSED", "SLIDING", "build", "config"]

_SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# Special token ids of a config's defaults lie outside the tiny vocabulary (transformers warns).
_NO_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

_CONFIGS: dict[str, Callable[[int], PretrainedConfig]] = {
    "llama3": lambda v: LlamaConfig(vocab_size=v, rope_theta=500000.0, **_SIZES),
    "qwen2.5": lambda v: Qwen2Config(vocab_size=v, **_SIZES),
    "qwen3": lambda v: Qwen3Config(vocab_size=v, head_dim=8, **_SIZES),
    "qwen3-moe": lambda v: Qwen3MoeConfig(
        vocab_size=v,
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        **_SIZES,
    ),
    "mistral": lambda v: MistralConfig(vocab_size=v, sliding_window=16, **_SIZES),
    "gemma3": lambda v: Gemma3TextConfig(
        vocab_size=v,
        head_dim=8,
        sliding_window=16,
        sliding_window_pattern=2,
        final_logit_softcapping=30.0,
        **_SIZES,
    ),
    "phi3": lambda v: Phi3Config(
        vocab_size=v, pad_token_id=0, bos_token_id=None, eos_token_id=None, **_SIZES
    ),
    "gpt-oss": lambda v: GptOssConfig(
        vocab_size=v,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        **{**_SIZES, "intermediate_size": 32},
    ),
    # Admitted by structure (no list of names): decoder-only with the standard projection names.
    # OLMo 2: q/k norms over the whole projection, norms after attention and MLP.
    "olmo2": lambda v: Olmo2Config(vocab_size=v, **_NO_IDS, **_SIZES),
    # StableLM: partial rotary, LayerNorm with biases, q/k/v biases, per-head q/k LayerNorms,
    # attention and MLP in parallel.
    "stablelm": lambda v: StableLmConfig(
        vocab_size=v, use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True, **_SIZES
    ),
    # SmolLM3: every second layer without rotary embeddings (NoPE), tied embeddings.
    "smollm3": lambda v: SmolLM3Config(vocab_size=v, **_NO_IDS, no_rope_layer_interval=2, **_SIZES),
    # GLM: fused gate_up_proj, partial rotary, attention biases.
    "glm": lambda v: GlmConfig(vocab_size=v, **_NO_IDS, head_dim=8, **_SIZES),
}

# Real architectures registration refuses, named by what does not resolve: Starcoder2's MLP
# linears are c_fc and c_proj (no name of the target rules), Qwen3-Next's layers are linear
# attention (a recurrent state, no KV cache), Falcon-H1's layers run a Mamba mixer beside
# attention.
_REFUSED: dict[str, Callable[[int], PretrainedConfig]] = {
    "starcoder2": lambda v: Starcoder2Config(vocab_size=v, **_NO_IDS, **_SIZES),
    "qwen3-next": lambda v: Qwen3NextConfig(
        vocab_size=v,
        head_dim=8,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        **_SIZES,
    ),
    "falcon-h1": lambda v: FalconH1Config(
        vocab_size=v,
        head_dim=8,
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        **_SIZES,
    ),
}

ARCHITECTURES: tuple[str, ...] = tuple(_CONFIGS)
# Outside the eight the registry once admitted by name: admitted now by their structure.
BY_STRUCTURE = ("olmo2", "stablelm", "smollm3", "glm")
REFUSED: tuple[str, ...] = tuple(_REFUSED)
MOE = frozenset({"qwen3-moe", "gpt-oss"})  # experts as 3-D parameters
SLIDING = frozenset({"mistral", "gemma3", "gpt-oss"})  # sliding-window attention layers

SEED = 1234


def config(name: str, vocab_size: int = 256) -> PretrainedConfig:
    """The tiny config of architecture `name`, for a vocabulary of `vocab_size` tokens; its
    special token ids are cleared (the tokenizer that goes with it sets them)."""
    cfg = {**_CONFIGS, **_REFUSED}[name](vocab_size)
    for key in ("bos_token_id", "eos_token_id"):
        setattr(cfg, key, None)
    if name != "phi3":
        cfg.pad_token_id = None
    return cfg


def build(name: str, vocab_size: int = 256, cfg: PretrainedConfig | None = None) -> PreTrainedModel:
    """A float32 model of architecture `name` with random weights from a fixed seed, in eval
    mode. The global RNG is left untouched."""
    cfg = cfg if cfg is not None else config(name, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        # from_config leaves some weights (norms, routers) at constants; perturb every parameter
        # a little so no architecture's features hide behind symmetric weights.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    model.eval()
    return model
