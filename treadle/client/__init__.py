"""Treadle's SDK: a thin layer over the official tinker SDK (ServiceClient -> TrainingClient ->
SamplingClient) with SageMaker-style ergonomics: the names SageMaker's training-session SDK
exports for a training loop (`AdamParams`, `Datum`, `ModelInput`, `SamplingParams`,
`ServiceClient`, `TensorData`, `TensorDtype`) are all here, the tinker SDK's own types where
they take the same arguments. Imports nothing from the server side (no flask, sqlalchemy,
celery, torch).
"""

from tinker.types import AdamParams, Datum, ModelInput, SamplingParams

from treadle.client.refusals import QuotaExceededError
from treadle.client.sampling import SamplingClient
from treadle.client.service import ConfigurationError, ServiceClient
from treadle.client.training import TrainingClient
from treadle.client.types import TensorData, TensorDtype

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
