"""A real Prometheus server for tests (Debian's `prometheus` package, which `make test` installs):
started on a free port with its own storage under a test's folder, scraping given targets every
second with given rule files, queried through its HTTP API, stopped at the end."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from treadle.platform.embedded import free_port

SCRAPE_INTERVAL_SECONDS = 1.0


def require(tool: str) -> str:
    """The path of `tool` (prometheus, promtool); fails, never skips, when it is missing."""
    path = shutil.which(tool)
    assert path is not None, (
        f"{tool} is not on PATH: run `make prometheus` (installs Debian's prometheus package)"
    )
    return path


@dataclass(frozen=True)
class Prometheus:
    base_url: str
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query at the current time; its result vector (raises on an error)."""
        response = httpx.get(f"{self.base_url}/api/v1/query", params={"query": expr}, timeout=30)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (
            f"Prometheus refused {expr!r}: {body.get('error', response.text)}"
        )
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.base_url}/api/v1/targets", timeout=10)
        response.raise_for_status()
        active: list[dict[str, Any]] = response.json()["data"]["activeTargets"]
        return active

    def rules(self) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.base_url}/api/v1/rules", timeout=10)
        response.raise_for_status()
        return [rule for group in response.json()["data"]["groups"] for rule in group["rules"]]

    def wait_until_scraped(self, count: int, timeout: float = 30) -> None:
        """Wait until every target is up and has been scraped `count` more times from now."""
        seen: dict[str, list[str]] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            targets = self.targets()
            for target in targets:
                scrapes = seen.setdefault(target["scrapeUrl"], [target["lastScrape"]])
                if target["health"] == "up" and scrapes[-1] != target["lastScrape"]:
                    scrapes.append(target["lastScrape"])
            if targets and all(len(seen[t["scrapeUrl"]]) > count for t in targets):
                return
            time.sleep(SCRAPE_INTERVAL_SECONDS / 5)
        states = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.targets()]
        raise AssertionError(f"targets not scraped {count} times in {timeout} s: {states}")


def scrape_job(name: str, urls: Sequence[str]) -> dict[str, Any]:
    """A scrape job over metrics URLs (http://host:port/path): one static target each."""
    return {
        "job_name": name,
        "static_configs": [
            {"targets": [parts.netloc], "labels": {"__metrics_path__": parts.path or "/metrics"}}
            for parts in map(urlsplit, urls)
        ],
    }


@contextmanager
def running_prometheus(
    folder: Path, jobs: Mapping[str, Sequence[str]], rule_files: Sequence[Path]
) -> Iterator[Prometheus]:
    """Prometheus on a free port, storage and config under `folder`, scraping `jobs` (job name
    -> metrics URLs) every second and evaluating `rule_files`."""
    folder.mkdir(parents=True, exist_ok=True)
    interval = f"{SCRAPE_INTERVAL_SECONDS:g}s"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [scrape_job(name, urls) for name, urls in jobs.items()],
    }
    config_file = folder / "prometheus.yml"
    config_file.write_text(json.dumps(config, indent=2))  # JSON is YAML
    port = free_port()
    log = folder / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                require("prometheus"),
                f"--config.file={config_file}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Prometheus(f"http://127.0.0.1:{port}", log)
    try:
        _wait_ready(proc, server)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], server: Prometheus, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("prometheus exited:\n" + server.log.read_text())
        try:
            if httpx.get(f"{server.base_url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"prometheus not ready in {timeout} s:\n" + server.log.read_text())
