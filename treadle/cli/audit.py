"""The `treadle sessions list` and `treadle audit SESSION` verbs: HTTP clients of the audit
routes (TREADLE_BASE_URL, TREADLE_API_KEY).

`sessions list` prints the listing as a table, CSV or JSON; `audit` prints one line per
operation (time, seq, type, actor, queue wait, execution time, tokens by class, outcome) with the
session's lease, checkpoint, recovery and stop events between them, as JSON lines with `--json`,
tails a live session with `--follow`, and writes every event in full as JSON lines with
`--export FILE`. Registered by `main`; imports the client only, never the server side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from treadle.cli import errors
from treadle.cli.billing import FORMATS, render

VERBS = ("sessions", "audit")
SESSION_COLUMNS = (
    "model_id", "name", "kind", "status", "base_model", "rank", "owner", "created_at",
    "last_active_at", "operations", "prefill_tokens", "sample_tokens", "train_tokens",
    "cost_usd", "worker_id",
)  # fmt: skip
COLUMNS = ("time", "seq", "type", "actor", "queue_wait", "execution", "prefill", "sample",
           "train", "outcome")  # fmt: skip
RIGHT = {"seq", "queue_wait", "execution", "prefill", "sample", "train"}
WIDTHS = {"time": 23, "seq": 5, "type": 24, "actor": 20, "queue_wait": 10, "execution": 10,
          "prefill": 7, "sample": 7, "train": 7}  # fmt: skip
FOLLOW_PAGE = 500
ACTIVE = ("Created", "Running")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sessions = sub.add_parser("sessions", help="list sessions with their usage")
    verbs = sessions.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="sessions, newest first")
    listing.add_argument("--tenant", default=None, help="the operator's: another tenant, or '*'")
    listing.add_argument("--status", default=None, help="e.g. Running, Stopped")
    listing.add_argument("--kind", default=None, help="e.g. training, sampling")
    listing.add_argument("--since", default=None, help="YYYY-MM-DD (UTC) or an ISO 8601 time")
    listing.add_argument("--limit", type=int, default=None, help="at most this many")
    listing.add_argument("--format", choices=FORMATS, default="table", help="default: table")
    audit = sub.add_parser("audit", help="a session's operations and events, one line each")
    audit.add_argument("session", help="the model id, e.g. sess-...:train:0")
    audit.add_argument("--json", action="store_true", help="JSON lines, one row each")
    audit.add_argument("--follow", action="store_true", help="tail a live session until it stops")
    audit.add_argument(
        "--export", type=Path, default=None, metavar="FILE",
        help="write every event, in full, to FILE as JSON lines",
    )  # fmt: skip
    audit.add_argument("--poll", type=float, default=1.0, help="--follow: seconds between polls")


def run(args: argparse.Namespace) -> int:
    import httpx

    from treadle.client.audit import AuditClient

    verb = "sessions list" if args.command == "sessions" else "audit"
    try:
        client = AuditClient.from_env()
        if args.command == "sessions":
            _sessions(client, args)
        elif args.export is not None:
            _export(client, args)
        else:
            _audit(client, args)
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as exc:
        return errors.failed(verb, exc)
    except KeyboardInterrupt:
        return 130
    return 0


def _sessions(client: Any, args: argparse.Namespace) -> None:
    rows = client.list_sessions(
        tenant=args.tenant, status=args.status, kind=args.kind, since=args.since, limit=args.limit
    )
    out = render(args.format, {"sessions": rows}, SESSION_COLUMNS, rows)
    print(out, end="" if out.endswith("\n") else "\n")


def _export(client: Any, args: argparse.Namespace) -> None:
    """Every event in full, one JSON object a line (followed live with --follow)."""
    if args.follow:
        stream = client.follow(args.session, args.poll, full=True)
    else:
        stream = client.events(args.session, full=True)
    count = 0
    with args.export.open("w") as out:
        for event in stream:
            out.write(json.dumps(event, separators=(",", ":")) + "\n")
            out.flush()
            count += 1
    print(f"wrote {count} events of {args.session} to {args.export}", file=sys.stderr)


def _audit(client: Any, args: argparse.Namespace) -> None:
    if args.follow:
        rows: Iterable[dict[str, Any]] = _follow(client, args.session, args.poll)
        widths = WIDTHS
    else:
        rows = client.timeline(args.session)
        cells = [_cells(r) for r in rows]
        widths = {c: max([len(c), *(len(x[c]) for x in cells)]) for c in COLUMNS}
    if not args.json:
        print(_line({c: c for c in COLUMNS}, widths), flush=True)
    for row in rows:
        print(json.dumps(row) if args.json else _line(_cells(row), widths), flush=True)


def _follow(client: Any, model_id: str, poll: float) -> Iterator[dict[str, Any]]:
    """Timeline rows as their operations settle (rows after a pending one wait for it), until
    the session is over and one more poll brings nothing new."""
    after, quiet = 0, 0
    while True:
        page = client.timeline_page(model_id, after=after, limit=FOLLOW_PAGE)
        rows = page["rows"]
        # Once the session is over, what is still pending after a quiet poll is shown as it is.
        shown = len(rows) if quiet else _settled(rows)
        yield from rows[:shown]
        if shown:
            after = rows[shown - 1]["seq"]
        if shown == len(rows) and page["has_more"]:
            continue
        if page["status"] in ACTIVE:
            quiet = 0
        else:  # over: one more poll for late events (a release), then stop
            quiet = 1 if shown or shown < len(rows) else quiet + 1
            if quiet >= 2:
                return
        time.sleep(poll)


def _settled(rows: Sequence[dict[str, Any]]) -> int:
    """How many rows lead up to the first pending operation."""
    for i, row in enumerate(rows):
        if row["kind"] == "operation" and row["status"] == "pending":
            return i
    return len(rows)


def _cells(row: dict[str, Any]) -> dict[str, str]:
    tokens = row.get("tokens") or {}
    is_op = row["kind"] == "operation"
    return {
        "time": _time(row["time"]),
        "seq": str(row["seq"]),
        "type": row["type"],
        "actor": row.get("actor") or "",
        "queue_wait": _ms(row.get("queue_wait_ms")),
        "execution": _ms(row.get("execution_ms")),
        "prefill": str(tokens.get("prefill", "")) if is_op else "",
        "sample": str(tokens.get("sample", "")) if is_op else "",
        "train": str(tokens.get("train", "")) if is_op else "",
        "outcome": row["outcome"] if is_op else _detail(row.get("detail") or {}),
    }


def _line(cells: dict[str, str], widths: dict[str, int]) -> str:
    parts = [
        cells[c].rjust(widths.get(c, 0)) if c in RIGHT else cells[c].ljust(widths.get(c, 0))
        for c in COLUMNS
    ]
    return "  ".join(parts).rstrip()


def _detail(data: dict[str, Any]) -> str:
    """A session-level event's small fields as key=value (nested ones, like hashes, left out)."""
    return " ".join(
        f"{k}={v}" for k, v in data.items() if v is not None and not isinstance(v, dict | list)
    )


def _time(text: str) -> str:
    when = datetime.fromisoformat(text).astimezone(UTC)
    return when.strftime("%Y-%m-%d %H:%M:%S.") + f"{when.microsecond // 1000:03d}"


def _ms(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f} ms" if value < 10_000 else f"{value / 1000:.2f} s"
