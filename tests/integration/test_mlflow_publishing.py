"""A platform whose operator configured MLflow (TREADLE_MLFLOW_TRACKING_URI) publishes each
session's per-step figures to a run named after the session, on a real MLflow server; read back
with MlflowClient they equal the figures recomputed here from the session's audit timeline and
its usage rows, and the run ends FINISHED when the session is stopped."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
import tinker
from mlflow import MlflowClient
from tinker import types

from tests.conftest import Platform, Services, new_tenant_key, served_platform
from tests.databases import private_database
from treadle.client.audit import AuditClient
from treadle.platform import db
from treadle.platform.audit import mlflow_publisher
from treadle.platform.embedded import free_port
from treadle.platform.sessions import sessions
from treadle.platform.tenancy import tenants

pytestmark = pytest.mark.integration

LEARNING_RATES = (1e-3, 5e-4, 2e-4)


@pytest.fixture(scope="module")
def tracked_platform(
    services: Services, mlflow_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Platform]:
    """A platform of its own (database and Redis database: the run's other platform must not
    take its sessions) that publishes to the test run's MLflow server."""
    base, _, number = services.redis_url.rpartition("/")
    redis_url = f"{base}/{(int(number or 0) + 9) % 16}"
    data_dir = tmp_path_factory.mktemp("mlflow-platform")
    prices = data_dir / "prices.toml"  # tiny-debug priced, so that steps cost something
    prices.write_text('["treadle/tiny-debug"]\nprefill = 1.0\nsample = 2.0\ntrain = 3.0\n')
    env = {
        "TREADLE_MLFLOW_TRACKING_URI": mlflow_uri,
        "TREADLE_MLFLOW_EXPERIMENT": "t-{tenant}",
        "TREADLE_PRICES_FILE": str(prices),
    }
    with (
        private_database(services.database_url, "treadle_mlflow") as database_url,
        served_platform(database_url, redis_url, data_dir, workers=1, env=env) as platform,
    ):
        yield platform


def expected_steps(timeline: list[dict[str, Any]], costs: dict[str, int]) -> list[dict[str, float]]:
    """The per-step figures, written out from the audit route's rows: each completed optim_step
    closes a step holding the completed operations since the previous one."""
    found, window, total = [], [], 0
    for row in timeline:
        if row["kind"] != "operation" or row["status"] != "completed":
            continue
        window.append(row)
        if row["type"] == "optim_step":
            cost = sum(costs[r["request_id"]] for r in window)
            total += cost
            figures = {
                "loss_sum": sum(r["loss"] for r in window if r["type"] == "forward_backward"),
                "learning_rate": row["metrics"]["learning_rate:mean"],
                "cost_usd": cost / 1e6,
                "total_cost_usd": total / 1e6,
                **{f"{c}_tokens": sum(r["tokens"][c] for r in window)
                   for c in ("prefill", "sample", "train")},
            }  # fmt: skip
            if "grad_norm:mean" in row["metrics"]:
                figures["grad_norm"] = row["metrics"]["grad_norm:mean"]
            found.append(figures)
            window = []
    return found


def test_each_sessions_steps_reach_its_mlflow_run_as_audited(
    tracked_platform: Platform, mlflow_uri: str
) -> None:
    key = new_tenant_key(tracked_platform, "mlflow")
    svc = tinker.ServiceClient(base_url=tracked_platform.base_url, api_key=key)
    try:
        tc = svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=1).result()
        tokens = list(range(10, 30))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        for lr in LEARNING_RATES:
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        model_id = tc.model_id
    finally:
        svc.close("success").result()

    client = MlflowClient(tracking_uri=mlflow_uri)
    run = published_run(client, model_id, steps=len(LEARNING_RATES), status="FINISHED")
    assert run.info.end_time is not None
    assert run.info.run_name == model_id and run.data.params["base_model"] == "treadle/tiny-debug"

    timeline = AuditClient(tracked_platform.base_url, key).timeline(model_id)
    engine = db.connect(tracked_platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            costs = dict(conn.execute(
                sa.text("SELECT request_id, cost_micro_usd FROM usage WHERE session_id = :s"),
                {"s": model_id},
            ).all())  # fmt: skip
    finally:
        engine.dispose()
    expected = expected_steps(timeline, costs)
    assert [s["learning_rate"] for s in expected] == pytest.approx(LEARNING_RATES)
    assert all(s["train_tokens"] == len(tokens) - 1 and s["cost_usd"] > 0 for s in expected), (
        expected
    )
    for key_name in expected[0]:
        history = client.get_metric_history(run.info.run_id, key_name)
        assert sorted((m.step, m.value) for m in history) == [
            (step, figures[key_name]) for step, figures in enumerate(expected, 1)
        ], key_name


def published_run(client: MlflowClient, model_id: str, *, steps: int, status: str) -> Any:
    """The session's run once its `steps` steps are published and its status is `status` (the
    publisher runs beside the operations, so it may lag them a little)."""
    deadline = time.monotonic() + 120
    while True:
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            f"tags.`treadle.session_id` = '{model_id}'",
        )
        published = runs and runs[0].data.tags.get("treadle.published_step") == str(steps)
        if published and runs[0].info.status == status:
            return runs[0]
        assert time.monotonic() < deadline, f"{model_id}: not published in 120 s ({runs})"
        time.sleep(0.5)


def test_an_unreachable_mlflow_is_reported_once_and_retried(
    quiet_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The publisher notes a step and returns; the server's failure is one warning however
    often it is retried."""
    with quiet_engine.begin() as conn:
        tenants.ensure_tenant(conn, "mlflow-down")
        principal = tenants.Principal("key-unit", "mlflow-down", "admin")
        client_session = sessions.create_client_session(conn, principal, [], {})
        session_id = sessions.training_session_id(client_session, 0)
        sessions.create_session(conn, principal, session_id=session_id,
                                client_session_id=client_session, kind="training",
                                base_model="treadle/tiny-debug")  # fmt: skip
    caplog.set_level(logging.DEBUG, logger=mlflow_publisher.__name__)
    nowhere = f"http://127.0.0.1:{free_port()}"
    publisher = mlflow_publisher.MlflowPublisher(
        quiet_engine, nowhere, "treadle-{tenant}", retry_seconds=0.1
    )
    try:
        publisher.step_settled(session_id)
        publisher.step_settled(session_id)
        deadline = time.monotonic() + 120
        while sum("still failing" in r.getMessage() for r in caplog.records) < 3:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.1)
    finally:
        publisher.close()
    # (only the publisher's: in the dev environment the sagemaker-mlflow plugin, which
    # sagemaker-train brings, warns on each request whose tracking URI is not a SageMaker ARN)
    warnings = [
        r for r in caplog.records
        if r.name == mlflow_publisher.__name__ and r.levelno == logging.WARNING
    ]  # fmt: skip
    assert len(warnings) == 1 and nowhere in warnings[0].getMessage()
