"""The `treadle status` verb: the operator's view of the running platform, an HTTP client of
`GET /api/v1/treadle/status` (TREADLE_BASE_URL, TREADLE_API_KEY = the operator's key).

Prints the workers (heartbeat age, alive or not, sessions held, queue depth, metrics address),
live sessions per tenant, the pending operations' count and the oldest pending one, as tables;
`--json` prints the server's answer as it is, for scripts. Registered by `main`; imports the
client only, never the server side.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from treadle.cli import errors
from treadle.cli.billing import render

VERBS = ("status",)
WORKER_COLUMNS = (
    "worker", "heartbeat_age", "alive", "sessions", "queued", "ranks", "layout", "metrics_url"
)  # fmt: skip

MEMORY_COLUMNS = ("worker", "capacity", "base_models", "sessions", "working_set", "free")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status", help="workers, live sessions, pending operations (the operator's key)"
    )
    status.add_argument("--json", action="store_true", help="the whole answer as JSON")


def run(args: argparse.Namespace) -> int:
    import httpx

    from treadle.client.admin import AdminClient

    try:
        client = AdminClient.from_env()
        body = client.status()
    except (RuntimeError, ValueError, httpx.HTTPError) as exc:
        return errors.failed("status", exc)
    sys.stdout.write(json.dumps(body, indent=2) + "\n" if args.json else show(body))
    return 0


def show(body: dict[str, Any]) -> str:
    """The answer of the status route as text tables."""
    workers = body["workers"]
    alive = sum(1 for w in workers if w["is_alive"])
    rows = [
        {
            "worker": w["id"],
            "heartbeat_age": f"{w['heartbeat_age_seconds']:.1f} s",
            "alive": "yes" if w["is_alive"] else "NO",
            "sessions": w["sessions"],
            "queued": w["queued"],
            "metrics_url": w["metrics_url"] or "",
            "ranks": w.get("world_size", 1),
            "layout": w.get("layout") or "",
        }
        for w in workers
    ]
    ttl = body["lease_ttl_seconds"]
    parts = [
        f"Workers: {alive} alive of {len(workers)} "
        f"(alive: heartbeated within the lease TTL, {ttl:g} s)\n",
        render("table", body, WORKER_COLUMNS, rows) if rows else "  none\n",
    ]
    budgets = [
        {
            "worker": w["id"],
            "capacity": _mib(m["capacity_bytes"]),
            "base_models": _mib(m["base_bytes"]),
            "sessions": f"{_mib(m['session_bytes'])} ({m['resident_adapters']} of {m['sessions']})",
            "working_set": _mib(m["working_bytes"]),
            "free": _mib(m["free_bytes"]) + ("" if m["complete"] else " (partial)"),
        }
        for w in workers
        if (m := w.get("memory"))
    ]
    if budgets:
        parts.append(
            "\nMemory per device (admission: base models, resident adapters, a training pass "
            "and the sampler's KV budget)\n"
        )
        parts.append(render("table", body, MEMORY_COLUMNS, budgets))
    models = [
        {
            "model": m["name"],
            "parameters": f"{m['parameters']:,}",
            "bytes": f"{m['size_bytes']:,}",
            "hosts": ", ".join(m["hosts"]) or "NONE",
        }
        for m in body.get("models", [])
    ]
    parts.append(f"\nBase models: {len(models)}\n")
    parts.append(render("table", body, ("model", "parameters", "bytes", "hosts"), models))
    live = body["live_sessions"]
    tenants = [{"tenant": t, "live_sessions": n} for t, n in live.items()]
    parts.append(f"\nLive sessions: {sum(live.values())}\n")
    parts.append(render("table", body, ("tenant", "live_sessions"), tenants) if tenants else "")
    parts.append(f"\nPending operations: {body['pending_operations']}\n")
    oldest = body["oldest_pending"]
    if oldest is not None:
        parts.append(
            f"Oldest pending: {oldest['request_id']} ({oldest['type']}, seq {oldest['seq_id']} "
            f"of {oldest['session_id']}, tenant {oldest['tenant_id']}), "
            f"waiting {oldest['age_seconds']:.1f} s\n"
        )
    return "".join(parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
