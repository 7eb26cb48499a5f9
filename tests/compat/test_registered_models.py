"""Base models the operator registers, end to end: tiny random models of twelve architectures
(tests/architectures.py: the eight once admitted by name, four admitted by structure alone;
tokenizers trained here, one byte-level BPE, one SentencePiece) saved with `save_pretrained`,
registered with `treadle models add`, and driven through the plain tinker SDK against the served
platform (`treadle up`, real workers): every served loss, optim_step, sample, compute_logprobs,
save_state and load, and a merged export loaded by plain transformers. Sample logprobs equal
forward logprobs; a sample alone equals the same sample among other architectures' samples. The
architectures admitted by structure train every attention and MLP linear, the modules peft's
`all-linear` chooses, with the logprobs peft computes from the exported adapter; architectures
whose blocks do not resolve are refused by `treadle models add` with the modules named.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests import architectures, tiny_models
from tests.compat import users
from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.client.checkpoints import CheckpointsClient
from treadle.client.rest import TreadleApiError

pytestmark = pytest.mark.integration

PROMPT = [5, 17, 42, 99, 7, 123, 64, 11, 250, 3, 77, 18]
TOL = 1e-4  # float32 end to end, through different kernels (oneDNN-packed sampling)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        arch: tiny_models.model_folder(arch, root / arch) for arch in architectures.ARCHITECTURES
    }


def cli(platform: Platform, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TREADLE_BASE_URL": platform.base_url,
        "TREADLE_API_KEY": key or platform.admin_key,
    }
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def names(platform: Platform, folders: dict[str, Path]) -> dict[str, str]:
    """Each architecture registered through `treadle models add` under a name of this run."""
    run = secrets.token_hex(3)
    out = {}
    for arch, folder in folders.items():
        name = f"tiny-{run}/{arch}"
        done = cli(platform, "models", "add", name, "--path", str(folder), "--max-lora-rank", "16")
        assert done.returncode == 0, done.stderr
        entry = json.loads(done.stdout)
        assert entry["name"] == name and entry["kind"] == "hf" and entry["path"] == str(folder)
        out[arch] = name
    return out


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        return str(admin.create_tenant(f"registered-{secrets.token_hex(3)}")["api_key"])
    finally:
        admin.close()


@pytest.fixture(scope="module")
def service(platform: Platform, key: str) -> Iterator[tinker.ServiceClient]:
    svc = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    yield svc
    svc.close("success").result()


def rl_datum(tokens: list[int], **extra: list[float]) -> types.Datum:
    n = len(tokens) - 1
    inputs: dict[str, Any] = {
        "target_tokens": tokens[1:],
        "logprobs": [-2.0] * n,
        "advantages": [0.5 if i % 2 else -0.25 for i in range(n)],
        **extra,
    }
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def ce_datum(tokens: list[int]) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
    )


ADVANTAGE = 0.75


def forward_logprobs(tc: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    out = tc.forward([ce_datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


@pytest.mark.parametrize("arch", architectures.ARCHITECTURES)
def test_a_registered_model_trains_samples_saves_and_loads(
    service: tinker.ServiceClient, names: dict[str, str], arch: str
) -> None:
    tc = service.create_lora_training_client(names[arch], rank=4, seed=3).result()
    info = tc.get_info()
    assert info.model_data.tokenizer_id == names[arch]
    n = len(PROMPT) - 1
    losses = {
        "cross_entropy": ce_datum(PROMPT),
        "importance_sampling": rl_datum(PROMPT),
        "ppo": rl_datum(PROMPT),
        "cispo": rl_datum(PROMPT),
        "dro": rl_datum(PROMPT),
        "gspo": rl_datum(PROMPT, sequence_ratio_mask=[1.0] * n),
    }
    for loss, datum in losses.items():
        out = tc.forward_backward([datum], loss).result()
        lp = out.loss_fn_outputs[0]["logprobs"].tolist()
        assert len(lp) == n and all(np.isfinite(lp)) and all(v <= 0 for v in lp), loss
    before = forward_logprobs(tc, PROMPT)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = forward_logprobs(tc, PROMPT)
    assert np.abs(after - before).max() > 1e-4  # the step changed the adapter

    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    sampled = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    for seq in sampled.sequences:
        full = PROMPT + list(seq.tokens)
        scored = forward_logprobs(tc, full)[len(PROMPT) - 1 :]
        np.testing.assert_allclose(np.asarray(seq.logprobs), scored, atol=TOL)
    # stable_reinforce over the recorded sample: on policy, each sampled token's weight is 1
    seq = sampled.sequences[0]
    out = tc.forward_backward(
        [users.provenance_datum(PROMPT, seq, ADVANTAGE)], "stable_reinforce"
    ).result()
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), np.float64)[len(PROMPT) - 1 :]
    assert out.metrics["loss:sum"] == pytest.approx(-ADVANTAGE * lp.sum(), rel=1e-3, abs=1e-4)
    prompt_scores = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert prompt_scores[0] is None
    np.testing.assert_allclose(np.asarray(prompt_scores[1:], dtype=np.float64), after, atol=TOL)

    state = tc.save_state("registered").result().path
    again = service.create_training_client_from_state(state).result()
    np.testing.assert_allclose(forward_logprobs(again, PROMPT), after, atol=1e-6)


def test_a_sample_alone_equals_the_same_sample_among_other_architectures(
    service: tinker.ServiceClient, names: dict[str, str]
) -> None:
    samplers = {
        arch: service.create_sampling_client(base_model=names[arch]).result()
        for arch in architectures.ARCHITECTURES
    }
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    prompt = types.ModelInput.from_ints(PROMPT)
    alone = {a: s.sample(prompt, 2, params).result() for a, s in samplers.items()}
    with ThreadPoolExecutor(len(samplers)) as pool:
        futures = {
            a: pool.submit(lambda s=s: s.sample(prompt, 2, params)) for a, s in samplers.items()
        }
        together = {a: f.result().result() for a, f in futures.items()}
    for arch in samplers:
        assert [list(s.tokens) for s in alone[arch].sequences] == [
            list(s.tokens) for s in together[arch].sequences
        ], arch


@pytest.mark.parametrize("arch", architectures.ARCHITECTURES)
def test_a_merged_export_loads_in_plain_transformers(
    platform: Platform, key: str, names: dict[str, str], arch: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    import treadle

    svc = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    try:
        tc = svc.create_lora_training_client(names[arch], rank=4, seed=1)
        tc.forward_backward([ce_datum(PROMPT)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        out = tc.forward([ce_datum(PROMPT)], "cross_entropy").result()
        served = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())
        path = tc.save_weights_for_sampler("merged", merge_weights=True).result().path
    finally:
        svc.close()
    checkpoints = CheckpointsClient(platform.base_url, key)
    try:
        checkpoints.download(path, tmp_path / "merged")
    finally:
        checkpoints.http.close()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT[:-1]])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1)[
        torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])
    ]
    np.testing.assert_allclose(logprobs.numpy(), served, atol=TOL)


@pytest.mark.parametrize("arch", sorted(architectures.MOE))
def test_a_moe_session_adapts_its_experts_by_default(
    platform: Platform,
    key: str,
    service: tinker.ServiceClient,
    names: dict[str, str],
    arch: str,
    tmp_path: Path,
) -> None:
    """train_mlp=True (the SDK's default) on Qwen3-MoE and gpt-oss adapts every expert, as peft's
    `target_parameters`: the saved state says so and holds their tensors."""
    tc = service.create_lora_training_client(names[arch], rank=4, seed=2).result()
    tc.forward_backward([ce_datum(PROMPT)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_state("experts").result().path
    checkpoints = CheckpointsClient(platform.base_url, key)
    try:
        checkpoints.download(path, tmp_path / "state")
    finally:
        checkpoints.http.close()
    config = json.loads((tmp_path / "state" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "state" / "adapter_model.safetensors"), "pt") as f:
        expert_tensors = [k for k in f.keys() if ".mlp.experts." in k]  # noqa: SIM118
    assert len(expert_tensors) == 8  # A and B of gate_up_proj and down_proj, two layers


def test_the_registry_lists_shows_and_retires(
    platform: Platform,
    key: str,
    service: tinker.ServiceClient,
    names: dict[str, str],
    folders: dict[str, Path],
) -> None:
    retired = names["llama3"] + "-retired"  # a name of its own: the other tests use llama3's
    added = cli(platform, "models", "add", retired, "--path", str(folders["llama3"]))
    assert added.returncode == 0, added.stderr
    listed = json.loads(cli(platform, "models", "list").stdout)
    assert set(names.values()) <= {m["name"] for m in listed}
    shown = json.loads(cli(platform, "models", "show", names["phi3"]).stdout)
    assert shown["architecture"] == "Phi3ForCausalLM" and shown["parameters"] > 0
    assert shown["size_bytes"] == 4 * shown["parameters"]  # float32 weights
    import treadle

    treadle_service = treadle.ServiceClient(base_url=platform.base_url, api_key=key)
    try:
        assert names["phi3"] in treadle_service.list_base_models()
    finally:
        treadle_service.close()

    tc = service.create_lora_training_client(retired, rank=4).result()
    done = cli(platform, "models", "retire", retired)
    assert done.returncode == 0 and json.loads(done.stdout)["retired_at"]
    with pytest.raises(tinker.BadRequestError, match="retired"):
        service.create_lora_training_client(retired, rank=4).result()
    tc.forward_backward([ce_datum(PROMPT)], "cross_entropy").result()  # sessions on it go on
    listed = json.loads(cli(platform, "models", "list").stdout)
    assert retired not in {m["name"] for m in listed}
    refused = cli(platform, "models", "retire", names["phi3"], key=key)  # not the operator
    assert refused.returncode == 1 and "operator" in refused.stderr


def test_hub_clients_get_each_models_own_tokenizer(
    platform: Platform, key: str, names: dict[str, str], folders: dict[str, Path], tmp_path: Path
) -> None:
    """The plain tinker SDK's `get_tokenizer()` (which loads the model's tokenizer repo through
    /hf) equals the folder's own tokenizer on a few hundred strings and on the chat template."""
    script = """
import json, sys, tinker
from transformers import AutoTokenizer
pairs, texts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
messages = [{"role": "user", "content": t} for t in texts[:5]]
service = tinker.ServiceClient()
bad = []
for name, folder in pairs:
    training = service.create_lora_training_client(name, rank=4, train_mlp=False).result()
    served, local = training.get_tokenizer(), AutoTokenizer.from_pretrained(folder)
    for t in texts:
        if served.encode(t) != local.encode(t) or served.decode(served.encode(t)) != local.decode(local.encode(t)):
            bad.append([name, t])
    if served.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) != \\
            local.apply_chat_template(messages, tokenize=False, add_generation_prompt=True):
        bad.append([name, "chat template"])
print(json.dumps(bad))
"""
    env = users.user_env(
        platform.base_url, key, tmp_path / "hf", HF_ENDPOINT=f"{platform.base_url}/hf"
    )
    pairs = [[names[a], str(folders[a])] for a in architectures.ARCHITECTURES]
    texts = tiny_models.corpus(300, seed=9) + ["  spaces\tand\nlines ", "ünïcödé 🚀", "12345"]
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(pairs), json.dumps(texts)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# peft 0.21's PeftModel asks transformers 5 for a deprecated attribute
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("arch", architectures.BY_STRUCTURE)
def test_a_model_admitted_by_structure_trains_the_linears_peft_chooses(
    platform: Platform,
    key: str,
    service: tinker.ServiceClient,
    names: dict[str, str],
    folders: dict[str, Path],
    arch: str,
    tmp_path: Path,
) -> None:
    """Attention and MLP adapted through the tinker SDK: the exported adapter adapts exactly the
    modules peft's `target_modules="all-linear"` chooses (every linear of every decoder layer),
    and peft with it computes the logprobs the platform served after two steps."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    tc = service.create_lora_training_client(
        names[arch], rank=4, seed=5, train_unembed=False
    ).result()
    for _ in range(2):
        tc.forward_backward([ce_datum(PROMPT)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    served = forward_logprobs(tc, PROMPT)
    path = tc.save_weights_for_sampler("peft").result().path
    checkpoints = CheckpointsClient(platform.base_url, key)
    try:
        checkpoints.download(path, tmp_path / "adapter")
    finally:
        checkpoints.http.close()

    def adapted(model: torch.nn.Module) -> set[str]:
        return {
            n.removeprefix("base_model.model.")
            for n, m in model.named_modules()
            if isinstance(m, LoraLayer)
        }

    def base() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(folders[arch]), dtype=torch.float32)

    chosen = adapted(get_peft_model(base(), LoraConfig(r=4, target_modules="all-linear")))
    decoder = {
        n for n, m in base().named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
    }
    loaded = PeftModel.from_pretrained(base(), str(tmp_path / "adapter")).eval()
    assert adapted(loaded) == chosen == decoder
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([PROMPT[:-1]])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1)[
        torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])
    ]
    np.testing.assert_allclose(logprobs.numpy(), served, atol=1e-5)
    bare = base()
    with torch.no_grad():
        untrained = torch.log_softmax(
            bare(input_ids=torch.tensor([PROMPT[:-1]])).logits[0].double(), -1
        )[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert np.abs(untrained.numpy() - served).max() > 1e-3  # the adapter changed the model


@pytest.mark.parametrize(
    ("arch", "named"),
    [
        ("starcoder2", ["model.layers.*.mlp.c_fc", "model.layers.*.mlp.c_proj"]),
        ("qwen3-next", ["layer 0 is linear_attention", "model.layers.*.linear_attn.in_proj_qkvz"]),
        ("falcon-h1", ["recurrent layers (mamba_", "model.layers.*.mamba.in_proj"]),
    ],
)
def test_models_add_refuses_a_structure_it_cannot_resolve_naming_it(
    platform: Platform, arch: str, named: list[str], tmp_path: Path
) -> None:
    folder = tiny_models.model_folder(arch, tmp_path / arch)
    done = cli(platform, "models", "add", f"refused-{secrets.token_hex(3)}/{arch}",
               "--path", str(folder))  # fmt: skip
    assert done.returncode == 1, done.stdout
    for words in named:
        assert words in done.stderr, done.stderr


# -- hostile registrations: each a clear 4xx, nothing half-registered -------------------------


def _refused(admin: AdminClient, name: str, path: str, status: int, match: str) -> None:
    with pytest.raises(TreadleApiError) as info:
        admin.register_model(name, path=path)
    assert info.value.status == status, info.value
    assert match in str(info.value), str(info.value)


def test_hostile_registrations_are_clear_4xx_and_leave_nothing(
    platform: Platform, key: str, folders: dict[str, Path], names: dict[str, str], tmp_path: Path
) -> None:
    import shutil

    def broken(label: str, edit: Any) -> str:
        folder = tmp_path / label
        shutil.copytree(folders["qwen3"], folder)
        edit(folder)
        return str(folder)

    def config_edit(**changes: Any) -> Any:
        def edit(folder: Path) -> None:
            config = json.loads((folder / "config.json").read_text())
            config.update(changes)
            (folder / "config.json").write_text(json.dumps(config))

        return edit

    cases = {
        "missing-config": (broken("a", lambda f: (f / "config.json").unlink()), 400, "no config.json"),
        "malformed-config": (
            broken("b", lambda f: (f / "config.json").write_text("{not json")), 400, "not valid JSON"
        ),
        "encoder-only": (
            broken("c", config_edit(architectures=["BertForMaskedLM"], model_type="bert")), 400,
            "not a causal language model",
        ),
        "other-class": (
            broken("d", config_edit(architectures=["FalconH1ForCausalLM"])), 400,
            "builds Qwen3ForCausalLM for its model_type 'qwen3'",
        ),
        "linear-attention": (
            broken("i", config_edit(layer_types=["linear_attention", "full_attention"])), 400,
            "layer 0 is linear_attention",
        ),
        "small-embedding": (broken("e", config_edit(vocab_size=64)), 400, "tokenizer has"),
        "mxfp4": (
            broken("f", config_edit(quantization_config={"quant_method": "mxfp4"})), 400,
            "Mxfp4Config(dequantize=True)",
        ),
        "no-weights": (
            broken("g", lambda f: (f / "model.safetensors").unlink()), 400, "no safetensors"
        ),
        "no-tokenizer": (
            broken("h", lambda f: (f / "tokenizer.json").unlink()), 400, "no tokenizer"
        ),
        "unreadable": (str(tmp_path / "nowhere"), 400, "not a folder this API process can read"),
        "relative": ("models/qwen3", 400, "relative"),
    }  # fmt: skip
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        for label, (path, status, match) in cases.items():
            _refused(admin, f"hostile/{label}", path, status, match)
        _refused(admin, names["qwen3"], str(folders["qwen3"]), 409, "already registered")
        _refused(admin, "no-org-name", str(folders["qwen3"]), 400, "org/name")
        listed = {m["name"] for m in admin.list_models(include_retired=True)}
        assert not {n for n in listed if n.startswith("hostile/")}
    finally:
        admin.close()
    member = AdminClient(platform.base_url, key)
    try:
        _refused(member, "hostile/member", str(folders["qwen3"]), 403, "operator")
    finally:
        member.close()


def test_a_cookbook_recipe_runs_unmodified_on_a_model_its_table_knows(
    platform: Platform, key: str, tmp_path: Path
) -> None:
    """`python -m tinker_cookbook.recipes.chat_sl.train`, no Treadle runner: the test registers
    a tiny random Qwen3 under the name `Qwen/Qwen3-8B-Base`, which the cookbook's table knows
    (renderer role_colon); its tokenizer comes from Treadle's /hf routes."""
    name = "Qwen/Qwen3-8B-Base"
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        if name not in {m["name"] for m in admin.list_models(include_retired=True)}:
            admin.register_model(name, path=str(tiny_models.model_folder("qwen3", tmp_path / "m")))
    finally:
        admin.close()
    data = tmp_path / "sums.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                      {"role": "assistant", "content": str(a + b)}]}
        for a in range(3) for b in range(3)
    ]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = users.user_env(
        platform.base_url, key, tmp_path / "hf-home",
        TINKER_COOKBOOK_RUNS_DIR=str(tmp_path / "runs"), HF_ENDPOINT=f"{platform.base_url}/hf",
    )  # fmt: skip
    log = tmp_path / "sft"
    done = subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.recipes.chat_sl.train", f"dataset={data}",
         f"model_name={name}", "lora_rank=4", "batch_size=2", "max_length=64", "eval_every=0",
         "infrequent_eval_every=0", f"log_path={log}", "max_steps=2",
         "behavior_if_log_dir_exists=delete"],
        env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    steps = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    assert all(np.isfinite(s["train_mean_nll"]) and s["train_mean_nll"] > 0 for s in steps)


def test_a_second_gguf_entry_loads_its_own_file(
    platform: Platform, key: str, service: tinker.ServiceClient, tmp_path: Path
) -> None:
    """A GGUF registered from a folder of its own (a copy of SmolLM2's file) converts that
    file: the same weights as the built-in SmolLM2, under the new name and cache."""
    import shutil

    from treadle.platform.config import PlatformConfig
    from treadle.platform.models.catalog import SMOLLM2_NAME, smollm2_gguf_path

    folder = tmp_path / "gguf"
    folder.mkdir()
    shutil.copy(smollm2_gguf_path(), folder / "model.gguf")
    name = f"gguf-{secrets.token_hex(3)}/smol"
    done = cli(platform, "models", "add", name, "--path", str(folder), "--gguf-file", "model.gguf")
    assert done.returncode == 0, done.stderr
    entry = json.loads(done.stdout)
    assert (entry["kind"], entry["architecture"], entry["gguf_file"]) == (
        "gguf", "LlamaForCausalLM", "model.gguf",
    )  # fmt: skip
    assert entry["parameters"] == 134_515_008 and entry["max_context_length"] == 8192
    mine = service.create_lora_training_client(name, rank=4, seed=1).result()
    builtin = service.create_lora_training_client(SMOLLM2_NAME, rank=4, seed=1).result()
    prompt = PROMPT[:6]
    np.testing.assert_array_equal(forward_logprobs(mine, prompt), forward_logprobs(builtin, prompt))
    cache = PlatformConfig.from_env().cache_dir
    assert (cache / "models" / name.replace("/", "--") / "config.json").is_file()
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        with pytest.raises(TreadleApiError, match="no file 'missing.gguf'"):
            admin.register_model(f"{name}-2", path=str(folder), gguf_file="missing.gguf")
        (folder / "bad.gguf").write_bytes(b"not a gguf file at all")
        with pytest.raises(TreadleApiError, match="not a readable GGUF file"):
            admin.register_model(f"{name}-3", path=str(folder), gguf_file="bad.gguf")
    finally:
        admin.close()
