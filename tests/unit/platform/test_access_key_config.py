"""The configuration behind access key pairs: TREADLE_SECRETS_KEY (checked, never echoed),
TREADLE_AWS_REGIONS, TREADLE_SAGEMAKER_MAX_BODY_BYTES, the key `treadle up` makes once (mode 600)
and keeps from its workers, and the signing-key cache's eviction."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from treadle.api.auth import PrincipalCache
from treadle.cli import serve
from treadle.platform.config import PlatformConfig
from treadle.platform.tenancy.access_keys import Keyring, SecretsKeyError, SigningKey
from treadle.platform.tenancy.tenants import Principal

KEY_A = Fernet.generate_key().decode()
KEY_B = Fernet.generate_key().decode()


def test_defaults_are_unconfigured_any_region_and_16_mib() -> None:
    config = PlatformConfig.from_env({})
    assert (config.secrets_key, config.aws_regions) == ("", ())
    assert config.sagemaker_max_body_bytes == 16 * 1024 * 1024
    assert not Keyring(config.secrets_key).is_configured


def test_settings_are_read_and_survive_to_env() -> None:
    config = PlatformConfig.from_env(
        {
            "TREADLE_SECRETS_KEY": f" {KEY_A} , {KEY_B} ",
            "TREADLE_AWS_REGIONS": "us-east-1, eu-west-1,us-east-1",
            "TREADLE_SAGEMAKER_MAX_BODY_BYTES": "33554432",
        }
    )
    assert config.secrets_key == f"{KEY_A},{KEY_B}"
    assert config.aws_regions == ("us-east-1", "eu-west-1")
    assert config.sagemaker_max_body_bytes == 32 * 1024 * 1024
    assert PlatformConfig.from_env(config.to_env()) == config
    assert KEY_A not in repr(config)


def test_a_malformed_secrets_key_is_refused_without_echoing_it() -> None:
    bad = "not-a-fernet-key-but-a-secret-nonetheless"
    with pytest.raises(ValueError, match="entry 2 of 2 is not a Fernet key") as refused:
        PlatformConfig.from_env({"TREADLE_SECRETS_KEY": f"{KEY_A},{bad}"})
    assert bad not in str(refused.value) and KEY_A not in str(refused.value)
    assert "urlsafe_b64encode" in str(refused.value)


def test_a_malformed_region_is_refused() -> None:
    with pytest.raises(ValueError, match="TREADLE_AWS_REGIONS"):
        PlatformConfig.from_env({"TREADLE_AWS_REGIONS": "us-east-1,arn:aws"})


def test_an_unconfigured_keyring_says_how_to_set_the_key() -> None:
    with pytest.raises(SecretsKeyError, match="TREADLE_SECRETS_KEY") as refused:
        Keyring("").encrypt("x")
    assert refused.value.status == 409


def test_up_makes_a_secrets_key_once_with_mode_600(tmp_path: Path) -> None:
    config = PlatformConfig.from_env({"TREADLE_DATA_DIR": str(tmp_path / "data")})
    made = serve._secrets_key(config)
    assert len(base64.urlsafe_b64decode(made)) == 32
    path = tmp_path / "data" / "secrets_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert serve._secrets_key(config) == made  # kept: a restart opens the same secrets
    assert [p.name for p in path.parent.iterdir()] == ["secrets_key"]  # no draft left
    assert Keyring(made).is_configured
    configured = PlatformConfig.from_env(
        {"TREADLE_DATA_DIR": str(tmp_path / "other"), "TREADLE_SECRETS_KEY": KEY_A}
    )
    assert serve._secrets_key(configured) == KEY_A
    assert not (tmp_path / "other" / "secrets_key").exists()


def test_workers_do_not_get_the_secrets_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREADLE_SECRETS_KEY", KEY_A)
    config = PlatformConfig.from_env(
        {"TREADLE_DATA_DIR": str(tmp_path), "TREADLE_SECRETS_KEY": KEY_A}
    )
    workers = serve._worker_processes(config, 2, tmp_path, "127.0.0.1")
    assert all("TREADLE_SECRETS_KEY" not in w.env for w in workers)
    assert all(KEY_A not in repr(w.env) for w in workers)
    assert "TREADLE_SECRETS_KEY" in config.to_env()  # the API's processes do get it
    assert os.environ["TREADLE_SECRETS_KEY"] == KEY_A


def test_signing_keys_are_evicted_by_key_and_by_tenant_and_expire() -> None:
    now = [0.0]
    cache: PrincipalCache[SigningKey] = PrincipalCache(ttl=1.0, clock=lambda: now[0])
    a = SigningKey(Principal("key-a", "acme", "member"), "secret-a")
    b = SigningKey(Principal("key-b", "acme", "member"), "secret-b")
    c = SigningKey(Principal("key-c", "other", "member"), "secret-c")
    for akid, value in (("AKA", a), ("AKB", b), ("AKC", c)):
        cache.put(akid, value, cache.generation)
    cache.forget(key_id="key-a")
    assert (cache.get("AKA"), cache.get("AKB"), cache.get("AKC")) == (None, b, c)
    cache.forget(tenant_id="acme")
    assert (cache.get("AKB"), cache.get("AKC")) == (None, c)
    now[0] = 1.0
    assert cache.get("AKC") is None


def test_a_lookup_that_began_before_an_eviction_is_not_cached() -> None:
    cache: PrincipalCache[SigningKey] = PrincipalCache(ttl=1.0)
    started = cache.generation
    cache.forget(key_id="key-a")  # a revocation while the lookup ran
    cache.put("AKA", SigningKey(Principal("key-a", "acme", "member"), "s"), started)
    assert cache.get("AKA") is None
