"""The event store and the schema, against a real PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from treadle.platform.eventlog import events
from treadle.platform.eventlog.optypes import ForwardBackward
from treadle.platform.eventlog.schema import metadata
from treadle.platform.operations import operations
from treadle.platform.sessions import leases, sessions
from treadle.platform.tenancy import tenants

pytestmark = pytest.mark.integration


@pytest.fixture
def session_id(quiet_engine: sa.Engine) -> str:
    with quiet_engine.begin() as conn:
        tenants.ensure_tenant(conn, "unit")
        principal = tenants.Principal("key-unit", "unit", "admin")
        client = sessions.create_client_session(conn, principal, [], {})
        sid = sessions.training_session_id(client, 0)
        sessions.create_session(
            conn,
            principal,
            session_id=sid,
            client_session_id=client,
            kind="training",
            base_model="treadle/tiny-debug",
        )
    return sid


def test_events_are_numbered_per_session(quiet_engine: sa.Engine, session_id: str) -> None:
    with quiet_engine.begin() as conn:
        events.append(conn, session_id, "unit", "SessionStopped", {"reason": "test"})
        stream = events.read_stream(conn, session_id)
    assert [e.seq for e in stream] == [1, 2]
    assert [e.type for e in stream] == ["SessionCreated", "SessionStopped"]


@pytest.mark.parametrize(
    "statement", ["UPDATE events SET type = 'X'", "DELETE FROM events", "TRUNCATE events"]
)
def test_database_refuses_changes_to_events(
    quiet_engine: sa.Engine, session_id: str, statement: str
) -> None:
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), quiet_engine.begin() as conn:
        conn.execute(sa.text(statement))
    with quiet_engine.connect() as conn:
        assert len(events.read_stream(conn, session_id)) == 1


def test_duplicate_session_seq_is_refused(quiet_engine: sa.Engine, session_id: str) -> None:
    with pytest.raises(sa.exc.IntegrityError), quiet_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO events (session_id, seq, type, data, tenant_id) "
                "VALUES (:s, 1, 'SessionStopped', '{}', 'unit')"
            ),
            {"s": session_id},
        )


def test_models_and_migrations_do_not_drift(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == []


def _forward() -> ForwardBackward:
    ints = {"dtype": "int64", "shape": [2], "data": [6, 7]}
    weights = {"dtype": "float32", "shape": [2], "data": [1.0, 1.0]}
    return ForwardBackward.model_validate(
        {
            "loss_fn": "cross_entropy",
            "loss_fn_config": {},
            "forward_only": True,
            "data": [
                {"tokens": [5, 6], "loss_fn_inputs": {"target_tokens": ints, "weights": weights}}
            ],
        }
    )


def test_settlement_is_fenced_advances_the_session_and_says_what_is_pending_after_it(
    quiet_engine: sa.Engine, session_id: str
) -> None:
    """The settlement's folded statements: the lease check, the outcome written once, the
    applied seq advanced with the outcome's event, and the next pending training seq_id."""
    principal = tenants.Principal("key-unit", "unit", "admin")
    with quiet_engine.begin() as conn:
        leases.heartbeat_worker(conn, "w-unit", {})
        assert leases.lease_session(conn, session_id, "w-unit", only_if_unleased=True)
        epoch = sessions.get_session(conn, None, session_id).lease_epoch
        admitted = [
            operations.admit(conn, principal, session_id, seq, _forward(), metering=False)
            for seq in (0, 1)
        ]
    with quiet_engine.connect() as conn:
        first, second = (operations.get_operation(conn, None, a.request_id) for a in admitted)

    def settle(op: operations.OperationRow, lease_epoch: int) -> operations.Settlement:
        with quiet_engine.begin() as conn:
            return operations.settle(
                conn, op, worker_id="w-unit", lease_epoch=lease_epoch,
                result={"ok": op.seq_id}, error=None, usage={},
            )  # fmt: skip

    with pytest.raises(leases.StaleLeaseError):
        settle(first, epoch + 1)
    with quiet_engine.connect() as conn:
        assert not operations.get_operation(conn, None, first.request_id).is_done
        assert sessions.get_session(conn, None, session_id).last_applied_seq == -1

    done = settle(first, epoch)
    assert (done.is_new, done.next_pending) == (True, 1)
    assert not settle(first, epoch).is_new  # a duplicate writes nothing
    last = settle(second, epoch)
    assert (last.is_new, last.next_pending) == (True, None)
    with quiet_engine.connect() as conn:
        session = sessions.get_session(conn, None, session_id)
        stream = events.read_stream(conn, session_id)
        woken, found = operations.session_and_operation(conn, session_id, second.request_id)
    assert (session.last_applied_seq, session.status) == (1, sessions.SessionStatus.RUNNING)
    assert [e.type for e in stream][-2:] == ["OperationCompleted", "OperationCompleted"]
    assert [e.seq for e in stream] == list(range(1, len(stream) + 1))
    assert found is not None and found[0].result == {"ok": 1}
    assert found[1]["data"][0]["tokens"] == [5, 6]
    assert woken.id == session_id


_RESERVED = sa.text("SELECT count(*) FROM reservations WHERE request_id = :r")


def test_a_metered_operation_takes_four_statements_to_admit_one_to_wake_and_four_to_settle(
    quiet_engine: sa.Engine, session_id: str
) -> None:
    """What docs/design.md ("Round trips") says each step of an operation sends to PostgreSQL,
    besides BEGIN and COMMIT."""
    principal = tenants.Principal("key-unit", "unit", "admin")
    with quiet_engine.begin() as conn:
        leases.heartbeat_worker(conn, "w-unit", {})
        assert leases.lease_session(conn, session_id, "w-unit", only_if_unleased=True)

    def statements(work: Any) -> tuple[Any, list[str]]:
        sent: list[str] = []
        with quiet_engine.begin() as conn:
            sa.event.listen(conn, "before_cursor_execute", lambda *a: sent.append(a[2]))
            return work(conn), sent

    admission, admitting = statements(
        lambda conn: operations.admit(conn, principal, session_id, 0, _forward())
    )
    (session, found), waking = statements(
        lambda conn: operations.session_and_operation(conn, session_id, admission.request_id)
    )
    assert found is not None
    held, _ = statements(lambda conn: conn.execute(_RESERVED, {"r": admission.request_id}).scalar())
    settlement, settling = statements(
        lambda conn: operations.settle(
            conn,
            found[0],
            worker_id="w-unit",
            lease_epoch=session.lease_epoch,
            result={"ok": 0},
            error=None,
            usage={"tokens": {"prefill": 2}},
        )  # fmt: skip
    )
    assert (len(admitting), len(waking), len(settling)) == (4, 1, 4), (admitting, settling)
    assert settlement.is_new and settlement.next_pending is None
    assert settlement.charge is not None and settlement.charge.tokens["prefill"] == 2
    with quiet_engine.connect() as conn:
        assert sessions.get_session(conn, None, session_id).last_applied_seq == 0
        reserved = conn.execute(_RESERVED, {"r": admission.request_id}).scalar()
        used = conn.execute(
            sa.text("SELECT prefill_tokens FROM usage WHERE request_id = :r"),
            {"r": admission.request_id},
        ).scalar()
    assert (held, reserved, used) == (1, 0, 2)  # reserved at admission, released by the charge
