"""The OTLP/HTTP transport's HTTP/1.1 exchange against real loopback servers: what it sends, how it
reads each kind of response, and when it keeps or drops the connection."""

from __future__ import annotations

import http.server
import socket
import ssl
import threading

import pytest

from phaselens.instrumentation.pipeline.http_transport import HttpClientTransport
from tests.tls_fixtures import Authority


class ScriptedServer:
    """Accepts connections on loopback and answers each request with the next scripted raw bytes
    (None: close the connection without answering), closing the connection after it unless it
    says how long its body is over HTTP/1.1; records every request's head and body."""

    def __init__(self, responses: list[bytes | None]) -> None:
        self.responses = responses
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1/traces?tenant=a"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.responses:
            conn, _ = self.listener.accept()
            self.connections += 1
            with conn, conn.makefile("rb") as reader:
                while self.responses and (line := reader.readline()):
                    head = line + b"".join(iter(reader.readline, b"\r\n"))
                    length = head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]
                    self.requests.append((head, reader.read(int(length))))
                    response = self.responses.pop(0)
                    if response is None:
                        break
                    conn.sendall(response)
                    if not kept_alive(response):
                        break

    def close(self) -> None:
        self.listener.close()


def kept_alive(response: bytes) -> bool:
    text = response.lower()
    sized = b"content-length: 0" in text or b"chunked" in text or b" 204 " in text
    return text.startswith(b"http/1.1") and b"connection: close" not in text and sized


def post(transport: HttpClientTransport, url: str, body: bytes = b"payload"):
    return transport.request(
        "POST", url, headers={"Content-Type": "application/x-protobuf", "X-Tenant": "t1"}, data=body, timeout=5
    )


def test_the_request_carries_the_method_target_host_length_and_the_callers_headers():
    server = ScriptedServer([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"])
    result = post(HttpClientTransport(), server.url, b"x" * 70_000)
    ((head, body),) = server.requests
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/traces?tenant=a HTTP/1.1"
    assert f"Host: {server.url.split('/')[2]}" in lines and "Content-Length: 70000" in lines
    assert "Content-Type: application/x-protobuf" in lines and "X-Tenant: t1" in lines
    assert body == b"x" * 70_000
    assert (result.status_code, result.reason, result.content(), result.headers()["content-length"]) == (
        200,
        "OK",
        b"ok",
        "2",
    )


def test_a_kept_alive_connection_serves_every_request_until_the_server_closes_it():
    server = ScriptedServer(
        [
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",  # 1xx skipped
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: t\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 503 Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n\r\n",
            b"HTTP/1.0 200 OK\r\n\r\nto the close",  # no length: the body ends at the server's close
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        ]
    )
    transport = HttpClientTransport()
    results = [post(transport, server.url) for _ in range(6)]
    assert [(r.status_code, r.content()) for r in results] == [
        (200, b""),
        (200, b"abcde"),
        (204, b""),
        (503, b""),
        (200, b"to the close"),
        (200, b""),
    ]
    assert results[3].headers()["retry-after"] == "1"  # the exporter's client reads it
    assert server.connections == 3  # reopened after the 503's close and after the body read to the close


@pytest.mark.parametrize(
    "response",
    [
        None,  # closed without a response
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # closed mid-body
        b"SPDY nonsense\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
    ],
)
def test_a_broken_response_is_a_connection_error_and_the_next_request_reconnects(response):
    server = ScriptedServer([response, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])
    transport = HttpClientTransport()
    broken = post(transport, server.url)
    assert broken.status_code is None and broken.error is not None
    assert transport.is_connection_error(broken.error) or isinstance(broken.error, ValueError)
    assert post(transport, server.url).status_code == 200 and server.connections == 2


def test_a_refused_connection_and_a_bad_url_are_errors_not_raises():
    port = socket.create_server(("127.0.0.1", 0))
    address = port.getsockname()
    port.close()
    transport = HttpClientTransport()
    refused = post(transport, f"http://127.0.0.1:{address[1]}/v1/traces")
    assert transport.is_connection_error(refused.error)
    assert isinstance(post(transport, "ftp://127.0.0.1/v1/traces").error, ValueError)


def test_a_line_break_in_a_header_is_refused_not_sent():
    server = ScriptedServer([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])
    transport = HttpClientTransport()
    for headers in ({"X-Tenant": "t1\r\nX-Injected: 1"}, {"X-Tenant": "t1\nX-Injected: 1"}, {"X\rY": "1"}):
        result = transport.request("POST", server.url, headers=headers, data=b"x", timeout=5)
        assert isinstance(result.error, ValueError) and result.status_code is None
    assert post(transport, server.url).status_code == 200 and len(server.requests) == 1


def stdlib_server(seen: list[tuple[str, bytes]], tls: ssl.SSLContext | None = None) -> http.server.HTTPServer:
    """The standard library's HTTP/1.1 server on loopback (over TLS with `tls`), recording each POST
    and answering 200 with an empty body; each connection's peer certificate, if any, in `peers`."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            seen.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_an_http_server_of_the_standard_library_reads_what_it_sends():
    seen: list[tuple[str, bytes]] = []
    server = stdlib_server(seen)
    transport = HttpClientTransport()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    assert [post(transport, url, bytes([i]) * 300_000).status_code for i in range(3)] == [200] * 3
    server.shutdown()
    server.server_close()
    assert seen == [("/v1/traces", bytes([i]) * 300_000) for i in range(3)]


def test_https_with_a_client_certificate_sends_every_body_and_an_unknown_ca_is_an_error(tmp_path):
    """TLS as the exporter configures it (OTEL_EXPORTER_OTLP_CERTIFICATE / _CLIENT_CERTIFICATE /
    _CLIENT_KEY): the server's CA verified, the client's certificate presented (the server requires
    one); a server whose CA is not the configured one is a connection error the exporter retries,
    nothing sent and nothing raised."""
    ca, other = Authority(tmp_path, "test"), Authority(tmp_path, "other")
    server_pair, client_pair = ca.issue("server"), ca.issue("client", server=False)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server_pair.cert, server_pair.key)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(ca.ca.cert)
    seen: list[tuple[str, bytes]] = []
    server = stdlib_server(seen, context)
    url = f"https://127.0.0.1:{server.server_address[1]}/v1/traces"
    try:
        transport = HttpClientTransport(verify=ca.ca.cert, cert=(client_pair.cert, client_pair.key))
        assert [post(transport, url, bytes([i]) * 300_000).status_code for i in range(3)] == [200] * 3
        transport.close()
        stranger = HttpClientTransport(verify=other.ca.cert, cert=(client_pair.cert, client_pair.key))
        refused = post(stranger, url)
        assert refused.status_code is None and stranger.is_connection_error(refused.error), refused
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [("/v1/traces", bytes([i]) * 300_000) for i in range(3)]
