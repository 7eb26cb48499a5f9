"""The checkpoint registry from the client side: list, get, delete, TTL and download.

Used by `treadle checkpoints ...` and available as `ServiceClient.checkpoints`.
Imports nothing from the server side.
"""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any

import httpx


class CheckpointsClient:
    """Example:
    ckpts = CheckpointsClient("http://127.0.0.1:8080", "tml-...")
    ckpts.download("tinker://sess-...:train:0/sampler_weights/final", Path("out"))
    """

    def __init__(
        self, base_url: str, api_key: str, *, transport: httpx.BaseTransport | None = None
    ):
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"X-API-Key": api_key},
            timeout=600,
            transport=transport,
        )

    @classmethod
    def from_env(cls) -> CheckpointsClient:
        base_url = os.environ.get("TREADLE_BASE_URL") or os.environ.get("TINKER_BASE_URL")
        key = os.environ.get("TREADLE_API_KEY") or os.environ.get("TINKER_API_KEY")
        if not key:
            raise ValueError("set TREADLE_API_KEY (and TREADLE_BASE_URL) to use the registry")
        return cls(base_url or "http://127.0.0.1:8080", key)

    def _ok(self, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise RuntimeError(f"{response.status_code}: {message}")
        return response.json()

    def list(
        self, *, run_id: str | None = None, group: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        if run_id:
            return self._ok(self.http.get(f"/api/v1/training_runs/{run_id}/checkpoints"))[
                "checkpoints"
            ]  # type: ignore[no-any-return]
        params = {"model_package_group": group} if group else {}
        return self._ok(self.http.get("/api/v1/checkpoints", params=params))["checkpoints"]  # type: ignore[no-any-return]

    def get(self, path: str) -> dict[str, Any]:
        return self._ok(self.http.get("/api/v1/treadle/checkpoints/files", params={"path": path}))  # type: ignore[no-any-return]

    def delete(self, path: str) -> None:
        run_id, checkpoint_id = _split(path)
        self._ok(self.http.delete(f"/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}"))

    def set_ttl(self, path: str, ttl_seconds: int | None) -> dict[str, Any]:
        run_id, checkpoint_id = _split(path)
        url = f"/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/ttl"
        return self._ok(self.http.put(url, json={"ttl_seconds": ttl_seconds}))  # type: ignore[no-any-return]

    def download(self, path: str, folder: Path) -> builtins.list[Path]:
        """Write the checkpoint's files (a PEFT adapter folder or a merged model folder)."""
        files = self.get(path)["files"]
        written = []
        for entry in files:
            target = folder / entry["name"]
            target.parent.mkdir(parents=True, exist_ok=True)
            params = {"path": path, "name": entry["name"]}
            with self.http.stream("GET", "/api/v1/treadle/checkpoints/file", params=params) as r:
                if r.status_code >= 400:
                    r.read()
                    self._ok(r)
                tmp = target.with_suffix(target.suffix + ".part")
                with open(tmp, "wb") as out:
                    for chunk in r.iter_bytes(1 << 20):
                        out.write(chunk)
                tmp.replace(target)
            written.append(target)
        return written


def _split(path: str) -> tuple[str, str]:
    if not path.startswith("tinker://") or path.count("/") != 4:
        raise ValueError(f"{path!r} is not tinker://<run id>/<weights|sampler_weights>/<name>")
    run_id, kind, name = path[len("tinker://") :].split("/")
    return run_id, f"{kind}/{name}"
