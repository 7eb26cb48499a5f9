"""Prices: USD per million tokens, per base model and token class, versioned by effective time.

A price takes effect at its `effective_from` and holds until a later one of the same model and
class takes effect: a change applies from then on, never to usage already recorded. Money is
integer micro-dollars everywhere (a price is micro-dollars per million tokens); an operation's
cost per class is `tokens x price / 1e6`, rounded half up to a whole micro-dollar. A model and
class with no price in effect costs 0 and is marked unpriced on the ledger and the bill. Only the
operator sets prices (API, CLI); defaults come from a TOML file (`load_defaults`).
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import distinct_on

from treadle.platform.errors import ValidationError
from treadle.platform.eventlog.schema import prices
from treadle.platform.tenancy.tenants import Principal, require_operator

TOKEN_CLASSES = ("prefill", "sample", "train")
MICRO = 1_000_000
# Far beyond any real price, small enough that tokens x price never nears 2**63.
MAX_USD_PER_MILLION = Decimal(1_000_000)
DEFAULT_PRICES_FILE = Path(__file__).with_name("default_prices.toml")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Price:
    base_model: str
    token_class: str
    micro_usd_per_million: int
    effective_from: datetime
    created_by: str | None

    @property
    def usd_per_million(self) -> Decimal:
        return Decimal(self.micro_usd_per_million) / MICRO

    def to_json(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "token_class": self.token_class,
            "usd_per_million": str(self.usd_per_million),
            "effective_from": self.effective_from.isoformat(),
            "created_by": self.created_by,
        }


def cost_micro_usd(tokens: int, micro_usd_per_million: int | None) -> int:
    """The cost of `tokens` at a price, in micro-dollars, rounded half up (0 when unpriced)."""
    if micro_usd_per_million is None or tokens <= 0:
        return 0
    return (tokens * micro_usd_per_million + MICRO // 2) // MICRO


def to_micro(usd_per_million: str | float | Decimal, what: str) -> int:
    """A price in USD per million tokens as integer micro-dollars per million; ValidationError
    for anything negative, not finite, too large, or finer than a micro-dollar."""
    try:
        value = Decimal(str(usd_per_million))
    except InvalidOperation:
        raise ValidationError(f"{what} must be a number of USD per million tokens") from None
    if not value.is_finite() or value < 0 or value > MAX_USD_PER_MILLION:
        raise ValidationError(
            f"{what} is {usd_per_million}; give USD per million tokens between 0 and "
            f"{MAX_USD_PER_MILLION}"
        )
    micro = value * MICRO
    if micro != micro.to_integral_value():
        raise ValidationError(f"{what} is {usd_per_million}; use at most 6 decimal places")
    return int(micro)


def usd_to_micro(usd: str | float | Decimal, what: str) -> int:
    """An amount of USD as integer micro-dollars (rounded to the nearest); ValidationError for
    a negative or non-finite amount."""
    try:
        value = Decimal(str(usd))
    except InvalidOperation:
        raise ValidationError(f"{what} must be a number of USD") from None
    if not value.is_finite() or value < 0:
        raise ValidationError(f"{what} is {usd}; give 0 or more USD")
    return int((value * MICRO).to_integral_value())


def set_price(
    conn: sa.Connection,
    principal: Principal,
    *,
    base_model: str,
    token_class: str,
    usd_per_million: str | float | Decimal,
    effective_from: datetime | None = None,
) -> Price:
    """Record a price that takes effect at `effective_from` (now when None). Operator only.
    A time in the past is refused: a price never applies to usage already recorded."""
    require_operator(principal, "setting prices")
    if token_class not in TOKEN_CLASSES:
        raise ValidationError(
            f"token class {token_class!r} is unknown; use one of {', '.join(TOKEN_CLASSES)}"
        )
    micro = to_micro(usd_per_million, f"the {token_class} price")
    now = conn.execute(sa.select(sa.func.now())).scalar_one()
    when = now if effective_from is None else effective_from
    if when.tzinfo is None:
        raise ValidationError("effective_from needs a time zone (e.g. 2026-12-01T00:00:00Z)")
    if when < now:
        raise ValidationError(
            f"effective_from {when.isoformat()} is in the past; a price applies from now on, "
            "never to usage already recorded"
        )
    conn.execute(
        prices.insert().values(
            base_model=base_model,
            token_class=token_class,
            micro_usd_per_million=micro,
            effective_from=when,
            created_by=principal.key_id,
        )
    )
    return Price(base_model, token_class, micro, when, principal.key_id)


# Each read is one statement answering one JSON object (micro-USD per million by token class),
# built for a base model that is either bound at execution (`in_effect`, `highest_from_now`) or
# a column of an enclosing statement that reads the prices along with other things (the
# admission's first read, the settlement's first statement).


def _in_effect_rows(base_model: sa.ColumnElement[Any]) -> sa.Select[Any]:
    return (
        sa.select(prices.c.token_class, prices.c.micro_usd_per_million)
        .ext(distinct_on(prices.c.token_class))
        .where(prices.c.base_model == base_model, prices.c.effective_from <= sa.func.now())
        .order_by(prices.c.token_class, prices.c.effective_from.desc(), prices.c.id.desc())
        .correlate_except(prices)
    )


def _as_json(rows: sa.Subquery) -> sa.ScalarSelect[Any]:
    return sa.select(
        sa.func.json_object_agg(rows.c.token_class, rows.c.micro_usd_per_million)
    ).scalar_subquery()


def in_effect_json(base_model: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
    """The prices in effect now of `base_model` (NULL when there is none; `from_json` reads
    it)."""
    return _as_json(_in_effect_rows(base_model).subquery("in_effect"))


def highest_from_now_json(base_model: sa.ColumnElement[Any]) -> sa.ScalarSelect[Any]:
    """Per class, the highest price of `base_model` in effect now or scheduled later (NULL when
    there is none; `highest_from_json` reads it)."""
    later = (
        sa.select(prices.c.token_class, prices.c.micro_usd_per_million)
        .where(prices.c.base_model == base_model, prices.c.effective_from > sa.func.now())
        .correlate_except(prices)
    )
    both = sa.union_all(_in_effect_rows(base_model).subquery().select(), later).subquery("both")
    highest = (
        sa.select(
            both.c.token_class,
            sa.func.max(both.c.micro_usd_per_million).label("micro_usd_per_million"),
        )
        .group_by(both.c.token_class)
        .subquery("highest")
    )
    return _as_json(highest)


_IN_EFFECT = sa.select(in_effect_json(sa.bindparam("base_model")))
_HIGHEST_FROM_NOW = sa.select(highest_from_now_json(sa.bindparam("base_model")))


def from_json(found: dict[str, int | None] | None) -> dict[str, int | None]:
    """`in_effect_json`'s object as `in_effect` answers."""
    return {c: (found or {}).get(c) for c in TOKEN_CLASSES}


def highest_from_json(found: dict[str, int | None] | None) -> dict[str, int]:
    """`highest_from_now_json`'s object as `highest_from_now` answers."""
    return {c: (found or {}).get(c) or 0 for c in TOKEN_CLASSES}


def in_effect(conn: sa.Connection, base_model: str) -> dict[str, int | None]:
    """Each token class's price (micro-USD per million) in effect now; None when unpriced."""
    return from_json(conn.execute(_IN_EFFECT, {"base_model": base_model}).scalar())


def highest_from_now(conn: sa.Connection, base_model: str) -> dict[str, int]:
    """Per class, the highest price in effect now or scheduled later: what an admitted operation
    is reserved at, so a price that takes effect before it completes cannot push it past a
    budget. One query."""
    return highest_from_json(conn.execute(_HIGHEST_FROM_NOW, {"base_model": base_model}).scalar())


def list_prices(conn: sa.Connection, base_model: str | None = None) -> list[Price]:
    """Every price version, oldest first (of one base model if given)."""
    query = sa.select(prices).order_by(
        prices.c.base_model, prices.c.token_class, prices.c.effective_from, prices.c.id
    )
    if base_model is not None:
        query = query.where(prices.c.base_model == base_model)
    return [
        Price(r.base_model, r.token_class, r.micro_usd_per_million, r.effective_from, r.created_by)
        for r in conn.execute(query)
    ]


def load_defaults(conn: sa.Connection, path: Path = DEFAULT_PRICES_FILE) -> int:
    """Seed prices from a TOML file (`["<base model>"]` tables of `prefill`, `sample`, `train` in
    USD per million tokens) for every model and class that has no price yet, in effect since
    1970. Returns how many were added. Safe to run at every start."""
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read the price file {path}: {exc}") from exc
    added = 0
    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(727171)))  # one seeder at a time
    for base_model, classes in table.items():
        if not isinstance(classes, dict):
            raise ValueError(f"{path}: [{base_model!r}] must be a table of token class prices")
        for token_class, usd in classes.items():
            if token_class not in TOKEN_CLASSES:
                raise ValueError(f"{path}: {base_model}.{token_class} is not a token class")
            exists = conn.execute(
                sa.select(prices.c.id)
                .where(prices.c.base_model == base_model, prices.c.token_class == token_class)
                .limit(1)
            ).first()
            if exists is None:
                conn.execute(
                    prices.insert().values(
                        base_model=base_model,
                        token_class=token_class,
                        micro_usd_per_million=to_micro(usd, f"{base_model}.{token_class}"),
                        effective_from=EPOCH,
                        created_by=None,
                    )
                )
                added += 1
    return added
