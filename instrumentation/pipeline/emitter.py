"""The SDK span backend: span descriptions (`spans.SpanData`) → the SDK's public span types.

The SDK starts a span only with ids its own generator makes, and phaselens chooses a request's
SERVER span id at receipt (see `ids`). So spans are not started and ended here: they are made
finished, as the public `opentelemetry.sdk.trace.ReadableSpan` the SDK itself hands to span
processors, and given to the provider's processors through the public `SpanProcessor.on_end`.

What the SDK's `Span` would apply is applied here too, from the same `SpanLimits` (OTEL_SPAN_* /
OTEL_ATTRIBUTE_* environment, or the limits given): attributes in a `BoundedAttributes`
(count and value-length limits), events and links in `BoundedList`s (count limits), each event's
and link's attributes bounded too; the resource is the provider's current one (re-read per span,
so a fork's update shows); the scope is `names.SERVER_SCOPE`. Not done: `on_start` (no live span
exists to hand over) and the deprecated `instrumentation_info`. The fast backend for a provider
phaselens owns is `otlp_fast.FastEmitter`; both take the same descriptions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanLimits
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.records import RequestRecord, unpack_link
from phaselens.instrumentation.pipeline.phases import Phases
from phaselens.instrumentation.pipeline.spans import (
    KIND_SERVER,
    LinkIds,
    PackedStep,
    SpanData,
    compact_span,
    emit_request_spans,
    emit_step_span,
    packed_links,
)

UNSET = Status(StatusCode.UNSET)


class SpanEmitter:
    """ReadableSpans bounded by `limits`, handed to `tracer`'s span processors; counts them in `emitted`."""

    def __init__(self, tracer: Any, limits: SpanLimits) -> None:
        self._tracer = tracer  # an SDK Tracer: its public span_processor, sampler, id_generator, resource
        self.processor = tracer.span_processor
        self.sampler = tracer.sampler
        self.ids = tracer.id_generator
        self.limits = limits
        self.scope = InstrumentationScope(names.SERVER_SCOPE, "", None, None)  # as get_tracer(SERVER_SCOPE) makes it
        self.emitted = 0

    @classmethod
    def of_provider(cls, tracer_provider: Any, limits: SpanLimits | None = None) -> SpanEmitter | None:
        """None for a provider with nothing to emit to (the API's no-op or proxy provider, or the SDK
        with OTEL_SDK_DISABLED): its requests are then unsampled. `limits` default: the SDK's own
        default, read from the environment as a TracerProvider without `span_limits` reads it."""
        tracer = tracer_provider.get_tracer(names.SERVER_SCOPE)
        if not hasattr(tracer, "span_processor"):
            return None
        return cls(tracer, limits or SpanLimits())

    def span(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ts: int,
        end_ts: int,
        attributes: dict[str, Any] | None = None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        events: Sequence[Event] = (),
        links: Sequence[Link] = (),
        status: Status = UNSET,
    ) -> ReadableSpan:
        limits = self.limits
        return ReadableSpan(
            name=name,
            context=context,
            parent=parent,
            resource=self._tracer.resource,
            attributes=BoundedAttributes(
                limits.max_span_attributes, attributes, immutable=True, max_value_len=limits.max_span_attribute_length
            ),
            events=BoundedList.from_seq(limits.max_events, events),
            links=BoundedList.from_seq(limits.max_links, links),
            kind=kind,
            status=status,
            start_time=start_ts,
            end_time=end_ts,
            instrumentation_scope=self.scope,
        )

    def event(self, name: str, attributes: dict[str, Any], timestamp_ts: int) -> Event:
        limits = self.limits
        return Event(
            name,
            BoundedAttributes(
                limits.max_event_attributes, attributes, immutable=True, max_value_len=limits.max_attribute_length
            ),
            timestamp_ts,
        )

    def link(self, trace_id: int, span_id: int, trace_flags: int, attributes: dict[str, Any] | None = None) -> Link:
        limits = self.limits
        return Link(
            SpanContext(trace_id, span_id, False, TraceFlags(trace_flags)),
            BoundedAttributes(
                limits.max_link_attributes, attributes, immutable=True, max_value_len=limits.max_attribute_length
            ),
        )

    def readable(self, data: SpanData) -> ReadableSpan:
        """The ReadableSpan of a description (a remote parent keeps its is_remote)."""
        state = TraceState.from_header([data.trace_state]) if data.trace_state else TraceState()
        flags = TraceFlags(data.trace_flags)
        parent = None
        if data.parent_id is not None:
            parent = SpanContext(data.trace_id, data.parent_id, data.parent_remote, flags, state)
        return self.span(
            data.name,
            SpanContext(data.trace_id, data.span_id, False, flags, state),
            parent,
            data.start_ts,
            data.end_ts,
            data.attributes,
            kind=SpanKind.SERVER if data.kind == KIND_SERVER else SpanKind.INTERNAL,
            events=[self.event(name, attributes, time_ts) for name, time_ts, attributes in data.events],
            links=[self.link(*(unpack_link(link) if isinstance(link, bytes) else link)) for link in self._links(data)],
            status=Status(StatusCode(data.status_code), data.status_message) if data.status_code else UNSET,
        )

    @staticmethod
    def _links(data: SpanData) -> Sequence[LinkIds]:
        links = data.links
        return packed_links(links) if isinstance(links, bytes) else links

    def emit(self, spans: Iterable[ReadableSpan]) -> None:
        """Each span to the processors, in order (children before their parent, as they would end)."""
        on_end = self.processor.on_end
        for span in spans:
            on_end(span)
            self.emitted += 1

    def emit_data(self, spans: Iterable[SpanData]) -> None:
        """The described spans as ReadableSpans to the processors, in order (the builder's backend call)."""
        self.emit(map(self.readable, spans))

    def emit_request(
        self,
        anchor: ClockAnchor,
        record: RequestRecord,
        phases: Phases,
        token_events: bool,
        full: str = names.TRACE_FULL_HEAD,
    ) -> None:
        """A sampled request's spans, described and emitted."""
        emit_request_spans(self, anchor, record, phases, token_events, full)

    def emit_compact(self, anchor: ClockAnchor, record: RequestRecord, phases: Phases) -> None:
        """A request's compact record, described and emitted."""
        self.emit_data((compact_span(anchor, record, phases),))

    def emit_steps(self, anchor: ClockAnchor, steps: Sequence[PackedStep]) -> int:
        """Engine steps' spans, each described and emitted; how many are built."""
        return sum(emit_step_span(self, anchor, step) for step in steps)
