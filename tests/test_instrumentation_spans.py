"""Span tree, attributes and metrics from a scripted loop on an injected clock (exact to the ns)."""

from __future__ import annotations

import json
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.observer import FINISH_LENGTH
from phaselens.instrumentation.hotpath.records import StepStats
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from tests.instrumentation_fixtures import (
    PARENT_ID,
    TRACE_ID,
    TRACEPARENT,
    WALL_BASE_NS,
    http_scope,
    make_rig,
    script_request,
)


def wall(rig, mono_ns):
    return WALL_BASE_NS + mono_ns - rig.anchor.mono_ts


def interval(rig, span):
    return span.start_time - wall(rig, 0), span.end_time - wall(rig, 0)


def test_span_tree_timing_exact():
    rig = make_rig()
    script_request(rig)
    spans = rig.by_name()
    root = spans["text_completion tiny"][0]
    assert root.kind == SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID and root.parent.is_remote
    expected = {
        names.SPAN_INGRESS: [(1_000_000, 1_100_000)],
        names.SPAN_QUEUE: [(1_100_000, 1_400_000), (1_760_000, 1_900_000)],
        names.SPAN_PREFILL: [(1_400_000, 1_700_000)],
        names.SPAN_PREFILL_CHUNK: [(1_410_000, 1_500_000), (1_600_000, 1_700_000), (1_905_000, 1_950_000)],
        names.SPAN_FIRST_TOKEN: [(1_700_000, 1_720_000)],
        names.SPAN_FIRST_CHUNK: [(1_720_000, 1_726_000)],
        names.SPAN_DECODE: [(1_720_000, 1_970_000)],
        names.SPAN_DELIVERY: [(1_970_000, 1_990_000)],
        "text_completion tiny": [(1_000_000, 1_990_000)],
    }
    for name, intervals in expected.items():
        assert sorted(interval(rig, s) for s in spans[name]) == intervals, name
    by_id = {s.context.span_id: s for group in spans.values() for s in group}
    parent_name = {
        s.name if s.name != names.SPAN_PREFILL_CHUNK else (s.name, s.attributes[names.PL_CHUNK_INDEX]): by_id[
            s.parent.span_id
        ].name
        for group in spans.values()
        for s in group
        if s.parent is not None and s.parent.span_id in by_id
    }
    assert parent_name[(names.SPAN_PREFILL_CHUNK, 0)] == names.SPAN_PREFILL
    assert parent_name[(names.SPAN_PREFILL_CHUNK, 2)] == names.SPAN_DECODE
    for name in (*names.PHASE_SPANS, names.SPAN_FIRST_CHUNK):
        assert parent_name[name] == "text_completion tiny"
    assert [
        s.attributes[names.PL_QUEUE_WAIT_INDEX] for s in sorted(spans[names.SPAN_QUEUE], key=lambda s: s.start_time)
    ] == [0, 1]
    assert all(
        s.context.trace_id == root.context.trace_id
        for group in spans.values()
        for s in group
        if s.name != names.SPAN_ENGINE_STEP
    )


def test_root_attributes_exact():
    rig = make_rig()
    script_request(rig)
    root = rig.by_name()["text_completion tiny"][0]
    a = dict(root.attributes)
    assert a.pop(names.GEN_AI_INPUT_MESSAGES, None) is None  # capture is off by default
    assert a.pop(names.GEN_AI_OUTPUT_MESSAGES, None) is None
    ttft_ns, decode_ns = 720_000, 250_000
    assert a == {
        names.GEN_AI_OPERATION_NAME: "text_completion",
        names.GEN_AI_PROVIDER_NAME: "phaselens",
        names.GEN_AI_REQUEST_MODEL: "tiny",
        names.GEN_AI_RESPONSE_MODEL: "tiny",
        names.GEN_AI_RESPONSE_ID: "cmpl-1",
        names.GEN_AI_REQUEST_ID: "cmpl-1",
        names.GEN_AI_REQUEST_MAX_TOKENS: 7,
        names.GEN_AI_REQUEST_TEMPERATURE: 0.0,
        names.GEN_AI_REQUEST_TOP_P: 1.0,
        names.GEN_AI_REQUEST_TOP_K: 0,
        names.GEN_AI_REQUEST_STREAM: True,
        names.GEN_AI_RESPONSE_FINISH_REASONS: ("length",),
        names.GEN_AI_USAGE_INPUT_TOKENS: 12,
        names.GEN_AI_USAGE_OUTPUT_TOKENS: 7,
        names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 4,
        names.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: 0,
        names.HTTP_REQUEST_METHOD: "POST",
        names.URL_PATH: "/v1/completions",
        names.SERVER_ADDRESS: "127.0.0.1",
        names.SERVER_PORT: 8000,
        names.PL_INGRESS_MS: 0.1,
        names.PL_QUEUE_MS: 0.3,
        names.PL_PREFILL_MS: 0.3,
        names.PL_FIRST_TOKEN_MS: 0.02,
        names.PL_DECODE_MS: 0.25,
        names.PL_DELIVERY_MS: 0.02,
        names.PL_SERVER_TTFT_MS: 0.72,
        names.PL_SERVER_TPOT_MS: decode_ns / 6 / 1e6,
        names.PL_PREEMPTIONS: 1,
        names.PL_FINISH_REASON: "length",
        names.PL_CLIENT_DISCONNECTED: False,
        names.PL_RECEIVED_WALL_NS: wall(rig, 1_000_000),
        names.PL_RESPONDED_WALL_NS: wall(rig, 1_990_000),
        names.LATENCY_TIME_IN_QUEUE: 300_000 / 1e9,
        names.LATENCY_TIME_TO_FIRST_TOKEN: ttft_ns / 1e9,
        names.LATENCY_E2E: 990_000 / 1e9,
        names.LATENCY_TIME_IN_MODEL_PREFILL: 320_000 / 1e9,
        names.LATENCY_TIME_IN_MODEL_DECODE: decode_ns / 1e9,
        names.LATENCY_TIME_IN_MODEL_INFERENCE: 570_000 / 1e9,
        names.PL_FIRST_CHUNK_MS: 0.006,
        names.PL_FIRST_CHUNK_LOOP_WAIT_MS: 0.004,
        names.PL_FIRST_CHUNK_ENCODE_MS: 0.002,
        names.PL_FIRST_CHUNK_WRITE_MS: 0.001,
        names.PL_SERVER_TTFC_MS: 0.726,
        names.PL_SERVER_LAST_CHUNK_MS: 0.9715,
        names.PL_TRACE_FULL: names.TRACE_FULL_HEAD,
    }
    # the budget identities hold exactly in ns: ingress + queue + prefill + first_token = server TTFT,
    # server TTFT + first_chunk = server TTFC, first_chunk = loop_wait + encode (write beside it)
    assert ttft_ns == 100_000 + 300_000 + 300_000 + 20_000
    assert ttft_ns + 6_000 == 726_000 and 4_000 + 2_000 == 6_000
    assert root.status.status_code == StatusCode.UNSET


def test_phase_span_attributes():
    rig = make_rig()
    script_request(rig)
    spans = rig.by_name()
    # gaps 10, 10, 10, 10, 210 µs; p99 by linear interpolation: h = 0.99 · 4 = 3.96 → 10 + 0.96 · 200 µs
    assert dict(spans[names.SPAN_DECODE][0].attributes) == {
        names.PL_DECODE_TOKENS: 6,
        names.PL_DECODE_STEPS: 5,
        names.PL_ITL_P50_MS: 0.01,
        names.PL_ITL_P99_MS: 0.202,
        names.PL_ITL_MAX_MS: 0.21,
        names.PL_STALL_MS: 0.2,
    }
    assert dict(spans[names.SPAN_PREFILL][0].attributes) == {
        names.PL_PREFILL_CHUNKS: 2,
        names.PL_CHUNK_TOKENS: 12,
        names.PL_CACHED_TOKENS: 4,
    }
    chunks = sorted(spans[names.SPAN_PREFILL_CHUNK], key=lambda s: s.start_time)
    assert [(c.attributes[names.PL_CHUNK_TOKENS], c.attributes[names.PL_PREFILL_RECOMPUTE]) for c in chunks] == [
        (8, False),
        (4, False),
        (16, True),
    ]
    assert spans[names.SPAN_DECODE][0].events == ()  # token events are opt-in
    assert dict(spans[names.SPAN_FIRST_CHUNK][0].attributes) == {
        names.PL_FIRST_CHUNK_LOOP_WAIT_MS: 0.004,
        names.PL_FIRST_CHUNK_ENCODE_MS: 0.002,
        names.PL_FIRST_CHUNK_WRITE_MS: 0.001,
    }


def test_engine_step_span_links_the_request_and_has_its_own_trace():
    rig = make_rig()
    script_request(rig)
    spans = rig.by_name()
    step, root = spans[names.SPAN_ENGINE_STEP][0], spans["text_completion tiny"][0]
    assert step.parent is None and step.context.trace_id != root.context.trace_id
    assert [link.context.span_id for link in step.links] == [root.context.span_id]
    assert interval(rig, step) == (1_940_000, 1_970_000)
    assert step.attributes[names.PL_STEP_NUM_SEQS] == 1 and step.attributes[names.PL_STEP_QUEUE_DEPTH] == 2
    assert step.attributes[names.PL_STEP_KV_BLOCKS_USED] == 3 and step.attributes[names.PL_STEP_PREFILL_TOKENS] == 16


def test_wall_clock_step_changes_no_duration(monkeypatch):
    """The wall clock jumps an hour mid-request (as after an NTP step): nothing moves."""
    rig = make_rig(wall_ns=time.time_ns)
    real_time_ns = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + 3_600 * 10**9)
    script_request(rig)
    spans = rig.spans()
    root = next(s for s in spans if s.kind == SpanKind.SERVER)
    assert root.start_time == rig.anchor.wall_ts + (1_000_000 - rig.anchor.mono_ts)
    durations = sorted(s.end_time - s.start_time for s in spans if s.name == names.SPAN_QUEUE)
    assert durations == [140_000, 300_000]
    assert root.end_time - root.start_time == 990_000


def test_metrics_recorded_with_semconv_buckets():
    rig = make_rig()
    script_request(rig)
    rig.spans()
    (ttft,) = rig.metric_points(names.METRIC_SERVER_TTFT)
    assert ttft.count == 1 and ttft.sum == pytest.approx(720_000 / 1e9)
    assert tuple(ttft.explicit_bounds) == tuple(float(b) for b in names.BUCKETS_TTFT_S)
    (tpot,) = rig.metric_points(names.METRIC_SERVER_TPOT)
    assert tpot.sum == pytest.approx(250_000 / 6 / 1e9) and tuple(tpot.explicit_bounds) == names.BUCKETS_TPOT_S
    (duration,) = rig.metric_points(names.METRIC_SERVER_REQUEST_DURATION)
    assert duration.sum == pytest.approx(990_000 / 1e9)
    assert dict(duration.attributes)[names.GEN_AI_REQUEST_MODEL] == "tiny"


def test_sampling_off_builds_the_compact_record_alone_and_keeps_metrics():
    rig = make_rig(sampler=ParentBased(ALWAYS_OFF))
    for _ in range(3):
        script_request(rig, traceparent=None)
    compact = rig.spans()
    assert [s.name for s in compact] == ["text_completion tiny"] * 3  # the SERVER root alone, exported as sampled
    assert all(s.context.trace_flags.sampled for s in compact)
    root = dict(compact[0].attributes)
    assert root[names.PL_TRACE_FULL] == names.TRACE_FULL_NONE and root[names.PL_SERVER_TTFT_MS] == 0.72
    assert root[names.PL_DECODE_TOKENS] == 6 and root[names.PL_PREFILL_CHUNKS] == 2  # llm.decode's, llm.prefill's
    stats = rig.telemetry.stats()
    assert stats.requests_unsampled == 3 and stats.steps_unsampled == 3 and stats.spans_built == 3
    assert rig.metric_points(names.METRIC_SERVER_TTFT)[0].count == 3
    script_request(rig, traceparent=TRACEPARENT)  # a sampled parent wins: parent-based, one decision
    spans = rig.spans()[3:]
    assert len(spans) == 12 and {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}
    # the engine-step trace has no parent: the root sampler (here ALWAYS_OFF) decides it
    assert names.SPAN_ENGINE_STEP not in {s.name for s in spans}


def test_sampling_ratio_keeps_whole_traces():
    rig = make_rig(sampler=ParentBased(TraceIdRatioBased(0.5)))
    for _ in range(200):
        script_request(rig, traceparent=None)
    spans = rig.spans()
    per_trace: dict[int, int] = {}
    for span in spans:
        if span.name != names.SPAN_ENGINE_STEP:
            per_trace[span.context.trace_id] = per_trace.get(span.context.trace_id, 0) + 1
    full = {t for t, count in per_trace.items() if count > 1}
    assert len(per_trace) == 200 and 60 <= len(full) <= 140
    assert set(per_trace.values()) == {1, 12}  # every sampled request is complete; the others, their root
    assert rig.telemetry.stats().requests_unsampled == 200 - len(full)


def test_content_capture_is_opt_in(monkeypatch):
    monkeypatch.delenv(names.ENV_CAPTURE_CONTENT, raising=False)
    rig = make_rig()
    script_request(rig)
    root = rig.by_name()["text_completion tiny"][0]
    assert names.GEN_AI_INPUT_MESSAGES not in root.attributes
    monkeypatch.setenv(names.ENV_CAPTURE_CONTENT, "true")
    rig = make_rig()
    script_request(rig, prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    root = rig.by_name()["text_completion tiny"][0]
    assert json.loads(root.attributes[names.GEN_AI_INPUT_MESSAGES]) == [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {"role": "user", "parts": [{"type": "text", "content": "hi"}]},
    ]
    assert json.loads(root.attributes[names.GEN_AI_OUTPUT_MESSAGES]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "world"}], "finish_reason": "length"}
    ]


def test_token_events_are_opt_in():
    rig = make_rig(token_events=True)
    script_request(rig)
    events = rig.by_name()[names.SPAN_DECODE][0].events
    assert [e.attributes[names.PL_TOKEN_COUNT] for e in events] == [1, 1, 2, 1, 1]
    assert [e.timestamp - wall(rig, 0) for e in events] == [1_730_000, 1_740_000, 1_750_000, 1_960_000, 1_970_000]


def test_rejected_request_gives_one_error_server_span():
    rig = make_rig()
    req = rig.telemetry.request(http_scope())
    rig.clock.advance(50_000)
    req.fail("invalid_request_error", 400)
    spans = rig.by_name()
    root = spans["POST"][0]
    assert root.kind == SpanKind.SERVER and root.status.status_code == StatusCode.ERROR
    assert root.attributes[names.ERROR_TYPE] == "invalid_request_error"
    assert root.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 400
    assert interval(rig, spans[names.SPAN_INGRESS][0]) == (1_000_000, 1_050_000)
    assert set(spans) == {"POST", names.SPAN_INGRESS}


def test_full_handoff_drops_and_counts_never_raises():
    rig = make_rig(queue_capacity=4, poll_interval_s=30)
    time.sleep(0.2)  # the builder has drained the empty queues and sleeps
    for index in range(10):
        rig.telemetry.step_observer.step(StepStats(index, index + 1, 0, 1, 1, 1), [])
    stats = rig.telemetry.stats()
    assert stats.steps_dropped == 6 and stats.steps_offered == 10 and stats.queue_full == 6
    assert stats.spans_dropped == 6
    (dropped,) = [
        p
        for p in rig.metric_points(names.METRIC_TELEMETRY_DROPPED)
        if p.attributes[names.PL_TELEMETRY_DROP_REASON] == "step_handoff_full"
    ]
    assert dropped.value == 6
    rig.telemetry.shutdown()
    assert rig.telemetry.stats().steps_unsampled == 4  # the 4 kept were built (no sampled request)


def test_request_that_fails_while_queued_ends_its_open_wait():
    rig = make_rig()
    req = rig.telemetry.request(http_scope())
    rig.clock.advance(10_000)
    req.enqueued()
    rig.clock.advance(30_000)
    req.finished("abort")
    rig.clock.advance(5_000)
    req.fail("server_overloaded", 503)
    spans = rig.by_name()
    assert interval(rig, spans[names.SPAN_QUEUE][0]) == (1_010_000, 1_045_000)
    assert set(spans) == {"POST", names.SPAN_INGRESS, names.SPAN_QUEUE}
    root = spans["POST"][0]
    assert root.attributes[names.PL_QUEUE_MS] == 0.035 and names.PL_SERVER_TTFT_MS not in root.attributes
    assert root.attributes[names.ERROR_TYPE] == "server_overloaded"


def test_global_providers_by_default():
    telemetry = ServerTelemetry()
    assert telemetry.tracer_provider is trace.get_tracer_provider()
    req = telemetry.request(http_scope())
    req.enqueued()
    req.scheduled()
    req.first_token()
    req.token()
    req.finished(FINISH_LENGTH)
    req.complete(output_tokens=2, finish_reason=FINISH_LENGTH)
    assert telemetry.flush(10)
    stats = telemetry.stats()
    assert stats.requests_built + stats.requests_unsampled == 1 and stats.build_errors == 0
    telemetry.shutdown()


def test_a_failing_build_is_counted_and_the_builder_goes_on(caplog):
    rig = make_rig()
    broken = rig.telemetry.request(http_scope())
    broken.info = object()  # not a RequestInfo: building its spans raises
    broken.fail("invalid_request_error", 400)
    script_request(rig)
    spans = rig.by_name()
    stats = rig.telemetry.stats()
    assert stats.build_errors == 1 and stats.spans_dropped == 1 and stats.requests_built == 1
    assert "text_completion tiny" in spans and "building spans failed" in caplog.text


def test_records_after_shutdown_are_counted_not_lost():
    rig = make_rig()
    rig.telemetry.shutdown()
    script_request(rig)
    stats = rig.telemetry.stats()
    assert stats.requests_dropped == 1 and stats.steps_dropped == 1 and stats.requests_built == 0


def test_the_sdk_span_limits_apply_as_to_an_sdk_span(monkeypatch):
    """OTEL_* span limits bound the built spans exactly as the SDK bounds a span it starts."""
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "20")
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "2")
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "1")
    rig = make_rig(token_events=True)
    other = rig.telemetry.request(http_scope(traceparent=None))
    script_request(rig)  # its step links this request only; one more step links both
    rig.telemetry.step_observer.step(StepStats(1_980_000, 1_985_000, 0, 2, 3, 16), [other, other])
    other.fail("invalid_request_error", 400)
    spans = rig.by_name()
    root = spans["text_completion tiny"][0]
    sdk_span = rig.telemetry.tracer_provider.get_tracer("sdk").start_span(
        "x", attributes=dict(json.loads(json.dumps(_unbounded_root_attributes(rig))))
    )
    sdk_span.end()
    assert dict(root.attributes) == dict(sdk_span.attributes)
    assert root.dropped_attributes == sdk_span.dropped_attributes > 0
    assert len(root.attributes) == 20 and root.attributes[names.GEN_AI_RESPONSE_ID] == "cmpl"  # "cmpl-1", cut to 4
    decode = spans[names.SPAN_DECODE][0]
    assert len(decode.events) == 2 and decode.dropped_events == 3
    step = max(spans[names.SPAN_ENGINE_STEP], key=lambda s: s.dropped_links)
    assert len(step.links) == 1 and step.dropped_links == 1


def _unbounded_root_attributes(rig) -> dict:
    """The root attributes of script_request with no limits in force (a second rig, env cleared)."""
    import os

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("OTEL_SPAN_")}
    try:
        plain = make_rig()
        script_request(plain)
        root = plain.by_name()["text_completion tiny"][0]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in root.attributes.items()}
    finally:
        os.environ.update(saved)
