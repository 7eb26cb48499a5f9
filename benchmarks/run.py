"""Platform overhead: how long the API takes to admit an operation, and how long a result takes
to reach the client, through the whole stack (HTTP, PostgreSQL, Celery/Redis, worker, long-poll).

Runs the embedded platform (`treadle up`) with one worker on `treadle/tiny-debug`, whose compute
is tiny, so the numbers are mostly platform overhead. Prints medians; record them in
docs/benchmarks.md.  Usage: python benchmarks/run.py [--ops 100]
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.wire_client import WireClient, datum  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=100)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-bench-"))
    key = "tml-bench-" + secrets.token_hex(8)
    try:
        with LocalPlatform(data_dir, free_port(), key) as platform:
            client = WireClient(platform.base_url, key)
            model_id = client.create_model()
            seq = 1
            admit, round_trip = [], []
            for _ in range(args.ops):  # one at a time: latency
                t0 = time.perf_counter()
                rid = client.forward_backward(model_id, seq, [datum([5, 6, 7, 8, 9])]).json()[
                    "request_id"
                ]
                t1 = time.perf_counter()
                client.result(rid)
                t2 = time.perf_counter()
                admit.append((t1 - t0) * 1000)
                round_trip.append((t2 - t0) * 1000)
                seq += 1
            t0 = time.perf_counter()  # pipelined: throughput
            rids = []
            for _ in range(args.ops):
                rids.append(client.optim_step(model_id, seq, lr=0.0).json()["request_id"])
                seq += 1
            for rid in rids:
                client.result(rid)
            pipelined = time.perf_counter() - t0
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    print(f"forward_backward (tiny-debug, 4 tokens), {args.ops} sequential operations:")
    print(f"  admission (POST -> future)      median {statistics.median(admit):7.2f} ms")
    print(f"  round trip (POST -> result)     median {statistics.median(round_trip):7.2f} ms")
    print(f"optim_step, {args.ops} pipelined: {args.ops / pipelined:7.1f} operations/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
