"""The worker's gauges and its metrics server.

`serve` registers the gauges, starts the worker's metrics HTTP server
(TREADLE_WORKER_METRICS_PORT; 0 or a port in use: any free one) and returns the URL that goes
into the worker's heartbeat ("metrics_url"). The gauges (operations in flight and queued, live
sessions, adapters and snapshots in memory and paged out, device memory by rank, a worker
group's ranks) are read at scrape time by `WorkerGauges`, never refreshed on a timer; reading
them never waits for a running operation (a group's other ranks report their memory at rank 0's
pings, between operations). The counters and histograms are `telemetry`'s. No session, request
or key ids in labels. Imports platform only; never api.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable

import sqlalchemy as sa
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from treadle.platform import metrics
from treadle.platform.config import PlatformConfig
from treadle.platform.sessions import leases
from treadle.worker.host import SessionHost

log = logging.getLogger(__name__)


class WorkerGauges(Collector):
    """The worker's gauges, read when Prometheus scrapes (labelled with the worker id)."""

    def __init__(self, host: SessionHost) -> None:
        self.host = host

    def describe(self) -> Iterable[Metric]:
        return gauge_families()

    def collect(self) -> Iterable[Metric]:
        return gauge_families(self.host)


def gauge_families(host: SessionHost | None = None) -> list[Metric]:
    """The worker's gauge families; with `host`, holding its values now."""
    worker = [] if host is None else [host.worker_id]
    family = GaugeMetricFamily
    in_flight = family(
        "treadle_operations_in_flight",
        "Operations running on the engine now (each sample of a batch counts)",
        labels=["worker"],
    )
    queued = family(
        "treadle_operations_queued",
        "Pending operations of the sessions leased to this worker",
        labels=["worker"],
    )
    live = family(
        "treadle_sessions_live", "Active sessions leased to this worker", labels=["worker"]
    )
    adapters = family(
        "treadle_adapters",
        'Session adapters in memory ("resident") or paged out to disk ("paged")',
        labels=["worker", "state"],
    )
    snapshots = family(
        "treadle_snapshots",
        'Sampling snapshots in memory ("resident") or paged out to disk ("paged")',
        labels=["worker", "state"],
    )
    device = family(
        "treadle_device_memory_bytes",
        'CUDA memory of each rank: "allocated" by tensors, "reserved" by the allocator (a '
        "group's other ranks as of rank 0's last ping)",
        labels=["worker", "rank", "kind"],
    )
    ranks = family(
        "treadle_group_ranks",
        "Ranks of this worker's group (torch.distributed), by how it holds base models",
        labels=["worker", "layout"],
    )
    families: list[Metric] = [in_flight, queued, live, adapters, snapshots, device, ranks]
    if host is None:
        return families
    running = 0 if host.running() is None else 1
    in_flight.add_metric(worker, running + len(host.running_samples()))
    load = _read_load(host)
    if load is not None:  # the database down: the gauges it gives are left out
        live.add_metric(worker, load[0])
        queued.add_metric(worker, load[1])
    resident, paged = host.engine.adapter_counts()
    adapters.add_metric([*worker, "resident"], resident)
    adapters.add_metric([*worker, "paged"], paged)
    resident, paged = host.engine.snapshot_counts()
    snapshots.add_metric([*worker, "resident"], resident)
    snapshots.add_metric([*worker, "paged"], paged)
    if (group := host.engine.topology()) is not None:
        ranks.add_metric([*worker, group.layout], group.world_size)
    for rank, memory in sorted(host.engine.rank_memory().items()):
        for kind, value in memory.items():
            device.add_metric([*worker, str(rank), kind], value)
    return families


def serve(config: PlatformConfig, host: SessionHost) -> str:
    """Register the worker's gauges, start its metrics server and return its URL."""
    REGISTRY.register(WorkerGauges(host))
    metrics.PROCESS_MEMORY.labels("worker").set_function(metrics.resident_memory_bytes)
    addr, port = config.worker_metrics_addr, config.worker_metrics_port
    try:
        server, _ = start_http_server(port, addr)
    except OSError as exc:  # e.g. two `treadle up` on one machine: any free port, logged
        if port == 0:
            raise
        log.warning(
            "%s: metrics port %d on %s is not free (%s); serving metrics on a free port "
            "instead (see metrics_url in `treadle status`)", host.worker_id, port, addr, exc,
        )  # fmt: skip
        server, _ = start_http_server(0, addr)
    shown = addr if addr not in ("0.0.0.0", "::", "") else socket.gethostname()
    if ":" in shown:
        shown = f"[{shown}]"  # an IPv6 address
    url = f"http://{shown}:{server.server_port}/metrics"
    log.info("%s: serving Prometheus metrics at %s", host.worker_id, url)
    return url


def _read_load(host: SessionHost) -> tuple[int, int] | None:
    try:
        with host.db.connect() as conn:
            return leases.worker_load(conn, host.worker_id)
    except sa.exc.SQLAlchemyError as exc:
        log.warning("%s: metrics could not read the sessions' load: %s", host.worker_id, exc)
        return None
