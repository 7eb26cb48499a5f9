"""code_rl end to end on tiny-debug: per-step metrics with the staleness inside its limit, every
episode scored by the sandbox, the curve, a checkpoint, and --resume continuing from it; and a
step's streamed forward_backward calls training the adapter one call on all the data trains."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from safetensors.numpy import load_file
from tinker import types

import treadle
from tests.conftest import Platform
from tests.recipes.conftest import RunRecipe, is_png, metrics_rows, saved_checkpoint, summary
from treadle.client.checkpoints import CheckpointsClient
from treadle.recipes.code_rl import train_step
from treadle.recipes.common.envs import Action, Episode, Turn, episode_datums, group_advantages
from treadle.recipes.common.rollouts import RolloutPool, StalePolicy

TINY = ("--batch-size", "2", "--group-size", "2", "--max-tokens", "8", "--rank", "4")


def test_a_run_overlaps_sampling_within_the_staleness_limit_and_draws_its_curve(
    run_recipe: RunRecipe, tmp_path: Path
) -> None:
    done = run_recipe("code_rl", *TINY, "--steps", "3", "--max-steps-off-policy", "1",
                      "--eval-every", "2", "--save-every", "2", log_dir=tmp_path)  # fmt: skip
    rows = metrics_rows(tmp_path)
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval_pass_rate" in r] == [0, 2, 3]
    # Step n (0-based) trains on weights n; its batch came from weights n - staleness.
    assert all(0 <= r["staleness"] <= 1 for r in steps)
    assert all(r["sampler_step"] == r["step"] - 1 - r["staleness"] for r in steps)
    # tiny-debug writes noise, never a code block: every reply earns -0.1.
    assert all(r["reward_mean"] == -0.1 and r["no_code_rate"] == 1.0 for r in steps)
    replies = [json.loads(line) for line in (tmp_path / "samples" / "step-000003.jsonl").open()]
    assert len(replies) == 4 and {r["outcome"] for r in replies} == {"no code"}
    assert is_png(tmp_path / "curve.png")
    checkpoint = saved_checkpoint(tmp_path)
    assert checkpoint["step"] == 3 and checkpoint["state"].startswith("tinker://")
    result = summary(done)
    assert result["max_staleness"] == max(r["staleness"] for r in steps)
    assert result["held_out_pass_rate_before"] == rows[0]["eval_pass_rate"]


def test_without_overlap_every_batch_is_on_policy(run_recipe: RunRecipe, tmp_path: Path) -> None:
    run_recipe("code_rl", *TINY, "--steps", "2", "--max-steps-off-policy", "0",
               "--num-rollout-workers", "1", "--stale-policy", "drop", "--loss", "cispo",
               "--eval-every", "0", "--save-every", "0", log_dir=tmp_path)  # fmt: skip
    steps = [r for r in metrics_rows(tmp_path) if "staleness" in r]
    assert [(r["step"], r["staleness"], r["sampler_step"]) for r in steps] == [(1, 0, 0), (2, 0, 1)]


def test_resume_continues_from_the_saved_step(run_recipe: RunRecipe, tmp_path: Path) -> None:
    run_recipe("code_rl", *TINY, "--steps", "1", "--eval-every", "0", log_dir=tmp_path)
    run_recipe("code_rl", *TINY, "--steps", "2", "--eval-every", "0", "--resume",
               log_dir=tmp_path)  # fmt: skip
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    # The resumed run sampled its first batch from the checkpoint's weights (after step 1), and
    # did not evaluate step 1 again: the first run's evaluation there is kept.
    second = next(r for r in rows if r["step"] == 2 and "sampler_step" in r)
    assert second["sampler_step"] == 1 and second["staleness"] == 0
    assert [r["step"] for r in rows if "eval_pass_rate" in r] == [0, 1, 2]
    assert saved_checkpoint(tmp_path)["step"] == 2


def test_the_plain_tinker_sdk_drives_the_same_loop(run_recipe: RunRecipe, tmp_path: Path) -> None:
    run_recipe("code_rl", *TINY, "--steps", "2", "--eval-every", "0", client="tinker",
               log_dir=tmp_path)  # fmt: skip
    steps = [r for r in metrics_rows(tmp_path) if "staleness" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["staleness"] <= 1 for r in steps)
    assert saved_checkpoint(tmp_path)["step"] == 2


def _group(offset: int) -> list[Episode]:
    """Two one-turn episodes of a prompt, one right and one wrong: a group with a signal."""
    prompt = [1, 9690, 198, 2683 + offset]
    return [
        Episode([Turn(prompt, Action(tokens, [-1.5, -2.0, -0.7], "", "stop"), reward, {})])
        for tokens, reward in (([504, 3575, 282 + offset], 1.0), ([30, 378, 3575], 0.0))
    ]


def test_streamed_forward_backward_trains_the_same_adapter_as_one_call(
    platform: Platform, tmp_path: Path
) -> None:
    """code_rl's step sends each group's forward_backward as the pool hands it over; the
    gradients add up until optim_step, so the adapter equals one call on all the data."""
    groups = [_group(0), _group(7)]
    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=platform.admin_key)
    ckpts = CheckpointsClient(platform.base_url, platform.admin_key)
    args = SimpleNamespace(batch_size=2, loss="cispo", learning_rate=1e-2)
    try:
        streamed, whole = (
            svc.create_lora_training_client("treadle/tiny-debug", rank=4, seed=11) for _ in "ab"
        )
        pool = RolloutPool(lambda work, sampler: groups[work.index], None, num_workers=1,
                           batch_size=2, start_step=0, max_steps_off_policy=0,
                           stale_policy=StalePolicy.REQUEUE)  # fmt: skip
        try:
            rollouts, _, datums, _ = train_step(streamed, pool, 0, args)
        finally:
            pool.close()
        assert [r.work.index for r in rollouts] == [0, 1] and datums == 4
        data = [d for g in groups for e, a in zip(g, group_advantages(g), strict=True)
                for d in episode_datums(e, a)]  # fmt: skip
        whole.forward_backward(data, loss_fn="cispo")
        whole.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        adapters = []
        for name, tc in (("streamed", streamed), ("whole", whole)):
            ckpts.download(tc.save_state(name).result().path, tmp_path / name)
            adapters.append(load_file(str(tmp_path / name / "adapter_model.safetensors")))
    finally:
        svc.close()
    a, b = adapters
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-6)
    assert any(np.abs(a[k]).max() > 0 for k in a if "lora_B" in k)  # it did train
