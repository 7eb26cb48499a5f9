"""tinker-cookbook recipes, unmodified, against Treadle: teach the cookbook Treadle's models.

The cookbook refuses a model its own table (`tinker_cookbook.model_info`) does not list, before
any request ("ConfigurationError: Unknown model"), and loads tokenizers from the hub. `register()`
adds Treadle's catalogue models to the cookbook: their attributes and recommended renderer, a
renderer for SmolLM2's chat template (ChatML, token for token), and tokenizers fetched from the
platform (`GET /api/v1/treadle/tokenizer`), so no hub access is needed; and the vision-language
models the platform serves, with their image processors (recipes such as vlm_classifier). The runner registers,
then runs a recipe's module as `__main__` with the remaining arguments
(docs/tinker-compatibility.md, "Cookbook"):

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... \\
    python -m treadle.cookbook tinker_cookbook.recipes.math_rl.train \\
        env=arithmetic model_name=HuggingFaceTB/SmolLM2-135M-Instruct max_steps=5

The cookbook has registries for renderers and tokenizers but none for model attributes, so
`register()` wraps `tinker_cookbook.model_info.get_model_attributes` (every cookbook lookup goes
through it); tests/compat/test_cookbook.py fails loudly if the pinned cookbook changes that.
Client side: imports treadle.client and tinker_cookbook (a dev extra), never server code
(treadle.platform, treadle.api, treadle.engine, treadle.worker, flask, sqlalchemy, celery).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx

from treadle.client.service import turn_off_sdk_telemetry
from treadle.client.tokenizer import fetch_image_processor, fetch_tokenizer

try:
    import tinker
    from tinker_cookbook import image_processing_utils, model_info, renderers, tokenizer_utils
    from tinker_cookbook.renderers.base import (
        Message,
        ParseTermination,
        RenderContext,
        RenderedMessage,
        Renderer,
        ensure_text,
        parse_response_for_stop_token,
    )
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    raise ModuleNotFoundError(
        f"treadle.cookbook needs tinker-cookbook ({exc.name} is missing); install it with "
        "`pip install 'treadle[cookbook]'` and then `pip install --no-deps "
        'tinker-cookbook==0.6.1` (docs/tinker-compatibility.md, "Cookbook")'
    ) from exc

__all__ = [
    "MODELS",
    "SMOLLM2_RENDERER",
    "SmolLM2Renderer",
    "TreadleModel",
    "main",
    "register",
]

SMOLLM2_RENDERER = "treadle/smollm2"
# The cookbook's renderers for the vision-language families Treadle serves, by model_type.
VISION_RENDERERS = {"qwen3_vl": ("qwen3_vl_instruct", "qwen3_vl")}
USAGE = (
    "usage: python -m treadle.cookbook <recipe module> [recipe arguments ...]\n"
    "  e.g. python -m treadle.cookbook tinker_cookbook.recipes.math_rl.train env=arithmetic "
    "model_name=HuggingFaceTB/SmolLM2-135M-Instruct\n"
    "  with TINKER_BASE_URL (Treadle's URL) and TINKER_API_KEY (a tml- key) set"
)


@dataclass(frozen=True)
class TreadleModel:
    """What the cookbook needs to know of one of Treadle's base models."""

    name: str
    attributes: model_info.ModelAttributes


# Treadle's catalogue (GET /api/v1/treadle/base_models); a test checks they agree.
MODELS: tuple[TreadleModel, ...] = (
    TreadleModel(
        "treadle/tiny-debug",
        model_info.ModelAttributes(
            organization="treadle",
            version_str="0",
            size_str="0.1M",
            is_chat=True,  # random weights, but SmolLM2's tokenizer and chat template
            recommended_renderers=(SMOLLM2_RENDERER, "role_colon"),
        ),
    ),
    TreadleModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        model_info.ModelAttributes(
            organization="HuggingFaceTB",
            version_str="2",
            size_str="135M",
            is_chat=True,
            recommended_renderers=(SMOLLM2_RENDERER, "role_colon"),
        ),
    ),
)


class SmolLM2Renderer(Renderer):
    """SmolLM2-Instruct's chat template (ChatML), token for token:

        <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n...

    with the template's default system message when a conversation starts without one. As in
    the cookbook's other ChatML renderers, a turn's output ends at `<|im_end|>` (the token the
    sampler stops at) and the newline after it opens the next header, so sampled turns extend
    the prompt exactly. Text only: no tools, no images.
    """

    DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    END = "<|im_end|>"

    @property
    def has_extension_property(self) -> bool:
        return True  # nothing is ever stripped from the history

    def render_message(self, message: Message, ctx: RenderContext) -> RenderedMessage:
        content = ensure_text(message["content"])
        header = "\n" if ctx.idx > 0 else ""
        if ctx.idx == 0 and message["role"] != "system":
            header += f"<|im_start|>system\n{self.DEFAULT_SYSTEM}{self.END}\n"
        header += f"<|im_start|>{message['role']}\n"
        return RenderedMessage(
            header=tinker.EncodedTextChunk(tokens=self._encode(header)),
            output=[tinker.EncodedTextChunk(tokens=self._encode(content + self.END))],
        )

    def get_stop_sequences(self) -> list[int]:
        return [self._end_token]

    def parse_response(self, response: list[int]) -> tuple[Message, ParseTermination]:
        return parse_response_for_stop_token(response, self.tokenizer, self._end_token)

    @property
    def _end_token(self) -> int:
        return self._encode(self.END)[0]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def register(base_url: str | None, api_key: str | None) -> None:
    """Teach tinker-cookbook Treadle's models (idempotent).

    Args:
        base_url: Treadle's URL, where tokenizers are fetched from (TINKER_BASE_URL).
        api_key: A Treadle key (tml-...) to fetch them with (TINKER_API_KEY).

    Raises nothing when either is missing: the first tokenizer load says what to set.

    Example:
        register("http://127.0.0.1:8000", "tml-...")
        get_recommended_renderer_name("HuggingFaceTB/SmolLM2-135M-Instruct")  # "treadle/smollm2"
    """
    renderers.register_renderer(SMOLLM2_RENDERER, lambda tokenizer, _: SmolLM2Renderer(tokenizer))
    for model in MODELS:
        tokenizer_utils.register_tokenizer(
            model.name, _tokenizer_factory(base_url, api_key, model.name)
        )
    _add_model_attributes({m.name: m.attributes for m in MODELS})
    _add_vision_models(base_url, api_key)


def _add_vision_models(base_url: str | None, api_key: str | None) -> None:
    """The vision-language models the platform serves (GET /api/v1/treadle/base_models): their
    tokenizers and image processors fetched from it (`preprocessor_config.json` comes with the
    tokenizer's files), and for a name the cookbook's table does not know, its attributes
    (`is_vl`, the cookbook's renderer for its family). Nothing where the platform cannot be
    asked: the recipe's first request then says what is wrong."""
    if not base_url or not api_key:
        return
    try:
        response = httpx.get(
            f"{base_url.rstrip('/')}/api/v1/treadle/base_models",
            headers={"X-API-Key": api_key},
            timeout=30,
        )
        response.raise_for_status()
        served = response.json()["base_models"]
    except (httpx.HTTPError, ValueError, KeyError):
        return
    vision = {
        m["name"]: m for m in served if m.get("vision") and m.get("model_type") in VISION_RENDERERS
    }
    known: dict[str, model_info.ModelAttributes] = {}
    for name, entry in vision.items():
        tokenizer_utils.register_tokenizer(name, _tokenizer_factory(base_url, api_key, name))
        try:
            model_info.get_model_attributes(name)
        except Exception:  # noqa: BLE001 - the cookbook raises its own ConfigurationError
            organization, _, short = name.rpartition("/")
            known[name] = model_info.ModelAttributes(
                organization=organization or "treadle",
                version_str="",
                size_str=short,
                is_chat=True,
                recommended_renderers=VISION_RENDERERS[entry["model_type"]],
                is_vl=True,
            )
    _add_model_attributes(known)
    _serve_image_processors(base_url, api_key, set(vision))


def _serve_image_processors(base_url: str, api_key: str, names: set[str]) -> None:
    """Make `image_processing_utils.get_image_processor` fetch `names`' processors from the
    platform (the cookbook loads them from the hub), and answer as before for the rest."""
    current = image_processing_utils.get_image_processor
    served: set[str] | None = getattr(current, "treadle_models", None)
    if served is not None:  # registered before: extend the set, do not wrap twice
        served.update(names)
        return

    @cache
    def get_image_processor(model_name: str) -> Any:
        name = model_name.split(":", 1)[0]
        if name in table:
            return fetch_image_processor(base_url.rstrip("/"), api_key, name)
        return current(model_name)

    table = set(names)
    get_image_processor.treadle_models = table  # type: ignore[attr-defined]
    image_processing_utils.get_image_processor = get_image_processor


def _tokenizer_factory(
    base_url: str | None, api_key: str | None, base_model: str
) -> Callable[[], Any]:
    @cache
    def load() -> Any:
        if not base_url or not api_key:
            raise RuntimeError(
                f"cannot load the tokenizer of {base_model}: set TINKER_BASE_URL to Treadle's URL "
                "and TINKER_API_KEY to a Treadle key (tml-...), or pass them to "
                "treadle.cookbook.register(base_url, api_key)"
            )
        return fetch_tokenizer(base_url.rstrip("/"), api_key, base_model)

    return load


def _add_model_attributes(models: dict[str, model_info.ModelAttributes]) -> None:
    """Make `model_info.get_model_attributes` answer for `models` first, then as before."""
    current = model_info.get_model_attributes
    known: dict[str, model_info.ModelAttributes] | None = getattr(current, "treadle_models", None)
    if known is not None:  # registered before: extend the table, do not wrap twice
        known.update(models)
        return
    table = dict(models)

    def get_model_attributes(model_name: str) -> model_info.ModelAttributes:
        found = table.get(model_name.split(":", 1)[0])
        return found if found is not None else current(model_name)

    get_model_attributes.treadle_models = table  # type: ignore[attr-defined]
    get_model_attributes.__doc__ = current.__doc__
    model_info.get_model_attributes = get_model_attributes


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m treadle.cookbook <recipe module> [args]`: register, then run the recipe's
    module as `__main__` with `args` as its command line. The SDK's telemetry is off unless
    TINKER_TELEMETRY is set (treadle.client.service.turn_off_sdk_telemetry)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if args else 2)
    module, recipe_args = args[0], args[1:]
    turn_off_sdk_telemetry()  # before the recipe makes its ServiceClient
    register(os.environ.get("TINKER_BASE_URL"), os.environ.get("TINKER_API_KEY"))
    sys.argv = [module, *recipe_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
