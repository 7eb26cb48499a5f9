"""Round trip of a trivial operation through the SDKs users use: how long one `forward` on 4
tokens of `treadle/tiny-debug` (and one `forward_backward`, one `optim_step`) takes from the
call to its result, one operation at a time, so the numbers are almost all platform overhead.

First the in-process reference: the same forward on the worker's engine in this process. Then
the embedded platform (`treadle up`, one worker) and, for Treadle's own SDK
(`treadle.ServiceClient`) and the official `tinker` SDK (`tinker.ServiceClient` pointed at
Treadle), `--ops` sequential calls of each operation after `--warmup` unmeasured ones; plus the
same forward through a raw HTTP client (POST, then retrieve_future), which shows what the SDK
itself adds; and through no HTTP at all: the API's Flask app built in this process against the
platform's PostgreSQL, Redis and worker, called through Flask's test client, which shows what
the HTTP server and clients add to the platform's own path; and through both SDKs against
`instant_answers.py`, a server in front of the platform that answers the forward's two requests
from memory, which shows what the SDK and HTTP take with no platform at all: with the engine's
forward, a floor that no platform design can go below on this machine. Prints p50 / p90 / p99 in
milliseconds, and the CPU each process spent per Treadle SDK `forward` (this process, the API,
the worker, PostgreSQL, Redis; from psutil): on a machine of few cores the round trip is these
processes taking turns. And, from the worker's operation log, the median queue wait of those
forwards (from the start of the admission's transaction to the start of execution) and their
execution time: the rest of the round trip is the settlement, the notice, HTTP and the SDK.
Record them in docs/benchmarks.md.

Usage: python benchmarks/roundtrip.py [--ops 200] [--warmup 20]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import instant_answers  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import psycopg  # noqa: E402
import tinker  # noqa: E402
from events import cpu_seconds  # noqa: E402
from peft_baseline import worker_pid  # noqa: E402
from tinker import types  # noqa: E402

import treadle  # noqa: E402
from tests.integration.wire_client import WireClient, forward_backward_body  # noqa: E402
from treadle.client.admin import AdminClient  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402

BASE_MODEL = "treadle/tiny-debug"
TOKENS = [5, 6, 7, 8, 9]  # a 4-token model input, its 4 shifted targets
ADAM = types.AdamParams(learning_rate=0.0)  # the weights stay put: every call does the same


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def percentiles(samples_ms: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(samples_ms, n=100, method="inclusive")
    return statistics.median(samples_ms), cuts[89], cuts[98]


def measure(call: Callable[[], Any], ops: int, warmup: int) -> tuple[float, float, float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(ops):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
    return percentiles(samples)


def processes(platform: LocalPlatform) -> dict[str, list[psutil.Process]]:
    """The platform's processes by what they run: this one (the SDK), the API (`treadle up`
    serves it), its worker, the embedded PostgreSQL (its postmaster, found by its data dir
    under the platform's, and its backends) and Redis."""
    assert platform.proc is not None
    root = psutil.Process(platform.proc.pid)
    postgres = [
        proc
        for postmaster in psutil.process_iter(["cmdline"])
        if "-D" in (command := postmaster.info["cmdline"] or [])
        and str(platform.data_dir) in " ".join(command)
        for proc in (postmaster, *postmaster.children())
    ]
    return {
        "SDK (this process)": [psutil.Process()],
        "API": [root],
        "worker": [psutil.Process(worker_pid(platform))],
        "PostgreSQL": postgres,
        "Redis": [c for c in root.children() if "redis-server" in " ".join(c.cmdline())],
    }


def cpu_ms_per_op(
    roles: dict[str, list[psutil.Process]], before: dict[str, float], ops: int
) -> dict[str, float]:
    """Each role's CPU since `before` (`cpu_by_role`), in milliseconds per operation."""
    return {
        role: (seconds - before[role]) * 1000 / ops for role, seconds in cpu_by_role(roles).items()
    }


def cpu_by_role(roles: dict[str, list[psutil.Process]]) -> dict[str, float]:
    return {role: sum(cpu_seconds(p) or 0.0 for p in procs) for role, procs in roles.items()}


def in_process(ops: int, warmup: int) -> tuple[float, float, float]:
    """The same forward on the worker's engine, in this process (CPU, or CUDA when present)."""
    from treadle.engine import Engine
    from treadle.engine.lora.adapters import LoraSpec
    from treadle.engine.losses.functions import EngineDatum
    from treadle.platform.config import DEFAULT_CACHE_DIR

    engine = Engine(cache_dir=DEFAULT_CACHE_DIR)
    engine.create_adapter("bench", BASE_MODEL, LoraSpec(rank=8, alpha=32.0, seed=0))
    data = [
        EngineDatum(
            tokens=tuple(TOKENS[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(TOKENS[1:], dtype=np.int64),
                "weights": np.ones(len(TOKENS) - 1, dtype=np.float32),
            },
        )
    ]

    def forward() -> Any:
        return engine.forward_backward("bench", data, "cross_entropy", forward_only=True)

    result = measure(forward, ops, warmup)
    engine.drop_adapter("bench")
    gc.collect()
    return result


def operations(training: Any) -> dict[str, Callable[[], Any]]:
    """The three trivial operations on a training client of either SDK."""
    return {
        "forward": lambda: training.forward([datum()], "cross_entropy").result(),
        "forward_backward": lambda: training.forward_backward([datum()], "cross_entropy").result(),
        "optim_step": lambda: training.optim_step(ADAM).result(),
    }


def raw_forward(client: WireClient, model_id: str, seq: list[int]) -> Callable[[], Any]:
    def call() -> Any:
        seq[0] += 1
        response = client.forward_backward(model_id, seq[0], [datum()], forward_only=True)
        response.raise_for_status()
        return client.result(response.json()["request_id"])

    return call


@contextlib.contextmanager
def no_http_forward(
    platform: LocalPlatform, admin_key: str, key: str, model_id: str, seq: list[int]
) -> Iterator[Callable[[], Any]]:
    """The raw forward through the API's Flask app built in this process (the platform's
    PostgreSQL, Redis and worker; Flask's test client for the two requests): the platform's path
    with no HTTP server, no HTTP client and no SDK. The app's connections close on leaving."""
    from treadle.api.app import create_app
    from treadle.platform.config import PlatformConfig

    state = json.loads((platform.data_dir / "up.json").read_text())
    env = {**os.environ, "DATABASE_URL": state["database_url"], "REDIS_URL": state["redis_url"],
           "TREADLE_ADMIN_KEY": admin_key, "TREADLE_DATA_DIR": str(platform.data_dir)}  # fmt: skip
    app = create_app(PlatformConfig.from_env(env))
    client = app.test_client()
    headers = {"X-API-Key": key}

    def call() -> Any:
        seq[0] += 1
        response = client.post(
            "/api/v1/forward_backward",
            data=forward_backward_body(model_id, seq[0], [datum()], forward_only=True),
            headers={**headers, "Content-Type": "application/x-protobuf"},
        )
        assert response.status_code == 200, response.text
        body = {"request_id": response.get_json()["request_id"]}
        while (
            response := client.post("/api/v1/retrieve_future", json=body, headers=headers)
        ).status_code == 408:
            pass  # still running: poll again, as the SDKs do
        assert response.status_code == 200, response.text
        return response.data

    try:
        yield call
    finally:
        app.extensions["treadle"].close()


@contextlib.contextmanager
def instant_server(platform: LocalPlatform) -> Iterator[str]:
    """The base URL of `instant_answers.py` in front of the platform, in a process of its own
    (as the API is), for the block."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("instant_answers.py")),
         "--upstream", platform.base_url],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.kill()
        proc.wait()


def same_forward(a: Any, b: Any) -> bool:
    """Whether two `forward` results carry the same loss and logprobs."""
    return bool(
        a.metrics == b.metrics
        and [o["logprobs"].tolist() for o in a.loss_fn_outputs]
        == [o["logprobs"].tolist() for o in b.loss_fn_outputs]
    )


def instant_forward(
    sdk: str, url: str, key: str, ops: int, warmup: int
) -> tuple[tuple[float, float, float], float]:
    """An SDK's `forward` against instant answers: the first goes through to the platform, every
    later one is answered from memory (checked to be the same result). Returns its percentiles
    and the median of the part a platform's execution would overlap (`instant_answers.py`)."""
    if sdk == "treadle":
        svc: Any = treadle.ServiceClient(base_url=url, api_key=key)
        training = svc.create_lora_training_client(BASE_MODEL, rank=8, seed=0)
    else:
        svc = tinker.ServiceClient(base_url=url, api_key=key)
        training = svc.create_lora_training_client(BASE_MODEL, rank=8, seed=0).result()
    call = operations(training)["forward"]
    first = call()
    for _ in range(warmup):
        call()
    overlap = f"{url}{instant_answers.OVERLAP}"
    httpx.get(overlap)  # counts from here
    result = measure(call, ops, 0)
    overlap_ms = float(httpx.get(overlap).json()["median_ms"])
    assert same_forward(call(), first), "instant answers must repeat the platform's"
    if sdk == "treadle":
        svc.close()
    else:
        svc.close("success").result()
    return result, overlap_ms


@contextlib.contextmanager
def durable_commit(platform: LocalPlatform) -> Iterator[Callable[[], Any]]:
    """One row inserted and committed on the platform's PostgreSQL, in a table of a scratch
    database beside the platform's (both go with the embedded platform's data dir): the least a
    durable write costs here. An operation needs two, its admission and its settlement."""
    url = json.loads((platform.data_dir / "up.json").read_text())["database_url"]
    url = url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("CREATE DATABASE roundtrip_commits")
    with psycopg.connect(psycopg.conninfo.make_conninfo(url, dbname="roundtrip_commits")) as conn:
        conn.execute("CREATE TABLE commits (n integer)")  # logged: a temporary table is not
        conn.commit()

        def call() -> None:
            conn.execute("INSERT INTO commits VALUES (1)")
            conn.commit()

        yield call


def worker_split(
    platform: LocalPlatform, model_id: str, skip: int, count: int
) -> tuple[float, float]:
    """Median queue wait and execution, in ms, of the session's `forward`s `skip`..`skip+count`
    (in seq order), from its worker's operation log lines."""
    lines = [
        json.loads(line)
        for path in sorted((platform.data_dir / "logs").glob("worker*.log"))
        for line in path.read_text().splitlines()
        if '"treadle.operations"' in line
    ]
    ops = sorted(
        (
            o
            for o in lines
            if o.get("session_id") == model_id and o.get("type") == "forward_backward"
        ),
        key=lambda o: o["seq_id"],
    )[skip : skip + count]
    assert len(ops) == count, f"found {len(ops)} of {count} operation log lines"
    return (
        statistics.median(o["queue_wait_seconds"] for o in ops) * 1000,
        statistics.median(o["execution_seconds"] for o in ops) * 1000,
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    rows: list[tuple[str, tuple[float, float, float]]] = []
    cpu_ms: dict[str, float] = {}  # per treadle SDK forward, by process
    split_ms = (0.0, 0.0)  # the worker's queue wait and execution of those forwards
    overlap_ms: dict[str, float] = {}  # per SDK, against instant answers (`instant_forward`)
    rows.append(("in-process engine forward", in_process(args.ops, args.warmup)))
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-roundtrip-bench-"))
    admin_key = "tml-bench-" + secrets.token_hex(8)
    try:
        with LocalPlatform(data_dir, free_port(), admin_key, workers=1) as platform:
            admin = AdminClient(platform.base_url, admin_key)
            key = admin.create_tenant(f"roundtrip-{secrets.token_hex(3)}")["api_key"]
            admin.close()

            svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
            training = svc.create_lora_training_client(BASE_MODEL, rank=8, seed=0)
            roles = processes(platform)
            for name, call in operations(training).items():
                before = cpu_by_role(roles)
                rows.append((f"treadle SDK {name}", measure(call, args.ops, args.warmup)))
                if name == "forward":
                    cpu_ms = cpu_ms_per_op(roles, before, args.ops + args.warmup)
                    split_ms = worker_split(platform, training.model_id, args.warmup, args.ops)
            svc.close()

            tsvc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
            ttraining = tsvc.create_lora_training_client(BASE_MODEL, rank=8, seed=0).result()
            for name, call in operations(ttraining).items():
                rows.append((f"tinker SDK {name}", measure(call, args.ops, args.warmup)))
            tsvc.close("success").result()

            # Not an SDK: what the platform alone takes, for the SDKs' own share.
            wire = WireClient(platform.base_url, key)
            model_id = wire.create_model(BASE_MODEL, rank=8)
            seq = [0]  # the model's seq_ids, which both rows below take in turn
            rows.append(
                ("raw HTTP forward (no SDK)", measure(raw_forward(wire, model_id, seq), args.ops,
                                                      args.warmup))
            )  # fmt: skip
            with no_http_forward(platform, admin_key, key, model_id, seq) as call:
                rows.append(
                    ("no HTTP (API app in this process)", measure(call, args.ops, args.warmup))
                )
            wire.http.close()

            with durable_commit(platform) as call:
                rows.append(("durable commit (PostgreSQL)", measure(call, args.ops, args.warmup)))
            with instant_server(platform) as url:
                for sdk in ("treadle", "tinker"):
                    result, overlap_ms[sdk] = instant_forward(sdk, url, key, args.ops, args.warmup)
                    rows.append((f"{sdk} SDK, instant answers", result))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print(
        f"{BASE_MODEL}, 4-token datum, {args.ops} sequential operations after {args.warmup} "
        "warm-up, milliseconds:"
    )
    print(f"  {'':34} {'p50':>8} {'p90':>8} {'p99':>8}")
    for name, (p50, p90, p99) in rows:
        print(f"  {name:34} {p50:8.2f} {p90:8.2f} {p99:8.2f}")
    print("CPU per treadle SDK forward by process, milliseconds (warm-up included):")
    for role, ms in cpu_ms.items():
        print(f"  {role:34} {ms:8.2f}")
    print(f"  {'all':34} {sum(cpu_ms.values()):8.2f}")
    medians = {name: p50 for name, (p50, _, _) in rows}
    engine, alone = medians["in-process engine forward"], medians["treadle SDK, instant answers"]
    commit = medians["durable commit (PostgreSQL)"]
    print("Floor of a treadle SDK forward here, before the platform's own work (p50s, ms):")
    print(f"  {'the engine forward':34} {engine:8.2f}")
    print(f"  {'+ the SDK against instant answers':34} {alone:8.2f}")
    print(f"  {'- what execution would overlap':34} {overlap_ms['treadle']:8.2f}")
    print(f"  {'+ two durable commits':34} {2 * commit:8.2f}")
    print(f"  {'floor':34} {engine + alone - overlap_ms['treadle'] + 2 * commit:8.2f}")
    print("Where a treadle SDK forward waits, from the worker's log (medians, milliseconds):")
    print(f"  {'admission to execution start':34} {split_ms[0]:8.2f}")
    print(f"  {'execution':34} {split_ms[1]:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
