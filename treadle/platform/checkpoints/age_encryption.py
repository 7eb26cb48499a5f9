"""age encryption of exported weights (`save_weights_external(age_encryption_recipients=...)`).

Owns what a recipient list may hold (at most MAX_RECIPIENTS, each a native X25519 `age1...` key
or an SSH public key, `ssh-ed25519` or `ssh-rsa`, as pyrage parses them; anything else is a
ValidationError naming it), and sealing an exported folder in place: each file encrypted to
every recipient as `<name>.age` and its plaintext removed at once, so only ciphertext reaches
the object store. Whether a stored checkpoint is sealed is read from its files' names.
Imports pyrage and the standard library; nothing from api, engine, worker, flask or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyrage

from treadle.platform.errors import ValidationError

__all__ = [
    "HEADER",
    "MAX_RECIPIENTS",
    "SUFFIX",
    "is_sealed",
    "parse_recipients",
    "seal_folder",
]

MAX_RECIPIENTS = 10  # the tinker SDK's documented limit
SUFFIX = ".age"  # the SDK's name for an encrypted file, which the cookbook's download expects
HEADER = b"age-encryption.org/v1\n"  # every age file (binary format) starts with it
_SHOWN = 60  # characters of a bad recipient quoted back
_SECRETS = ("AGE-SECRET-KEY-", "PRIVATE KEY")  # an age identity, a PEM / OpenSSH private key


def _show(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _parse_one(text: str, index: int) -> Any:
    if any(mark in text.upper() for mark in _SECRETS):  # never quoted back, nor logged
        raise ValidationError(
            f"age_encryption_recipients[{index}] is a private key, not a recipient: send only "
            "public keys (`age-keygen -y` prints an age identity's, ~/.ssh/id_*.pub holds an SSH "
            "key's), and treat this private key as exposed"
        )
    if text[:4].lower() == "age1":
        try:
            return pyrage.x25519.Recipient.from_str(text)
        except pyrage.RecipientError as exc:
            raise _bad(text, index, f"not a valid age X25519 recipient ({exc})") from None
    try:
        return pyrage.ssh.Recipient.from_str(text)
    except pyrage.RecipientError as exc:
        why = (
            "neither an age X25519 recipient (age1...) nor an SSH public key pyrage can "
            f"encrypt to ({exc})"
        )
        raise _bad(text, index, why) from None


def _bad(text: str, index: int, why: str) -> ValidationError:
    return ValidationError(
        f"age_encryption_recipients[{index}] = {_show(text)} is {why}; give an age public key "
        "(age1..., printed by `age-keygen -y`) or an SSH public key (the ssh-ed25519 or ssh-rsa "
        "line of ~/.ssh/id_*.pub)"
    )


def parse_recipients(texts: Sequence[str]) -> list[Any]:
    """The pyrage recipients of `texts`; ValidationError (a 400) naming the first bad one, an
    empty list, or more than MAX_RECIPIENTS."""
    if not texts:
        raise ValidationError(
            "age_encryption_recipients is empty: give at least one recipient (age1... or an SSH "
            "public key), or omit it to store the export unencrypted"
        )
    if len(texts) > MAX_RECIPIENTS:
        raise ValidationError(
            f"age_encryption_recipients has {len(texts)} recipients; at most {MAX_RECIPIENTS} "
            "are accepted: encrypt to fewer keys (a shared team key, for example)"
        )
    return [_parse_one(text, i) for i, text in enumerate(texts)]


def seal_folder(folder: Path, recipients: Sequence[str]) -> None:
    """Encrypt every file under `folder` to every recipient as `<name>.age` beside it, removing
    each plaintext file as soon as its ciphertext is written."""
    parsed = parse_recipients(recipients)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        sealed = path.with_name(path.name + SUFFIX)
        try:
            pyrage.encrypt_file(str(path), str(sealed), parsed)
        finally:
            path.unlink()


def is_sealed(names: Iterable[str]) -> bool:
    """Whether a checkpoint with these file names is age-encrypted (every file `.age`)."""
    listed = list(names)
    return bool(listed) and all(name.endswith(SUFFIX) for name in listed)
