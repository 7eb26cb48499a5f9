"""Request bodies of the model registry's routes (`routes_models`), as pydantic models parsed
with `body.parse` (unknown fields are ignored; a failure is a 400 naming the field).
Imports platform only; never torch.
"""

from __future__ import annotations

from pydantic import Field

from treadle.api.body import Body
from treadle.platform.models.catalog import LORA_CATEGORIES
from treadle.platform.models.model_files import DTYPES


class RegisterModel(Body):
    """A base model to register: a local folder (`path`) or a hub id at a pinned revision in
    the hosts' Hugging Face cache, plus what the operator sets."""

    name: str = Field(min_length=3, max_length=193)
    path: str | None = Field(None, min_length=1, max_length=4096)
    hub_id: str | None = Field(None, min_length=3, max_length=193)
    revision: str | None = Field(None, min_length=1, max_length=255)
    gguf_file: str | None = Field(None, min_length=1, max_length=255)  # a GGUF file in `path`
    description: str | None = Field(None, min_length=1, max_length=1000)
    dtype: str = Field("auto", json_schema_extra={"enum": list(DTYPES)})
    max_lora_rank: int = Field(128, ge=1, le=1024)
    lora_targets: list[str] = Field(
        default_factory=lambda: list(LORA_CATEGORIES),
        min_length=1,
        max_length=3,
        json_schema_extra={"items": {"enum": list(LORA_CATEGORIES)}},
    )
    max_context_length: int | None = Field(None, ge=1, le=2**24)
    # USD per million tokens by token class (prefill, sample, train), from now on
    prices: dict[str, float] | None = None
