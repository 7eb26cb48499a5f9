"""Process configuration: one frozen object per process, built once from the environment.

`PlatformConfig.from_env()` is called at entry points only (CLI, Celery worker boot, tests);
everything else receives the config explicitly. Imports nothing from api, gpu_worker or torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_DATA_DIR = Path.home() / ".treadle"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "treadle"


@dataclass(frozen=True)
class PlatformConfig:
    """Where the platform's services live and how it behaves.

    `database_url` / `redis_url` empty means "use the embedded servers under data_dir";
    `treadle up` resolves them before starting the API and workers.
    """

    database_url: str = ""
    redis_url: str = ""
    data_dir: Path = DEFAULT_DATA_DIR
    cache_dir: Path = DEFAULT_CACHE_DIR
    admin_key: str = ""
    long_poll_seconds: float = 20.0
    worker_heartbeat_seconds: float = 2.0
    lease_ttl_seconds: float = 30.0
    device: str | None = None
    s3_endpoint: str = ""
    s3_bucket: str = "treadle"
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_region: str = "us-east-1"

    @property
    def storage_dir(self) -> Path:
        """The local object store's root when no S3 endpoint is configured."""
        return self.data_dir / "storage"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PlatformConfig:
        env = os.environ if env is None else env
        return cls(
            database_url=env.get("DATABASE_URL", ""),
            redis_url=env.get("REDIS_URL", ""),
            data_dir=Path(env.get("TREADLE_DATA_DIR") or DEFAULT_DATA_DIR),
            cache_dir=Path(env.get("TREADLE_CACHE_DIR") or DEFAULT_CACHE_DIR),
            admin_key=env.get("TREADLE_ADMIN_KEY", ""),
            long_poll_seconds=float(env.get("TREADLE_LONG_POLL_SECONDS", "20")),
            device=env.get("TREADLE_DEVICE") or None,
            s3_endpoint=env.get("TREADLE_S3_ENDPOINT", ""),
            s3_bucket=env.get("TREADLE_S3_BUCKET") or "treadle",
            s3_access_key=env.get("TREADLE_S3_ACCESS_KEY") or env.get("AWS_ACCESS_KEY_ID", ""),
            s3_secret_key=env.get("TREADLE_S3_SECRET_KEY") or env.get("AWS_SECRET_ACCESS_KEY", ""),
            s3_region=env.get("TREADLE_S3_REGION") or "us-east-1",
        )

    def with_services(self, database_url: str, redis_url: str) -> PlatformConfig:
        return replace(self, database_url=database_url, redis_url=redis_url)

    def to_env(self) -> dict[str, str]:
        """The environment that makes `from_env` rebuild this config in a child process."""
        env = {
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "TREADLE_DATA_DIR": str(self.data_dir),
            "TREADLE_CACHE_DIR": str(self.cache_dir),
            "TREADLE_LONG_POLL_SECONDS": str(self.long_poll_seconds),
        }
        if self.admin_key:
            env["TREADLE_ADMIN_KEY"] = self.admin_key
        if self.device:
            env["TREADLE_DEVICE"] = self.device
        if self.s3_endpoint:
            env.update(
                TREADLE_S3_ENDPOINT=self.s3_endpoint,
                TREADLE_S3_BUCKET=self.s3_bucket,
                TREADLE_S3_ACCESS_KEY=self.s3_access_key,
                TREADLE_S3_SECRET_KEY=self.s3_secret_key,
                TREADLE_S3_REGION=self.s3_region,
            )
        return env
