"""ServiceClient: entry point of Treadle's SDK, a thin layer over the official tinker SDK.

Reads TREADLE_BASE_URL / TREADLE_API_KEY (then the TINKER_ ones), lists base models, creates
training sessions with a name, rank, alpha, registry group and spend cap, and reports usage.
Also takes the arguments of SageMaker's training-session ServiceClient, so code written for
it runs with only its import changed (what each means here: `ServiceClient`'s docstring).
Imports nothing from the server side.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal
from types import TracebackType
from typing import Any

import httpx
import tinker
from tinker import types
from tinker.lib.api_future_impl import _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.public_interfaces.training_client import fetch_training_info

from treadle.client.audit import AuditClient
from treadle.client.billing import BillingClient, UsageReport
from treadle.client.checkpoints import CheckpointsClient
from treadle.client.lineage import Replay, ReplayReport
from treadle.client.refusals import refusals_translated
from treadle.client.rest import segment
from treadle.client.sampling import SamplingClient
from treadle.client.training import TrainingClient

DEFAULT_BASE_URL = "http://127.0.0.1:8080"


class ConfigurationError(ValueError):
    """The SDK is missing a setting (base URL or API key)."""


def turn_off_sdk_telemetry() -> None:
    """Tell the tinker SDK in this process to send no telemetry (TINKER_TELEMETRY=0), unless
    the user set the variable. Treadle accepts those posts and drops them, so they cost a
    request and nothing else; and with tinker 0.38 on Python 3.11 the SDK's telemetry task can
    swallow the cancellation that `close()` waits for, so `close()` never returns
    (docs/tinker-compatibility.md, "Known SDK faults")."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")


def model_package_group_name(group: str) -> str:
    """The name of a model package group given as its SageMaker ARN
    (`arn:aws:sagemaker:<region>:<account>:model-package-group/<name>`) or as a name.

    Raises:
        ValueError: an ARN that names no model package group.
    """
    if not group.startswith("arn:"):
        return group
    _, found, name = group.partition(":model-package-group/")
    if not found or not name or "/" in name:
        raise ValueError(
            f"{group!r} is not a model package group ARN; pass "
            "arn:aws:sagemaker:<region>:<account>:model-package-group/<name>, or the group's name"
        )
    return name


class ServiceClient:
    """Connects to a Treadle platform.

    Treadle's SDK speaks the Tinker protocol to the platform with an API key. It also takes
    the keyword arguments of SageMaker's training-session `ServiceClient`, so that code runs
    with only its import changed; Treadle has no IAM role, AWS region or customer bucket, so
    most of them change nothing.

    Args:
        base_url: the platform's URL; default $TREADLE_BASE_URL, $TINKER_BASE_URL, then
            http://127.0.0.1:8080.
        api_key: a `tml-...` key; default $TREADLE_API_KEY, then $TINKER_API_KEY.
        model_package_group_arn: the registry group every session this client creates saves
            its checkpoints into, as versions (unless the session names its own): a SageMaker
            ARN, whose name after `model-package-group/` is used, or a plain name. Default:
            each session's own group (its name, else its id).
        session_name_prefix: sessions created without a name are named `{prefix}-{8 hex}`
            (without a prefix they stay unnamed and are listed by id).
        region, role_arn, s3_output_path, kms_key_arn, vpc_config, max_pool_connections:
            accepted for SageMaker compatibility and ignored: the platform is the one at
            `base_url`, the API key is the identity, checkpoints live in the platform's own
            storage (under its operator's encryption, not your KMS key), sessions run on its
            workers, and the tinker SDK sizes its own connection pools.
    Raises:
        ConfigurationError: no API key was given or found, or `base_url` is not a URL (a
            region passed first, as SageMaker's SDK takes it, lands there: pass region=).
    Example:
        svc = treadle.ServiceClient(base_url="http://127.0.0.1:8080", api_key="tml-...")
        print(svc.list_base_models())
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        user_metadata: dict[str, str] | None = None,
        model_package_group_arn: str | None = None,
        session_name_prefix: str | None = None,
        region: str | None = None,
        role_arn: str | None = None,
        s3_output_path: str | None = None,
        kms_key_arn: str | None = None,
        vpc_config: Any = None,
        max_pool_connections: int | None = None,
    ) -> None:
        base_url = (
            base_url
            or os.environ.get("TREADLE_BASE_URL")
            or os.environ.get("TINKER_BASE_URL")
            or DEFAULT_BASE_URL
        ).rstrip("/")
        if "://" not in base_url:
            raise ConfigurationError(
                f"base_url {base_url!r} is not a URL: pass the platform's, e.g. "
                "http://127.0.0.1:8080 (a SageMaker region goes in region=, which Treadle ignores)"
            )
        api_key = api_key or os.environ.get("TREADLE_API_KEY") or os.environ.get("TINKER_API_KEY")
        if not api_key:
            raise ConfigurationError(
                "no API key: pass api_key='tml-...' or set TREADLE_API_KEY "
                "(`treadle up` prints the admin key)"
            )
        self.base_url = base_url
        self.api_key = api_key
        self.model_package_group = (
            model_package_group_name(model_package_group_arn) if model_package_group_arn else None
        )
        self.session_name_prefix = session_name_prefix
        del region, role_arn, s3_output_path, kms_key_arn, vpc_config, max_pool_connections
        turn_off_sdk_telemetry()
        self._inner = tinker.ServiceClient(
            user_metadata=user_metadata, base_url=base_url, api_key=api_key
        )

    @property
    def checkpoints(self) -> CheckpointsClient:
        """The checkpoint registry: list, get, delete, set_ttl, download."""
        return CheckpointsClient(self.base_url, self.api_key)

    @property
    def billing(self) -> BillingClient:
        """Prices, quotas, usage and bills."""
        return BillingClient(self.base_url, self.api_key)

    @property
    def audit(self) -> AuditClient:
        """The session listing, a session's events (paged or followed) and its timeline."""
        return AuditClient(self.base_url, self.api_key)

    def get_usage(
        self,
        *,
        month: str | None = None,
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        by: Iterable[str] = (),
        tenant: str | None = None,
    ) -> UsageReport:
        """Your tenant's usage over a time range: tokens by class and cost, grouped.

        Args:
            month: a UTC month "YYYY-MM"; or `since` / `until` (ISO 8601 or datetimes, UTC
                unless they carry an offset). Default: the current month so far.
            by: any of "tenant", "session", "key", "base_model", "day", "op_type".
            tenant: another tenant (the operator's key only), or "*" for every tenant.
        Returns:
            a UsageReport: `groups` (each a Usage with its `key`) and `total`.
        Raises:
            treadle.client.rest.TreadleApiError: 400 for a bad range or group, 403 for another
                tenant.
        Example:
            report = svc.get_usage(month="2026-11", by=["session"])
            print(report.total.cost_usd, [g.key for g in report.groups])
        """
        client = self.billing
        try:
            return client.get_usage(month=month, since=since, until=until, by=by, tenant=tenant)
        finally:
            client.close()

    def list_base_models(self) -> list[str]:
        """Names of the base models this platform can train and sample."""
        response = httpx.get(
            f"{self.base_url}/api/v1/get_server_capabilities",
            headers={"X-API-Key": self.api_key},
            timeout=30,
        )
        response.raise_for_status()
        return [m["model_name"] for m in response.json()["supported_models"]]

    def create_lora_training_client(
        self,
        base_model: str,
        *,
        rank: int = 32,
        alpha: float | None = None,
        training_session_name: str | None = None,
        model_package_group_arn: str | None = None,
        s3_output_path: str | None = None,
        kms_key_arn: str | None = None,
        vpc_config: Any = None,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        model_package_group: str | None = None,
        max_cost_usd: float | Decimal | str | None = None,
        optimizer: types.OptimizerConfig | None = None,
    ) -> TrainingClient:
        """Start a training session (base model + a fresh LoRA adapter) and wait until it is live.

        Args:
            base_model: a name from list_base_models().
            rank, alpha: the LoRA rank and scaling numerator, an int or a float (scale =
                alpha / rank; both default to 32).
            training_session_name: a label for audit and listing (1-128 chars, no '/');
                default `{session_name_prefix}-{8 hex}` when the ServiceClient has a prefix.
            model_package_group_arn, model_package_group: the registry group each checkpoint
                save becomes a version of, as a SageMaker ARN (its name after
                `model-package-group/` is used) or a name; give either, not two different
                groups. Default: the ServiceClient's, else the session name, else its id.
            s3_output_path, kms_key_arn, vpc_config: accepted for SageMaker compatibility and
                ignored (see ServiceClient).
            seed: seeds the adapter's initialisation.
            train_mlp, train_attn, train_unembed: which layers get adapters.
            max_cost_usd: the session's spend cap in USD: an operation that could take its
                spend past it is refused (402); `get_usage()` shows what is spent.
            optimizer: the session's optimizer for life, tinker's AdamOptimizerConfig (the
                default) or DimuonOptimizerConfig; each optim_step sends its params.
        Returns:
            the session's TrainingClient, once the session is live.
        Raises:
            ValueError: an ARN that names no model package group, or two different groups.
            tinker.RequestFailedError / tinker.BadRequestError: the server refused the session.
        Example:
            tc = svc.create_lora_training_client("treadle/tiny-debug", rank=8, alpha=16,
                                                 model_package_group_arn=GROUP_ARN)
        """
        del s3_output_path, kms_key_arn, vpc_config  # SageMaker's; nothing here (docstring)
        group = self._group(model_package_group_arn, model_package_group)
        name = training_session_name
        if name is None and self.session_name_prefix:
            name = f"{self.session_name_prefix}-{uuid.uuid4().hex[:8]}"
        holder = self._inner.holder
        session_id = holder.get_session_id()
        model_seq_id = holder.get_training_client_id()
        lora: dict[str, Any] = {
            "rank": rank,
            "train_mlp": train_mlp,
            "train_attn": train_attn,
            "train_unembed": train_unembed,
        }
        if alpha is not None:
            lora["alpha"] = alpha
        if seed is not None:
            lora["seed"] = seed
        body: dict[str, Any] = {
            "session_id": session_id,
            "model_seq_id": model_seq_id,
            "base_model": base_model,
            "lora_config": lora,
            "optimizer_config": (optimizer or types.AdamOptimizerConfig()).model_dump(),
            "type": "create_model",
        }
        if name is not None:
            body["training_session_name"] = name
        if user_metadata:
            body["user_metadata"] = user_metadata
        if group is not None:
            body["model_package_group"] = group
        if max_cost_usd is not None:
            body["max_cost_usd"] = float(max_cost_usd)

        inner = self._open_model("/api/v1/create_model", body, model_seq_id)
        return TrainingClient(
            inner, base_url=self.base_url, api_key=self.api_key, base_model=base_model, name=name
        )

    def _group(self, arn: str | None, name: str | None) -> str | None:
        """The session's model package group: the one named here (as an ARN or a name), else
        the ServiceClient's."""
        named = {model_package_group_name(g) for g in (arn, name) if g}
        if len(named) > 1:
            raise ValueError(
                f"model_package_group_arn={arn!r} and model_package_group={name!r} name "
                "different groups; pass one of them"
            )
        return named.pop() if named else self.model_package_group

    def fork_training_client(
        self, model_id: str, at_seq: int, *, training_session_name: str | None = None
    ) -> TrainingClient:
        """A new training session equal to `model_id` right after its operation `at_seq`:
        weights and optimizer state rebuilt from its log (from its newest recovery point at or
        before `at_seq`, every replayed step checked against the hashes it recorded). The
        source is untouched; the fork is yours (your tenant, your quota) and trains like any
        other session.

        Args:
            model_id: the session to fork (one of your tenant's).
            at_seq: the seq_id after which to fork (0 .. its last applied operation).
            training_session_name: a label for the fork.
        Returns:
            the fork's TrainingClient, once its state is rebuilt.
        Raises:
            tinker.BadRequestError: an unknown session or a seq_id it never reached.
            tinker.RequestFailedError: its log does not reproduce its state (no exact fork).
        Example:
            tc2 = svc.fork_training_client(tc.model_id, at_seq=40)
            tc2.optim_step(types.AdamParams(learning_rate=1e-5)).result()
        """
        body: dict[str, Any] = {"at_seq": at_seq}
        if training_session_name is not None:
            body["training_session_name"] = training_session_name
        return self._wrap(self._open_derived(model_id, "fork", body))

    def replay(self, model_id: str, to_seq: int | None = None) -> Replay:
        """Rebuild `model_id` from its log, up to `to_seq` (default: all it applied), in a new
        read-only sandbox that is never billed, comparing the state after every state-changing
        operation with the hashes recorded when it first ran.

        Returns:
            a Replay: its `report` (operations replayed, steps verified, the first divergence)
            and a `training_client` on the sandbox, to sample from the model as it stood then.
        Raises:
            tinker.BadRequestError: an unknown session or a seq_id it never reached.
        Example:
            replay = svc.replay(tc.model_id, to_seq=40)
            assert replay.report.matched, replay.report.first_divergence
        """
        body: dict[str, Any] = {} if to_seq is None else {"to_seq": to_seq}
        client = self._wrap(self._open_derived(model_id, "replay", body))
        response = httpx.get(
            f"{self.base_url}/api/v1/treadle/sessions/{segment(client.model_id)}/rebuild",
            headers={"X-API-Key": self.api_key},
            timeout=60,
        )
        response.raise_for_status()
        return Replay(ReplayReport.from_json(response.json()), client)

    def _open_derived(
        self, model_id: str, verb: str, body: dict[str, Any]
    ) -> tinker.TrainingClient:
        holder = self._inner.holder
        model_seq_id = holder.get_training_client_id()
        body = {**body, "session_id": holder.get_session_id(), "model_seq_id": model_seq_id}
        path = f"/api/v1/treadle/sessions/{segment(model_id)}/{verb}"
        return self._open_model(path, body, model_seq_id)

    def _open_model(
        self, path: str, body: dict[str, Any], model_seq_id: int
    ) -> tinker.TrainingClient:
        """POST a request that opens a model, wait for its future, return the tinker client."""
        holder = self._inner.holder

        async def create() -> tinker.TrainingClient:
            start = time.time()
            with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
                future = await client.post(path, body=body, cast_to=types.UntypedAPIFuture)
            response = await _APIFuture(
                types.CreateModelResponse, holder, future, start, "CreateModel"
            ).result_async()
            info = await fetch_training_info(holder, response.model_id)
            return tinker.TrainingClient(
                holder, model_seq_id=model_seq_id, model_id=response.model_id, info=info
            )

        with refusals_translated():
            return holder.run_coroutine_threadsafe(create()).result()

    def create_training_client_from_state(self, path: str) -> TrainingClient:
        """A new training session with a checkpoint's weights and a fresh optimizer."""
        with refusals_translated():
            inner = self._inner.create_training_client_from_state(path).result()
        return self._wrap(inner)

    def create_training_client_from_state_with_optimizer(self, path: str) -> TrainingClient:
        """A new training session resuming a checkpoint exactly: weights and optimizer state."""
        with refusals_translated():
            inner = self._inner.create_training_client_from_state_with_optimizer(path).result()
        return self._wrap(inner)

    def _wrap(self, inner: tinker.TrainingClient) -> TrainingClient:
        info = inner.get_info()
        return TrainingClient(
            inner,
            base_url=self.base_url,
            api_key=self.api_key,
            base_model=str(info.model_data.model_name),
            name=None,
        )

    def create_sampling_client(
        self, model_path: str | None = None, *, base_model: str | None = None
    ) -> SamplingClient:
        """A sampler on a saved checkpoint (`tinker://...`) or on a bare base model."""
        with refusals_translated():
            inner = self._inner.create_sampling_client(
                model_path=model_path, base_model=base_model
            ).result()
        return SamplingClient(
            inner,
            base_url=self.base_url,
            api_key=self.api_key,
            base_model=base_model or inner.get_base_model(),
        )

    def close(self, status: str = "success") -> None:
        """Finish the client session: every training session it opened stops."""
        self._inner.close(status).result()  # type: ignore[arg-type]

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close("success" if exc_type is None else "errored")
