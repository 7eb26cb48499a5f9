"""config.json: a run's resolved configuration, every flag's value, so that the run can be
repeated (`--config FILE`) and a resumed run is known to continue the same one.

`--config FILE` reads values from a JSON object keyed by flag (`{"learning_rate": 0.0005}`, the
format config.json is written in); flags given on the command line win over it. `--resume` reads
the run folder's config.json the same way and refuses a configuration that differs from it in
anything but the keys that say where the run is driven, how far and how it reports
(NOT_COMPARED), unless `--allow-config-change`. The API key is never written.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

FILE = "config.json"
NEVER_WRITTEN = frozenset({"api_key"})
# What a command says about itself, not about the run: never read from a file.
NOT_READ = frozenset({"config", "resume", "overwrite", "allow_config_change"})
# Keys a resumed run may change without --allow-config-change: where the run is driven (the
# platform, the client, the tracker), how far it goes (--steps) and how it shows progress.
NOT_COMPARED = NOT_READ | {
    "steps",
    "log_dir",
    "embedded",
    "base_url",
    "api_key",
    "client",
    "no_progress",
    "mlflow_uri",
    "mlflow_experiment",
}


class ConfigError(ValueError):
    """A --config file that cannot be read as this recipe's flags."""


def resolved(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag's value as JSON (paths as strings), the API key left out."""
    return {
        key: str(value) if isinstance(value, Path) else value
        for key, value in sorted(vars(args).items())
        if key not in NEVER_WRITTEN
    }


def write(path: Path, values: dict[str, Any]) -> None:
    """Write config.json atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(values, indent=2) + "\n")
    os.replace(tmp, path)


def read(path: Path) -> dict[str, Any]:
    """A configuration file's object; ConfigError saying what is wrong with it otherwise."""
    try:
        values = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"--config {path}: not JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(
            f"--config {path}: expected a JSON object of flag values, like "
            '{"learning_rate": 0.0005}, not ' + type(values).__name__
        )
    return values


def as_argv(p: argparse.ArgumentParser, values: dict[str, Any], source: Path) -> list[str]:
    """`values` as command-line arguments, to be parsed before the real ones (which then win),
    so argparse checks their types and choices as it does a typed flag's."""
    # argparse keeps its arguments in `_actions` only; it has done so since it was written.
    actions = {a.dest: a for a in p._actions if a.option_strings}
    unknown = sorted(set(values) - set(actions))
    if unknown:
        raise ConfigError(
            f"{source}: {', '.join(unknown)} {'is not a flag' if len(unknown) == 1 else 'are not flags'}"
            f" of {p.prog} (keys are flag names with '_' for '-', as config.json writes them)"
        )
    argv: list[str] = []
    for key, value in values.items():
        if key in NOT_READ or value is None:
            continue
        flag = actions[key].option_strings[-1]
        if actions[key].nargs == 0:  # an on/off flag (store_true)
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {key} must be true or false, not {value!r}")
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def changes(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The compared keys whose value differs, each as `key: recorded -> now`."""
    keys = sorted((set(recorded) | set(now)) - NOT_COMPARED)
    return [
        f"{key}: {json.dumps(recorded.get(key))} -> {json.dumps(now.get(key))}"
        for key in keys
        if recorded.get(key) != now.get(key)
    ]
