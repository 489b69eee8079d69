"""ExportLogsServiceRequest bytes → `otel_logs` RowBinary rows, as the exporter renders a log record.

Timestamp = the record's time, or its observed time when the time is 0 (ns); TraceId / SpanId
lowercase hex (`''` when absent); TraceFlags = the record's flags (low byte); Body and attribute
values as pdata's AsString (`attr_string`); ServiceName from the resource's `service.name`.
Columns in signal_schema.LOGS insert order (TimestampTime is computed by the server).
"""

from __future__ import annotations

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from phaselens.collectors import rowbinary as rb
from phaselens.collectors.attr_string import as_string
from phaselens.collectors.signal_rows import (
    InvalidPayload,
    check_size,
    encode_map,
    hex_id,
    parse,
    service_name,
    string_attributes,
)
from phaselens.collectors.signal_schema import LOGS


def render(payload: bytes) -> tuple[dict[str, bytes], int]:
    """One request → ({"otel_logs": rows}, record count). Raises InvalidPayload."""
    request = parse(ExportLogsServiceRequest, payload)
    out, records = bytearray(), 0
    for rl in request.resource_logs:
        resource = string_attributes(rl.resource.attributes)
        service = bytearray()
        rb.string(service, service_name(resource))
        resource_part = bytearray()
        rb.string(resource_part, rl.schema_url)
        resource_part += encode_map(resource)
        for sl in rl.scope_logs:
            scope = bytearray(resource_part)  # the columns after Body: the same for the whole scope
            rb.string(scope, sl.schema_url)
            rb.string(scope, sl.scope.name)
            rb.string(scope, sl.scope.version)
            scope += encode_map(string_attributes(sl.scope.attributes))
            for record in sl.log_records:
                _record(out, record, bytes(service), bytes(scope))
                records += 1
            check_size(out)
    return ({LOGS.name: bytes(out)} if records else {}), records


def _record(out: bytearray, r: LogRecord, service: bytes, scope: bytes) -> None:
    rb.datetime64_ns(out, r.time_unix_nano or r.observed_time_unix_nano)
    rb.string(out, hex_id(r.trace_id, 16, "trace_id"))
    rb.string(out, hex_id(r.span_id, 8, "span_id"))
    rb.u8(out, r.flags & 0xFF)
    rb.string(out, r.severity_text)
    rb.u8(out, _severity(r.severity_number))
    out += service
    rb.string(out, _body(r.body))
    out += scope
    out += encode_map(string_attributes(r.attributes))


def _severity(number: int) -> int:
    if not 0 <= number <= 24:  # OTLP's SeverityNumber range; UInt8 column
        raise InvalidPayload(f"severity_number must be 0..24, got {number}")
    return number


def _body(body: AnyValue) -> str:
    try:
        return as_string(body)
    except RecursionError as exc:
        raise InvalidPayload(f"malformed log body: {exc}") from None
