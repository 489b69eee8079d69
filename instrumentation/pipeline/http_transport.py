"""An HTTP/1.1 transport for the SDK's OTLP/HTTP exporter: one kept-alive connection, a lean exchange.

The exporter sends through a pluggable `BaseHTTPTransport` (package opentelemetry-exporter-http-
transport); its default wraps `requests`, which costs ~3.6 ms of CPU per export on this machine
(a 60 KB body to a loopback server; urllib3's ~1.0 ms), `http.client` ~0.1-0.2 ms, this exchange
~0.03-0.1 ms (warm; head and body in one `sendmsg`, the response's status line and headers split
here instead of through `http.client`'s `email` parser, the URL parsed once). In the span-builder
process, whose exports run in cold caches, an export cost ~0.8 ms of CPU with `http.client`.
The exporter's own client (`_OTLPHTTPClient`) still does everything above the wire: retries and
backoff (429, 502, 503, 504 and connection errors), the deadline, compression and headers; this
only sends one request and reads its response (Content-Length, chunked, or up to the server's
close; 1xx skipped; `http.client`'s limits on line length and header count). TLS as the default
transport: `verify` (True, False, or a CA bundle path) and `cert` (a client certificate, or
(certificate, key)), from the same OTEL_EXPORTER_OTLP_* variables (`tls_settings`).
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

from opentelemetry.exporter.http.transport._base import BaseHTTPResult, BaseHTTPTransport

_CONNECTION_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, a broken response


@dataclass(frozen=True, slots=True)
class HttpClientResult(BaseHTTPResult):
    body: bytes = b""
    response_headers: Mapping[str, str] = field(default_factory=dict)

    def content(self) -> bytes:
        return self.body

    def headers(self) -> Mapping[str, str]:
        return self.response_headers


def tls_settings(signal: str = "TRACES") -> tuple[bool | str, str | tuple[str, str] | None]:
    """(verify, cert) from OTEL_EXPORTER_OTLP_(TRACES_)CERTIFICATE / _CLIENT_CERTIFICATE / _CLIENT_KEY,
    as the OTLP/HTTP exporter reads them."""

    def setting(name: str) -> str | None:
        return os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")

    certificate, key = setting("CLIENT_CERTIFICATE"), setting("CLIENT_KEY")
    return setting("CERTIFICATE") or True, (certificate, key) if certificate and key else certificate


_MAX_LINE = 65536  # http.client's limits on a response's lines and headers
_MAX_HEADERS = 100


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL's requests go: (host, port), TLS or not, the request target and Host header."""

    address: tuple[str, int]
    tls: bool
    path: str
    host: str

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected an http:// or https:// URL")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        path = f"{parts.path or '/'}?{parts.query}" if parts.query else parts.path or "/"
        return cls((parts.hostname, port), tls, path, parts.netloc.rpartition("@")[2])


@dataclass(slots=True)
class Connection:
    target: Target
    sock: socket.socket
    reader: BinaryIO  # buffered: a response's bytes past its end stay for the next one


def request_head(method: str, target: Target, headers: Mapping[str, str], length: int) -> bytes:
    """The request line and headers, as http.client writes them (Host, Accept-Encoding: identity,
    Content-Length, then the caller's); a line break in a header or the path is a ValueError, as
    there (it would start a header or a request of its own)."""
    lines = [f"{method} {target.path} HTTP/1.1", f"Host: {target.host}", "Accept-Encoding: identity"]
    lines += [f"Content-Length: {length}", *(f"{name}: {value}" for name, value in headers.items())]
    head = "\r\n".join(lines)
    if head.count("\n") != len(lines) - 1 or "\r" in head.replace("\r\n", ""):
        raise ValueError("a line break inside a request header or its path")
    return (head + "\r\n\r\n").encode("latin-1")


def _send(sock: socket.socket, head: bytes, body: bytes) -> None:
    """Head and body in one system call where the socket takes it (plain TCP), sendall for TLS."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg
        sock.sendall(head)
        sock.sendall(body)
        return
    sent = sock.sendmsg([head, body])
    if sent < len(head):
        sock.sendall(head[sent:])
        sent = len(head)
    sock.sendall(memoryview(body)[sent - len(head) :])


def _line(reader: BinaryIO) -> bytes:
    line = reader.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise http.client.LineTooLong("response line")
    if not line:
        raise http.client.RemoteDisconnected("the server closed the connection without a response")
    return line


def read_head(reader: BinaryIO) -> tuple[int, str, dict[str, str], bool]:
    """Status, reason, headers (names in lower case) of the next final response (1xx skipped), and
    whether the connection stays open after it (HTTP/1.1 unless `Connection: close`; 1.0 only with
    keep-alive)."""
    while True:
        version, _, rest = _line(reader).decode("latin-1").rstrip("\r\n").partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/") or not code.isdigit():
            raise http.client.BadStatusLine(f"{version} {rest}")
        headers: dict[str, str] = {}
        while (line := _line(reader)) not in (b"\r\n", b"\n"):
            if len(headers) == _MAX_HEADERS:
                raise http.client.HTTPException(f"more than {_MAX_HEADERS} headers")
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if not 100 <= int(code) < 200:
            connection = headers.get("connection", "").lower()
            kept = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
            return int(code), reason, headers, kept


def _exactly(reader: BinaryIO, size: int) -> bytes:
    data = reader.read(size)
    if len(data) < size:
        raise http.client.IncompleteRead(data, size - len(data))
    return data


def read_body(reader: BinaryIO, status: int, headers: Mapping[str, str]) -> tuple[bytes, bool]:
    """The body (none for 204 and 304), by Content-Length, chunked, or (neither) up to the server's
    close; and whether it ended at that close."""
    if status in (204, 304):
        return b"", False
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunks = []
        while size := int(_line(reader).split(b";", 1)[0], 16):
            chunks.append(_exactly(reader, size))
            _line(reader)  # the chunk's CRLF
        while _line(reader) not in (b"\r\n", b"\n"):  # trailers
            pass
        return b"".join(chunks), False
    if "content-length" in headers:
        return _exactly(reader, int(headers["content-length"])), False
    return reader.read(), True


class HttpClientTransport(BaseHTTPTransport):
    """One request at a time over one kept-alive connection, reopened after an error or a close."""

    def __init__(self, *, verify: bool | str = True, cert: str | tuple[str, str] | None = None) -> None:
        self._verify, self._cert = verify, cert
        self._connection: Connection | None = None
        self._targets: dict[str, Target] = {}  # the exporter's endpoint is fixed: parsed once
        self._lock = threading.RLock()  # request() closes a broken connection under it

    def _tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self._verify if isinstance(self._verify, str) else None)
        if self._verify is False:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self._cert:
            certificate, key = self._cert if isinstance(self._cert, tuple) else (self._cert, None)
            context.load_cert_chain(certificate, key)
        return context

    def _connect(self, target: Target, timeout: float | None) -> Connection:
        if self._connection is None or self._connection.target is not target:
            self.close()
            sock = socket.create_connection(target.address, timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client: no Nagle wait
            if target.tls:
                sock = self._tls().wrap_socket(sock, server_hostname=target.address[0])
            self._connection = Connection(target, sock, sock.makefile("rb"))
        self._connection.sock.settimeout(timeout)
        return self._connection

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        data: bytes | None = None,
    ) -> BaseHTTPResult:
        with self._lock:
            try:
                target = self._targets.get(url) or self._targets.setdefault(url, Target.parse(url))
                connection = self._connect(target, timeout)
                _send(connection.sock, request_head(method, target, headers or {}, len(data or b"")), data or b"")
                status, reason, response_headers, kept = read_head(connection.reader)
                body, closed = read_body(connection.reader, status, response_headers)
            except (*_CONNECTION_ERRORS, ValueError) as error:  # the client retries connection errors
                self.close()  # a broken connection is never reused
                return HttpClientResult(error=error)
            if closed or not kept:
                self.close()
        return HttpClientResult(status_code=status, reason=reason, body=body, response_headers=response_headers)

    def is_connection_error(self, exception: Exception | None) -> bool:
        return isinstance(exception, _CONNECTION_ERRORS)

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.reader.close()
                self._connection.sock.close()
                self._connection = None
