"""The byte format between the serving process and the span-builder process (`builder="process"`).

A stream of frames, each `<u32 payload length><u8 kind><payload>`; the payload is a `marshal`ed
(format version 2) tuple of ints, strings, floats, None, bytes and tuples — a record's fields in
declaration order, nested records as tuples of theirs, timelines as their int64 bytes:

    HELLO    (service_name, anchor_mono_ts, anchor_wall_ts, token_events, interval_s)    first, once
    REQUEST  record.RequestRecord
    STEP     records.StepRecord  (its stats, the batch size, and its sampled members' links,
                                 records.pack_link, 25 bytes each, in one bytes: packed by the loop)
    FLUSH    (sequence,)   the child exports what it has built and acks `sequence`

The shipper writes a drain's records with `pack` (C, `_wire_pack.c`): the same bytes as
`encode_request` / `encode_step` (the layout's reference, `tests/test_wire_pack.py`), all frames in
one bytes.

The span-builder process reads them with `split_runs` (C): `split_frames`'s frames, a run of step
frames decoded as one item; a request frame's record is made by `decode_request` (C for the usual
form).

The child answers on its own pipe with one JSON line of counters per report (see builder_child).
"""

from __future__ import annotations

import marshal
import struct
from dataclasses import dataclass
from typing import Any

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
from phaselens.instrumentation.pipeline.spans import PackedStep
from phaselens.instrumentation.process import _wire_pack

HEADER = struct.Struct("<IB")
# version 2: no back-references (3+ look every object written up in a table: more instructions per frame)
MARSHAL_VERSION = 2
KIND_HELLO, KIND_REQUEST, KIND_STEP, KIND_FLUSH = 1, 2, 3, 4
_TIMELINES = RequestRecord._fields.index("waits")  # a request's fields from `waits` on: 5 timelines, 4 records
_STEP_FIELDS = len(PackedStep._fields)


def frame(kind: int, fields: tuple[Any, ...]) -> bytes:
    payload = marshal.dumps(fields, MARSHAL_VERSION)
    return HEADER.pack(len(payload), kind) + payload


def hello(service_name: str, anchor_mono_ts: int, anchor_wall_ts: int, token_events: bool, interval_s: float) -> bytes:
    """The first frame: `interval_s` is the shipper's (`process_sink.wait_interval_s`), the child's
    checkpoints follow it."""
    return frame(KIND_HELLO, (service_name, anchor_mono_ts, anchor_wall_ts, token_events, interval_s))


def _plain(record: Any) -> tuple[Any, ...] | None:
    """A NamedTuple as a plain tuple (marshal takes exact tuples only)."""
    return None if record is None else tuple(record)


def encode_request(record: RequestRecord) -> bytes:
    root, parent, *timeline, info, outcome, http, kv = record
    fields = (tuple(root), _plain(parent), *timeline, _plain(info), tuple(outcome), tuple(http), _plain(kv))
    return frame(KIND_REQUEST, fields)


def encode_step(step: StepRecord) -> bytes:
    """The record as it is: its links are one bytes (packed by the loop), which marshals in fewer
    instructions than 64, and the child then reads one object, not 64."""
    return frame(KIND_STEP, tuple(step))


@dataclass(slots=True)
class Packed:
    """A drain's records as frames: `data` the frames end to end, `ends` each one's end offset in
    it; `unsampled` steps not written (no sampled member), `errors` records whose fields do not
    marshal (lost, counted by the caller)."""

    data: bytes
    ends: memoryview  # format "I"
    unsampled: int
    errors: int


def pack(records: list[Any]) -> Packed:
    """`records` (RequestRecords and StepRecords) as `encode_request` / `encode_step` would frame
    them, in one C call."""
    data, ends, unsampled, errors = _wire_pack.pack(records, RequestRecord, StepRecord)
    return Packed(data, memoryview(ends).cast("I"), unsampled, errors)


_new_tuple = tuple.__new__


_REQUEST_TYPES = (RequestRecord, SpanIds, RequestInfo, RequestOutcome, HttpFacts, KvStamps)


def decode_request(fields: tuple[Any, ...]) -> RequestRecord:
    """The record `encode_request` wrote: in C (`_wire_pack.decode_request`) for fields of the usual
    form, else `decode_request_fields`."""
    record = _wire_pack.decode_request(fields, _REQUEST_TYPES)
    return record if record is not None else decode_request_fields(fields)


def decode_request_fields(fields: tuple[Any, ...]) -> RequestRecord:
    """Each record type made with tuple.__new__ from the full field tuple `encode_request` wrote
    (no NamedTuple __new__ frame: five or six a request); a tuple of another length is a ValueError."""
    waits, chunks, token_ts, token_n, sends, info, outcome, http, kv = fields[_TIMELINES:]
    parent = fields[1]
    ids = (_new_tuple(SpanIds, fields[0]), _new_tuple(SpanIds, parent) if parent is not None else None)
    rest = (
        int64s(waits),
        int64s(chunks),
        int64s(token_ts),
        int64s(token_n),
        int64s(sends),
        _new_tuple(RequestInfo, info) if info is not None else None,
        _new_tuple(RequestOutcome, outcome),
        _new_tuple(HttpFacts, http),
        _new_tuple(KvStamps, kv) if kv is not None else None,
    )
    # concatenated, the stamps sliced: ~15 % faster than a starred display (a list built, then copied)
    return _new_tuple(RequestRecord, ids + fields[2:_TIMELINES] + rest)


def decode_step(fields: tuple[Any, ...]) -> PackedStep:
    if len(fields) != _STEP_FIELDS or not isinstance(fields[-1], bytes):
        raise ValueError("a step frame: PackedStep's fields expected")
    return _new_tuple(PackedStep, fields)


def split_frames(data: bytes) -> tuple[list[tuple[int, tuple[Any, ...]]], int]:
    """The whole frames at the start of `data` as (kind, fields), and how many bytes they take (a
    frame cut at the end is left out)."""
    frames = []
    view, end, offset, size = memoryview(data), len(data), 0, HEADER.size
    unpack, loads = HEADER.unpack_from, marshal.loads
    while offset + size <= end:
        length, kind = unpack(data, offset)
        stop = offset + size + length
        if stop > end:
            break
        frames.append((kind, loads(view[offset + size : stop])))
        offset = stop
    return frames, offset


def split_runs(data: bytes) -> tuple[list[tuple[int, Any]], int]:
    """`split_frames` for the span-builder process (C, `_wire_pack.split_runs`): the same frames
    and bytes used, except that each run of consecutive step frames is one item (KIND_STEP,
    (steps, undecoded)): its frames' `decode_step`s, and how many of them it refused."""
    return _wire_pack.split_runs(data, PackedStep, decode_step)
