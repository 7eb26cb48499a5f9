"""SageMaker's inference on a training session: SampleTrainingSession and
SampleTrainingSessionWithResponseStream pass an OpenAI chat-completions request to Treadle's
OpenAI-compatible serving and its answer back (the stream as server-sent events, `data: [DONE]`
last; an error after the first byte is a `data: {"error": ...}` event and no [DONE]).

`X-Amzn-SageMaker-Model-Package` chooses a model package (a saveWeights or saveState package of
the caller's, on the session's base model); without it the session's base model answers, as a
sampler with no package does. The request's `model` is echoed, never resolved: the session and
the header say what answers. Imports platform only; never torch.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Response, request

from treadle.api.chat import serving
from treadle.api.chat.schemas import ChatCompletionRequest, parse
from treadle.api.sagemaker import protocol, runtime
from treadle.platform.serving.openai_models import Target

PACKAGE_HEADER = "X-Amzn-SageMaker-Model-Package"


def sample_training_session(name: str) -> Any:
    return _infer(name, "SampleTrainingSession", stream=False)


def sample_training_session_with_response_stream(name: str) -> Any:
    return _infer(name, "SampleTrainingSessionWithResponseStream", stream=True)


def _infer(name: str, operation: str, *, stream: bool) -> Any:
    arn = request.headers.get(PACKAGE_HEADER)
    uri: dict[str, Any] = {"trainingSessionName": name, "body": request.get_data(cache=True)}
    if arn is not None:
        uri["modelPackageArn"] = arn
    runtime.validate(operation, {}, **uri)
    session = runtime.accepting(name).session
    snapshot_id = prefix = None
    if arn:
        snapshot_id, prefix = runtime.package_weights(session, arn)
    body = parse(ChatCompletionRequest, protocol.read_json())
    target = Target(body.model, session.base_model, session.id, snapshot_id, prefix)
    answer = serving.chat(body.model_copy(update={"stream": stream}), target)
    if isinstance(answer, Response):
        return answer
    return Response(json.dumps(answer), mimetype="application/json")  # as the serving made it
