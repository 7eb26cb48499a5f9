"""`treadle tenants` (the operator creates, lists, disables and enables tenants) and `treadle
keys` (a tenant's admin mints, lists and revokes its keys; `--aws` also mints an access key
pair and prints it as two export lines), through Treadle's AdminClient
(TREADLE_BASE_URL, TREADLE_API_KEY). Imports the client only, never the server side.
"""

from __future__ import annotations

import argparse
import sys

from treadle.cli import errors

VERBS = ("tenants", "keys")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tenants = sub.add_parser(
        "tenants", help="create, list, disable tenants (the operator's key in TREADLE_API_KEY)"
    )
    verbs = tenants.add_subparsers(dest="verb", required=True)
    create = verbs.add_parser("create", help="create a tenant; prints its first admin key once")
    create.add_argument("id")
    create.add_argument("--name", default=None)
    verbs.add_parser("list", help="list tenants")
    verbs.add_parser("disable", help="refuse every key of a tenant").add_argument("id")
    verbs.add_parser("enable", help="accept a disabled tenant's keys again").add_argument("id")
    keys = sub.add_parser(
        "keys", help="create, list, revoke API keys (an admin key in TREADLE_API_KEY)"
    )
    verbs = keys.add_subparsers(dest="verb", required=True)
    create = verbs.add_parser("create", help="mint a key; prints it once")
    create.add_argument("--tenant", default=None, help="default: the caller's tenant")
    create.add_argument("--role", choices=("admin", "member"), default="member")
    create.add_argument("--name", default=None, help="a label, e.g. who or what uses it")
    create.add_argument(
        "--aws",
        action="store_true",
        help="also an AWS-style access key pair (SigV4: SageMaker's SDK, boto3); prints only "
        "AWS_ACCESS_KEY_ID=... and AWS_SECRET_ACCESS_KEY=..., e.g. export $(treadle keys "
        "create --aws)",
    )
    listing = verbs.add_parser("list", help="list a tenant's keys (never their text)")
    listing.add_argument("--tenant", default=None, help="default: the caller's tenant")
    verbs.add_parser("revoke", help="refuse a key from its next request on").add_argument("key_id")


def run(args: argparse.Namespace) -> int:
    import json

    import httpx

    from treadle.client.admin import AdminClient

    try:
        client = AdminClient.from_env()
        if args.command == "tenants":
            if args.verb == "create":
                out: object = client.create_tenant(args.id, args.name)
            elif args.verb == "list":
                out = client.list_tenants()
            elif args.verb == "disable":
                out = client.disable_tenant(args.id)
            else:
                out = client.enable_tenant(args.id)
        elif args.verb == "create" and args.aws:
            pair = client.create_key(args.tenant, args.role, args.name, aws=True)
            # Only the two lines a shell exports on stdout; which key it is goes to stderr.
            print(f"key {pair['key']['id']} of tenant {pair['key']['tenant_id']}", file=sys.stderr)
            print(f"AWS_ACCESS_KEY_ID={pair['access_key_id']}")
            print(f"AWS_SECRET_ACCESS_KEY={pair['secret_access_key']}")
            return 0
        elif args.verb == "create":
            out = client.create_key(args.tenant, args.role, args.name)
        elif args.verb == "list":
            out = client.list_keys(args.tenant)
        else:
            out = client.revoke_key(args.key_id)
    except (RuntimeError, ValueError, httpx.HTTPError) as exc:
        return errors.failed(f"{args.command} {args.verb}", exc)
    print(json.dumps(out, indent=2))
    return 0
