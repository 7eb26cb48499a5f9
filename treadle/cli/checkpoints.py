"""`treadle checkpoints`: the checkpoint registry (list, get, delete, ttl, download), through
Treadle's SDK (TREADLE_BASE_URL, TREADLE_API_KEY). Imports the client only, never the server
side.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

VERBS = ("checkpoints",)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ckpt = sub.add_parser("checkpoints", help="the checkpoint registry (TREADLE_BASE_URL/_API_KEY)")
    verbs = ckpt.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="list checkpoints")
    listing.add_argument("--run", default=None, help="only this training run (model id)")
    listing.add_argument("--group", default=None, help="only this model package group")
    for verb in ("get", "delete"):
        verbs.add_parser(verb).add_argument("path")
    ttl = verbs.add_parser("ttl", help="set (or clear, with 0) a checkpoint's time to live")
    ttl.add_argument("path")
    ttl.add_argument("seconds", type=int)
    download = verbs.add_parser("download", help="write a checkpoint's files to a folder")
    download.add_argument("path")
    download.add_argument("dir", type=Path)


def run(args: argparse.Namespace) -> int:
    import json

    from treadle.client.checkpoints import CheckpointsClient

    client = CheckpointsClient.from_env()
    try:
        if args.verb == "list":
            out: object = client.list(run_id=args.run, group=args.group)
        elif args.verb == "get":
            out = client.get(args.path)
        elif args.verb == "delete":
            client.delete(args.path)
            out = {"deleted": args.path}
        elif args.verb == "ttl":
            out = client.set_ttl(args.path, args.seconds or None)
        else:
            out = {"written": [str(p) for p in client.download(args.path, args.dir)]}
    except (RuntimeError, ValueError) as exc:
        print(f"treadle checkpoints {args.verb}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0
