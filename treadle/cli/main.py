"""The `treadle` command: `up` (the whole embedded platform), `worker`, `migrate`, and the
HTTP clients' verbs `checkpoints`, `tenants`, `keys`, `models`, `prices`, `quotas`, `usage`, `bill`,
`sessions`, `audit`, `replay`, `fork` and `status` (TREADLE_BASE_URL, TREADLE_API_KEY).

Each verb group is a module of `treadle.cli` with `add_parsers`, `VERBS` and `run`; this one
builds the parser from them and hands the parsed arguments to the group that owns the verb.
"""

from __future__ import annotations

import argparse
import sys

from treadle.cli import admin, audit, billing, checkpoints, lineage, models, serve, status

GROUPS = (serve, checkpoints, admin, models, billing, audit, lineage, status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treadle", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_parsers(sub)
    args = parser.parse_args(argv)
    (group,) = (group for group in GROUPS if args.command in group.VERBS)
    return group.run(args)


if __name__ == "__main__":
    sys.exit(main())
