"""Synthetic OTLP trace payloads shaped like phaselens spans, for the collector benchmark and tests."""

from __future__ import annotations

import os

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from phaselens.instrumentation import names


def _kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def export_request(span_count: int, start_ns: int, service: str = "bench") -> ExportTraceServiceRequest:
    """`span_count` spans, 4 per trace (server root + 3 phases), ~8 attributes and 1 event each."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.extend([_kv("service.name", service), _kv("host.name", "bench-host")])
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "phaselens.bench", "0.1.0"
    phase_names = (names.SPAN_QUEUE, names.SPAN_PREFILL, names.SPAN_DECODE)
    for i in range(span_count):
        if i % 4 == 0:
            trace_id, root_id = os.urandom(16), os.urandom(8)
        span = ss.spans.add(
            trace_id=trace_id,
            span_id=root_id if i % 4 == 0 else os.urandom(8),
            name=names.root_span_name(names.OP_TEXT_COMPLETION, "tiny") if i % 4 == 0 else phase_names[i % 4 - 1],
            kind=Span.SPAN_KIND_SERVER if i % 4 == 0 else Span.SPAN_KIND_INTERNAL,
            start_time_unix_nano=start_ns + i * 1000,
            end_time_unix_nano=start_ns + i * 1000 + 5_000_000,
        )
        if i % 4:
            span.parent_span_id = root_id
        span.attributes.extend(
            [
                _kv(names.GEN_AI_OPERATION_NAME, names.OP_TEXT_COMPLETION),
                _kv(names.GEN_AI_REQUEST_MODEL, "tiny"),
                _kv(names.GEN_AI_REQUEST_MAX_TOKENS, 16),
                _kv(names.GEN_AI_REQUEST_TEMPERATURE, 0.7),
                _kv(names.GEN_AI_REQUEST_STREAM, True),
                _kv(names.GEN_AI_USAGE_INPUT_TOKENS, 12 + i % 7),
                _kv(names.GEN_AI_USAGE_OUTPUT_TOKENS, 16),
                _kv(names.GEN_AI_RESPONSE_ID, f"cmpl-{i}"),
            ]
        )
        event = span.events.add(time_unix_nano=start_ns + i * 1000 + 1000, name=names.EVENT_FIRST_CHUNK)
        event.attributes.append(_kv("index", i))
    return request
