"""ExportTraceServiceRequest bytes → `otel_traces` rows, rendered as the exporter renders them.

SpanKind `Server`…, StatusCode `Unset|Ok|Error`, lowercase hex ids (`''` when empty), ServiceName
from the resource's `service.name`, Duration = end − start in ns (clamped at 0: UInt64 column),
attribute values via `attr_string`.

Why a hand-written wire decoder: through the upb message API every KeyValue costs ~1 µs of
wrapper objects; here a KeyValue is a byte slice, and the same slice (`gen_ai.request.model=tiny`)
recurs across spans, so its rendering is cached. The decoder also validates: malformed wire data,
wrong wire types of known fields, bad UTF-8 and invalid ids raise InvalidSpans; it accepts nothing
that protobuf's parser refuses (tests/test_collector_render.py fuzzes that).
"""

from __future__ import annotations

import struct

from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.resources import SERVICE_NAME

from collectors.attr_string import as_string, go_float
from collectors.schema import INSERT_COLUMNS

SPAN_KINDS = dict(enumerate(("Unspecified", "Internal", "Server", "Client", "Producer", "Consumer")))
STATUS_CODES = dict(enumerate(("Unset", "Ok", "Error")))
_NONE: list = []  # shared by every span without events/links; only ever read
_NO_EVENTS, _NO_LINKS = (_NONE,) * 3, (_NONE,) * 4
_NO_STATUS = (0, "")
_ZERO_TRACE_ID, _ZERO_SPAN_ID = bytes(16), bytes(8)
_KV_CACHE: dict[bytes, tuple[str, str]] = {}
_KV_CACHE_MAX = 50_000
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MAX_TAG = (1 << 32) - 1  # field numbers up to 2**29 - 1, as protobuf allows
_U64 = struct.Struct("<Q").unpack_from
_U64_MASK = (1 << 64) - 1
_F64 = struct.Struct("<d").unpack_from
_START_END = struct.Struct("<QxQ").unpack_from  # two fixed64 fields and the tag between them


class InvalidSpans(ValueError):
    """Malformed protobuf, or a span the exporter could not store meaningfully (bad ids)."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise InvalidSpans("varint longer than 10 bytes")


def _fields(buf: bytes, i: int, end: int):
    """Yields (field number, wire type, value) with value = int, or (start, stop) for LEN fields."""
    while i < end:
        tag = buf[i]
        i += 1
        if tag >= 0x80:
            tag, i = _varint(buf, i - 1)
            if tag > _MAX_TAG:
                raise InvalidSpans("field number out of range")
        wire = tag & 7
        if wire == _LEN:
            length = buf[i]
            i += 1
            if length >= 0x80:
                length, i = _varint(buf, i - 1)
            stop = i + length
            if stop > end:
                raise InvalidSpans("length-delimited field runs past its message")
            yield tag >> 3, wire, (i, stop)
            i = stop
        elif wire == _VARINT:
            value, i = _varint(buf, i)
            yield tag >> 3, wire, value
        elif wire == _I64:
            i += 8
            if i > end:
                raise InvalidSpans("truncated fixed64")
            yield tag >> 3, wire, int.from_bytes(buf[i - 8:i], "little")
        elif wire == _I32:
            i += 4
            if i > end:
                raise InvalidSpans("truncated fixed32")
            yield tag >> 3, wire, int.from_bytes(buf[i - 4:i], "little")
        else:
            raise InvalidSpans(f"unsupported wire type {wire}")
        if tag >> 3 == 0:
            raise InvalidSpans("field number 0")


def _expect(wire: int, expected: int, what: str) -> None:
    if wire != expected:
        raise InvalidSpans(f"{what}: wrong wire type {wire}")


def _text(buf: bytes, span: tuple[int, int]) -> str:
    return buf[span[0]:span[1]].decode("utf-8")


def _key_value(raw: bytes) -> tuple[str, str]:
    """Renders one serialized KeyValue (a cache miss) and remembers it. Unique values (ids) would
    fill the cache for good: when full it is emptied, and the recurring values return to it."""
    hit = _scalar_key_value(raw) or _any_key_value(raw)
    if len(_KV_CACHE) >= _KV_CACHE_MAX:
        _KV_CACHE.clear()
    _KV_CACHE[raw] = hit
    return hit


def _scalar_key_value(raw: bytes) -> tuple[str, str] | None:
    """The common miss, read directly: a short key and one string, int, bool or double value
    (AnyValue fields 1, 3, 2, 4), nothing else. None for any other layout."""
    n = len(raw)
    if n < 4 or raw[0] != 0x0A or raw[1] >= 0x80:
        return None
    v = 4 + raw[1]  # where the AnyValue starts
    if v > n or raw[v - 2] != 0x12 or raw[v - 1] >= 0x80 or v + raw[v - 1] != n:
        return None
    key = raw[2:v - 2].decode()
    if v == n:
        return key, ""
    tag = raw[v]
    if tag == 0x0A and v + 1 < n and raw[v + 1] < 0x80 and v + 2 + raw[v + 1] == n:
        return key, raw[v + 2:].decode()
    if tag == 0x18 or tag == 0x10:
        number, end = _varint(raw, v + 1)
        if end == n:
            number &= _U64_MASK
            if tag == 0x10:
                return key, "true" if number else "false"
            return key, str(number - (1 << 64) if number >> 63 else number)
    elif tag == 0x21 and v + 9 == n:
        return key, go_float(_F64(raw, v + 1)[0])
    return None


def _any_key_value(raw: bytes) -> tuple[str, str]:
    key, value = "", ""
    for field, wire, val in _fields(raw, 0, len(raw)):
        if field == 1:
            _expect(wire, _LEN, "KeyValue.key")
            key = _text(raw, val)
        elif field == 2:
            _expect(wire, _LEN, "KeyValue.value")
            try:
                value = as_string(AnyValue.FromString(raw[val[0]:val[1]]))
            except Exception as exc:  # upb DecodeError and friends
                raise InvalidSpans(f"malformed attribute value: {exc}") from None
    return key, value


def _attributes(buf: bytes, ranges: list) -> dict[str, str]:
    out = {}
    cache = _KV_CACHE
    for start, stop in ranges:
        raw = buf[start:stop]
        key, value = cache.get(raw) or _key_value(raw)
        out[key] = value
    return out


def _id(raw: bytes | None, size: int, what: str, allow_empty: bool = False) -> str:
    if raw is None:
        raise InvalidSpans(f"{what} is missing")
    if len(raw) == size and raw.count(0) != size:
        return raw.hex()
    if allow_empty and not raw:
        return ""
    raise InvalidSpans(f"{what} must be {size} bytes, not all zero")


def to_columns(rows: list[tuple]) -> list[tuple]:
    """Row tuples → columns (INSERT_COLUMNS order), transposed in C."""
    return list(zip(*rows)) if rows else [() for _ in INSERT_COLUMNS]


def empty_columns() -> list[list]:
    return [[] for _ in INSERT_COLUMNS]


def add_request(columns: list[list], payload: bytes) -> int:
    """Column-oriented form of `add_rows`: extends each of `columns` (from empty_columns())."""
    rows: list[tuple] = []
    count = add_rows(rows, payload)
    for column, values in zip(columns, to_columns(rows)):
        column.extend(values)
    return count


def add_rows(rows: list[tuple], payload: bytes) -> int:
    """Appends one row tuple (INSERT_COLUMNS order) per span of an ExportTraceServiceRequest;
    returns how many. Raises InvalidSpans (then `rows` may hold part of the request)."""
    before = len(rows)
    try:
        for field, wire, val in _fields(payload, 0, len(payload)):
            if field == 1:
                _expect(wire, _LEN, "resource_spans")
                _resource_spans(rows, payload, *val)
    except (IndexError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidSpans(f"malformed protobuf: {exc}") from None
    return len(rows) - before


def count_spans(payload: bytes) -> int:
    """Decodes and validates without keeping rows."""
    return add_rows([], payload)


def _resource_spans(rows: list, buf: bytes, start: int, stop: int) -> None:
    resource, scope_spans = [], []
    for field, wire, val in _fields(buf, start, stop):
        if field == 1:
            _expect(wire, _LEN, "resource")
            # a repeated singular message is merged: its attributes are concatenated
            resource += [v for f, w, v in _fields(buf, *val) if f == 1 and w == _LEN]
        elif field == 2:
            _expect(wire, _LEN, "scope_spans")
            scope_spans.append(val)
    attrs = _attributes(buf, resource)
    service = attrs.get(SERVICE_NAME, "")
    for s, e in scope_spans:
        _scope_spans(rows, buf, s, e, attrs, service)


def _scope_spans(rows: list, buf, start, stop, resource: dict, service: str) -> None:
    """The scope may follow its spans on the wire: spans are decoded once it is known."""
    name = version = ""
    spans = []
    i = start
    while i < stop:
        if buf[i] == 0x12:  # a span: the common case, located without the generic path
            length = buf[i + 1]
            if length < 0x80:
                i += 2
            else:
                length, i = _varint(buf, i + 1)
            if i + length > stop:
                raise InvalidSpans("span runs past its scope_spans")
            spans.append((i, i + length))
            i += length
            continue
        end = _field_end(buf, i, stop)
        for field, wire, val in _fields(buf, i, end):
            if field == 1:
                _expect(wire, _LEN, "scope")
                name, version = _scope(buf, *val, name, version)
            elif field == 2:
                _expect(wire, _LEN, "span")
        i = end
    append = rows.append
    for s, e in spans:
        append(_span(buf, s, e, resource, service, name, version))


def _scope(buf, start, stop, name: str, version: str) -> tuple[str, str]:
    """Name and version, over those of an earlier occurrence (protobuf merges repeated messages)."""
    for f, w, v in _fields(buf, start, stop):
        if f in (1, 2):
            _expect(w, _LEN, "scope name/version")
            if f == 1:
                name = _text(buf, v)
            else:
                version = _text(buf, v)
    return name, version


# Span fields by number → wire type, for the generic path (unknown fields are skipped).
_SPAN_WIRE = {1: _LEN, 2: _LEN, 3: _LEN, 4: _LEN, 5: _LEN, 6: _VARINT, 7: _I64, 8: _I64, 9: _LEN,
              10: _VARINT, 11: _LEN, 12: _VARINT, 13: _LEN, 14: _VARINT, 15: _LEN, 16: _I32}


def _span(buf, i, stop, resource, service, scope_name, scope_version) -> tuple:
    """The hot loop, inlined: one-byte tags of known fields are matched directly (0x4A = field 9,
    attributes, LEN); start and end (0x39, 0x41), adjacent as SDKs write them, are read by one
    unpack; anything else takes the generic, checked path."""
    trace_id = span_id = None
    parent = state = name = b""
    kind = begin = end = 0
    status = _NO_STATUS
    attrs, events, links = {}, [], []
    cache = _KV_CACHE
    while i < stop:
        tag = buf[i]
        if tag & 7 == 2 and tag < 0x80:  # LEN fields with one-byte tags
            length = buf[i + 1]
            if length < 0x80:
                i += 2
            else:
                length, i = _varint(buf, i + 1)
            j = i + length
            if j > stop:
                raise InvalidSpans("length-delimited field runs past its span")
            if tag == 0x4A:  # attributes, the most frequent field
                raw = buf[i:j]
                key, value = cache.get(raw) or _key_value(raw)
                attrs[key] = value
            elif tag == 0x0A:
                trace_id = buf[i:j]
            elif tag == 0x12:
                span_id = buf[i:j]
            elif tag == 0x22:
                parent = buf[i:j]
            elif tag == 0x2A:
                name = buf[i:j]
            elif tag == 0x5A:
                events.append((i, j))
            elif tag == 0x1A:
                state = buf[i:j]
            elif tag == 0x7A:
                status = _status(buf, i, j, *status)
            elif tag == 0x6A:
                links.append((i, j))
            elif _SPAN_WIRE.get(tag >> 3, _LEN) != _LEN or tag < 8:
                raise InvalidSpans(f"span field {tag >> 3}: wrong wire type or number")
            i = j
        elif tag == 0x39 and i + 18 <= stop and buf[i + 9] == 0x41:
            begin, end = _START_END(buf, i + 1)
            i += 18
        elif tag == 0x30:
            kind = buf[i + 1]
            if kind < 0x80:
                i += 2
            else:
                kind, i = _varint(buf, i + 1)
        elif tag == 0x39 or tag == 0x41:
            if i + 9 > stop:
                raise InvalidSpans("truncated timestamp")
            if tag == 0x39:
                begin = _U64(buf, i + 1)[0]
            else:
                end = _U64(buf, i + 1)[0]
            i += 9
        else:
            i = _skip_checked(buf, i, stop, _SPAN_WIRE)
    if trace_id is None or len(trace_id) != 16 or trace_id == _ZERO_TRACE_ID:
        _id(trace_id, 16, "trace_id")  # raises
    if span_id is None or len(span_id) != 8 or span_id == _ZERO_SPAN_ID:
        _id(span_id, 8, "span_id")
    if parent and (len(parent) != 8 or parent == _ZERO_SPAN_ID):
        _id(parent, 8, "parent_span_id")
    return (begin, trace_id.hex(), span_id.hex(), parent.hex(), state.decode() if state else "",
            name.decode(), SPAN_KINDS.get(kind, ""), service, resource, scope_name, scope_version,
            attrs, max(end - begin, 0), STATUS_CODES.get(status[0], ""), status[1],
            *(_events(buf, events) if events else _NO_EVENTS), *(_links(buf, links) if links else _NO_LINKS))


def _skip_checked(buf: bytes, i: int, stop: int, wire_of: dict) -> int:
    """Skips one field starting at `i` (its tag), refusing a known field with the wrong wire type."""
    for field, wire, _ in _fields(buf, i, _field_end(buf, i, stop)):
        if wire_of.get(field, wire) != wire:
            raise InvalidSpans(f"field {field}: wrong wire type {wire}")
    return _field_end(buf, i, stop)


def _field_end(buf: bytes, i: int, stop: int) -> int:
    tag, i = _varint(buf, i)
    if tag > _MAX_TAG:
        raise InvalidSpans("field number out of range")
    wire = tag & 7
    if wire == _VARINT:
        return _varint(buf, i)[1]
    if wire == _LEN:
        length, i = _varint(buf, i)
        end = i + length
    elif wire in (_I64, _I32):
        end = i + (8 if wire == _I64 else 4)
    else:
        raise InvalidSpans(f"unsupported wire type {wire}")
    if end > stop:
        raise InvalidSpans("field runs past its message")
    return end


def _status(buf, start, stop, code: int, message: str) -> tuple[int, str]:
    """Code and message, over those of an earlier occurrence (protobuf merges repeated messages)."""
    for field, wire, val in _fields(buf, start, stop):
        if field == 2:
            _expect(wire, _LEN, "status.message")
            message = _text(buf, val)
        elif field == 3:
            _expect(wire, _VARINT, "status.code")
            code = val
    return code, message


_EVENT_WIRE = {1: _I64, 2: _LEN, 3: _LEN, 4: _VARINT}


def _events(buf, events: list) -> tuple[list, list, list]:
    """Inlined like `_span`: 0x09 time (fixed64), 0x12 name, 0x1A attributes."""
    times, names, attrs = [], [], []
    cache = _KV_CACHE
    for i, stop in events:
        time_ns, name, kvs = 0, "", {}
        while i < stop:
            tag = buf[i]
            if tag == 0x1A or tag == 0x12:
                length = buf[i + 1]
                if length < 0x80:
                    i += 2
                else:
                    length, i = _varint(buf, i + 1)
                j = i + length
                if j > stop:
                    raise InvalidSpans("length-delimited field runs past its event")
                if tag == 0x1A:
                    raw = buf[i:j]
                    key, value = cache.get(raw) or _key_value(raw)
                    kvs[key] = value
                else:
                    name = buf[i:j].decode()
                i = j
            elif tag == 0x09:
                if i + 9 > stop:
                    raise InvalidSpans("truncated event time")
                time_ns = _U64(buf, i + 1)[0]
                i += 9
            else:
                i = _skip_checked(buf, i, stop, _EVENT_WIRE)
        times.append(time_ns)
        names.append(name)
        attrs.append(kvs)
    return times, names, attrs


def _links(buf, links: list) -> tuple[list, list, list, list]:
    trace_ids, span_ids, states, attrs = [], [], [], []
    for start, stop in links:
        trace_id = span_id = None
        state, kvs = "", []
        for field, wire, val in _fields(buf, start, stop):
            if field in (1, 2, 3, 4):
                _expect(wire, _LEN, "link field")
            if field == 1:
                trace_id = _id(buf[val[0]:val[1]], 16, "link trace_id")
            elif field == 2:
                span_id = _id(buf[val[0]:val[1]], 8, "link span_id")
            elif field == 3:
                state = _text(buf, val)
            elif field == 4:
                kvs.append(val)
        if trace_id is None or span_id is None:
            raise InvalidSpans("a link needs a trace_id and a span_id")
        trace_ids.append(trace_id), span_ids.append(span_id), states.append(state)
        attrs.append(_attributes(buf, kvs))
    return trace_ids, span_ids, states, attrs
