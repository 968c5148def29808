"""A loopback HTTP server for images, so tests, benchmarks and the demo can run `pack` offline.

It binds 127.0.0.1 on a free port and answers each path from a fixed table of responses, which may
also describe how a real or hostile web server misbehaves: an error status, a slow answer, an opt-out
header, a body cut short of its declared length, a redirect, a body trickled a few bytes at a time, or
a huge body generated on the fly (never held in memory).
"""

from __future__ import annotations

import mimetypes
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


@dataclass(frozen=True)
class Response:
    body: bytes
    status: int = 200
    content_type: str = "image/jpeg"
    headers: tuple[tuple[str, str], ...] = ()
    delay_s: float = 0.0
    # A Content-Length larger than the body: the connection closes mid-transfer.
    declared_length: int | None = None
    # Send the body in pieces of trickle_bytes, sleeping trickle_s before each: per-read timeouts never fire.
    trickle_bytes: int = 0
    trickle_s: float = 0.0
    # Append this many zero bytes after body, streamed (a huge download).
    padding: int = 0
    # False: no Content-Length, the body ends when the connection closes (its size is known only by reading).
    send_length: bool = True


def redirect(location: str, status: int = 302) -> Response:
    """A redirect to ``location`` (a path on this server, or any URL such as file:///etc/passwd)."""
    return Response(b"", status=status, content_type="text/plain", headers=(("Location", location),))


@dataclass
class ServedImages:
    """What a running server exposes: its base URL and how often each path was asked for."""

    base_url: str
    hits: Counter

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"


def folder_routes(folder: str | os.PathLike[str]) -> dict[str, Response]:
    """One route per image file in ``folder``, named like the file."""
    routes = {}
    for path in sorted(Path(folder).iterdir()):
        if path.suffix.lower() in IMAGE_SUFFIXES:
            content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            routes[path.name] = Response(path.read_bytes(), content_type=content_type)
    return routes


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # downloaders open many connections at once; the default 5 drops some


def _handler(routes: Mapping[str, Response], hits: Counter, lock: threading.Lock) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0].lstrip("/")
            with lock:
                hits[path] += 1
            response = routes.get(path, Response(b"not found", status=404, content_type="text/plain"))
            if response.delay_s:
                time.sleep(response.delay_s)
            try:
                self.send_response(response.status)
                self.send_header("Content-Type", response.content_type)
                length = response.declared_length or len(response.body) + response.padding
                if response.send_length:
                    self.send_header("Content-Length", str(length))
                for name, value in response.headers:
                    self.send_header(name, value)
                self.end_headers()
                if response.trickle_bytes:
                    for start in range(0, len(response.body), response.trickle_bytes):
                        time.sleep(response.trickle_s)
                        self.wfile.write(response.body[start : start + response.trickle_bytes])
                        self.wfile.flush()
                else:
                    self.wfile.write(response.body)
                block = bytes(1 << 20)
                for start in range(0, response.padding, len(block)):
                    self.wfile.write(block[: min(len(block), response.padding - start)])
            except (BrokenPipeError, ConnectionResetError):
                return  # the client gave up (a timeout under test): nothing left to answer
            if response.declared_length or not response.send_length:
                self.close_connection = True

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            return

    return Handler


@contextmanager
def serve(routes: Mapping[str, Response]) -> Iterator[ServedImages]:
    """Serve ``routes`` on 127.0.0.1 (a free port) from a background thread until the block exits."""
    hits: Counter = Counter()
    server = _Server(("127.0.0.1", 0), _handler(dict(routes), hits, threading.Lock()))
    thread = threading.Thread(target=server.serve_forever, name="laionkit-imageserver", daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield ServedImages(f"http://{host}:{port}", hits)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
