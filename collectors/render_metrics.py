"""ExportMetricsServiceRequest bytes → rows of the five `otel_metrics_*` tables, one row per data
point, as the exporter renders them.

Per point: the metric's resource, scope, ServiceName (resource `service.name`), name, description,
unit; its Attributes (values as pdata's AsString); StartTimeUnix / TimeUnix (ns); Flags; Exemplars
(filtered attributes, time, value as Float64, hex span and trace ids). Gauge and sum: Value as Float64
(an int point converted); sum adds AggregationTemporality and IsMonotonic. Histogram: Count, Sum,
BucketCounts, ExplicitBounds, Min, Max (0 when absent, as pdata reads them). Exponential histogram:
Scale, ZeroCount, offsets and bucket counts of both sides. Summary: Count, Sum, ValueAtQuantiles.
A metric with no data (none of the five kinds) has no rows, as in the exporter.
Columns in signal_schema insert order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import Exemplar, Metric

from phaselens.collectors import rowbinary as rb
from phaselens.collectors.signal_rows import check_size, encode_map, hex_id, parse, service_name, string_attributes
from phaselens.collectors.signal_schema import EXPONENTIAL_HISTOGRAM, GAUGE, HISTOGRAM, SUM, SUMMARY

Point = Any  # NumberDataPoint | HistogramDataPoint | …: upb messages, one writer per kind


def render(payload: bytes) -> tuple[dict[str, bytes], int]:
    """One request → ({table: rows}, data point count). Raises InvalidPayload."""
    request = parse(ExportMetricsServiceRequest, payload)
    tables: dict[str, bytearray] = {}
    points = 0
    for rm in request.resource_metrics:
        resource = string_attributes(rm.resource.attributes)
        for sm in rm.scope_metrics:
            scope = bytearray()
            scope += encode_map(resource)
            rb.string(scope, rm.schema_url)
            rb.string(scope, sm.scope.name)
            rb.string(scope, sm.scope.version)
            scope += encode_map(string_attributes(sm.scope.attributes))
            rb.u32(scope, sm.scope.dropped_attributes_count)
            rb.string(scope, sm.schema_url)
            rb.string(scope, service_name(resource))
            for metric in sm.metrics:
                points += _metric(tables, bytes(scope), metric)
    for rows in tables.values():
        check_size(rows)
    return {table: bytes(rows) for table, rows in tables.items()}, points


def _metric(tables: dict[str, bytearray], scope: bytes, metric: Metric) -> int:
    kind = metric.WhichOneof("data")
    if kind not in _WRITERS:
        return 0
    table, write = _WRITERS[kind]
    data = getattr(metric, kind)
    head = bytearray(scope)
    for text in (metric.name, metric.description, metric.unit):
        rb.string(head, text)
    out = tables.setdefault(table, bytearray())
    for point in data.data_points:
        out += head
        out += encode_map(string_attributes(point.attributes))
        rb.datetime64_ns(out, point.start_time_unix_nano)
        rb.datetime64_ns(out, point.time_unix_nano)
        write(out, data, point)
    return len(data.data_points)


def _number(point: Point) -> float:
    return float(point.as_int) if point.WhichOneof("value") == "as_int" else point.as_double


def _exemplars(out: bytearray, exemplars: Iterable[Exemplar]) -> None:
    """Nested Exemplars: five parallel arrays."""
    items = list(exemplars)
    rb.uleb(out, len(items))
    for e in items:
        out += encode_map(string_attributes(e.filtered_attributes))
    rb.uleb(out, len(items))
    for e in items:
        rb.datetime64_ns(out, e.time_unix_nano)
    rb.f64_array(out, (_number(e) for e in items))
    for field, size in (("span_id", 8), ("trace_id", 16)):
        rb.uleb(out, len(items))
        for e in items:
            rb.string(out, hex_id(getattr(e, field), size, f"exemplar {field}"))


def _gauge(out: bytearray, data: Any, point: Point) -> None:
    rb.f64(out, _number(point))
    rb.u32(out, point.flags)
    _exemplars(out, point.exemplars)


def _sum(out: bytearray, data: Any, point: Point) -> None:
    _gauge(out, data, point)
    rb.i32(out, data.aggregation_temporality)
    rb.u8(out, 1 if data.is_monotonic else 0)


def _tail(out: bytearray, data: Any, point: Point) -> None:
    """Exemplars, Flags, Min, Max, AggregationTemporality: the end of both histogram rows."""
    _exemplars(out, point.exemplars)
    rb.u32(out, point.flags)
    rb.f64(out, point.min)
    rb.f64(out, point.max)
    rb.i32(out, data.aggregation_temporality)


def _histogram(out: bytearray, data: Any, point: Point) -> None:
    rb.u64(out, point.count)
    rb.f64(out, point.sum)
    rb.u64_array(out, point.bucket_counts)
    rb.f64_array(out, point.explicit_bounds)
    _tail(out, data, point)


def _exponential_histogram(out: bytearray, data: Any, point: Point) -> None:
    rb.u64(out, point.count)
    rb.f64(out, point.sum)
    rb.i32(out, point.scale)
    rb.u64(out, point.zero_count)
    for side in (point.positive, point.negative):
        rb.i32(out, side.offset)
        rb.u64_array(out, side.bucket_counts)
    _tail(out, data, point)


def _summary(out: bytearray, data: Any, point: Point) -> None:
    rb.u64(out, point.count)
    rb.f64(out, point.sum)
    rb.f64_array(out, (q.quantile for q in point.quantile_values))
    rb.f64_array(out, (q.value for q in point.quantile_values))
    rb.u32(out, point.flags)


_Writer = Callable[[bytearray, Any, Point], None]
_WRITERS: dict[str, tuple[str, _Writer]] = {
    "gauge": (GAUGE.name, _gauge),
    "sum": (SUM.name, _sum),
    "histogram": (HISTOGRAM.name, _histogram),
    "exponential_histogram": (EXPONENTIAL_HISTOGRAM.name, _exponential_histogram),
    "summary": (SUMMARY.name, _summary),
}
