"""SageMaker's names for Treadle's things (platform/sagemaker/arns.py): account ids, ARNs and the
Hub content names of registry models, built and parsed strictly."""

from __future__ import annotations

import re

import pytest

from treadle.platform.errors import NotFoundError, ValidationError
from treadle.platform.models import catalog
from treadle.platform.sagemaker import arns

# The service model's pattern of a Hub content name (HubContentName).
HUB_CONTENT_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")


def test_account_id_is_twelve_digits_stable_and_per_tenant() -> None:
    first = arns.account_id("acme")
    assert re.fullmatch(r"\d{12}", first)
    assert arns.account_id("acme") == first
    assert arns.account_id("globex") != first


def test_builtin_models_have_readable_hub_content_names() -> None:
    assert arns.hub_content_name(catalog.TINY_DEBUG_NAME) == "treadle--tiny-debug"
    assert (
        arns.hub_content_name("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "HuggingFaceTB--SmolLM2-135M-Instruct"
    )


@pytest.mark.parametrize(
    "names",
    [
        ("org/model-v2", "org/model.v2", "org/model_v2", "org-model/v2", "org--model/v2"),
        ("Qwen/Qwen3-8B", "Qwen/Qwen3.8B", "qwen/qwen3-8b"),
        ("a/" + "b" * 90, "a/" + "b" * 91),
    ],
)
def test_hub_content_names_fit_the_pattern_and_never_collide(names: tuple[str, ...]) -> None:
    """Each registry name maps to a valid Hub content name, and distinct names to distinct
    ones (`org--name` where the parts are clean, else words plus a hash, which has no `--`)."""
    mapped = [arns.hub_content_name(name) for name in names]
    for name in mapped:
        assert HUB_CONTENT_NAME.fullmatch(name), name
    assert len(set(mapped)) == len(names)


def test_arns_are_built_with_the_callers_region_and_account() -> None:
    account = arns.account_id("acme")
    assert (
        arns.session_arn("eu-west-1", "acme", "demo")
        == f"arn:aws:sagemaker:eu-west-1:{account}:training-session/demo"
    )
    assert arns.package_arn("us-west-2", "acme", "grpo", 3).endswith(
        f":{account}:model-package/grpo/3"
    )


def test_a_group_arn_resolves_by_name_whatever_its_account_and_region() -> None:
    arn = "arn:aws:sagemaker:ap-south-1:123456789012:model-package-group/gsm8k-grpo"
    assert arns.group_name(arn) == "gsm8k-grpo"
    assert arns.group_name("gsm8k-grpo") == "gsm8k-grpo"
    with pytest.raises(ValidationError, match="not a model package group ARN"):
        arns.group_name("arn:aws:sagemaker:us-west-2:123456789012:model-package/g/1")
    with pytest.raises(ValidationError, match="group name"):
        arns.group_name("bad_name")


def test_package_references_parse_strictly() -> None:
    ref = arns.parse_package("arn:aws:sagemaker:us-west-2:123456789012:model-package/grpo/12")
    assert (ref.group, ref.version) == ("grpo", 12)
    assert arns.parse_package("grpo/3") == arns.PackageRef("grpo", 3)
    for bad in ("grpo", "grpo/0", "grpo/x", "arn:aws:sagemaker:r:1:model-package-group/grpo"):
        with pytest.raises(ValidationError):
            arns.parse_package(bad)


def test_hub_content_arns_round_trip() -> None:
    arn = arns.hub_content_arn("us-west-2", "treadle--tiny-debug")
    assert arn.endswith(":aws:hub-content/SageMakerPublicHub/Model/treadle--tiny-debug/1.0.0")
    assert arns.parse_hub_content_arn(arn) == arns.HubContentRef("treadle--tiny-debug", "1.0.0")
    unversioned = arn.rsplit("/", 1)[0]
    assert arns.parse_hub_content_arn(unversioned).version is None
    with pytest.raises(ValidationError, match="Hub content ARN"):
        arns.parse_hub_content_arn("arn:aws:sagemaker:us-west-2:aws:hub-content/Other/Model/x")


def test_a_session_arn_gives_its_name() -> None:
    assert arns.session_name("demo") == "demo"
    assert arns.session_name("arn:aws:sagemaker:us-west-2:1:training-session/demo") == "demo"
    with pytest.raises(NotFoundError):
        arns.session_name("arn:aws:sagemaker:us-west-2:1:model-package/g/1")
