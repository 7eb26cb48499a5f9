"""The `treadle replay` and `treadle fork` verbs: SDK clients (TREADLE_BASE_URL,
TREADLE_API_KEY) of the replay and fork routes.

`replay` rebuilds a session from its log in a read-only sandbox, prints the report (operations
replayed, steps verified, the first divergence) and exits 0 when every step matched, 1 when one
diverged. `fork` opens a new training session equal to the source right after a seq_id and
prints its model id; `--save NAME` also saves its state, so it can be resumed from a
`tinker://` path once this command's client session has gone.
Kept apart from `main` (the entry point registers and dispatches). Imports the client only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

VERBS = ("replay", "fork")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = sub.add_parser(
        "replay", help="re-run a session from its log in a sandbox, verified step by step"
    )
    replay.add_argument("session", help="the model id of the session to replay")
    replay.add_argument("--to-seq", type=int, default=None, help="default: all it applied")
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    fork = sub.add_parser("fork", help="a new live session, equal to SESSION after seq N")
    fork.add_argument("session", help="the model id of the session to fork")
    fork.add_argument("--at-seq", type=int, required=True, help="the seq_id to fork after")
    fork.add_argument("--name", default=None, help="the fork's training_session_name")
    fork.add_argument(
        "--save", default=None, metavar="NAME", help="save the fork's state as this checkpoint"
    )
    fork.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    import tinker

    from treadle.client.service import ServiceClient

    svc = ServiceClient()
    try:
        if args.command == "replay":
            return _replay(svc, args)
        return _fork(svc, args)
    except tinker.APIStatusError as exc:
        print(f"error: {_message(exc)}")
        return 2
    except tinker.RequestFailedError as exc:
        print(f"error: {exc}")
        return 2


def _replay(svc: Any, args: argparse.Namespace) -> int:
    replay = svc.replay(args.session, to_seq=args.to_seq)
    report = replay.report
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(report)
        print(f"sandbox: {report.model_id} (read-only; stopped when this command exits)")
    svc.close()  # a report is all this command leaves behind
    return 0 if report.matched else 1


def _fork(svc: Any, args: argparse.Namespace) -> int:
    tc = svc.fork_training_client(args.session, args.at_seq, training_session_name=args.name)
    out: dict[str, Any] = {"model_id": tc.model_id, "source": args.session, "at_seq": args.at_seq}
    if args.save:
        out["path"] = tc.save_state(args.save).result().path
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"forked {args.session} after seq {args.at_seq}: {tc.model_id}")
        if "path" in out:
            print(
                f"saved {out['path']}: resume with "
                "create_training_client_from_state_with_optimizer(path)"
            )
        print(
            "the fork stays live until its client session expires (no heartbeat for the idle "
            "time); train it from the SDK with fork_training_client, or resume from --save"
        )
    return 0


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", exc))
    return str(exc)
