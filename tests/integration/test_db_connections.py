"""Pooled connections (treadle.platform.db) against a real PostgreSQL: a connection whose server
session ended is replaced before use (no error reaches the caller), and `reading` runs its reads
outside any transaction without leaving the pooled connection that way."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from treadle.platform import db

pytestmark = pytest.mark.integration

PID = sa.text("SELECT pg_backend_pid()")
XID = sa.text("SELECT txid_current()")


@pytest.fixture
def pool_of_one(quiet_engine: sa.Engine) -> Iterator[sa.Engine]:
    engine = db.connect(quiet_engine.url.render_as_string(hide_password=False), pool_size=1)
    yield engine
    engine.dispose()


def _wait_until_gone(engine: sa.Engine, pid: int) -> None:
    """Until the server process `pid` has exited (its socket is closed), as PostgreSQL sees it."""
    gone = sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with db.reading(engine) as conn:
            if conn.execute(gone, {"pid": pid}).scalar_one() == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"backend {pid} was not gone after 60 s")


def test_a_connection_whose_server_session_ended_is_replaced_before_use(
    pool_of_one: sa.Engine, quiet_engine: sa.Engine
) -> None:
    with db.reading(pool_of_one) as conn:
        first = conn.execute(PID).scalar_one()
    with quiet_engine.connect() as admin:
        assert admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first}).scalar()
    _wait_until_gone(quiet_engine, first)
    with db.reading(pool_of_one) as conn:  # the pool's only connection is the dead one
        second = conn.execute(PID).scalar_one()
    with pool_of_one.begin() as conn:
        assert conn.execute(PID).scalar_one() == second
    assert second != first


def test_reading_runs_each_statement_outside_a_transaction(pool_of_one: sa.Engine) -> None:
    with db.reading(pool_of_one) as conn:
        assert conn.execute(XID).scalar_one() != conn.execute(XID).scalar_one()


def test_the_connection_a_reading_used_is_transactional_again(pool_of_one: sa.Engine) -> None:
    with db.reading(pool_of_one) as conn:
        reader = conn.execute(PID).scalar_one()
    with pool_of_one.begin() as conn:
        assert conn.execute(PID).scalar_one() == reader  # the same pooled connection
        assert conn.execute(XID).scalar_one() == conn.execute(XID).scalar_one()
