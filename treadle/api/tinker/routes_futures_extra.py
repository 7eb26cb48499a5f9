"""The Tinker protocol's futures routes beyond retrieve_future (routes_futures):

- `POST /api/v1/retrieve_futures`: long-polls which requests of one client of a sampling
  session (`target.cloned_sampler_id`) settled after `prev_cursor`, as
  `{completions: [{state: finished|failed, request_id}], cursor}`; their results still come
  through retrieve_future. `retrieved_request_ids` only lets a server drop those results, and
  Treadle keeps every result in its log (the audit trail), so there is nothing to drop.
- `POST /api/v1/cancel_future`: cancels a pending request (platform.futures.cancel): it fails
  in place ("cancelled", category user), its reservation is released, a running one stops at
  its next step boundary, a training one's seq_id is passed over; a settled one is a 400.

The wait goes through the process's one NoticeHub, as retrieve_future's does.
Imports platform only; never torch.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.tinker.schemas_extras import CancelFuture, RetrieveFutures
from treadle.platform import db
from treadle.platform.operations import futures

bp = Blueprint("tinker_futures", __name__)


@bp.post("/api/v1/retrieve_futures")
def retrieve_futures() -> Any:
    body = parse(RetrieveFutures, json_body())
    svc = services()
    who = principal()
    sampler, clone = body.target.sampling_session_id, body.target.cloned_sampler_id

    def check() -> list[futures.Completion] | None:
        with db.reading(svc.db) as conn:
            done = futures.completions(conn, who, sampler, clone, after=body.prev_cursor)
        return done or None

    limit = svc.config.long_poll_seconds
    timeout = limit if body.timeout is None else min(body.timeout, limit)
    done = check()  # another tenant's sampler is a 404 here
    if done is None and timeout > 0:
        with svc.db.connect() as conn:
            waiting = futures.pending(conn, who, sampler, clone)
        # A notice of the oldest pending request ends the wait at once; the others (and any
        # request admitted meanwhile) are found by the hub's periodic re-check.
        done = svc.notices.wait_until(waiting[0] if waiting else sampler, check, timeout)
    completions = done or []
    return jsonify(
        completions=[
            {"state": "finished" if c.is_finished else "failed", "request_id": c.request_id}
            for c in completions
        ],
        cursor=completions[-1].position if completions else body.prev_cursor,
    )


@bp.post("/api/v1/cancel_future")
def cancel_future() -> Any:
    body = parse(CancelFuture, json_body())
    op = futures.cancel(services().deps, principal(), body.request_id)
    return jsonify(request_id=op.request_id, status=op.status, error=op.error)
