"""Log output: one handler on the root logger, rendering records as JSON lines or for people.

`configure(fmt)` is called once by each entry point (`treadle up`, `treadle worker`, the
gunicorn API): "json" writes one JSON object per line (ts, level, logger, message, every
`extra=` attribute of the record, and exc_info as text), which a log collector reads without a
parser of its own; "human" writes the classic "time LEVEL logger: message" line with the
extras appended as key=value. Rendering never raises: a value JSON cannot hold is written as
its str(). Imports nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from datetime import UTC, datetime
from typing import IO, Any

FORMATS = ("json", "human")
HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Every attribute a LogRecord has before `extra=` adds any; whatever else a record carries was
# passed as an extra. ("message" and "asctime" are set by formatting, "taskName" since 3.12.)
_BARE = logging.LogRecord("", logging.INFO, "", 0, "", (), None)
STANDARD_ATTRS = frozenset([*vars(_BARE), "message", "asctime", "taskName"])
# The JSON object's own keys; an extra with one of these names is written as "extra_<name>".
CORE_KEYS = ("ts", "level", "logger", "message", "exc_info", "stack_info")
_MARK = "_treadle_handler"  # set on the handler `configure` installs, so a second call replaces it


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The attributes `extra=` put on the record, in the order they were given."""
    return {k: v for k, v in vars(record).items() if k not in STANDARD_ATTRS}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": _message(record),
        }
        for key, value in extras(record).items():
            out[f"extra_{key}" if key in CORE_KEYS else key] = value
        if record.exc_info:
            # Cached on the record like logging.Formatter does, so other handlers reuse it.
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        try:
            return json.dumps(out, default=_text, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            # A circular value, a float JSON has no literal for, a key that is not a string:
            # write what JSON holds as it is and everything else as its text.
            return json.dumps({k: _plain(v) for k, v in out.items()}, allow_nan=False)


class HumanFormatter(logging.Formatter):
    """The classic line, with the record's extras appended as key=value."""

    def __init__(self) -> None:
        super().__init__(HUMAN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        pairs = " ".join(f"{k}={_pair_value(v)}" for k, v in extras(record).items())
        if not pairs:
            return line
        # The traceback (if any) stays last, after the message's own line.
        head, sep, tail = line.partition("\n")
        return f"{head} {pairs}{sep}{tail}"


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "human":
        return HumanFormatter()
    raise ValueError(f"the log format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def configure(fmt: str, level: int = logging.INFO, stream: IO[str] | None = None) -> None:
    """Install one handler on the root logger writing `fmt` ("json" or "human") to `stream`
    (stderr by default) at `level`, and route warnings through it. A handler from an earlier
    call is replaced; handlers others installed (a test runner's) are left alone. Raises
    ValueError for another format."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(fmt))
    setattr(handler, _MARK, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Warnings become records too (logger "py.warnings"), so they are in the same format; Celery
    # warns before it sets up its logging (e.g. about running as root).
    logging.captureWarnings(True)


def gunicorn_logconfig(fmt: str) -> dict[str, Any]:
    """gunicorn's `logconfig_dict` setting: its own lines (logger "gunicorn.error": start, stop
    and crash of its master and workers) written in `fmt`, which they are not otherwise
    (gunicorn gives its loggers handlers of their own). The root logger gets no handler
    here: the app's process installs it (`configure`), so no line is written twice."""
    formatter(fmt)  # refuse an unknown format here, in the master, before any worker starts
    name = "JsonFormatter" if fmt == "json" else "HumanFormatter"
    own = {"level": "INFO", "handlers": ["treadle"], "propagate": False}
    # A logconfig_dict turns gunicorn's access log on whatever `accesslog` says; its lines are
    # INFO, so WARNING keeps it off (the API's metrics and operation records cover requests).
    quiet = {**own, "level": "WARNING"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"treadle": {"()": f"{__name__}.{name}"}},
        "handlers": {
            "treadle": {
                "class": "logging.StreamHandler",
                "formatter": "treadle",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": "INFO", "handlers": []},
        "loggers": {"gunicorn.error": own, "gunicorn.access": quiet},
    }


def to_root(logger: logging.Logger, **_: Any) -> None:
    """Send a logger's records to the root handler instead of a handler of its own. Celery
    gives its task logger its own plain-text handler (and stops it propagating) whatever the
    root logger has: connected to `after_setup_task_logger`, this undoes that."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception as exc:  # a message whose arguments do not fit it: say so, never raise
        return f"{record.msg!s} (arguments {record.args!r} do not fit it: {exc})"


def _text(value: Any) -> str:
    try:
        return str(value)
    except Exception:
        return f"<{type(value).__name__} that cannot be shown>"


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return _text(value)


def _pair_value(value: Any) -> str:
    text = _text(value)
    return json.dumps(text) if not text or any(c.isspace() or c == '"' for c in text) else text
