"""OTLP/HTTP: `POST /v1/traces`, `/v1/logs`, `/v1/metrics` (protobuf or JSON, gzip or not),
`GET /metrics`, `GET /health`.

Bodies are capped twice: the bytes on the wire (Content-Length) and the bytes after gzip, which is
inflated in a stream that stops at the cap, so a gzip bomb is refused without being expanded.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import zlib
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.rpc import status_pb2

from phaselens.collectors import otlp_json
from phaselens.collectors.ingest import RETRY_AFTER_S, Ingest, Refused
from phaselens.collectors.metrics import CollectorMetrics
from phaselens.common.ports import bind_reusable
from phaselens.common.tls import ServerTls

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_HTTP_STATUS = {"invalid": 400, "too_large": 413, "unsupported": 415, "unauthenticated": 401, "full": 503}
_GRPC_CODE = {"invalid": 3, "too_large": 3, "unsupported": 3, "unauthenticated": 16, "full": 14}


def inflate_capped(body: bytes, cap: int) -> bytes:
    """gzip → bytes, refusing (ValueError) output over `cap` bytes without producing more than cap+1."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, cap + 1)
    except zlib.error as exc:
        raise ValueError(f"invalid gzip body: {exc}") from None
    if len(out) > cap or inflater.unconsumed_tail:
        raise OverflowError(f"body exceeds {cap} bytes after decompression")
    if not inflater.eof:
        raise ValueError("truncated gzip body")
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "phaselens-collector"
    timeout = 30  # seconds a connection may stall mid-request before its thread gives up
    # headers and body go out in two writes: without TCP_NODELAY the body waits for the exporter's
    # delayed ACK of the headers (~40 ms on Linux) on every keep-alive request
    disable_nagle_algorithm = True
    collector: HttpReceiver  # set on a subclass per server

    def log_message(self, fmt: str, *args: object) -> None:  # quiet: counters tell the story
        pass

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b'{"status":"ok"}\n', JSON)
        elif self.path == "/metrics":  # counters: behind the token when one is set (health is not)
            try:
                self.collector.ingest.check_auth(self.headers.get("Authorization"))
            except Refused:
                self._send(401, b"missing or wrong bearer token\n", "text/plain")
                return
            self._send(200, self.collector.metrics_text().encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        ingest = self.collector.routes.get(self.path)
        if ingest is None:
            self._drain_or_close()
            paths = ", ".join(self.collector.routes)
            self._send(404, f"not found: OTLP goes to {paths}\n".encode(), "text/plain")
            return
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        try:
            ingest.check_auth(self.headers.get("Authorization"))
            if content_type not in (PROTOBUF, JSON):
                ingest.refuse("unsupported", f"unsupported Content-Type {content_type!r}; use {PROTOBUF} or {JSON}")
            body = self._read_body(ingest)
            if content_type == PROTOBUF:
                ingest.accept(body)
                self._send(200, ingest.signal.response, PROTOBUF)
            else:
                ingest.accept(self._parse_json(ingest, body))
                self._send(200, b"{}", JSON)
        except Refused as exc:
            self._refused(exc, content_type)

    def _read_body(self, ingest: Ingest) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            ingest.refuse("invalid", "a Content-Length header is required")
        if int(length) > ingest.max_body_bytes:
            self.close_connection = True  # not read: the connection cannot be reused
            ingest.refuse("too_large", f"body of {length} bytes exceeds {ingest.max_body_bytes}")
        body = self.rfile.read(int(length))
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding == "identity":
            return body
        if encoding != "gzip":
            ingest.refuse("unsupported", f"unsupported Content-Encoding {encoding!r}; use gzip or none")
        try:
            return inflate_capped(body, ingest.max_body_bytes)
        except OverflowError as exc:
            ingest.refuse("too_large", str(exc))
        except ValueError as exc:
            ingest.refuse("invalid", str(exc))

    def _parse_json(self, ingest: Ingest, body: bytes) -> bytes:
        """OTLP/JSON → the protobuf bytes that are spooled."""
        try:
            payload: bytes = otlp_json.parse(body, ingest.signal.request_type).SerializeToString()
        except otlp_json.InvalidJson as exc:
            ingest.refuse("invalid", str(exc))
        return payload

    def _drain_or_close(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= self.collector.ingest.max_body_bytes:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _refused(self, exc: Refused, content_type: str) -> None:
        self.close_connection = True  # the body may be unread: do not reuse the connection
        status = status_pb2.Status(code=_GRPC_CODE[exc.kind], message=str(exc))
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.kind == "full" else {}
        if exc.kind == "unauthenticated":
            headers["WWW-Authenticate"] = "Bearer"
        if content_type == JSON:
            body = f'{{"code":{status.code:d},"message":{json.dumps(status.message)}}}'.encode()
            self._send(_HTTP_STATUS[exc.kind], body, JSON, headers)
        else:
            self._send(_HTTP_STATUS[exc.kind], status.SerializeToString(), PROTOBUF, headers)

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(code, HTTPStatus(code).phrase)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None = None
    metrics: CollectorMetrics | None = None

    def get_request(self) -> tuple[socket.socket, Any]:  # Any: socketserver's address type
        sock, address = self.socket.accept()
        if self.tls is None:
            return sock, address
        # the handshake runs on the connection's own thread (finish_request): a client that stalls
        # in it must not hold up accept()
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

    def finish_request(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(_Handler.timeout)
            try:
                request.do_handshake()
            except (ssl.SSLError, OSError):  # a plaintext client, a wrong CA, no client certificate
                if self.metrics is not None:
                    self.metrics.add("tls_handshakes_failed")
                return
        super().finish_request(request, client_address)

    def server_bind(self) -> None:
        # rebinds at once after a crash (connections left in TIME_WAIT); a live owner still fails
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # HttpReceiver passes (host: str, port); socketserver also allows bytes
        bind_reusable(self.socket, host, port, "OTLP/HTTP")
        address = self.socket.getsockname()
        self.server_address = address
        self.server_name, self.server_port = address[:2]


class HttpReceiver:
    """Owns the HTTP server thread (HTTPS with `tls`); `metrics_text` is supplied by the service.
    `ingests`: one per signal, the first's token and body cap also guard `GET /metrics` and 404s."""

    def __init__(
        self,
        ingests: Sequence[Ingest],
        metrics_text: Callable[[], str],
        host: str,
        port: int,
        tls: ServerTls | None = None,
    ):
        self.ingest, self.metrics_text = ingests[0], metrics_text
        self.routes = {ingest.signal.http_path: ingest for ingest in ingests}
        handler = type("Handler", (_Handler,), {"collector": self})
        context = tls.ssl_context() if tls is not None else None  # bad files fail before the bind
        self._server = _Server((host, port), handler)
        self._server.tls, self._server.metrics = context, self.ingest.metrics
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
