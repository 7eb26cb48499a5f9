"""Every Prometheus metric Treadle defines follows the naming contract that dashboards and alerts
are written against (docs/operations.md, "Metrics"): a `treadle_` prefix, counters exposed with
`_total`, time in `_seconds` and sizes in `_bytes`, and no label that holds an id (a session,
request, key or model id would make one series per id). Every module of the package is
imported, so a metric added anywhere is checked; the worker's scrape-time gauges are checked
through the families their collector describes."""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics import MetricWrapperBase

import treadle
from treadle.worker import gauges as worker_gauges

# Built at import from the environment (it needs a database): it defines no metric.
NOT_IMPORTED = {"treadle.api.wsgi"}
# Names a label must not have: each value would be one id, one series per id.
ID_LABELS = {"id", "session", "request", "key", "model", "sampler", "checkpoint", "path", "seq"}
# The process and platform collectors prometheus_client registers by itself.
FOREIGN_PREFIXES = ("process_", "python_")
TIME_WORDS = re.compile(r"(second|duration|latency|wait|time)")
SIZE_WORDS = re.compile(r"(bytes|memory|size)")


@dataclass(frozen=True)
class Declared:
    name: str  # without the `_total` a counter's samples carry
    type: str
    labels: tuple[str, ...]
    where: str


def _all_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(treadle.__path__, "treadle.")]
    return [name for name in names if name not in NOT_IMPORTED]


def _declared() -> Iterator[Declared]:
    """Every metric object at module level in the package, and the worker's gauge families."""
    for module_name in _all_modules():
        module = importlib.import_module(module_name)
        for attr, value in vars(module).items():
            if isinstance(value, MetricWrapperBase):
                # prometheus_client keeps a metric's label names in `_labelnames`: fail loudly
                # if a new version moves them, rather than checking nothing.
                assert isinstance(value._labelnames, tuple), "prometheus_client changed"
                (family,) = value.describe()
                yield Declared(family.name, family.type, value._labelnames, f"{module_name}.{attr}")
    for family in worker_gauges.gauge_families():
        labels = getattr(family, "_labelnames", None)
        assert isinstance(labels, tuple), "prometheus_client changed GaugeMetricFamily"
        yield Declared(family.name, family.type, labels, "treadle.worker.gauges")


def _problems(metric: Declared) -> list[str]:
    found = []
    name = metric.name
    if not name.startswith("treadle_"):
        found.append("has no treadle_ prefix")
    if metric.type != "counter" and name.endswith("_total"):
        found.append(f"is a {metric.type} named like a counter (_total)")
    if metric.type == "histogram" and not name.endswith(("_seconds", "_bytes")):
        found.append("is a histogram of neither time (_seconds) nor size (_bytes)")
    if TIME_WORDS.search(name) and not name.endswith("_seconds"):
        found.append("measures time but does not end with _seconds")
    if SIZE_WORDS.search(name) and not name.endswith("_bytes"):
        found.append("measures a size but does not end with _bytes")
    for label in metric.labels:
        if label in ID_LABELS or label.endswith(("_id", "_ids")):
            found.append(f"has label {label!r}, which would hold an id (one series per id)")
    return found


def test_every_metric_follows_the_naming_contract() -> None:
    declared = list(_declared())
    assert len(declared) >= 20, [d.name for d in declared]  # the walk found the catalogue
    wrong = [f"{d.where} ({d.name}) {p}" for d in declared for p in _problems(d)]
    assert wrong == []


def test_counters_are_exposed_with_total() -> None:
    declared = list(_declared())
    text = generate_latest(REGISTRY).decode()
    counters = [d.name for d in declared if d.type == "counter"]
    assert "treadle_operations_admitted" in counters and "treadle_tokens" in counters
    for name in counters:
        assert f"# TYPE {name}_total counter" in text or f"# TYPE {name} counter" in text, name
        assert not re.search(rf"^{name}(\{{| )", text, re.M), f"{name}: a sample without _total"


def test_every_registered_treadle_metric_is_a_declared_one() -> None:
    """Nothing registers a treadle_ metric the walk above cannot see (e.g. a collector)."""
    declared = {d.name for d in _declared()}
    registered = {family.name for family in REGISTRY.collect()}
    unknown = sorted(
        name for name in registered - declared if not name.startswith(FOREIGN_PREFIXES)
    )
    assert unknown == []


def test_the_catalogue_names_exist() -> None:
    """The names dashboards and alerts use (dashboards/) are defined, with their labels."""
    labels = {d.name: set(d.labels) for d in _declared()}
    expected = {
        "treadle_http_requests": {"route", "method", "status"},
        "treadle_http_request_duration_seconds": {"route", "method"},
        "treadle_operations_admitted": {"type"},
        "treadle_quota_rejections": {"reason"},
        "treadle_event_appends": {"type"},
        "treadle_event_append_conflicts": {"reason"},
        "treadle_lease_changes": {"reason"},
        "treadle_process_resident_memory_bytes": {"component"},
        "treadle_operations": {"type", "outcome"},
        "treadle_operation_queue_wait_seconds": {"type"},
        "treadle_operation_execution_seconds": {"type"},
        "treadle_operations_in_flight": {"worker"},
        "treadle_operations_queued": {"worker"},
        "treadle_sessions_live": {"worker"},
        "treadle_adapters": {"worker", "state"},
        "treadle_snapshots": {"worker", "state"},
        "treadle_tokens": {"token_class", "base_model", "tenant"},
        "treadle_cost_usd": {"token_class", "base_model", "tenant"},
        "treadle_recoveries": {"outcome"},
        "treadle_replayed_operations": {"type"},
        "treadle_device_memory_bytes": {"worker", "rank", "kind"},
        "treadle_group_ranks": {"worker", "layout"},
    }
    assert {name: labels.get(name) for name in expected} == expected
