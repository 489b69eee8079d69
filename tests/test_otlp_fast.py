"""The fast span backend (otlp_fast, the C encoder _otlp_encode) against the SDK backend: the same
records give the same OTLP, field by field; into the real collector and ClickHouse the same rows;
a dead endpoint is counted, never raised; a provider the user brought keeps the SDK path."""

from __future__ import annotations

import gzip
import itertools
import random
import threading
import time
from array import array
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from phaselens.collectors import schema
from phaselens.collectors.service import Collector
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.observer import NULL_REQUEST
from phaselens.instrumentation.hotpath.records import NO_OUTCOME, RequestInfo, RequestRecord, StepStats, int64s
from phaselens.instrumentation.pipeline import otel_setup
from phaselens.instrumentation.pipeline._otlp_encode import (
    encode_phases,
    encode_root,
    encode_spans,
    encode_step,
    encode_steps,
)
from phaselens.instrumentation.pipeline.builder import SpanBuilder
from phaselens.instrumentation.pipeline.emitter import SpanEmitter
from phaselens.instrumentation.pipeline.genai_metrics import GenAiServerMetrics
from phaselens.instrumentation.pipeline.http_transport import HttpClientTransport
from phaselens.instrumentation.pipeline.otlp_fast import (
    FastEmitter,
    bytes_exporter,
    limits_tuple,
    request_encoder,
)
from phaselens.instrumentation.pipeline.span_processor import BatchSettings, CountingBatchSpanProcessor
from phaselens.instrumentation.pipeline.spans import (
    KIND_INTERNAL,
    PHASE_KEYS,
    PHASE_NAMES,
    ROOT_SPAN_KEYS,
    STEP_KEYS,
    PackedStep,
    SpanData,
    compact_summary,
    step_span,
)
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from tests.collector_fixtures import rows, wait_rows
from tests.dead_collectors import closed_port
from tests.fuzz_encode import (
    DrawnIds,
    FixedIds,
    WordIds,
    phase_arguments,
    phase_case,
    phase_spans,
    root_arguments,
    root_case,
    root_reference,
    word_bits,
)
from tests.instrumentation_fixtures import WALL_BASE_NS, ScriptedClock, http_scope, make_rig, script_request


class CountingIds(IdGenerator):
    """Ids in sequence: two providers given one each produce the same ids for the same records."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self._next)

    def generate_trace_id(self) -> int:
        return (0xABC << 100) + next(self._next)


class RequestsKept(SpanExporter):
    """Keeps each export as ExportTraceServiceRequest bytes: the SDK's encoder, or the fast backend's."""

    def __init__(self, encode=None) -> None:
        self.encode = encode
        self.requests: list[bytes] = []

    def export(self, spans) -> SpanExportResult:
        self.requests.append(self.encode(spans) if self.encode else sdk_encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def provider(service: str = "phaselens-test", ids: IdGenerator | None = None) -> TracerProvider:
    resource = Resource({"service.name": service, "deployment": "ci"})
    return TracerProvider(resource=resource, id_generator=ids or CountingIds())


def fast_builder(emitter, tracer_provider: TracerProvider) -> SpanBuilder:
    """A SpanBuilder over `emitter`, metrics to a provider nobody reads, token events on."""
    return SpanBuilder(emitter, GenAiServerMetrics(MeterProvider(), dict), make_rig().anchor, tracer_provider, True)


def scripted_records() -> list:
    """A traced request (remote parent with trace state, chunked prefill, a preemption, token
    events), a failed one, and steps with a sampled and an unsampled member, as the sink gets them."""
    records: list = []
    rig = make_rig(capture_content=True, token_events=True, poll_interval_s=3600)
    rig.telemetry._closer._submit = records.append
    rig.telemetry.step_observer.submit = records.append
    traced = script_request(rig)
    scope = http_scope(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    scope["headers"].append((b"tracestate", b"vendor=abc,other=1"))
    failed = rig.telemetry.request(scope)
    failed.describe(RequestInfo(names.OP_TEXT_COMPLETION, "tiny", prompt=[{"role": "user", "content": "hi"}]))
    failed.enqueued()
    failed.fail("ValueError", status_code=400)
    rig.telemetry.step_observer.step(StepStats(2_000_000, 2_010_000, 0, 2, 5, 16, 0, 1), [traced, NULL_REQUEST, failed])
    rig.telemetry.shutdown()
    assert [type(r).__name__ for r in records].count("RequestRecord") == 2
    return records


def build(
    records: list, backend: str, limits: SpanLimits | None = None, ids: IdGenerator | None = None
) -> tuple[list[bytes], dict]:
    """The records through SpanBuilder with the SDK or the fast backend; the export requests made."""
    tracer_provider = provider(ids=ids)
    if backend == "sdk":
        kept = RequestsKept()
        processor: Any = CountingBatchSpanProcessor(kept, BatchSettings(4096, 4096, 3_600_000))
        tracer_provider.add_span_processor(processor)
        emitter: Any = SpanEmitter(tracer_provider.get_tracer(names.SERVER_SCOPE), limits or SpanLimits())
    else:
        kept = RequestsKept(request_encoder(tracer_provider))
        processor = CountingBatchSpanProcessor(kept, BatchSettings(4096, 4096, 3_600_000))
        emitter = FastEmitter(tracer_provider, [processor], limits)
    anchor = make_rig().anchor
    builder = SpanBuilder(emitter, GenAiServerMetrics(MeterProvider(), dict), anchor, tracer_provider, True)
    for record in records:
        builder.build(record)
    processor.force_flush()
    processor.shutdown()
    return kept.requests, {**builder.counters(), **vars_of(processor.counts)}


def vars_of(counts) -> dict:
    return {f"processor_{k}": getattr(counts, k) for k in ("exported", "failed", "dropped")}


def value_of(any_value) -> tuple:
    """(oneof name, value): the type is part of the comparison."""
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return kind, tuple(value_of(v) for v in any_value.array_value.values)
    if kind == "kvlist_value":
        return kind, tuple((kv.key, value_of(kv.value)) for kv in any_value.kvlist_value.values)
    return kind, getattr(any_value, kind) if kind else None


def attributes_of(key_values) -> list:
    return [(kv.key, value_of(kv.value)) for kv in key_values]


def fields_of(request_bytes: bytes) -> list[dict]:
    """Every field of every span, with resource and scope: the form the two paths are compared in."""
    request = ExportTraceServiceRequest.FromString(request_bytes)
    out = []
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    {
                        "resource": attributes_of(rs.resource.attributes),
                        "scope": (ss.scope.name, ss.scope.version, attributes_of(ss.scope.attributes)),
                        "ids": (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.trace_state, s.flags),
                        "name": (s.name, s.kind),
                        "times": (s.start_time_unix_nano, s.end_time_unix_nano),
                        "attributes": attributes_of(s.attributes),
                        "events": [
                            (e.name, e.time_unix_nano, attributes_of(e.attributes), e.dropped_attributes_count)
                            for e in s.events
                        ],
                        "links": [
                            (
                                lk.trace_id.hex(),
                                lk.span_id.hex(),
                                lk.trace_state,
                                lk.flags,
                                attributes_of(lk.attributes),
                            )
                            for lk in s.links
                        ],
                        "status": (s.HasField("status"), s.status.code, s.status.message),
                        "dropped": (s.dropped_attributes_count, s.dropped_events_count, s.dropped_links_count),
                    }
                )
    return out


def test_both_paths_export_the_same_spans_field_by_field():
    records = scripted_records()
    (sdk,), sdk_counts = build(records, "sdk")
    (fast,), fast_counts = build(records, "fast")
    sdk_spans, fast_spans = fields_of(sdk), fields_of(fast)
    assert len(sdk_spans) == 17  # 12 of the traced request, 3 of the failed one, 2 steps
    for sdk_span, fast_span in zip(sdk_spans, fast_spans, strict=True):
        assert fast_span == sdk_span, sdk_span["name"]
    by_name = {s["name"][0]: s for s in fast_spans}
    failed = next(s for s in fast_spans if s["status"][1] == 2)
    assert failed["status"] == (True, 2, "ValueError") and failed["ids"][3] == "vendor=abc,other=1"
    assert failed["ids"][4] == 0x300  # a remote parent
    assert len(by_name[names.SPAN_DECODE]["events"]) == 5 and len(by_name[names.SPAN_ENGINE_STEP]["links"]) == 2
    assert {"string_value", "int_value", "double_value", "bool_value", "array_value"} <= {
        kind for s in fast_spans for _, (kind, _) in s["attributes"]
    }
    assert fast == sdk  # and byte for byte: the SDK's encoder writes fields in the same order
    assert fast_counts == sdk_counts and fast_counts["processor_exported"] == 17


@pytest.mark.parametrize("tail_slo", ["off", "ttft:0.001"])
def test_sampled_out_requests_are_the_same_on_both_paths(monkeypatch, tail_slo):
    """Requests the head sampler left out: the failed one kept whole by the tail rule (tail_error),
    the other a compact record (`off`) or kept for its TTFT (tail_slo); both backends, byte for byte."""
    monkeypatch.setenv(names.ENV_TAIL_SLO, tail_slo)
    records = [
        r._replace(root=r.root._replace(trace_flags=0)) if isinstance(r, RequestRecord) else r
        for r in scripted_records()
    ]
    (sdk,), sdk_counts = build(records, "sdk")
    (fast,), fast_counts = build(records, "fast")
    assert fast == sdk and fast_counts == sdk_counts
    roots = [dict(s["attributes"]) for s in fields_of(fast) if s["name"][1] == 2]
    kept = "tail_slo" if tail_slo != "off" else "none"
    assert sorted(r[names.PL_TRACE_FULL][1] for r in roots) == sorted(["tail_error", kept])
    assert fast_counts["requests_tail"] == (2 if tail_slo != "off" else 1)


def test_the_roots_optional_attributes_are_the_same_on_both_paths_and_in_order():
    """The root's inbound edge, held-back tokens, first chunk and body sends (added only when their
    stamps exist): both paths field by field and byte for byte, each group where request_attributes
    puts it."""
    records = scripted_records()
    at, traced = next((i, r) for i, r in enumerate(records) if isinstance(r, RequestRecord) and r.first_chunk_ts)
    received, first = traced.received_ts, traced.first_chunk_ts
    records[at] = traced._replace(
        arrived_ts=received - 3_000,
        read_ts=received - 1_000,
        visible_tokens=2,
        sends=int64s(array("q", [first, 120, first + 5_000, 480]).tobytes()),
    )
    (sdk,), _ = build(records, "sdk")
    (fast,), _ = build(records, "fast")
    assert fast == sdk
    root = next(s for s in fields_of(fast) if s["name"][1] == 2)
    keys = [key for key, _ in root["attributes"]]
    order = [names.PL_FIRST_CHUNK_MS, names.PL_SERVER_TTFC_MS, names.PL_FIRST_SENDS_NS, names.PL_INBOUND_DISPATCH_MS]
    assert [keys.index(key) for key in order] == sorted(keys.index(key) for key in order)
    attributes = dict(root["attributes"])
    assert attributes[names.PL_FIRST_SENDS_NS] == ("array_value", (("int_value", 0), ("int_value", 5_000)))
    assert attributes[names.PL_INBOUND_MS] == ("double_value", 3_000 / 1e6)
    assert names.PL_HELD_BACK_TOKENS in attributes


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_sdks_random_ids_are_drawn_in_bulk_as_its_generator_draws_them(seed):
    """With the SDK's default generator the fast path draws a request's span ids 8 at a time and a
    step's two ids at once: after the same `random.seed`, each record's spans (ids included) equal
    the SDK path's, which calls `RandomIdGenerator` per id."""
    for record in scripted_records():
        random.seed(seed)
        (sdk,), _ = build([record], "sdk", ids=RandomIdGenerator())
        random.seed(seed)
        (fast,), _ = build([record], "fast", ids=RandomIdGenerator())
        assert fields_of(fast) == fields_of(sdk)
        assert fast == sdk


def test_a_subclass_of_the_default_generator_is_still_called_per_id():
    class OwnIds(RandomIdGenerator):
        drawn = 0

        def generate_span_id(self) -> int:
            OwnIds.drawn += 1
            return (1 << 40) + OwnIds.drawn

    (fast,), _ = build(scripted_records(), "fast", ids=OwnIds())
    own = [int(s["ids"][1], 16) for s in fields_of(fast) if s["name"][0].startswith("llm.")]
    assert OwnIds.drawn >= 12 and len(own) >= 12 and all(span_id >> 40 == 1 for span_id in own)


def test_span_limits_bound_both_paths_alike():
    limits = SpanLimits(
        max_span_attributes=5,
        max_span_attribute_length=3,
        max_events=2,
        max_links=1,
        max_event_attributes=0,
        max_attribute_length=2,
    )
    records = scripted_records()
    (sdk,), _ = build(records, "sdk", limits)
    (fast,), _ = build(records, "fast", limits)
    assert fields_of(fast) == fields_of(sdk)
    decode = next(s for s in fields_of(fast) if s["name"][0] == names.SPAN_DECODE)
    assert decode["dropped"] == (1, 3, 0) and len(decode["attributes"]) == 5
    assert all(len(v) <= 3 for s in fields_of(fast) for _, (k, v) in s["attributes"] if k == "string_value")


ATTRIBUTES = {
    "str": "text",
    "empty": "",
    "unicode": "héllo ✓",
    "true": True,
    "false": False,
    "zero": 0,
    "negative": -7,
    "int64_max": 2**63 - 1,
    "too_big": 2**70,  # no int64: left out by both encoders
    "float": 0.1,
    "bytes": b"\x00\xff",
    "none": None,
    "strings": ["a", "b"],
    "ints": (1, 2, 3),
    "mixed": [1, "a", 2.5, True],
    "nothing": [],
    "map": {"k": "v", "n": {"deep": 1}},
    "": "empty key",  # dropped by both, counted
}


def test_every_attribute_type_encodes_as_the_sdk_encodes_it():
    span = SpanData("typed", KIND_INTERNAL, 1 << 100, 2, None, False, 1, "", 10, 20, dict(ATTRIBUTES))
    tracer_provider = provider()
    emitter = SpanEmitter(tracer_provider.get_tracer(names.SERVER_SCOPE), SpanLimits())
    sdk = sdk_encode_spans([emitter.readable(span)]).SerializeToString()
    fast = request_encoder(tracer_provider)(encode_spans([span], limits_tuple(SpanLimits())))
    assert fields_of(fast) == fields_of(sdk)
    (typed,) = fields_of(fast)
    assert "too_big" not in dict(typed["attributes"]) and typed["dropped"][0] == 1
    assert dict(typed["attributes"])["mixed"] == (
        "array_value",
        (("int_value", 1), ("string_value", "a"), ("double_value", 2.5), ("bool_value", True)),
    )
    assert fast == sdk


def test_bad_descriptions_are_clear_errors_not_crashes():
    limits = limits_tuple(SpanLimits())
    good = SpanData("s", KIND_INTERNAL, 1, 2, None, False, 1, "", 10, 20, {})
    with pytest.raises(TypeError, match="attribute value of type object"):
        encode_spans([good._replace(attributes={"x": object()})], limits)
    with pytest.raises(ValueError, match="trace_id: not an unsigned 128-bit int"):
        encode_spans([good._replace(trace_id=1 << 128)], limits)
    with pytest.raises(ValueError, match="span_id: not an unsigned 64-bit int"):
        encode_spans([good._replace(span_id=-1)], limits)
    with pytest.raises(TypeError, match="expected a SpanData"):
        encode_spans([("too", "short")], limits)
    with pytest.raises(ValueError, match="26 bytes, not a whole number of 25-byte packed links"):
        encode_spans([good._replace(links=b"x" * 26)], limits)


def test_spans_past_the_encoders_stack_buffer_encode_as_the_sdk_encodes_them():
    """The encoder writes into an 8 KiB stack buffer, then the heap: a 30 KB description (entry length
    of three varint bytes) and a 420-link step (14 KB) give the SDK encoder's bytes."""
    span = SpanData(
        "big", KIND_INTERNAL, 1 << 100, 2, 3, False, 1, "", 10, 20, {f"k{i}": "v" * (i * 60) for i in range(32)}
    )
    emitter = SpanEmitter(provider().get_tracer(names.SERVER_SCOPE), SpanLimits(max_span_attribute_length=None))
    limits = limits_tuple(SpanLimits(max_span_attribute_length=None))
    (fast,) = encode_spans([span], limits)
    sdk = sdk_encode_spans([emitter.readable(span)]).resource_spans[0].scope_spans[0].spans[0].SerializeToString()
    assert len(sdk) > 2**14 and fast == b"\x12" + _varint(len(sdk)) + sdk

    links = bytes(random.Random(5).randbytes(25 * 420))
    step = PackedStep(7, 1_000, 9_000, 0, 64, 4, 10, 100, 0, 64, links)
    described = step_span(FixedIds(9, 8), TracerProvider().sampler, ClockAnchor(mono_ts=0, wall_ts=5), step)
    assert described is not None
    unbounded = (-1,) * 7
    encoded = encode_step(
        step, 9, 8, described.start_ts, described.end_ts, names.SPAN_ENGINE_STEP, STEP_KEYS, unbounded
    )
    assert len(encoded) > 8192 and encoded == encode_spans([described], unbounded)[0]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


INT64 = st.integers(-(2**63), 2**63 - 1)
LIMIT = st.one_of(st.just(-1), st.integers(0, 12))


class SeededIds(IdGenerator):
    """Random ids from a fixed seed: two providers make the same ones, and a ratio sampler splits them."""

    def __init__(self) -> None:
        self._random = random.Random(23)

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64)

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128)


@settings(max_examples=300, deadline=None)
@given(
    stats=st.lists(st.one_of(INT64, st.integers(2**63, 2**70)), min_size=8, max_size=8),
    start_ts=st.integers(-(2**62), 2**62),
    duration_ns=st.integers(-(2**62), 2**62 - 1),  # end_ts an int64, as a monotonic stamp is
    links=st.lists(st.binary(min_size=25, max_size=25), max_size=70),
    ids=st.tuples(st.integers(0, 2**128 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    attribute_limit=LIMIT,
    link_limit=LIMIT,
)
def test_encode_step_writes_the_bytes_of_the_step_spans_description(
    stats, start_ts, duration_ns, links, ids, attribute_limit, link_limit
):
    """Any step (ints past int64 left out, negative and zero times, any links) and any limits:
    `encode_step` equals `encode_spans` of `step_span`'s description, byte for byte."""
    step = PackedStep(stats[0], start_ts, start_ts + duration_ns, *stats[1:], b"".join(links))
    trace_id, span_id, wall_offset_ns = ids
    anchor = ClockAnchor(mono_ts=0, wall_ts=wall_offset_ns)
    limits = limits_tuple(SpanLimits(max_span_attributes=attribute_limit, max_links=link_limit))
    span = step_span(FixedIds(trace_id, span_id), TracerProvider().sampler, anchor, step)
    if not links:
        assert span is None
        return
    assert span is not None
    encoded = outcome(
        encode_step, step, trace_id, span_id, span.start_ts, span.end_ts, names.SPAN_ENGINE_STEP, STEP_KEYS, limits
    )
    assert encoded == outcome(lambda: encode_spans([span], limits)[0])  # wall times outside uint64: one error


def outcome(call, *args) -> tuple:
    """A call's result, or its error's type and message."""
    try:
        return ("ok", call(*args))
    except (TypeError, ValueError) as error:
        return (type(error), str(error))


def test_bad_steps_are_clear_errors_not_crashes():
    limits = limits_tuple(SpanLimits())
    step = PackedStep(1, 10, 20, 0, 1, 2, 3, 0, 0, 1, b"l" * 25)
    args = (1, 2, 10, 20, names.SPAN_ENGINE_STEP, STEP_KEYS, limits)
    assert encode_step(step, *args)
    with pytest.raises(TypeError, match="expected a PackedStep"):
        encode_step(step[:-1], *args)
    with pytest.raises(TypeError, match="expected a PackedStep"):
        encode_step(step._replace(links=[b"l" * 25]), *args)
    with pytest.raises(ValueError, match="26 bytes, not a whole number of 25-byte packed links"):
        encode_step(step._replace(links=b"x" * 26), *args)
    with pytest.raises(ValueError, match="start_ts and end_ts must be int64"):
        encode_step(step._replace(end_ts=2**63), *args)
    with pytest.raises(ValueError, match="start_ts and end_ts must be int64"):
        encode_step(step._replace(start_ts=-(2**62), end_ts=2**62), *args)
    with pytest.raises(ValueError, match="start_ts and end_ts must be int64"):
        encode_step(step._replace(start_ts=1.5), *args)
    with pytest.raises(TypeError, match="attribute value of type object"):
        encode_step(step._replace(queue_depth=object()), *args)
    with pytest.raises(ValueError, match="trace_id: not an unsigned 128-bit int"):
        encode_step(step, 1 << 128, *args[1:])
    with pytest.raises(ValueError, match="start_ns: expected an int in"):
        encode_step(step, 1, 2, -1, *args[3:])
    with pytest.raises(TypeError, match="expected 9 attribute keys"):
        encode_step(step, *args[:5], STEP_KEYS[:-1], limits)
    with pytest.raises(TypeError, match="keys: expected non-empty str"):
        encode_step(step, *args[:5], (*STEP_KEYS[:-1], ""), limits)
    with pytest.raises(TypeError, match="limits: expected a 7-tuple"):
        encode_step(step, *args[:6], limits[:-1])
    with pytest.raises(TypeError, match="expected 8 arguments, got 7"):
        encode_step(step, *args[:-1])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="name must be a str and keys a tuple"):
        encode_step(step, *args[:4], b"name", *args[5:])  # type: ignore[arg-type]


def steps_one_at_a_time(steps, random_bits, new_ids, offset_ns: int, limits) -> list[bytes]:
    """The per-step path `encode_steps` replaces: a step with a sampled member (links) gets
    getrandbits(192)'s low 128 bits as its trace id and high 64 as its span id (`new_ids()` without
    `random_bits`, or for a 0), its ends on the wall clock, then `encode_step`."""
    encoded = []
    for step in steps:
        if not step.links:
            continue
        bits = random_bits(192) if random_bits is not None else 0
        trace_id, span_id = bits & ((1 << 128) - 1), bits >> 128
        if not (trace_id and span_id):
            trace_id, span_id = new_ids()
        start_ns, end_ns = step.start_ts + offset_ns, step.end_ts + offset_ns
        encoded.append(
            encode_step(step, trace_id, span_id, start_ns, end_ns, names.SPAN_ENGINE_STEP, STEP_KEYS, limits)
        )
    return encoded


STEP = st.builds(
    lambda stats, start_ts, duration_ns, links: PackedStep(
        stats[0], start_ts, start_ts + duration_ns, *stats[1:], b"".join(links)
    ),
    stats=st.lists(st.one_of(INT64, st.integers(2**63, 2**70)), min_size=8, max_size=8),
    start_ts=st.integers(-(2**62), 2**62),
    duration_ns=st.integers(-(2**62), 2**62 - 1),
    links=st.lists(st.binary(min_size=25, max_size=25), max_size=6),  # none: no sampled member, not built
)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(STEP, max_size=6),
    seed=st.integers(0, 2**32),
    offset_ns=st.one_of(st.integers(0, 2**62), st.integers(-(2**63), 2**63 - 1)),
    attribute_limit=LIMIT,
    link_limit=LIMIT,
    drawn=st.booleans(),
)
def test_encode_steps_writes_the_bytes_of_encode_step_one_step_at_a_time(
    steps, seed, offset_ns, attribute_limit, link_limit, drawn
):
    """Any run of steps (unsampled ones, ints past int64, wall times outside uint64), any limits,
    ids drawn or from `new_ids`: `encode_steps` equals `encode_step` step by step with the ids
    drawn one step at a time, byte for byte; where one fails, both fail."""
    limits = limits_tuple(SpanLimits(max_span_attributes=attribute_limit, max_links=link_limit))
    made = []

    def run(encode, rng: random.Random) -> tuple:
        ids = SeededIds()
        new_ids = lambda: (ids.generate_trace_id(), ids.generate_span_id())  # noqa: E731
        bits = rng.getrandbits if drawn else None
        result = outcome(encode, steps, bits, new_ids, offset_ns, limits)
        made.append(rng.getrandbits(64))  # the generator's state after the run
        return result if result[0] == "ok" else (result[0],)

    together = run(
        lambda *args: encode_steps(*args[:4], names.SPAN_ENGINE_STEP, STEP_KEYS, args[4]), random.Random(seed)
    )
    assert together == run(steps_one_at_a_time, random.Random(seed))
    if together[0] == "ok":
        assert len(together[1]) == sum(1 for step in steps if step.links)
        assert made[0] == made[1] or not drawn  # as many bits drawn


def test_encode_steps_takes_new_ids_where_a_drawn_id_is_0():
    step = PackedStep(1, 10, 20, 0, 1, 2, 3, 0, 0, 1, b"l" * 25)
    limits = limits_tuple(SpanLimits())
    zero_span = lambda bits: 5 if bits == 384 else 0  # noqa: E731 — the first step's span id 0, the second's all
    encoded = encode_steps([step, step], zero_span, lambda: (7, 9), 100, names.SPAN_ENGINE_STEP, STEP_KEYS, limits)
    expected = encode_step(step, 7, 9, 110, 120, names.SPAN_ENGINE_STEP, STEP_KEYS, limits)
    assert encoded == [expected, expected]


def test_bad_step_runs_are_clear_errors_not_crashes():
    limits = limits_tuple(SpanLimits())
    step = PackedStep(1, 10, 20, 0, 1, 2, 3, 0, 0, 1, b"l" * 25)
    ids = lambda: (1, 2)  # noqa: E731
    args = (random.getrandbits, ids, 0, names.SPAN_ENGINE_STEP, STEP_KEYS, limits)
    assert len(encode_steps([step, step._replace(links=b"")], *args)) == 1
    assert encode_steps([], *args) == []
    with pytest.raises(TypeError, match="expected a PackedStep"):
        encode_steps([step, step[:-1]], *args)
    with pytest.raises(TypeError, match="steps: expected a sequence"):
        encode_steps(3, *args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="end_ts \\+ offset_ns: expected an int64 with a sum in"):
        encode_steps([step._replace(end_ts=2**63)], *args)
    with pytest.raises(ValueError, match="start_ts \\+ offset_ns"):
        encode_steps([step], *args[:2], -11, *args[3:])
    with pytest.raises(TypeError, match="attribute value of type object"):
        encode_steps([step, step._replace(queue_depth=object())], *args)
    with pytest.raises(ValueError, match="random_bits: expected an int of 192 bits a step"):
        encode_steps([step], lambda bits: -1, *args[1:])
    with pytest.raises(ValueError, match="random_bits: expected an int of 192 bits a step"):
        encode_steps([step], lambda bits: 1 << 192, *args[1:])
    with pytest.raises(TypeError, match="new_ids: expected \\(trace_id, span_id\\)"):
        encode_steps([step], None, lambda: 3, *args[2:])
    with pytest.raises(ValueError, match="trace_id: not an unsigned 128-bit int"):
        encode_steps([step], None, lambda: (-1, 2), *args[2:])
    with pytest.raises(TypeError, match="random_bits None or a callable"):
        encode_steps([step], 3, *args[1:])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected 9 attribute keys"):
        encode_steps([step], *args[:4], STEP_KEYS[:-1], limits)
    with pytest.raises(TypeError, match="expected 7 arguments, got 6"):
        encode_steps([step], *args[:-1])  # type: ignore[call-arg]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_run_of_steps_draws_the_ids_of_its_steps_built_one_at_a_time(seed):
    """The SDK's default generator: a run of step frames built in one call (its ids of one draw)
    exports what its steps built one at a time export (a draw each), ids included."""
    step = next(r for r in scripted_records() if not isinstance(r, RequestRecord) and r.links)
    run = [step._replace(step_index=i, links=step.links * (i % 3)) for i in range(7)]  # i % 3 == 0: unsampled

    def built(feed) -> tuple[list[dict], dict]:
        random.seed(seed)
        tracer_provider = provider(ids=RandomIdGenerator())
        kept = RequestsKept(request_encoder(tracer_provider))
        processor = CountingBatchSpanProcessor(kept, BatchSettings(4096, 4096, 3_600_000))
        builder = fast_builder(FastEmitter(tracer_provider, [processor]), tracer_provider)
        feed(builder)
        processor.shutdown()
        return [s for r in kept.requests for s in fields_of(r)], builder.counters()

    together = built(lambda builder: builder.build_steps(run))
    assert together == built(lambda builder: [builder.build_steps((s,)) for s in run])
    assert together[1]["steps_built"] == 4 and together[1]["steps_unsampled"] == 3
    assert len({s["ids"][:2] for s in together[0]}) == 4


@settings(max_examples=400, deadline=None)
@given(
    case=st.randoms(use_true_random=False),
    seed=st.integers(0, 2**32),
    wall_offset_ns=st.integers(0, 2**62),
    attribute_limit=LIMIT,
    event_limit=LIMIT,
)
def test_encode_phases_writes_the_bytes_of_the_phase_spans_descriptions(
    case, seed, wall_offset_ns, attribute_limit, event_limit
):
    """Any phases (a phase that did not happen, waits, chunks cut mid-chunk, ids of 0 drawn again)
    and any limits: `encode_phases` equals `encode_spans` of `request_spans`'s phase spans, byte for
    byte, its ids drawn in the same order."""
    record, phases = phase_case(case)
    anchor = ClockAnchor(mono_ts=0, wall_ts=wall_offset_ns)
    limits = limits_tuple(SpanLimits(max_span_attributes=attribute_limit, max_events=event_limit))
    encoded = encode_phases(*phase_arguments(DrawnIds(seed), anchor, record, phases, limits))
    assert encoded == phase_spans(DrawnIds(seed), anchor, record, phases, limits)


@settings(max_examples=200, deadline=None)
@given(case=st.randoms(use_true_random=False), seed=st.integers(0, 2**32))
def test_encode_phases_draws_random_bits_as_the_sdks_generator_draws_ids(case, seed):
    """`random_bits` (8 ids a draw, a 0 skipped, a second draw past 8 spans) gives the ids the SDK's
    generator gives from the same bits, byte for byte."""
    record, phases = phase_case(case)
    anchor = ClockAnchor(mono_ts=0, wall_ts=2**60)
    limits = limits_tuple(SpanLimits())
    arguments = phase_arguments(FixedIds(0, 0), anchor, record, phases, limits)
    arguments[1] = word_bits(seed)
    assert encode_phases(*arguments) == phase_spans(WordIds(seed), anchor, record, phases, limits)


def test_bad_phases_are_clear_errors_not_crashes():
    record, phases = next(
        (r, p) for r, p in map(phase_case, map(random.Random, itertools.count())) if p.first_token_ts and p.scheduled_ts
    )
    good = phase_arguments(
        DrawnIds(1), ClockAnchor(mono_ts=0, wall_ts=2**60), record, phases, limits_tuple(SpanLimits())
    )
    assert encode_phases(*good)

    def bad(index: int, value: Any) -> list[Any]:
        return [*good[:index], value, *good[index + 1 :]]

    stamps = good[4]
    cases = [
        (bad(0, None), TypeError, "expected a callable, None or a callable, a SpanIds and 13 stamps"),
        (bad(0, lambda: "x"), TypeError, "span_id: expected int"),
        (bad(2, (1, 2, 3)), TypeError, "expected a callable, None or a callable, a SpanIds and 13 stamps"),
        (bad(2, (1 << 128, 2, 1, "")), ValueError, "trace_id: not an unsigned 128-bit int"),
        (bad(3, 2**63), ValueError, "offset_ns: expected an int64"),
        (bad(3, -(2**62)), ValueError, r"phase stamp \+ offset_ns: outside \[0, 2\*\*63\)"),
        (bad(4, stamps[:-1]), TypeError, "13 stamps"),
        (bad(4, (*stamps[:-1], -1)), ValueError, "initial_chunks must be >= 0"),
        (bad(4, (1.5, *stamps[1:])), ValueError, "stamp: expected an int64"),
        (bad(5, [(1, 2, 3)]), TypeError, r"waits: expected \(start, end\) tuples"),
        (bad(5, [(1, "x")]), ValueError, "wait end: expected an int64"),
        (bad(5, 7), TypeError, "waits: expected a sequence"),
        (bad(6, (0, 1, 2**63 - 1, 0, 0, 1, 2**63 - 1, 0)), ValueError, "sum outside int64"),
        (bad(6, None), TypeError, "chunks: expected a sequence"),
        (bad(7, None), TypeError, r"decode: expected \(attributes, events\)"),
        (bad(7, ([], ())), TypeError, "attributes: expected a dict"),
        (bad(7, ({}, 5)), TypeError, "events: expected a tuple or list"),
        (bad(8, PHASE_NAMES[:-1]), TypeError, "names: expected a tuple of 8 non-empty str"),
        (bad(9, (*PHASE_KEYS[:-1], "")), TypeError, "keys: expected a tuple of 9 non-empty str"),
        (bad(10, (1, 2)), TypeError, "limits: expected a 7-tuple"),
        (bad(1, 5), TypeError, "expected a callable, None or a callable"),
        (bad(1, lambda bits: "x"), ValueError, "random_bits: expected an int of 512 bits"),
        (bad(1, lambda bits: 1 << bits), ValueError, "random_bits: expected an int of 512 bits"),
        (good[:-1], TypeError, "expected 11 arguments, got 10"),
    ]
    for arguments, error, message in cases:
        with pytest.raises(error, match=message):
            encode_phases(*arguments)


@settings(max_examples=500, deadline=None)
@given(
    case=st.randoms(use_true_random=False),
    wall_offset_ns=st.integers(0, 2**62),
    attribute_limit=st.sampled_from([None, 0, 1, 7, 30, 45, 200]),
    length_limit=st.sampled_from([None, 0, 3, 100]),
)
def test_encode_root_writes_the_bytes_of_the_server_spans_description(
    case, wall_offset_ns, attribute_limit, length_limit
):
    """Any record and phases (every optional fact of the root present or not, odd values, a compact
    record's summary, tail reasons) and any limits: `encode_root` equals `encode_spans` of
    `root_span`'s description, byte for byte."""
    record, phases, full, summary = root_case(case)
    anchor = ClockAnchor(mono_ts=0, wall_ts=wall_offset_ns)
    limits = limits_tuple(SpanLimits(max_span_attributes=attribute_limit, max_span_attribute_length=length_limit))
    arguments = root_arguments(anchor, record, phases, full, summary, limits)
    assert encode_root(*arguments) == root_reference(anchor, record, phases, full, summary, limits)


def test_the_roots_keys_and_a_compact_summarys_are_distinct():
    """encode_root appends the summary's items as a dict update would only where no key repeats."""
    record, phases, _, _ = next(c for c in map(root_case, map(random.Random, itertools.count())) if c[3])
    phases.scheduled_ts = phases.first_token_ts = 1
    assert len(set(ROOT_SPAN_KEYS)) == len(ROOT_SPAN_KEYS)
    assert not set(ROOT_SPAN_KEYS) & set(compact_summary(record, phases))


def test_bad_roots_are_clear_errors_not_crashes():
    record, phases, full, summary = root_case(random.Random(5))
    anchor, limits = ClockAnchor(mono_ts=0, wall_ts=2**60), limits_tuple(SpanLimits())
    good = root_arguments(anchor, record, phases, full, summary, limits)
    assert encode_root(*good)

    def bad(index: int, value: Any) -> list[Any]:
        return [*good[:index], value, *good[index + 1 :]]

    unjudged = record.http._replace(client_disconnected=False, exception_type=None)

    def odd_phases(**fields: Any) -> Any:
        copy = SimpleNamespace(**{name: getattr(phases, name) for name in phases.__slots__})
        vars(copy).update(fields)
        return copy

    cases = [
        (bad(0, (1, 2)), TypeError, "expected a RequestRecord"),
        (bad(0, record._replace(outcome=None)), TypeError, "expected a RequestOutcome and HttpFacts"),
        (bad(0, record._replace(root=(1, 2))), TypeError, "expected SpanIds"),
        (bad(0, record._replace(info=(1,))), TypeError, "expected a RequestInfo"),
        (bad(0, record._replace(outcome=record.outcome._replace(output_tokens=2**70))), ValueError, "output_tokens"),
        (bad(0, record._replace(sends=(1, "x"))), ValueError, "timeline stamp: expected an int64"),
        (bad(1, None), AttributeError, "received_ts"),
        (bad(1, odd_phases(decode_ns=1.5)), ValueError, "decode_ns: expected an int64"),
        (bad(1, odd_phases(end_ts=2**62, received_ts=-(2**62))), ValueError, "outside int64"),
        (bad(2, -(2**62)), ValueError, "before 1970"),
        (bad(0, record._replace(http=unjudged._replace(status_code="x"), outcome=NO_OUTCOME)), TypeError, ">="),
        (bad(3, ("full",)), TypeError, "3 texts"),
        (bad(4, []), TypeError, "a dict or None"),
        (bad(4, {"": 1}), TypeError, "summary: expected non-empty str keys"),
        (bad(5, ROOT_SPAN_KEYS[:-1]), TypeError, "keys: expected a tuple of 59 non-empty str"),
        (bad(6, ("phaselens",)), TypeError, "4 constants"),
        (bad(7, (1, 2)), TypeError, "limits: expected a 7-tuple"),
        (good[:-1], TypeError, "expected 8 arguments, got 7"),
    ]
    for arguments, error, message in cases:
        with pytest.raises(error, match=message):
            encode_root(*arguments)


def test_a_ratio_sampler_keeps_the_described_step_path():
    """Past the default sampler the fast backend asks the sampler (its trace state and attributes
    reach the span), as the SDK backend does: both export the same steps."""
    records = [r for r in scripted_records() if not isinstance(r, RequestRecord)]
    exported = {}
    for backend in ("sdk", "fast"):
        tracer_provider = TracerProvider(sampler=TraceIdRatioBased(0.5), id_generator=SeededIds())
        kept = RequestsKept(None if backend == "sdk" else request_encoder(tracer_provider))
        processor = CountingBatchSpanProcessor(kept, BatchSettings(4096, 4096, 3_600_000))
        if backend == "sdk":
            tracer_provider.add_span_processor(processor)
            emitter: Any = SpanEmitter(tracer_provider.get_tracer(names.SERVER_SCOPE), SpanLimits())
        else:
            emitter = FastEmitter(tracer_provider, [processor])
        builder = fast_builder(emitter, tracer_provider)
        for _ in range(8):
            for record in records:
                builder.build(record)
        processor.shutdown()
        exported[backend] = ([s for r in kept.requests for s in fields_of(r)], builder.counters())
    (sdk, sdk_counts), (fast, fast_counts) = exported["sdk"], exported["fast"]
    assert fast == sdk and fast_counts == sdk_counts
    steps = 8 * len(records)
    assert 0 < len(fast) == fast_counts["steps_built"] < steps and fast_counts["steps_unsampled"] == steps - len(fast)


def test_a_description_that_fails_to_encode_is_counted_in_build_errors():
    records = scripted_records()
    tracer_provider = provider()
    processor = CountingBatchSpanProcessor(RequestsKept(request_encoder(tracer_provider)))
    builder = fast_builder(FastEmitter(tracer_provider, [processor]), tracer_provider)
    request = next(r for r in records if isinstance(r, RequestRecord))
    builder.build(request._replace(info=request.info._replace(seed=object())))  # no attribute type
    builder.build(request)
    processor.shutdown()
    counts = builder.counters()
    assert counts["build_errors"] == 1 and counts["requests_built"] == 1 and processor.counts.exported == 12


def test_a_run_of_steps_exports_as_one_at_a_time_and_a_step_that_fails_costs_only_itself():
    """The span-builder process builds a run of step frames in one call (one offer): the same export
    requests and counts as step by step; a failing step counted once, its neighbours built."""
    step = next(r for r in scripted_records() if not isinstance(r, RequestRecord) and r.links)
    run = [step._replace(step_index=i) for i in range(3)]

    def built(feed) -> tuple[list[bytes], dict]:
        tracer_provider = provider()
        kept = RequestsKept(request_encoder(tracer_provider))
        processor = CountingBatchSpanProcessor(kept, BatchSettings(4096, 4096, 3_600_000))
        emitter = FastEmitter(tracer_provider, [processor])
        builder = fast_builder(emitter, tracer_provider)
        feed(builder)
        processor.shutdown()
        return kept.requests, {**builder.counters(), **vars_of(processor.counts)}

    together = built(lambda builder: builder.build_steps(run))
    assert together == built(lambda builder: [builder.build_steps((s,)) for s in run])
    assert together[1]["steps_built"] == 3 and together[1]["processor_exported"] == 3
    run[1] = step._replace(step_index=object())  # not an int: its encoding raises
    _, counts = built(lambda builder: builder.build_steps(run))
    assert counts["build_errors"] == 1 and counts["steps_built"] == counts["processor_exported"] == 2


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_an_endpoint_that_is_down_counts_failed_spans_and_raises_nothing(monkeypatch, protocol):
    port = closed_port()
    path = "/v1/traces" if protocol == "http/protobuf" else ""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}{path}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    tracer_provider = provider()
    exporter = bytes_exporter(protocol, request_encoder(tracer_provider))
    processor = CountingBatchSpanProcessor(exporter, BatchSettings(max_queue_size=12, max_export_batch_size=512))
    emitter = FastEmitter(tracer_provider, [processor])
    span = SpanData("s", KIND_INTERNAL, 1, 2, None, False, 1, "", 10, 20, {"k": 1})
    emitter.emit_data([span._replace(span_id=i) for i in range(1, 11)])
    emitter.emit_data([span._replace(span_id=i) for i in range(11, 16)])  # 2 fit the queue, 3 are refused
    processor.force_flush()
    processor.shutdown()
    assert (processor.counts.exported, processor.counts.failed, processor.counts.dropped) == (0, 12, 3)


@pytest.fixture()
def collector(clickhouse, ch_client, fresh_database, tmp_path):
    schema.apply(ch_client, schema.statements(fresh_database))
    with Collector(
        clickhouse.url, database=fresh_database, spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05
    ) as running:
        yield running, fresh_database


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_fast_path_rows_in_clickhouse_equal_the_sdk_paths(collector, ch_client, monkeypatch, protocol):
    running, database = collector
    endpoint = f"http://{running.grpc_endpoint}" if protocol == "grpc" else f"{running.http_endpoint}/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    records = scripted_records()
    for backend in ("sdk", "fast"):
        tracer_provider = provider(f"phaselens-{backend}")
        if backend == "sdk":
            exporter = otel_setup.otlp_span_exporter()
            processor: Any = CountingBatchSpanProcessor(exporter)
            tracer_provider.add_span_processor(processor)
            emitter: Any = SpanEmitter.of_provider(tracer_provider)
        else:
            processor = CountingBatchSpanProcessor(bytes_exporter(protocol, request_encoder(tracer_provider)))
            emitter = FastEmitter(tracer_provider, [processor])
        builder = fast_builder(emitter, tracer_provider)
        for record in records:
            builder.build(record)
        processor.shutdown()
        assert processor.counts.exported == 17 and processor.counts.failed == 0
    assert wait_rows(ch_client, database, 34) == 34
    by_service: dict[str, list] = {}
    for row in rows(ch_client, database, order_by="SpanId, ServiceName"):
        service = row.pop("ServiceName")
        row["ResourceAttributes"].pop("service.name")
        by_service.setdefault(service, []).append(row)
    assert by_service["phaselens-fast"] == by_service["phaselens-sdk"]
    assert len(by_service["phaselens-fast"]) == 17


def test_a_provider_the_user_brought_keeps_the_sdk_path():
    rig = make_rig()  # the user's TracerProvider with their own processor and exporter
    script_request(rig)
    assert rig.telemetry.builder == "thread" and len(rig.spans()) == 13
    rig.telemetry.shutdown()


def test_configure_picks_the_fast_backend_only_for_otlp_alone(monkeypatch):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.delenv(names.ENV_SPAN_BACKEND, raising=False)
    cases = [("otlp", None, True), ("otlp,console", None, False), ("otlp", "sdk", False), ("none", None, False)]
    for exporters, backend, fast in cases:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", exporters)
        if backend:
            monkeypatch.setenv(names.ENV_SPAN_BACKEND, backend)
        providers = otel_setup.configure("svc", set_global=False, encoded_spans=True)
        assert bool(providers.encoded) is fast, (exporters, backend)
        emitter = otel_setup.span_backend(providers)
        assert isinstance(emitter, FastEmitter if fast else SpanEmitter | type(None)), (exporters, backend)
        providers.shutdown()
        monkeypatch.delenv(names.ENV_SPAN_BACKEND, raising=False)


class ScriptedReceiver:
    """A loopback OTLP/HTTP endpoint answering each POST with the next status of `statuses` (then
    200), after `delay_s` or at close(), whichever comes first; it keeps each request's headers and
    body."""

    def __init__(self, statuses: list[int], delay_s: float = 0.0) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[dict, bytes]] = []
        self.released = threading.Event()  # close() answers a delayed request at once: nobody waits it out
        receiver, statuses = self, list(statuses)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the transport expects

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                receiver.released.wait(delay_s)
                status = statuses.pop(0) if statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


def export_one(monkeypatch, receiver: ScriptedReceiver, **env: str) -> CountingBatchSpanProcessor:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    tracer_provider = provider()
    exporter = bytes_exporter("http/protobuf", request_encoder(tracer_provider))
    assert isinstance(exporter._client._transport, HttpClientTransport)  # not requests
    processor = CountingBatchSpanProcessor(exporter)
    FastEmitter(tracer_provider, [processor]).emit_data(
        [SpanData("s", KIND_INTERNAL, 1, 2, None, False, 1, "", 1, 2, {})]
    )
    processor.shutdown()
    return processor


def test_http_export_keeps_the_exporters_headers_compression_and_retries(monkeypatch):
    receiver = ScriptedReceiver([503, 429])
    processor = export_one(
        monkeypatch,
        receiver,
        OTEL_EXPORTER_OTLP_TRACES_HEADERS="authorization=Bearer%20abc,x-tenant=t1",
        OTEL_EXPORTER_OTLP_TRACES_COMPRESSION="gzip",
    )
    receiver.close()
    assert (processor.counts.exported, processor.counts.failed) == (1, 0)
    assert len(receiver.requests) == 3  # 503 and 429 retried with the exporter's backoff
    headers, body = receiver.requests[-1]
    assert headers["authorization"] == "Bearer abc" and headers["x-tenant"] == "t1"
    assert headers["content-encoding"] == "gzip" and headers["content-type"] == "application/x-protobuf"
    (span,) = fields_of(gzip.decompress(body))
    assert span["name"] == ("s", KIND_INTERNAL) and span["resource"][0] == (
        "service.name",
        ("string_value", "phaselens-test"),
    )


def test_http_export_fails_on_a_4xx_and_within_the_exporters_timeout(monkeypatch):
    refused = ScriptedReceiver([400])
    assert export_one(monkeypatch, refused).counts.failed == 1 and len(refused.requests) == 1  # not retried
    refused.close()
    # the reply would come a minute later: a failure within 5 timeouts is the exporter's own timeout
    # (its retries share that deadline), far from both a loaded machine's delay and the reply
    timeout_s = 1.0
    slow = ScriptedReceiver([], delay_s=60.0)
    started = time.monotonic()
    processor = export_one(monkeypatch, slow, OTEL_EXPORTER_OTLP_TRACES_TIMEOUT=str(timeout_s))
    assert processor.counts.failed == 1 and time.monotonic() - started < 5 * timeout_s
    slow.close()


def test_the_span_builder_process_counts_a_dead_endpoint_and_serving_goes_on(monkeypatch):
    for name, value in {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(names.ENV_SPAN_BACKEND, raising=False)
    clock = ScriptedClock()
    telemetry = ServerTelemetry.from_env(
        "phaselens-dead-end", builder="process", clock_ns=clock, anchor=ClockAnchor.capture(clock, lambda: WALL_BASE_NS)
    )
    script_request(SimpleNamespace(telemetry=telemetry, clock=clock))
    assert telemetry.flush(20)
    stats = telemetry.stats()
    assert (stats.export_failed, stats.export_exported, stats.child_alive) == (13, 0, 1)
    assert stats.spans_dropped == 13 and stats.build_errors == 0
    script_request(SimpleNamespace(telemetry=telemetry, clock=clock))  # still serving, still counting
    telemetry.shutdown()
    assert telemetry.stats().export_failed == 26
