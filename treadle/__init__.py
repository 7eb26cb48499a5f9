"""Treadle: you write the loop; Treadle turns the wheel.

The top level holds the SDK's public names only, loaded on first use, so server processes that
import `treadle.platform` or `treadle.api` do not load the client. The client needs no server
dependency.
"""

from __future__ import annotations

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
    from treadle.client import (
        AdamParams,
        ConfigurationError,
        Datum,
        ModelInput,
        QuotaExceededError,
        SamplingClient,
        SamplingParams,
        ServiceClient,
        TensorData,
        TensorDtype,
        TrainingClient,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        import treadle.client

        return getattr(treadle.client, name)
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")
