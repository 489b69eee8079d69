"""OpenTelemetry providers from the standard OTEL_* environment, with every loss counted.

Honoured: OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG) (default
parentbased_always_on: one decision per request, taken at its root and kept by all its spans),
OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER (otlp | console | none; comma lists allowed; default
otlp), OTEL_EXPORTER_OTLP_(TRACES_|METRICS_)PROTOCOL (grpc | http/protobuf; default http/protobuf,
as the specification says), OTEL_EXPORTER_OTLP_(TRACES_|METRICS_)ENDPOINT, _HEADERS, _TIMEOUT (read
by the exporters themselves), OTEL_BSP_* (queue size, batch size, delay) and OTEL_METRIC_EXPORT_INTERVAL.

Spans leave through `span_processor.CountingBatchSpanProcessor` (bounded queue, exporting on its
own thread, so a slow or dead collector never blocks the caller) which counts spans refused because
its queue was full and spans whose export failed; `export_counters(tracer_provider)` reads them.
With `configure(encoded_spans=True)` (the span-builder process) and OTEL_TRACES_EXPORTER=otlp alone,
the spans skip the SDK's span objects: a CountingBatchSpanProcessor of OTLP bytes (the same queue
and counts) with the OTLP exporter for the protocol, and the GenAI histograms skip the SDK's
instruments (`histograms.HistogramReader`s aggregate them: `Providers.histogram_readers`), unless
PHASELENS_SPAN_BACKEND=sdk.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TypeVar, cast

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from phaselens.instrumentation import names
from phaselens.instrumentation.pipeline.emitter import SpanEmitter
from phaselens.instrumentation.pipeline.histograms import HistogramReader, histogram_readers_usable
from phaselens.instrumentation.pipeline.otlp_fast import (
    FastEmitter,
    bytes_exporter,
    request_encoder,
)
from phaselens.instrumentation.pipeline.sampling import check_sampler_env
from phaselens.instrumentation.pipeline.span_processor import CountingBatchSpanProcessor, ExportCounts
from phaselens.instrumentation.pipeline.spans import SpanBackend

RESOURCE_ATTRIBUTES_ENV = "OTEL_RESOURCE_ATTRIBUTES"

T = TypeVar("T")

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
_DEFAULT_PROTOCOL = PROTOCOL_HTTP


_processors_by_provider: weakref.WeakKeyDictionary[object, list[CountingBatchSpanProcessor]] = (
    weakref.WeakKeyDictionary()
)


def add_counting_processor(tracer_provider: TracerProvider, exporter: SpanExporter) -> ExportCounts:
    """Attach a CountingBatchSpanProcessor for `exporter`; its counts show in export_counters()."""
    processor = CountingBatchSpanProcessor(exporter)
    tracer_provider.add_span_processor(processor)
    _processors_by_provider.setdefault(tracer_provider, []).append(processor)
    return processor.counts


def export_positions(tracer_provider: object) -> list[ExportCounts]:
    """The counts of each counting processor on this provider, live (their `queued` / `settled`)."""
    return [processor.counts for processor in _processors_by_provider.get(tracer_provider, [])]


def notify_settled(tracer_provider: object, callback: Callable[[], None]) -> None:
    """`callback()` after each export of any counting processor on this provider (its `settled` moved)."""
    for processor in _processors_by_provider.get(tracer_provider, []):
        processor.on_settled = callback


def export_on_caller(tracer_provider: object) -> None:
    """Each counting processor on this provider exports a full batch on the thread that filled it
    (for a process whose one thread builds: no worker to wake, no GIL handed back and forth)."""
    for processor in _processors_by_provider.get(tracer_provider, []):
        processor.full_batch_on_caller = True


def export_counters(tracer_provider: object) -> dict[str, int]:
    """Sum of the counts of every counting processor on this provider (zeros when none)."""
    counts = export_positions(tracer_provider) if tracer_provider is not None else []
    return {
        "export_exported": sum(c.exported for c in counts),
        "export_failed": sum(c.failed for c in counts),
        "export_dropped": sum(c.dropped for c in counts),
        "export_suppressed": sum(c.suppressed for c in counts),
    }


@dataclass(slots=True)
class Providers:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    encoded: list[CountingBatchSpanProcessor] = field(default_factory=list)  # the fast backend's export, if used
    histogram_readers: list[HistogramReader] | None = None  # they aggregate the GenAI histograms; None: the SDK does

    def force_flush(self) -> None:
        for processor in self.encoded:
            processor.force_flush()
        self.tracer_provider.force_flush()

    def shutdown(self) -> None:
        for processor in self.encoded:
            processor.shutdown()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def span_backend(providers: Providers) -> SpanBackend | None:
    """The fast backend when configure() set up encoded export, else the SDK one (None: no SDK)."""
    if providers.encoded:
        return FastEmitter(providers.tracer_provider, providers.encoded)
    return SpanEmitter.of_provider(providers.tracer_provider)


def _encoded_processors(tracer_provider: TracerProvider) -> list[CountingBatchSpanProcessor]:
    """One processor of encoded spans for OTEL_TRACES_EXPORTER=otlp alone (another exporter takes SDK
    spans), its counts in export_counters(); [] when the SDK path is to be used."""
    if not _fast_backend() or _choices("OTEL_TRACES_EXPORTER") != ["otlp"]:
        return []
    exporter = bytes_exporter(_protocol("TRACES"), request_encoder(tracer_provider))
    if exporter is None:  # an exporter version without the hooks otlp_fast uses
        return []
    processor = CountingBatchSpanProcessor(exporter)
    _processors_by_provider.setdefault(tracer_provider, []).append(processor)
    return [processor]


def _fast_backend() -> bool:
    backend = os.environ.get(names.ENV_SPAN_BACKEND, "").strip().lower() or names.SPAN_BACKEND_FAST
    if backend not in (names.SPAN_BACKEND_FAST, names.SPAN_BACKEND_SDK):
        raise ValueError(f"{names.ENV_SPAN_BACKEND}={backend!r}: expected fast or sdk")
    return backend == names.SPAN_BACKEND_FAST


def _choices(variable: str) -> list[str]:
    value = os.environ.get(variable, "otlp")
    return [v.strip().lower() for v in value.split(",") if v.strip()]


def _protocol(signal: str) -> str:
    value = (
        (
            os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or _DEFAULT_PROTOCOL
        )
        .strip()
        .lower()
    )
    if value not in (PROTOCOL_GRPC, PROTOCOL_HTTP):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={value!r}: expected {PROTOCOL_GRPC} or {PROTOCOL_HTTP}")
    return value


def otlp_span_exporter() -> SpanExporter:
    if _protocol("TRACES") == PROTOCOL_GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


def otlp_metric_exporter() -> MetricExporter:
    if _protocol("METRICS") == PROTOCOL_GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

    return HttpExporter()


def _span_exporters() -> list[SpanExporter]:
    factories = {"otlp": otlp_span_exporter, "console": ConsoleSpanExporter}
    return [
        _pick(factories, name, "OTEL_TRACES_EXPORTER")() for name in _choices("OTEL_TRACES_EXPORTER") if name != "none"
    ]


def _metric_readers(owned_by: Resource | None) -> list[MetricReader]:
    """`owned_by`: the resource of a provider phaselens owns, whose readers aggregate its histograms."""
    factories = {"otlp": otlp_metric_exporter, "console": ConsoleMetricExporter}
    exporters = [
        _pick(factories, name, "OTEL_METRICS_EXPORTER")()
        for name in _choices("OTEL_METRICS_EXPORTER")
        if name != "none"
    ]
    if owned_by is None:
        return [PeriodicExportingMetricReader(exporter) for exporter in exporters]
    scope = InstrumentationScope(names.SERVER_SCOPE)
    return [HistogramReader(exporter, owned_by, scope) for exporter in exporters]


def _pick(factories: dict[str, Callable[[], T]], name: str, variable: str) -> Callable[[], T]:
    if name not in factories:
        raise ValueError(f"{variable}={name!r}: expected one of {', '.join([*factories, 'none'])}")
    return factories[name]


def make_resource(service_name: str) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME win; `service_name` fills in when neither names one."""
    from_env = Resource.create()
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return from_env if named else from_env.merge(Resource({SERVICE_NAME: service_name}))


def configure(
    service_name: str,
    *,
    set_global: bool = True,
    sampler: Sampler | None = None,
    id_generator: IdGenerator | None = None,
    encoded_spans: bool = False,
    exporters: bool = True,
) -> Providers:
    """Tracer and meter providers from the OTEL_* environment (see module docstring).

    With `set_global` they also become the process's global providers (only the first call in a
    process can set them; later ones keep the providers local). `sampler` replaces the one
    OTEL_TRACES_SAMPLER names; `id_generator` the SDK's random one. `encoded_spans`: the caller
    emits through `span_backend()` alone (nothing else uses the tracer provider, whose processors
    the fast backend skips), so the fast backend may export, and the GenAI histograms may be
    aggregated by the readers (`Providers.histogram_readers`). `exporters` False: no span processor
    and no metric reader (no exporter, thread or channel): providers that decide sampling and ids
    for spans exported elsewhere (a serving process whose span-builder child exports). ValueError
    when OTEL_TRACES_SAMPLER_ARG is not a ratio (`sampling.check_sampler_env`)."""
    check_sampler_env()
    resource = make_resource(service_name)
    tracer_provider = TracerProvider(resource=resource, sampler=sampler, id_generator=id_generator)
    encoded = _encoded_processors(tracer_provider) if encoded_spans and exporters else []
    if not encoded and exporters:
        for exporter in _span_exporters():
            add_counting_processor(tracer_provider, exporter)
    owned = encoded_spans and _fast_backend()
    readers = _metric_readers(resource if owned else None) if exporters else []
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    if set_global:
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
    histogram_readers = cast("list[HistogramReader]", readers) if owned and histogram_readers_usable(readers) else None
    return Providers(tracer_provider, meter_provider, encoded, histogram_readers)


def tag_pd_resource(env: MutableMapping[str, str], role: str, url: str) -> None:
    """Tag a disaggregated-serving process's spans with its role and URL (`phaselens.pd.role`,
    `phaselens.pd.instance`): appended to OTEL_RESOURCE_ATTRIBUTES in `env` (os.environ, or a child's
    environment), which every OTel SDK process reads, the span-builder child too."""
    ours = f"{names.PL_PD_ROLE}={role},{names.PL_PD_INSTANCE}={url}"
    given = env.get(RESOURCE_ATTRIBUTES_ENV, "")
    env[RESOURCE_ATTRIBUTES_ENV] = f"{given},{ours}" if given else ours
