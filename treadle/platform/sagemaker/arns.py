"""The names SageMaker's API gives Treadle's things: ARNs, the tenant's pseudo-account id and the
Hub content name of each registered base model, built here and parsed strictly.

- A tenant's account id is a stable 12-digit number derived from its id (nothing stored).
- Sessions, model package groups and packages are
  `arn:aws:sagemaker:<region>:<account>:training-session/<name>`,
  `...:model-package-group/<group>` and `...:model-package/<group>/<version>`; the region is the
  one the caller signed for (every region sees the same resources). An ARN the user wrote
  resolves by its name inside the caller's tenant, whatever its region and account fields say.
- A base model is `arn:aws:sagemaker:<region>:aws:hub-content/SageMakerPublicHub/Model/<hub
  content name>/<version>`. Registry names are `org/name`; Hub content names allow letters,
  digits and single or repeated hyphens only, so `org/name` becomes `org--name` where both parts
  are letters and digits joined by single hyphens (`HuggingFaceTB--SmolLM2-135M-Instruct`), and
  any other name its letters and digits joined by single hyphens plus 8 hex digits of its
  SHA-256 (never `--`, so the two forms never meet).
Imports nothing from api, engine, worker or torch.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from treadle.platform.errors import NotFoundError, ValidationError

PARTITION = "aws"
HUB_NAME = "SageMakerPublicHub"
HUB_CONTENT_VERSION = "1.0.0"  # a registry entry never changes once written
MAX_HUB_CONTENT_NAME = 63

_PART = re.compile(r"^[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*$")
_ARN = re.compile(r"^arn:aws[a-z-]*:sagemaker:(?P<region>[^:]*):(?P<account>[^:]*):(?P<rest>.+)$")
_GROUP = re.compile(r"^[a-zA-Z0-9](?:-*[a-zA-Z0-9]){0,62}$")


def account_id(tenant_id: str) -> str:
    """The tenant's 12-digit pseudo-account id."""
    digest = int.from_bytes(hashlib.sha256(f"account:{tenant_id}".encode()).digest()[:8], "big")
    return f"{digest % 10**12:012d}"


def session_arn(region: str, tenant_id: str, name: str) -> str:
    return f"arn:{PARTITION}:sagemaker:{region}:{account_id(tenant_id)}:training-session/{name}"


def group_arn(region: str, tenant_id: str, group: str) -> str:
    return f"arn:{PARTITION}:sagemaker:{region}:{account_id(tenant_id)}:model-package-group/{group}"


def package_arn(region: str, tenant_id: str, group: str, version: int) -> str:
    return (
        f"arn:{PARTITION}:sagemaker:{region}:{account_id(tenant_id)}:"
        f"model-package/{group}/{version}"
    )


def hub_arn(region: str) -> str:
    return f"arn:{PARTITION}:sagemaker:{region}:aws:hub/{HUB_NAME}"


def hub_content_arn(region: str, content_name: str) -> str:
    return (
        f"arn:{PARTITION}:sagemaker:{region}:aws:hub-content/{HUB_NAME}/Model/"
        f"{content_name}/{HUB_CONTENT_VERSION}"
    )


def hub_content_name(model: str) -> str:
    """The Hub content name of registry model `model` (see the module docstring)."""
    org, _, name = model.partition("/")
    if _PART.match(org) and _PART.match(name) and len(org) + 2 + len(name) <= MAX_HUB_CONTENT_NAME:
        return f"{org}--{name}"
    tag = hashlib.sha256(model.encode()).hexdigest()[:8]
    words = "-".join(re.findall(r"[A-Za-z0-9]+", model))[: MAX_HUB_CONTENT_NAME - len(tag) - 1]
    return f"{words.rstrip('-')}-{tag}"


@dataclass(frozen=True)
class HubContentRef:
    name: str
    version: str | None  # None: the current version


def parse_hub_content_arn(arn: str) -> HubContentRef:
    """`...:hub-content/SageMakerPublicHub/Model/<name>[/<version>]`; ValidationError otherwise."""
    match = _ARN.match(arn)
    parts = match.group("rest").split("/") if match else []
    if (
        len(parts) not in (4, 5)
        or parts[0] != "hub-content"
        or parts[1] != HUB_NAME
        or parts[2] != "Model"
    ):
        raise ValidationError(
            f"BaseModelArn {arn!r} is not a base model's Hub content ARN; use the HubContentArn "
            f"DescribeHubContent returns (arn:aws:sagemaker:<region>:aws:hub-content/{HUB_NAME}"
            "/Model/<name>/<version>), or pass a model id from list_base_models() to the SDK"
        )
    return HubContentRef(parts[3], parts[4] if len(parts) == 5 else None)


def group_name(arn_or_name: str, what: str = "ModelPackageGroupArn") -> str:
    """The group an ARN (`...:model-package-group/<group>`) or a bare name names."""
    name = arn_or_name
    if arn_or_name.startswith("arn:"):
        match = _ARN.match(arn_or_name)
        kind, _, name = (match.group("rest") if match else "").partition("/")
        if kind != "model-package-group":
            raise ValidationError(
                f"{what} {arn_or_name!r} is not a model package group ARN "
                "(arn:aws:sagemaker:<region>:<account>:model-package-group/<name>)"
            )
    if not _GROUP.match(name):
        raise ValidationError(
            f"{what} names the group {name!r}; a group name has 1-63 letters, digits and "
            "hyphens, starting and ending with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class PackageRef:
    group: str
    version: int


def parse_package(arn_or_name: str, what: str = "modelPackageArn") -> PackageRef:
    """A model package: `...:model-package/<group>/<version>` or `<group>/<version>`.
    NotFoundError when it cannot name one (it answers like a missing package)."""
    rest = arn_or_name
    if arn_or_name.startswith("arn:"):
        match = _ARN.match(arn_or_name)
        kind, _, rest = (match.group("rest") if match else "").partition("/")
        if kind != "model-package":
            raise ValidationError(
                f"{what} {arn_or_name!r} is not a model package ARN "
                "(arn:aws:sagemaker:<region>:<account>:model-package/<group>/<version>)"
            )
    group, _, version = rest.partition("/")
    if not _GROUP.match(group) or not version.isdigit() or int(version) < 1:
        raise ValidationError(
            f"{what} {arn_or_name!r} names no package version; use the ModelPackageArn a save "
            "returned (...:model-package/<group>/<version>)"
        )
    return PackageRef(group, int(version))


def session_name(arn_or_name: str) -> str:
    """A training session's name, from its ARN or as given."""
    if arn_or_name.startswith("arn:"):
        match = _ARN.match(arn_or_name)
        kind, _, name = (match.group("rest") if match else "").partition("/")
        if kind != "training-session" or not name:
            raise NotFoundError(f"training session {arn_or_name} not found")
        return name
    return arn_or_name
