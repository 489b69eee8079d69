"""OTLP/JSON → an Export*ServiceRequest (traces, logs or metrics), per the OTLP JSON mapping.

It differs from protobuf's canonical JSON in one way that matters: trace and span ids are hex
strings, not base64. Enums may be names or integers, int64 strings or numbers; protobuf's parser
accepts those, so the ids (of spans, links, log records, exemplars: wherever a key names one) are
rewritten to base64 and the rest is left to `json_format`. Attribute keys never collide with them:
OTLP/JSON writes an attribute as {"key": …, "value": …}.
"""

from __future__ import annotations

import base64
import json
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_KEYS = {"traceId": 16, "trace_id": 16, "spanId": 8, "span_id": 8, "parentSpanId": 8, "parent_span_id": 8}
M = TypeVar("M", bound=Message)


class InvalidJson(ValueError):
    pass


def _hex_id_to_base64(value: object, size: int, where: str) -> str:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) != size:
        raise InvalidJson(f"{where}: expected {2 * size} hex digits, got {value!r}")
    return base64.b64encode(raw).decode()


def _rewrite_ids(node: Any, where: str) -> None:
    """In place, depth first (an explicit stack: nesting depth is the sender's choice)."""
    stack = [(node, where)]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, dict):
            for key, value in obj.items():
                if key in _ID_KEYS and value not in (None, ""):
                    obj[key] = _hex_id_to_base64(value, _ID_KEYS[key], f"{path}.{key}")
                elif isinstance(value, dict | list):
                    stack.append((value, f"{path}.{key}"))
        elif isinstance(obj, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(obj) if isinstance(item, dict | list))


def parse(body: bytes, request_type: type[M]) -> M:
    """OTLP/JSON bytes → a `request_type` message. Raises InvalidJson."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidJson(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidJson("expected a JSON object")
    _rewrite_ids(doc, "$")
    request: M = request_type()
    try:
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)  # fills `request`
    except (json_format.ParseError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidJson(f"not an OTLP {request_type.__name__}: {exc}") from None
    return request


def parse_traces(body: bytes) -> ExportTraceServiceRequest:
    return parse(body, ExportTraceServiceRequest)
