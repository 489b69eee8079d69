"""One trace's spans, in the columns Grafana's trace view expects."""

from __future__ import annotations

from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.schema.schema import (
    ERROR_CODES,
    SPANS_VIEW,
    TRACE_TIMES_VIEW,
)


def one_trace(d: Dialect, select: str, tail: str) -> str:
    """`select` over the spans of `${trace_id}`, the time range bounded by the lookup table (as
    Grafana's plugin does: its Start/End are whole seconds, so the end gets one more)."""
    lookup = d.table(TRACE_TIMES_VIEW)
    return (
        f"WITH {d.value('trace_id', 'String')} AS trace_id,\n"
        f"    (SELECT min(Start) FROM {lookup} WHERE TraceId = trace_id) AS trace_start,\n"
        f"    (SELECT max(End) + 1 FROM {lookup} WHERE TraceId = trace_id) AS trace_end\n"
        f"SELECT {select}\nFROM {d.table(SPANS_VIEW)}\n"
        f"WHERE TraceId = trace_id AND Timestamp >= trace_start AND Timestamp <= trace_end\n{tail}"
    )


def _key_values(column: str) -> str:
    """A Map as the trace view's list of {key, value} maps."""
    return f"arrayMap(key -> map('key', key, 'value', {column}[key]), mapKeys({column}))"


def request_trace(d: Dialect) -> str:
    """One trace in the columns Grafana's trace view expects (plugin QueryType.Traces, format 3)."""
    return one_trace(
        d,
        (
            "TraceId AS traceID, SpanId AS spanID, ParentSpanId AS parentSpanID,\n"
            "    ServiceName AS serviceName, SpanName AS operationName,\n"
            "    multiply(toUnixTimestamp64Nano(Timestamp), 0.000001) AS startTime,\n"
            "    multiply(Duration, 0.000001) AS duration,\n"
            f"    {_key_values('SpanAttributes')} AS tags,\n    {_key_values('ResourceAttributes')} AS serviceTags,\n"
            f"    if(StatusCode IN {ERROR_CODES}, 2, 0) AS statusCode"
        ),
        f"LIMIT {d.limit(1000)}",
    )
