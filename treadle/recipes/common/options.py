"""The command line every recipe takes: where the platform is, which client, the model, the run
folder, the tracker, and the knobs common to every loop. A recipe adds its own flags to the
parser. Values may also come from a file (`--config`, or the run's config.json on `--resume`:
run_config); flags given on the command line win."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from treadle.recipes.common import run_config

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def parser(
    name: str,
    description: str,
    *,
    steps: int,
    learning_rate: float,
    rank: int = 16,
    save_every: int = 5,
    eval_every: int = 5,
) -> argparse.ArgumentParser:
    """The shared flags, with this recipe's defaults; `name` names the default run folder."""
    p = argparse.ArgumentParser(
        prog=f"python -m treadle.recipes.{name}",
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    where = p.add_argument_group("platform")
    where.add_argument(
        "--embedded", action="store_true",
        help="start an embedded platform (PostgreSQL, Redis, API, one worker) in the run folder "
        "for this run, and stop it afterwards",
    )  # fmt: skip
    where.add_argument(
        "--base-url",
        default=os.environ.get("TREADLE_BASE_URL") or os.environ.get("TINKER_BASE_URL"),
        help="a running platform (default: $TREADLE_BASE_URL or $TINKER_BASE_URL)",
    )
    where.add_argument(
        "--api-key",
        default=os.environ.get("TREADLE_API_KEY") or os.environ.get("TINKER_API_KEY"),
        help="an API key of that platform (default: $TREADLE_API_KEY or $TINKER_API_KEY)",
    )
    where.add_argument(
        "--client", choices=["treadle", "tinker"], default="treadle",
        help="drive the loop through Treadle's SDK or the plain tinker SDK (the loop is the same)",
    )  # fmt: skip
    train = p.add_argument_group("training")
    train.add_argument("--model", default=DEFAULT_MODEL, help="base model")
    train.add_argument("--rank", type=int, default=rank, help="LoRA rank")
    train.add_argument("--learning-rate", type=float, default=learning_rate)
    train.add_argument("--steps", type=int, default=steps, help="optimizer steps in all")
    train.add_argument("--seed", type=int, default=0, help="seeds data order, sampling and LoRA")
    run = p.add_argument_group("run folder")
    run.add_argument(
        "--log-dir", type=Path, default=Path("runs") / name,
        help="metrics.jsonl, curve.png and checkpoint.json go here",
    )  # fmt: skip
    run.add_argument("--resume", action="store_true", help="continue the run in --log-dir")
    run.add_argument(
        "--overwrite", action="store_true", help="start afresh even if --log-dir holds a run"
    )
    run.add_argument(
        "--save-every", type=int, default=save_every, help="checkpoint every N steps (0: never)"
    )
    run.add_argument(
        "--eval-every", type=int, default=eval_every,
        help="evaluate on held-out data every N steps, besides before and after (0: only then)",
    )  # fmt: skip
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--config", type=Path, metavar="FILE",
        help="take flag values from FILE (a JSON object keyed by flag, as the config.json every "
        "run writes in --log-dir); flags given on the command line win",
    )  # fmt: skip
    run.add_argument(
        "--allow-config-change", action="store_true",
        help="let --resume continue with a configuration that differs from the run's config.json",
    )  # fmt: skip
    track = p.add_argument_group("tracking")
    track.add_argument(
        "--mlflow-uri", default=os.environ.get("MLFLOW_TRACKING_URI") or None,
        help="log parameters, per-step metrics, the curve and the final checkpoint to an MLflow "
        "run on this tracking server (default: $MLFLOW_TRACKING_URI; none: no tracking)",
    )  # fmt: skip
    track.add_argument(
        "--mlflow-experiment", default=f"treadle-{name}",
        help="the MLflow experiment the run goes in (created if missing)",
    )  # fmt: skip
    return p


def non_negative(text: str) -> int:
    """An argparse type: an integer 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse (over the values of --config FILE, or of the run's config.json on --resume) and
    check the combinations argparse cannot."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    source = args.config
    if source is None and args.resume and (args.log_dir / run_config.FILE).exists():
        source = args.log_dir / run_config.FILE
    if source is not None:
        try:
            args = p.parse_args([*run_config.as_argv(p, run_config.read(source), source), *argv])
        except run_config.ConfigError as e:
            p.error(str(e))
    if not args.embedded and not (args.base_url and args.api_key):
        p.error(
            "no platform: pass --embedded to start one for this run, or --base-url and "
            "--api-key (or set TREADLE_BASE_URL and TREADLE_API_KEY) for a running one"
        )
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --log-dir and --overwrite discards it: pick one")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, not {args.steps}")
    return args
