"""Settling an operation's outcome: one transaction guarded by the worker's lease epoch.

`Settler.settle` writes the operation's completion or failure, its usage and, for a state
change, the adapter's hashes (`operations.settle`), then, once committed, tells the client
(`notify`), records the operation's metrics and log line (`telemetry`), counts its charge and,
for an optimizer step, tells the MLflow publisher when there is one.
A stale lease writes nothing. Imports platform only; never api or the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import sqlalchemy as sa

from treadle.platform import metrics
from treadle.platform.billing import metering
from treadle.platform.eventlog import notify
from treadle.platform.eventlog.optypes import OpType
from treadle.platform.operations import operations
from treadle.platform.sessions import leases
from treadle.platform.sessions.sessions import SessionRow
from treadle.worker import handlers, telemetry

__all__ = ["Settler"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settler:
    """Settles this worker's operations (`worker_id`) through `db`, telling clients on `redis`."""

    db: sa.Engine
    redis: redis.Redis
    worker_id: str
    metering: bool  # settle usage rows and charges (TREADLE_METERING)
    # Told a session's id when its optim_step has settled (the MLflow publisher), or None.
    step_settled: Callable[[str], None] | None = None

    def settle(
        self,
        session: SessionRow,
        op: operations.OperationRow,
        outcome: handlers.Outcome | None,
        error: dict[str, Any] | None,
        state: dict[str, str] | None,
        seconds: float,
        started_at: float,
    ) -> operations.Settlement | None:
        """Settle an operation's outcome (it ran `seconds` from `started_at`, a `time.time()`);
        None when this worker's lease was stale (nothing was written)."""
        tokens = outcome.tokens if outcome is not None else handlers.no_tokens()
        result = outcome.result.to_json() if outcome is not None else None
        usage = {"duration_ms": round(seconds * 1000, 3), "tokens": tokens}
        try:
            with self.db.begin() as conn:
                settled = operations.settle(
                    conn,
                    op,
                    worker_id=self.worker_id,
                    lease_epoch=session.lease_epoch,
                    result=result,
                    error=error,
                    usage=usage,
                    state=state,
                    also=outcome.also if outcome is not None else None,
                    metering=self.metering,
                )
        except leases.StaleLeaseError as exc:
            log.warning("refused a stale write: %s", exc)
            metrics.count_conflict("stale_lease")
            return None
        if settled.is_new:
            notice = operations.outcome_notice(
                op.type, settled.result, error, max_bytes=notify.MAX_OUTCOME_BYTES
            )
            notify.publish_done(self.redis, op.request_id, notice)
            telemetry.settled(self.worker_id, op, error, seconds, started_at)
            if self.step_settled is not None and op.type == OpType.OPTIM_STEP and error is None:
                self.step_settled(session.id)
        if settled.charge is not None:
            metering.count_charge(settled.charge)
        return settled
