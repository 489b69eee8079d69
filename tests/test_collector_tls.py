"""TLS on the collector's hops, with a CA made in the test: real OTel SDK exporters over TLS into
both receivers, refusals (wrong CA, plaintext, missing client certificate), mutual TLS, the
exposure policy, and the collector's inserts into ClickHouse over HTTPS (tests/tls_fixtures.py)."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from phaselens.collectors.service import Collector
from phaselens.common.exposure import InsecureBindError, check_exposure
from phaselens.common.tls import ServerTls, TlsConfigError, server_tls
from phaselens.storage.clickhouse_url import connect
from tests.collector_fixtures import traces_db, wait_rows
from tests.test_collector_cli import _start, _stop
from tests.tls_fixtures import Authority, Pair, TlsProxy

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_EMPTY_EXPORT = ExportTraceServiceRequest().SerializeToString()
__all__ = ["traces_db"]  # a fixture, used by name


@pytest.fixture(autouse=True)
def _no_requests_ca_override(monkeypatch) -> None:
    """requests (under the OTLP/HTTP exporter) lets these variables override the exporter's own
    certificate_file: the session's `verify` loses to the environment (docs/collectors.md)."""
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    """One CA that signs the server and a client; a second CA nobody trusts."""
    directory = tmp_path_factory.mktemp("pki")
    ca, other = Authority(directory, "test"), Authority(directory, "other")
    return {
        "ca": ca.ca.cert,
        "server": ca.issue("server"),
        "client": ca.issue("client", server=False),
        "other_ca": other.ca.cert,
        "other_client": other.issue("other-client", server=False),
    }


def _pem(path: str) -> bytes:
    return Path(path).read_bytes()


def _collector(clickhouse, database: str, tmp_path, tls: ServerTls | None, **kwargs) -> Collector:
    return Collector(
        clickhouse.url, database=database, spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05, tls=tls, **kwargs
    ).start()


def _send(exporter, service: str = "tls-test") -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("root"):
        pass
    provider.shutdown()


def _grpc_exporter(c: Collector, ca: str, client: Pair | None = None) -> GrpcExporter:
    key_cert = (_pem(client.key), _pem(client.cert)) if client else (None, None)
    credentials = grpc.ssl_channel_credentials(_pem(ca), *key_cert)
    return GrpcExporter(endpoint=c.grpc_endpoint, credentials=credentials, timeout=5)


def _http_exporter(c: Collector, ca: str, client: Pair | None = None) -> HttpExporter:
    return HttpExporter(
        endpoint=f"{c.http_endpoint}/v1/traces",
        certificate_file=ca,
        client_certificate_file=client.cert if client else None,
        client_key_file=client.key if client else None,
        timeout=5,
    )


def _grpc_call(c: Collector, channel_credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """One raw Export; its status code (OK when accepted)."""
    target = c.grpc_endpoint
    with (
        grpc.secure_channel(target, channel_credentials)
        if channel_credentials
        else grpc.insecure_channel(target) as channel
    ):
        try:
            channel.unary_unary(EXPORT)(_EMPTY_EXPORT, timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sdk_exporter_over_tls_lands_and_untrusted_clients_are_refused(
    protocol, pki, clickhouse, ch_client, traces_db, tmp_path
):
    c = _collector(clickhouse, traces_db, tmp_path, ServerTls(pki["server"].cert, pki["server"].key))
    try:
        assert c.http_endpoint.startswith("https://")
        exporter = _grpc_exporter(c, pki["ca"]) if protocol == "grpc" else _http_exporter(c, pki["ca"])
        _send(exporter)
        assert wait_rows(ch_client, traces_db, 1) == 1
        if protocol == "grpc":
            wrong_ca = grpc.ssl_channel_credentials(_pem(pki["other_ca"]))
            assert _grpc_call(c, wrong_ca) == grpc.StatusCode.UNAVAILABLE
            assert _grpc_call(c, None) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
        else:
            url = f"{c.http_endpoint}/health"
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(url, verify=ssl.create_default_context(cafile=pki["other_ca"]))
            with pytest.raises(httpx.TransportError):  # plaintext to a TLS port: the handshake fails
                httpx.get(url.replace("https://", "http://"), timeout=5)
            assert httpx.get(url, verify=ssl.create_default_context(cafile=pki["ca"])).status_code == 200
            assert _handshakes_failed(c, 2) == 2
        assert wait_rows(ch_client, traces_db, 2, timeout_s=0.5) == 1  # nothing else came in
    finally:
        c.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_mutual_tls_needs_a_client_certificate_from_the_trusted_ca(
    protocol, pki, clickhouse, ch_client, traces_db, tmp_path
):
    tls = ServerTls(pki["server"].cert, pki["server"].key, client_ca_file=pki["ca"])
    c = _collector(clickhouse, traces_db, tmp_path, tls)
    try:
        make = _grpc_exporter if protocol == "grpc" else _http_exporter
        _send(make(c, pki["ca"], pki["client"]))
        assert wait_rows(ch_client, traces_db, 1) == 1
        if protocol == "grpc":
            ca = _pem(pki["ca"])
            assert _grpc_call(c, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE
            other = pki["other_client"]
            foreign = grpc.ssl_channel_credentials(ca, _pem(other.key), _pem(other.cert))
            assert _grpc_call(c, foreign) == grpc.StatusCode.UNAVAILABLE
        else:
            url = f"{c.http_endpoint}/health"
            for client in (None, pki["other_client"]):
                context = ssl.create_default_context(cafile=pki["ca"])
                if client is not None:
                    context.load_cert_chain(client.cert, client.key)
                with pytest.raises(httpx.TransportError):
                    httpx.get(url, verify=context, timeout=5)
            assert _handshakes_failed(c, 2) == 2
        assert wait_rows(ch_client, traces_db, 2, timeout_s=0.5) == 1
    finally:
        c.stop()


def test_exposure_policy_counts_mutual_tls_as_authentication_and_plain_tls_not(pki, clickhouse, traces_db, tmp_path):
    check_exposure("0.0.0.0", None, False, mutual_tls=True)
    with pytest.raises(InsecureBindError, match="--tls-client-ca"):
        check_exposure("0.0.0.0", None, False, mutual_tls=False)
    server = pki["server"]
    with pytest.raises(InsecureBindError):
        Collector(clickhouse.url, database=traces_db, host="0.0.0.0", tls=ServerTls(server.cert, server.key)).start()
    mutual = ServerTls(server.cert, server.key, client_ca_file=pki["ca"])
    c = _collector(clickhouse, traces_db, tmp_path, mutual, host="0.0.0.0")
    c.stop()


def test_unusable_tls_files_are_clear_errors(pki, tmp_path):
    with pytest.raises(TlsConfigError, match="go together"):
        server_tls(pki["server"].cert, None)
    with pytest.raises(TlsConfigError, match="needs --tls-cert"):
        server_tls(None, None, pki["ca"])
    assert server_tls(None, None) is None
    mismatched = ServerTls(pki["server"].cert, pki["client"].key)
    with pytest.raises(TlsConfigError, match=pki["client"].key):
        mismatched.ssl_context()
    missing = ServerTls(pki["server"].cert, pki["server"].key, client_ca_file=str(tmp_path / "nope.pem"))
    with pytest.raises(TlsConfigError, match="--tls-client-ca"):
        missing.ssl_context()


def test_collector_command_tls_both_hops(pki, clickhouse, ch_client, traces_db, tmp_path):
    """`phaselens collector --tls-cert/--tls-key` receiving over TLS, writing to ClickHouse over
    HTTPS (a TLS endpoint in front of the embedded server) verified with --clickhouse-ca."""
    proxy = TlsProxy(pki["server"], clickhouse.http_port)
    server = pki["server"]
    args = ["--grpc-port", "0", "--http-port", "0", "--spool", str(tmp_path / "spool")]
    proc = _start("collector", "--clickhouse", proxy.url, "--clickhouse-ca", pki["ca"], "--database", traces_db,
                  "--tls-cert", server.cert, "--tls-key", server.key, *args)  # fmt: skip
    try:
        line = proc.stdout.readline().strip()
        assert " http=https://127.0.0.1:" in line, line
        grpc_endpoint = line.split("grpc=")[1].split()[0]
        credentials = grpc.ssl_channel_credentials(_pem(pki["ca"]))
        _send(GrpcExporter(endpoint=grpc_endpoint, credentials=credentials, timeout=5))
        assert wait_rows(ch_client, traces_db, 1) == 1
    finally:
        assert _stop(proc) == 0, proc.stderr.read()
        proxy.close()
    bad = _start("collector", "--clickhouse", proxy.url, "--tls-cert", server.cert, *args)
    assert bad.wait(30) == 1 and "--tls-cert and --tls-key go together" in bad.stderr.read()


def test_clickhouse_over_https_verifies_the_server(pki, clickhouse, ch_client, traces_db, tmp_path, monkeypatch):
    """The sink trusts only the CA it is given: with another CA the inserts fail and are retried,
    and the spans stay spooled (written once the right CA is used: nothing lost)."""
    proxy = TlsProxy(pki["server"], clickhouse.http_port)
    try:
        with connect(proxy.url, ca_cert=pki["ca"]) as client:
            assert client.command("SELECT 1") == 1
        monkeypatch.setenv("SSL_CERT_FILE", pki["ca"])  # the system trust store, as other commands use it
        with connect(proxy.url) as client:
            assert client.command("SELECT 2") == 2
        monkeypatch.delenv("SSL_CERT_FILE")
        c = Collector(proxy.url, database=traces_db, spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05,
                      clickhouse_ca=pki["other_ca"]).start()  # fmt: skip
        try:
            _send(HttpExporter(endpoint=f"{c.http_endpoint}/v1/traces", timeout=5))
            assert wait_rows(ch_client, traces_db, 1, timeout_s=1.0) == 0
            assert c.metrics.snapshot()["insert_retries"] >= 1
        finally:
            c.stop(drain_timeout_s=0.5)
        c = Collector(proxy.url, database=traces_db, spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05,
                      clickhouse_ca=pki["ca"]).start()  # fmt: skip
        try:
            assert wait_rows(ch_client, traces_db, 1) == 1  # the spooled span, replayed
        finally:
            c.stop()
    finally:
        proxy.close()


def _handshakes_failed(c, expected: int, timeout_s: float = 5.0) -> int:
    """The collector's failed-handshake count once it reaches `expected` (or the deadline): the
    connection's own thread counts it, after the client may already have seen its error (TLS 1.3
    reports a refused client certificate on the client's first read; CI once read 1 of 2)."""
    deadline = time.monotonic() + timeout_s
    while (n := c.metrics.snapshot()["tls_handshakes_failed"]) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return n
