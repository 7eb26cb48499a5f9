"""retrieve_future: long-polls an operation's result (Redis notice, database truth).

Answers proto bytes for forward_backward and sample results, JSON for the rest,
`{"type": "try_again"}` with status 408 while pending (see STILL_RUNNING), and
`{"error", "category"}` for a failed operation.
The wait goes through the process's one NoticeHub and holds no database connection between
its checks; with Redis down it answers the same, by polling the database. A request admitted
by this process is answered from the outcome its completion notice carried, where it did.
Imports platform only; never torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, jsonify

from treadle.api.body import parse
from treadle.api.context import json_body, principal, services
from treadle.api.tinker.routes_custom_losses import loss_future
from treadle.api.tinker.schemas import RetrieveFuture
from treadle.api.tinker.wire import encode_forward_backward_output, encode_sample_response
from treadle.platform import db
from treadle.platform.eventlog.optypes import OpStatus, OpType
from treadle.platform.models.custom_losses import LOSS_ID_PREFIX
from treadle.platform.operations import operations

bp = Blueprint("futures", __name__)

PROTO = "application/x-protobuf"
# A long-poll that ends before the result: the tinker SDK re-polls a 408 at once and silently
# (tinker/lib/api_future_impl.py: "408 is a try_again pretending to be an HTTP error; the body
# carries queue_state"), whereas a 200 `{"type": "try_again"}` logs a WARNING in the user's loop
# on every poll.
STILL_RUNNING = 408
# The results the tinker SDK reads as protobuf; every other result is JSON.
PROTO_RESULTS: dict[OpType, Callable[[Any], bytes]] = {
    OpType.FORWARD_BACKWARD: encode_forward_backward_output,
    OpType.SAMPLE: encode_sample_response,
}


@bp.post("/api/v1/retrieve_future")
def retrieve_future() -> Any:
    body = parse(RetrieveFuture, json_body())
    if body.request_id.startswith(LOSS_ID_PREFIX):  # create_custom_loss: settled when stored
        return jsonify(loss_future(body.request_id))
    svc = services()
    who = principal()

    def check() -> operations.Outcome | None:
        with db.reading(svc.db) as conn:
            op = operations.get_operation(conn, who, body.request_id)
        return operations.Outcome.of(op) if op.is_done else None

    op = svc.notices.wait_until(
        body.request_id,
        check,
        svc.config.long_poll_seconds,
        tenant_id=who.tenant_id,
        from_outcome=operations.outcome_of_notice,  # sent by the worker that settled it
    )
    if op is None:  # still running: 408, the SDK's quiet "poll again" (module docstring)
        response = jsonify(type="try_again", request_id=body.request_id, queue_state="active")
        response.status_code = STILL_RUNNING
        return response
    if op.status == OpStatus.FAILED:
        return jsonify(error=op.error["message"], category=op.error["category"])
    encode = PROTO_RESULTS.get(op.type)
    if encode is not None:
        return Response(encode(op.result), mimetype=PROTO)
    return jsonify(op.result)
