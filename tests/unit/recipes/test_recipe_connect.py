"""The recipes' client (treadle.recipes.common.connect) on the plain tinker SDK: what it sets up
before it makes the SDK's ServiceClient, which makes no request until it is used."""

from __future__ import annotations

import argparse
import os

import pytest
import tinker

from treadle.recipes.common import connect

# A recipe's flags for a running platform and the plain SDK (nothing listens on the port).
PLAIN_SDK = argparse.Namespace(
    embedded=False, client="tinker", base_url="http://127.0.0.1:9", api_key="tml-recipe"
)


def test_the_plain_sdk_runs_with_its_telemetry_off_unless_the_user_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (
        "TINKER_TELEMETRY",
        "HF_ENDPOINT",
        "HF_HUB_ETAG_TIMEOUT",
        "HF_HUB_DOWNLOAD_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    with connect.service(PLAIN_SDK) as svc:
        assert isinstance(svc, tinker.ServiceClient)
        assert os.environ["TINKER_TELEMETRY"] == "0"
        assert os.environ["HF_ENDPOINT"] == "http://127.0.0.1:9/hf"

    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    with connect.service(PLAIN_SDK):
        assert os.environ["TINKER_TELEMETRY"] == "1"
