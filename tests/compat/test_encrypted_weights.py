"""Age-encrypted external weights against the served platform (`treadle up`, real workers), on a
tiny Qwen3 registered with the operator's `register_model`: tinker-cookbook 0.6.1's
`weights.download` of a training checkpoint (it exports the checkpoint with
`save_weights_external(age_encryption_recipients=[a key made for the download])`, fetches the
`.age` files from their links, decrypts them and deletes the export), then the cookbook's
`weights.build_hf_model` merge, gives a folder that plain transformers loads with the session's
logprobs. The stored objects are age ciphertext that each recipient's identity (X25519 and SSH)
decrypts to the plain export's bytes; bad recipient lists are a 400 naming what is wrong and
record nothing.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pyrage
import pytest
import sqlalchemy as sa
import tinker
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from tinker import types

from tests import tiny_models
from tests.conftest import Platform
from treadle.client.admin import AdminClient
from treadle.platform import db
from treadle.platform.checkpoints.age_encryption import HEADER
from treadle.platform.eventlog.schema import events

pytestmark = [pytest.mark.integration, pytest.mark.compat]

PROMPT = [5, 17, 42, 99, 7, 123, 64, 11, 250, 3, 77, 18]
FILES = {"adapter_model.safetensors", "adapter_config.json", "treadle.json"}
# float32 end to end; the merged weight W + (alpha/r)·B·A is rounded once more than the
# session's W·x + (alpha/r)·B·(A·x), and the kernels differ (as tests/compat/test_registered_models)
TOL = 1e-4


@dataclass
class Trained:
    platform: Platform
    key: str
    tenant: str
    folder: Path  # the registered model's folder
    service: tinker.ServiceClient
    training: tinker.TrainingClient
    model_id: str
    state: str  # tinker://<model>/weights/trained

    def rest(self) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.platform.base_url, api_key=self.key)


def ce_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def forward_logprobs(tc: tinker.TrainingClient) -> np.ndarray:
    out = tc.forward([ce_datum(PROMPT)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


def hf_logprobs(folder: Path) -> np.ndarray:
    """PROMPT's next-token logprobs under the model in `folder`, by plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT[:-1]])).logits[0].double()
    positions = torch.arange(len(PROMPT) - 1)
    return torch.log_softmax(logits, -1)[positions, torch.tensor(PROMPT[1:])].numpy()


@pytest.fixture(scope="module")
def trained(platform: Platform, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    run = secrets.token_hex(3)
    folder = tiny_models.model_folder("qwen3", tmp_path_factory.mktemp("qwen3"))
    tenant = f"age-{run}"
    admin = AdminClient(platform.base_url, platform.admin_key)
    try:
        admin.register_model(f"tiny-age-{run}/qwen3", path=str(folder), max_lora_rank=16)
        key = str(admin.create_tenant(tenant)["api_key"])
    finally:
        admin.close()
    service = tinker.ServiceClient(base_url=platform.base_url, api_key=key)
    training = service.create_lora_training_client(f"tiny-age-{run}/qwen3", rank=4, seed=3)
    training = training.result()
    training.forward_backward([ce_datum(PROMPT)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    state = training.save_state("trained").result().path
    model_id = training.get_info().model_id
    yield Trained(platform, key, tenant, folder, service, training, model_id, state)
    service.close("success").result()


def test_cookbook_download_and_merge_give_the_sessions_logprobs(
    trained: Trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinker_cookbook import weights

    monkeypatch.setenv("TINKER_API_KEY", trained.key)  # how the cookbook's clients find it
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    served = forward_logprobs(trained.training)
    sampler = trained.training.save_weights_and_get_sampling_client().result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    np.testing.assert_allclose(np.asarray(scored[1:], dtype=np.float64), served, atol=1e-5)

    adapter = tmp_path / "adapter"
    weights.download(
        tinker_path=trained.state, output_dir=str(adapter), base_url=trained.platform.base_url
    )
    assert {p.name for p in adapter.iterdir()} == FILES  # decrypted, the staging folder gone
    listed = trained.rest().list_user_checkpoints(limit=1000).result().checkpoints
    assert not [c for c in listed if c.checkpoint_type == "external"]  # the export deleted

    merged = tmp_path / "merged"
    weights.build_hf_model(
        base_model=str(trained.folder), adapter_path=str(adapter), output_path=str(merged)
    )
    # the base alone is far from the session, so the comparison sees the adapter
    assert np.abs(hf_logprobs(trained.folder) - served).max() > 100 * TOL
    np.testing.assert_allclose(hf_logprobs(merged), served, atol=TOL)


def _ssh_key() -> tuple[str, bytes]:
    """A fresh ssh-ed25519 key: its public line and its private key (OpenSSH PEM)."""
    key = ed25519.Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )  # fmt: skip
    return public.decode() + " user@host", private


def stored(trained: Trained, name: str) -> dict[str, bytes]:
    """The objects of external weights `name` as the local store holds them."""
    prefix = (
        trained.platform.data_dir / "storage" / "tenants" / trained.tenant / "sessions"
        / trained.model_id / "external_weights" / name
    )  # fmt: skip
    return {p.name: p.read_bytes() for p in prefix.iterdir()}


def test_the_stored_export_is_age_ciphertext_each_recipient_decrypts(trained: Trained) -> None:
    identity = pyrage.x25519.Identity.generate()
    ssh_public, ssh_private = _ssh_key()
    recipients = [str(identity.to_public()), ssh_public]
    sealed = trained.training.save_weights_external("sealed", age_encryption_recipients=recipients)
    sealed_path = sealed.result().path
    trained.training.save_weights_external("plain").result()  # the same weights, unencrypted

    ciphertext, plain = stored(trained, "sealed"), stored(trained, "plain")
    assert set(plain) == FILES
    assert set(ciphertext) == {f"{name}.age" for name in FILES}  # nothing else, no plaintext
    for name, data in ciphertext.items():
        assert data.startswith(HEADER), name
        assert plain[name.removesuffix(".age")] not in data
        assert pyrage.decrypt(data, [identity]) == plain[name.removesuffix(".age")]
        ssh_identity = pyrage.ssh.Identity.from_buffer(ssh_private)
        assert pyrage.decrypt(data, [ssh_identity]) == plain[name.removesuffix(".age")]

    links = trained.rest().get_external_weights_urls(sealed_path).result()
    assert set(links.urls) == set(ciphertext)  # the names the cookbook's download expects
    name = "adapter_model.safetensors.age"
    assert httpx.get(links.urls[name], timeout=60).content == ciphertext[name]
    with pytest.raises(tinker.BadRequestError, match="age-encrypted"):
        trained.service.create_sampling_client(model_path=sealed_path).result()


def _events(trained: Trained) -> int:
    engine = db.connect(trained.platform.database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).where(events.c.session_id == trained.model_id)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def test_bad_recipients_are_a_400_naming_them_and_record_nothing(trained: Trained) -> None:
    good = str(pyrage.x25519.Identity.generate().to_public())
    before = _events(trained)
    cases = [
        (["age1bogus"], r"age_encryption_recipients\[0\] = .+age1bogus.+ is not a valid age"),
        ([good, "ssh-ed25519 AAAAnotakey"], r"recipients\[1\] = .+ssh-ed25519 AAAAnotakey.+ is ne"),
        (
            [good, "ecdsa-sha2-nistp256 AAAA"],
            r"recipients\[1\] = .+ecdsa-sha2-nistp256 AAAA.+ is ne",
        ),
        ([good] * 11, "at most 10"),
        ([], "is empty"),
    ]
    for recipients, says in cases:
        refused = trained.training.save_weights_external(
            "refused", age_encryption_recipients=recipients
        )
        with pytest.raises(tinker.BadRequestError, match=says):
            refused.result()
    assert _events(trained) == before  # nothing recorded
    listed = trained.rest().list_checkpoints(trained.model_id).result().checkpoints
    assert "external_weights/refused" not in {c.checkpoint_id for c in listed}
    started = time.monotonic()
    forward_logprobs(trained.training)  # the SDK moved past the refused seq_ids
    assert time.monotonic() - started < 30
