"""A Flask app served over HTTP on a free port in a thread, counting its answers, for tests that
need real HTTP clients (the tinker SDK) against an in-process app; and an API replica of a running
platform served that way."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from flask import Flask
from werkzeug.serving import make_server

from tests.conftest import Platform
from treadle.api.app import create_app
from treadle.api.context import Services
from treadle.platform.config import PlatformConfig

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


@contextlib.contextmanager
def replica(platform: Platform, **config: Any) -> Iterator[tuple[str, Counts]]:
    """A second API of `platform` (same database, Redis and workers) built with `config` on top
    of the platform's settings, served by `served`: its URL and its answers by (path, status)."""
    app = create_app(
        PlatformConfig(
            database_url=platform.database_url,
            redis_url=platform.redis_url,
            data_dir=platform.data_dir,
            admin_key=platform.admin_key,
            **config,
        )
    )
    try:
        with served(app) as (base_url, counts):
            yield base_url, counts
    finally:
        services: Services = app.extensions["treadle"]
        services.close()
