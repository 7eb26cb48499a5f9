"""The worker process: a Celery worker (solo pool, prefetch 1, acks_late) hosting sessions.

`run_worker` builds the engine and the session host, starts the metrics server (`gauges`),
registers the wake/stop tasks, starts the lease keeper (`lease_keeper`) and runs Celery until
SIGTERM/SIGINT. Imports platform and the engine; never api.
"""

from __future__ import annotations

import logging
from pathlib import Path

import redis
import sqlalchemy as sa
from celery import Celery
from celery.signals import after_setup_task_logger, worker_ready, worker_shutting_down

from treadle.engine import ALONE, Engine, EngineAPI, Group, GroupExecutor, VllmSettings, heap
from treadle.platform import db, logs
from treadle.platform.checkpoints import storage
from treadle.platform.config import PlatformConfig
from treadle.platform.models import registry
from treadle.platform.sessions import leases, routing
from treadle.worker import gauges
from treadle.worker.host import SessionHost
from treadle.worker.lease_keeper import LeaseKeeper

log = logging.getLogger(__name__)


def build_app(config: PlatformConfig, host: SessionHost) -> Celery:
    app = routing.make_celery(config.redis_url)

    @app.task(name=routing.WAKE_TASK)
    def wake(session_id: str, request_id: str | None = None) -> None:
        host.wake(session_id, request_id)

    @app.task(name=routing.STOP_TASK)
    def stop(session_id: str) -> None:
        host.stop(session_id)

    return app


def new_engine(
    config: PlatformConfig,
    database: sa.Engine,
    *,
    spill_dir: Path,
    group: Group | None = None,
    device: str | None = None,
    pack_cpu_weights: bool | None = None,
) -> Engine:
    """The engine of a worker (or of one rank of a group) as `config` says, reading registered
    models through `database`; `device` and `pack_cpu_weights` override the configured ones."""
    return Engine(
        cache_dir=config.cache_dir,
        device=device or config.device,
        max_loaded_adapters=config.max_loaded_adapters or None,  # 0: no limit
        max_loaded_snapshots=config.max_loaded_snapshots or None,
        spill_dir=spill_dir,
        pack_cpu_weights=config.pack_cpu_weights if pack_cpu_weights is None else pack_cpu_weights,
        activation_checkpointing=config.activation_checkpointing,
        models=registry.ModelRegistry(database).get,
        parallel=ALONE if group is None else group,
        microbatch_tokens=config.microbatch_tokens or None,
        sampler_kv_tokens=config.sampler_kv_tokens,
        vllm=VllmSettings(
            python=config.vllm_python,
            url=config.vllm_url,
            max_lora_rank=config.vllm_max_lora_rank,
            kv_cache_gib=config.vllm_kv_cache_gib,
            devices=config.vllm_devices,
        )
        if config.sampler_backend == "vllm"
        else None,
    )


def run_worker(
    config: PlatformConfig,
    worker_id: str,
    *,
    loglevel: str = "INFO",
    group: Group | None = None,
) -> None:
    """Run the worker `worker_id` until it is shut down: alone, or as rank 0 of `group`, whose
    other ranks follow its engine (`worker/launch.py`)."""
    heap.keep_freed_pages(keep=config.worker_free_heap_bytes)
    database = db.connect(config.database_url, pool_size=4)
    alone = new_engine(config, database, spill_dir=config.spill_dir(worker_id), group=group)
    engine: EngineAPI = alone if group is None else GroupExecutor(alone, group)
    host = SessionHost(
        db=database,
        redis_client=redis.Redis.from_url(config.redis_url),
        engine=engine,
        store=storage.store_from_config(config),
        worker_id=worker_id,
        config=config,
    )
    # A new process never shares a lease epoch with an earlier one of the same id: whatever
    # that one held is released (and claimed again with a new epoch).
    with host.db.begin() as conn:
        released = leases.retire_worker(conn, worker_id, "the worker restarted")
    if released:
        log.info("%s: released %d lease(s) of a previous run", worker_id, len(released))
    metrics_url = gauges.serve(config, host)
    app = build_app(config, host)
    keeper = LeaseKeeper(config, host, app, metrics_url)
    # Start keeping leases once the consumer is connected, so its add_consumer requests land.
    worker_ready.connect(lambda **_: keeper.start(), weak=False)
    # SIGTERM: interrupt the running operation at its next step (it stays pending for the next
    # holder) instead of waiting for it to finish.
    worker_shutting_down.connect(lambda **_: host.close(), weak=False)
    # Celery's task logger gets a plain-text handler of its own: its records go through the
    # root handler (platform/logs) instead, so every line of the worker is in one format.
    after_setup_task_logger.connect(logs.to_root, weak=False)
    # Celery prints its banner straight to stdout, past logging: left out of a JSON log (its
    # connection and readiness are records of their own).
    quiet = ["--quiet"] if config.log_format == "json" else []
    # Celery writes a line for every task it receives and every one that succeeds: two per
    # operation (its wake-up), on the operation's path, saying less than the operation's own
    # record (platform/oplog). Below DEBUG they are left out; a task that fails is still logged,
    # at ERROR.
    if logging.getLevelName(loglevel.upper()) != logging.DEBUG:
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        app.worker_main(
            [
                *quiet,
                "worker",
                "--pool=solo",
                "--concurrency=1",
                f"--hostname={worker_id}",
                f"--queues={routing.DEFAULT_QUEUE}",
                f"--loglevel={loglevel}",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
    finally:
        host.close()
        keeper.stopped.set()
        keeper.join(timeout=10)
        if host.sampler is not None:
            host.sampler.close()  # its batch ends at its next step
        engine.close()  # a group's other ranks stop following
        with host.db.begin() as conn:
            released = leases.retire_worker(conn, worker_id, "the worker shut down")
        log.info("%s: released %d session lease(s) on shutdown", worker_id, len(released))
