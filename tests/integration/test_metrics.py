"""The metrics of a running platform (`treadle up`, two workers), read the way Prometheus reads
them: the API's `GET /metrics` and each worker's own endpoint, found through the `metrics_url`
its heartbeat records. 20 sessions train and sample at once through the unmodified tinker SDK,
and every counter moves by exactly what was sent: operations admitted and settled by type,
events appended, leases placed, tokens by class (equal to the usage ledger and to the tokens
the test sent and got back). Requests are counted under their route template with their real
status, a 404 and a 400 included."""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.client.billing import BillingClient
from treadle.platform import db

pytestmark = pytest.mark.integration

BASE_MODEL = "treadle/tiny-debug"
SESSIONS = 20
PROMPT = [504, 3575, 282, 4649, 314]
SAMPLING = types.SamplingParams(max_tokens=3, temperature=1.0, seed=5)

# The truth the counters are compared with: what the database recorded for the test's tenant.
OPERATIONS_BY_TYPE = sa.text(
    "SELECT type, status, count(*) AS n FROM operations WHERE tenant_id = :t GROUP BY type, status"
)
TOKENS_IN_LEDGER = sa.text(
    "SELECT sum(train_tokens), sum(prefill_tokens), sum(sample_tokens) FROM usage "
    "WHERE tenant_id = :t"
)
SESSIONS_OF_TENANT = sa.text("SELECT count(*) FROM sessions WHERE tenant_id = :t")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str) -> Samples:
    """Every sample of one endpoint: (name, sorted labels) -> value."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def _sum(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(
        value
        for (sample_name, sample_labels), value in samples.items()
        if sample_name == name and labels.items() <= dict(sample_labels).items()
    )


@dataclass
class Scrapes:
    platform: Platform

    def worker_urls(self) -> list[str]:
        eng = db.connect(self.platform.database_url, pool_size=1)
        try:
            with eng.connect() as conn:
                infos = conn.execute(sa.text("SELECT info FROM workers ORDER BY id")).scalars()
                urls = [info["metrics_url"] for info in infos]
        finally:
            eng.dispose()
        assert len(urls) == 2 and all(urls), urls
        return urls

    def api(self) -> Samples:
        return _scrape(f"{self.platform.base_url}/metrics")

    def workers(self) -> list[Samples]:
        return [_scrape(url) for url in self.worker_urls()]


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return _sum(after, name, **labels) - _sum(before, name, **labels)


def _workers_delta(before: list[Samples], after: list[Samples], name: str, **labels: str) -> float:
    return sum(_delta(b, a, name, **labels) for b, a in zip(before, after, strict=True))


def _eventually(check: Callable[[], None], seconds: float = 10.0) -> None:
    """A worker counts a settlement just after committing it, so a client can see the result
    a moment before the counter moves: retry `check` until it passes or time runs out."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@dataclass(frozen=True)
class Sent:
    train_tokens: int
    prefill_tokens: int
    sample_tokens: int


def _one_session(base_url: str, key: str, index: int) -> Sent:
    """A session's life through the tinker SDK: one forward_backward, one optim_step, a save for
    a sampler and one sample."""
    svc = tinker.ServiceClient(base_url=base_url, api_key=key)
    try:
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4, seed=index).result()
        tokens = [7, 11, 13, 17, 19, 23, 29, 31][: 4 + index % 5]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(PROMPT)
        result = sampler.sample(prompt, 1, SAMPLING).result()
        return Sent(
            train_tokens=datum.model_input.length,
            prefill_tokens=prompt.length,
            sample_tokens=sum(len(s.tokens) for s in result.sequences),
        )
    finally:
        svc.close("success").result()


def test_counters_move_by_exactly_what_twenty_concurrent_sessions_sent(
    platform: Platform, engine: sa.Engine
) -> None:
    tenant = f"metrics-{secrets.token_hex(3)}"
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(tenant)["api_key"]
    admin.close()
    scrapes = Scrapes(platform)
    api_before, workers_before = scrapes.api(), scrapes.workers()

    with ThreadPoolExecutor(SESSIONS) as pool:
        sent = list(pool.map(lambda i: _one_session(platform.base_url, key, i), range(SESSIONS)))

    with engine.connect() as conn:
        rows = conn.execute(OPERATIONS_BY_TYPE, {"t": tenant})
        ops = Counter({(row.type, row.status): row.n for row in rows})
        ledger = conn.execute(TOKENS_IN_LEDGER, {"t": tenant}).one()
        sessions = conn.execute(SESSIONS_OF_TENANT, {"t": tenant}).scalar_one()
    by_type = Counter({op_type: n for (op_type, _), n in ops.items()})
    assert by_type == {
        "create_model": SESSIONS, "forward_backward": SESSIONS, "optim_step": SESSIONS,
        "save_weights_for_sampler": SESSIONS, "sample": SESSIONS,
    }  # fmt: skip
    assert {status for _, status in ops} == {"completed"}

    api_after = scrapes.api()
    for op_type, n in by_type.items():
        assert _delta(api_before, api_after, "treadle_operations_admitted_total", type=op_type) == n
    assert _delta(api_before, api_after, "treadle_event_appends_total",
                  type="OperationRequested") == sum(by_type.values())  # fmt: skip
    assert _delta(api_before, api_after, "treadle_lease_changes_total", reason="placed") == sessions
    assert _delta(api_before, api_after, "treadle_http_requests_total",
                  route="/api/v1/create_model", method="POST", status="200") == SESSIONS  # fmt: skip

    train = sum(s.train_tokens for s in sent)
    prefill = sum(s.prefill_tokens for s in sent)
    sampled = sum(s.sample_tokens for s in sent)
    assert (ledger[0], ledger[1], ledger[2]) == (train, prefill, sampled)

    def workers_counted_everything() -> None:
        after = scrapes.workers()
        for op_type, n in by_type.items():
            assert _workers_delta(workers_before, after, "treadle_operations_total",
                                  type=op_type, outcome="completed") == n, op_type  # fmt: skip
            for name in ("treadle_operation_queue_wait_seconds_count",
                         "treadle_operation_execution_seconds_count"):  # fmt: skip
                assert _workers_delta(workers_before, after, name, type=op_type) == n, name
        assert _workers_delta(workers_before, after, "treadle_operations_total",
                              outcome="failed") == 0  # fmt: skip
        assert _workers_delta(workers_before, after, "treadle_event_appends_total",
                              type="OperationCompleted") == sum(by_type.values())  # fmt: skip
        for token_class, n in (("train", train), ("prefill", prefill), ("sample", sampled)):
            assert _workers_delta(workers_before, after, "treadle_tokens_total",
                                  token_class=token_class, tenant=tenant) == n, token_class  # fmt: skip

    _eventually(workers_counted_everything)

    # One "treadle.operations" record per operation at admission (the API's log, in `treadle up`'s
    # output) and one at settlement (the workers' logs), JSON lines by default.
    def logged(paths: list[Path]) -> Counter[tuple[str, str]]:
        records = [
            json.loads(line)
            for path in paths
            for line in path.read_text().splitlines()
            if line.startswith("{") and '"treadle.operations"' in line
        ]
        return Counter(
            (r["type"], r["outcome"])
            for r in records
            if r["logger"] == "treadle.operations" and r["tenant_id"] == tenant
        )

    data_dir = platform.data_dir
    admitted = Counter({(op_type, "admitted"): n for op_type, n in by_type.items()})
    completed = Counter({(op_type, "completed"): n for op_type, n in by_type.items()})
    assert logged([data_dir / "up.log"]) == admitted
    worker_logs = sorted((data_dir / "logs").glob("worker*.log"))
    assert logged(worker_logs) == completed
    # Celery's own two lines per task (its wake-up received, succeeded) are left out below DEBUG:
    # they would double the worker's log and say less than the operation's record.
    celery_per_task = [
        line
        for path in worker_logs
        for line in path.read_text().splitlines()
        if '"celery.worker.strategy"' in line or '"celery.app.trace"' in line
    ]
    assert celery_per_task == []


def test_each_worker_serves_its_gauges_labelled_with_its_id(platform: Platform) -> None:
    urls = Scrapes(platform).worker_urls()
    for url, samples in zip(urls, Scrapes(platform).workers(), strict=True):
        worker_ids = {
            dict(labels)["worker"]
            for (name, labels), _ in samples.items()
            if name == "treadle_sessions_live"
        }
        assert len(worker_ids) == 1, (url, worker_ids)
        for name in ("treadle_operations_in_flight", "treadle_operations_queued",
                     "treadle_sessions_live"):  # fmt: skip
            assert _sum(samples, name) >= 0 and any(n == name for n, _ in samples), name
        for gauge in ("treadle_adapters", "treadle_snapshots"):
            assert {dict(labels)["state"] for (name, labels) in samples
                    if name == gauge} == {"resident", "paged"}, gauge  # fmt: skip
        assert _sum(samples, "treadle_process_resident_memory_bytes", component="worker") > 0
        assert _sum(samples, "process_resident_memory_bytes") > 0


def test_requests_are_counted_by_route_template_with_their_real_status(platform: Platform) -> None:
    scrapes = Scrapes(platform)
    before = scrapes.api()
    headers = {"X-API-Key": platform.admin_key}
    missing = httpx.get(f"{platform.base_url}/api/v1/no/such/route/{secrets.token_hex(4)}",
                        headers=headers)  # fmt: skip
    assert missing.status_code == 404
    bad = httpx.post(f"{platform.base_url}/api/v1/create_session", headers=headers,
                     content=b"{not json", timeout=10)  # fmt: skip
    assert bad.status_code == 400, bad.text
    model = f"sess-{secrets.token_hex(8)}:train:0"
    unknown = httpx.post(f"{platform.base_url}/api/v1/get_info", headers=headers,
                         json={"model_id": model}, timeout=10)  # fmt: skip
    assert unknown.status_code == 404, unknown.text
    odd = httpx.request("BREW", f"{platform.base_url}/api/v1/get_info", headers=headers)
    assert odd.status_code == 405, odd.text
    after = scrapes.api()

    def counted(route: str, method: str, status: str) -> float:
        name = "treadle_http_requests_total"
        return _delta(before, after, name, route=route, method=method, status=status)

    assert counted("unmatched", "GET", "404") == 1
    assert counted("/api/v1/create_session", "POST", "400") == 1
    assert counted("/api/v1/get_info", "POST", "404") == 1  # by template, not by the id
    assert counted("unmatched", "other", "405") == 1  # a method the client made up
    assert not any(model in str(labels) for _, labels in after)
    assert counted("/metrics", "GET", "200") == 1  # the first scrape
    assert _sum(after, "treadle_http_request_duration_seconds_count", route="/api/v1/get_info") >= 1
    assert _sum(after, "treadle_process_resident_memory_bytes", component="api") > 0


def test_a_request_refused_by_quota_counts_its_rejection_and_no_append(platform: Platform) -> None:
    """The refused request's OperationRequested was appended and rolled back with its
    transaction: the append counter counts only what committed."""
    tenant = f"metrics-quota-{secrets.token_hex(3)}"
    admin = AdminClient(platform.base_url, platform.admin_key)
    key = admin.create_tenant(tenant)["api_key"]
    admin.close()
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    try:
        tc = svc.create_lora_training_client(BASE_MODEL, rank=4).result()
        billing = BillingClient(platform.base_url, platform.admin_key)
        billing.set_quota(tenant, max_request_tokens=1)  # a 413: the SDK waits out a 402
        billing.close()
        scrapes = Scrapes(platform)
        before = scrapes.api()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([7, 11, 13]),
            loss_fn_inputs={"target_tokens": [11, 13, 17], "weights": [1.0, 1.0, 1.0]},
        )
        with pytest.raises(tinker.APIStatusError) as refused:
            tc.forward_backward([datum], "cross_entropy").result(timeout=60)
        assert refused.value.status_code == 413
        after = scrapes.api()
    finally:
        svc.close("success").result()
    assert _delta(before, after, "treadle_quota_rejections_total", reason="max_request_tokens") == 1
    assert _delta(before, after, "treadle_event_appends_total", type="OperationRequested") == 0
    assert _delta(before, after, "treadle_operations_admitted_total") == 0
    assert _delta(before, after, "treadle_http_requests_total",
                  route="/api/v1/forward_backward", status="413") == 1  # fmt: skip
