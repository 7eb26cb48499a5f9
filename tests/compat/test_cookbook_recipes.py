"""tinker-cookbook 0.6.1 recipes that read hub data, run unmodified through `python -m
treadle.cookbook` on treadle/tiny-debug with the data supplied offline, two steps each:

- sdft (`topk=20`: teacher top-K prompt logprobs, then `cross_entropy` with (N, 20) targets) on
  ToolAlpaca-shaped rows, through the recipe's own `toolalpaca_data_path` option;
- distillation/off_policy_reasoning (plain SFT on OpenThoughts3, streamed) from a local
  `datasets` cache built here under the name the recipe loads;
- decisions.forecasting (sampling with `target_prompt_logprobs`, then `forward_backward_custom`
  of its Brier loss on `(T, K)` targets) on a Prophet Arena-shaped CSV, through the recipe's own
  `data_path` option.

Each test fails if its recipe fails, and checks in the event log that the platform was asked
what the recipe is known for."""

from __future__ import annotations

import csv
import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import datasets
import pytest
from datasets.packaged_modules.parquet.parquet import Parquet

from tests import vision_models
from tests.compat.cookbook_runs import jsonl, requested, run_recipe
from tests.conftest import Platform
from treadle import cookbook
from treadle.client.admin import AdminClient
from treadle.platform.models import catalog

# a recipe run, not a services test: make test runs it, .ci/run's second pass does not
pytestmark = pytest.mark.recipes

TINY = catalog.TINY_DEBUG_NAME


def tenant(platform: Platform, name: str) -> tuple[str, str]:
    """A tenant of its own (so its requests can be read alone) and its key."""
    tenant_id = f"{name}-{secrets.token_hex(3)}"
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        return tenant_id, str(admin.create_tenant(tenant_id)["api_key"])
    finally:
        admin.close()


def test_sdft_distils_from_teacher_top_k_targets(platform: Platform, tmp_path: Path) -> None:
    data = tmp_path / "toolalpaca"
    tools = ["weather", "calendar", "currency", "translate", "timer"]
    datasets.Dataset.from_dict(
        {
            "prompt": [f"Use the {t} tool for request {i}." for i in range(2) for t in tools],
            "golden_response": [
                [f"Action: {t}", f'Action Input: {{"id": {i}}}'] for i in range(2) for t in tools
            ],
        }
    ).save_to_disk(str(data))
    tenant_id, key = tenant(platform, "sdft")
    log = tmp_path / "sdft"
    run_recipe(
        platform, key, tmp_path, "tinker_cookbook.recipes.sdft.train",
        f"model_name={TINY}", "dataset=toolalpaca", f"toolalpaca_data_path={data}",
        "lora_rank=4", "groups_per_batch=2", "group_size=1", "max_tokens=6",
        "learning_rate=1e-3", "max_context_length=512", "eval_every=0", "save_every=0",
        "max_steps=2", f"log_path={log}", "behavior_if_log_dir_exists=delete",
    )  # fmt: skip
    assert len(requested(platform, tenant_id, "optim_step")) == 2
    teacher = [s for s in requested(platform, tenant_id, "sample") if s["topk_prompt_logprobs"]]
    assert teacher and {s["topk_prompt_logprobs"] for s in teacher} == {20}
    trained = requested(platform, tenant_id, "forward_backward")
    assert trained and {fb["loss_fn"] for fb in trained} == {"cross_entropy"}
    for fb in trained:
        for datum in fb["data"]:
            targets = datum["loss_fn_inputs"]["target_tokens"]
            assert targets["shape"] == [len(datum["tokens"]), 20]
            assert datum["loss_fn_inputs"]["weights"]["shape"] == targets["shape"]


def hub_dataset_cache(
    hf_home: Path,
    repo_id: str,
    rows: list[dict[str, Any]],
    *,
    test_rows: list[dict[str, Any]] | None = None,
    features: datasets.Features | None = None,
) -> None:
    """Put `rows` (and `test_rows`) in `hf_home`'s datasets cache as the prepared train (and
    test) split of `repo_id`, with `features` where given, where `datasets.load_dataset(repo_id)`
    finds it with the hub switched off (HF_HUB_OFFLINE=1)."""
    files = {}
    for split, split_rows in (("train", rows), ("test", test_rows)):
        if split_rows is None:
            continue
        source = hf_home / f"{repo_id.replace('/', '--')}-{split}.parquet"
        source.parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(split_rows, features=features).to_parquet(str(source))
        files[split] = str(source)
    cache = hf_home / "datasets"
    namespace, name = repo_id.split("/")
    builder = Parquet(
        cache_dir=str(cache), dataset_name=name, config_name="default", data_files=files,
        features=features,
    )  # fmt: skip
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)  # <cache>/<name>/default-<hash>/0.0.0
    # a hub dataset's cached copy is <cache>/<namespace>___<name>/<config>/<version>/<hash>
    # (datasets' CachedDatasetModuleFactory, which load_dataset tries when the hub is off)
    target = cache / f"{namespace}___{prepared.parents[1].name}" / "default" / "0.0.0"
    target.mkdir(parents=True)
    shutil.move(str(prepared), str(target / "prepared"))


def test_off_policy_reasoning_trains_on_a_streamed_hub_dataset(
    platform: Platform, tmp_path: Path
) -> None:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"What is {a} times {b}?"},
                {"from": "gpt", "value": f"<think>{a} groups of {b}.</think> {a * b}"},
            ]
        }
        for a in range(2, 5)
        for b in range(2, 5)
    ]
    hub_dataset_cache(tmp_path / "hf-home", "open-thoughts/OpenThoughts3-1.2M", rows)
    tenant_id, key = tenant(platform, "openthoughts")
    log = tmp_path / "off-policy"
    run_recipe(
        platform, key, tmp_path, "tinker_cookbook.recipes.distillation.off_policy_reasoning",
        f"model_name={TINY}", f"renderer_name={cookbook.SMOLLM2_RENDERER}", "lora_rank=4",
        "batch_size=2", "max_length=128", "buffer_size=4", "max_prompts=8", "eval_every=0",
        "save_every=0", "max_steps=2", f"log_path={log}", "behavior_if_log_dir_exists=delete",
    )  # fmt: skip
    steps = [m for m in jsonl(log / "metrics.jsonl") if "train_mean_nll" in m]
    assert [m["step"] for m in steps] == [0, 1]
    assert all(m["train_mean_nll"] > 0 for m in steps)
    trained = requested(platform, tenant_id, "forward_backward")
    assert len(trained) == 2 and {fb["loss_fn"] for fb in trained} == {"cross_entropy"}
    assert all(len(fb["data"]) == 2 for fb in trained)


def prophet_arena_csv(path: Path) -> None:
    """Binary markets in the Prophet Arena subset's columns: four events that closed before the
    recipe's default split date (training) and two opened after it (validation)."""
    columns = ["submission_id", "event_ticker", "title", "snapshot_time", "close_time",
               "market_outcome", "category", "markets", "sources"]  # fmt: skip
    events = [(f"2025-09-0{i}", f"2025-09-2{i}") for i in range(1, 5)] + [
        (f"2025-11-0{i}", f"2025-11-2{i}") for i in range(1, 3)
    ]
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=columns)
        writer.writeheader()
        for i, (opened, closes) in enumerate(events):
            market = f"Team {i} wins on {closes}"
            writer.writerow(
                {
                    "submission_id": f"s{i}",
                    "event_ticker": f"EVENT-{i}",
                    "title": f"Who wins match {i}?",
                    "snapshot_time": f"{opened}T12:00:00Z",
                    "close_time": f"{closes}T12:00:00Z",
                    "market_outcome": json.dumps({market: i % 2}),
                    "category": "Sports",
                    "markets": json.dumps([market]),
                    "sources": json.dumps([{"title": f"Preview {i}", "summary": "Even odds."}]),
                }
            )


def test_decisions_forecasting_trains_a_brier_loss_on_choice_probabilities(
    platform: Platform, tmp_path: Path
) -> None:
    data = tmp_path / "prophet-arena.csv"
    prophet_arena_csv(data)
    tenant_id, key = tenant(platform, "forecasting")
    log = tmp_path / "forecasting"
    run_recipe(
        platform, key, tmp_path, "tinker_cookbook.recipes.decisions.forecasting",
        f"model_name={TINY}", "lora_rank=4", f"data_path={data}", "batch_size=2",
        "max_steps=2", "eval_every=0", f"log_path={log}", "behavior_if_log_dir_exists=delete",
    )  # fmt: skip
    metrics = jsonl(log / "metrics.jsonl")
    assert [m["step"] for m in metrics if "train/loss" in m] == [1, 2]
    assert [m["step"] for m in metrics if any(k.startswith("test/") for k in m)] == [0, 2]
    scored = [s for s in requested(platform, tenant_id, "sample") if s["target_prompt_logprobs"]]
    assert scored  # the choices' probabilities: sparse prompt logprobs of each label's tokens
    # forward_backward_custom with a plain function, the client-side path: per step a forward
    # for the (T, 2) choice logprobs, then a backward on the loss's gradient as weights
    trained = requested(platform, tenant_id, "forward_backward")
    assert [fb["forward_only"] for fb in trained] == [True, False, True, False]
    assert {fb["loss_fn"] for fb in trained} == {"cross_entropy"}
    for fb in trained:
        for datum in fb["data"]:
            targets = datum["loss_fn_inputs"]["target_tokens"]
            assert len(targets["shape"]) == 2 and targets["shape"][1] == 2  # Yes / No


VL_MODEL = "Qwen/Qwen3-VL-8B-Instruct"  # a dense Qwen3-VL, the architecture of the tiny one
CLASSES = ["cat", "dog", "red_car"]


def test_vlm_classifier_trains_on_images_and_samples_from_them(
    platform: Platform, tmp_path: Path
) -> None:
    """vlm_classifier (dataset caltech101) on a tiny random Qwen3-VL registered under the name
    of a dense Qwen3-VL: its images reach the platform as ImageChunks in training datums and in
    its sampling evaluator's prompts."""
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        if VL_MODEL not in {m["name"] for m in admin.list_models(include_retired=True)}:
            folder = vision_models.vl_folder(tmp_path / "qwen3-vl")
            admin.register_model(VL_MODEL, path=str(folder))
    finally:
        admin.close()
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)}
    )

    def row(seed: int) -> dict[str, Any]:
        size = (48 + 8 * (seed % 3), 64 - 8 * (seed % 2))
        return {"image": {"bytes": vision_models.image_bytes(*size, seed=seed), "path": None},
                "label": seed % len(CLASSES)}  # fmt: skip

    hub_dataset_cache(
        tmp_path / "hf-home", "dpdl-benchmark/caltech101", [row(i) for i in range(4)],
        test_rows=[row(10 + i) for i in range(3)], features=features,
    )  # fmt: skip
    tenant_id, key = tenant(platform, "vlm")
    experiments = tmp_path / "vlm"
    run_recipe(
        platform, key, tmp_path, "tinker_cookbook.recipes.vlm_classifier.train",
        f"experiment_dir={experiments}", f"model_name={VL_MODEL}",
        "renderer_name=qwen3_vl_instruct", "dataset=caltech101", "lora_rank=4", "batch_size=2",
        "num_epochs=1", "max_steps=2", "eval_every=2", "save_every=0", "n_eval=2",
        "max_tokens=8", "behavior_if_log_dir_exists=delete",
    )  # fmt: skip
    (log,) = experiments.iterdir()
    steps = [m for m in jsonl(log / "metrics.jsonl") if "train_mean_nll" in m]
    assert [m["step"] for m in steps] == [0, 1]
    trained = requested(platform, tenant_id, "forward_backward")
    assert len(trained) == 2 and all(len(fb["data"]) == 2 for fb in trained)
    for fb in trained:
        for datum in fb["data"]:
            (image,) = datum["images"]
            assert image["format"] == "jpeg" and image["tokens"] > 0
    sampled = requested(platform, tenant_id, "sample")
    assert sampled and all(len(s["images"]) == 1 for s in sampled)
