"""Treadle's SDK: a thin layer over the official tinker SDK (ServiceClient -> TrainingClient ->
SamplingClient) with SageMaker-style ergonomics. Imports nothing from the server side
(no flask, sqlalchemy, celery, torch).
"""

from tinker.types import AdamParams, Datum, ModelInput, SamplingParams, TensorData

from treadle.client.refusals import QuotaExceededError
from treadle.client.sampling import SamplingClient
from treadle.client.service import ConfigurationError, ServiceClient
from treadle.client.training import TrainingClient

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
    "TrainingClient",
]
