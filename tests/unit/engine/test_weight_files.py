"""A model built on the meta device and read from its files a module at a time equals the one
`from_pretrained` loads whole, for every architecture Treadle admits; a checkpoint whose tensor
names are not the model's (MoE experts transformers stacks while loading) is loaded whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests import architectures
from treadle.engine.models.weight_files import build_deferred


def saved(arch: str, folder: Path) -> Path:
    architectures.build(arch, 96).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("arch", architectures.ARCHITECTURES)
def test_a_model_read_a_module_at_a_time_equals_the_one_loaded_whole(
    arch: str, tmp_path: Path
) -> None:
    folder = saved(arch, tmp_path)
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    whole.eval()
    model, files = build_deferred(folder, torch.float32)
    if arch == "qwen3-moe":  # its file holds each expert apart; transformers stacks them
        assert files is None
    else:
        assert files is not None
        assert all(p.is_meta for p in model.parameters())
        assert not any(b.is_meta for b in model.buffers())
        layers = model.get_decoder().layers
        read = files.materialize(layers[0])  # one layer: the rest stays on meta
        assert read == sum(p.numel() * 4 for p in layers[0].parameters())
        assert any(p.is_meta for p in model.parameters())
        files.materialize(model)
    assert not any(p.is_meta or p.requires_grad for p in model.parameters())
    expected, got = whole.state_dict(), model.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    tied = whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    ids_B_T = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(whole(ids_B_T).logits, model(ids_B_T).logits)
