"""Treadle: you write the loop; Treadle turns the wheel.

This package's top level is the SDK's public names only; the client needs no server dependency.
"""

from treadle.client import (
    AdamParams,
    ConfigurationError,
    Datum,
    ModelInput,
    SamplingClient,
    SamplingParams,
    ServiceClient,
    TensorData,
    TrainingClient,
)

__all__ = [
    "AdamParams",
    "ConfigurationError",
    "Datum",
    "ModelInput",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "TensorData",
    "TrainingClient",
]
