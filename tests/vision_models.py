"""A registrable folder of a tiny random Qwen3-VL (vision-language) model, offline.

`vl_folder(folder)` writes what an operator registers for a vision-language model:
`save_pretrained` of a tiny random `Qwen3VLForConditionalGeneration` (a 2-layer language model
larger than its 2-block vision tower, as in real checkpoints), its image processor's
`preprocessor_config.json` (Qwen2-VL's resize rule: 16-pixel patches merged 2 x 2, between
32 x 32 and 128 x 128 pixels), and the byte-level BPE tokenizer of tests/tiny_models.py with
Qwen-VL's special tokens added. Deterministic: the same folder bytes in every process.
"""

from __future__ import annotations

import io
from pathlib import Path

from tests import tiny_models

__all__ = ["QWEN3_VL_SPECIAL", "image_bytes", "processor", "vl_folder"]

QWEN3_VL_SPECIAL = [
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
]
MIN_PIXELS, MAX_PIXELS = 32 * 32, 128 * 128


def processor() -> object:
    """The image processor the folder saves (PIL backend: no torchvision here)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def vl_folder(folder: Path) -> Path:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = tiny_models.save_tokenizer("bpe", folder)
    tok.add_special_tokens({"additional_special_tokens": QWEN3_VL_SPECIAL})  # type: ignore[attr-defined]
    tok.save_pretrained(str(folder))  # type: ignore[attr-defined]
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN3_VL_SPECIAL}  # type: ignore[attr-defined]
    vocab = -(-len(tok) // 64) * 64  # type: ignore[arg-type]
    eos = tok.convert_tokens_to_ids(tok.eos_token)  # type: ignore[attr-defined]
    cfg = Qwen3VLConfig(
        text_config={
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": True,
            "eos_token_id": eos,
        },  # fmt: skip
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(str(folder))
    processor().save_pretrained(str(folder))  # type: ignore[attr-defined]
    return folder


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "JPEG") -> bytes:
    """A random RGB image of `width` x `height`, encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()
