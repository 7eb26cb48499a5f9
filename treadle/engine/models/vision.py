"""Images in a vision-language model's passes: pixels from a request's image bytes, and the
extra inputs a pass over token rows that hold images needs.

A datum or prompt carries its images as `EngineImage`s (where its `tokens` image-token
placeholders begin, how many, the encoded bytes). `pixel_arrays` runs the model's own image
processor (from its registered folder) over them, per datum, into `pixel_values` and
`image_grid_thw` arrays that ride with the datum's other arrays through a forward_backward's
passes; `pass_inputs` turns a pass's rows into the model's keyword arguments: the pixels of
every image in row order, which positions are image tokens (`mm_token_type_ids`) and explicit
multimodal rotary positions ([4, B, T]: the text position, then the model's 3-D positions from
its own `get_rope_index`), so that no state is left on the model between passes (transformers
caches `rope_deltas` on the model when it computes them itself). Deterministic: the processor
and the positions depend only on the bytes and the tokens, so a replay recomputes the same bits.
Must not import flask, sqlalchemy, celery or treadle.api.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel

from treadle.platform.errors import ValidationError
from treadle.platform.models.catalog import BaseModelInfo

__all__ = [
    "EngineImage",
    "image_processor",
    "model_pixels",
    "pass_inputs",
    "pixel_arrays",
    "prompt_inputs",
]


@dataclass(frozen=True)
class EngineImage:
    """One image of a datum or prompt: its placeholders are `tokens[at : at + tokens]`."""

    at: int
    tokens: int
    format: str
    data: bytes


@cache
def image_processor(folder: str) -> Any:
    """The image processor saved in a registered vision-language model's folder, offline (its
    Pillow backend where torchvision is not installed, as here)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder, local_files_only=True)


def model_pixels(
    info: BaseModelInfo, images: Sequence[EngineImage], where: str
) -> dict[str, np.ndarray]:
    """A datum's or prompt's images as its model's own processor makes them (`pixel_arrays`);
    ValidationError for a text-only model."""
    if info.vision is None or info.path is None:
        raise ValidationError(f"{where}: {info.name} is a text-only model; it takes no images")
    return pixel_arrays(image_processor(info.path), images, where)


def pixel_arrays(
    processor: Any, images: Sequence[EngineImage], where: str
) -> dict[str, np.ndarray]:
    """`images` through `processor`: {"pixel_values": float32 [patches, D], "image_grid_thw":
    int64 [images, 3]}. Raises ValidationError where an image does not become the tokens its
    placeholders hold (the API counted them with the same rule: `platform.models.vision`)."""
    from PIL import Image

    pictures = []
    for image in images:
        with Image.open(io.BytesIO(image.data)) as opened:
            pictures.append(opened.convert("RGB"))
    out = processor(images=pictures, return_tensors="np")
    grid = np.asarray(out["image_grid_thw"], np.int64).reshape(len(images), 3)
    merge = int(processor.merge_size)
    for n, (image, thw) in enumerate(zip(images, grid, strict=True)):
        made = int(np.prod(thw)) // merge**2
        if made != image.tokens:
            raise ValidationError(
                f"{where}: image {n} becomes {made} tokens with the model's image processor, "
                f"but its chunk holds {image.tokens}; compute expected_tokens with the model's "
                "own processor"
            )
    return {
        "pixel_values": np.asarray(out["pixel_values"], np.float32),
        "image_grid_thw": grid,
    }


def pass_inputs(
    model: PreTrainedModel,
    tokens_B_T: Tensor,
    mask_B_T: Tensor,
    arrays: Sequence[dict[str, np.ndarray]],
) -> dict[str, Tensor]:
    """The keyword arguments a forward over `tokens_B_T` (right- or left-padded, `mask_B_T`)
    needs besides its ids, for rows `arrays` whose images `pixel_arrays` made: {} where no row
    holds an image."""
    rows = [a for a in arrays if "image_grid_thw" in a]
    if not rows:
        return {}
    device = tokens_B_T.device
    pixels = torch.from_numpy(np.concatenate([a["pixel_values"] for a in rows])).to(device)
    grid = torch.from_numpy(np.concatenate([a["image_grid_thw"] for a in rows])).to(device)
    image_token = int(model.config.image_token_id)
    kinds_B_T = (tokens_B_T == image_token).int() * mask_B_T.int()
    mask = mask_B_T.long()
    rope_3_B_T, _ = model.model.get_rope_index(
        tokens_B_T, mm_token_type_ids=kinds_B_T, image_grid_thw=grid, attention_mask=mask
    )
    text_B_T = (mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "pixel_values": pixels.to(model.dtype),
        "image_grid_thw": grid,
        "mm_token_type_ids": kinds_B_T,
        "position_ids": torch.cat([text_B_T[None], rope_3_B_T.to(device)]),
    }


def prompt_inputs(
    model: PreTrainedModel,
    tokens_J_L: Tensor,
    mask_J_L: Tensor,
    arrays: Sequence[dict[str, np.ndarray]],
) -> tuple[dict[str, Tensor], Tensor]:
    """A left-padded prefill's `pass_inputs`, and each row's rotary offset for the tokens it
    samples after its prompt (int64 [J]: position = text position + offset; 0 without images)."""
    inputs = pass_inputs(model, tokens_J_L, mask_J_L, arrays)
    if not inputs:
        return inputs, torch.zeros(len(tokens_J_L), dtype=torch.long, device=tokens_J_L.device)
    position_4_J_L = inputs["position_ids"]
    # as transformers' get_rope_index: the next position is one past the prompt's largest (the
    # left padding's are 0)
    offset_J = position_4_J_L[1:].amax(dim=(0, 2)) + 1 - mask_J_L.long().sum(-1)
    return inputs, offset_J
