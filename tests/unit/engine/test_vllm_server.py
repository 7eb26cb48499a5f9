"""How a worker starts its vLLM server (`engine/sampling/vllm_server.py`), read from the command
and environment it would run, without vLLM: on the devices configured for it (a worker group's
rank 0 has its own training device in view), tensor parallel over them; and the setting as the
platform's configuration parses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.engine import VllmSettings
from treadle.engine.sampling.vllm_server import VllmServer
from treadle.platform.config import PlatformConfig


def server(tmp_path: Path, devices: str = "") -> VllmServer:
    return VllmServer(
        VllmSettings(python="/vllm/bin/python", devices=devices),
        folder=tmp_path / "model",
        dtype="bfloat16",
        max_model_len=4096,
        log_path=tmp_path / "vllm.log",
    )


def test_a_server_on_configured_devices_is_tensor_parallel_over_them(tmp_path: Path) -> None:
    on_two = server(tmp_path, devices="6,7")
    command = on_two.command(8123)
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--model") + 1] == str(tmp_path / "model")
    assert command[command.index("--port") + 1] == "8123"
    assert on_two.environment()["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert "PYTHONPATH" not in on_two.environment()


def test_a_server_without_devices_keeps_vllms_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    default = server(tmp_path)
    assert "--tensor-parallel-size" not in default.command(8123)
    assert "CUDA_VISIBLE_DEVICES" not in default.environment()


def test_the_devices_setting_is_parsed_and_refused_with_what_to_write() -> None:
    config = PlatformConfig.from_env({"TREADLE_VLLM_DEVICES": " 6, 7"})
    assert config.vllm_devices == "6,7"
    assert PlatformConfig.from_env(config.to_env()).vllm_devices == "6,7"
    assert PlatformConfig.from_env({}).vllm_devices == ""
    for bad in ("6,6", "06,6", "cuda:1", "1,,2", "-1"):
        with pytest.raises(ValueError, match=r"TREADLE_VLLM_DEVICES must list distinct device"):
            PlatformConfig.from_env({"TREADLE_VLLM_DEVICES": bad})
