"""What Treadle's own HTTP clients share (`AdminClient`, `BillingClient`): an httpx client on
`/api/v1/treadle` carrying the key, the settings from the environment, and refusals raised as
`TreadleApiError` with the server's message. Imports nothing from the server side.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
C = TypeVar("C", bound="RestClient")


class TreadleApiError(RuntimeError):
    """The server refused a request; `status` is its HTTP status, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class RestClient:
    """Base of the clients of Treadle's extension routes."""

    def __init__(
        self, base_url: str, api_key: str, *, transport: httpx.BaseTransport | None = None
    ) -> None:
        self.http = httpx.Client(
            base_url=base_url.rstrip("/") + "/api/v1/treadle",
            headers={"X-API-Key": api_key},
            timeout=60,
            transport=transport,
        )

    @classmethod
    def from_env(cls: type[C]) -> C:
        """From TREADLE_BASE_URL (default http://127.0.0.1:8080) and TREADLE_API_KEY (or the
        TINKER_ equivalents)."""
        base_url = os.environ.get("TREADLE_BASE_URL") or os.environ.get("TINKER_BASE_URL")
        key = os.environ.get("TREADLE_API_KEY") or os.environ.get("TINKER_API_KEY")
        if not key:
            raise ValueError(
                "set TREADLE_API_KEY to a key (the operator's for tenants, prices and quotas), "
                "and TREADLE_BASE_URL to the server"
            )
        return cls(base_url or DEFAULT_BASE_URL, key)

    def close(self) -> None:
        self.http.close()

    @staticmethod
    def _ok(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise TreadleApiError(response.status_code, message)
        return response.json()


def segment(value: str) -> str:
    """An id as one URL path segment (a "/" in it is escaped, not a separator)."""
    return quote(value, safe="")
