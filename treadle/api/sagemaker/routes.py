"""The SageMaker surface's blueprint: every route of the control plane (`control`), the runtime
(`runtime`) and inference (`inference`), each request authenticated by its SigV4 signature
before anything else reads it, and every refusal answered in its protocol's error shape
(`protocol`). The app's X-API-Key check passes these routes over. Imports platform only; never
torch.
"""

from __future__ import annotations

from flask import Blueprint, g

from treadle.api.sagemaker import control, inference, protocol, runtime, sigv4

bp = Blueprint("sagemaker", __name__)

SESSION = "/v1/training-sessions/<name>"


@bp.before_request
def sign_in() -> None:
    signed = sigv4.authenticate()
    g.principal = signed.principal
    g.aws_region = signed.region


bp.register_error_handler(Exception, protocol.handle_error)
bp.add_url_rule("/", view_func=control.dispatch, methods=["POST"])
bp.add_url_rule(
    f"{SESSION}/operations", view_func=runtime.execute_training_operation, methods=["POST"]
)
bp.add_url_rule(
    f"{SESSION}/operations/<operation_id>",
    view_func=runtime.get_training_operation_result,
    methods=["GET"],
)
bp.add_url_rule(
    f"{SESSION}/sampling-operations",
    view_func=runtime.execute_sampling_operation,
    methods=["POST"],
)
bp.add_url_rule(
    f"{SESSION}/sampling-operations/<operation_id>",
    view_func=runtime.get_sampling_operation_result,
    methods=["GET"],
)
bp.add_url_rule(
    "/training-sessions/<name>/sample",
    view_func=inference.sample_training_session,
    methods=["POST"],
)
bp.add_url_rule(
    "/training-sessions/<name>/sample-with-response-stream",
    view_func=inference.sample_training_session_with_response_stream,
    methods=["POST"],
)
