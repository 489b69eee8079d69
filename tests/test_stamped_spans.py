"""StampedSpans: spans made after the fact from monotonic stamps, ids chosen before the span exists
(instrumentation/pipeline/stamped_spans.py; the P/D and router spans of the reference server use it)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode, TraceFlags

from phaselens.common.clocks import MonoTs, WallTs
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.ids import span_context
from phaselens.instrumentation.pipeline import StampedSpans, parse_traceparent, traceparent

INCOMING = "00-0000000000000000000000000000abcd-00000000000000ef-01"


def test_traceparent_round_trips_and_a_malformed_one_is_none():
    context = parse_traceparent(traceparent(0xABCD, 0xEF, 1))
    assert (context.trace_id, context.span_id, context.trace_flags) == (0xABCD, 0xEF, TraceFlags.SAMPLED)
    assert traceparent(0xABCD, 0xEF, 1) == INCOMING
    assert parse_traceparent("00-zz-01") is None and parse_traceparent("") is None


def test_a_root_joins_the_incoming_trace_and_its_span_is_placed_by_the_anchor():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = StampedSpans(provider, ClockAnchor(mono_ts=MonoTs(1_000), wall_ts=WallTs(5_000_000_000)))
    root, parent = spans.decide_root({"traceparent": INCOMING}, "POST")
    assert (root.trace_id, parent.span_id, root.trace_flags & TraceFlags.SAMPLED) == (0xABCD, 0xEF, 1)
    child = SpanContext(root.trace_id, spans.new_span_id(), False, TraceFlags(root.trace_flags))
    spans.submit(
        "s", span_context(root), span_context(parent, is_remote=True), MonoTs(2_000), MonoTs(9_000), {"a": 1, "b": None}
    )
    spans.submit(
        "c", child, span_context(root), MonoTs(3_000), MonoTs(4_000), {}, error="peer gone", kind=SpanKind.CLIENT
    )
    spans.shutdown()
    server, client = sorted(exporter.get_finished_spans(), key=lambda s: s.name, reverse=True)
    assert (server.start_time, server.end_time) == (5_000_001_000, 5_000_008_000)
    assert dict(server.attributes) == {"a": 1} and server.parent.span_id == 0xEF
    assert client.parent.span_id == root.span_id and client.kind == SpanKind.CLIENT
    assert (client.status.status_code, client.status.description) == (StatusCode.ERROR, "peer gone")
    assert (spans.emitted, spans.failed) == (2, 0)


def test_without_a_provider_nothing_is_sampled_or_emitted():
    spans = StampedSpans()
    root, parent = spans.decide_root({"traceparent": INCOMING}, "POST")
    assert not spans.enabled and spans.new_span_id() == 0
    assert root.trace_id == 0 and not root.trace_flags & TraceFlags.SAMPLED and parent.span_id == 0xEF
    spans.submit("s", SpanContext(1, 2, False, TraceFlags(1)), None, MonoTs(1), MonoTs(2), {})
    spans.shutdown()
    assert (spans.emitted, spans.failed) == (0, 0)
