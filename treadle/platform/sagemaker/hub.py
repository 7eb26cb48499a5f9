"""SageMaker's Public Hub as Treadle serves it: the registered, unretired base models.

Each model is Hub content `Model` of hub `SageMakerPublicHub`, named as `arns.hub_content_name`
says, version 1.0.0, with the keywords the SageMaker SDK looks for
(`@capability:training_session`, `@huggingface-id:<registry name>`) and a document whose
`HuggingfaceId` is the registry name: the id `list_base_models()` reports, that
`create_lora_training_client` resolves back and that `get_tokenizer()` loads (Treadle's
hub-compatible `/hf` serves every model's tokenizer under its name). Retired models are not
listed and not resolved for new sessions. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from treadle.platform.errors import NotFoundError
from treadle.platform.models.catalog import BaseModelInfo
from treadle.platform.models.registry import RegisteredModel
from treadle.platform.sagemaker import arns

CAPABILITY_KEYWORD = "@capability:training_session"
ID_KEYWORD = "@huggingface-id:"
DOCUMENT_SCHEMA_VERSION = "2.0.0"
CONTENT_TYPE = "Model"


def check_hub(hub: str) -> None:
    """Only the public hub exists: by name or by its ARN."""
    name = hub.rsplit("/", 1)[-1] if hub.startswith("arn:") else hub
    if name != arns.HUB_NAME:
        raise NotFoundError(
            f"hub {hub!r} not found; this server serves the base models of hub {arns.HUB_NAME} only"
        )


def find(
    models: Sequence[RegisteredModel], content_name: str, version: str | None
) -> BaseModelInfo:
    """The unretired model whose Hub content name is `content_name` (NotFoundError otherwise)."""
    for model in models:
        if not model.is_retired and arns.hub_content_name(model.info.name) == content_name:
            if version not in (None, arns.HUB_CONTENT_VERSION):
                raise NotFoundError(
                    f"Hub content {content_name} has no version {version}; its only version is "
                    f"{arns.HUB_CONTENT_VERSION}"
                )
            return model.info
    raise NotFoundError(
        f"Hub content {content_name!r} not found in {arns.HUB_NAME}; ListHubContents lists the "
        "base models this server serves"
    )


def listed(models: Sequence[RegisteredModel]) -> list[RegisteredModel]:
    """The models the Hub lists: unretired, in name order."""
    return sorted((m for m in models if not m.is_retired), key=lambda m: m.info.name.lower())


def summary(model: RegisteredModel, region: str) -> dict[str, Any]:
    """A model's HubContentInfo."""
    info = model.info
    name = arns.hub_content_name(info.name)
    return {
        "HubContentName": name,
        "HubContentArn": arns.hub_content_arn(region, name),
        "HubContentVersion": arns.HUB_CONTENT_VERSION,
        "HubContentType": CONTENT_TYPE,
        "DocumentSchemaVersion": DOCUMENT_SCHEMA_VERSION,
        "HubContentDisplayName": info.name,
        "HubContentDescription": f"{info.name} ({info.model_type}), a base model of this server",
        "HubContentSearchKeywords": [CAPABILITY_KEYWORD, f"{ID_KEYWORD}{info.name}"],
        "HubContentStatus": "Available",
        "CreationTime": _epoch(model.created_at),
    }


def description(model: RegisteredModel, region: str) -> dict[str, Any]:
    """A model's DescribeHubContent answer."""
    info = model.info
    document = {
        "HuggingfaceId": info.name,
        "ModelType": info.model_type,
        "MaxContextLength": info.max_context_length,
        "VocabSize": info.vocab_size,
    }
    answer = summary(model, region)
    answer.update(
        HubName=arns.HUB_NAME,
        HubArn=arns.hub_arn(region),
        HubContentDocument=json.dumps(document),
    )
    return answer


def _epoch(when: datetime | None) -> float:
    """Seconds since the epoch; a built-in model (no registration time) is 0."""
    return 0.0 if when is None else when.timestamp()
