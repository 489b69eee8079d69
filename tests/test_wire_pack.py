"""The shipper's packer (`wire.pack`, C) writes exactly the frames of the layout's reference
encoders (`wire.encode_request` / `wire.encode_step`), for any field values a record may hold,
counts the steps with no sampled member and the records that do not marshal, and loses no other."""

from __future__ import annotations

import marshal
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from phaselens.instrumentation.hotpath.records import (
    HttpFacts,
    KvStamps,
    RequestInfo,
    RequestOutcome,
    RequestRecord,
    SpanIds,
    StepRecord,
    int64s,
)
from phaselens.instrumentation.process import wire

INTS = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**130), 2**130),
    st.sampled_from([0, -1, 2**31, -(2**31) - 1, 2**15, 2**30, 2**45, 2**63 - 1, -(2**63), 2**64, 2**128 - 1]),
)
TEXT = st.one_of(st.text(max_size=8), st.sampled_from(["", "length", "POST", "\ud800", "é"]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, TEXT, st.floats(allow_nan=False), st.binary(max_size=8))
PROMPT = st.one_of(st.none(), TEXT, st.lists(st.dictionaries(TEXT, TEXT, max_size=2), max_size=2))
STAMPS = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6).map(lambda v: int64s(array("q", v).tobytes()))
LINKS = st.lists(st.binary(min_size=25, max_size=25), max_size=6).map(b"".join)  # as the loop packs them


def ids() -> st.SearchStrategy[SpanIds]:
    return st.builds(SpanIds, INTS, INTS, INTS, TEXT)


REQUESTS = st.builds(
    lambda root, parent, stamps, visible, reason, timelines, info, outcome, http, kv: RequestRecord(
        root, parent, *stamps, visible, reason, *timelines, info, outcome, http, kv
    ),
    ids(),
    st.none() | ids(),
    st.lists(INTS, min_size=11, max_size=11),
    INTS,
    TEXT,
    st.lists(STAMPS, min_size=5, max_size=5),
    st.none()
    | st.builds(
        RequestInfo, TEXT, TEXT, st.none() | TEXT, SCALARS, SCALARS, SCALARS, SCALARS, SCALARS, SCALARS, SCALARS, PROMPT
    ),
    st.builds(RequestOutcome, SCALARS, SCALARS, SCALARS, SCALARS, st.none() | TEXT, SCALARS, SCALARS),
    st.builds(HttpFacts, TEXT, TEXT, st.none() | TEXT, SCALARS, SCALARS, st.booleans(), SCALARS, SCALARS),
    st.none() | st.builds(KvStamps, INTS, INTS, INTS, st.none() | INTS, INTS, INTS, INTS, st.none() | INTS),
)
STEPS = st.builds(lambda stats, links: StepRecord(*stats, links), st.lists(INTS, min_size=10, max_size=10), LINKS)


def reference(records: list) -> tuple[bytes, list[int], int]:
    """The frames the Python encoders write, their ends, and the steps they would not ship."""
    frames, unsampled = [], 0
    for record in records:
        if isinstance(record, RequestRecord):
            frames.append(wire.encode_request(record))
        elif record.links:
            frames.append(wire.encode_step(record))
        else:
            unsampled += 1
    ends, end = [], 0
    for frame in frames:
        end += len(frame)
        ends.append(end)
    return b"".join(frames), ends, unsampled


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(REQUESTS, STEPS), max_size=6))
def test_pack_writes_the_reference_frames(records):
    data, ends, unsampled = reference(records)
    packed = wire.pack(records)
    assert (packed.data, list(packed.ends), packed.unsampled, packed.errors) == (data, ends, unsampled, 0)


def test_frames_read_back_as_the_records():
    info = RequestInfo("chat", "tiny", "r1", 3, 4, 0.5, None, 2, 7, True, [{"role": "user", "content": "hé"}])
    request = RequestRecord(
        SpanIds(2**127 + 5, 2**63 + 1, 1), None, *range(11), 2, "length", *[int64s(array("q", [1, -2]).tobytes())] * 5,
        info, RequestOutcome(2, "stop"), HttpFacts("POST", "/v1"),
    )  # fmt: skip
    link = b"\x01" * 25
    packed = wire.pack([request, StepRecord(*range(9), 3, link + link)])
    first, second = bytes(packed.data[: packed.ends[0]]), bytes(packed.data[packed.ends[0] :])
    assert wire.decode_request(marshal.loads(first[wire.HEADER.size :])) == request
    assert wire.HEADER.unpack(second[: wire.HEADER.size]) == (len(second) - wire.HEADER.size, wire.KIND_STEP)
    assert marshal.loads(second[wire.HEADER.size :]) == (*range(9), 3, link + link)


def test_records_that_do_not_marshal_are_counted_and_the_others_kept():
    good = StepRecord(*range(9), 1, b"\x02" * 25)
    unmarshallable = RequestRecord(
        SpanIds(1, 2, 1), None, *range(11), 0, "", *[int64s(b"")] * 5,
        RequestInfo("chat", "tiny", prompt=object()), RequestOutcome(), HttpFacts(),
    )  # fmt: skip
    bad_link = StepRecord(*range(9), 1, "not bytes")
    packed = wire.pack([unmarshallable, good, bad_link, "not a record", StepRecord(*range(9), 2, b"")])
    assert (packed.data, list(packed.ends)) == (wire.encode_step(good), [len(wire.encode_step(good))])
    assert (packed.unsampled, packed.errors) == (1, 3)


def decoded(decode, fields) -> tuple:
    """(the record with each nested record's type, or the error's type)."""
    try:
        record = decode(fields)
    except Exception as exc:  # noqa: BLE001 — the error is what is compared
        return ("error", type(exc))
    return record, [type(field) for field in record]


ODD_FIELDS = st.sampled_from([None, 1, "x", b"1234567", [1, 2], (1,), ()])


@settings(max_examples=300, deadline=None)
@given(REQUESTS, st.none() | st.tuples(st.integers(0, 23), ODD_FIELDS), st.integers(0, 2))
def test_a_request_frame_decodes_in_c_as_in_python(request, odd, cut):
    """Any request's frame fields, or one field replaced by an odd value, or the tuple cut: the C
    decoder's record (or the Python one's where it gives the fields back) equals the Python
    decoder's, nested types included, or both fail alike (then counted in decode_errors)."""
    fields = marshal.loads(wire.encode_request(request)[wire.HEADER.size :])
    if odd is not None:
        fields = (*fields[: odd[0]], odd[1], *fields[odd[0] + 1 :])
    fields = fields[: len(fields) - cut]
    assert decoded(wire.decode_request, fields) == decoded(wire.decode_request_fields, fields)
    if odd is None and not cut:
        assert wire.decode_request(fields) == request
