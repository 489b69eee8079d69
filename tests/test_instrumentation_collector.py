"""End to end: ServerTelemetry → the real OTLP gRPC exporter (configured from OTEL_* env) → the
phaselens collector → the embedded ClickHouse; the rows say what the spans said."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from phaselens.collectors import schema
from phaselens.collectors.service import Collector
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from tests.instrumentation_fixtures import PARENT_ID, TRACE_ID, WALL_BASE_NS, ScriptedClock, script_request


@pytest.fixture()
def collector(clickhouse, ch_client, fresh_database, tmp_path):
    schema.apply(ch_client, schema.statements(fresh_database))
    with Collector(
        clickhouse.url, database=fresh_database, spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05
    ) as running:
        yield running, fresh_database


def query_rows(ch_client, database: str, want: int, timeout_s: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = list(ch_client.query(f"SELECT * FROM {database}.otel_traces").named_results())
        if len(rows) >= want:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"{len(rows)} of {want} rows arrived")


@pytest.mark.parametrize("builder", ["thread", "process"])
def test_spans_arrive_in_clickhouse_over_otlp_grpc(collector, ch_client, monkeypatch, builder):
    running, database = collector
    monkeypatch.setenv(names.ENV_SPAN_BUILDER, builder)
    for variable, value in {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{running.grpc_endpoint}",
    }.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    clock = ScriptedClock()
    telemetry = ServerTelemetry.from_env(
        "phaselens-e2e", clock_ns=clock, anchor=ClockAnchor.capture(clock, lambda: WALL_BASE_NS)
    )
    script_request(SimpleNamespace(telemetry=telemetry, clock=clock))
    telemetry.shutdown()
    assert telemetry.stats().export_exported == 13
    rows = {row["SpanName"]: row for row in query_rows(ch_client, database, want=12)}
    root = rows["text_completion tiny"]
    assert (root["TraceId"], root["ParentSpanId"], root["SpanKind"]) == (TRACE_ID, PARENT_ID, "Server")
    assert root["ServiceName"] == "phaselens-e2e" and root["Duration"] == 990_000
    attributes = root["SpanAttributes"]
    assert attributes[names.PL_SERVER_TTFT_MS] == "0.72" and attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == "7"
    assert rows[names.SPAN_DECODE]["Duration"] == 250_000
    assert rows[names.SPAN_DECODE]["ParentSpanId"] == root["SpanId"]
    step = rows[names.SPAN_ENGINE_STEP]
    assert step["ParentSpanId"] == "" and step["Links.SpanId"] == [root["SpanId"]]
