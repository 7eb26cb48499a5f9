"""The published SageMaker GSM8K GRPO example through the official `sagemaker-train` SDK,
unmodified and unpatched, against the served platform (`treadle up`, real workers), on
SmolLM2-135M-Instruct: the user's process (tests/compat/sagemaker_gsm8k.py) knows Treadle only
by AWS_ENDPOINT_URL, an access key pair from `treadle keys create --aws`, AWS_REGION and
HF_ENDPOINT. Its loop runs as written, then every follow-up call; this test checks what they
did on the server, in the same log, ledger and registry every other client sees.

- The session resumed from `save_state()` continues to the uninterrupted session's weights and
  optimizer state, bit for bit (the state hashes each optimizer step records).
- The merged save loads in plain transformers and gives the session's logprobs.
- Every save is a version of the group the example named; kinds, listing, latest and deletion
  as the SDK reads them; the session is metered, listed by Treadle's audit, and deleted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import boto3
import pytest
import sqlalchemy as sa
import torch

from tests.compat.users import aws_user_env, new_aws_user
from tests.conftest import Platform
from treadle.client.audit import AuditClient
from treadle.client.billing import BillingClient
from treadle.client.checkpoints import CheckpointsClient
from treadle.platform import db

# The example samples up to 512 tokens (the least the SageMaker API takes), and SmolLM2 often
# writes them all: about 6 minutes on this CPU alone, and past pytest's 10-minute limit with
# another test process beside it. The run has a limit of its own, under this one, so a run that
# is too slow fails here instead of ending the test process.
EXAMPLE_TIMEOUT_S = 1100
# The published example run as its users run it: make test runs it, .ci/run's second pass (the
# machine's own services) does not; tests/compat/test_sagemaker_routes.py covers the surface there.
pytestmark = [pytest.mark.recipes, pytest.mark.timeout(EXAMPLE_TIMEOUT_S + 300)]

EXAMPLE = Path(__file__).with_name("sagemaker_gsm8k.py")
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SESSION = "gsm8k-grpo-demo"
GROUP = "gsm8k-grpo"


@pytest.fixture(scope="module")
def run(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example run once in a user's process; its report, and the user's credentials."""
    user = new_aws_user(platform, "gsm8k")
    folder = tmp_path_factory.mktemp("gsm8k")
    report_path = folder / "report.json"
    env = aws_user_env(
        platform.base_url,
        user,
        folder / "hf",
        BASE_MODEL=BASE_MODEL,
        SESSION_NAME=SESSION,
        NUM_STEPS="2",
        BATCH_SIZE="2",
        GROUP_SIZE="2",
    )
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), str(report_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report: dict[str, Any] = json.loads(report_path.read_text())
    return {"report": report, "user": user, "stdout": done.stdout}


def session_ids(platform: Platform, tenant_id: str) -> dict[str, str]:
    """The tenant's SageMaker sessions by name, deleted ones included."""
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT name, session_id FROM sagemaker_sessions WHERE tenant_id = :t"),
                {"t": tenant_id},
            ).all()
    finally:
        engine.dispose()
    return {r.name: r.session_id for r in rows}


def last_optim_state(platform: Platform, session_id: str) -> dict[str, str]:
    engine = db.connect(platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            return dict(
                conn.execute(
                    sa.text(
                        "SELECT state FROM operations WHERE session_id = :s "
                        "AND type = 'optim_step' AND status = 'completed' "
                        "ORDER BY seq_id DESC LIMIT 1"
                    ),
                    {"s": session_id},
                ).scalar_one()
            )
    finally:
        engine.dispose()


def version(arn: str) -> int:
    group, number = arn.rsplit("/", 2)[-2:]
    assert group == GROUP
    return int(number)


def test_the_loop_trains_and_samples_each_step_from_its_new_weights(run: dict[str, Any]) -> None:
    report = run["report"]
    assert {BASE_MODEL, "treadle/tiny-debug"} <= set(report["base_models"])
    steps = report["steps"]
    assert len(steps) == 2
    for step in steps:
        assert step["datums"] == 4
        assert math.isfinite(step["fb_metrics"]["loss:sum"])
        assert step["optim_metrics"]["learning_rate:mean"] == pytest.approx(1e-5)
    # each step's sampler is the package that step saved, the next version of the group
    assert version(steps[1]["sampler"]) == version(steps[0]["sampler"]) + 1


def test_the_resumed_session_continues_the_uninterrupted_one_bit_for_bit(
    run: dict[str, Any], platform: Platform
) -> None:
    ids = session_ids(platform, run["user"]["tenant_id"])
    uninterrupted = last_optim_state(platform, ids[SESSION])
    resumed = last_optim_state(platform, ids[f"{SESSION}-resume"])
    assert resumed == uninterrupted
    assert set(resumed) >= {"weights", "optimizer"}


def test_logprobs_agree_across_sampler_forward_and_prompt_scores(run: dict[str, Any]) -> None:
    report = run["report"]
    prompt, scored = report["prompt"], report["compute_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    assert all(lp <= 0 for lp in scored[1:])
    # a sample's prompt logprobs leave out the first token, which has none
    assert report["prompt_logprobs"] == pytest.approx(scored[1:], abs=1e-5)
    # the training forward on the session's weights, which the last sampler package holds
    forward = report["forward_logprobs"][: len(prompt) - 1]
    assert forward == pytest.approx(scored[1:], abs=1e-4)


def test_the_merged_save_loads_in_plain_transformers_with_the_sessions_logprobs(
    run: dict[str, Any], platform: Platform
) -> None:
    from transformers import AutoModelForCausalLM

    report, user = run["report"], run["user"]
    registry = sagemaker_client(platform, user)
    described = registry.describe_model_package(ModelPackageName=report["merged_arn"])
    container = described["InferenceSpecification"]["Containers"][0]
    assert container["IsCheckpoint"] is False
    assert described["CustomerMetadataProperties"]["Merged"] == "true"
    path = described["CustomerMetadataProperties"]["TinkerPath"]
    checkpoints = CheckpointsClient(platform.base_url, user["api_key"])
    with tempfile.TemporaryDirectory() as folder:
        checkpoints.download(path, Path(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = report["forward_tokens"]
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert logprobs.tolist() == pytest.approx(report["forward_logprobs"], abs=2e-4)


def test_saves_are_versions_of_the_named_group_as_the_sdk_lists_them(
    run: dict[str, Any], platform: Platform
) -> None:
    report = run["report"]
    samplers = [step["sampler"] for step in report["steps"]]
    state, merged = report["state_arn"], report["merged_arn"]
    assert version(samplers[0]) < version(samplers[1]) < version(merged) < version(state)
    # listed newest first; the first sampler package was deleted at the end
    listed = report["packages"]
    assert listed[:3] == [state, merged, samplers[1]]
    assert report["model_packages"][:2] == [merged, samplers[1]]  # MODEL: no saveState
    assert report["latest_checkpoint"] == state
    describe = sagemaker_client(platform, run["user"]).describe_model_package(
        ModelPackageName=state
    )
    assert describe["InferenceSpecification"]["Containers"][0]["IsCheckpoint"] is True
    assert describe["InferenceSpecification"]["Containers"][0]["BaseModel"] == {
        "HubContentName": "HuggingFaceTB--SmolLM2-135M-Instruct",
        "HubContentVersion": "1.0.0",
    }
    assert describe["ManagedStorageType"] == "Restricted"


def test_a_deleted_package_and_session_are_gone_and_a_repeat_is_no_error(
    run: dict[str, Any], platform: Platform
) -> None:
    report = run["report"]
    assert report["deleted"] == [True, False]  # the second delete found nothing: no error
    assert SESSION in report["sessions"] and f"{SESSION}-resume" in report["sessions"]
    assert SESSION not in report["sessions_after_delete"]
    client = sagemaker_client(platform, run["user"])
    with pytest.raises(client.exceptions.ClientError) as gone:
        client.describe_model_package(ModelPackageName=report["steps"][0]["sampler"])
    assert gone.value.response["Error"]["Code"] == "ResourceNotFound"


def test_the_session_is_metered_and_audited_like_any_other(
    run: dict[str, Any], platform: Platform
) -> None:
    user = run["user"]
    ids = session_ids(platform, user["tenant_id"])
    tokens = (
        BillingClient(platform.base_url, user["api_key"]).session_usage(ids[SESSION]).usage.tokens
    )
    assert tokens["train"] > 0 and tokens["sample"] > 0 and tokens["prefill"] > 0
    listing = AuditClient(platform.base_url, user["api_key"]).list_sessions()
    names = {s["name"] for s in listing}
    assert {SESSION, f"{SESSION}-resume"} <= names
    resumed = sagemaker_client(platform, user).describe_training_session(
        TrainingSessionName=f"{SESSION}-resume"
    )["TrainingSessionDetail"]
    assert resumed["TrainingSessionStatus"] == "Stopped"
    billed = resumed["BillableTokenUsage"]
    resumed_usage = BillingClient(platform.base_url, user["api_key"]).session_usage(
        ids[f"{SESSION}-resume"]
    )
    assert billed["TrainingTokenCount"] == resumed_usage.usage.tokens["train"] > 0
    assert resumed["LastReceivedSequenceNumber"] == 3  # loadState, forwardBackward, step


def sagemaker_client(platform: Platform, user: dict[str, str]) -> Any:
    return boto3.client(
        "sagemaker",
        endpoint_url=platform.base_url,
        region_name="us-west-2",
        aws_access_key_id=user["access_key_id"],
        aws_secret_access_key=user["secret_access_key"],
    )
