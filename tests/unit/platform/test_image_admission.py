"""Image admission for vision-language models (platform/models/vision.py): the token count the
API computes without torch equals what the model's own image processor makes, images that
cannot run are refused with what to fix, and a Qwen3-VL folder registers with its image
geometry (a folder without its processor does not)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from tests import tiny_models, vision_models
from treadle.platform.errors import ValidationError
from treadle.platform.models import model_files
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.models.vision import (
    IMAGE_PLACEHOLDER,
    VisionSpec,
    admit_image,
    image_tokens,
    place_images,
)

SPEC = VisionSpec(
    image_token_id=402,
    vision_start_token_id=400,
    vision_end_token_id=401,
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=vision_models.MIN_PIXELS,
    max_pixels=vision_models.MAX_PIXELS,
)
SIZES = [(1, 1), (31, 33), (60, 80), (80, 60), (129, 7), (7, 129), (640, 480), (1000, 40),
         (32, 32), (47, 48), (4000, 3000), (16, 16), (250, 2)]  # fmt: skip


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_the_token_count_is_the_processors(width: int, height: int) -> None:
    processor = vision_models.processor()
    patches = processor.get_number_of_image_patches(height, width, images_kwargs={})  # type: ignore[attr-defined]
    assert image_tokens(SPEC, width, height) == patches // 4


def test_an_image_is_admitted_with_its_size_and_tokens() -> None:
    data = vision_models.image_bytes(60, 80)
    admitted = admit_image("datum 0", data, "jpeg", 4, SPEC, "m")
    assert (admitted.width, admitted.height, admitted.tokens) == (60, 80, 4)
    assert base64.b64decode(admitted.data) == data
    assert admit_image("p", admitted.data, "jpeg", None, SPEC, "m") == admitted  # base64 in


@pytest.mark.parametrize(
    ("data", "fmt", "expected", "spec", "message"),
    [
        (vision_models.image_bytes(60, 80), "jpeg", 16, None, "m, a text-only model"),
        (vision_models.image_bytes(60, 80), "gif", 16, SPEC, "format 'gif' is not one of"),
        (vision_models.image_bytes(60, 80), "jpeg", 5, SPEC, "expected_tokens is 5, but a 60x80"),
        (b"\xff\xd8\xff not a jpeg", "jpeg", None, SPEC, "not a jpeg image that decodes"),
        (vision_models.image_bytes(60, 80, fmt="PNG"), "jpeg", None, SPEC, "not a jpeg image"),
        (vision_models.image_bytes(60, 80)[:200], "jpeg", None, SPEC, "not a jpeg image"),
        (vision_models.image_bytes(2, 500), "jpeg", None, SPEC, "at most 200 times"),
        ("***", "jpeg", None, SPEC, "not valid base64"),
    ],
)
def test_images_that_cannot_run_are_refused(
    data: bytes | str, fmt: str, expected: int | None, spec: VisionSpec | None, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        admit_image("datum 0", data, fmt, expected, spec, "m")


def test_placeholders_become_the_image_token_and_images_are_placed() -> None:
    data = vision_models.image_bytes(60, 80)
    tokens = [1, 400, *[IMAGE_PLACEHOLDER] * 4, 401, 2, 400, 401]
    images = [
        {"at": 2, "format": "jpeg", "data": data, "expected_tokens": 4},
        {"at": 9, "format": "jpeg", "data": data, "expected_tokens": None},  # no placeholders
    ]
    out, placed = place_images("prompt", tokens, images, SPEC, "m")
    assert out == [1, 400, *[402] * 4, 401, 2, 400, *[402] * 4, 401]
    assert [(p["at"], p["tokens"]) for p in placed] == [(2, 4), (9, 4)]


def test_text_holding_the_image_token_is_refused() -> None:
    with pytest.raises(ValidationError, match="its text holds m's image token"):
        place_images("datum 1", [1, 402, 3], [], SPEC, "m")


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vision_models.vl_folder(tmp_path_factory.mktemp("qwen3-vl"))


def test_a_qwen3_vl_folder_registers_with_its_image_geometry(vl_folder: Path) -> None:
    info = model_files.inspect_folder("t/vl", vl_folder, model_files.Options())
    assert info.architecture == "Qwen3VLForConditionalGeneration"
    assert info.vision == SPEC
    assert BaseModelInfo.from_json(json.loads(json.dumps(info.to_json()))) == info


def test_a_vision_language_folder_without_its_processor_is_refused(
    vl_folder: Path, tmp_path: Path
) -> None:
    copy = Path(shutil.copytree(vl_folder, tmp_path / "copy"))
    (copy / "preprocessor_config.json").unlink()
    with pytest.raises(ValidationError, match="needs its image processor's preprocessor_config"):
        model_files.inspect_folder("t/vl", copy, model_files.Options())


def test_a_text_only_model_has_no_image_geometry(tmp_path: Path) -> None:
    folder = tiny_models.model_folder("qwen3", tmp_path / "qwen3")
    assert model_files.inspect_folder("t/q", folder, model_files.Options()).vision is None
