"""How the `treadle` command's HTTP verbs report a failure: one line on stderr, exit status 1.

A refusal the server explained (the SDK raises it as RuntimeError or ValueError) is shown as is;
a server that cannot be reached is named with the setting to check. Imports only httpx.
"""

from __future__ import annotations

import sys

import httpx


def failed(verb: str, exc: Exception) -> int:
    """Print why `treadle <verb>` failed and return its exit status."""
    if isinstance(exc, httpx.HTTPError):
        print(
            f"treadle {verb}: cannot reach the server ({exc}); check TREADLE_BASE_URL",
            file=sys.stderr,
        )
    else:
        print(f"treadle {verb}: {exc}", file=sys.stderr)
    return 1
