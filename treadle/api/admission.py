"""Admission at the edge: the seq_id a training request carries, and its submission.

A route that reads a training request's model id and seq_id calls `expect_seq` (or
`parse_training`) first: if the request is then refused (a 4xx), the error handler records the
refusal so the session's next operation does not wait for that seq_id. `submit` hands the
operation to the platform's command. Imports platform only; never torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from flask import g

from treadle.api.body import B, parse
from treadle.api.context import json_body, principal, services
from treadle.platform.eventlog.optypes import Payload
from treadle.platform.operations import commands, operations

MAX_SEQ = 2**62


def expect_seq(model_id: Any, seq_id: Any) -> None:
    """Note the training seq_id this request carries (if it reads as one)."""
    if (
        isinstance(model_id, str)
        and isinstance(seq_id, int)
        and not isinstance(seq_id, bool)
        and 0 <= seq_id < MAX_SEQ
    ):
        g.training_seq = (model_id, seq_id)


def parse_training(model: type[B]) -> B:
    """Parse a training request's JSON body, noting its seq_id first (even if parsing fails)."""
    raw = json_body()
    if isinstance(raw, dict):
        expect_seq(raw.get("model_id"), raw.get("seq_id"))
    return parse(model, raw)


def submit(
    session_id: str,
    seq_id: int | Callable[[sa.Connection], int],
    payload: Payload,
    *,
    sampler_id: str | None = None,
    with_request: Callable[[sa.Connection, operations.Admission], None] | None = None,
    on_admitted: Callable[[operations.Admission], None] | None = None,
) -> operations.Admission:
    """Submit the caller's operation (see `commands.submit`). This process's notice hub
    expects a new request's notice from before it commits, so the caller's first long-poll of
    it does not read the database only to find it pending (`NoticeHub.expect`)."""
    svc, who = services(), principal()

    def admitted(admission: operations.Admission) -> None:
        svc.notices.expect(admission.request_id, who.tenant_id)
        if on_admitted is not None:
            on_admitted(admission)

    admission = commands.submit(
        svc.deps,
        who,
        session_id,
        seq_id,
        payload,
        sampler_id=sampler_id,
        with_request=with_request,
        on_admitted=admitted,
    )
    g.pop("training_seq", None)  # admitted: not a refusal, whatever happens next
    return admission
