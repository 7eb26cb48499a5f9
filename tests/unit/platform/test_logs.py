"""The log formatter (treadle/platform/logs.py): JSON lines with every extra, tracebacks as
text, values JSON cannot hold written as their str(), and the human format with key=value."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import re
import sys
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from treadle.platform import logs
from treadle.platform.config import PlatformConfig

OPERATION = {
    "request_id": "req-1",
    "session_id": "sess-0123456789abcdef:train:0",
    "tenant_id": "acme",
    "type": "forward_backward",
    "seq_id": 3,
    "queue_wait_seconds": 0.25,
    "execution_seconds": None,
    "outcome": "completed",
}


def _record(msg: str = "operation", *, extra: dict[str, object] | None = None,
            exc: bool = False) -> logging.LogRecord:  # fmt: skip
    exc_info = None
    if exc:
        try:
            raise RuntimeError("the engine ran out of memory")
        except RuntimeError:
            exc_info = sys.exc_info()
    return logging.getLogger("treadle.operations").makeRecord(
        "treadle.operations", logging.INFO, __file__, 1, msg, (), exc_info, extra=extra
    )


def test_a_record_with_extras_is_one_json_line_with_every_key() -> None:
    line = logs.JsonFormatter().format(_record(extra=OPERATION))
    assert "\n" not in line
    out = json.loads(line)
    assert list(out)[:4] == ["ts", "level", "logger", "message"]
    assert (out["level"], out["logger"], out["message"]) == (
        "INFO", "treadle.operations", "operation"
    )  # fmt: skip
    assert {k: out[k] for k in OPERATION} == OPERATION
    assert "exc_info" not in out
    when = datetime.fromisoformat(out["ts"])
    assert when.utcoffset() is not None and when.utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    assert abs((datetime.now(UTC) - when).total_seconds()) < 60


def test_a_record_without_extras_has_only_the_four_keys() -> None:
    out = json.loads(logs.JsonFormatter().format(_record("worker-0 is ready")))
    assert set(out) == {"ts", "level", "logger", "message"}
    assert out["message"] == "worker-0 is ready"


def test_an_exception_record_carries_the_traceback_as_text() -> None:
    line = logs.JsonFormatter().format(_record("the operation failed", exc=True))
    assert "\n" not in line  # the traceback's newlines are escaped inside the JSON string
    out = json.loads(line)
    assert out["exc_info"].startswith("Traceback (most recent call last):")
    assert "RuntimeError: the engine ran out of memory" in out["exc_info"]


class Unserialisable:
    def __str__(self) -> str:
        return "<a tensor of shape (2, 3)>"


class Unprintable:
    def __str__(self) -> str:
        raise ValueError("no text")


def test_values_json_cannot_hold_are_written_as_their_text() -> None:
    extra = {"shape": Unserialisable(), "ratio": float("nan"), "count": 3, "bad": Unprintable()}
    out = json.loads(logs.JsonFormatter().format(_record(extra=extra)))
    assert out["shape"] == "<a tensor of shape (2, 3)>"
    assert out["ratio"] == "nan"  # not the NaN literal, which is not JSON
    assert out["count"] == 3
    assert out["bad"] == "<Unprintable that cannot be shown>"


def test_a_circular_value_never_raises() -> None:
    loop: list[object] = []
    loop.append(loop)
    out = json.loads(logs.JsonFormatter().format(_record(extra={"loop": loop})))
    assert out["loop"] == "[[...]]"


def test_an_extra_named_like_a_core_key_does_not_overwrite_it() -> None:
    out = json.loads(logs.JsonFormatter().format(_record(extra={"level": "custom"})))
    assert out["level"] == "INFO" and out["extra_level"] == "custom"


def test_a_message_whose_arguments_do_not_fit_is_written_not_raised() -> None:
    record = logging.getLogger("x").makeRecord(
        "x", logging.INFO, __file__, 1, "%d items", ("a",), None
    )
    out = json.loads(logs.JsonFormatter().format(record))
    assert out["message"].startswith("%d items (arguments ('a',) do not fit it")


def test_the_human_format_is_the_classic_line_with_extras_as_key_value() -> None:
    line = logs.HumanFormatter().format(_record(extra={**OPERATION, "note": "two words"}))
    pattern = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO treadle\.operations: operation "
    assert re.match(pattern, line), line
    assert line.endswith(
        "request_id=req-1 session_id=sess-0123456789abcdef:train:0 tenant_id=acme "
        "type=forward_backward seq_id=3 queue_wait_seconds=0.25 execution_seconds=None "
        'outcome=completed note="two words"'
    )


def test_the_human_format_keeps_the_traceback_after_the_line() -> None:
    text = logs.HumanFormatter().format(_record("failed", extra={"seq_id": 3}, exc=True))
    first, rest = text.split("\n", 1)
    assert first.endswith("treadle.operations: failed seq_id=3")
    assert rest.startswith("Traceback") and "the engine ran out of memory" in rest


@pytest.fixture
def root_handlers() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.mark.usefixtures("root_handlers")
def test_configure_installs_one_handler_and_a_second_call_replaces_it() -> None:
    first, second = io.StringIO(), io.StringIO()
    before = len(logging.getLogger().handlers)
    logs.configure("human", stream=first)
    logs.configure("json", stream=second)
    assert len(logging.getLogger().handlers) == before + 1
    logging.getLogger("treadle.operations").info("operation", extra=OPERATION)
    assert first.getvalue() == ""
    (line,) = second.getvalue().splitlines()
    assert json.loads(line)["outcome"] == "completed"


@pytest.mark.usefixtures("root_handlers")
def test_warnings_are_written_as_records_of_the_same_format() -> None:
    stream = io.StringIO()
    logs.configure("json", stream=stream)
    warnings.showwarning(UserWarning("running as root"), UserWarning, "celery.py", 893)
    out = json.loads(stream.getvalue())
    assert out["logger"] == "py.warnings" and out["level"] == "WARNING"
    assert "UserWarning: running as root" in out["message"]


@pytest.mark.usefixtures("root_handlers")
def test_configure_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="json, human"):
        logs.configure("xml")


@pytest.mark.usefixtures("root_handlers")
def test_celery_task_logger_is_sent_to_the_root_handler() -> None:
    stream = io.StringIO()
    logs.configure("json", stream=stream)
    task_logger = logging.getLogger("celery.task.test")
    own = logging.StreamHandler(io.StringIO())
    task_logger.addHandler(own)
    task_logger.propagate = False
    try:
        logs.to_root(task_logger)
        task_logger.warning("task said %s", "hello")
    finally:
        task_logger.removeHandler(own)
    assert json.loads(stream.getvalue())["message"] == "task said hello"


@pytest.mark.usefixtures("root_handlers")
def test_gunicorns_own_lines_are_written_in_the_format_and_only_once() -> None:
    logging.config.dictConfig(logs.gunicorn_logconfig("json"))
    error_log = logging.getLogger("gunicorn.error")
    try:
        (handler,) = error_log.handlers
        assert isinstance(handler, logging.StreamHandler)
        stream = io.StringIO()
        handler.setStream(stream)
        error_log.info("Booting worker with pid: %s", 42)
        (line,) = stream.getvalue().splitlines()
        assert json.loads(line)["message"] == "Booting worker with pid: 42"
        assert error_log.propagate is False  # the root handler (`configure`) does not repeat it
        # gunicorn's access log stays off (a logconfig_dict would turn it on): INFO is dropped
        assert not logging.getLogger("gunicorn.access").isEnabledFor(logging.INFO)
    finally:
        for name in ("gunicorn.error", "gunicorn.access"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
    with pytest.raises(ValueError, match="json, human"):
        logs.gunicorn_logconfig("text")


def test_the_log_format_comes_from_the_environment_and_is_checked() -> None:
    assert PlatformConfig.from_env({}).log_format == "json"
    config = PlatformConfig.from_env({"TREADLE_LOG_FORMAT": "human"})
    assert config.log_format == "human"
    assert PlatformConfig.from_env(config.to_env()).log_format == "human"  # reaches the workers
    with pytest.raises(ValueError, match="TREADLE_LOG_FORMAT must be json or human"):
        PlatformConfig.from_env({"TREADLE_LOG_FORMAT": "yaml"})
