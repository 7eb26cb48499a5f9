"""A service client for a recipe's run: Treadle's SDK or the plain tinker SDK (the recipes use only
the calls both have), on the platform the flags name, or on an embedded one started for the run."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

import tinker

import treadle
from treadle.client.service import turn_off_sdk_telemetry


@contextlib.contextmanager
def service(args: argparse.Namespace) -> Iterator[Any]:
    """`with service(args) as svc:` a ServiceClient for the whole run, closed afterwards."""
    if not args.embedded:
        with _client(args.client, args.base_url, args.api_key) as svc:
            yield svc
        return
    # Server-side packages: needed only to start a platform, not to use one.
    from treadle.platform.embedded import free_port
    from treadle.recipes.platform_process import LocalPlatform

    key = f"tml-recipe-{secrets.token_hex(12)}"
    data_dir = (args.log_dir / "platform").resolve()
    print(f"starting an embedded platform in {data_dir} (its log: {data_dir / 'up.log'})")
    with (
        LocalPlatform(data_dir, free_port(), key) as platform,
        _client(args.client, platform.base_url, key) as svc,
    ):
        yield svc


@contextlib.contextmanager
def _client(kind: str, base_url: str, api_key: str) -> Iterator[Any]:
    svc: Any
    status = "errored"  # what the plain SDK reports for the client session if the run fails
    if kind == "tinker":
        # The plain SDK loads tokenizers from the hub; Treadle serves them at /hf. This must be
        # set before huggingface_hub is first imported (it reads the variable once).
        os.environ.setdefault("HF_ENDPOINT", f"{base_url.rstrip('/')}/hf")
        # The hub client gives up after 10 s and then looks for an offline copy; a busy
        # platform's first answer can take longer than that.
        os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "60")
        os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "60")
        turn_off_sdk_telemetry()
        svc = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    else:
        svc = treadle.ServiceClient(base_url=base_url, api_key=api_key)
    try:
        yield svc
        status = "success"
    finally:
        if kind == "tinker":
            svc.close(status).result()
        else:
            svc.close()


def ready(client: Any) -> Any:
    """The client itself: the plain tinker SDK hands some clients back as futures (and warns when
    one is used as a client before it resolves); Treadle's SDK hands back the client."""
    return client.result() if isinstance(client, tinker.APIFuture) else client


def current_sampler(tc: Any) -> Any:
    """A sampling client on the training session's weights as they are now."""
    return ready(tc.save_weights_and_get_sampling_client())
