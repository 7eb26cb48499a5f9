"""A server that answers a `forward`'s two requests at once: the SDK's own share of a round trip.

Run as a process of its own in front of a platform (`python benchmarks/instant_answers.py
--upstream URL`; it prints its port): every request goes on to the platform, except that once one
`forward` has been answered (its POST and the `retrieve_future` that brought its result), every
later POST to `/api/v1/forward_backward` gets that POST's answer again and every `retrieve_future`
of that request gets its result again, from memory. A client's SDK then runs as it always does
(its session, heartbeats and futures through the platform) while its `forward` costs no platform
at all: what is left of the round trip is the SDK, HTTP and this small server. The repeated
forward must be the same each time (the round-trip benchmark's is).

`GET /instant/overlap` answers the median, in milliseconds, of the time from each answer to a
POST from memory to the arrival of the next `retrieve_future` (the client's operations one at a
time), and starts counting again. That is the SDK taking the POST's answer and sending for the
result; on a real platform it overlaps the operation's execution, so it is not on the round
trip's serial path.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FORWARD = "/api/v1/forward_backward"
RESULT = "/api/v1/retrieve_future"
OVERLAP = "/instant/overlap"
# Headers not passed on: those of one connection only, and those a server writes itself.
_NOT_PASSED = {"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"}


class Recorded:
    """The first forward's request id and its two answers (its POST's and its result's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.request_id: str | None = None  # the first forward's, once its POST is answered
        # Its POST's answer and its retrieve_future's (200), each with its headers (the body may
        # be compressed, as the client asked).
        self.admitted: tuple[list[tuple[str, str]], bytes] | None = None
        self.result: tuple[list[tuple[str, str]], bytes] | None = None
        self.answered_post: float | None = None  # when the last POST was answered from memory
        self.overlaps_ms: list[float] = []  # from then to its retrieve_future's arrival


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDKs expect
    disable_nagle_algorithm = True  # headers and body go in two writes: never hold the second
    recorded: Recorded
    upstream: tuple[str, int]
    _local = threading.local()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        pass  # quiet: a line per request would cost more than the answer

    def do_GET(self) -> None:
        if self.path == OVERLAP:
            overlaps, self.recorded.overlaps_ms = self.recorded.overlaps_ms, []
            median = statistics.median(overlaps) if overlaps else None
            return self._answer(200, json.dumps({"median_ms": median}).encode())
        self._forward(b"")

    def do_DELETE(self) -> None:
        self._forward(self._body())

    def do_PUT(self) -> None:
        self._forward(self._body())

    def do_POST(self) -> None:
        body = self._body()
        recorded = self.recorded
        admitted, result = recorded.admitted, recorded.result
        if admitted is not None and result is not None:  # from memory
            if self.path == FORWARD:
                self._answer(200, admitted[1], admitted[0])
                recorded.answered_post = time.perf_counter()
                return None
            if self.path == RESULT and json.loads(body).get("request_id") == recorded.request_id:
                if (answered := recorded.answered_post) is not None:
                    recorded.overlaps_ms.append((time.perf_counter() - answered) * 1000)
                    recorded.answered_post = None
                return self._answer(200, result[1], result[0])
        status, headers, answer = self._proxy(body)
        with recorded.lock:
            if self.path == FORWARD and recorded.request_id is None and status == 200:
                recorded.request_id = json.loads(_plain(answer, headers))["request_id"]
                recorded.admitted = (headers, answer)
            elif (
                self.path == RESULT
                and status == 200
                and recorded.request_id is not None
                and json.loads(body).get("request_id") == recorded.request_id
            ):
                recorded.result = (headers, answer)
        self._answer(status, answer, headers)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes) -> None:
        status, headers, answer = self._proxy(body)
        self._answer(status, answer, headers)

    def _proxy(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_PASSED}
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        answer = response.read()
        kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _NOT_PASSED]
        return response.status, kept, answer

    def _answer(
        self, status: int, body: bytes, headers: list[tuple[str, str]] | None = None
    ) -> None:
        self.send_response(status)
        for key, value in headers or [("Content-Type", "application/json")]:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _plain(body: bytes, headers: list[tuple[str, str]]) -> bytes:
    """`body` decompressed, as its Content-Encoding says."""
    encoding = next((v for k, v in headers if k.lower() == "content-encoding"), "identity")
    return gzip.decompress(body) if encoding == "gzip" else body


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True, help="the platform's base URL")
    args = parser.parse_args()
    url = urlsplit(args.upstream)
    Handler.recorded = Recorded()
    Handler.upstream = (url.hostname or "127.0.0.1", url.port or 80)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
