"""Alembic environment: runs migrations against the URL the caller put in the config."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from treadle.platform.eventlog.schema import metadata

config = context.config
url = config.get_main_option("sqlalchemy.url")


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(connection=connectable, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
