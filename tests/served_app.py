"""A Flask app served over HTTP on a free port in a thread, counting its answers, for tests that
need real HTTP clients (the tinker SDK) against an in-process app."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from flask import Flask
from werkzeug.serving import make_server

Counts = collections.Counter[tuple[str, int]]


@contextlib.contextmanager
def served(app: Flask) -> Iterator[tuple[str, Counts]]:
    """Serve `app` over HTTP on a free port, counting requests by (path, status)."""
    counts: Counts = collections.Counter()
    inner = app.wsgi_app

    def counting(environ: dict[str, Any], start_response: Any) -> Any:
        def record(status: str, headers: Any, exc_info: Any = None) -> Any:
            counts[(environ["PATH_INFO"], int(status.split()[0]))] += 1
            return start_response(status, headers, exc_info)

        return inner(environ, record)

    app.wsgi_app = counting  # type: ignore[method-assign]
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", counts
    finally:
        server.shutdown()
        thread.join(5)
