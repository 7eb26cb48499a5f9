"""Query strings of the Tinker protocol's billing routes (`routes_tinker_billing`), as pydantic
models parsed with `body.parse`: a failure is a 400 naming the field. Times are ISO 8601, UTC
unless they carry an offset. Imports platform only; never torch.
"""

from __future__ import annotations

from pydantic import Field

from treadle.api.body import Body, Time
from treadle.platform.models.validation import MAX_ID_LENGTH


class BillingUsageQuery(Body):
    """The Tinker SDK's GetBillingUsageRequest, as query parameters."""

    starting_on: Time
    ending_before: Time


class StorageQuery(Body):
    """The Tinker SDK's GetCurrentCheckpointStorageUsageRequest; Treadle has no projects, so a
    project id matches nothing but the tenant's own storage."""

    project_id: str | None = Field(None, max_length=MAX_ID_LENGTH)
