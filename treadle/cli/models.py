"""`treadle models`: the operator registers (`add`), lists, describes (`show`) and retires base
models, through Treadle's AdminClient (TREADLE_BASE_URL, TREADLE_API_KEY). Imports the client
only, never the server side.
"""

from __future__ import annotations

import argparse
from typing import Any

from treadle.cli import errors

VERBS = ("models",)
_CATEGORIES = ("attn", "mlp", "unembed")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = sub.add_parser(
        "models", help="register, list, show, retire base models (the operator's key)"
    )
    verbs = models.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser(
        "add",
        help="register a base model: a local Hugging Face folder (--path) or a hub id at a "
        "pinned revision in the local Hugging Face cache (--hub-id, --revision)",
    )
    add.add_argument("name", help="the model's name, like a hub id: org/name")
    source = add.add_mutually_exclusive_group(required=True)
    source.add_argument("--path", help="absolute path of the model folder (config.json, ...)")
    source.add_argument("--hub-id", help="a hub repo id already in the Hugging Face cache")
    add.add_argument("--revision", help="with --hub-id: the commit, tag or branch to pin")
    add.add_argument("--gguf-file", help="with --path: a GGUF file in the folder to convert")
    add.add_argument("--description", default=None)
    add.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    add.add_argument("--max-lora-rank", type=int, default=128)
    add.add_argument(
        "--lora-targets",
        default=",".join(_CATEGORIES),
        help="comma-separated categories sessions may adapt (default: attn,mlp,unembed)",
    )
    add.add_argument("--max-context-length", type=int, default=None)
    for token_class in ("prefill", "sample", "train"):
        add.add_argument(
            f"--{token_class}-price", type=float, default=None, metavar="USD",
            help=f"USD per million {token_class} tokens, from now on",
        )  # fmt: skip
    listing = verbs.add_parser("list", help="list the base models in service")
    listing.add_argument("--all", action="store_true", help="retired models too")
    verbs.add_parser("show", help="one model's registry entry").add_argument("name")
    verbs.add_parser("retire", help="refuse new sessions on a registered model").add_argument(
        "name"
    )


def run(args: argparse.Namespace) -> int:
    import json

    import httpx

    from treadle.client.admin import AdminClient

    try:
        client = AdminClient.from_env()
        if args.verb == "add":
            out: object = client.register_model(args.name, **_registration(args))
        elif args.verb == "list":
            out = client.list_models(include_retired=args.all)
        elif args.verb == "show":
            out = client.get_model(args.name)
        else:
            out = client.retire_model(args.name)
    except (RuntimeError, ValueError, httpx.HTTPError) as exc:
        return errors.failed(f"models {args.verb}", exc)
    print(json.dumps(out, indent=2))
    return 0


def _registration(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "path": args.path,
        "hub_id": args.hub_id,
        "revision": args.revision,
        "gguf_file": args.gguf_file,
        "dtype": args.dtype,
        "max_lora_rank": args.max_lora_rank,
        "lora_targets": [t.strip() for t in args.lora_targets.split(",") if t.strip()],
    }
    if args.description is not None:
        body["description"] = args.description
    if args.max_context_length is not None:
        body["max_context_length"] = args.max_context_length
    prices = {
        c: getattr(args, f"{c}_price")
        for c in ("prefill", "sample", "train")
        if getattr(args, f"{c}_price") is not None
    }
    if prices:
        body["prices"] = prices
    return body
