"""`phaselens serve` over HTTPS, `phaselens bench --ca-cert` against it, and both exporting their
spans over TLS (the standard OTEL_EXPORTER_OTLP_CERTIFICATE) into a collector that serves TLS:
every hop of the pipeline encrypted, with a CA made in the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from phaselens.collectors.service import Collector
from phaselens.common.tls import ServerTls
from tests.collector_fixtures import traces_db, wait_rows
from tests.tls_fixtures import Authority

REQUESTS = 3
__all__ = ["traces_db"]  # a fixture, used by name


def _env(collector: Collector, ca: str, service: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}
    return env | {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://{collector.grpc_endpoint}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": ca,
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }


def test_serve_and_bench_over_https_export_over_tls(clickhouse, ch_client, traces_db, tmp_path):
    authority = Authority(tmp_path, "serve")
    cert = authority.issue("server")
    ca = authority.ca.cert
    collector = Collector(clickhouse.url, database=traces_db, spool_dir=str(tmp_path / "spool"),
                          flush_interval_s=0.05, tls=ServerTls(cert.cert, cert.key)).start()  # fmt: skip
    serve = subprocess.Popen(
        [sys.executable, "-m", "phaselens", "serve", "--port", "0", "--tls-cert", cert.cert, "--tls-key", cert.key],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(collector, ca, "tls-server"),
    )
    try:
        line = serve.stdout.readline()
        assert line.startswith("READY server https://127.0.0.1:"), (line, serve.poll() and serve.stderr.read())
        url = line.split()[-1]
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/v1/models", verify=True)  # the system's trust store does not know our CA
        out = tmp_path / "bench.json"
        bench = subprocess.run(
            [sys.executable, "-m", "phaselens", "bench", "--url", url, "--model", "tiny", "--ca-cert", ca,
             "--requests", str(REQUESTS), "--output-len", "4", "--quiet", "--json", str(out)],
            check=False, env=_env(collector, ca, "tls-bench"), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr[-2000:]
        requests = json.loads(out.read_text())["summary"]["requests"]
        assert (requests["completed"], requests["failed"]) == (REQUESTS, 0)
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
        drained = collector.stop()
    assert drained and collector.metrics.snapshot()["spans_dropped"] == 0
    services = dict(
        ch_client.query(
            f"SELECT ServiceName, countIf(SpanKind = 'Server' OR SpanKind = 'Client') FROM {traces_db}.otel_traces "
            "GROUP BY ServiceName"
        ).result_rows
    )
    assert wait_rows(ch_client, traces_db, 1) > 0
    assert services.get("tls-bench") == REQUESTS and services.get("tls-server", 0) >= REQUESTS
