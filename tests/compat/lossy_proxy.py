"""A TCP proxy in front of the platform that loses answers: the first answer to each POST whose
path ends with one of `lose`, after the platform has written it, is dropped and the client's
connection closed, as a network that fails between the server's reply and the client. The
request itself reaches the platform whole, so the operation is admitted; what the client does
next (its SDK's retry) is what a test looks at."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class LossyProxy:
    def __init__(self, upstream_port: int, lose: tuple[str, ...]) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._to_lose = {path: 1 for path in lose}
        self.lost: list[str] = []  # the paths whose answer it dropped, in order
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(self._upstream)
            losing = threading.Event()  # the answer now on its way is to be dropped
            threading.Thread(
                target=self._requests, args=(client, upstream, losing), daemon=True
            ).start()
            threading.Thread(
                target=self._answers, args=(upstream, client, losing), daemon=True
            ).start()

    def _requests(
        self, client: socket.socket, upstream: socket.socket, losing: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while chunk := client.recv(65536):
                if self._loses_answer_to(chunk):
                    losing.set()
                upstream.sendall(chunk)
        _close(client, upstream)

    def _answers(
        self, upstream: socket.socket, client: socket.socket, losing: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while chunk := upstream.recv(65536):
                if losing.is_set():
                    break  # the platform answered; the client never hears it
                client.sendall(chunk)
        _close(client, upstream)

    def _loses_answer_to(self, chunk: bytes) -> bool:
        """Whether the answer to the request starting in `chunk` is to be lost (and counted)."""
        if not chunk.startswith(b"POST "):
            return False
        path = chunk.split(b" ", 2)[1].decode("latin-1")
        with self._lock:
            for suffix, left in self._to_lose.items():
                if left and path.endswith(suffix):
                    self._to_lose[suffix] = left - 1
                    self.lost.append(suffix)
                    return True
        return False


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


@contextlib.contextmanager
def lossy_proxy(upstream_port: int, lose: tuple[str, ...]) -> Iterator[LossyProxy]:
    proxy = LossyProxy(upstream_port, lose)
    try:
        yield proxy
    finally:
        proxy.close()
