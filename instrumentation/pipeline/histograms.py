"""Explicit-bucket histograms aggregated by phaselens itself, exported through the SDK's readers.

The SDK has no bound instruments: each `Histogram.record` builds a Measurement, consults the
exemplar filter, copies and hashes the attributes and takes two locks (~40k instructions; ~85k with
a metric reader), three times a request. Where phaselens owns the MeterProvider (`otel_setup.configure`
with `owned_histograms`; `PHASELENS_SPAN_BACKEND=sdk` keeps the SDK instruments, as a provider the
user brought does), each reader `configure` makes is a `HistogramReader` and a record costs a tuple
key, a bisect and a few additions per reader. At each collection the reader adds the points to what
the SDK collected (the drop counter), so one export carries both, through the same exporter,
interval and temporality.

The points are the SDK's, value for value (tests/test_histograms.py compares both): per attribute
set, per collection interval, bucket i counts values v with bounds[i-1] < v ≤ bounds[i]
(`bisect_left`), sum = Σ v added in record order starting from 0, min and max; non-finite and
negative values are ignored as the SDK ignores them (with its warning). Cumulative temporality: the
interval is added to the running totals (counts element-wise, sum = interval sum + previous sum,
min/max of both), start = the set's first record, and every set is reported at every collection.
Delta: the interval's own totals, for the sets recorded since the last collection, start = the
last collection (the first record before any). At most the reader's cardinality limit of sets
(per interval with delta); later sets go to the `otel.metric.overflow` set, as in the SDK.
"""

from __future__ import annotations

import logging
import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any, cast

from opentelemetry.sdk.metrics._internal.instrument import _Histogram
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricsData,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import DefaultAggregation, ExplicitBucketHistogramAggregation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from phaselens.common.clocks import WallTs, wall_clock_ts

_logger = logging.getLogger(__name__)

_INF = math.inf
_OVERFLOW: tuple[tuple[str, Any], ...] = (("otel.metric.overflow", True),)
Key = tuple[tuple[str, Any], ...]  # an attribute set: tuple(attributes.items())


class _Point:
    """One attribute set's interval (counts, sum, min, max) and, for cumulative, its running totals."""

    __slots__ = ("attributes", "counts", "max", "min", "start_ts", "sum", "total")

    def __init__(self, attributes: dict[str, Any], buckets: int, start_ts: WallTs) -> None:
        self.attributes, self.start_ts = attributes, start_ts
        self.counts, self.min, self.max = [0] * buckets, math.inf, -math.inf
        self.sum: float = 0  # the SDK's start, int 0
        self.total: tuple[list[int], float, float, float] | None = None  # cumulative: counts, sum, min, max


class HistogramStream:
    """One histogram instrument as one reader sees it (its temporality and cardinality limit)."""

    __slots__ = ("bounds", "delta", "description", "last_collect_ts", "limit", "name", "points", "unit")

    def __init__(self, name: str, unit: str, description: str, bounds: Sequence[float], delta: bool, limit: int):
        self.name, self.unit, self.description = name, unit, description
        self.bounds, self.delta, self.limit = tuple(bounds), delta, limit
        self.points: dict[Key, _Point] = {}
        self.last_collect_ts: WallTs | None = None  # delta: the start of every set made after a collection

    def record(self, value: float, key: Key, attributes: dict[str, Any]) -> None:
        """Caller holds the reader's lock."""
        point = self.points.get(key)
        if point is None:
            point = self._new_point(key, attributes)
        point.sum += value
        if value < point.min:
            point.min = value
        if value > point.max:
            point.max = value
        point.counts[bisect_left(self.bounds, value)] += 1

    def _new_point(self, key: Key, attributes: dict[str, Any]) -> _Point:
        if len(self.points) >= self.limit:
            key, attributes = _OVERFLOW, dict(_OVERFLOW)
            if key in self.points:
                return self.points[key]
        start_ts = self.last_collect_ts if self.delta and self.last_collect_ts is not None else wall_clock_ts()
        point = self.points[key] = _Point(dict(attributes), len(self.bounds) + 1, start_ts)
        return point

    def collect(self, now_ts: WallTs) -> Metric | None:
        """This interval's points (delta), or the running totals (cumulative); caller holds the lock."""
        if self.delta:
            points, self.points, self.last_collect_ts = self.points, {}, now_ts
            data = [self._data_point(p, p.counts, p.sum, p.min, p.max, now_ts) for p in points.values()]
        else:
            data = [self._cumulative(point, now_ts) for point in self.points.values()]
        if not data:
            return None
        temporality = AggregationTemporality.DELTA if self.delta else AggregationTemporality.CUMULATIVE
        return Metric(self.name, self.description, self.unit, Histogram(data, temporality))

    def _cumulative(self, point: _Point, now_ts: WallTs) -> HistogramDataPoint:
        counts, total_sum, total_min, total_max = point.total or ([0] * len(point.counts), 0, math.inf, -math.inf)
        counts = [a + b for a, b in zip(point.counts, counts, strict=True)]
        point.total = (counts, point.sum + total_sum, min(point.min, total_min), max(point.max, total_max))
        point.counts, point.sum, point.min, point.max = [0] * len(counts), 0, math.inf, -math.inf
        return self._data_point(point, *point.total, now_ts)

    def _data_point(
        self, point: _Point, counts: list[int], total: float, low: float, high: float, now_ts: WallTs
    ) -> HistogramDataPoint:
        return HistogramDataPoint(
            attributes=point.attributes,
            start_time_unix_nano=point.start_ts,
            time_unix_nano=now_ts,
            count=sum(counts),
            sum=total,
            bucket_counts=tuple(counts),
            explicit_bounds=self.bounds,
            min=low,
            max=high,
        )


class HistogramReader(PeriodicExportingMetricReader):
    """The SDK's periodic reader, each collection extended with this reader's `HistogramStream`s."""

    def __init__(
        self, exporter: MetricExporter, resource: Resource, scope: InstrumentationScope, **reader_options: Any
    ) -> None:
        super().__init__(exporter, **reader_options)
        self.resource, self.scope = resource, scope
        self.schema_url = cast("str", scope.schema_url)  # None for a scope without one, as the SDK passes it
        self.streams: list[HistogramStream] = []
        self.lock = threading.Lock()

    def stream(self, name: str, unit: str, description: str, bounds: Sequence[float]) -> HistogramStream:
        temporality = self._instrument_class_temporality[_Histogram]
        limit = self._instrument_class_cardinality_limit[_Histogram]
        stream = HistogramStream(name, unit, description, bounds, temporality is AggregationTemporality.DELTA, limit)
        self.streams.append(stream)
        return stream

    def _set_collect_callback(self, func: Callable[..., MetricsData | None] | None) -> None:  # type: ignore[misc]
        """The provider's collect, then this reader's histograms added to its scope (the only
        hook that runs when the SDK has collected nothing: it then returns None)."""

        def collect(reader: Any, timeout_millis: float = 10_000) -> MetricsData | None:
            return self._with_histograms(func(reader, timeout_millis=timeout_millis) if func else None)

        super()._set_collect_callback(cast("Any", collect) if func is not None else None)

    def _with_histograms(self, collected: MetricsData | None) -> MetricsData | None:
        with self.lock:
            now_ts = wall_clock_ts()
            metrics = [m for m in (s.collect(now_ts) for s in self.streams) if m is not None]
        if not metrics:
            return collected
        resource_metrics = list(collected.resource_metrics) if collected else []
        if not resource_metrics:
            resource_metrics = [ResourceMetrics(self.resource, [], self.resource.schema_url)]
        first = resource_metrics[0]
        scopes = list(first.scope_metrics)
        mine = next((i for i, s in enumerate(scopes) if s.scope == self.scope), None)
        if mine is None:
            scopes.append(ScopeMetrics(self.scope, metrics, self.schema_url))
        else:
            scopes[mine] = ScopeMetrics(self.scope, [*scopes[mine].metrics, *metrics], self.schema_url)
        resource_metrics[0] = ResourceMetrics(first.resource, scopes, first.schema_url)
        return MetricsData(resource_metrics)


def _default_buckets(aggregation: Any) -> bool:
    """The default aggregation, or what the OTLP exporters prefer for histograms unless told
    otherwise (`ExplicitBucketHistogramAggregation()`: the instrument's advisory bounds, min and max),
    which aggregates the same."""
    if isinstance(aggregation, ExplicitBucketHistogramAggregation):
        return aggregation._boundaries is None and aggregation._record_min_max
    return isinstance(aggregation, DefaultAggregation)


def histogram_readers_usable(readers: Sequence[Any]) -> bool:
    """Only readers whose histograms take the default explicit-bucket aggregation: a preference for
    exponential histograms (OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION) or other bounds
    keeps the SDK."""
    return all(
        isinstance(r, HistogramReader) and _default_buckets(r._instrument_class_aggregation[_Histogram])
        for r in readers
    )


def _ignored(value: float, name: str) -> None:
    """The SDK Histogram's warning for a value it ignores (non-finite or negative: not 0 <= value < inf)."""
    _logger.warning("Record amount %s is not finite or negative on Histogram %s, ignoring measurement.", value, name)


RequestValues = tuple[float | None, float | None, float]  # a request's TTFT, TPOT (None: not recorded), duration


class OwnedHistograms:
    """The GenAI histograms of one request, the SDK Histogram's `record` for each, into each
    reader's streams: one key and one lock a request (the SDK: a key and two locks a value)."""

    __slots__ = ("names", "readers")

    def __init__(
        self, readers: Sequence[HistogramReader], instruments: Sequence[tuple[str, str, str, Sequence[float]]]
    ):
        self.names = [name for name, *_ in instruments]
        self.readers = [(reader.lock, [reader.stream(*instrument) for instrument in instruments]) for reader in readers]

    def record(self, values: RequestValues, attributes: dict[str, Any], duration_attributes: dict[str, Any]) -> None:
        """TTFT and TPOT under `attributes`, the duration under `duration_attributes`."""
        ttft, tpot = values[0], values[1]
        duration: float | None = values[2]
        if ttft is not None and not 0 <= ttft < _INF:  # inline: no call for a valid value (three a request)
            _ignored(ttft, self.names[0])
            ttft = None
        if tpot is not None and not 0 <= tpot < _INF:
            _ignored(tpot, self.names[1])
            tpot = None
        if not 0 <= values[2] < _INF:
            _ignored(values[2], self.names[2])
            duration = None
        key = tuple(attributes.items())
        duration_key = key if duration_attributes is attributes else tuple(duration_attributes.items())
        for lock, (ttft_stream, tpot_stream, duration_stream) in self.readers:
            with lock:
                if ttft is not None:
                    ttft_stream.record(ttft, key, attributes)
                if tpot is not None:
                    tpot_stream.record(tpot, key, attributes)
                if duration is not None:
                    duration_stream.record(duration, duration_key, duration_attributes)
