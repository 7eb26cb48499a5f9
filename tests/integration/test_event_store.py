"""The event store and the schema, against a real PostgreSQL."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from treadle.platform import events, sessions, tenants
from treadle.platform.schema import metadata

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
