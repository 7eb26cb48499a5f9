"""Failover: from `kill -9` of a session's worker to the next result in the client.

Runs the embedded platform (`treadle up`, 2 workers, the default heartbeat and lease settings)
and a training loop through Treadle's SDK. Each trial kills the session's worker between two
steps, then sends the next `forward_backward` and times it to its result. Two cases: the kill
comes right after an automatic checkpoint (0 operations to replay), or 20 operations after one.
The rebuild's own time (load the checkpoint, replay, verify) is read from the `SessionRecovered`
event. Prints medians; record them in docs/benchmarks.md.

Usage: python benchmarks/failover.py [--trials 5] [--model treadle/tiny-debug]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import treadle  # noqa: E402
from treadle.platform import db  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402

EVERY = 11  # optimizer steps between automatic checkpoints: 10 steps after one = 20 operations


def batch(step: int) -> list[treadle.Datum]:
    ids = [(5 * step + 3 * i) % 200 + 1 for i in range(33)]
    return [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
        )
    ]


def step(tc: Any, i: int) -> None:
    fb = tc.forward_backward(batch(i), loss_fn="cross_entropy")
    tc.optim_step(treadle.AdamParams(learning_rate=1e-3)).result()
    fb.result()


def wait(check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception:
            pass
        time.sleep(0.1)
    raise TimeoutError("gave up waiting")


def trial(
    data_dir: Path, engine: sa.Engine, svc: Any, model: str, since: int
) -> tuple[float, float]:
    """One kill, `since` operations after an automatic checkpoint; (seconds to the next result,
    seconds the rebuild itself took)."""
    tc = svc.create_lora_training_client(model, rank=16, seed=1)
    steps = EVERY + since // 2
    for i in range(steps):
        step(tc, i)
    # The kill comes once the automatic checkpoint after step EVERY is written.
    wait(lambda: _latest_point(engine, tc.model_id) == 2 * EVERY, 60)
    with engine.connect() as conn:
        worker_id, recovered = conn.execute(
            sa.text(
                "SELECT worker_id, (SELECT count(*) FROM events e WHERE e.session_id = s.id "
                "AND e.type = 'SessionRecovered') FROM sessions s WHERE id = :id"
            ),
            {"id": tc.model_id},
        ).one()
    state = json.loads((data_dir / "up.json").read_text())
    os.kill(state["workers"][worker_id]["pid"], signal.SIGKILL)
    killed = time.perf_counter()
    tc.forward_backward(batch(steps), loss_fn="cross_entropy").result()
    elapsed = time.perf_counter() - killed
    with engine.connect() as conn:
        event = conn.execute(
            sa.text(
                "SELECT data FROM events WHERE session_id = :id AND type = 'SessionRecovered' "
                "ORDER BY seq DESC LIMIT 1"
            ),
            {"id": tc.model_id},
        ).scalar_one()
    assert event is not None and recovered == 0
    assert event["replayed"] == since, event
    tc.stop()
    # The killed worker is restarted by `treadle up`; wait until both are up again.
    wait(lambda: _live_workers(engine) == 2, 120)
    return elapsed, float(event["seconds"])


def _latest_point(engine: sa.Engine, model_id: str) -> int | None:
    with engine.connect() as conn:
        return conn.execute(  # type: ignore[no-any-return]
            sa.text("SELECT max(seq_id) FROM auto_checkpoints WHERE session_id = :id"),
            {"id": model_id},
        ).scalar_one()


def _live_workers(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM workers WHERE heartbeat_at > now() - interval '3 s'")
            ).scalar_one()
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--model", default="treadle/tiny-debug")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-failover-"))
    key = "tml-bench-" + secrets.token_hex(8)
    os.environ["TREADLE_AUTO_CHECKPOINT_STEPS"] = str(EVERY)
    results: dict[int, list[tuple[float, float]]] = {0: [], 20: []}
    try:
        with LocalPlatform(data_dir, free_port(), key, workers=2) as platform:
            state = wait(lambda: json.loads((data_dir / "up.json").read_text()), 60)
            engine = db.connect(state["database_url"], pool_size=2)
            wait(lambda: _live_workers(engine) == 2, 120)
            svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
            for _ in range(args.trials):
                for since in results:
                    results[since].append(trial(data_dir, engine, svc, args.model, since))
            engine.dispose()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print(f"failover on {args.model}, kill -9 of the session's worker, {args.trials} trials:")
    for since, runs in results.items():
        total = statistics.median(r[0] for r in runs)
        rebuild = statistics.median(r[1] for r in runs)
        print(
            f"  {since:2d} operations since the last checkpoint: kill -> next result median "
            f"{total:6.2f} s (rebuild itself {rebuild:5.2f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
