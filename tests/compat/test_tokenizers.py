"""Tokenizers anywhere: with `HF_ENDPOINT=<treadle>/hf` (and no internet, no cached tokenizer:
HF_HOME is a fresh folder), the plain tinker SDK's `get_tokenizer()` on a TrainingClient and on a
SamplingClient, and `transformers.AutoTokenizer.from_pretrained`, load the platform's tokenizer
from the hub-compatible routes (treadle/api/tinker/routes_hf.py); hub clients get the headers and the
exceptions they expect; get_info names the real tokenizer repo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.compat import users
from tests.conftest import Platform, new_tenant_key
from tests.secure_app import SecureApp
from treadle.platform.models import catalog

pytestmark = pytest.mark.integration

TINY = catalog.TINY_DEBUG_NAME
SMOLLM2 = catalog.SMOLLM2_NAME
TEXT = "The capital of France is Paris. 12 + 30 = 42!"


@pytest.fixture(scope="module")
def key(platform: Platform) -> str:
    return new_tenant_key(platform, "tokenizers")


def hub_env(platform: Platform, key: str, hf_home: Path) -> dict[str, str]:
    """The environment of a user's process pointed at Treadle: the tinker variables, HF_ENDPOINT,
    and a fresh HF_HOME so no tokenizer cached elsewhere can be used."""
    return users.user_env(platform.base_url, key, hf_home, HF_ENDPOINT=f"{platform.base_url}/hf")


def run_python(code: str, env: dict[str, str], timeout: float = 300) -> Any:
    """Run `code` in a fresh interpreter; it prints one JSON line last, which is returned."""
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def platform_encoding(platform: Platform, key: str, base_model: str) -> list[int]:
    """TEXT encoded by the platform's own tokenizer files (GET /api/v1/treadle/tokenizer)."""
    from treadle.client.tokenizer import fetch_tokenizer

    return list(fetch_tokenizer(platform.base_url, key, base_model).encode(TEXT))


SDK_SCRIPT = """
import json, sys, tinker
service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model=sys.argv[1], rank=4)
info = training.get_info()
tok = training.get_tokenizer()
sampler = service.create_sampling_client(base_model=sys.argv[1])
stok = sampler.get_tokenizer()
text = sys.argv[2]
print(json.dumps({
    "tokenizer_id": info.model_data.tokenizer_id,
    "training_ids": tok.encode(text),
    "training_text": tok.decode(tok.encode(text)),
    "sampling_ids": stok.encode(text),
    "sampling_text": stok.decode(stok.encode(text)),
    "eos": stok.eos_token,
}))
"""


def test_sdk_get_tokenizer_works_on_training_and_sampling_clients(
    platform: Platform, key: str, tmp_path: Path
) -> None:
    env = hub_env(platform, key, tmp_path / "hf-home")
    code = SDK_SCRIPT.replace("sys.argv[1]", repr(TINY)).replace("sys.argv[2]", repr(TEXT))
    out = run_python(code, env)
    assert out["tokenizer_id"] == SMOLLM2  # the real tokenizer repo, not the model's name
    expected = platform_encoding(platform, key, TINY)
    assert out["training_ids"] == expected and out["sampling_ids"] == expected
    assert out["training_text"] == TEXT and out["sampling_text"] == TEXT
    assert out["eos"] == "<|im_end|>"
    # Both came through Treadle's hub routes into the fresh cache: the training client asks for
    # the tokenizer repo, the sampling client (which knows only the base model) for the model.
    hub = tmp_path / "hf-home" / "hub"
    assert (hub / "models--HuggingFaceTB--SmolLM2-135M-Instruct").is_dir()
    assert (hub / "models--treadle--tiny-debug").is_dir()


AUTO_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
out = {}
for repo in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(repo)
    ids = tok.encode(TEXT)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    out[repo] = {"ids": ids, "text": tok.decode(ids), "len": len(tok), "chat": chat}
print(json.dumps(out))
"""


def test_autotokenizer_from_pretrained_loads_every_served_repo(
    platform: Platform, key: str, tmp_path: Path
) -> None:
    repos = catalog.tokenizer_repo_ids()
    assert set(repos) == {TINY, SMOLLM2}
    code = AUTO_SCRIPT.replace("TEXT", repr(TEXT)).replace("sys.argv[1:]", repr(repos))
    out = run_python(code, hub_env(platform, key, tmp_path / "hf-home"))
    expected = platform_encoding(platform, key, SMOLLM2)
    for repo in repos:
        assert out[repo]["ids"] == expected and out[repo]["text"] == TEXT
        assert out[repo]["len"] == 49152
        assert out[repo]["chat"].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


HUB_ERRORS_SCRIPT = """
import json
from huggingface_hub import hf_hub_download, model_info
from huggingface_hub.errors import (
    EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
)
out = {"sha": model_info(REPO).sha}
out["path"] = hf_hub_download(REPO, "tokenizer_config.json", revision=out["sha"])
for name, call in {
    "repo": lambda: hf_hub_download("nobody/nothing", "tokenizer.json"),
    "revision": lambda: hf_hub_download(REPO, "tokenizer.json", revision="v0"),
    "entry": lambda: hf_hub_download(REPO, "model.safetensors"),
}.items():
    try:
        call()
        out[name] = None
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""


def test_hub_clients_get_their_own_not_found_errors(
    platform: Platform, key: str, tmp_path: Path
) -> None:
    code = HUB_ERRORS_SCRIPT.replace("REPO", repr(TINY))
    out = run_python(code, hub_env(platform, key, tmp_path / "hf-home"))
    assert len(out["sha"]) == 40 and Path(out["path"]).is_file()
    assert out["repo"] == "RepositoryNotFoundError"
    assert out["revision"] == "RevisionNotFoundError"
    assert out["entry"] in ("EntryNotFoundError", "RemoteEntryNotFoundError")


def test_resolve_answers_head_with_the_headers_hub_clients_require(secure: SecureApp) -> None:
    url = f"/hf/{TINY}/resolve/main/tokenizer.json"
    head = secure.call("HEAD", url, None)  # no API key: the routes are public
    assert head.status_code == 200 and head.get_data() == b""
    etag = head.headers["ETag"].strip('"')
    commit = head.headers["X-Repo-Commit"]
    assert len(etag) == 40 and len(commit) == 40
    body = secure.call("GET", f"/hf/{TINY}/resolve/{commit}/tokenizer.json", None)
    assert body.status_code == 200 and body.headers["ETag"].strip('"') == etag
    assert int(head.headers["Content-Length"]) == len(body.get_data())
    part = secure.call("GET", url, None, headers={"Range": "bytes=0-9"})
    assert part.status_code == 206 and part.get_data() == body.get_data()[:10]


def test_the_same_files_under_the_model_name_and_the_tokenizer_repo(secure: SecureApp) -> None:
    trees = [secure.call("GET", f"/hf/api/models/{r}/tree/main", None) for r in (TINY, SMOLLM2)]
    assert all(t.status_code == 200 for t in trees)
    assert trees[0].get_json() == trees[1].get_json()
    names = {entry["path"] for entry in trees[0].get_json()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/hf/nobody/nothing/resolve/main/tokenizer.json", "RepoNotFound"),
        (f"/hf/{TINY}/resolve/v0/tokenizer.json", "RevisionNotFound"),
        (f"/hf/{TINY}/resolve/main/model.safetensors", "EntryNotFound"),
        (f"/hf/api/models/{TINY}/tree/main/additional_chat_templates", "EntryNotFound"),
        ("/hf/api/models/nobody/nothing", "RepoNotFound"),
    ],
)
def test_a_missing_repo_revision_or_file_is_a_404_that_says_which(
    secure: SecureApp, path: str, code: str
) -> None:
    response = secure.call("GET", path, None)
    assert response.status_code == 404
    assert response.headers["X-Error-Code"] == code
    assert response.get_json()["error"]["code"] == code


def test_get_info_names_the_tokenizer_repo_of_the_base_model(platform: Platform, key: str) -> None:
    import treadle

    with (
        treadle.ServiceClient(base_url=platform.base_url, api_key=key) as svc,
        svc.create_lora_training_client(TINY, rank=4) as tc,
    ):
        response = httpx.post(
            f"{platform.base_url}/api/v1/get_info",
            json={"model_id": tc.model_id, "type": "get_info"},
            headers={"X-API-Key": key},
            timeout=30,
        )
    assert response.status_code == 200, response.text
    model_data = response.json()["model_data"]
    assert model_data == {"arch": "llama", "model_name": TINY, "tokenizer_id": SMOLLM2}
