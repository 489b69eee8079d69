"""OTLP/JSON → ExportTraceServiceRequest, per the OTLP JSON mapping.

It differs from protobuf's canonical JSON in one way that matters: trace and span ids are hex
strings, not base64. Enums may be names or integers, int64 strings or numbers; protobuf's parser
accepts those, so the ids are rewritten to base64 and the rest is left to `json_format`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_ID_KEYS = {"traceId": 16, "trace_id": 16, "spanId": 8, "span_id": 8, "parentSpanId": 8, "parent_span_id": 8}


class InvalidJson(ValueError):
    pass


def _hex_ids_to_base64(obj: dict[str, Any], where: str) -> None:
    for key, size in _ID_KEYS.items():
        value = obj.get(key)
        if value is None or value == "":
            continue
        try:
            raw = bytes.fromhex(value) if isinstance(value, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != size:
            raise InvalidJson(f"{where}.{key}: expected {2 * size} hex digits, got {value!r}")
        obj[key] = base64.b64encode(raw).decode()


def _spans(doc: object) -> Iterator[dict[str, Any]]:
    for rs in _list(doc, "resourceSpans", "resource_spans"):
        for ss in _list(rs, "scopeSpans", "scope_spans"):
            for span in _list(ss, "spans"):
                if not isinstance(span, dict):
                    raise InvalidJson("spans: expected JSON objects")
                yield span


def _list(obj: object, *keys: str) -> list[Any]:
    if not isinstance(obj, dict):
        raise InvalidJson("expected a JSON object")
    for key in keys:
        if key in obj:
            value = obj[key]
            if not isinstance(value, list):
                raise InvalidJson(f"{key}: expected a JSON array")
            return value
    return []


def parse_traces(body: bytes) -> ExportTraceServiceRequest:
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidJson(f"not JSON: {exc}") from None
    for i, span in enumerate(_spans(doc)):
        _hex_ids_to_base64(span, f"span[{i}]")
        for j, link in enumerate(_list(span, "links")):
            if not isinstance(link, dict):
                raise InvalidJson(f"span[{i}].links[{j}]: expected a JSON object")
            _hex_ids_to_base64(link, f"span[{i}].links[{j}]")
    request = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)  # fills `request`
    except (json_format.ParseError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidJson(f"not an OTLP ExportTraceServiceRequest: {exc}") from None
    return request
