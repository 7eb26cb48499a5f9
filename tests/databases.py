"""A migrated database of its own on the run's PostgreSQL server, for tests that must not share
the served platform's database (whose workers claim any unleased session they find)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import sqlalchemy as sa

from treadle.platform import db


@contextlib.contextmanager
def private_database(server_url: str, prefix: str) -> Iterator[str]:
    """A new database on the server of `server_url` (any database URL of it), migrated to
    head; dropped after the block. Yields its `postgresql://` URL."""
    server = sa.make_url(db.sqlalchemy_url(server_url))
    name = f"{prefix}_{secrets.token_hex(4)}"
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = server.set(database=name).render_as_string(hide_password=False)
    url = url.replace("postgresql+psycopg://", "postgresql://")
    try:
        db.migrate(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
