"""What the metering tests share: a tenant of its own for each test (a member key, so budgets and
session slots are that test's alone), prices and quotas set as the operator sets them, a raw
Tinker-protocol client that controls seq_ids and sees every status code (the tinker SDK retries
429s), and readers of the usage ledger and the money counters.

Expected token counts and costs are computed here independently of the platform: tokens from the
request sent and the result received, money with Decimal rounded half up.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.conftest import Platform
from tests.integration.wire_client import WireClient
from treadle.platform.billing import prices, quotas
from treadle.platform.sessions import routing
from treadle.platform.tenancy import keys, tenants
from treadle.platform.tenancy.tenants import Principal

BASE_MODEL = "treadle/tiny-debug"
CLASSES = ("prefill", "sample", "train")
# USD per million tokens; some token counts cost a half micro-dollar, so rounding half up shows.
PRICES = {"prefill": "1.5", "sample": "2.25", "train": "3.125"}


def datum(length: int, first: int = 5) -> types.Datum:
    """A cross-entropy datum whose model_input has exactly `length` tokens."""
    ids = [(first + 7 * i) % 400 + 1 for i in range(length + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * length},
    )


def input_tokens(datums: list[types.Datum]) -> int:
    """Tokens of a forward(-backward) request, counted from what was sent."""
    return sum(len(d.model_input.to_ints()) for d in datums)


def hand_cost(tokens: int, usd_per_million: str) -> int:
    """Micro-dollars: tokens x USD per million tokens, rounded half up to a whole micro-dollar."""
    exact = Decimal(tokens) * Decimal(usd_per_million)
    return int(exact.quantize(Decimal(1), rounding=ROUND_HALF_UP))


def hand_bill(tokens: Mapping[str, int], usd: Mapping[str, str]) -> int:
    return sum(hand_cost(tokens.get(c, 0), usd[c]) for c in CLASSES)


def micro_per_million(usd: str) -> int:
    return int(Decimal(usd) * 1_000_000)


def wait_consumed(redis_url: str, session_id: str, timeout: float = 60) -> None:
    """Until no wake-up of the session waits in its queue or runs unacknowledged (the worker's
    solo pool acknowledges a message only after its task returned), three looks in a row: a
    message being moved from its queue to the unacknowledged set is briefly in neither."""
    client = redis.Redis.from_url(redis_url)
    queue = routing.session_queue(session_id)
    queues = [queue] + [f"{queue}\x06\x16{priority}" for priority in (3, 6, 9)]  # kombu's
    deadline = time.monotonic() + timeout
    quiet = 0
    try:
        while time.monotonic() < deadline:
            waiting = sum(client.llen(q) for q in queues)
            running = [v for v in client.hvals("unacked") if session_id.encode() in v]
            quiet = quiet + 1 if waiting == 0 and not running else 0
            if quiet == 3:
                return
            time.sleep(0.05)
    finally:
        client.close()
    raise AssertionError(f"the wake-ups of {session_id} were not consumed in {timeout:.0f} s")


class MeterClient(WireClient):
    """The raw client with the operations the metering tests send; remembers its client
    sessions so the test can finish them (their adapters leave the workers)."""

    def __init__(self, base_url: str, api_key: str) -> None:
        super().__init__(base_url, api_key)
        self.sessions: list[str] = []

    def new_session(self) -> str:
        session_id = str(self.post("create_session", {"tags": []}).json()["session_id"])
        self.sessions.append(session_id)
        return session_id

    def open_model(self, session_id: str, model_seq_id: int = 0) -> httpx.Response:
        return self.post(
            "create_model",
            {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE_MODEL,
             "lora_config": {"rank": 4, "seed": 0}},
        )  # fmt: skip

    def create_model(self, base_model: str = BASE_MODEL, rank: int = 4) -> str:
        answer = self.open_model(self.new_session())
        assert answer.status_code == 200, answer.text
        self.result(answer.json()["request_id"])
        return str(answer.json()["model_id"])

    def forward(self, model_id: str, seq_id: int, datums: list[types.Datum]) -> httpx.Response:
        """forward_backward with forward_only set, as the tinker SDK's `forward` sends it."""
        request = types.ForwardBackwardRequest(
            model_id=model_id,
            seq_id=seq_id,
            forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn="cross_entropy"),
        )
        message = forward_backward_request_to_proto(request)
        message.forward_only = True
        return self.http.post(
            "/api/v1/forward_backward",
            content=message.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )

    def sampler_for(self, model_id: str, seq_id: int, sampling_session_seq_id: int = 0) -> str:
        """save_weights_for_sampler; waits for it and returns the sampler's id."""
        answer = self.post(
            "save_weights_for_sampler",
            {"model_id": model_id, "seq_id": seq_id,
             "sampling_session_seq_id": sampling_session_seq_id},
        )  # fmt: skip
        return str(self.done(answer)["sampling_session_id"])

    def sample(
        self,
        sampler_id: str,
        seq_id: int,
        prompt: list[int],
        *,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        **params: Any,
    ) -> httpx.Response:
        return self.post(
            "asample",
            {"sampling_session_id": sampler_id, "seq_id": seq_id, "num_samples": num_samples,
             "prompt": {"chunks": [{"tokens": prompt}]}, "prompt_logprobs": prompt_logprobs,
             "sampling_params": params},
        )  # fmt: skip

    def stop(self, model_id: str) -> httpx.Response:
        return self.post(f"treadle/sessions/{model_id}/stop", {})

    def done(self, answer: httpx.Response) -> Any:
        """The result of an admitted operation (asserting it was admitted)."""
        assert answer.status_code == 200, answer.text
        return self.result(answer.json()["request_id"])

    def finish_all(self) -> None:
        for session_id in self.sessions:
            self.post(f"sessions/{session_id}/finish", {})
        self.http.close()


@dataclass
class Account:
    """A tenant of the test's own and a member key's client."""

    tenant_id: str
    key: str
    client: MeterClient


@dataclass
class Operator:
    """The operator's hand on one platform's database: prices, quotas, tenants; and the ledger."""

    db: sa.Engine
    base_url: str
    principal: Principal
    accounts: list[Account] = field(default_factory=list)

    @classmethod
    def of(cls, db: sa.Engine, base_url: str, admin_key: str) -> Operator:
        with db.connect() as conn:
            return cls(db, base_url, keys.authenticate(conn, admin_key))

    def new_account(self, label: str) -> Account:
        tenant_id = f"{label[:40]}-{secrets.token_hex(3)}".lower().replace("_", "-")
        with self.db.begin() as conn:
            _, key = keys.create_tenant_key(conn, tenant_id, tenants.Role.MEMBER)
        account = Account(tenant_id, key, MeterClient(self.base_url, key))
        self.accounts.append(account)
        return account

    def set_prices(self, usd: Mapping[str, str], effective_from: datetime | None = None) -> None:
        with self.db.begin() as conn:
            for token_class, price in usd.items():
                prices.set_price(
                    conn, self.principal, base_model=BASE_MODEL, token_class=token_class,
                    usd_per_million=price, effective_from=effective_from,
                )  # fmt: skip

    def set_quota(self, tenant_id: str, **limits: Any) -> None:
        with self.db.begin() as conn:
            quotas.set_quota(conn, self.principal, tenant_id, quotas.Quota(**limits))

    def assert_no_price_scheduled(self) -> None:
        """A precondition of exact budgets: reservations are taken at the highest price in effect
        or scheduled, so only with none scheduled do they equal what is charged."""
        with self.db.connect() as conn:
            assert prices.highest_from_now(conn, BASE_MODEL) == {
                c: p or 0 for c, p in prices.in_effect(conn, BASE_MODEL).items()
            }

    # --- reading the ledger and the counters ---------------------------------------------------

    def usage(self, tenant_id: str) -> dict[str, Any]:
        """The tenant's usage rows by request id."""
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT * FROM usage WHERE tenant_id = :t"), {"t": tenant_id}
            ).all()
        return {r.request_id: r for r in rows}

    def usage_counts(self, session_id: str) -> dict[str, int]:
        """Usage rows per request id of a session's operations."""
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT request_id, count(*) AS n FROM usage WHERE session_id = :s "
                    "GROUP BY request_id"
                ),
                {"s": session_id},
            ).all()
        return {r.request_id: int(r.n) for r in rows}

    def assert_one_row_per_completed_operation(self, session_id: str) -> None:
        """Every completed operation of the session has exactly one usage row, and nothing else
        has one (a failed or replayed operation is never billed)."""
        completed = [e["request_id"] for e in self.events(session_id, "OperationCompleted")]
        assert len(completed) == len(set(completed)), "an operation was settled twice"
        assert self.usage_counts(session_id) == dict.fromkeys(completed, 1)

    def events(self, session_id: str, event_type: str) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT data FROM events WHERE session_id = :s AND type = :t ORDER BY seq"),
                {"s": session_id, "t": event_type},
            ).all()
        return [dict(r.data) for r in rows]

    def month(self, tenant_id: str) -> tuple[int, int, int, int]:
        """(settled micro-USD, settled tokens, reserved micro-USD, reserved tokens) this month."""
        with self.db.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT settled_micro_usd, settled_tokens, reserved_micro_usd, "
                    "reserved_tokens FROM tenant_months WHERE tenant_id = :t AND month = "
                    "date_trunc('month', timezone('UTC', now()))::date"
                ),
                {"t": tenant_id},
            ).one()
        return tuple(row)  # type: ignore[return-value]

    def session_money(self, session_id: str) -> tuple[int, int]:
        """(spent, reserved) micro-USD of a session."""
        with self.db.connect() as conn:
            row = conn.execute(
                sa.text("SELECT spent_micro_usd, reserved_micro_usd FROM sessions WHERE id = :s"),
                {"s": session_id},
            ).one()
        return int(row.spent_micro_usd), int(row.reserved_micro_usd)

    def reservations(self, tenant_id: str) -> list[Any]:
        with self.db.connect() as conn:
            return list(
                conn.execute(
                    sa.text("SELECT * FROM reservations WHERE tenant_id = :t"), {"t": tenant_id}
                ).all()
            )

    def db_now(self) -> datetime:
        with self.db.connect() as conn:
            return conn.execute(sa.select(sa.func.now())).scalar_one()  # type: ignore[no-any-return]

    def next_month(self) -> str:
        """When this month's budgets reset, as the 402 body says it."""
        with self.db.connect() as conn:
            first = conn.execute(
                sa.text("SELECT (date_trunc('month', timezone('UTC', now())) + interval '1 month')")
            ).scalar_one()
        return f"{first:%Y-%m-%d}T00:00:00Z"

    def close(self) -> None:
        for account in self.accounts:
            account.client.finish_all()


@pytest.fixture(scope="module")
def operator(platform: Platform, engine: sa.Engine) -> Iterator[Operator]:
    """The operator of the served platform (tests/conftest.py's `platform`)."""
    op = Operator.of(engine, platform.base_url, platform.admin_key)
    yield op
    op.close()


@pytest.fixture
def account(operator: Operator, request: pytest.FixtureRequest) -> Account:
    """A fresh tenant with a member key, and the prices of PRICES in effect."""
    operator.set_prices(PRICES)
    return operator.new_account(request.node.name.split("[")[0].removeprefix("test_")[:30])
