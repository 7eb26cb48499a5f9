"""tinker-cookbook 0.6.1 recipes run unmodified against the served platform through the one
documented registration, `python -m treadle.cookbook <recipe module> [args]` (treadle/cookbook.py):
the supervised recipe (chat_sl, on a dataset written here) and math_rl with env=arithmetic, each
on treadle/tiny-debug with a checkpoint saved and training started again from it, and math_rl
with its default loss (stable_reinforce: recorded samples, provenance) on SmolLM2-135M-Instruct,
synchronous and async (max_steps_off_policy=1); only
TINKER_BASE_URL / TINKER_API_KEY point them at Treadle, and the hub is off (HF_HUB_OFFLINE=1).
Also: the registration's renderer writes SmolLM2's chat template token for token, and it extends
the cookbook's model table without hiding the cookbook's own models."""

from __future__ import annotations

import ast
import json
import math
import secrets
from pathlib import Path
from typing import Any

import pytest
from tinker_cookbook import model_info, renderers, tokenizer_utils
from tinker_cookbook.exceptions import ConfigurationError
from tinker_cookbook.renderers.base import ParseTermination

from tests.compat.cookbook_runs import jsonl, losses_trained, run_recipe
from tests.conftest import Platform, new_tenant_key
from treadle import cookbook
from treadle.client.admin import AdminClient
from treadle.platform.models import catalog, tokenizers

# a recipe run, not a services test: make test runs it, .ci/run's second pass does not
pytestmark = pytest.mark.recipes

TINY = catalog.TINY_DEBUG_NAME
SMOLLM2 = catalog.SMOLLM2_NAME


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return new_tenant_key(platform, "cookbook")


def batches(log: Path) -> list[dict[str, Any]]:
    """The RL trainer's per-step metrics (0.6 also logs a run's token totals at its end)."""
    return [m for m in jsonl(log / "metrics.jsonl") if "env/all/reward/total" in m]


def test_sft_recipe_trains_saves_and_starts_again_from_its_checkpoint(
    platform: Platform, key: str, tmp_path: Path
) -> None:
    data = tmp_path / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {a} + {b}?"},
                        {"role": "assistant", "content": str(a + b)},
                    ]
                }
            )
            + "\n"
            for a in range(3)
            for b in range(3)
        )
    )
    common = (
        f"dataset={data}", f"model_name={TINY}", "lora_rank=4", "batch_size=2",
        "max_length=128", "eval_every=0", "infrequent_eval_every=0",
        "behavior_if_log_dir_exists=delete",
    )  # fmt: skip
    first = tmp_path / "sft-1"
    run_recipe(
        platform, key, tmp_path, "tinker_cookbook.recipes.chat_sl.train", *common,
        f"log_path={first}", "max_steps=2", "save_every=1",
    )  # fmt: skip
    steps = jsonl(first / "metrics.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    assert all(math.isfinite(s["train_mean_nll"]) and s["train_mean_nll"] > 0 for s in steps)
    saved = [c for c in jsonl(first / "checkpoints.jsonl") if "state_path" in c]
    assert saved and saved[0]["name"] == "000001"
    state = saved[0]["state_path"]
    assert state.startswith("tinker://") and "/weights/" in state

    second = tmp_path / "sft-2"
    done = run_recipe(
        platform, key, tmp_path, "tinker_cookbook.recipes.chat_sl.train", *common,
        f"log_path={second}", "max_steps=1", f"load_checkpoint_path={state}",
    )  # fmt: skip
    assert f"Loaded weights from {state}" in done.stdout + done.stderr
    assert [s["step"] for s in jsonl(second / "metrics.jsonl")] == [0]


def test_math_rl_arithmetic_trains_saves_and_resumes_from_its_log_dir(
    platform: Platform, key: str, tmp_path: Path
) -> None:
    log = tmp_path / "math-rl"
    common = (
        "env=arithmetic", f"model_name={TINY}", "lora_rank=4", "group_size=2",
        "groups_per_batch=2", "max_tokens=4", "save_every=1", "eval_every=0",
        f"log_path={log}", "behavior_if_log_dir_exists=resume",
    )  # fmt: skip
    run_recipe(platform, key, tmp_path, "tinker_cookbook.recipes.math_rl.train", *common,
               "max_steps=2")  # fmt: skip
    assert [m["step"] for m in batches(log)] == [0, 1]
    last = [c for c in jsonl(log / "checkpoints.jsonl") if "state_path" in c][-1]
    assert last["batch"] == 2

    done = run_recipe(platform, key, tmp_path, "tinker_cookbook.recipes.math_rl.train",
                      *common, "max_steps=3")  # fmt: skip
    assert f"Resumed training from {last['state_path']}" in done.stdout + done.stderr
    metrics = batches(log)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(-1.0 <= m["env/all/reward/total"] <= 1.0 for m in metrics)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_math_rl_with_its_default_loss_runs_to_the_end_on_smollm2(
    platform: Platform, tmp_path: Path, mode: str
) -> None:
    """0.6.1's default loss is stable_reinforce: its samplers record stability information and
    every datum names its sequences; async training samples up to one step ahead."""
    tenant_id = f"cookbook-{mode}-{secrets.token_hex(3)}"
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        key = str(admin.create_tenant(tenant_id)["api_key"])
    finally:
        admin.close()
    log = tmp_path / f"math-rl-{mode}"
    extra = ("max_steps_off_policy=1",) if mode == "async" else ()
    run_recipe(
        platform, key, tmp_path, "tinker_cookbook.recipes.math_rl.train",
        "env=arithmetic", f"model_name={SMOLLM2}", "lora_rank=4", "group_size=2",
        "groups_per_batch=2", "max_tokens=6", "eval_every=0", "save_every=0", "max_steps=3",
        f"log_path={log}", "behavior_if_log_dir_exists=delete", *extra,
    )  # fmt: skip
    metrics = batches(log)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert all(-1.0 <= m["env/all/reward/total"] <= 1.0 for m in metrics)
    assert losses_trained(platform, tenant_id) == {"stable_reinforce"}
    if mode == "async":
        assert all(0 <= m["async/staleness_max"] <= 1 for m in metrics)


# -- the registration itself -------------------------------------------------------------------


def test_the_registration_imports_no_server_code() -> None:
    tree = ast.parse(Path(cookbook.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names} | {
        node.module for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }  # fmt: skip
    server = ("treadle.platform", "treadle.api", "treadle.engine", "treadle.worker", "flask",
              "sqlalchemy", "celery", "torch")  # fmt: skip
    assert sorted(n for n in imported if n.split(".")[0] in server or n.startswith(server)) == []


def test_registration_covers_the_catalogue_and_keeps_the_cookbooks_models() -> None:
    cookbook.register("http://treadle.invalid", "tml-unused")
    lookup = model_info.get_model_attributes
    cookbook.register("http://treadle.invalid", "tml-unused")
    assert model_info.get_model_attributes is lookup  # idempotent: wrapped once
    assert [m.name for m in cookbook.MODELS] == [m.name for m in catalog.list_base_models()]
    for model in catalog.list_base_models():
        assert model_info.get_recommended_renderer_name(model.name) == cookbook.SMOLLM2_RENDERER
        assert model_info.get_recommended_renderer_name(f"{model.name}:ckpt") == (
            cookbook.SMOLLM2_RENDERER
        )
        assert tokenizer_utils.is_tokenizer_registered(model.name)
    assert model_info.get_model_attributes("Qwen/Qwen3-8B").size_str == "8B"
    with pytest.raises(ConfigurationError, match="Unknown model"):
        model_info.get_model_attributes("nobody/nothing")


def test_a_missing_url_or_key_says_what_to_set() -> None:
    cookbook.register(None, None)
    try:
        with pytest.raises(RuntimeError, match="set TINKER_BASE_URL"):
            tokenizer_utils.get_tokenizer(TINY)
    finally:
        cookbook.register("http://treadle.invalid", "tml-unused")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": " leading space\n"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
    ],
)
def test_the_smollm2_renderer_writes_the_chat_template_token_for_token(
    messages: list[Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache = tmp_path_factory.getbasetemp() / "cookbook-tokenizer"
    tokenizer = tokenizers.load_tokenizer(catalog.SMOLLM2_NAME, cache)
    cookbook.register("http://treadle.invalid", "tml-unused")
    renderer = renderers.get_renderer(cookbook.SMOLLM2_RENDERER, tokenizer)
    prompt = renderer.build_generation_prompt(messages).to_ints()
    template = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    assert prompt == list(template)
    reply = tokenizer.encode("4<|im_end|>", add_special_tokens=False)
    message, termination = renderer.parse_response(reply)
    assert message["content"] == "4" and termination == ParseTermination.STOP_SEQUENCE
