"""The audit trail from the client side: the session listing, a session's events (every page,
or followed live) and its per-operation timeline; what `treadle sessions list` and
`treadle audit` call, and what `ServiceClient.audit` returns.

Rows come back as the server's JSON objects (dicts). Every key reads its own tenant's sessions;
the operator's key (TREADLE_ADMIN_KEY) any tenant's. Imports nothing from the server side.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from datetime import date, datetime
from typing import Any

from treadle.client.rest import RestClient, segment

ACTIVE_STATUSES = ("Created", "Running")
PAGE_SIZE = 500  # the server allows up to 1000 a page


class AuditClient(RestClient):
    """Example:
    audit = AuditClient("http://127.0.0.1:8080", "tml-...")
    print([s["model_id"] for s in audit.list_sessions(status="Running")])
    """

    def list_sessions(
        self,
        *,
        tenant: str | None = None,
        status: str | None = None,
        kind: str | None = None,
        since: date | datetime | str | None = None,
        limit: int | None = None,
        page_size: int = 100,
    ) -> list[dict[str, Any]]:
        """Sessions, newest first, each with its owner key, last activity, operation count,
        tokens by class and cost (the usage ledger's sums).

        Args:
            tenant: another tenant (the operator's key only), or "*" for every tenant; default
                your own.
            status: e.g. "Running" or "Stopped"; kind: "training", "sampling", ...
            since: only sessions created at or after this (a date is its UTC midnight).
            limit: at most this many (default: all); page_size: sessions per request.
        Returns:
            one dict per session: model_id, name, kind, status, base_model, rank, owner,
            worker_id, created_at, last_active_at, operations, prefill/sample/train_tokens,
            total_tokens, cost_usd, ...
        Raises:
            treadle.client.rest.TreadleApiError: 400 for a bad filter, 403 for another tenant.
        Example:
            rows = svc.audit.list_sessions(since="2026-11-01")
            print(sum(r["train_tokens"] for r in rows))
        """
        params: dict[str, Any] = {}
        for name, value in (("tenant", tenant), ("status", status), ("kind", kind)):
            if value is not None:
                params[name] = value
        if since is not None:
            params["since"] = since if isinstance(since, str) else since.isoformat()
        found: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None and (limit is None or len(found) < limit):
            size = page_size if limit is None else min(page_size, limit - len(found))
            body = self._ok(
                self.http.get("/sessions", params={**params, "limit": size, "offset": offset})
            )
            found.extend(body["sessions"])
            offset = body["next_offset"]
        return found

    def events_page(
        self,
        model_id: str,
        *,
        after: int = 0,
        limit: int = 100,
        types: Iterable[str] | None = None,
        full: bool = False,
    ) -> dict[str, Any]:
        """One page of a session's events with position > `after`.

        Args:
            after: the cursor (`next_after` of the previous page; 0 from the start).
            limit: 1-1000 events. types: only these event types. full: payloads and results
                unabridged (otherwise large ones are summarised, marked "summary": true).
        Returns:
            {model_id, status, events: [{position, seq, type, data, actor, created_at,
            tenant_id, session_id}], next_after, has_more}.
        Raises:
            treadle.client.rest.TreadleApiError: 404 for a missing (or another tenant's)
                session, 400 for a bad argument.
        Example:
            page = svc.audit.events_page(model_id, limit=10)
            print([e["type"] for e in page["events"]], page["has_more"])
        """
        params: dict[str, Any] = {"after": after, "limit": limit, "full": str(full).lower()}
        if types:
            params["type"] = ",".join(types)
        return self._ok(self.http.get(f"/sessions/{segment(model_id)}/events", params=params))  # type: ignore[no-any-return]

    def events(
        self,
        model_id: str,
        types: Iterable[str] | None = None,
        full: bool = False,
        *,
        page_size: int = PAGE_SIZE,
    ) -> Iterator[dict[str, Any]]:
        """Every event of a session, oldest first, fetched page by page.

        Args:
            types: only these event types (e.g. ["OperationRequested"]).
            full: payloads and results unabridged (for an export).
            page_size: events per request (1-1000).
        Returns:
            an iterator of event dicts (see `events_page`).
        Raises:
            treadle.client.rest.TreadleApiError: 404 for a missing (or another tenant's) session.
        Example:
            for event in svc.audit.events(model_id, full=True):
                print(event["seq"], event["type"])
        """
        wanted = list(types) if types else None
        after = 0
        while True:
            page = self.events_page(model_id, after=after, limit=page_size, types=wanted, full=full)
            yield from page["events"]
            after = page["next_after"]
            if not page["has_more"]:
                return

    def timeline(self, model_id: str, *, page_size: int = PAGE_SIZE) -> list[dict[str, Any]]:
        """A session's operations, one row each (time, seq, type, actor, queue_wait_ms,
        execution_ms, tokens by class, loss/metrics or error, outcome), with its session-level
        events (lease, recovery, checkpoints, stop) between them, in seq order.

        Args:
            page_size: rows per request (1-1000).
        Returns:
            a list of row dicts; an operation's `kind` is "operation", an event's "event".
        Raises:
            treadle.client.rest.TreadleApiError: 404 for a missing (or another tenant's) session.
        Example:
            for row in svc.audit.timeline(model_id):
                print(row["seq"], row["type"], row["outcome"])
        """
        rows: list[dict[str, Any]] = []
        after = 0
        while True:
            page = self.timeline_page(model_id, after=after, limit=page_size)
            rows.extend(page["rows"])
            after = page["next_after"]
            if not page["has_more"]:
                return rows

    def timeline_page(self, model_id: str, *, after: int = 0, limit: int = 100) -> dict[str, Any]:
        """One page of timeline rows with seq > `after`: {model_id, status, rows, next_after,
        has_more}. Raises TreadleApiError (404 for a missing or another tenant's session).

        Example:
            page = svc.audit.timeline_page(model_id, limit=20)
            print(len(page["rows"]), page["next_after"])
        """
        params = {"after": after, "limit": limit}
        return self._ok(self.http.get(f"/sessions/{segment(model_id)}/timeline", params=params))  # type: ignore[no-any-return]

    def follow(
        self,
        model_id: str,
        poll: float = 1.0,
        *,
        types: Iterable[str] | None = None,
        full: bool = False,
    ) -> Iterator[dict[str, Any]]:
        """Every event of a session, then each new one as it is appended, until the session is
        no longer active (stopped, expired, failed, ...) and no more events come for one `poll`.

        Args:
            poll: seconds between requests once caught up.
            types, full: as for `events`.
        Returns:
            an iterator of event dicts; it ends by itself once the session is over.
        Raises:
            treadle.client.rest.TreadleApiError: 404 for a missing (or another tenant's) session.
        Example:
            for event in svc.audit.follow(model_id):
                print(event["type"], event["data"].get("type"))
        """
        wanted = list(types) if types else None
        after, quiet = 0, 0
        while True:
            page = self.events_page(model_id, after=after, limit=PAGE_SIZE, types=wanted, full=full)
            yield from page["events"]
            after = page["next_after"]
            if page["has_more"]:
                continue
            # The status is read before the events: once the session is over, one more poll
            # lets in what a worker appends as it lets go (a release); then it is done.
            if page["status"] in ACTIVE_STATUSES:
                quiet = 0
            else:
                quiet = 1 if page["events"] else quiet + 1
                if quiet >= 2:
                    return
            time.sleep(poll)
