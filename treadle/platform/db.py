"""Database access: the SQLAlchemy engine, read-only connections and schema migrations.

`connect(url)` builds the engine (psycopg 3); `reading(engine)` lends a connection for reads
alone, outside any transaction; `migrate(url)` upgrades the schema to head with Alembic from the
repository's `migrations/` folder. Imports nothing from api, engine, worker or torch.

A connection taken from the pool is checked for life without a round trip while it is busy
(`_check_alive`): SQLAlchemy's `pool_pre_ping` sends a `SELECT 1` on every checkout, one more
round trip for every request. A server that stopped or restarted closes its end of the socket,
which the check sees; a connection idle for IDLE_PING_SECONDS is pinged as before.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
# A connection idle this long gets a real ping before use (a peer that vanished without closing
# the socket, e.g. behind a NAT that dropped it, is only found by talking to it).
IDLE_PING_SECONDS = 10.0
_CHECKED_IN = "treadle.checked_in"


def sqlalchemy_url(url: str) -> str:
    """Accept `postgresql://` URLs as users write them; SQLAlchemy needs the driver named."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ValueError(f"DATABASE_URL must be a postgresql:// URL, got {url!r}")


def connect(url: str, *, pool_size: int = 10) -> sa.Engine:
    engine = sa.create_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=20,
        # A request that finds every connection busy fails (a 503 at the API) within seconds
        # instead of queueing for the default 30.
        pool_timeout=10,
    )
    sa.event.listen(engine, "connect", _note_checkin)  # a new connection counts as just used
    sa.event.listen(engine, "checkout", _check_alive)
    sa.event.listen(engine, "checkin", _note_checkin)
    return engine


@contextmanager
def reading(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection for reads only, in autocommit: each statement sees what was committed when
    it started (as under the default READ COMMITTED), and no BEGIN or ROLLBACK is sent."""
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT")


def _note_checkin(dbapi_connection: Any, record: Any) -> None:
    if record is not None:
        record.info[_CHECKED_IN] = time.monotonic()


def _has_input(dbapi_connection: Any) -> bool:
    """Whether the server wrote to this idle connection (or closed it): poll, no round trip."""
    try:
        poller = select.poll()
        poller.register(dbapi_connection.fileno(), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):  # no socket to look at: let the ping decide
        return True


def _check_alive(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """Refuse (DisconnectionError: the pool replaces it) a pooled connection that is dead.

    A healthy idle connection has nothing to read: PostgreSQL only writes to it when asked, or to
    say it is terminating the session before it closes the socket (shutdown, crash, restart,
    pg_terminate_backend). So a connection whose socket is readable, or that sat idle for
    IDLE_PING_SECONDS, is pinged; any other is used as it is.
    """
    if getattr(dbapi_connection, "closed", False) or getattr(dbapi_connection, "broken", False):
        raise sa.exc.DisconnectionError("the connection is closed")
    idle_since = record.info.get(_CHECKED_IN) if record is not None else None
    recent = idle_since is not None and time.monotonic() - idle_since < IDLE_PING_SECONDS
    if recent and not _has_input(dbapi_connection):
        return
    try:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SELECT 1")
        finally:
            cursor.close()
        dbapi_connection.rollback()
    except Exception as exc:
        raise sa.exc.DisconnectionError(f"the connection failed its ping: {exc}") from exc


def alembic_config(url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the schema; safe to run concurrently from several processes (advisory lock)."""
    from alembic import command

    engine = sa.create_engine(sqlalchemy_url(url), poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(727170)"))
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    engine.dispose()
