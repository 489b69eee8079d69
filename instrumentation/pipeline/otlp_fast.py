"""The fast span backend: descriptions → OTLP bytes in C → the OTLP exporter's own transport.

Used where phaselens owns the tracer provider (the span-builder process; `ServerTelemetry.from_env`)
and every trace exporter is OTLP: no ReadableSpan, no SDK Link and no protobuf object is made.
`FastEmitter.emit` encodes a record's sampled spans (`_otlp_encode.encode_spans`, SpanLimits
applied as the SDK applies them) and offers the encoded spans to a
`span_processor.CountingBatchSpanProcessor` per exporter (`offer`: the same bounded queue, batches,
worker thread and counts — `dropped`, `failed`, `exported`, positions — holding bytes, not spans). A batch becomes one
ExportTraceServiceRequest (the provider's resource at export time, scope `names.SERVER_SCOPE`)
sent by the SDK's OTLP exporter classes themselves, so their retry and backoff, timeout,
compression, headers, TLS and every `OTEL_EXPORTER_OTLP_*` setting hold unchanged:

- HTTP: `OTLPSpanExporter` (proto.http) whose `export` hands the bytes to its own client, as its
  `export` does after encoding (size limit, retries on 429/502/503/504 and connection errors),
  over `http_transport.HttpClientTransport` (http.client) instead of requests.
- gRPC: `OTLPSpanExporter` (proto.grpc) with a stub whose `Export` sends bytes as they are; its
  `_export` does the retries (and the reconnect on UNAVAILABLE), the deadline and the headers.

Both lean on the exporters' internals (`_client`, `_translate_data`); `bytes_exporter` returns None
when the installed exporter lacks them, and the caller then stays on the SDK backend.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Sampler

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.records import RequestRecord
from phaselens.instrumentation.pipeline._otlp_encode import (
    encode_phases,
    encode_request,
    encode_root,
    encode_spans,
    encode_steps,
)
from phaselens.instrumentation.pipeline.phases import Phases
from phaselens.instrumentation.pipeline.span_processor import CountingBatchSpanProcessor
from phaselens.instrumentation.pipeline.spans import (
    PHASE_KEYS,
    PHASE_NAMES,
    ROOT_SPAN_CONSTANTS,
    ROOT_SPAN_KEYS,
    STEP_KEYS,
    PackedStep,
    SpanData,
    compact_summary,
    decode_description,
    emit_request_spans,
    emit_step_span,
    kv_spans,
    phase_stamps,
    root_texts,
    samples_every_root,
)

PROTOCOL_GRPC = "grpc"
PROTOCOL_HTTP = "http/protobuf"
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_CREDENTIAL_PROVIDER = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER"
_TRACES_CREDENTIAL_PROVIDER = "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER"

RequestEncoder = Callable[[Sequence[bytes]], bytes]


def limits_tuple(limits: SpanLimits) -> tuple[int, ...]:
    """SpanLimits as `_otlp_encode` takes them (-1: no limit), in its order."""
    values = (
        limits.max_span_attributes,
        limits.max_span_attribute_length,
        limits.max_events,
        limits.max_links,
        limits.max_event_attributes,
        limits.max_link_attributes,
        limits.max_attribute_length,
    )
    return tuple(-1 if value is None else value for value in values)


def request_encoder(tracer_provider: TracerProvider) -> RequestEncoder:
    """Encoded spans → one ExportTraceServiceRequest with the provider's resource (read per batch,
    so a fork's update shows, as the SDK backend reads it per span). A Resource's attributes are
    immutable: copied into a dict once per Resource object, not per batch (~12 us warm an export)."""
    copied: list[tuple[object, dict[str, Any]]] = []  # (the resource, its attributes as a dict)

    def encode(spans: Sequence[bytes]) -> bytes:
        resource = tracer_provider.resource
        if not copied or copied[0][0] is not resource:
            copied[:] = [(resource, dict(resource.attributes))]
        return encode_request(copied[0][1], names.SERVER_SCOPE, "", spans)

    return encode


class FastEmitter:
    """The fast backend (the SDK one: `emitter.SpanEmitter`): the provider's ids, sampler and limits;
    sampled spans encoded once and offered to each processor; `emitted` counts every span given."""

    def __init__(
        self,
        tracer_provider: TracerProvider,
        processors: list[CountingBatchSpanProcessor],
        limits: SpanLimits | None = None,
    ) -> None:
        self.ids: IdGenerator = tracer_provider.id_generator
        # the SDK's default generator draws random.getrandbits(64) per id: the encoder draws the same
        # bits 8 ids at a time (`encode_phases`), a run of steps' at once (`encode_steps`); any other
        # generator is called per id
        self._random_bits = random.getrandbits if type(self.ids) is RandomIdGenerator else None
        self.sampler: Sampler = tracer_provider.sampler
        self.limits = limits_tuple(limits or SpanLimits())
        self._every_root = samples_every_root(self.sampler)  # a provider's sampler is fixed at its making
        self.processors = processors
        self.emitted = 0

    def emit_data(self, spans: Sequence[SpanData]) -> None:
        self.emitted += len(spans)
        sampled = [span for span in spans if span.trace_flags & 1]  # as the SDK's batch processors
        if sampled:
            encoded = encode_spans(sampled, self.limits)
            for processor in self.processors:
                processor.offer(encoded)

    def emit_request(
        self,
        anchor: ClockAnchor,
        record: RequestRecord,
        phases: Phases,
        token_events: bool,
        full: str = names.TRACE_FULL_HEAD,
    ) -> None:
        """A sampled request's phase spans encoded straight from its phases (`encode_phases`: the
        bytes of `request_spans`'s descriptions, ids drawn in its order), then its SERVER span
        encoded from its record (`encode_root`); no sampler is asked (the root's decision, taken at receipt, holds
        for the whole tree). An unsampled root (its spans counted, not exported) is described."""
        if not record.root.trace_flags & 1:
            emit_request_spans(self, anchor, record, phases, token_events, full)
            return
        decode = decode_description(anchor, record, phases, token_events) if phases.first_token_ts else None
        encoded = encode_phases(
            self.ids.generate_span_id,
            self._random_bits,
            record.root,
            anchor.wall_offset_ns,
            phase_stamps(phases),
            phases.waits,
            record.chunks,
            decode,
            PHASE_NAMES,
            PHASE_KEYS,
            self.limits,
        )
        if record.kv is not None:
            encoded += encode_spans(kv_spans(self.ids, anchor, record), self.limits)
        encoded.append(self._root(anchor, record, phases, full, None))
        self.emitted += len(encoded)
        for processor in self.processors:
            processor.offer(encoded)

    def emit_compact(self, anchor: ClockAnchor, record: RequestRecord, phases: Phases) -> None:
        """A request's compact record (`spans.compact_span`), encoded from its record and phases."""
        self.emitted += 1
        if record.root.trace_flags & 1:
            encoded = [self._root(anchor, record, phases, names.TRACE_FULL_NONE, compact_summary(record, phases))]
            for processor in self.processors:
                processor.offer(encoded)

    def _root(
        self, anchor: ClockAnchor, record: RequestRecord, phases: Phases, full: str, summary: dict[str, Any] | None
    ) -> bytes:
        """The SERVER span's entry (`encode_root`: the bytes of `spans.root_span`'s description)."""
        texts = root_texts(record, full)
        offset_ns = anchor.wall_offset_ns
        return encode_root(record, phases, offset_ns, texts, summary, ROOT_SPAN_KEYS, ROOT_SPAN_CONSTANTS, self.limits)

    def emit_steps(self, anchor: ClockAnchor, steps: Sequence[PackedStep]) -> int:
        """Engine steps' spans encoded straight from the PackedSteps in one C call (`encode_steps`:
        the bytes of `step_span`'s descriptions, the ids of one draw for all, ~1/2 of a per-step
        Python loop's instructions) where the sampler records and samples every root as given,
        offered once for all of them (an offer, ~1.5 us, was most of a step's cost); else described
        and emitted. How many are built (a step with no sampled member is not)."""
        if not self._every_root:
            return sum(emit_step_span(self, anchor, step) for step in steps)
        encoded = encode_steps(
            steps,
            self._random_bits,
            self._generated_ids,
            anchor.wall_offset_ns,
            names.SPAN_ENGINE_STEP,
            STEP_KEYS,
            self.limits,
        )
        if encoded:
            self.emitted += len(encoded)
            for processor in self.processors:
                processor.offer(encoded)
        return len(encoded)

    def _generated_ids(self) -> tuple[int, int]:
        """A step's trace id, then its span id, from the generator (as step_span draws them): where
        the SDK's default generator's bits are not drawn, or drew a 0 (p = 2**-64)."""
        return self.ids.generate_trace_id(), self.ids.generate_span_id()


def _http_transport() -> Any:
    """`http_transport.HttpClientTransport` (~10x less CPU per export than the default's requests),
    unless a credential provider is configured (its requests.Session sends, as without phaselens) or
    the installed exporter has no pluggable transports."""
    if os.environ.get(_CREDENTIAL_PROVIDER) or os.environ.get(_TRACES_CREDENTIAL_PROVIDER):
        return None
    try:
        from phaselens.instrumentation.pipeline.http_transport import HttpClientTransport, tls_settings
    except ImportError:  # opentelemetry-exporter-http-transport missing: an older exporter
        return None
    verify, cert = tls_settings()
    return HttpClientTransport(verify=verify, cert=cert)


def _http_exporter(encode: RequestEncoder) -> SpanExporter | None:
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    class HttpBytesExporter(trace_exporter.OTLPSpanExporter):
        """Sends encoded batches with the exporter's own client (retries, timeout, compression)."""

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            if self._shutdown:
                return SpanExportResult.FAILURE
            with self._metrics.export_operation(len(spans)) as result:
                payload = encode(spans)
                if 0 < self._max_request_size < len(payload):
                    result.error = ValueError(f"request of {len(payload)} bytes over max_request_size")
                    return SpanExportResult.FAILURE
                outcome = self._client.export(payload)
                if not outcome.success:
                    result.error = outcome.error
                    return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

    transport = _http_transport()
    exporter = HttpBytesExporter(_transport=transport) if transport is not None else HttpBytesExporter()
    usable = all(hasattr(exporter, name) for name in ("_client", "_metrics", "_max_request_size", "_shutdown"))
    return exporter if usable and hasattr(exporter._client, "export") else None


class _BytesTraceStub:
    """TraceService's stub with the request sent as the bytes given (no serializer)."""

    def __init__(self, channel: Any) -> None:
        self.Export = channel.unary_unary(
            _EXPORT_METHOD, request_serializer=None, response_deserializer=ExportTraceServiceResponse.FromString
        )


def _grpc_exporter(encode: RequestEncoder) -> SpanExporter | None:
    from opentelemetry.exporter.otlp.proto.grpc import trace_exporter

    class GrpcBytesExporter(trace_exporter.OTLPSpanExporter):
        """The exporter's `_export` (retries, reconnect, deadline, headers) over pre-encoded bytes."""

        def _initialize_channel_and_stub(self) -> None:
            self._stub = _BytesTraceStub
            super()._initialize_channel_and_stub()  # type: ignore[no-untyped-call]

        def _translate_data(self, data: Sequence[Any]) -> Any:
            return encode(data)

        def _count_data(self, data: Sequence[Any]) -> int:
            return len(data)

    if not all(
        hasattr(trace_exporter.OTLPSpanExporter, name) for name in ("_export", "_translate_data", "_count_data")
    ):
        return None
    return GrpcBytesExporter()


def bytes_exporter(protocol: str, encode: RequestEncoder) -> SpanExporter | None:
    """The OTLP exporter for `protocol`, sending `encode(batch)` bytes; None where unsupported."""
    return _grpc_exporter(encode) if protocol == PROTOCOL_GRPC else _http_exporter(encode)
