"""phaselens's own histogram aggregation (`histograms`, where it owns the MeterProvider) against the
SDK's instruments: the same measurements give the same exported points, value for value, with
either temporality, over several collections, past the cardinality limit, through the real
GenAiServerMetrics and the real span-builder configuration."""

from __future__ import annotations

import math
import random

import pytest
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from phaselens.instrumentation import names
from phaselens.instrumentation.pipeline import otel_setup
from phaselens.instrumentation.pipeline.genai_metrics import HISTOGRAMS, GenAiServerMetrics, SdkHistograms
from phaselens.instrumentation.pipeline.histograms import HistogramReader, OwnedHistograms
from phaselens.instrumentation.pipeline.phases import compute_phases
from tests.instrumentation_fixtures import OtlpReceiver
from tests.test_otlp_fast import scripted_records

RESOURCE = Resource({"service.name": "histograms-test"})
NEVER_MS = 3_600_000  # no periodic export: the test collects


class Kept(MetricExporter):
    """Keeps every MetricsData it is given."""

    def __init__(self, temporality: AggregationTemporality) -> None:
        super().__init__(preferred_temporality={Histogram: temporality})
        self.exports: list[MetricsData] = []

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        return None


def sdk_and_owned(temporality: AggregationTemporality, limit: int = 2000):
    """(SDK reader, its exporter, meter), (owned reader, its exporter, provider): the same options."""
    options = {"export_interval_millis": NEVER_MS, "cardinality_limits": {Histogram: limit}}
    sdk_kept, owned_kept = Kept(temporality), Kept(temporality)
    sdk_reader = PeriodicExportingMetricReader(sdk_kept, **options)
    owned_reader = HistogramReader(owned_kept, RESOURCE, InstrumentationScope(names.SERVER_SCOPE), **options)
    sdk_provider = MeterProvider(resource=RESOURCE, metric_readers=[sdk_reader])
    owned_provider = MeterProvider(resource=RESOURCE, metric_readers=[owned_reader])
    return (sdk_reader, sdk_kept, sdk_provider), (owned_reader, owned_kept, owned_provider)


def points(export: MetricsData) -> dict:
    """{(scope, metric, attributes): point values}; timestamps apart (each path reads its own clock)."""
    found = {}
    for resource_metrics in export.resource_metrics:
        assert resource_metrics.resource == RESOURCE
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for p in metric.data.data_points:
                    assert 0 < p.start_time_unix_nano <= p.time_unix_nano
                    key = (
                        scope_metrics.scope,
                        metric.name,
                        metric.unit,
                        metric.description,
                        tuple(p.attributes.items()),
                    )
                    temporality = getattr(metric.data, "aggregation_temporality", None)
                    if not hasattr(p, "bucket_counts"):  # the drop counter
                        found[key] = (temporality, p.value)
                        continue
                    values = (p.count, p.sum, type(p.sum), p.bucket_counts, tuple(p.explicit_bounds), p.min, p.max)
                    found[key] = (temporality, *values, list(p.exemplars))
    return found


def assert_same_exports(sdk_kept: Kept, owned_kept: Kept, collections: int) -> None:
    assert len(sdk_kept.exports) == len(owned_kept.exports) == collections
    for sdk_export, owned_export in zip(sdk_kept.exports, owned_kept.exports, strict=True):
        assert points(owned_export) == points(sdk_export)


MEASUREMENTS = [  # (ttft, tpot, duration), attributes; the duration's with error.type when the last is given
    *[
        ((rng.uniform(0, 12), rng.uniform(0, 0.3), rng.uniform(0, 200)), {"model": "a"}, None)
        for rng in [random.Random(7)] * 3
    ],
    ((0, None, 0), {"model": "a"}, None),  # ints: the sum stays an int until a float joins
    ((0.1, 0.1, 0.1), {"model": "a"}, None),  # exactly a bound: the bucket it closes
    ((10, None, 25.5), {"model": "b", "port": 8000}, "500"),  # over the last bound
    ((None, None, 500.0), {"model": "b", "port": 8000}, "timeout"),
    ((-1.0, math.inf, math.nan), {"model": "a"}, None),  # ignored, as the SDK ignores them
]


def record_both(sdk: SdkHistograms, owned: OwnedHistograms, values, attributes: dict, failure) -> None:
    duration_attributes = {**attributes, "error.type": failure} if failure else attributes
    sdk.record(values, attributes, duration_attributes)
    owned.record(values, attributes, duration_attributes)


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
def test_owned_histograms_export_the_sdks_points(temporality) -> None:
    (sdk_reader, sdk_kept, sdk_provider), (owned_reader, owned_kept, _) = sdk_and_owned(temporality)
    sdk = SdkHistograms(sdk_provider.get_meter(names.SERVER_SCOPE))
    owned = OwnedHistograms([owned_reader], HISTOGRAMS)
    rng = random.Random(23)
    generated = [((rng.expovariate(2), rng.expovariate(40), rng.expovariate(0.1)), {"m": rng.choice("ab")}, None)]
    rounds = [MEASUREMENTS, [], generated * 300]
    for measurements in rounds:  # the second interval records nothing: cumulative repeats, delta omits
        for values, attributes, failure in measurements:
            record_both(sdk, owned, values, attributes, failure)
        sdk_reader.collect()
        owned_reader.collect()
    expected = 3 if temporality is AggregationTemporality.CUMULATIVE else 2  # delta: nothing to export once
    assert_same_exports(sdk_kept, owned_kept, expected)
    assert len(points(owned_kept.exports[-1])) >= 3  # something was compared


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
def test_owned_histograms_overflow_as_the_sdk_does(temporality) -> None:
    (sdk_reader, sdk_kept, sdk_provider), (owned_reader, owned_kept, _) = sdk_and_owned(temporality, limit=3)
    sdk = SdkHistograms(sdk_provider.get_meter(names.SERVER_SCOPE))
    owned = OwnedHistograms([owned_reader], HISTOGRAMS)
    for interval in range(2):
        for index in range(6):
            record_both(sdk, owned, (index / 10, index / 100, index), {"set": (index + interval) % 6}, None)
        sdk_reader.collect()
        owned_reader.collect()
    assert_same_exports(sdk_kept, owned_kept, 2)
    overflow = [k for k in points(owned_kept.exports[0]) if k[-1] == (("otel.metric.overflow", True),)]
    assert len(overflow) == 3  # one per histogram


@pytest.mark.parametrize("temporality", [AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA])
def test_genai_metrics_same_points_owned_or_sdk(temporality) -> None:
    """The builder's records (a traced request, a failed one) through GenAiServerMetrics both ways,
    with the drop counter in the same scope as the owned histograms."""
    records = [r for r in scripted_records() if hasattr(r, "http")]
    (sdk_reader, sdk_kept, sdk_provider), (owned_reader, owned_kept, owned_provider) = sdk_and_owned(temporality)
    drops = {"queue_full": 3}
    sdk_metrics = GenAiServerMetrics(sdk_provider, lambda: drops)
    owned_metrics = GenAiServerMetrics(owned_provider, lambda: drops, [owned_reader])
    for _ in range(2):
        for record in records:
            sdk_metrics.record(record, compute_phases(record))
            owned_metrics.record(record, compute_phases(record))
        sdk_reader.collect()
        owned_reader.collect()
    assert_same_exports(sdk_kept, owned_kept, 2)
    names_seen = {key[1] for key in points(owned_kept.exports[-1])}
    assert names_seen == {
        names.METRIC_SERVER_TTFT,
        names.METRIC_SERVER_TPOT,
        names.METRIC_SERVER_REQUEST_DURATION,
        names.METRIC_TELEMETRY_DROPPED,
    }
    scopes = list(owned_kept.exports[-1].resource_metrics[0].scope_metrics)
    assert [s.scope.name for s in scopes] == [names.SERVER_SCOPE]  # one scope: the counter's and the histograms'


def test_span_builder_configuration_owns_the_histograms(monkeypatch) -> None:
    """configure(encoded_spans=True) (the span-builder process) aggregates the histograms itself;
    PHASELENS_SPAN_BACKEND=sdk, or a preference for exponential histograms, keeps the SDK's."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    owned = otel_setup.configure("svc", set_global=False, encoded_spans=True)
    assert owned.histogram_readers is not None and len(owned.histogram_readers) == 1
    assert otel_setup.configure("svc", set_global=False).histogram_readers is None  # a provider for others
    monkeypatch.setenv(names.ENV_SPAN_BACKEND, names.SPAN_BACKEND_SDK)
    assert otel_setup.configure("svc", set_global=False, encoded_spans=True).histogram_readers is None
    monkeypatch.setenv(names.ENV_SPAN_BACKEND, names.SPAN_BACKEND_FAST)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")  # the default: its exporters prefer explicit buckets
    for protocol in ("http/protobuf", "grpc"):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        otlp = otel_setup.configure("svc", set_global=False, encoded_spans=True)
        assert otlp.histogram_readers is not None and len(otlp.histogram_readers) == 1, protocol
        otlp.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "base2_exponential_bucket_histogram")
    assert otel_setup.configure("svc", set_global=False, encoded_spans=True).histogram_readers is None
    for providers in (owned,):
        providers.shutdown()


def test_metrics_off_the_builder_records_nothing(monkeypatch) -> None:
    """OTEL_METRICS_EXPORTER=none in the span-builder process: owned histograms with no reader, so
    `record` returns before reading the request (a record it cannot read passes); with a reader it reads it."""
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    providers = otel_setup.configure("svc", set_global=False, encoded_spans=True)
    assert providers.histogram_readers == []
    GenAiServerMetrics(providers.meter_provider, dict, providers.histogram_readers).record(None, None)  # type: ignore[arg-type]
    scope = InstrumentationScope(names.SERVER_SCOPE)
    reader = HistogramReader(Kept(AggregationTemporality.CUMULATIVE), RESOURCE, scope, export_interval_millis=NEVER_MS)
    with pytest.raises(AttributeError):
        GenAiServerMetrics(MeterProvider(metric_readers=[reader]), dict, [reader]).record(None, None)  # type: ignore[arg-type]
    providers.shutdown()


def test_span_builder_histograms_reach_an_otlp_receiver(monkeypatch) -> None:
    """The owned histograms through the real OTLP/HTTP metric exporter: one request, the counter's
    scope, each histogram's count, sum and buckets as recorded."""
    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    providers = otel_setup.configure("svc", set_global=False, encoded_spans=True)
    assert providers.histogram_readers is not None  # phaselens's own, not the SDK's instruments
    metrics = GenAiServerMetrics(providers.meter_provider, lambda: {"queue_full": 2}, providers.histogram_readers)
    records = [r for r in scripted_records() if hasattr(r, "http")]
    for record in records:
        metrics.record(record, compute_phases(record))
    providers.meter_provider.force_flush()
    providers.shutdown()
    receiver.close()
    exported = {
        m.name: m
        for request in receiver.metrics[:1]
        for rm in request.resource_metrics
        for sm in rm.scope_metrics
        if sm.scope.name == names.SERVER_SCOPE
        for m in sm.metrics
    }
    assert set(exported) >= {names.METRIC_SERVER_REQUEST_DURATION, names.METRIC_TELEMETRY_DROPPED}
    durations = exported[names.METRIC_SERVER_REQUEST_DURATION].histogram.data_points
    expected = sorted(compute_phases(r).e2e_ns / 1e9 for r in records)
    assert sorted(p.sum for p in durations) == expected  # one request per attribute set
    assert all(sum(p.bucket_counts) == p.count == 1 for p in durations)
    assert all(list(p.explicit_bounds) == list(names.BUCKETS_DURATION_S) for p in durations)
