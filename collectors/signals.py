"""The three OTLP signals the collector takes, and what differs between them: the request type,
its gRPC service and HTTP path, how a request is validated and counted, its rows, its spool folder
and its counters' names. Everything else (spool, writer, answers to bad input) is one code path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from phaselens.collectors import render, render_logs, render_metrics
from phaselens.collectors.signal_rows import InvalidPayload
from phaselens.collectors.signal_schema import LOGS as LOGS_TABLE
from phaselens.collectors.signal_schema import METRIC_TABLES, SignalTable

# what a renderer raises for a request that is not valid OTLP
INVALID = (render.InvalidSpans, InvalidPayload)


@dataclass(frozen=True, slots=True)
class Signal:
    name: str  # traces | logs | metrics
    request_type: type[Message]
    response: bytes  # the empty Export…ServiceResponse
    grpc_service: str
    count: Callable[[bytes], int]  # validates the request (raises INVALID); returns its items
    item: str  # counter names: <item>_received, _written, _quarantined
    counter_prefix: str  # counter names: <prefix>requests_received, …
    spool_subdir: str  # under the collector's spool directory ('' : the directory itself)
    tables: tuple[SignalTable, ...] = ()  # logs and metrics; spans go through render.py's own path
    rows: Callable[[bytes], tuple[dict[str, bytes], int]] | None = None  # ({table: RowBinary}, items)

    @property
    def http_path(self) -> str:
        return f"/v1/{self.name}"

    def counter(self, name: str) -> str:
        """`requests_received` → this signal's counter (`logs_requests_received`, …)."""
        return f"{self.counter_prefix}{name}"


TRACES = Signal(
    "traces",
    ExportTraceServiceRequest,
    ExportTraceServiceResponse().SerializeToString(),
    "opentelemetry.proto.collector.trace.v1.TraceService",
    render.count_spans,
    "spans",
    "",
    "",
)
LOGS = Signal(
    "logs",
    ExportLogsServiceRequest,
    ExportLogsServiceResponse().SerializeToString(),
    "opentelemetry.proto.collector.logs.v1.LogsService",
    lambda payload: render_logs.render(payload)[1],
    "log_records",
    "logs_",
    "logs",
    (LOGS_TABLE,),
    render_logs.render,
)
METRICS = Signal(
    "metrics",
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse().SerializeToString(),
    "opentelemetry.proto.collector.metrics.v1.MetricsService",
    lambda payload: render_metrics.render(payload)[1],
    "metric_points",
    "metrics_",
    "metrics",
    tuple(METRIC_TABLES.values()),
    render_metrics.render,
)
SIGNALS = (TRACES, LOGS, METRICS)
