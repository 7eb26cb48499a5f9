"""Tenants, API keys and base models from the client side: what `treadle tenants ...`,
`treadle keys ...` and `treadle models ...` call, and what an operator's or tenant admin's own
scripts can use.

The operator's key (TREADLE_ADMIN_KEY) creates, lists, disables and enables tenants; a tenant
admin's key creates, lists and revokes its own tenant's keys (the operator's, any tenant's).
A minted key's text (`api_key`), and an access key pair's secret (`secret_access_key`), are
returned once and never again.
Imports nothing from the server side.
"""

from __future__ import annotations

from typing import Any

from treadle.client.rest import RestClient, segment


class AdminClient(RestClient):
    """Example:
    admin = AdminClient("http://127.0.0.1:8080", os.environ["TREADLE_ADMIN_KEY"])
    acme_admin_key = admin.create_tenant("acme", name="Acme Corp")["api_key"]
    """

    def create_tenant(self, tenant_id: str, name: str | None = None) -> dict[str, Any]:
        """Create a tenant (operator only).

        Returns:
            `{tenant, key, api_key}`: the tenant, its first admin key, and that key's text
            (shown once).
        Raises:
            TreadleApiError: 409 if the tenant exists, 403 for a key that is not the operator's.
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
        return self._ok(self.http.post(f"/tenants/{segment(tenant_id)}/disable"))["tenant"]  # type: ignore[no-any-return]

    def enable_tenant(self, tenant_id: str) -> dict[str, Any]:
        """Accept a disabled tenant's keys again (operator only)."""
        return self._ok(self.http.post(f"/tenants/{segment(tenant_id)}/enable"))["tenant"]  # type: ignore[no-any-return]

    def create_key(
        self,
        tenant_id: str | None = None,
        role: str = "member",
        name: str | None = None,
        *,
        aws: bool = False,
    ) -> dict[str, Any]:
        """Mint a key (`admin` or `member`) of `tenant_id`, the caller's tenant by default;
        with `aws`, also an AWS-style access key pair of the same key, for SigV4-signed
        requests (SageMaker's SDK and boto3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).

        Returns:
            `{key, api_key}`: the key's record and its text (shown once); with `aws`, also
            `access_key_id` and `secret_access_key` (the secret shown once).
        Raises:
            TreadleApiError: 403 for a key that may not mint for the tenant, 409 for a disabled
            tenant or (with `aws`) a server without TREADLE_SECRETS_KEY.

        Example:
            pair = admin.create_key("acme", aws=True)
            os.environ["AWS_ACCESS_KEY_ID"] = pair["access_key_id"]
        """
        body: dict[str, Any] = {"role": role}
        if tenant_id is not None:
            body["tenant_id"] = tenant_id
        if name is not None:
            body["name"] = name
        if aws:
            body["aws"] = True
        return self._ok(self.http.post("/keys", json=body))

    def list_keys(self, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """A tenant's keys (id, role, created, last used, revoked, and `access_key_id` for a
        key with an access key pair), never their text nor secret."""
        params = {"tenant_id": tenant_id} if tenant_id else {}
        return self._ok(self.http.get("/keys", params=params))["keys"]  # type: ignore[no-any-return]

    def get_key(self, key_id: str) -> dict[str, Any]:
        return self._ok(self.http.get(f"/keys/{segment(key_id)}"))["key"]  # type: ignore[no-any-return]

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        """Revoke a key: refused from its next request on. Idempotent."""
        return self._ok(self.http.post(f"/keys/{segment(key_id)}/revoke"))["key"]  # type: ignore[no-any-return]

    def register_model(
        self,
        name: str,
        *,
        path: str | None = None,
        hub_id: str | None = None,
        revision: str | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Register base model `name` (operator only) from a folder in the Hugging Face layout
        (`path`, absolute, readable by the API and the workers) or from `hub_id` at a pinned
        `revision` in the hosts' Hugging Face cache. `options`: gguf_file (a GGUF file in `path`
        to convert), description, dtype,
        max_lora_rank, lora_targets (a subset of attn, mlp, unembed), max_context_length,
        prices ({token class: USD per million}).

        Returns:
            The registry entry: what the model's files say (architecture, context length,
            vocabulary, parameters, bytes, ...) and what the operator set.
        Raises:
            TreadleApiError: 400 naming what is wrong with the folder, 409 for a name in use.

        Example:
            admin.register_model("acme/llama-3.1-8b", path="/models/llama-3.1-8b")
        """
        body: dict[str, Any] = {"name": name, **options}
        for key, value in (("path", path), ("hub_id", hub_id), ("revision", revision)):
            if value is not None:
                body[key] = value
        body = {k: v for k, v in body.items() if v is not None}
        return self._ok(self.http.post("/base_models", json=body))["base_model"]  # type: ignore[no-any-return]

    def list_models(self, include_retired: bool = False) -> list[dict[str, Any]]:
        """The base models in service (retired ones too if asked), built-in first."""
        params = {"include_retired": "1"} if include_retired else {}
        return self._ok(self.http.get("/base_models", params=params))["base_models"]  # type: ignore[no-any-return]

    def get_model(self, name: str) -> dict[str, Any]:
        """One base model's registry entry."""
        return self._ok(self.http.get(f"/base_models/{segment(name)}"))["base_model"]  # type: ignore[no-any-return]

    def retire_model(self, name: str) -> dict[str, Any]:
        """Refuse new sessions on a registered model (operator only); idempotent."""
        return self._ok(self.http.post(f"/base_models/{segment(name)}/retire"))["base_model"]  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        """The platform's state now (operator only): what `treadle status` prints.

        Returns:
            `{lease_ttl_seconds, workers, live_sessions, pending_operations, oldest_pending}`:
            each worker's `id`, `heartbeat_age_seconds`, `is_alive` (heartbeated within the
            lease TTL), `sessions` held, `queued` (their pending operations) and `metrics_url`
            (None when its heartbeat names none); live sessions by tenant id; the pending
            operations' count and the oldest one (`request_id`, `session_id`, `tenant_id`,
            `type`, `seq_id`, `age_seconds`), None when nothing is pending.
        Raises:
            TreadleApiError: 403 for a key that is not the operator's.

        Example:
            admin = AdminClient.from_env()
            dead = [w["id"] for w in admin.status()["workers"] if not w["is_alive"]]
        """
        return self._ok(self.http.get("/status"))  # type: ignore[no-any-return]
