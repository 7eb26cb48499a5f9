"""compose.yaml (and the GPU override) against the Compose specification's JSON schema, and
against what docs/deploy.md, .env.example and the Prometheus/Grafana provisioning say of it.

The schema is the compose-spec project's `schema/compose-spec.json`, as vendored by the PyPI
package `check-jsonschema` (a dev dependency); `jsonschema` validates. The YAML is read as
Compose reads it (YAML 1.2, merge keys resolved) and checked before interpolation, the form
that is committed.
"""

from __future__ import annotations

import importlib.util
import json
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
GPU_OVERRIDE = ROOT / "compose.gpu.yaml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
ENV_EXAMPLE = ROOT / ".env.example"
SECRET_NAME = re.compile(r"PASSWORD|SECRET|_KEY$|_KEY_ID$|TOKEN|_AUTH$")
VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-?+]([^}]*))?\}")
# A whole value that is one variable reference: the only acceptable form of a secret.
ONLY_A_VARIABLE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?[-?+][^}]*)?\}")
URL_PASSWORD = re.compile(r"://[^:/@\s]*:([^@\s]+)@")


def load(path: Path) -> dict[str, Any]:
    doc = YAML(typ="safe", pure=True).load(path.read_text())
    assert isinstance(doc, dict), f"{path.name} is not a mapping"
    return doc


def schema_errors(doc: dict[str, Any]) -> list[str]:
    schema_file = files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(doc)]


def services() -> dict[str, dict[str, Any]]:
    return load(COMPOSE)["services"]  # type: ignore[no-any-return]


def long_running(service: dict[str, Any]) -> bool:
    """Every service but a one shot (`restart: "no"`, like the migration) keeps running."""
    return str(service.get("restart", "no")) != "no"


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def strings(node: Any) -> list[str]:
    """Every string value in a loaded YAML document (comments are not part of it)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [text for value in node.values() for text in strings(value)]
    if isinstance(node, list):
        return [text for value in node for text in strings(value)]
    return []


def variables(path: Path) -> list[re.Match[str]]:
    return [m for text in strings(load(path)) for m in VARIABLE.finditer(text)]


def documented_services() -> list[str]:
    """The first column of the table under "## Services" in docs/deploy.md."""
    section = DEPLOY_DOC.read_text().split("\n## Services\n", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([a-z0-9._-]+)` \|", section, flags=re.MULTILINE)
    assert names, "docs/deploy.md has no services table under '## Services'"
    return names


@pytest.mark.parametrize("path", [COMPOSE, GPU_OVERRIDE], ids=lambda p: p.name)
def test_compose_file_matches_the_compose_specification(path: Path) -> None:
    assert schema_errors(load(path)) == []


def test_schema_check_refuses_a_misspelled_key() -> None:
    """The validation can fail: an unknown service key is an error the schema reports."""
    doc = load(COMPOSE)
    doc["services"]["api"]["healthcheck"]["intervall"] = "10s"
    errors = schema_errors(doc)
    assert any("$.services.api.healthcheck" in e and "intervall" in e for e in errors), errors


def test_every_service_the_deploy_guide_names_exists() -> None:
    named = documented_services()
    assert sorted(set(named) - set(services())) == []
    # and the other way round: the guide's table lists every service
    assert sorted(set(services()) - set(named)) == []


def test_every_long_running_service_has_a_health_check() -> None:
    missing = []
    for name, service in services().items():
        if not long_running(service):
            continue
        check = service.get("healthcheck") or {}
        if not check.get("test") or check.get("disable") in (True, "true"):
            missing.append(name)
    assert missing == []
    assert {n for n, s in services().items() if not long_running(s)} == {"migrate"}


def test_migration_runs_once_before_the_api_and_the_workers() -> None:
    svc = services()
    assert svc["migrate"]["command"] == ["treadle", "migrate"]
    assert svc["migrate"]["restart"] == "no"
    for name in ("api", "worker"):
        condition = svc[name]["depends_on"]["migrate"]["condition"]
        assert condition == "service_completed_successfully", name


def test_api_runs_gunicorn_with_its_metrics_folder_on_a_tmpfs() -> None:
    api = services()["api"]
    command = [str(part) for part in api["command"]]
    assert command[0] == "gunicorn" and command[-1] == "treadle.api.wsgi:app"
    assert command[command.index("-c") + 1] == "python:treadle.api.gunicorn_conf"
    for module in ("treadle.api.wsgi", "treadle.api.gunicorn_conf"):
        assert importlib.util.find_spec(module) is not None, module
    assert environment(api)["PROMETHEUS_MULTIPROC_DIR"] in api["tmpfs"]


def test_worker_service_scales() -> None:
    """`docker compose up --scale worker=N`: nothing that two replicas could not share."""
    worker = services()["worker"]
    for fixed in ("container_name", "hostname", "ports"):
        assert fixed not in worker, f"the worker service sets {fixed}: replicas would collide"
    # its id: w0.<platform>@<hostname>; a group of ranks with TREADLE_WORKER_DEVICES
    assert worker["command"] == ["treadle", "worker", "--devices", "${TREADLE_WORKER_DEVICES:-1}"]
    port = environment(worker)["TREADLE_WORKER_METRICS_PORT"]
    assert [str(p) for p in worker["expose"]] == [port]


def test_prometheus_scrapes_the_api_and_every_worker_replica() -> None:
    svc = services()
    assert "./dashboards/prometheus:/etc/prometheus:ro" in svc["prometheus"]["volumes"]
    config = load(ROOT / "dashboards" / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["treadle-api"]["static_configs"][0]["targets"] == ["api:8080"]
    assert "0.0.0.0:8080" in " ".join(svc["api"]["command"])
    port = int(environment(svc["worker"])["TREADLE_WORKER_METRICS_PORT"])
    assert {"names": ["worker"], "type": "A", "port": port} == {
        k: v
        for k, v in jobs["treadle-worker"]["dns_sd_configs"][0].items()
        if k in ("names", "type", "port")
    }


def test_grafana_mounts_what_its_provisioning_points_at() -> None:
    grafana = services()["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    assert mounts["./dashboards/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = load(ROOT / "dashboards/grafana/provisioning/dashboards/treadle.yml")
    path = provider["providers"][0]["options"]["path"]
    assert mounts["./dashboards/grafana"] == path
    assert sorted(p.name for p in (ROOT / "dashboards" / "grafana").glob("*.json")) == [
        "overview.json",
        "tenants.json",
        "workers.json",
    ]


def test_no_secret_is_written_in_the_file() -> None:
    literal = []
    for name, service in services().items():
        for key, value in environment(service).items():
            if SECRET_NAME.search(key) and not ONLY_A_VARIABLE.fullmatch(value):
                literal.append(f"{name}.environment.{key}")
            for password in URL_PASSWORD.findall(value):
                if not ONLY_A_VARIABLE.fullmatch(password):
                    literal.append(f"{name}.environment.{key} (password in the URL)")
    assert literal == []


def test_required_secrets_stop_compose_when_unset() -> None:
    """A secret has no default: `${VAR:?message}`, so a missing one is an error, not ''."""
    found = variables(COMPOSE)
    for name in (
        "POSTGRES_PASSWORD",
        "REDIS_PASSWORD",
        "S3_ACCESS_KEY",
        "S3_SECRET_KEY",
        "TREADLE_ADMIN_KEY",
        "GF_ADMIN_PASSWORD",
    ):
        forms = {m.group(0) for m in found if m.group(1) == name}
        assert forms and all(form.startswith(f"${{{name}:?") for form in forms), name


def test_env_example_lists_every_variable() -> None:
    """Every ${VAR} of the compose files is in .env.example: the required ones to fill in
    (empty, uncommented), the optional ones commented out with their default."""
    example = ENV_EXAMPLE.read_text()
    listed = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", example, flags=re.MULTILINE))
    required = set(re.findall(r"^([A-Z][A-Z0-9_]*)=$", example, flags=re.MULTILINE))
    used = set()
    must_set = set()
    for path in (COMPOSE, GPU_OVERRIDE):
        for match in variables(path):
            used.add(match.group(1))
            if match.group(0).startswith(f"${{{match.group(1)}:?"):
                must_set.add(match.group(1))
    assert sorted(used - listed) == []
    assert sorted(must_set) == sorted(required)
    assert ".env" in (ROOT / ".gitignore").read_text().split()
