"""OTLP metrics exports: accepted and counted (requests and data points), not stored.

SDKs configured with OTEL_METRICS_EXPORTER=otlp point at the same endpoint as traces; answering
them keeps their logs clean, and the counters at /metrics say exactly how much was not kept."""

from __future__ import annotations

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from phaselens.collectors.metrics import CollectorMetrics

EMPTY_RESPONSE = ExportMetricsServiceResponse().SerializeToString()
_DATA_KINDS = ("gauge", "sum", "histogram", "exponential_histogram", "summary")


class InvalidMetrics(ValueError):
    pass


def count_points(request: ExportMetricsServiceRequest) -> int:
    points = 0
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                kind = metric.WhichOneof("data")
                if kind in _DATA_KINDS:
                    points += len(getattr(metric, kind).data_points)
    return points


def accept_metrics(payload: bytes, metrics: CollectorMetrics) -> int:
    """Parses an ExportMetricsServiceRequest and counts it; returns its data point count."""
    try:
        request = ExportMetricsServiceRequest.FromString(payload)
    except Exception as exc:  # noqa: BLE001 — upb DecodeError and friends
        raise InvalidMetrics(f"malformed ExportMetricsServiceRequest: {exc}") from None
    points = count_points(request)
    metrics.add("metrics_requests_received")
    metrics.add("metric_points_not_stored", points)
    return points
