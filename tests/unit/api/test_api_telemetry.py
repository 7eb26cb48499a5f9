"""The API's request hooks: an answer slower than `slow_after` is logged, a quick one is not."""

from __future__ import annotations

import logging
import time

import pytest
from flask import Flask

from treadle.api import telemetry


def test_an_answer_slower_than_the_limit_is_logged_with_its_route_status_and_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Flask(__name__)
    telemetry.install(app, slow_after=0.2)

    @app.post("/api/v1/slow")
    def slow() -> tuple[str, int]:
        time.sleep(0.3)
        return "", 202

    @app.post("/api/v1/quick")
    def quick() -> str:
        return ""

    caplog.set_level(logging.WARNING, logger=telemetry.__name__)
    client = app.test_client()
    assert client.post("/api/v1/quick").status_code == 200
    assert caplog.messages == []
    assert client.post("/api/v1/slow").status_code == 202
    [line] = caplog.messages
    assert line.startswith("slow answer: POST /api/v1/slow 202 after 0.")
