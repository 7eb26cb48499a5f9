"""Publishing each session's per-step figures (`step_figures`) to an MLflow tracking server,
when the operator configures one (TREADLE_MLFLOW_TRACKING_URI).

A worker tells the publisher when it has settled an `optim_step` (`step_settled`, which only
notes the session and returns); the publisher's own thread then reads the session's timeline
after the last step it published and logs the new steps to the session's run (named after the
session, in the experiment `mlflow_experiment` names for its tenant). The run's tags hold how
far it has been published (`treadle.published_*`), so a session that moves to another worker,
or a worker that restarts, continues where the run stands. When the worker lets a session go
(`session_left`: stopped, or leased elsewhere), the publisher publishes what is left and, if the
session has ended, ends its run with the status that says how (`END_STATUS`); a session that
ended without a step gets no run. An MLflow server that fails is
reported once (a warning) until it answers again; the sessions it missed are retried every
`retry_seconds`, so nothing an operation waits for ever waits on MLflow.
Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import sqlalchemy as sa

from treadle.platform import db
from treadle.platform.audit import audit, step_figures
from treadle.platform.audit.step_figures import Cursor
from treadle.platform.errors import NotFoundError
from treadle.platform.eventlog.schema import usage
from treadle.platform.sessions.sessions import SessionRow, SessionStatus, get_session
from treadle.platform.tenancy.tenants import Principal, Role

log = logging.getLogger(__name__)

# Importing mlflow otherwise takes over loggers of the worker's own: it sets `sqlalchemy.engine`
# and `alembic` to WARNING with a handler of its own and stops them propagating, so their
# records would leave the worker's log format (platform/logs). Set before mlflow is imported.
os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")

SESSION_TAG = "treadle.session_id"
CURSOR_TAGS = {
    "step": "treadle.published_step",
    "seq": "treadle.published_seq",
    "cost_micro_usd": "treadle.published_cost_micro_usd",
}
RETRY_SECONDS = 30.0
# How an ended session's run ends: stopped by its client, given up for idleness, or stopped
# because it could not be rebuilt or its replay diverged.
END_STATUS = {
    SessionStatus.STOPPED: "FINISHED",
    SessionStatus.EXPIRED: "KILLED",
    SessionStatus.FAILED: "FAILED",
    SessionStatus.DIVERGED: "FAILED",
}


class MlflowPublisher:
    """Publishes the steps of the sessions it is told about, on a thread of its own."""

    def __init__(
        self,
        database: sa.Engine,
        tracking_uri: str,
        experiment: str,
        *,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self.db = database
        self.tracking_uri = tracking_uri
        self.experiment = experiment  # "{tenant}" is replaced by the session's tenant id
        self.retry_seconds = retry_seconds
        self._due: set[str] = set()
        self._left: set[str] = set()  # let go by the worker: published only if ended
        self._retry: dict[str, bool] = {}  # session -> whether only if ended (as it came)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._runs: dict[str, tuple[str, Cursor]] = {}  # session -> (run id, cursor)
        self._ended: set[str] = set()  # runs this publisher ended (searches may lag)
        self._failing = False
        self._client: Any = None
        self._thread = threading.Thread(target=self._loop, name="mlflow-publisher", daemon=True)
        self._thread.start()

    def step_settled(self, session_id: str) -> None:
        """Note that `session_id` has a new step; returns at once."""
        with self._lock:
            self._due.add(session_id)
        self._wake.set()

    def session_left(self, session_id: str) -> None:
        """Note that the worker let `session_id` go: if the session has ended, what is left is
        published and its run ends (one still running, leased elsewhere, is its new holder's
        to publish); returns at once."""
        with self._lock:
            self._left.add(session_id)
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.retry_seconds if self._retry else None)
            self._wake.clear()
            with self._lock:
                retry, self._retry = self._retry, {}
                due = self._due | {k for k, only in retry.items() if not only}
                left = (self._left | {k for k, only in retry.items() if only}) - due
                self._due, self._left = set(), set()
            for session_id in sorted(due | left):
                if self._closed:
                    return
                try:
                    self._publish(session_id, only_if_ended=session_id in left)
                except Exception as exc:  # whatever MLflow or the network does, retried later
                    self._retry[session_id] = session_id in left
                    self._report(exc)
                else:
                    if self._failing:
                        log.info("MLflow at %s answers again", self.tracking_uri)
                        self._failing = False

    def _report(self, exc: Exception) -> None:
        if self._failing:
            log.debug("MLflow still failing: %s", exc)
            return
        self._failing = True
        log.warning(
            "MLflow at %s failed (%s: %s); sessions' steps are published when it answers "
            "(retried every %.0f s)",
            self.tracking_uri, type(exc).__name__, str(exc).splitlines()[0][:300],
            self.retry_seconds,
        )  # fmt: skip

    def _publish(self, session_id: str, *, only_if_ended: bool = False) -> None:
        from mlflow.entities import Metric, RunTag

        with db.reading(self.db) as conn:
            try:
                session = get_session(conn, None, session_id)
            except NotFoundError:
                log.info("session %s is gone: nothing of it to publish to MLflow", session_id)
                return
            if only_if_ended and session.is_active:
                return
            known = self._runs.get(session_id) or self._run_of(session, create=session.is_active)
            if known is None:
                return  # ended before any step: no run to publish to or end
            run_id, cursor = known
            principal = Principal("mlflow-publisher", session.tenant_id, Role.MEMBER)
            rows: list[audit.TimelineRow] = []
            after = cursor.seq
            while True:
                page = audit.timeline(conn, principal, session_id, after=after, limit=1000)
                rows += page.rows
                after = page.next_after
                if not page.has_more:
                    break
            ids = [r.request_id for r in rows if r.request_id is not None]
            costs = dict(
                conn.execute(
                    sa.select(usage.c.request_id, usage.c.cost_micro_usd).where(
                        usage.c.request_id.in_(ids)
                    )
                ).all()
            )
        found, _ = step_figures.steps(rows, costs, cursor)
        for step in found:
            self._client.log_batch(
                run_id,
                metrics=[Metric(k, v, step.time_ms, step.step) for k, v in step.figures.items()],
                tags=[RunTag(CURSOR_TAGS[k], str(getattr(step.cursor, k))) for k in CURSOR_TAGS],
            )
            self._runs[session_id] = (run_id, step.cursor)
        if not session.is_active:
            self._client.set_terminated(run_id, END_STATUS[SessionStatus(session.status)])
            self._runs.pop(session_id, None)
            self._ended.add(run_id)

    def _run_of(self, session: SessionRow, *, create: bool) -> tuple[str, Cursor] | None:
        """The session's run and how far it was published; created if there is none and
        `create`. None for a run that has ended (nothing more goes to it) or none at all."""
        if self._client is None:
            # MLflow's client takes its retry policy from the environment only. Its default
            # (seven retries, two minutes apart at the end, each logged by urllib3) would hold
            # this thread for minutes and fill the log: the publisher retries by itself.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment.replace("{tenant}", session.tenant_id)
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(name)
        )
        found = self._client.search_runs(
            [experiment_id], f"tags.`{SESSION_TAG}` = '{session.id}'", max_results=1
        )
        if found and (found[0].info.status != "RUNNING" or found[0].info.run_id in self._ended):
            return None
        if found:
            tags = found[0].data.tags
            cursor = Cursor(**{k: int(tags.get(tag, 0)) for k, tag in CURSOR_TAGS.items()})
            return found[0].info.run_id, cursor
        run = self._client.create_run(
            experiment_id,
            run_name=session.id,
            tags={
                SESSION_TAG: session.id,
                "treadle.tenant_id": session.tenant_id,
                "treadle.base_model": session.base_model,
                # a SageMaker training session's own name, where it has one
                **({"treadle.session_name": session.name} if session.name else {}),
            },
        )
        lora = {f"lora_{k}": str(v) for k, v in session.lora_config.items()}
        self._client.log_batch(run.info.run_id, params=_params(session.base_model, lora))
        return run.info.run_id, Cursor()


def _params(base_model: str, lora: dict[str, str]) -> list[Any]:
    from mlflow.entities import Param

    return [Param("base_model", base_model), *(Param(k, v) for k, v in sorted(lora.items()))]
