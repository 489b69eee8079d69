"""Row rendering: attribute strings as pdata's AsString writes them, and the C wire decoder checked
against the upb-parsed message on generated requests; malformed bytes only ever raise InvalidSpans."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList

from phaselens.collectors import render
from phaselens.collectors.attr_string import as_string, go_float
from tests.rowbinary import read_rows, uleb


@pytest.mark.parametrize(
    "value,text",
    [
        (1.0, "1"),
        (0.1, "0.1"),
        (-0.0, "-0"),
        (0.0, "0"),
        (2.5, "2.5"),
        (1e-7, "1e-7"),
        (1.5e-7, "1.5e-7"),
        (1e-6, "0.000001"),
        (1e20, "100000000000000000000"),
        (1e21, "1e+21"),
        (1.234e300, "1.234e+300"),
        (123456789.125, "123456789.125"),
        (1e16, "10000000000000000"),
        (0.00001234, "0.00001234"),
        (float("nan"), "json: unsupported value: NaN"),
        (float("inf"), "json: unsupported value: +Inf"),
    ],
)
def test_go_float(value, text):
    assert go_float(value) == text


def test_any_value_strings():
    kvlist = KeyValueList(
        values=[KeyValue(key="z", value=AnyValue(int_value=1)), KeyValue(key="a", value=AnyValue(string_value="<&>"))]
    )
    array = ArrayValue(
        values=[AnyValue(double_value=1.0), AnyValue(bytes_value=b"\xff"), AnyValue(kvlist_value=kvlist), AnyValue()]
    )
    assert as_string(AnyValue(array_value=array)) == '[1,"/w==",{"a":"\\u003c\\u0026\\u003e","z":1},null]'
    assert as_string(AnyValue(bytes_value=b"\x01\x02")) == "AQI="
    assert as_string(AnyValue(bool_value=False)) == "false"
    assert as_string(AnyValue(int_value=-(2**63))) == str(-(2**63))
    assert as_string(AnyValue()) == ""
    nan_in_array = ArrayValue(values=[AnyValue(double_value=float("nan"))])
    assert as_string(AnyValue(array_value=nan_in_array)) == ""  # Go's json.Marshal fails: empty


_text = st.text(max_size=8)
_scalar = st.one_of(
    st.builds(lambda v: AnyValue(string_value=v), _text),
    st.builds(lambda v: AnyValue(int_value=v), st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda v: AnyValue(double_value=v), st.floats(allow_nan=False)),
    st.builds(lambda v: AnyValue(bool_value=v), st.booleans()),
    st.builds(lambda v: AnyValue(bytes_value=v), st.binary(max_size=6)),
)
_value = st.one_of(
    _scalar, st.builds(lambda vs: AnyValue(array_value=ArrayValue(values=vs)), st.lists(_scalar, max_size=3))
)
_attrs = st.lists(st.builds(lambda k, v: KeyValue(key=k, value=v), _text, _value), max_size=4)
_trace_id = st.binary(min_size=16, max_size=16).filter(any)
_span_id = st.binary(min_size=8, max_size=8).filter(any)


@st.composite
def _requests(draw) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = request.resource_spans.add()
        rs.resource.attributes.extend(draw(_attrs))
        if draw(st.booleans()):
            rs.resource.attributes.add(key="service.name", value=AnyValue(string_value=draw(_text)))
        ss = rs.scope_spans.add()
        ss.scope.name, ss.scope.version = draw(_text), draw(_text)
        for _ in range(draw(st.integers(0, 3))):
            start = draw(st.integers(0, 2**63))
            span = ss.spans.add(
                trace_id=draw(_trace_id),
                span_id=draw(_span_id),
                name=draw(_text),
                trace_state=draw(_text),
                kind=draw(st.integers(0, 7)),
                start_time_unix_nano=start,
                end_time_unix_nano=draw(st.integers(0, 2**64 - 1)),
            )
            if draw(st.booleans()):
                span.parent_span_id = draw(_span_id)
            span.attributes.extend(draw(_attrs))
            span.status.code, span.status.message = draw(st.integers(0, 3)), draw(_text)
            for _ in range(draw(st.integers(0, 2))):
                span.events.add(
                    time_unix_nano=draw(st.integers(0, 2**64 - 1)), name=draw(_text), attributes=draw(_attrs)
                )
            for _ in range(draw(st.integers(0, 2))):
                span.links.add(
                    trace_id=draw(_trace_id), span_id=draw(_span_id), trace_state=draw(_text), attributes=draw(_attrs)
                )
    return request


def _reference(request: ExportTraceServiceRequest) -> list[tuple]:
    """The same rendering, straight from the upb-parsed message."""

    def attrs(kvs):
        return {kv.key: as_string(kv.value) for kv in kvs}

    rows = []
    for rs in request.resource_spans:
        resource = attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                rows.append(
                    (
                        s.start_time_unix_nano,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.trace_state,
                        s.name,
                        render.SPAN_KINDS.get(s.kind, ""),
                        resource.get("service.name", ""),
                        resource,
                        ss.scope.name,
                        ss.scope.version,
                        attrs(s.attributes),
                        max(s.end_time_unix_nano - s.start_time_unix_nano, 0),
                        render.STATUS_CODES.get(s.status.code, ""),
                        s.status.message,
                        [e.time_unix_nano for e in s.events],
                        [e.name for e in s.events],
                        [attrs(e.attributes) for e in s.events],
                        [lk.trace_id.hex() for lk in s.links],
                        [lk.span_id.hex() for lk in s.links],
                        [lk.trace_state for lk in s.links],
                        [attrs(lk.attributes) for lk in s.links],
                    )
                )
    return rows


def _rows(request: ExportTraceServiceRequest) -> list[tuple]:
    block, count = render.render(request.SerializeToString())
    rows = read_rows(block)
    assert count == len(rows)
    return rows


@settings(max_examples=150, deadline=None)
@given(request=_requests())
def test_wire_decoder_matches_the_parsed_message(request):
    assert _rows(request) == _reference(request)


@settings(max_examples=60, deadline=None)
@given(request=_requests(), slots=st.integers(1, 5))
def test_rows_split_by_trace_keep_every_row_once_and_each_trace_in_one_slot(request, slots):
    """Where each slot goes is checked against ClickHouse's own placement in tests/test_cluster.py."""
    payload = request.SerializeToString()
    parts, count = render.render_slots(payload, slots)
    split = [read_rows(part) for part in parts]
    assert len(parts) == slots and count == sum(map(len, split))
    assert sorted(map(repr, (r for rows in split for r in rows))) == sorted(map(repr, _rows(request)))
    slot_of = {}
    for slot, rows in enumerate(split):
        for row in rows:
            assert slot_of.setdefault(row[1], slot) == slot  # row[1]: TraceId
    if slots == 1:
        assert parts == [render.render(payload)[0]]


def test_slot_count_is_checked():
    with pytest.raises(ValueError, match="slots"):
        render.render_slots(b"", 5000)


def _accepted_only_if_protobuf_accepts(data: bytes) -> None:
    try:
        render.count_spans(data)
    except render.InvalidSpans:
        return
    ExportTraceServiceRequest.FromString(data)  # what we accepted, protobuf accepts too


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_malformed_bytes_raise_only_invalid_spans(data):
    _accepted_only_if_protobuf_accepts(data)


@settings(max_examples=150, deadline=None)
@given(request=_requests(), position=st.integers(0, 10_000), byte=st.integers(0, 255), cut=st.booleans())
def test_corrupted_requests_raise_only_invalid_spans(request, position, byte, cut):
    data = bytearray(request.SerializeToString())
    if data:
        position %= len(data)
        data = data[:position] if cut else data[:position] + bytes([byte]) + data[position + 1 :]
    _accepted_only_if_protobuf_accepts(bytes(data))


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda s: setattr(s, "trace_id", b"\x01" * 15), "trace_id"),
        (lambda s: setattr(s, "trace_id", bytes(16)), "trace_id"),
        (lambda s: setattr(s, "span_id", b""), "span_id"),
        (lambda s: setattr(s, "parent_span_id", b"\x01" * 4), "parent_span_id"),
        (lambda s: s.links.add(trace_id=b"\x01" * 16, span_id=b"\x02"), "link span_id"),
    ],
)
def test_invalid_ids_are_refused(mutate, message):
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    mutate(span)
    with pytest.raises(render.InvalidSpans, match=message):
        render.count_spans(request.SerializeToString())


@pytest.mark.parametrize(
    "value",
    [
        AnyValue(),
        AnyValue(string_value=""),
        AnyValue(string_value="k" * 200),
        AnyValue(string_value="é漢🙂"),
        AnyValue(int_value=0),
        AnyValue(int_value=-1),
        AnyValue(int_value=2**63 - 1),
        AnyValue(int_value=-(2**63)),
        AnyValue(bool_value=True),
        AnyValue(bool_value=False),
        AnyValue(double_value=-0.0),
        AnyValue(double_value=1e-7),
        AnyValue(bytes_value=b"\x00"),
        AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1)])),
    ],
)
@pytest.mark.parametrize("key", ["", "gen_ai.request.model", "k" * 130])
def test_attribute_read_directly_or_through_anyvalue_renders_alike(key, value):
    """Scalars and bytes are rendered in C; arrays through Python's AnyValue."""
    request = ExportTraceServiceRequest()
    span = request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    span.attributes.add(key=key, value=value)
    assert _rows(request)[0][11] == {key: as_string(value)}


def test_every_occurrence_of_a_repeated_message_is_validated():
    """Protobuf merges a repeated singular message (resource, scope, status), so it parses each:
    a malformed first occurrence must be refused even when a later one is valid."""
    malformed_kv = b"\x0a\x05" + b"0" * 5  # a Resource whose attribute is a truncated varint
    resource_spans = b"\x0a\x07" + malformed_kv + b"\x0a\x00"
    with pytest.raises(render.InvalidSpans):
        render.count_spans(b"\x0a" + bytes([len(resource_spans)]) + resource_spans)
    with pytest.raises(DecodeError):
        ExportTraceServiceRequest.FromString(b"\x0a" + bytes([len(resource_spans)]) + resource_spans)


def _one_span(**fields) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, **fields)
    return request


@settings(max_examples=300, deadline=None)
@given(value=st.floats())
def test_doubles_render_as_go_writes_them(value):
    request = _one_span(attributes=[KeyValue(key="x", value=AnyValue(double_value=value))])
    assert _rows(request)[0][11] == {"x": go_float(value)}


def _request_of(span: bytes) -> bytes:
    """A serialized span (which may hold what protobuf would never write) in a request."""
    scope_spans = b"\x12" + uleb(len(span)) + span
    resource_spans = b"\x12" + uleb(len(scope_spans)) + scope_spans
    return b"\x0a" + uleb(len(resource_spans)) + resource_spans


_IDS = b"\x0a\x10" + b"\x01" * 16 + b"\x12\x08" + b"\x02" * 8


def test_enum_varints_longer_than_32_bits_keep_their_low_bits():
    """SpanKind and StatusCode are int32 enums: protobuf reads 2**32 + 2 as 2 (Server, Error)."""
    long_two = uleb(2**32 + 2)
    status = b"\x18" + long_two
    data = _request_of(_IDS + b"\x30" + long_two + b"\x7a" + uleb(len(status)) + status)
    parsed = ExportTraceServiceRequest.FromString(data).resource_spans[0].scope_spans[0].spans[0]
    assert (parsed.kind, parsed.status.code) == (2, 2)
    row = read_rows(render.render(data)[0])[0]
    assert (row[6], row[13]) == ("Server", "Error")


def test_a_repeated_key_keeps_its_first_place_and_last_value():
    kvs = [KeyValue(key=k, value=AnyValue(int_value=i)) for i, k in enumerate("abacb")]
    assert list(_rows(_one_span(attributes=kvs))[0][11].items()) == [("a", "2"), ("b", "4"), ("c", "3")]


def test_many_attributes_and_events():
    """Above 64 entries a map's repeated keys are found by a hash index: same rows."""
    kvs = [KeyValue(key=f"k{i % 250}", value=AnyValue(string_value=str(i))) for i in range(300)]
    request = _one_span(attributes=kvs)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    for i in range(50):
        span.events.add(time_unix_nano=i, name=f"e{i}", attributes=kvs[:i])
    assert _rows(request) == _reference(request)


def test_a_million_attributes_of_one_key_take_linear_time():
    kv = KeyValue(key="k", value=AnyValue(int_value=7)).SerializeToString()
    row = read_rows(render.render(_request_of(_IDS + (b"\x4a" + uleb(len(kv)) + kv) * 1_000_000))[0])[0]
    assert row[11] == {"k": "7"}


def test_rows_that_would_outgrow_their_request_are_refused():
    """1 MB of resource attributes repeated over 300 spans would be 300 MB of rows."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="big", value=AnyValue(string_value="x" * (1 << 20)))
    for i in range(300):
        rs.scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=(i + 1).to_bytes(8, "big"))
    with pytest.raises(render.InvalidSpans, match="would exceed 256 MiB"):
        render.count_spans(request.SerializeToString())
    del rs.scope_spans[200:]  # 200 MB: within the bound
    assert render.count_spans(request.SerializeToString()) == 200


def test_merged_attribute_values_render_as_protobuf_merges_them():
    """A KeyValue whose `value` occurs twice: protobuf merges the two AnyValues (arrays concatenate)."""
    first = AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1)])).SerializeToString()
    second = AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="x")])).SerializeToString()
    kv = b"\x0a\x01k" + b"\x12" + bytes([len(first)]) + first + b"\x12" + bytes([len(second)]) + second
    request = _one_span()
    request.resource_spans[0].scope_spans[0].spans[0].attributes.add().MergeFromString(kv)
    assert _rows(request) == _reference(request)
    assert _rows(request)[0][11] == {"k": '[1,"x"]'}


@pytest.mark.parametrize(
    "where",
    [
        "span name",
        "scope attribute key",
        "resource schema_url",
        "entity_ref",
        "event name",
        "link trace_state",
        "attribute value",
        "status message",
    ],
)
def test_invalid_utf8_is_refused_wherever_protobuf_refuses_it(where):
    """The request is built with the placeholder "~~" in one string field, then the placeholder's
    bytes become an overlong "/" (0xC0 0xAF): not UTF-8."""
    request = _one_span()
    rs = request.resource_spans[0]
    span = rs.scope_spans[0].spans[0]
    if where == "span name":
        span.name = "~~"
    elif where == "scope attribute key":
        rs.scope_spans[0].scope.attributes.add(key="~~")
    elif where == "resource schema_url":
        rs.schema_url = "~~"
    elif where == "entity_ref":
        rs.resource.entity_refs.add(type="~~")
    elif where == "event name":
        span.events.add(name="~~")
    elif where == "link trace_state":
        span.links.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, trace_state="~~")
    elif where == "status message":
        span.status.message = "~~"
    else:
        span.attributes.add(key="k", value=AnyValue(string_value="~~"))
    data = request.SerializeToString()
    assert data.count(b"~~") == 1
    data = data.replace(b"~~", b"\xc0\xaf")
    with pytest.raises(DecodeError):
        ExportTraceServiceRequest.FromString(data)
    with pytest.raises(render.InvalidSpans, match="UTF-8"):
        render.count_spans(data)


def test_absurdly_nested_attribute_values_are_refused():
    raw = AnyValue(int_value=1).SerializeToString()
    for _ in range(200):  # arrays in arrays, beyond protobuf's recursion limit of 100
        inner = b"\x0a" + uleb(len(raw)) + raw
        raw = b"\x2a" + uleb(len(inner)) + inner
    kv = b"\x0a\x04deep\x12" + uleb(len(raw)) + raw
    with pytest.raises(render.InvalidSpans, match="malformed attribute value"):
        render.count_spans(_request_of(_IDS + b"\x4a" + uleb(len(kv)) + kv))


def test_decoding_keeps_no_memory_on_any_path():
    """The C decoder allocates with PyMem, which tracemalloc traces: after accepting and refusing
    thousands of mutated requests (every error path), nothing it allocated is still held."""
    import random
    import tracemalloc

    from tests.fuzz_render import _mutate, _seeds

    rng, seeds = random.Random(3), _seeds()
    inputs = [_mutate(rng, bytearray(rng.choice(seeds))) for _ in range(3000)] + seeds

    def decode_all() -> int:
        refused = 0
        for data in inputs:
            try:
                render.render(data)
            except render.InvalidSpans:
                refused += 1
        return refused

    decode_all()  # warm caches (protobuf's, Python's) first
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        refused = decode_all()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < refused < len(inputs)
    assert held < 16 << 10, f"{held} bytes still held"
