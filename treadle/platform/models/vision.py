"""Images for vision-language base models: what registration learns of a model's vision tower
(`VisionSpec`, from `config.json` and `preprocessor_config.json`), how many tokens an image
becomes (`image_tokens`, the Qwen-VL processors' resize rule), and admission of one image
(`admit_image`: a JPEG or PNG that decodes, within the limits, whose token count is what the
client expected).

A request's image stands in its token sequence as `tokens` copies of the model's image token,
so lengths, targets, metering (as prefill) and the event log treat it as tokens; the image's
bytes travel beside them (`optypes.Image`) and the worker's processor turns them into pixels.
Must not import flask, torch, treadle.api, treadle.engine or treadle.worker.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from treadle.platform.errors import ValidationError

__all__ = [
    "ASSET_POINTERS_REFUSED",
    "FORMATS",
    "IMAGE_PLACEHOLDER",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "AdmittedImage",
    "VisionSpec",
    "admit_image",
    "image_tokens",
    "place_images",
    "vision_spec",
]

FORMATS = ("jpeg", "png")
# Why an image_asset_pointer chunk is refused: a multi-tenant server does not fetch the URLs or
# read the paths its clients name.
ASSET_POINTERS_REFUSED = (
    "image_asset_pointer chunks are not served (this server fetches no URL or path a client "
    "names); send the image's bytes as an image chunk (tinker.types.ImageChunk)"
)
# What an edge puts at an image's positions before the model (and so its image token) is known.
IMAGE_PLACEHOLDER = -1
MAX_IMAGE_BYTES = 20 * 2**20
MAX_IMAGE_PIXELS = 64 * 2**20  # decoded pixels: past this, a small file is a decompression bomb
MAX_ASPECT = 200  # the processors refuse a longer side more than 200 times the shorter
# Registration admits the vision-language families the engine's image path is tested on
# (tests/unit/engine/test_vision_language.py): processors that resize this way, a language model
# that takes the image as `image_token_id` placeholders between start and end tokens, and
# multimodal rotary positions from the model's own `get_rope_index`.
VISION_MODEL_TYPES = ("qwen3_vl",)


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language model's image geometry and its special tokens: an image resized to a
    multiple of `patch_size * merge_size` per side, between `min_pixels` and `max_pixels`,
    becomes (h / patch) * (w / patch) / merge^2 `image_token_id` tokens."""

    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VisionSpec:
        return cls(**{k: int(v) for k, v in data.items()})


def vision_spec(
    model_type: str, config: dict[str, Any], preprocessor: dict[str, Any] | None
) -> VisionSpec:
    """The `VisionSpec` of a registered folder's vision-language model.

    Raises ValidationError for a family Treadle does not serve images for, or a folder without
    the `preprocessor_config.json` (or with one missing a field) its processor is saved with."""
    if model_type not in VISION_MODEL_TYPES:
        raise ValidationError(
            f"model_type {model_type!r} is a vision-language model Treadle does not serve; "
            f"image inputs are served for {list(VISION_MODEL_TYPES)}"
        )
    if preprocessor is None:
        raise ValidationError(
            "a vision-language model folder needs its image processor's preprocessor_config.json "
            "(save the processor into the folder with processor.save_pretrained)"
        )
    vision = config.get("vision_config")
    vision_config: dict[str, Any] = vision if isinstance(vision, dict) else {}
    size = preprocessor.get("size")
    sizes: dict[str, Any] = size if isinstance(size, dict) else {}
    values = {
        "image_token_id": config.get("image_token_id"),
        "vision_start_token_id": config.get("vision_start_token_id"),
        "vision_end_token_id": config.get("vision_end_token_id"),
        "patch_size": preprocessor.get("patch_size", vision_config.get("patch_size")),
        "merge_size": preprocessor.get("merge_size", vision_config.get("spatial_merge_size")),
        "temporal_patch_size": preprocessor.get(
            "temporal_patch_size", vision_config.get("temporal_patch_size")
        ),
        "min_pixels": preprocessor.get("min_pixels", sizes.get("shortest_edge")),
        "max_pixels": preprocessor.get("max_pixels", sizes.get("longest_edge")),
    }
    given = {k: v for k, v in values.items() if isinstance(v, int) and v > 0}
    missing = [k for k in values if k not in given]
    if missing:
        raise ValidationError(
            f"the vision-language model's config.json and preprocessor_config.json do not give "
            f"{missing} as positive integers; save the model and its processor with "
            "save_pretrained from the same checkpoint"
        )
    return VisionSpec(**given)


def image_tokens(spec: VisionSpec, width: int, height: int) -> int:
    """The tokens an image of `width` x `height` pixels becomes: resized so that each side is a
    multiple of patch x merge, the area kept within [min_pixels, max_pixels] at about the same
    aspect ratio (the rule Qwen-VL's processors apply), then one token per merge x merge
    patches."""
    factor = spec.patch_size * spec.merge_size
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return (h // spec.patch_size) * (w // spec.patch_size) // spec.merge_size**2


@dataclass(frozen=True)
class AdmittedImage:
    """One image as a request may carry it: its format, its bytes as base64 (as the event log
    records them), its size and the tokens it becomes."""

    format: str
    data: str
    width: int
    height: int
    tokens: int


def admit_image(
    where: str,
    data: bytes | str,
    fmt: str,
    expected_tokens: int | None,
    spec: VisionSpec | None,
    model: str,
) -> AdmittedImage:
    """`data` (bytes, or base64 as the JSON wire sends them) admitted as an image for `model`.

    Raises ValidationError, prefixed with `where`, for a model without a vision tower (`spec`
    None), a format other than jpeg or png, bytes that are not one or do not decode, an image
    past the size limits or too elongated, or an `expected_tokens` other than what the image
    becomes."""
    if spec is None:
        raise ValidationError(
            f"{where}: an image chunk was sent to {model}, a text-only model; send images to a "
            "vision-language base model (GET /api/v1/treadle/base_models lists which take "
            "images), or send text"
        )
    if fmt not in FORMATS:
        raise ValidationError(f"{where}: image format {fmt!r} is not one of {list(FORMATS)}")
    raw = _bytes(where, data)
    if len(raw) > MAX_IMAGE_BYTES:
        raise ValidationError(
            f"{where}: the image is {len(raw)} bytes; send at most {MAX_IMAGE_BYTES} (resize it)"
        )
    width, height = _decoded_size(where, raw, fmt)
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise ValidationError(
            f"{where}: the image is {width}x{height} pixels; its longer side may be at most "
            f"{MAX_ASPECT} times its shorter (crop or pad it)"
        )
    tokens = image_tokens(spec, width, height)
    if expected_tokens is not None and expected_tokens != tokens:
        raise ValidationError(
            f"{where}: expected_tokens is {expected_tokens}, but a {width}x{height} image is "
            f"{tokens} tokens for {model} (patch {spec.patch_size}, merge {spec.merge_size}, "
            f"{spec.min_pixels}..{spec.max_pixels} pixels); compute it with the model's own "
            "image processor, or leave it unset"
        )
    return AdmittedImage(fmt, base64.b64encode(raw).decode("ascii"), width, height, tokens)


def _bytes(where: str, data: bytes | str) -> bytes:
    if isinstance(data, bytes):
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError(f"{where}: the image's data is not valid base64") from None


def _decoded_size(where: str, raw: bytes, fmt: str) -> tuple[int, int]:
    """The image's width and height, after decoding it whole (a truncated file is refused here,
    not on the worker)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw), formats=[fmt.upper()]) as image:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise ValidationError(
                        f"{where}: the image is {width}x{height} pixels; send at most "
                        f"{MAX_IMAGE_PIXELS} pixels (resize it)"
                    )
                image.load()
    except ValidationError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Warning) as exc:
        raise ValidationError(
            f"{where}: the data is not a {fmt} image that decodes ({exc}); send the file's bytes"
        ) from None
    return width, height


def place_images(
    where: str, tokens: list[int], images: list[dict[str, Any]], spec: VisionSpec | None, model: str
) -> tuple[list[int], list[dict[str, Any]]]:
    """`tokens` with each image's placeholders (`IMAGE_PLACEHOLDER`, from `at` for its
    `expected_tokens`; None: as many as it becomes) made the model's image token, and the
    images as the event log records them: {at, tokens, format, data (base64)}. An image sent
    without `expected_tokens` has no placeholders in `tokens` (its `at` is where it goes).

    Raises ValidationError for an image `admit_image` refuses, and for text that holds the
    model's image token itself (only an image chunk may: the model would find more image
    positions than images)."""
    if not images and spec is None:  # a text-only model's text: nothing to place or check
        return tokens, []
    out: list[int] = []
    placed: list[dict[str, Any]] = []
    done = 0
    for n, image in enumerate(images):
        at, expected = int(image["at"]), image.get("expected_tokens")
        admitted = admit_image(
            f"{where}: image {n}", image["data"], str(image["format"]), expected, spec, model
        )
        assert spec is not None  # admit_image refused a model without a vision tower
        out += tokens[done:at]
        placed.append(
            {"at": len(out), "tokens": admitted.tokens, "format": admitted.format,
             "data": admitted.data}
        )  # fmt: skip
        out += [spec.image_token_id] * admitted.tokens
        done = at + (0 if expected is None else int(expected))  # its placeholders
    out += tokens[done:]
    if spec is not None and out.count(spec.image_token_id) != sum(p["tokens"] for p in placed):
        raise ValidationError(
            f"{where}: its text holds {model}'s image token ({spec.image_token_id}); that token "
            "stands only for an image's pixels: send the image as an image chunk"
        )
    return out, placed
