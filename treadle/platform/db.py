"""Database access: the SQLAlchemy engine and schema migrations.

`connect(url)` builds the engine (psycopg 3); `migrate(url)` upgrades the schema to head with
Alembic from the repository's `migrations/` folder. Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def sqlalchemy_url(url: str) -> str:
    """Accept `postgresql://` URLs as users write them; SQLAlchemy needs the driver named."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ValueError(f"DATABASE_URL must be a postgresql:// URL, got {url!r}")


def connect(url: str, *, pool_size: int = 10) -> sa.Engine:
    return sa.create_engine(
        sqlalchemy_url(url),
        pool_size=pool_size,
        max_overflow=20,
        pool_pre_ping=True,
        # A request that finds every connection busy fails (a 503 at the API) within seconds
        # instead of queueing for the default 30.
        pool_timeout=10,
    )


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
