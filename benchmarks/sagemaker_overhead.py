"""SageMaker's runtime against the Tinker route: the API's own time per operation, for the same
operations sent by each surface's official SDK (`sagemaker-train`; the `tinker` SDK through
Treadle's), on one platform.

`treadle up` runs PostgreSQL, Redis and a worker; this process serves a second API on the same
database (the same app `create_app` builds), timing every request it answers from its arrival
to its answer (Flask's before/after request hooks), less the time it waited for the worker (a
long-poll's wait for the result's notice, not its reads of the database: the tinker SDK polls
at once, SageMaker's when asked).
Operations go one at a time, the two surfaces' alternating: each is submitted through the SDK,
settled by the worker, then its result fetched. Server time per operation = median submit + median fetch; the ratio is
SageMaker's over Tinker's. Prints a table; record it in docs/benchmarks.md.

Usage: python benchmarks/sagemaker_overhead.py [--ops 30] [--model treadle/tiny-debug]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import sqlalchemy as sa
from flask import Response, g, request
from waitress.server import create_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import treadle  # noqa: E402
from tests.compat.users import aws_env, new_aws_user  # noqa: E402
from treadle.api.app import create_app  # noqa: E402
from treadle.platform import db  # noqa: E402
from treadle.platform.config import PlatformConfig  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402

Submits = dict[str, Callable[[], Any]]
ROLE = "arn:aws:iam::123456789012:role/SageMakerTrainingSessionsRole"
GROUP = "arn:aws:sagemaker:us-west-2:123456789012:model-package-group/bench"
OPERATIONS = ("forward_backward", "optim_step", "sample", "save_weights")
SUBMIT_ROUTES = {
    "/v1/training-sessions/<name>/operations",
    "/v1/training-sessions/<name>/sampling-operations",
    "/api/v1/forward_backward",
    "/api/v1/optim_step",
    "/api/v1/asample",
    "/api/v1/save_weights_for_sampler",
}
RESULT_ROUTES = {
    "/v1/training-sessions/<name>/operations/<operation_id>",
    "/v1/training-sessions/<name>/sampling-operations/<operation_id>",
    "/api/v1/retrieve_future",
}


class Timings:
    """Each answered request's milliseconds, under the phase running when it came, less the
    time it waited for a worker (a long-poll's wait for the result's notice)."""

    def __init__(self) -> None:
        self.phase = ""
        self.ms: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    def install(self, app: Any) -> None:
        notices = app.extensions["treadle"].notices
        wait_until = notices.wait_until

        def timed_wait(request_id: str, check: Any, *args: Any, **kwargs: Any) -> Any:
            """wait_until, its time counted as waiting but for its reads (`check`)."""
            reading = 0.0

            def timed_check() -> Any:
                nonlocal reading
                started = time.perf_counter()
                try:
                    return check()
                finally:
                    reading += time.perf_counter() - started

            started = time.perf_counter()
            try:
                return wait_until(request_id, timed_check, *args, **kwargs)
            finally:
                waited = time.perf_counter() - started - reading
                g.waited = g.get("waited", 0.0) + waited

        notices.wait_until = timed_wait

        @app.after_request
        def record(response: Response) -> Response:
            started = g.get("metrics_started")  # set first of all hooks (api/telemetry.py)
            rule = request.url_rule.rule if request.url_rule is not None else ""
            kind = "submit" if rule in SUBMIT_ROUTES else "fetch" if rule in RESULT_ROUTES else ""
            if started is not None and kind and self.phase:
                spent = time.perf_counter() - started - g.get("waited", 0.0)
                with self._lock:
                    self.ms[self.phase, kind].append(spent * 1000)
            return response


def settled_count(engine: sa.Engine, tenant: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM operations WHERE tenant_id = :t AND status != 'pending'"
                ),
                {"t": tenant},
            ).scalar_one()
        )


def one(timings: Timings, name: str, engine: sa.Engine, tenant: str, submit: Any) -> None:
    """One operation: submitted through the SDK, settled by the worker, then fetched."""
    timings.phase = name
    before = settled_count(engine, tenant)
    future = submit()
    deadline = time.monotonic() + 600
    while settled_count(engine, tenant) <= before:
        assert time.monotonic() < deadline, f"{name} did not settle"
        time.sleep(0.01)
    future.result()
    timings.phase = ""


@contextmanager
def sagemaker_session(base_url: str, pair: dict[str, str], model: str) -> Iterator[Submits]:
    """A session through SageMaker's SDK: one submit per operation type."""
    with mock.patch.dict(os.environ, aws_env(base_url, pair)):
        from sagemaker.train.training_session import (
            AdamParams,
            Datum,
            ModelInput,
            SamplingParams,
            ServiceClient,
            TensorData,
        )

        svc = ServiceClient(role_arn=ROLE, region="us-west-2")
        with svc.create_lora_training_client(
            model, training_session_name=f"bench-{secrets.token_hex(3)}", rank=8, alpha=16,
            model_package_group_arn=GROUP, s3_output_path="s3://bucket/bench",
        ) as tc:  # fmt: skip
            tokens = list(range(5, 21))
            datum = Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": TensorData(data=tokens[1:]),
                "weights": TensorData(data=[1.0] * (len(tokens) - 1)),
            })  # fmt: skip
            sampler = tc.save_weights_and_get_sampling_client()
            params = SamplingParams(max_tokens=512, temperature=1.0, seed=1)
            yield {
                "forward_backward": lambda: tc.forward_backward([datum], loss_fn="cross_entropy"),
                "optim_step": lambda: tc.optim_step(AdamParams(learning_rate=1e-4)),
                "sample": lambda: sampler.sample(
                    ModelInput.from_ints([1, 2, 3]), num_samples=1, sampling_params=params
                ),  # fmt: skip
                "save_weights": lambda: tc.save_weights_for_sampler(),
            }


@contextmanager
def tinker_session(base_url: str, api_key: str, model: str) -> Iterator[Submits]:
    """A session through the tinker SDK (Treadle's): one submit per operation type."""
    svc = treadle.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        with svc.create_lora_training_client(model, rank=8, alpha=16) as tc:
            tokens = list(range(5, 21))
            datum = treadle.Datum(
                model_input=treadle.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
            sampler = tc.save_weights_and_get_sampling_client()
            params = treadle.SamplingParams(max_tokens=512, temperature=1.0, seed=1)
            counter = iter(range(10**6))
            yield {
                "forward_backward": lambda: tc.forward_backward([datum], loss_fn="cross_entropy"),
                "optim_step": lambda: tc.optim_step(treadle.AdamParams(learning_rate=1e-4)),
                "sample": lambda: sampler.sample([1, 2, 3], num_samples=1, sampling_params=params),
                "save_weights": lambda: tc.save_weights_for_sampler(f"w-{next(counter)}"),
            }
    finally:
        svc.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=30)
    parser.add_argument("--model", default="treadle/tiny-debug")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-bench-sm-"))
    key = "tml-bench-" + secrets.token_hex(8)
    timings = Timings()
    try:
        with LocalPlatform(data_dir, free_port(), key) as platform:
            state = json.loads((data_dir / "up.json").read_text())
            config = PlatformConfig(
                database_url=state["database_url"],
                redis_url=state["redis_url"],
                data_dir=data_dir,
                admin_key=key,
                secrets_key=(data_dir / "secrets_key").read_text().strip(),
            )
            app = create_app(config)
            timings.install(app)
            server = create_server(app, host="127.0.0.1", port=free_port(), threads=64)
            threading.Thread(target=server.run, daemon=True).start()
            base_url = f"http://127.0.0.1:{server.effective_port}"
            engine = db.connect(state["database_url"], pool_size=1)
            sm_user = new_aws_user(platform, "bench")
            tk_user = new_aws_user(platform, "bench")
            with (
                tinker_session(base_url, tk_user["api_key"], args.model) as tinker,
                sagemaker_session(base_url, sm_user, args.model) as sagemaker,
            ):
                surfaces = {"tinker": (tinker, tk_user), "sagemaker": (sagemaker, sm_user)}
                for op in OPERATIONS:  # the two surfaces' operations alternate, one each
                    for _ in range(args.ops):
                        for surface, (submits, user) in surfaces.items():
                            one(timings, f"{surface}:{op}", engine, user["tenant_id"], submits[op])
            server.close()
            engine.dispose()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print(f"API time per operation, ms (medians of {args.ops} operations of each type, "
          f"{args.model}):")  # fmt: skip
    print(f"{'operation':18} {'tinker submit':>14} {'fetch':>7} {'sum':>7}   "
          f"{'sagemaker submit':>16} {'fetch':>7} {'sum':>7}   ratio")  # fmt: skip
    for op in OPERATIONS:
        row = []
        for surface in ("tinker", "sagemaker"):
            submit = statistics.median(timings.ms[f"{surface}:{op}", "submit"])
            fetch = statistics.median(timings.ms[f"{surface}:{op}", "fetch"])
            row.append((submit, fetch, submit + fetch))
        (ts, tf, tsum), (ss, sf, ssum) = row
        print(f"{op:18} {ts:14.2f} {tf:7.2f} {tsum:7.2f}   {ss:16.2f} {sf:7.2f} {ssum:7.2f}   "
              f"{ssum / tsum:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
