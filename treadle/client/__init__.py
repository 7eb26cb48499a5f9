"""Treadle's SDK: a thin layer over the official tinker SDK (ServiceClient -> TrainingClient ->
SamplingClient) with SageMaker-style ergonomics: the names SageMaker's training-session SDK
exports for a training loop (`AdamParams`, `Datum`, `ModelInput`, `SamplingParams`,
`ServiceClient`, `TensorData`, `TensorDtype`) are all here, the tinker SDK's own types where
they take the same arguments. Imports nothing from the server side (no flask, sqlalchemy,
celery, torch).

The names are loaded on first use, so a module of the package that needs no tinker SDK
(`tool_calls`, which the OpenAI-compatible serving shares) is imported without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AdamParams",
    "ConfigurationError",
    "Datum",
    "ModelInput",
    "QuotaExceededError",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TensorDtype",
    "TrainingClient",
]

if TYPE_CHECKING:
    from tinker.types import AdamParams, Datum, ModelInput, SamplingParams

    from treadle.client.refusals import QuotaExceededError
    from treadle.client.sampling import SamplingClient
    from treadle.client.service import ConfigurationError, ServiceClient
    from treadle.client.training import TrainingClient
    from treadle.client.types import TensorData, TensorDtype

_HOMES = {
    "AdamParams": "tinker.types",
    "Datum": "tinker.types",
    "ModelInput": "tinker.types",
    "SamplingParams": "tinker.types",
    "QuotaExceededError": "treadle.client.refusals",
    "SamplingClient": "treadle.client.sampling",
    "ConfigurationError": "treadle.client.service",
    "ServiceClient": "treadle.client.service",
    "TrainingClient": "treadle.client.training",
    "TensorData": "treadle.client.types",
    "TensorDtype": "treadle.client.types",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'treadle.client' has no attribute {name!r}")
