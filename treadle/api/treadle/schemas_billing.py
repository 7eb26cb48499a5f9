"""Request bodies and query strings of Treadle's billing routes (`routes_billing`), as pydantic
models parsed with `body.parse`: a failure is a 400 naming the field. Money arrives as USD
(numbers or decimal strings) and becomes integer micro-dollars in the platform; times are ISO
8601, UTC unless they carry an offset (`body.Time`).
Imports platform only; never torch.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator

from treadle.api.body import Body, Id, Time
from treadle.platform.models.validation import MAX_ID_LENGTH

MAX_USD = Decimal(10**12)  # a monthly budget; far beyond any real one, far inside a BIGINT
MAX_SESSIONS = 2**31 - 1  # the column is a 32-bit integer
MAX_TOKENS = 2**62 - 1
_MONTH = re.compile(r"^(\d{4})-(\d{2})$")


def _month(value: Any) -> tuple[int, int]:
    match = _MONTH.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a month; write YYYY-MM, e.g. 2026-11")
    year, month = int(match[1]), int(match[2])
    if not (1 <= month <= 12 and 2000 <= year <= 9998):
        raise ValueError(f"{value!r} is not a month from 2000-01 to 9998-12; write YYYY-MM")
    return year, month


Month = Annotated[tuple[int, int], BeforeValidator(_month)]
Usd = Annotated[Decimal, Field(ge=0, le=MAX_USD, allow_inf_nan=False)]
# Checked and converted by `prices.to_micro`, whose messages name the class and the rule.
UsdPerMillion = Annotated[str | float, Field(union_mode="left_to_right")]


class SetPrices(Body):
    """New prices of one base model, in USD per million tokens, from `effective_from` (now when
    omitted; never in the past). Classes left out keep their prices."""

    base_model: Id = Field(min_length=1)
    prefill: UsdPerMillion | None = None
    sample: UsdPerMillion | None = None
    train: UsdPerMillion | None = None
    effective_from: Time | None = None


class SetQuota(Body):
    """A tenant's limits: a field sent is set (null removes that limit), a field left out keeps
    its value."""

    monthly_usd: Usd | None = None
    monthly_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    max_sessions: int | None = Field(None, ge=0, le=MAX_SESSIONS)
    requests_per_second: float | None = Field(None, gt=0, le=1e6)
    max_request_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)


class UsageQuery(Body):
    """GET usage: a window (`month`, or `since`/`until`; the current UTC month by default),
    grouping, and the tenant (the operator's: any id, or '*' for every tenant)."""

    tenant: str | None = Field(None, min_length=1, max_length=MAX_ID_LENGTH)
    month: Month | None = None
    since: Time | None = None
    until: Time | None = None
    by: tuple[str, ...] = ()

    @field_validator("by", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value


class BillQuery(Body):
    tenant: str | None = Field(None, min_length=1, max_length=MAX_ID_LENGTH)
    month: Month | None = None
