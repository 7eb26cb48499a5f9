"""Process configuration: one frozen object per process, built once from the environment.

`PlatformConfig.from_env()` is called at entry points only (CLI, Celery worker boot, tests);
everything else receives the config explicitly. Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from treadle.platform.logs import FORMATS

DEFAULT_DATA_DIR = Path.home() / ".treadle"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "treadle"
# Adapters (weights, grads, Adam state) a worker keeps in memory; the least recently used others
# page out to local disk. 4 keeps 16 SmolLM2-135M sessions of rank 32 within 1.5x one session's
# memory (docs/benchmarks.md).
DEFAULT_MAX_LOADED_ADAPTERS = 4
# Sampling snapshots a worker keeps in memory; the least recently used others page out to local
# disk. An RL loop takes one a step and samples only the newest; 16 keeps a 16-session batch's
# samplers in memory.
DEFAULT_MAX_LOADED_SNAPSHOTS = 16
# Tokens of KV cache a worker's admission reserves for its sampler: 32 samples of 1,024 tokens.
DEFAULT_SAMPLER_KV_TOKENS = 32768
DEFAULT_WORKER_FREE_HEAP_BYTES = 4 * 2**30
# Where a worker serves its Prometheus metrics (`treadle up` gives worker i this port + i).
DEFAULT_WORKER_METRICS_PORT = 9101
# SageMaker's SDK sends forwardBackward in chunks of about 10-12 MB (api/sagemaker).
DEFAULT_SAGEMAKER_MAX_BODY_BYTES = 16 * 1024 * 1024
# A region a SigV4 credential scope may name (it is echoed in ARNs, so no ':' or '/'): lowercase
# letters, digits and inner hyphens, like us-east-1.
AWS_REGION_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,30}[a-z0-9])?$")
# The MLflow experiment a session's run goes in: one per tenant.
DEFAULT_MLFLOW_EXPERIMENT = "treadle-{tenant}"
# How an operator makes a TREADLE_SECRETS_KEY (a Fernet key: 32 random bytes, urlsafe base64).
SECRETS_KEY_HOWTO = (
    "generate one with: python -c 'import base64, os; "
    "print(base64.urlsafe_b64encode(os.urandom(32)).decode())'"
)


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
    # A worker heartbeats this often; one silent for lease_ttl_seconds is taken for dead and its
    # sessions move to a live worker (`treadle up` also releases a dead child's leases at once).
    worker_heartbeat_seconds: float = 1.0
    lease_ttl_seconds: float = 10.0
    # Recovery: an automatic checkpoint every N optimizer steps (0: none), the newest K kept.
    auto_checkpoint_steps: int = 20
    auto_checkpoint_keep: int = 2
    # An operation running longer than this fails with an error saying so.
    op_time_limit_seconds: float = 600.0
    # A seq_id the worker never received (and that was not refused) is skipped after this long.
    gap_timeout_seconds: float = 60.0
    api_threads: int = 256
    # Metering and quotas (the usage ledger, reservations, budgets); off only to measure them.
    metering: bool = True
    # A client session that has not heartbeated this long expires with its sessions (0: never).
    session_idle_seconds: float = 1800.0
    # How long the tinker SDK keeps retrying a request refused for money (402) before it gives
    # up with the refusal (client/config's billing_exception_max_pause_duration_sec). 0: it
    # retries once, 5 s later, then ends the loop; raise it to let an operator's quota raise
    # resume a paused loop.
    billing_pause_seconds: float = 0.0
    # A sequence sampled with record_stability_info is kept this long after its last use (its
    # recording, or a training datum that names it); then provenance naming it is refused.
    recorded_sample_ttl_seconds: float = 86400.0
    prices_file: Path | None = None  # default prices (TOML); None: the one shipped with Treadle
    # The largest request body the API reads (413 beyond it). forward_backward is the only big
    # one; the tinker SDK is told (client/config) to keep its chunks within half of it.
    max_body_bytes: int = 8 * 1024 * 1024
    # Tests only: lets a test pause a worker between an operation's effect and its settlement
    # (see worker/faults.py). Never set in production.
    debug_faults: bool = False
    device: str | None = None
    # At most this many adapters (weights, pending grads, Adam state) in a worker's memory; the
    # least recently used others are written to `spill_dir` and read back when used (0: no limit).
    max_loaded_adapters: int = DEFAULT_MAX_LOADED_ADAPTERS
    # At most this many sampling snapshots in a worker's memory, the same way (0: no limit).
    max_loaded_snapshots: int = DEFAULT_MAX_LOADED_SNAPSHOTS
    # A CPU worker samples with its base model's linear weights packed for oneDNN: much faster
    # on some CPUs, for a second copy of those weights in memory (engine/models/cpu_linear.py).
    pack_cpu_weights: bool = True
    # Bytes a worker may give the base models' weights (0: its device's memory, the GPU's or
    # the host's). A registered model needing more is not hosted there (engine/memory/capacity.py).
    worker_model_memory_bytes: int = 0
    # Host memory a worker may use to load base models (0: the host's RAM); on a GPU worker
    # each rank reads the whole model into it first (platform/sessions/admission.py).
    worker_host_memory_bytes: int = 0
    # Freed heap a worker keeps for its next passes before handing pages back to the OS
    # (engine/memory/heap.py): a pass of the same size then reuses pages instead of faulting
    # fresh ones in, at the cost of up to this much RSS beyond what the worker uses.
    worker_free_heap_bytes: int = DEFAULT_WORKER_FREE_HEAP_BYTES
    # Tokens of KV cache admission reserves for a worker's sampler (per device), beside a
    # training pass: what the sessions a worker admits may sample at once. A reservation the
    # sample batch does not enforce yet (docs/operations.md, "Admission").
    sampler_kv_tokens: int = DEFAULT_SAMPLER_KV_TOKENS
    # What a worker samples with: "reference" (Treadle's own decode loop, exact: the CPU
    # default) or "vllm" (a vLLM server per base model, run from vLLM's own environment:
    # `vllm_python`, which `make vllm` builds; or `vllm_url`, a server already running).
    sampler_backend: str = "reference"
    vllm_python: str = ""
    vllm_url: str = ""
    # The largest LoRA rank vLLM serves, and its KV cache on the CPU (GiB).
    vllm_max_lora_rank: int = 64
    vllm_kv_cache_gib: int = 1
    # The CUDA devices the worker's vLLM servers run on ("6,7": tensor parallel over both), so
    # that they do not share the training ranks' devices; empty: vLLM's default (device 0).
    vllm_devices: str = ""
    # Recompute each decoder layer in the backward instead of keeping its activations: None
    # where a training pass is big enough for it to save memory, True always, False never.
    activation_checkpointing: bool | None = None
    # Padded tokens per part of a forward_backward (0: the device's budget, from its memory on
    # CUDA, engine/losses/passes.py): one pass's size, and the grain at which a worker group
    # splits a request across its ranks. Recorded in each result; a replay uses the recorded one.
    microbatch_tokens: int = 0
    # How long a worker group's collective may wait for a rank before the group fails (rank 0
    # pings the others at a quarter of it while idle).
    group_timeout_seconds: float = 120.0
    # How a worker group holds its base models: "replicated" (whole on every rank; requests
    # split across the ranks) or "sharded" (each decoder layer split across the ranks with
    # FSDP2, for models larger than one device). One process ignores it.
    group_layout: str = "replicated"
    s3_endpoint: str = ""
    s3_bucket: str = "treadle"
    s3_access_key: str = ""
    s3_secret_key: str = ""
    s3_region: str = "us-east-1"
    # A worker's Prometheus endpoint: the port (0: any free one) and the address it listens on;
    # the URL it is reached at goes into the worker's heartbeat ("metrics_url").
    worker_metrics_port: int = DEFAULT_WORKER_METRICS_PORT
    worker_metrics_addr: str = "0.0.0.0"
    # prometheus_client's multiprocess mode (the API under gunicorn): every process writes its
    # metrics under this folder and /metrics sums them. Empty: one process, its own metrics.
    prometheus_multiproc_dir: str = ""
    # How log records are written (platform/logs.py): "json" lines for a collector, or "human".
    log_format: str = "json"
    # Fernet keys (comma-separated; the first encrypts, every one decrypts, so an operator can
    # rotate) under which access key secrets are stored (tenancy/access_keys). Empty: access key
    # pairs cannot be minted nor SigV4 signatures checked. `treadle up` generates one.
    secrets_key: str = field(default="", repr=False)
    # The regions a SigV4 signature's scope may name (empty: any well-formed region name).
    aws_regions: tuple[str, ...] = ()
    # The largest SageMaker request body (api/sagemaker; a larger one is refused).
    sagemaker_max_body_bytes: int = DEFAULT_SAGEMAKER_MAX_BODY_BYTES
    # An MLflow tracking server to which workers publish each session's per-step figures
    # (platform/audit/mlflow_publisher.py), in the experiment named here ("{tenant}": the
    # session's tenant id). Empty: nothing is published.
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = DEFAULT_MLFLOW_EXPERIMENT

    @property
    def fwdbwd_chunk_bytes(self) -> int:
        """The forward_backward chunk size the tinker SDK is told to keep within: half the body
        limit, as its chunk estimate leaves out the protobuf framing (a few bytes per field)."""
        return self.max_body_bytes // 2

    @property
    def storage_dir(self) -> Path:
        """The local object store's root when no S3 endpoint is configured."""
        return self.data_dir / "storage"

    def spill_dir(self, worker_id: str) -> Path:
        """Where worker `worker_id` pages idle adapters out to (its own; local disk)."""
        return self.data_dir / "spill" / worker_id

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PlatformConfig:
        env = os.environ if env is None else env
        return cls(
            database_url=env.get("DATABASE_URL", ""),
            redis_url=env.get("REDIS_URL", ""),
            data_dir=Path(env.get("TREADLE_DATA_DIR") or DEFAULT_DATA_DIR),
            cache_dir=Path(env.get("TREADLE_CACHE_DIR") or DEFAULT_CACHE_DIR),
            admin_key=env.get("TREADLE_ADMIN_KEY", ""),
            long_poll_seconds=_number(env, "TREADLE_LONG_POLL_SECONDS", 20.0),
            worker_heartbeat_seconds=_number(env, "TREADLE_HEARTBEAT_SECONDS", 1.0),
            lease_ttl_seconds=_number(env, "TREADLE_LEASE_TTL_SECONDS", 10.0),
            auto_checkpoint_steps=int(_number(env, "TREADLE_AUTO_CHECKPOINT_STEPS", 20)),
            auto_checkpoint_keep=int(_number(env, "TREADLE_AUTO_CHECKPOINT_KEEP", 2)),
            op_time_limit_seconds=_number(env, "TREADLE_OP_TIME_LIMIT_SECONDS", 600.0),
            gap_timeout_seconds=_number(env, "TREADLE_GAP_TIMEOUT_SECONDS", 60.0),
            api_threads=int(_number(env, "TREADLE_API_THREADS", 256)),
            max_body_bytes=_body_bytes(env, "TREADLE_MAX_BODY_BYTES", 8 * 1024 * 1024),
            debug_faults=env.get("TREADLE_DEBUG_FAULTS", "") == "1",
            metering=env.get("TREADLE_METERING", "1") != "0",
            session_idle_seconds=_number(env, "TREADLE_SESSION_IDLE_SECONDS", 1800.0),
            billing_pause_seconds=_number(env, "TREADLE_BILLING_PAUSE_SECONDS", 0.0),
            recorded_sample_ttl_seconds=_number(
                env, "TREADLE_RECORDED_SAMPLE_TTL_SECONDS", 86400.0
            ),
            prices_file=Path(env["TREADLE_PRICES_FILE"])
            if env.get("TREADLE_PRICES_FILE")
            else None,
            device=env.get("TREADLE_DEVICE") or None,
            max_loaded_adapters=_whole(
                env, "TREADLE_MAX_LOADED_ADAPTERS", DEFAULT_MAX_LOADED_ADAPTERS
            ),
            max_loaded_snapshots=_whole(
                env, "TREADLE_MAX_LOADED_SNAPSHOTS", DEFAULT_MAX_LOADED_SNAPSHOTS
            ),
            pack_cpu_weights=env.get("TREADLE_PACK_CPU_WEIGHTS", "1") != "0",
            worker_model_memory_bytes=_whole(env, "TREADLE_WORKER_MODEL_MEMORY", 0),
            worker_host_memory_bytes=_whole(env, "TREADLE_WORKER_HOST_MEMORY", 0),
            worker_free_heap_bytes=_whole(
                env, "TREADLE_WORKER_FREE_HEAP", DEFAULT_WORKER_FREE_HEAP_BYTES
            ),
            sampler_kv_tokens=_whole(env, "TREADLE_SAMPLER_KV_TOKENS", DEFAULT_SAMPLER_KV_TOKENS),
            sampler_backend=_sampler_backend(env),
            vllm_python=env.get("TREADLE_VLLM_PYTHON", ""),
            vllm_url=env.get("TREADLE_VLLM_URL", ""),
            vllm_max_lora_rank=_whole(env, "TREADLE_VLLM_MAX_LORA_RANK", 64),
            vllm_kv_cache_gib=_whole(env, "TREADLE_VLLM_KV_CACHE_GIB", 1),
            vllm_devices=_devices(env, "TREADLE_VLLM_DEVICES"),
            activation_checkpointing=_auto_flag(env, "TREADLE_ACTIVATION_CHECKPOINTING"),
            microbatch_tokens=_whole(env, "TREADLE_MICROBATCH_TOKENS", 0),
            group_timeout_seconds=_number(env, "TREADLE_GROUP_TIMEOUT_SECONDS", 120.0),
            group_layout=_group_layout(env),
            s3_endpoint=env.get("TREADLE_S3_ENDPOINT", ""),
            s3_bucket=env.get("TREADLE_S3_BUCKET") or "treadle",
            s3_access_key=env.get("TREADLE_S3_ACCESS_KEY") or env.get("AWS_ACCESS_KEY_ID", ""),
            s3_secret_key=env.get("TREADLE_S3_SECRET_KEY") or env.get("AWS_SECRET_ACCESS_KEY", ""),
            s3_region=env.get("TREADLE_S3_REGION") or "us-east-1",
            worker_metrics_port=_port(env, "TREADLE_WORKER_METRICS_PORT"),
            worker_metrics_addr=env.get("TREADLE_WORKER_METRICS_ADDR") or "0.0.0.0",
            prometheus_multiproc_dir=env.get("PROMETHEUS_MULTIPROC_DIR", ""),
            log_format=_log_format(env),
            secrets_key=_secrets_key(env),
            aws_regions=_aws_regions(env),
            sagemaker_max_body_bytes=_body_bytes(
                env, "TREADLE_SAGEMAKER_MAX_BODY_BYTES", DEFAULT_SAGEMAKER_MAX_BODY_BYTES
            ),
            mlflow_tracking_uri=env.get("TREADLE_MLFLOW_TRACKING_URI", ""),
            mlflow_experiment=env.get("TREADLE_MLFLOW_EXPERIMENT") or DEFAULT_MLFLOW_EXPERIMENT,
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
            "TREADLE_HEARTBEAT_SECONDS": str(self.worker_heartbeat_seconds),
            "TREADLE_LEASE_TTL_SECONDS": str(self.lease_ttl_seconds),
            "TREADLE_AUTO_CHECKPOINT_STEPS": str(self.auto_checkpoint_steps),
            "TREADLE_AUTO_CHECKPOINT_KEEP": str(self.auto_checkpoint_keep),
            "TREADLE_OP_TIME_LIMIT_SECONDS": str(self.op_time_limit_seconds),
            "TREADLE_GAP_TIMEOUT_SECONDS": str(self.gap_timeout_seconds),
            "TREADLE_BILLING_PAUSE_SECONDS": str(self.billing_pause_seconds),
            "TREADLE_RECORDED_SAMPLE_TTL_SECONDS": str(self.recorded_sample_ttl_seconds),
            "TREADLE_API_THREADS": str(self.api_threads),
            "TREADLE_MAX_BODY_BYTES": str(self.max_body_bytes),
            "TREADLE_MAX_LOADED_ADAPTERS": str(self.max_loaded_adapters),
            "TREADLE_MAX_LOADED_SNAPSHOTS": str(self.max_loaded_snapshots),
            "TREADLE_PACK_CPU_WEIGHTS": "1" if self.pack_cpu_weights else "0",
            "TREADLE_WORKER_MODEL_MEMORY": str(self.worker_model_memory_bytes),
            "TREADLE_WORKER_HOST_MEMORY": str(self.worker_host_memory_bytes),
            "TREADLE_WORKER_FREE_HEAP": str(self.worker_free_heap_bytes),
            "TREADLE_SAMPLER_KV_TOKENS": str(self.sampler_kv_tokens),
            "TREADLE_SAMPLER_BACKEND": self.sampler_backend,
            "TREADLE_VLLM_PYTHON": self.vllm_python,
            "TREADLE_VLLM_URL": self.vllm_url,
            "TREADLE_VLLM_MAX_LORA_RANK": str(self.vllm_max_lora_rank),
            "TREADLE_VLLM_KV_CACHE_GIB": str(self.vllm_kv_cache_gib),
            "TREADLE_VLLM_DEVICES": self.vllm_devices,
            "TREADLE_ACTIVATION_CHECKPOINTING": {None: "auto", True: "on", False: "off"}[
                self.activation_checkpointing
            ],
            "TREADLE_MICROBATCH_TOKENS": str(self.microbatch_tokens),
            "TREADLE_GROUP_TIMEOUT_SECONDS": str(self.group_timeout_seconds),
            "TREADLE_GROUP_LAYOUT": self.group_layout,
            "TREADLE_WORKER_METRICS_PORT": str(self.worker_metrics_port),
            "TREADLE_WORKER_METRICS_ADDR": self.worker_metrics_addr,
            "TREADLE_LOG_FORMAT": self.log_format,
            "TREADLE_SAGEMAKER_MAX_BODY_BYTES": str(self.sagemaker_max_body_bytes),
            "TREADLE_MLFLOW_TRACKING_URI": self.mlflow_tracking_uri,
            "TREADLE_MLFLOW_EXPERIMENT": self.mlflow_experiment,
        }
        if self.secrets_key:
            env["TREADLE_SECRETS_KEY"] = self.secrets_key
        if self.aws_regions:
            env["TREADLE_AWS_REGIONS"] = ",".join(self.aws_regions)
        if self.debug_faults:
            env["TREADLE_DEBUG_FAULTS"] = "1"
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


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number of 0 or more, got {raw!r}")
    return value


def _sampler_backend(env: Mapping[str, str]) -> str:
    backend = env.get("TREADLE_SAMPLER_BACKEND", "") or "reference"
    if backend not in ("reference", "vllm"):
        raise ValueError(
            f"TREADLE_SAMPLER_BACKEND is {backend!r}; use reference (the default) or vllm"
        )
    return backend


def _devices(env: Mapping[str, str], name: str) -> str:
    """A comma-separated list of distinct device indices ("6,7"), or empty."""
    raw = env.get(name, "").replace(" ", "")
    if not raw:
        return ""
    parts = raw.split(",")
    indices = [int(p) for p in parts if p.isdigit()]
    if len(indices) != len(parts) or len(set(indices)) != len(indices):
        raise ValueError(
            f"{name} must list distinct device indices separated by commas (6,7), got {raw!r}"
        )
    return ",".join(map(str, indices))


def _whole(env: Mapping[str, str], name: str, default: int) -> int:
    value = _number(env, name, default)
    if value != int(value):
        raise ValueError(f"{name} must be a whole number of 0 or more, got {env.get(name)!r}")
    return int(value)


def _log_format(env: Mapping[str, str]) -> str:
    raw = env.get("TREADLE_LOG_FORMAT") or "json"
    if raw not in FORMATS:
        raise ValueError(f"TREADLE_LOG_FORMAT must be {' or '.join(FORMATS)}, got {raw!r}")
    return raw


def _group_layout(env: Mapping[str, str]) -> str:
    raw = env.get("TREADLE_GROUP_LAYOUT") or "replicated"
    if raw not in GROUP_LAYOUTS:
        raise ValueError(f"TREADLE_GROUP_LAYOUT must be {' or '.join(GROUP_LAYOUTS)}, got {raw!r}")
    return raw


def _port(env: Mapping[str, str], name: str) -> int:
    value = _whole(env, name, DEFAULT_WORKER_METRICS_PORT)
    if value > 65535:
        raise ValueError(f"{name} must be a port number from 0 to 65535, got {env.get(name)!r}")
    return value


MIN_BODY_BYTES = 64 * 1024
# How a worker group holds its base models (engine/distributed/group.py).
GROUP_LAYOUTS = ("replicated", "sharded")


def _body_bytes(env: Mapping[str, str], name: str, default: int) -> int:
    value = _number(env, name, default)
    if value != int(value) or value < MIN_BODY_BYTES:
        raise ValueError(
            f"{name} must be a whole number of bytes, at least {MIN_BODY_BYTES}, got {env.get(name)!r}"
        )
    return int(value)


def _secrets_key(env: Mapping[str, str]) -> str:
    """TREADLE_SECRETS_KEY, each comma-separated entry checked to be a Fernet key (never put in
    a message: only its position is named)."""
    entries = [part.strip() for part in (env.get("TREADLE_SECRETS_KEY") or "").split(",")]
    entries = [part for part in entries if part]
    for i, entry in enumerate(entries, 1):
        try:
            raw = base64.urlsafe_b64decode(entry.encode("ascii"))
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raw = b""
        if len(raw) != 32:
            raise ValueError(
                f"TREADLE_SECRETS_KEY: entry {i} of {len(entries)} is not a Fernet key (32 bytes, "
                f"urlsafe base64, 44 characters); {SECRETS_KEY_HOWTO}"
            )
    return ",".join(entries)


def _aws_regions(env: Mapping[str, str]) -> tuple[str, ...]:
    names = [part.strip() for part in (env.get("TREADLE_AWS_REGIONS") or "").split(",")]
    names = [name for name in names if name]
    for name in names:
        if not AWS_REGION_NAME.match(name):
            raise ValueError(
                f"TREADLE_AWS_REGIONS: {name!r} is not a region name (lowercase letters, digits "
                "and hyphens, like us-east-1); list them comma-separated"
            )
    return tuple(dict.fromkeys(names))


def _auto_flag(env: Mapping[str, str], name: str) -> bool | None:
    """`auto` (or unset) -> None, `on` -> True, `off` -> False."""
    raw = (env.get(name) or "auto").lower()
    choices = {"auto": None, "on": True, "off": False}
    if raw not in choices:
        raise ValueError(f"{name} must be auto, on or off, got {env.get(name)!r}")
    return choices[raw]
