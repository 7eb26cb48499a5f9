"""platform/checkpoints/age_encryption: which recipient lists are accepted (X25519 `age1...`,
ssh-ed25519 and ssh-rsa keys; at most ten; every bad one a ValidationError naming its index and
text), and sealing a folder: every file replaced by its `.age` ciphertext, which each recipient's
identity decrypts to the original bytes, with no plaintext file left."""

from __future__ import annotations

from pathlib import Path

import pyrage
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from treadle.platform.checkpoints.age_encryption import (
    HEADER,
    MAX_RECIPIENTS,
    is_sealed,
    parse_recipients,
    seal_folder,
)
from treadle.platform.errors import ValidationError

X25519 = pyrage.x25519.Identity.generate()
AGE_PUBLIC = str(X25519.to_public())


def _openssh(key: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey) -> tuple[str, bytes]:
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )  # fmt: skip
    return public.decode() + " user@host", private


ED25519_PUBLIC, ED25519_PRIVATE = _openssh(ed25519.Ed25519PrivateKey.generate())
RSA_PUBLIC, RSA_PRIVATE = _openssh(rsa.generate_private_key(public_exponent=65537, key_size=2048))


def test_age_and_ssh_recipients_are_accepted() -> None:
    recipients = [AGE_PUBLIC, ED25519_PUBLIC, RSA_PUBLIC]
    assert len(parse_recipients(recipients)) == 3
    assert len(parse_recipients([AGE_PUBLIC] * MAX_RECIPIENTS)) == MAX_RECIPIENTS


@pytest.mark.parametrize(
    ("recipients", "says"),
    [
        (["age1x"], "age_encryption_recipients[0] = 'age1x' is not a valid age X25519 recipient"),
        ([AGE_PUBLIC, AGE_PUBLIC[:-1]], "age_encryption_recipients[1] = "),
        ([AGE_PUBLIC, " " + AGE_PUBLIC], "[1] = ' age1"),
        ([AGE_PUBLIC, "ssh-ed25519 AAAA"], "[1] = 'ssh-ed25519 AAAA' is neither"),
        (["ecdsa-sha2-nistp256 AAAA"], "[0] = 'ecdsa-sha2-nistp256 AAAA' is neither"),
        ([AGE_PUBLIC, str(X25519)], "[1] is a private key, not a recipient"),
        ([ED25519_PRIVATE.decode()], "[0] is a private key, not a recipient"),
        ([""], "[0] = '' is neither"),
        ([AGE_PUBLIC] * (MAX_RECIPIENTS + 1), "has 11 recipients; at most 10"),
        ([], "is empty"),
    ],
)
def test_a_bad_recipient_list_is_refused_naming_what_is_wrong(
    recipients: list[str], says: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        parse_recipients(recipients)
    assert says in str(refused.value)
    assert str(X25519) not in str(refused.value)  # a private key is never quoted back


def test_a_long_bad_recipient_is_quoted_shortened() -> None:
    with pytest.raises(ValidationError) as refused:
        parse_recipients(["x" * 4000])
    assert "'" + "x" * 60 + "...'" in str(refused.value) and "x" * 61 not in str(refused.value)


def test_sealing_replaces_every_file_by_ciphertext_each_identity_decrypts(tmp_path: Path) -> None:
    originals = {
        "adapter_model.safetensors": bytes(range(256)) * 40,
        "adapter_config.json": b'{"r": 4}',
        "nested/treadle.json": b"{}",
        "empty": b"",
    }
    for name, data in originals.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)

    seal_folder(tmp_path, [AGE_PUBLIC, ED25519_PUBLIC, RSA_PUBLIC])

    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert files == {f"{name}.age" for name in originals}
    assert is_sealed(files)
    identities = [
        X25519,
        pyrage.ssh.Identity.from_buffer(ED25519_PRIVATE),
        pyrage.ssh.Identity.from_buffer(RSA_PRIVATE),
    ]
    for name, data in originals.items():
        sealed = (tmp_path / f"{name}.age").read_bytes()
        assert sealed.startswith(HEADER)
        for identity in identities:
            assert pyrage.decrypt(sealed, [identity]) == data
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt(sealed, [pyrage.x25519.Identity.generate()])


def test_sealing_with_a_bad_recipient_leaves_the_folder_untouched(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_bytes(b"{}")
    with pytest.raises(ValidationError):
        seal_folder(tmp_path, ["age1x"])
    assert [p.name for p in tmp_path.iterdir()] == ["adapter_config.json"]


def test_a_checkpoint_is_sealed_only_when_every_file_is_age() -> None:
    assert is_sealed(["a/b.age", "c.age"])
    assert not is_sealed(["a/b.age", "c.json"])
    assert not is_sealed([])
