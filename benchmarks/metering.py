"""Metering's cost: the round trip of a trivial operation with metering and quotas on, and with
them off (TREADLE_METERING=0), in one run.

Starts two embedded platforms (`treadle up`, one worker each, `treadle/tiny-debug`) side by side.
On the metered one a price is set for every token class and the tenant has every quota (budget,
monthly tokens, sessions, request rate, request size), all far from binding, so each request
runs every check: the rate limiter's Redis script, the quota read, the reservation under the
tenant's month lock, and at completion the usage row, the release and the counters. Each
operation is a sequential `forward_backward` of one 4-token datum; rounds alternate between the
two platforms (and which goes first) so drift on a noisy machine falls on both alike. Prints
medians; record them in docs/benchmarks.md.
Usage: python benchmarks/metering.py [--ops 200] [--rounds 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.wire_client import WireClient, datum  # noqa: E402
from treadle.platform import db  # noqa: E402
from treadle.platform.billing import prices, quotas  # noqa: E402
from treadle.platform.embedded import free_port  # noqa: E402
from treadle.platform.tenancy import keys, tenants  # noqa: E402
from treadle.recipes.platform_process import LocalPlatform  # noqa: E402

BASE_MODEL = "treadle/tiny-debug"
TENANT = "bench"
WARMUP = 10


@dataclass
class Side:
    name: str
    platform: LocalPlatform
    engine: sa.Engine
    client: WireClient | None = None
    model_id: str = ""
    seq: int = 1
    admit: list[float] = field(default_factory=list)
    round_trip: list[float] = field(default_factory=list)

    def one(self, record: bool) -> None:
        assert self.client is not None
        t0 = time.perf_counter()
        answer = self.client.forward_backward(self.model_id, self.seq, [datum([5, 6, 7, 8, 9])])
        t1 = time.perf_counter()
        assert answer.status_code == 200, answer.text
        self.client.result(answer.json()["request_id"])
        t2 = time.perf_counter()
        self.seq += 1
        if record:
            self.admit.append((t1 - t0) * 1000)
            self.round_trip.append((t2 - t0) * 1000)

    def usage_rows(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM usage")).scalar_one())


def start(stack: contextlib.ExitStack, root: Path, name: str, metering: bool) -> Side:
    admin_key = "tml-bench-" + secrets.token_hex(8)
    platform = LocalPlatform(root / name, free_port(), admin_key)
    platform.env["TREADLE_METERING"] = "1" if metering else "0"
    stack.enter_context(platform)
    database_url = json.loads((platform.data_dir / "up.json").read_text())["database_url"]
    engine = db.connect(database_url, pool_size=1)
    stack.callback(engine.dispose)
    with engine.begin() as conn:
        _, member_key = keys.create_tenant_key(conn, TENANT, tenants.Role.MEMBER)
        if metering:
            operator = keys.authenticate(conn, admin_key)
            for token_class, usd in (("prefill", "0.1"), ("sample", "0.4"), ("train", "0.3")):
                prices.set_price(conn, operator, base_model=BASE_MODEL, token_class=token_class,
                                 usd_per_million=usd)  # fmt: skip
            limits = quotas.Quota(
                monthly_micro_usd=10**12,
                monthly_tokens=10**12,
                max_sessions=100,
                requests_per_second=1e6,
                max_request_tokens=10**6,
            )
            quotas.set_quota(conn, operator, TENANT, limits)
    side = Side(name, platform, engine)
    side.client = WireClient(platform.base_url, member_key)
    stack.callback(side.client.http.close)
    side.model_id = side.client.create_model()
    return side


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=200, help="measured operations per platform")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    per_round = max(1, args.ops // args.rounds)
    root = Path(tempfile.mkdtemp(prefix="treadle-bench-metering-"))
    try:
        with contextlib.ExitStack() as stack:
            on = start(stack, root, "metered", metering=True)
            off = start(stack, root, "unmetered", metering=False)
            for side in (on, off):
                for _ in range(WARMUP):
                    side.one(record=False)
            for r in range(args.rounds):
                for side in (on, off) if r % 2 == 0 else (off, on):
                    for _ in range(per_round):
                        side.one(record=True)
            rows = on.usage_rows(), off.usage_rows()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = args.rounds * per_round
    print(f"forward_backward (tiny-debug, 4 tokens), {n} sequential operations per platform,")
    print(f"in {args.rounds} alternating rounds; usage rows written: on {rows[0]}, off {rows[1]}")
    print(f"{'':34}{'metering on':>14}{'metering off':>14}{'on / off':>10}")
    for what, a, b in (
        ("admission (POST -> future)", on.admit, off.admit),
        ("round trip (POST -> result)", on.round_trip, off.round_trip),
    ):
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"  {what:32}{ma:11.2f} ms{mb:11.2f} ms{ma / mb:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
