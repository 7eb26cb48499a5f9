"""The operator's view, checked against a real Prometheus (Debian's `prometheus` package, which
`make test` installs): promtool accepts the compose scrape config and the alert rules; a
Prometheus on a free port scrapes the served platform's API and both its workers every second
during a short loop through the official tinker SDK, and then every expression of every
dashboard panel and of every alert rule returns data.

Alert rules are all written `<expression> <comparison> <number>` (dashboards/prometheus/alerts.yml
says so): a threshold filters out the very series the test looks for, so the test evaluates the
`<expression>` part. Dashboard expressions use Grafana's `$__rate_interval` and `$__range` only,
substituted here by windows that cover the loop. Device memory is exported by CUDA workers only:
on a CPU machine its expressions must return nothing (a worker does not invent device memory).
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import tinker
import torch
import yaml
from tinker import types

from tests.conftest import Platform
from tests.integration.prometheus_server import Prometheus, require, running_prometheus
from tests.integration.wire_client import WireClient, datum
from treadle.client.admin import AdminClient
from treadle.platform import db
from treadle.platform.sessions import leases

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
ALERTS = DASHBOARDS / "prometheus" / "alerts.yml"
BASE_MODEL = "treadle/tiny-debug"
PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378]
DATASOURCE_UID = "prometheus"  # dashboards/grafana/provisioning/datasources/prometheus.yml
# Grafana's built-in interval variables, as windows that cover the whole test (scrapes every 1 s).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "10m"}
THRESHOLD = re.compile(r"^(?P<expr>.+?)\s*(?:==|!=|>=|<=|>|<)\s*-?[0-9.]+(?:e[+-]?[0-9]+)?$", re.S)
# Exported only where the worker runs on CUDA; see the module docstring.
CUDA_ONLY_METRICS = ("treadle_device_memory_bytes",)
LIVE = "heartbeat_at > now() - interval '30 seconds'"  # workers of a finished test do not count


@dataclass(frozen=True)
class Query:
    where: str  # "overview.json: Request rate by route [A]" or "alert TreadleWorkerDown"
    expr: str  # as written in the file


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def _dashboards() -> dict[str, dict[str, Any]]:
    return {
        path.name: json.loads(path.read_text())
        for path in sorted((DASHBOARDS / "grafana").glob("*.json"))
    }


def _dashboard_queries() -> list[Query]:
    return [
        Query(f"{name}: {panel['title']} [{target['refId']}]", target["expr"])
        for name, board in _dashboards().items()
        for panel in _panels(board["panels"])
        for target in panel.get("targets", [])
    ]


def _alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alert_queries() -> list[Query]:
    return [Query(f"alert {rule['alert']}", rule["expr"]) for rule in _alert_rules()]


def _ids(queries: list[Query]) -> list[str]:
    return [query.where for query in queries]


# --- the files, and promtool ----------------------------------------------------------------


def test_the_three_dashboards_are_there_and_query_the_provisioned_datasource() -> None:
    boards = _dashboards()
    assert sorted(boards) == ["overview.json", "tenants.json", "workers.json"]
    provisioned = yaml.safe_load(
        (DASHBOARDS / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    assert [source["uid"] for source in provisioned] == [DATASOURCE_UID]
    for name, board in boards.items():
        assert board["uid"] and board["schemaVersion"] >= 39, name
        for panel in _panels(board["panels"]):
            if panel["type"] == "row":
                continue
            assert panel["type"] in ("timeseries", "stat"), (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == DATASOURCE_UID, (name, panel["title"])
                assert target["expr"].strip(), (name, panel["title"])


def test_promtool_accepts_the_compose_scrape_config() -> None:
    # The compose config names hosts only compose's DNS resolves (api, worker): promtool checks
    # its syntax and that its rule file (alerts.yml, relative to the config) loads.
    done = subprocess.run(
        [require("promtool"), "check", "config", "prometheus.yml"],
        cwd=DASHBOARDS / "prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout + done.stderr


def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(
        [require("promtool"), "check", "rules", str(ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in done.stdout


def test_every_alert_has_a_threshold_a_duration_a_severity_and_a_summary() -> None:
    for rule in _alert_rules():
        assert THRESHOLD.match(rule["expr"].strip()), (rule["alert"], rule["expr"])
        assert "for" in rule, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


# --- a live Prometheus scraping the served platform ------------------------------------------


def _metrics_urls(platform: Platform, timeout: float = 60) -> list[str]:
    """Each live worker's metrics URL, from the heartbeat info it records in `workers`."""
    engine = db.connect(platform.database_url, pool_size=1)
    deadline = time.monotonic() + timeout
    try:
        while True:
            with engine.connect() as conn:
                rows = conn.execute(sa.text(f"SELECT id, info FROM workers WHERE {LIVE}")).all()
            urls = [row.info.get("metrics_url") for row in rows]
            if len(urls) >= 2 and all(urls):
                return [str(url) for url in urls]
            assert time.monotonic() < deadline, f"workers without a metrics_url: {rows}"
            time.sleep(0.5)
    finally:
        engine.dispose()


def _train_and_sample(service: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    training = service.create_lora_training_client(BASE_MODEL, rank=4, seed=seed).result()
    training.forward_backward([datum(PROMPT)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    return training


def _move_to_another_worker(platform: Platform, session_id: str) -> None:
    """Give the session's lease to the other worker, as the lease keeper does with a session of
    a dead worker: its next operation makes the new holder rebuild it from the log."""
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.begin() as conn:
            holder = conn.execute(
                sa.text("SELECT worker_id FROM sessions WHERE id = :id"), {"id": session_id}
            ).scalar_one()
            other = conn.execute(
                sa.text(f"SELECT id FROM workers WHERE id <> :holder AND {LIVE} LIMIT 1"),
                {"holder": holder},
            ).scalar_one()
            assert leases.lease_session(conn, session_id, other, only_if_unleased=False)
    finally:
        engine.dispose()


def _exercise(platform: Platform) -> None:
    """A short loop that touches every metric the dashboards and alerts read."""
    admin = AdminClient(platform.base_url, platform.admin_key)
    tenant = admin.create_tenant(f"prometheus-{secrets.token_hex(3)}")
    limited_id = f"prometheus-limited-{secrets.token_hex(3)}"
    limited = admin.create_tenant(limited_id)
    admin.close()
    service = tinker.ServiceClient(base_url=platform.base_url, api_key=tenant["api_key"])
    trainings = [_train_and_sample(service, seed) for seed in range(3)]

    # 4xx: a refused request (a loss-name typo) and a path no route matches.
    with pytest.raises(tinker.BadRequestError):
        trainings[0].forward_backward([datum(PROMPT)], "cross_entropyy").result()  # type: ignore[arg-type]
    missing = httpx.get(
        f"{platform.base_url}/api/v1/no-such-route",
        headers={"X-API-Key": tenant["api_key"]},
        timeout=30,
    )
    assert missing.status_code == 404

    # A quota rejection: a request larger than the tenant's max_request_tokens.
    quota = httpx.patch(
        f"{platform.base_url}/api/v1/treadle/quotas/{limited_id}",
        json={"max_request_tokens": 2},
        headers={"X-API-Key": platform.admin_key},
        timeout=30,
    )
    assert quota.status_code == 200, quota.text
    wire = WireClient(platform.base_url, limited["api_key"])
    model_id = wire.create_model()
    refused = wire.forward_backward(model_id, 1, [datum(PROMPT)])
    assert refused.status_code == 413, refused.text

    # An append conflict: seq_id 1 resent with another payload.
    sent = WireClient(platform.base_url, tenant["api_key"])
    other_model = sent.create_model()
    assert sent.forward_backward(other_model, 1, [datum([1, 2, 3, 4])]).status_code == 200
    conflict = sent.forward_backward(other_model, 1, [datum([5, 6, 7, 8])])
    assert (conflict.status_code, conflict.json()["error"]["code"]) == (400, "conflict")

    # A recovery: the session moves to the other worker, which rebuilds it (replaying the
    # forward_backward and optim_step of its log) before its next operation.
    _move_to_another_worker(platform, trainings[1].model_id)
    trainings[1].forward_backward([datum(PROMPT)], "cross_entropy").result()
    service.close("success").result()
    wire.http.close()
    sent.http.close()


@pytest.fixture(scope="module")
def prometheus(
    platform: Platform, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    jobs = {
        "treadle-api": [f"{platform.base_url}/metrics"],
        "treadle-worker": _metrics_urls(platform),
    }
    folder = tmp_path_factory.mktemp("prometheus")
    with running_prometheus(folder, jobs, [ALERTS]) as server:
        server.wait_until_scraped(1)
        _exercise(platform)
        server.wait_until_scraped(2)  # what the loop counted is in Prometheus now
        yield server


def test_prometheus_scrapes_the_api_and_both_workers(prometheus: Prometheus) -> None:
    up = {(t["labels"]["job"], t["health"]) for t in prometheus.targets()}
    assert up == {("treadle-api", "up"), ("treadle-worker", "up")}
    assert prometheus.query('sum(up{job="treadle-worker"})')[0]["value"][1] == "2"


def test_prometheus_loads_every_alert_rule(prometheus: Prometheus) -> None:
    loaded = sorted(rule["name"] for rule in prometheus.rules())
    assert loaded == sorted(rule["alert"] for rule in _alert_rules())
    assert all(rule["health"] == "ok" for rule in prometheus.rules()), prometheus.rules()


def _substituted(expr: str) -> str:
    for variable, window in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, window)
    assert "$" not in expr.replace("${1}", ""), f"unknown template variable in {expr!r}"
    return expr


def _is_cuda_only(expr: str) -> bool:
    return any(name in expr for name in CUDA_ONLY_METRICS)


@pytest.mark.parametrize("query", _dashboard_queries(), ids=_ids(_dashboard_queries()))
def test_every_dashboard_expression_returns_data(prometheus: Prometheus, query: Query) -> None:
    result = prometheus.query(_substituted(query.expr))
    if _is_cuda_only(query.expr) and not torch.cuda.is_available():
        assert result == [], f"{query.where}: device memory on a CPU-only machine: {result}"
    else:
        assert result, f"{query.where}: no data for {query.expr}"


@pytest.mark.parametrize("query", _alert_queries(), ids=_ids(_alert_queries()))
def test_every_alert_expression_returns_data(prometheus: Prometheus, query: Query) -> None:
    matched = THRESHOLD.match(query.expr.strip())
    assert matched, f"{query.where}: not written `<expression> <comparison> <number>`"
    result = prometheus.query(matched["expr"])
    assert not _is_cuda_only(query.expr), f"{query.where}: an alert on a CUDA-only metric"
    assert result, f"{query.where}: no data for {matched['expr']}"
