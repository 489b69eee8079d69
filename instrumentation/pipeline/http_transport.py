"""An HTTP transport for the SDK's OTLP/HTTP exporter over `http.client`: one kept-alive connection.

The exporter sends through a pluggable `BaseHTTPTransport` (package opentelemetry-exporter-http-
transport); its default wraps `requests`, which costs ~3.6 ms of CPU per export on this machine
(a 60 KB body to a loopback server; urllib3's ~1.0 ms), `http.client` ~0.3 ms. At the span-builder
process's checkpoint rate (4 exports a second at least) that is most of the fast backend's CPU.
The exporter's own client (`_OTLPHTTPClient`) still does everything above the wire: retries and
backoff (429, 502, 503, 504 and connection errors), the deadline, compression and headers; this
only sends one request. TLS as the default transport: `verify` (True, False, or a CA bundle path)
and `cert` (a client certificate, or (certificate, key)), from the same OTEL_EXPORTER_OTLP_*
variables (`tls_settings`).
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

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


class HttpClientTransport(BaseHTTPTransport):
    """One request at a time over one kept-alive connection, reopened after an error or a close."""

    def __init__(self, *, verify: bool | str = True, cert: str | tuple[str, str] | None = None) -> None:
        self._verify, self._cert = verify, cert
        self._connection: http.client.HTTPConnection | None = None
        self._target: tuple[str, str, int | None] | None = None
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

    def _connect(self, url: urllib.parse.SplitResult, timeout: float | None) -> http.client.HTTPConnection:
        target = (url.scheme, url.hostname or "", url.port)
        if self._connection is None or target != self._target:
            self.close()
            if url.scheme == "https":
                self._connection = http.client.HTTPSConnection(
                    target[1], target[2], timeout=timeout, context=self._tls()
                )
            else:
                self._connection = http.client.HTTPConnection(target[1], target[2], timeout=timeout)
            self._target = target
        self._connection.timeout = timeout
        if self._connection.sock is not None:
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
        parts = urllib.parse.urlsplit(url)
        path = parts.path or "/"
        with self._lock:
            try:
                connection = self._connect(parts, timeout)
                connection.request(method, f"{path}?{parts.query}" if parts.query else path, data, headers or {})
                response = connection.getresponse()
                body = response.read()
            except (*_CONNECTION_ERRORS, ValueError) as error:  # the client retries connection errors
                self.close()  # a broken connection is never reused
                return HttpClientResult(error=error)
            if response.will_close:
                self.close()
        return HttpClientResult(
            status_code=response.status,
            reason=response.reason,
            body=body,
            response_headers={k.lower(): v for k, v in response.getheaders()},
        )

    def is_connection_error(self, exception: Exception | None) -> bool:
        return isinstance(exception, _CONNECTION_ERRORS)

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None
