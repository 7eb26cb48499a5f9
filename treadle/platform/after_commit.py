"""Work that must happen only once a transaction commits: counting what it recorded.

`after_commit(conn, fn)` runs `fn()` when `conn`'s transaction commits and forgets it when the
transaction rolls back, so a counter never counts an event or a lease change that a refused
request rolled back. The callbacks wait in the DBAPI connection's `info` dict; listeners on
every SQLAlchemy `Engine` (installed once, at import) run or drop them. A callback runs just
before the server's COMMIT is sent: a COMMIT that then fails still counted (rare; the counters
are operational signals, the ledger is the truth). A callback must not raise; one that does is
logged and the others still run.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

log = logging.getLogger(__name__)

_PENDING = "treadle.after_commit"


def after_commit(conn: sa.Connection, fn: Callable[[], None]) -> None:
    """Run `fn` when `conn`'s current transaction commits (never if it rolls back). Outside a
    transaction (autocommit), `fn` runs at once."""
    if not conn.in_transaction():
        _call(fn)
        return
    conn.info.setdefault(_PENDING, []).append(fn)


def _run_pending(conn: sa.Connection) -> None:
    for fn in conn.info.pop(_PENDING, ()):
        _call(fn)


def _drop_pending(conn: sa.Connection, *_: Any) -> None:
    conn.info.pop(_PENDING, None)


def _drop_on_reset(dbapi_connection: Any, record: Any, reset_state: Any) -> None:
    # A connection returned to the pool mid-transaction is rolled back by the pool, below the
    # Connection's events: what it left must not be counted by the next transaction on it.
    if record is not None:
        record.info.pop(_PENDING, None)


def _call(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # a metric must never fail the work it counts
        log.exception("an after-commit callback failed")


sa.event.listen(sa.engine.Engine, "commit", _run_pending)
sa.event.listen(sa.engine.Engine, "rollback", _drop_pending)
sa.event.listen(sa.pool.Pool, "reset", _drop_on_reset)
