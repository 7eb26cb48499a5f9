"""Tenants and API keys from the client side: what `treadle tenants ...` and `treadle keys ...`
call, and what an operator's or tenant admin's own scripts can use.

The operator's key (TREADLE_ADMIN_KEY) creates, lists, disables and enables tenants; a tenant
admin's key creates, lists and revokes its own tenant's keys (the operator's, any tenant's).
A minted key's text (`api_key`) is returned once and never again.
Imports nothing from the server side.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

import httpx


class AdminError(RuntimeError):
    """The server refused a request; `status` is its HTTP status, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class AdminClient:
    """Example:
    admin = AdminClient("http://127.0.0.1:8080", os.environ["TREADLE_ADMIN_KEY"])
    acme_admin_key = admin.create_tenant("acme", name="Acme Corp")["api_key"]
    """

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
    def from_env(cls) -> AdminClient:
        """From TREADLE_BASE_URL (default http://127.0.0.1:8080) and TREADLE_API_KEY (or the
        TINKER_ equivalents)."""
        base_url = os.environ.get("TREADLE_BASE_URL") or os.environ.get("TINKER_BASE_URL")
        key = os.environ.get("TREADLE_API_KEY") or os.environ.get("TINKER_API_KEY")
        if not key:
            raise ValueError(
                "set TREADLE_API_KEY to an admin key (the operator's for tenants), and "
                "TREADLE_BASE_URL to the server"
            )
        return cls(base_url or "http://127.0.0.1:8080", key)

    def close(self) -> None:
        self.http.close()

    def create_tenant(self, tenant_id: str, name: str | None = None) -> dict[str, Any]:
        """Create a tenant (operator only).

        Returns:
            `{tenant, key, api_key}`: the tenant, its first admin key, and that key's text
            (shown once).
        Raises:
            AdminError: 409 if the tenant exists, 403 for a key that is not the operator's.
        """
        body: dict[str, Any] = {"id": tenant_id}
        if name is not None:
            body["name"] = name
        return self._ok(self.http.post("/tenants", json=body))

    def list_tenants(self) -> list[dict[str, Any]]:
        """Every tenant (operator only)."""
        return self._ok(self.http.get("/tenants"))["tenants"]  # type: ignore[no-any-return]

    def disable_tenant(self, tenant_id: str) -> dict[str, Any]:
        """Refuse every key of the tenant from its next request on (operator only)."""
        return self._ok(self.http.post(f"/tenants/{_segment(tenant_id)}/disable"))["tenant"]  # type: ignore[no-any-return]

    def enable_tenant(self, tenant_id: str) -> dict[str, Any]:
        """Accept a disabled tenant's keys again (operator only)."""
        return self._ok(self.http.post(f"/tenants/{_segment(tenant_id)}/enable"))["tenant"]  # type: ignore[no-any-return]

    def create_key(
        self, tenant_id: str | None = None, role: str = "member", name: str | None = None
    ) -> dict[str, Any]:
        """Mint a key (`admin` or `member`) of `tenant_id`, the caller's tenant by default.

        Returns:
            `{key, api_key}`: the key's record and its text (shown once).
        """
        body: dict[str, Any] = {"role": role}
        if tenant_id is not None:
            body["tenant_id"] = tenant_id
        if name is not None:
            body["name"] = name
        return self._ok(self.http.post("/keys", json=body))

    def list_keys(self, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """A tenant's keys (id, role, created, last used, revoked), never their text."""
        params = {"tenant_id": tenant_id} if tenant_id else {}
        return self._ok(self.http.get("/keys", params=params))["keys"]  # type: ignore[no-any-return]

    def get_key(self, key_id: str) -> dict[str, Any]:
        return self._ok(self.http.get(f"/keys/{_segment(key_id)}"))["key"]  # type: ignore[no-any-return]

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        """Revoke a key: refused from its next request on. Idempotent."""
        return self._ok(self.http.post(f"/keys/{_segment(key_id)}/revoke"))["key"]  # type: ignore[no-any-return]

    @staticmethod
    def _ok(response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise AdminError(response.status_code, message)
        return response.json()


def _segment(value: str) -> str:
    """An id as one URL path segment (a "/" in it is escaped, not a separator)."""
    return quote(value, safe="")
