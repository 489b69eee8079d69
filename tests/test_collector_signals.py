"""OTLP logs and metrics into `otel_logs` and `otel_metrics_*`: the SDK's exporters over gRPC and
HTTP, JSON and gzip bodies, bad input refused and counted, a SIGKILL between acknowledgement and
insert, and Rotel forwarding logs to our collector."""

from __future__ import annotations

import gzip
import json
import logging
import subprocess
import time

import grpc
import httpx
import pytest
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetricExporter
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetricExporter
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from phaselens.collectors import schema
from phaselens.collectors.rotel_agent import agent_path
from phaselens.common.process import LOOPBACK, free_port
from phaselens.faults.parts import wait_until
from phaselens.instrumentation import names
from tests.collector_fixtures import collector, killed_and_restarted, traces_db, wait_rows

LOGS_EXPORT = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"
METRICS_EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
_HTTP = httpx.Client(timeout=10)
TRACE_HEX, SPAN_HEX = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"


def _exporters(kind: str, collector, signal: str):
    if signal == "logs":
        if kind == "grpc":
            return GrpcLogExporter(endpoint=collector.grpc_endpoint, insecure=True)
        return HttpLogExporter(endpoint=f"{collector.http_endpoint}/v1/logs")
    if kind == "grpc":
        return GrpcMetricExporter(endpoint=collector.grpc_endpoint, insecure=True)
    return HttpMetricExporter(endpoint=f"{collector.http_endpoint}/v1/metrics")


def _query(ch_client, sql: str) -> list[dict]:
    return list(ch_client.query(sql).named_results())


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_sdk_metrics_land_with_their_values(kind, collector, ch_client, traces_db):
    reader = PeriodicExportingMetricReader(_exporters(kind, collector, "metrics"), export_interval_millis=600_000)
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "engine"}))
    meter = provider.get_meter("phaselens.test", "1.2")
    ttft = meter.create_histogram(
        names.METRIC_SERVER_TTFT, unit="s", explicit_bucket_boundaries_advisory=list(names.BUCKETS_TTFT_S)
    )
    for seconds in (0.003, 0.03, 0.03, 2.0):
        ttft.record(seconds, {"gen_ai.request.model": "tiny"})
    meter.create_counter("requests", unit="{request}").add(7, {"route": "/v1/chat"})
    meter.create_gauge("queue_depth").set(3, {"engine": "0"})
    provider.shutdown()  # the one export

    assert wait_rows(ch_client, traces_db, 1, table="otel_metrics_histogram") == 1
    (h,) = _query(ch_client, f"SELECT * FROM {traces_db}.otel_metrics_histogram")
    assert (h["MetricName"], h["MetricUnit"], h["ServiceName"]) == (names.METRIC_SERVER_TTFT, "s", "engine")
    assert (h["ScopeName"], h["ScopeVersion"], h["Attributes"]) == (
        "phaselens.test",
        "1.2",
        {"gen_ai.request.model": "tiny"},
    )
    assert h["Count"] == 4 and h["Sum"] == pytest.approx(2.063)
    assert (h["Min"], h["Max"]) == (pytest.approx(0.003), pytest.approx(2.0))
    assert h["ExplicitBounds"] == list(names.BUCKETS_TTFT_S)
    bounds = list(names.BUCKETS_TTFT_S)
    expected = [0] * (len(bounds) + 1)
    for seconds in (0.003, 0.03, 0.03, 2.0):
        expected[next((i for i, b in enumerate(bounds) if seconds <= b), len(bounds))] += 1
    assert h["BucketCounts"] == expected
    assert h["AggregationTemporality"] == 2  # cumulative
    (s,) = _query(ch_client, f"SELECT * FROM {traces_db}.otel_metrics_sum")
    assert (s["MetricName"], s["Value"], s["IsMonotonic"], s["Attributes"]) == (
        "requests",
        7.0,
        True,
        {"route": "/v1/chat"},
    )
    (g,) = _query(ch_client, f"SELECT * FROM {traces_db}.otel_metrics_gauge")
    assert (g["MetricName"], g["Value"], g["Attributes"]) == ("queue_depth", 3.0, {"engine": "0"})
    assert g["TimeUnix"].timestamp() == pytest.approx(time.time(), abs=120)
    # The writer counts a batch once its insert has returned: the rows can be visible a moment before.
    assert wait_until(lambda: collector.metrics.snapshot()["metric_points_written"] >= 3, 15) is not None
    snapshot = collector.metrics.snapshot()
    assert snapshot["metrics_requests_received"] == 1
    assert snapshot["metric_points_received"] == snapshot["metric_points_written"] == 3


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_sdk_logs_land_with_body_severity_attributes_and_ids(kind, collector, ch_client, traces_db):
    provider = LoggerProvider(resource=Resource.create({"service.name": "dynamo-worker"}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(_exporters(kind, collector, "logs")))
    logger = logging.getLogger(f"test_collector_signals.{kind}")
    logger.propagate = False
    logger.addHandler(LoggingHandler(logger_provider=provider))
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("request") as span:
        logger.warning("prefill took %d ms", 42, extra={"gen_ai.request.model": "tiny"})
        context = span.get_span_context()
    logger.error("no span here")
    provider.shutdown()

    assert wait_rows(ch_client, traces_db, 2, table="otel_logs") == 2
    first, second = _query(ch_client, f"SELECT * FROM {traces_db}.otel_logs ORDER BY Timestamp")
    assert (first["Body"], first["SeverityText"], first["SeverityNumber"]) == ("prefill took 42 ms", "WARN", 13)
    assert (first["TraceId"], first["SpanId"]) == (f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert first["TraceFlags"] == int(context.trace_flags) and first["ServiceName"] == "dynamo-worker"
    assert first["LogAttributes"]["gen_ai.request.model"] == "tiny"
    assert first["ResourceAttributes"]["service.name"] == "dynamo-worker"
    assert (second["Body"], second["SeverityNumber"], second["TraceId"], second["SpanId"]) == (
        "no span here",
        17,
        "",
        "",
    )
    assert first["TimestampTime"].timestamp() == pytest.approx(time.time(), abs=120)
    assert wait_until(lambda: collector.metrics.snapshot()["log_records_written"] >= 2, 15) is not None
    snapshot = collector.metrics.snapshot()
    assert snapshot["log_records_received"] == snapshot["log_records_written"] == 2


def _json_logs(trace_id: str = TRACE_HEX) -> dict:
    record = {
        "timeUnixNano": str(time.time_ns()),
        "severityNumber": "SEVERITY_NUMBER_INFO",
        "severityText": "INFO",
        "body": {"stringValue": "KV cache 91% used"},
        "attributes": [{"key": "traceId", "value": {"stringValue": "an attribute, not an id"}}],
        "traceId": trace_id,
        "spanId": SPAN_HEX,
    }
    return {
        "resourceLogs": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "vllm"}}]},
                "scopeLogs": [{"scope": {"name": "vllm.engine"}, "logRecords": [record]}],
            }
        ]
    }


def _summary_request() -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest()
    metric = request.resource_metrics.add().scope_metrics.add().metrics.add(name="latency_summary")
    point = metric.summary.data_points.add(count=10, sum=5.5, time_unix_nano=time.time_ns())
    point.quantile_values.add(quantile=0.5, value=0.4)
    point.quantile_values.add(quantile=0.99, value=1.2)
    exp = request.resource_metrics[0].scope_metrics[0].metrics.add(name="itl_exp")
    p = exp.exponential_histogram.data_points.add(
        count=3, sum=0.3, scale=2, zero_count=1, time_unix_nano=time.time_ns()
    )
    p.positive.offset, p.negative.offset = -1, 4
    p.positive.bucket_counts.extend([1, 1])
    return request


def _post(url: str, body: bytes, content_type: str, **headers: str) -> httpx.Response:
    return _HTTP.post(url, content=body, headers={"Content-Type": content_type, **headers})


def test_json_and_gzip_bodies_land(collector, ch_client, traces_db):
    logs_url, metrics_url = f"{collector.http_endpoint}/v1/logs", f"{collector.http_endpoint}/v1/metrics"
    r = _post(logs_url, json.dumps(_json_logs()).encode(), "application/json")
    assert (r.status_code, r.json()) == (200, {})
    gz = gzip.compress(_summary_request().SerializeToString())
    r = _post(metrics_url, gz, "application/x-protobuf", **{"Content-Encoding": "gzip"})
    assert (r.status_code, r.content) == (200, b"")  # an empty ExportMetricsServiceResponse
    assert wait_rows(ch_client, traces_db, 1, table="otel_logs") == 1
    (log,) = _query(ch_client, f"SELECT * FROM {traces_db}.otel_logs")
    assert (log["TraceId"], log["SpanId"], log["SeverityNumber"]) == (TRACE_HEX, SPAN_HEX, 9)
    assert (log["Body"], log["ServiceName"], log["ScopeName"]) == ("KV cache 91% used", "vllm", "vllm.engine")
    assert log["LogAttributes"] == {"traceId": "an attribute, not an id"}
    assert wait_rows(ch_client, traces_db, 1, table="otel_metrics_summary") == 1
    (s,) = _query(ch_client, f"SELECT * FROM {traces_db}.otel_metrics_summary")
    assert (s["Count"], s["Sum"]) == (10, 5.5)
    assert (s["ValueAtQuantiles.Quantile"], s["ValueAtQuantiles.Value"]) == ([0.5, 0.99], [0.4, 1.2])
    assert wait_rows(ch_client, traces_db, 1, table="otel_metrics_exponential_histogram") == 1
    (e,) = _query(ch_client, f"SELECT * FROM {traces_db}.otel_metrics_exponential_histogram")
    assert (e["Scale"], e["ZeroCount"], e["PositiveOffset"], e["PositiveBucketCounts"]) == (2, 1, -1, [1, 1])
    assert (e["NegativeOffset"], e["NegativeBucketCounts"]) == (4, [])


def test_bad_logs_and_metrics_are_refused_and_counted(collector, ch_client, traces_db):
    logs_url, metrics_url = f"{collector.http_endpoint}/v1/logs", f"{collector.http_endpoint}/v1/metrics"
    cases = [
        (logs_url, b"\x0a\xff", "application/x-protobuf", {}, 400),
        (logs_url, json.dumps(_json_logs("not-hex")).encode(), "application/json", {}, 400),
        (logs_url, b"{}", "text/plain", {}, 415),
        (logs_url, b"x" * (2 << 20), "application/x-protobuf", {}, 413),
        (metrics_url, b"\xff\xff", "application/x-protobuf", {}, 400),
        (metrics_url, b"[1, 2]", "application/json", {}, 400),
        (metrics_url, gzip.compress(b"\x00" * (2 << 20)), "application/x-protobuf", {"Content-Encoding": "gzip"}, 413),
    ]
    for url, body, content_type, headers, status in cases:
        r = _post(url, body, content_type, **headers)
        assert r.status_code == status, (url, content_type, r.text)
    bad_id = ExportLogsServiceRequest()
    bad_id.resource_logs.add().scope_logs.add().log_records.add(trace_id=b"\x01" * 5)
    with grpc.insecure_channel(collector.grpc_endpoint) as channel:
        for method, body, why in (
            (LOGS_EXPORT, bad_id.SerializeToString(), "trace_id must be 16 bytes"),
            (METRICS_EXPORT, b"\x0a\xff", "malformed ExportMetricsServiceRequest"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(method)(body, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
    snapshot = collector.metrics.snapshot()
    assert (snapshot["logs_requests_rejected"], snapshot["metrics_requests_rejected"]) == (5, 4)
    assert snapshot["requests_rejected"] == 0  # the spans' counter is the spans'
    assert snapshot["log_records_received"] == snapshot["metric_points_received"] == 0
    text = _HTTP.get(f"{collector.http_endpoint}/metrics").text
    assert "phaselens_collector_logs_requests_rejected_total 5" in text
    assert "phaselens_collector_metrics_requests_rejected_total 4" in text


def _logs_request(n: int, tag: str) -> bytes:
    request = ExportLogsServiceRequest()
    records = request.resource_logs.add().scope_logs.add().log_records
    for i in range(n):
        records.add(time_unix_nano=time.time_ns(), body={"string_value": f"{tag}-{i}"})
    return request.SerializeToString()


def _gauge_request(n: int, tag: str) -> bytes:
    request = ExportMetricsServiceRequest()
    metric = request.resource_metrics.add().scope_metrics.add().metrics.add(name=tag)
    for i in range(n):
        metric.gauge.data_points.add(as_int=i, time_unix_nano=time.time_ns())
    return request.SerializeToString()


def test_sigkill_after_acknowledging_then_restart_stores_each_row_once(clickhouse, ch_client, traces_db, tmp_path):
    """First batches inserted, the rest acknowledged and killed before (or while) they are
    inserted: after the restart every log record and point is there exactly once."""
    logs = [_logs_request(50, f"log{i}") for i in range(6)]
    gauges = [_gauge_request(40, f"gauge{i}") for i in range(6)]

    def before_kill(endpoints) -> None:
        with grpc.insecure_channel(endpoints.grpc) as channel:
            for i in range(6):
                channel.unary_unary(LOGS_EXPORT)(logs[i], timeout=10)
                channel.unary_unary(METRICS_EXPORT)(gauges[i], timeout=10)
                if i == 2:  # the first half is in ClickHouse before the kill
                    assert wait_rows(ch_client, traces_db, 150, table="otel_logs") == 150
                    assert wait_rows(ch_client, traces_db, 120, table="otel_metrics_gauge") == 120

    with killed_and_restarted(clickhouse.url, traces_db, str(tmp_path / "spool"), before_kill):
        assert wait_rows(ch_client, traces_db, 300, timeout_s=30, table="otel_logs") == 300
        assert wait_rows(ch_client, traces_db, 240, timeout_s=30, table="otel_metrics_gauge") == 240
    count, unique = ch_client.query(f"SELECT count(), uniqExact(Body) FROM {traces_db}.otel_logs").result_rows[0]
    assert (count, unique) == (300, 300)
    sql = f"SELECT count(), uniqExact(MetricName, Value) FROM {traces_db}.otel_metrics_gauge"
    assert ch_client.query(sql).result_rows[0] == (240, 240)


def test_the_schema_gives_the_signal_tables_the_traces_tables_options():
    sql = "\n".join(schema.statements("o", ttl="72h", cluster="c", table_engine="ReplicatedMergeTree"))
    for table in ("otel_logs", "otel_metrics_gauge", "otel_metrics_histogram", "otel_metrics_summary"):
        assert f'CREATE TABLE IF NOT EXISTS "o"."{table}" ON CLUSTER "c"' in sql
        assert f'"o"."{table}_distributed" ON CLUSTER "c" AS "o"."{table}"' in sql
    assert "TTL TimestampTime + toIntervalDay(3)" in sql and "TTL toDateTime(TimeUnix) + toIntervalDay(3)" in sql
    assert sql.count("ENGINE = ReplicatedMergeTree()") == 7  # traces and the six signal tables


def test_rotel_forwards_logs_and_metrics_to_our_collector(collector, ch_client, traces_db, tmp_path):
    grpc_port, http_port = free_port(LOOPBACK), free_port(LOOPBACK)
    argv = [agent_path(), "start", "--otlp-grpc-endpoint", f"{LOOPBACK}:{grpc_port}"]
    argv += ["--otlp-http-endpoint", f"{LOOPBACK}:{http_port}", "--exporter", "otlp"]
    argv += ["--otlp-exporter-endpoint", f"http://{collector.grpc_endpoint}", "--disable-batching"]
    with open(tmp_path / "rotel.log", "wb") as log:
        rotel = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        with grpc.insecure_channel(f"{LOOPBACK}:{grpc_port}") as channel:
            while True:  # bounded: rotel answers once its receiver is up
                try:
                    channel.unary_unary(LOGS_EXPORT)(_logs_request(5, "via-rotel"), timeout=2)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, (tmp_path / "rotel.log").read_text()
                    time.sleep(0.2)
            channel.unary_unary(METRICS_EXPORT)(_gauge_request(3, "via-rotel"), timeout=5)
        assert wait_rows(ch_client, traces_db, 5, timeout_s=20, table="otel_logs") == 5, (
            tmp_path / "rotel.log"
        ).read_text()
        assert wait_rows(ch_client, traces_db, 3, timeout_s=20, table="otel_metrics_gauge") == 3
    finally:
        rotel.terminate()
        rotel.wait(10)
    bodies = ch_client.query(f"SELECT Body FROM {traces_db}.otel_logs ORDER BY Body").result_columns[0]
    assert bodies == [f"via-rotel-{i}" for i in range(5)]
