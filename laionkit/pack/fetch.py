"""URL safety: pack's replacement for img2dataset's fetch, for URLs from untrusted metadata.

http(s) only; every redirect hop's resolved address must be public unless ``--allow-private-hosts``, and
the socket connects to the address that was checked; one deadline per download; a cap on the body.
Refusals come back as per-sample error messages, recorded like any failed download.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import socket
import time
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

# Only these are fetched; file://, data:, ftp:// and the like are refused.
ALLOWED_SCHEMES = ("http", "https")


class URLRefused(Exception):
    """A URL or redirect hop pack will not fetch (scheme, or a non-public address)."""


class _Download:
    """One download's deadline and socket, shared by its connections (one per redirect hop)."""

    def __init__(self, timeout: float, allow_private_hosts: bool) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.allow_private_hosts = allow_private_hosts
        self.sock: socket.socket | None = None

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"download timed out: over the --timeout total deadline of {self.timeout:g} s")
        return left

    def connect(self, address: tuple[str, int], timeout: float, source_address: Any = None) -> socket.socket:
        """Resolve the host, refuse non-public addresses, and connect to the checked address itself, so a
        second DNS answer cannot swap in another one."""
        host, port = address
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not self.allow_private_hosts:
            for *_, sockaddr in infos:
                kind = non_public_kind(sockaddr[0])
                if kind:
                    raise URLRefused(f"URL refused: {host} resolves to {sockaddr[0]}, a {kind} address "
                                     "(--allow-private-hosts fetches it)")
        error: OSError | None = None
        for family, kind, proto, _, sockaddr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(min(timeout, self.remaining()))
                sock.connect(sockaddr)
                return sock
            except OSError as failed:
                sock.close()
                error = failed
        raise error or OSError(f"{host}: no address")


def non_public_kind(address: str) -> str | None:
    """'loopback', 'private', 'link-local' ... for an address pack must not reach by default, else None."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-public"


def _connection_class(base: type, download: _Download) -> Any:
    class Connection(base):
        def __init__(self, host: str, **kwargs: Any) -> None:
            kwargs["timeout"] = min(kwargs.get("timeout") or download.timeout, download.remaining())
            super().__init__(host, **kwargs)
            self._create_connection = download.connect

        def connect(self) -> None:
            super().connect()
            download.sock = self.sock  # the TLS socket for https: the one reads go through

    return Connection


def _opener(download: _Download) -> urllib.request.OpenerDirector:
    """http(s) only, no proxies from the environment, every redirect hop checked like the first URL."""

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(_connection_class(http.client.HTTPConnection, download), req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(_connection_class(http.client.HTTPSConnection, download), req,
                                context=self._context)

    class RedirectHandler(urllib.request.HTTPRedirectHandler):
        def http_error_302(self, req, fp, code, msg, headers):  # noqa: ANN001, ANN201
            location = headers.get("location") or headers.get("uri")
            if location:
                try:
                    check_scheme(urljoin(req.full_url, location))
                except URLRefused:
                    fp.close()
                    raise
            return super().http_error_302(req, fp, code, msg, headers)

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    opener = urllib.request.OpenerDirector()
    for handler in (HTTPHandler(), HTTPSHandler(), RedirectHandler(), urllib.request.HTTPDefaultErrorHandler(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


def check_scheme(url: Any) -> None:
    scheme = urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    if scheme not in ALLOWED_SCHEMES:
        shown = f"{scheme}:" if scheme else repr(url)[:100]
        raise URLRefused(f"URL refused: scheme {shown} (only http and https are fetched)")


@dataclass(frozen=True)
class Fetcher:
    """img2dataset's ``download_image``, made safe for hostile input.

    urllib would fetch file:// and data: URLs and follow redirects anywhere, a socket timeout bounds only
    each read (a server trickling a byte a second never trips it), and the whole body was read into
    memory whatever its size. Here: http(s) only, every hop's resolved address must be public unless
    ``allow_private_hosts``, ``timeout`` bounds the whole download, and a body over ``max_bytes`` is
    refused as soon as it is known to be (Content-Length, else while reading). Failures come back as
    img2dataset's error messages, so they are recorded per sample and counted by reason.
    """

    max_bytes: int
    allow_private_hosts: bool

    def __call__(self, row: tuple[int, str], timeout: float, user_agent_token: str | None,
                 disallowed_header_directives: set[str] | None) -> tuple[int, io.BytesIO | None, str | None]:
        key, url = row
        try:
            check_scheme(url)
            download = _Download(timeout, self.allow_private_hosts)
            request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
            with _opener(download).open(request, timeout=download.remaining()) as response:
                if disallowed_header_directives and _is_disallowed(
                    response.headers, user_agent_token, disallowed_header_directives
                ):
                    return key, None, "Use of image disallowed by X-Robots-Tag directive"
                return key, io.BytesIO(self.read_body(response, download)), None
        except Exception as error:  # noqa: BLE001 (each failure is this sample's recorded error)
            return key, None, str(error)

    def read_body(self, response: http.client.HTTPResponse, download: _Download) -> bytes:
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            raise ValueError(f"body of {int(declared):,} bytes is over --max-bytes {self.max_bytes:,}")
        chunks, size = [], 0
        while True:
            download.sock.settimeout(download.remaining())  # read1: one receive, so no read outlasts it
            chunk = response.read1(min(READ_CHUNK, self.max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_bytes:
                raise ValueError(f"body is over --max-bytes {self.max_bytes:,}")
        if response.length:  # the server closed before sending the length it declared
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        return b"".join(chunks)


def _is_disallowed(*args: Any) -> bool:
    """img2dataset's X-Robots-Tag check (imported late: img2dataset is slow to import)."""
    from img2dataset.downloader import is_disallowed

    return is_disallowed(*args)


# img2dataset's user agent, so sites treat pack like img2dataset.
USER_AGENT = "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:72.0) Gecko/20100101 Firefox/72.0"
READ_CHUNK = 1 << 16
