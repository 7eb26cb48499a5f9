"""The `treadle prices|quotas|usage|bill` verbs: HTTP clients of the billing routes
(TREADLE_BASE_URL, TREADLE_API_KEY) that print a table, CSV or JSON (`--format`).

Kept apart from `main` (the entry point, which registers these parsers and dispatches here) so
each stays small. Imports the client only, never the server side.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from collections.abc import Sequence
from typing import Any

from treadle.cli import errors

FORMATS = ("table", "csv", "json")
VERBS = ("prices", "quotas", "usage", "bill")
GROUPS = ("tenant", "session", "key", "base_model", "day", "op_type")
_KEY_COLUMNS = {"tenant": "tenant_id", "session": "session_id", "key": "key_id"}
_TOKENS = ("prefill_tokens", "sample_tokens", "train_tokens", "total_tokens")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fmt: dict[str, Any] = {"choices": FORMATS, "default": "table", "help": "default: table"}
    prices = sub.add_parser("prices", help="list or set prices (USD per million tokens)")
    verbs = prices.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="every price version and its status")
    listing.add_argument("--model", default=None, help="only this base model")
    listing.add_argument("--format", **fmt)
    setting = verbs.add_parser("set", help="set a base model's prices (the operator's key)")
    setting.add_argument("base_model")
    for token_class in ("prefill", "sample", "train"):
        setting.add_argument(
            f"--{token_class}",
            default=None,
            metavar="USD",
            help=f"{token_class} tokens, USD per million",
        )
    setting.add_argument(
        "--from",
        dest="effective_from",
        default=None,
        metavar="WHEN",
        help="YYYY-MM-DD (UTC midnight) or an ISO 8601 time; default now",
    )
    setting.add_argument("--format", **fmt)
    quotas = sub.add_parser("quotas", help="show or change a tenant's quota")
    verbs = quotas.add_subparsers(dest="verb", required=True)
    get = verbs.add_parser("get", help="a tenant's limits and this month's spend")
    get.add_argument("--tenant", required=True)
    get.add_argument("--format", **fmt)
    change = verbs.add_parser("set", help="change limits (the operator's key); 'none' removes")
    change.add_argument("--tenant", required=True)
    for flag in (
        "monthly-usd",
        "monthly-tokens",
        "max-sessions",
        "requests-per-second",
        "max-request-tokens",
    ):
        change.add_argument(f"--{flag}", default=None)
    change.add_argument("--format", **fmt)
    report = sub.add_parser("usage", help="usage grouped over a time range")
    report.add_argument("--tenant", default=None, help="the operator's: another tenant")
    report.add_argument("--all-tenants", action="store_true", help="the operator's: every one")
    report.add_argument("--month", default=None, help="YYYY-MM (UTC); default this month")
    report.add_argument("--since", default=None, help="ISO 8601; instead of --month")
    report.add_argument("--until", default=None, help="ISO 8601 (exclusive); default now")
    report.add_argument(
        "--by",
        action="append",
        default=[],
        help=f"group by any of {', '.join(GROUPS)} (comma-separated)",
    )
    report.add_argument("--format", **fmt)
    bill = sub.add_parser("bill", help="a month's invoice: lines and the total")
    bill.add_argument("--tenant", default=None, help="the operator's: another tenant")
    bill.add_argument("--month", default=None, help="YYYY-MM (UTC); default this month")
    bill.add_argument("--format", **fmt)


def run(args: argparse.Namespace) -> int:
    import httpx

    from treadle.client.billing import BillingClient

    verb = f"{args.command} {getattr(args, 'verb', '')}".strip()
    try:
        client = BillingClient.from_env()
        if args.command == "prices":
            out = _prices(client, args)
        elif args.command == "quotas":
            out = _quotas(client, args)
        elif args.command == "usage":
            out = _usage(client, args)
        else:
            out = _bill(client, args)
    except (RuntimeError, ValueError, httpx.HTTPError) as exc:
        return errors.failed(verb, exc)
    print(out, end="" if out.endswith("\n") else "\n")
    return 0


def _prices(client: Any, args: argparse.Namespace) -> str:
    if args.verb == "list":
        rows = client.list_prices(args.model)
    else:
        classes = {c: getattr(args, c) for c in ("prefill", "sample", "train")}
        if all(v is None for v in classes.values()):
            raise ValueError("give at least one of --prefill, --sample, --train (USD per million)")
        when = None if args.effective_from is None else _when(args.effective_from)
        rows = client.set_prices(args.base_model, **classes, effective_from=when)
    columns = ["base_model", "token_class", "usd_per_million", "effective_from", "status"]
    return render(args.format, {"prices": rows}, columns, rows)


def _when(text: str) -> Any:
    from datetime import date, datetime

    try:
        return date.fromisoformat(text) if len(text) == 10 else datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--from {text!r}: write YYYY-MM-DD or an ISO 8601 time") from None


def _quotas(client: Any, args: argparse.Namespace) -> str:
    if args.verb == "get":
        body = client.get_quota(args.tenant)
    else:
        limits: dict[str, Any] = {}
        for name in (
            "monthly_usd",
            "monthly_tokens",
            "max_sessions",
            "requests_per_second",
            "max_request_tokens",
        ):
            value = getattr(args, name)
            if value is not None:
                limits[name] = None if value.lower() == "none" else _number(name, value)
        if not limits:
            raise ValueError("give at least one limit, e.g. --monthly-usd 50 --max-sessions 3")
        body = client.set_quota(args.tenant, **limits)
    month = body.get("this_month", {})
    rows = [{"limit": k, "value": v} for k, v in body.items() if k != "this_month"]
    rows += [{"limit": f"this_month.{k}", "value": v} for k, v in month.items()]
    return render(args.format, body, ["limit", "value"], rows)


def _number(name: str, value: str) -> Any:
    from decimal import Decimal, InvalidOperation

    try:
        if name == "monthly_usd":
            return Decimal(value)
        return float(value) if name == "requests_per_second" else int(value)
    except (ValueError, InvalidOperation):
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{flag} {value!r} is not a number (or 'none')") from None


def _usage(client: Any, args: argparse.Namespace) -> str:
    if args.all_tenants and args.tenant:
        raise ValueError("give --tenant or --all-tenants, not both")
    by = [part.strip() for item in args.by for part in item.split(",") if part.strip()]
    body = client.usage(
        month=args.month,
        since=args.since,
        until=args.until,
        by=by,
        tenant="*" if args.all_tenants else args.tenant,
    )
    keys = [_KEY_COLUMNS.get(b, b) for b in body["by"]]
    columns = [*keys, "operations", *_TOKENS, "cost_usd", "unpriced"]
    rows = list(body["groups"])
    if args.format == "table":  # the total as the last row (CSV and JSON keep it apart)
        total = dict(body["total"])
        if keys:
            total[keys[0]] = "total"
        rows = [*rows, total] if keys else [total]
        title = f"usage of {body['tenant_id']} from {body['since']} until {body['until']}\n"
        return title + _table(columns, rows)
    return render(args.format, body, columns, rows)


def _bill(client: Any, args: argparse.Namespace) -> str:
    body = client.get_bill(args.month, args.tenant)
    columns = ["base_model", "token_class", "tokens", "usd_per_million", "amount_usd"]
    lines = [
        {**line, "usd_per_million": line["usd_per_million"] or "unpriced"} for line in body["lines"]
    ]
    rows = [*lines, {"base_model": "total", "amount_usd": body["total_usd"]}]
    if args.format == "table":
        title = f"bill of {body['tenant_id']} for {body['month']} (UTC)\n"
        note = "\nunpriced: no price was set; billed at 0\n" if body["unpriced"] else ""
        return title + _table(columns, rows) + note
    return render(args.format, body, columns, rows)


def render(fmt: str, body: Any, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """`body` as JSON, or `rows` as CSV or a table of `columns` (shared with `audit`)."""
    if fmt == "json":
        return json.dumps(body, indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(
            out, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n"
        )
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    return _table(columns, rows)


def _table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """Aligned columns; numbers (and amounts) right-aligned."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    right = [
        bool(cells) and all(_numeric(r[i]) for r in cells if r[i]) for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)
        ).rstrip()

    return "\n".join([line(columns), *(line(r) for r in cells)]) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else ""
    return f"{value:,}" if isinstance(value, int) else str(value)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "", 1).isdigit()
