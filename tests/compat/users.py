"""What the compat tests' user processes and loops share: a user's environment pointed at a
Treadle (`user_env`), and tinker-cookbook's RL datum of a recorded sample (`provenance_datum`)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Protocol

from tinker import types

from treadle.client.admin import AdminClient


def user_env(base_url: str, key: str, hf_home: Path, **extra: str) -> dict[str, str]:
    """A user's environment for a tinker SDK or hub client process: this process's, less
    every HF_, HUGGINGFACE_, TRANSFORMERS_, TINKER_ and TREADLE_ setting, then the tinker
    variables for `base_url` and `key` (telemetry off), a fresh HF_HOME (nothing cached
    elsewhere is used) and `extra`."""
    prefixes = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TINKER_", "TREADLE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(
        TINKER_BASE_URL=base_url,
        TINKER_API_KEY=key,
        TINKER_TELEMETRY="0",
        HF_HOME=str(hf_home),
        **extra,
    )
    return env


class Served(Protocol):
    """A running platform: the compat tests' `Platform`, the fault tests' `Up`."""

    base_url: str
    admin_key: str


def new_aws_user(platform: Served, name: str) -> dict[str, str]:
    """A new tenant `<name>-<random>` and its admin's key minted with an access key pair, as
    `treadle keys create --aws` mints it: tenant_id, key_id, api_key, access_key_id and
    secret_access_key."""
    operator = AdminClient(platform.base_url, platform.admin_key)
    try:
        tenant = operator.create_tenant(f"{name}-{secrets.token_hex(3)}")
    finally:
        operator.close()
    admin = AdminClient(platform.base_url, tenant["api_key"])
    try:
        minted = admin.create_key(aws=True)
    finally:
        admin.close()
    return {
        "tenant_id": tenant["tenant"]["id"],
        "key_id": minted["key"]["id"],
        "api_key": minted["api_key"],
        "access_key_id": minted["access_key_id"],
        "secret_access_key": minted["secret_access_key"],
    }


def aws_env(base_url: str, user: dict[str, str]) -> dict[str, str]:
    """What points every client of the SageMaker SDK and boto3 at a Treadle, as
    docs/sagemaker.md gives it: the endpoint, the access key pair, a region; no instance
    metadata."""
    return {
        "AWS_ENDPOINT_URL": base_url,
        "AWS_ACCESS_KEY_ID": user["access_key_id"],
        "AWS_SECRET_ACCESS_KEY": user["secret_access_key"],
        "AWS_REGION": "us-west-2",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def aws_user_env(
    base_url: str, user: dict[str, str], hf_home: Path, **extra: str
) -> dict[str, str]:
    """A SageMaker SDK user's process environment: this process's, less every AWS_, HF_ and
    TREADLE_ setting, then `aws_env`, no AWS config files, and HF_ENDPOINT for
    get_tokenizer()."""
    prefixes = ("AWS_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TINKER_", "TREADLE_",
                "SAGEMAKER_")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(
        aws_env(base_url, user),
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        HF_ENDPOINT=f"{base_url}/hf",
        HF_HOME=str(hf_home),
        **extra,
    )
    return env


def provenance_datum(
    prompt: list[int],
    sequence: types.SampledSequence,
    advantage: float,
    *,
    client_logprobs: float = 0.0,
    tamper: bool = False,
) -> types.Datum:
    """The cookbook's datum of one prompt + recorded completion: inputs drop the last token,
    targets the first; prompt targets have advantage 0, sampled ones `advantage`; provenance
    spans name the recorded sequence. `tamper` alters one sampled token."""
    sid, n_prompt, n_sampled = sequence.sequence_id, len(prompt), len(sequence.tokens)
    assert sid is not None
    full = prompt + list(sequence.tokens)
    if tamper:
        full[-2] = (full[-2] + 1) % 200
    targets = full[1:]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": targets,
            "logprobs": [client_logprobs] * len(targets),
            "advantages": [0.0] * (n_prompt - 1) + [advantage] * n_sampled,
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n_sampled),
        ],
    )
