"""Per-request analysis schema: an AggregatingMergeTree of request facts keyed by TraceId, fed by a
materialized view from `otel_traces`, and the views `phaselens_requests` / `phaselens_steps`.

Why aggregate states: the spans of one request arrive in different inserts from different processes
(client, server), so each insert contributes a partial row per TraceId and ClickHouse merges them
(min, max, any, sum as SimpleAggregateFunction; the views read the table with FINAL). Every column
but two is idempotent (max/min/any), so a span seen twice changes nothing; the two sums (queue waits,
prefill chunk count) rely on insert deduplication: the collector gives every batch a deduplication
token, and this table keeps a deduplication window as otel_traces does, so a replayed batch is
dropped here too (`deduplicate_blocks_in_dependent_materialized_views`).

Every figure is a duration from one clock: a `phaselens.*` millisecond attribute measured on a
monotonic clock, or a phase span's own `Duration` (one process). Only `clock_offset_estimate_ms`
compares wall stamps of two machines, as a diagnostic:
    offset = ((t2 − t1) + (t3 − t4)) / 2,  t1 client sent, t2 server received, t3 server responded,
    t4 client done (wall ns).  Positive: the server clock is ahead of the client's.
"""

from __future__ import annotations

from phaselens.analysis.schema import pd_schema
from phaselens.analysis.schema.parts import Part, attr, num
from phaselens.analysis.schema.parts import select_list as _select_list
from phaselens.collectors import schema as collector_schema
from phaselens.collectors.schema import (
    DEDUP_WINDOW_BLOCKS,
    DISTRIBUTED_TABLE,
    TRACE_ID_TS_DISTRIBUTED,
    TRACE_ID_TS_TABLE,
    TRACES_TABLE,
    ident,
    ttl_interval,
)
from phaselens.instrumentation import names as n

PARTS_TABLE = "phaselens_request_parts"
PARTS_MV = f"{PARTS_TABLE}_mv"
PARTS_DISTRIBUTED = f"{PARTS_TABLE}_distributed"
FACTS_VIEW = "phaselens_request_facts"  # every per-request column, the queries read this one
REQUESTS_VIEW = "phaselens_requests"  # the documented column set (docs/contracts.md#per-request-view)
STEPS_VIEW = "phaselens_steps"
SPANS_VIEW = "phaselens_spans"  # otel_traces, of every shard on a cluster: what trace-level queries read
TRACE_TIMES_VIEW = "phaselens_trace_times"  # the trace-id lookup table, likewise

SERVER_KINDS = "('Server', 'SPAN_KIND_SERVER')"
# The spans of a disaggregated prefill or decode instance go to their own parts (analysis.schema.pd_schema)
OUTSIDE_PD_INSTANCES = (
    f"ResourceAttributes['{n.PL_PD_ROLE}'] NOT IN ('prefill', 'decode') AND NOT ({pd_schema.IS_SGLANG_PD_ROOT})"
)
CLIENT_KINDS = "('Client', 'SPAN_KIND_CLIENT')"
ERROR_CODES = "('Error', 'STATUS_CODE_ERROR')"


def _names(span_names: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{name}'" for name in span_names) + ")"


# Native request spans that are not SERVER spans: SGLang's ` Req …` root (a colocated server's: a P/D
# instance's `prefill Req …`/`decode Req …` goes to analysis.schema.pd_schema) and TGI's handler span (INTERNAL
# both). TGI's Infer layer opens a second `generate_stream`/`generate` span below the handler's: only the
# handler's carries the timings.
# Cheapest test first: ClickHouse evaluates AND lazily, so most spans never reach the map lookups.
IS_SGLANG = (
    f"startsWith(SpanName, ' Req ') AND {attr(n.SGLANG_MODULE)} = '{n.SGLANG_REQUEST_MODULE}' "
    f"AND mapContains(SpanAttributes, '{n.SGLANG_RID}')"
)
IS_TGI = f"SpanName IN {_names(n.TGI_REQUEST_SPANS)} AND mapContains(SpanAttributes, '{n.TGI_TOTAL_TIME}')"
# A server we do not own (vLLM's `llm_request`) is recognised by the de-facto TTFT key.
IS_SERVER = (
    f"(SpanKind IN {SERVER_KINDS} AND (mapContains(SpanAttributes, '{n.GEN_AI_OPERATION_NAME}') "
    f"OR mapContains(SpanAttributes, '{n.PL_SERVER_TTFT_MS}') "
    f"OR mapContains(SpanAttributes, '{n.LATENCY_TIME_TO_FIRST_TOKEN}'))) "
    f"OR ({IS_SGLANG}) OR ({IS_TGI}) OR ({pd_schema.DY_REQUEST})"
)
IS_CLIENT = (
    f"SpanKind IN {CLIENT_KINDS} AND (mapContains(SpanAttributes, '{n.GEN_AI_OPERATION_NAME}') "
    f"OR mapContains(SpanAttributes, '{n.PL_CLIENT_E2E_MS}'))"
)


# Rust's `Debug` of a `Duration`: a decimal number and a unit, trailing zeros dropped ("1.5ms", "850µs",
# "42ns", "3.2s"); Rust writes µ as U+00B5, U+03BC and `us` are accepted too.
_RUST_DURATION = "^([0-9]+(?:[.][0-9]+)?)(ns|µs|μs|us|ms|s)$"
_RUST_UNIT_MS = {"ns": "1e-6", "µs": "1e-3", "μs": "1e-3", "us": "1e-3", "ms": "1", "s": "1000"}


def rust_duration_ms(value: str) -> str:
    """A Rust `Duration` Debug string in ms, NULL when it is not one:
    ms = number × {ns: 1e-6, µs: 1e-3, ms: 1, s: 1000}[unit]"""
    groups = f"extractGroups({value}, '{_RUST_DURATION}')"
    units = ", ".join(f"{groups}[2] = '{unit}', {factor}" for unit, factor in _RUST_UNIT_MS.items())
    return f"toFloat64OrNull({groups}[1]) * multiIf({units}, NULL)"


def _attr_part(column: str, key: str) -> Part:
    """Max of a numeric attribute over the spans of the request that carry it; wall-clock
    nanoseconds stay integers (a Float64 would round them to 256 ns)."""
    if column.endswith("_wall_ns"):
        return Part(column, "max", "Nullable(Int64)", f"max(toInt64OrNull({attr(key)}))")
    return Part(column, "max", "Nullable(Float64)", f"max({num(key)})")


def _text_part(column: str, key: str, cond: str | None = None) -> Part:
    """Any non-empty value of a string attribute; with `cond`, its value on the spans that meet it
    (`if`: ClickHouse then looks the key up only in those spans)."""
    if cond:
        return Part(column, "any", "Nullable(String)", f"any(if({cond}, toNullable({attr(key)}), NULL))")
    return Part(column, "any", "Nullable(String)", f"anyIf(toNullable({attr(key)}), {attr(key)} != '')")


def _phase_part(phase: str, span_names: tuple[str, ...]) -> Part:
    """The Duration (ns) of a request's one span of this phase (max: a repeated span is harmless;
    SGLang's prefill_forward repeats only for a recompute after a retraction, which it then shows)."""
    return Part(
        f"d_{phase}", "max", "Nullable(UInt64)", f"maxIf(toNullable(Duration), SpanName IN {_names(span_names)})"
    )


def _count_part(column: str, span_names: tuple[str, ...], value: str) -> Part:
    """Σ `value` over the spans of a phase that may repeat (queue waits, prefill chunks)."""
    return Part(column, "sum", "UInt64", f"sumIf({value}, SpanName IN {_names(span_names)})")


def _kind_part(column: str, merge: str, value_type: str, expr: str, cond: str) -> Part:
    return Part(column, merge, value_type, f"{merge}If({expr}, {cond})")


# phase → the span names that measure it: the phaselens tree's, and SGLang's scheduler slices
PHASE_SPANS = {
    "ingress": (n.SPAN_INGRESS,),
    "prefill": (n.SPAN_PREFILL, n.SPAN_SGLANG_PREFILL),
    "first_token": (n.SPAN_FIRST_TOKEN,),
    "first_chunk": (n.SPAN_FIRST_CHUNK,),
    "decode": (n.SPAN_DECODE,),
    "delivery": (n.SPAN_DELIVERY,),
}
QUEUE_SPANS = (n.SPAN_QUEUE, n.SPAN_SGLANG_QUEUE)
CHUNK_SPANS = (n.SPAN_PREFILL_CHUNK, n.SPAN_SGLANG_PREFILL_CHUNK)
NUMERIC_ATTRS = {
    "a_input_tokens": n.GEN_AI_USAGE_INPUT_TOKENS,
    "a_output_tokens": n.GEN_AI_USAGE_OUTPUT_TOKENS,
    "a_cached_tokens": n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    "a_prefix_cached": n.PL_CACHED_TOKENS,
    "a_reasoning_tokens": n.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS,
    "a_client_ttft_ms": n.PL_CLIENT_TTFT_MS,
    "a_client_ttfo_ms": n.PL_CLIENT_TTFO_MS,
    "a_client_tpot_ms": n.PL_CLIENT_TPOT_MS,
    "a_client_e2e_ms": n.PL_CLIENT_E2E_MS,
    "a_client_itl_p50_ms": n.PL_CLIENT_ITL_P50_MS,
    "a_client_itl_p99_ms": n.PL_CLIENT_ITL_P99_MS,
    "a_server_ttft_ms": n.PL_SERVER_TTFT_MS,
    "a_server_tpot_ms": n.PL_SERVER_TPOT_MS,
    "a_ingress_ms": n.PL_INGRESS_MS,
    "a_queue_ms": n.PL_QUEUE_MS,
    "a_prefill_ms": n.PL_PREFILL_MS,
    "a_first_token_ms": n.PL_FIRST_TOKEN_MS,
    "a_decode_ms": n.PL_DECODE_MS,
    "a_first_chunk_ms": n.PL_FIRST_CHUNK_MS,
    "a_loop_wait_ms": n.PL_FIRST_CHUNK_LOOP_WAIT_MS,
    "a_encode_ms": n.PL_FIRST_CHUNK_ENCODE_MS,
    "a_write_ms": n.PL_FIRST_CHUNK_WRITE_MS,
    "a_held_back_ms": n.PL_HELD_BACK_MS,
    "a_held_back_tokens": n.PL_HELD_BACK_TOKENS,
    "a_inbound_ms": n.PL_INBOUND_MS,
    "a_kernel_wait_ms": n.PL_INBOUND_KERNEL_WAIT_MS,
    "a_dispatch_ms": n.PL_INBOUND_DISPATCH_MS,
    "a_client_read_ms": n.PL_CLIENT_READ_MS,
    "a_client_send_ms": n.PL_CLIENT_SEND_MS,
    "a_client_end_read_ms": n.PL_CLIENT_END_READ_MS,
    "a_client_read_body_bytes": n.PL_CLIENT_READ_BODY_BYTES,
    "a_server_ttfc_ms": n.PL_SERVER_TTFC_MS,
    "a_server_last_chunk_ms": n.PL_SERVER_LAST_CHUNK_MS,
    "a_delivery_ms": n.PL_DELIVERY_MS,
    "a_prefill_chunks": n.PL_PREFILL_CHUNKS,
    "a_itl_p50_ms": n.PL_ITL_P50_MS,
    "a_itl_p99_ms": n.PL_ITL_P99_MS,
    "a_stall_ms": n.PL_STALL_MS,
    "a_preemptions": n.PL_PREEMPTIONS,
    # de-facto engine keys (seconds): spans from vLLM/SGLang-style servers still yield a budget
    "a_lat_queue_s": n.LATENCY_TIME_IN_QUEUE,
    "a_lat_ttft_s": n.LATENCY_TIME_TO_FIRST_TOKEN,
    "a_lat_prefill_s": n.LATENCY_TIME_IN_MODEL_PREFILL,
    "a_lat_decode_s": n.LATENCY_TIME_IN_MODEL_DECODE,
    "a_prompt_tokens": n.GEN_AI_USAGE_PROMPT_TOKENS,
    "a_completion_tokens": n.GEN_AI_USAGE_COMPLETION_TOKENS,
    "a_usage_cached_tokens": n.GEN_AI_USAGE_CACHED_TOKENS,
    "a_sent_wall_ns": n.PL_CLIENT_SENT_WALL_NS,
    "a_done_wall_ns": n.PL_CLIENT_DONE_WALL_NS,
    "a_received_wall_ns": n.PL_RECEIVED_WALL_NS,
    "a_responded_wall_ns": n.PL_RESPONDED_WALL_NS,
}
TEXT_ATTRS = {
    "t_request_id": n.GEN_AI_REQUEST_ID,
    "t_response_id": n.GEN_AI_RESPONSE_ID,
    "t_request_model": n.GEN_AI_REQUEST_MODEL,
    "t_response_model": n.GEN_AI_RESPONSE_MODEL,
    "t_error_type": n.ERROR_TYPE,
    "t_finish_reason": n.PL_FINISH_REASON,
    "t_rid": n.SGLANG_RID,
    "t_x_request_id": n.HTTP_REQUEST_HEADER_X_REQUEST_ID,
    "t_client_harness": n.PL_CLIENT_HARNESS,
    "t_client_harness_version": n.PL_CLIENT_HARNESS_VERSION,
    "t_sends_ns": n.PL_FIRST_SENDS_NS,
    "t_sends_body_bytes": n.PL_FIRST_SENDS_BODY_BYTES,
}
# TGI's timings as recorded, from its request span only; the views parse them, once per request
# (parsing them in the materialized view cost ~20 % more of its server CPU, measured over 800k spans)
TGI_TIMINGS = {
    "t_tgi_validation": n.TGI_VALIDATION_TIME,
    "t_tgi_queue": n.TGI_QUEUE_TIME,
    "t_tgi_inference": n.TGI_INFERENCE_TIME,
    "t_tgi_total": n.TGI_TOTAL_TIME,
    "t_tgi_per_token": n.TGI_TIME_PER_TOKEN,
}

PARTS: tuple[Part, ...] = (
    Part("first_seen", "min", "DateTime64(9)", "min(Timestamp)"),  # every partial row has one: the TTL
    _kind_part("server_start", "min", "Nullable(DateTime64(9))", "toNullable(Timestamp)", IS_SERVER),
    _kind_part("client_start", "min", "Nullable(DateTime64(9))", "toNullable(Timestamp)", IS_CLIENT),
    _kind_part("server_duration_ns", "max", "Nullable(UInt64)", "toNullable(Duration)", IS_SERVER),
    _kind_part("server_service", "any", "Nullable(String)", "toNullable(toString(ServiceName))", IS_SERVER),
    _kind_part("client_service", "any", "Nullable(String)", "toNullable(toString(ServiceName))", IS_CLIENT),
    _kind_part("server_span", "any", "Nullable(String)", "toNullable(toString(SpanName))", IS_SERVER),
    Part(
        "native_model",
        "any",
        "Nullable(String)",  # the span model of a native root that is not a SERVER span
        f"anyIf(toNullable(if({IS_SGLANG}, '{n.SPAN_MODEL_SGLANG}', '{n.SPAN_MODEL_TGI}')), "
        f"({IS_SGLANG}) OR ({IS_TGI}))",
    ),
    Part("has_error", "max", "UInt8", f"max(StatusCode IN {ERROR_CODES})"),
    *(_phase_part(phase, name) for phase, name in PHASE_SPANS.items()),
    _count_part("queue_ns", QUEUE_SPANS, "Duration"),
    _count_part("queue_spans", QUEUE_SPANS, "1"),
    _count_part("chunk_spans", CHUNK_SPANS, "1"),
    *(_attr_part(col, key) for col, key in NUMERIC_ATTRS.items()),
    # Dynamo's frontend TTFT: `ttft_ms` of its `http-request` only (a worker's `engine.generate` has one too)
    _kind_part("a_dynamo_ttft_ms", "max", "Nullable(Float64)", num(n.DYNAMO_TTFT_MS), pd_schema.DY_REQUEST),
    *(_text_part(col, key) for col, key in TEXT_ATTRS.items()),
    *(_text_part(col, key, IS_TGI) for col, key in TGI_TIMINGS.items()),
)


def _spans_ms(phase: str) -> str:
    """The phase span's own Duration in ms (Σ over the waits for the queue); NULL when absent."""
    return "if(queue_spans = 0, NULL, queue_ns / 1e6)" if phase == "queue" else f"d_{phase} / 1e6"


def _phase_ms(phase: str, ms_attr: str, *fallbacks: str) -> str:
    """A budget term in ms: the server span's `phaselens.*_ms` attribute (the exact term, monotonic
    clock, waits after a preemption excluded: see instrumentation/pipeline/phases.py); else the phase span's
    own Duration; else what a native span model gives (`fallbacks`, ms, in order)."""
    return f"coalesce({', '.join([ms_attr, _spans_ms(phase), *fallbacks])})"


_IS_SGLANG_ROW = f"native_model = '{n.SPAN_MODEL_SGLANG}'"
# SGLang's time_in_model_prefill runs from the dispatch to the scheduler to the first token (queue,
# prefill and both hops): not a prefill term. What it leaves of TTFT is the ingress:
#     ingress = time_to_first_token − time_in_model_prefill = received → dispatched (tokenise + dispatch)
SGLANG_INGRESS_MS = f"if({_IS_SGLANG_ROW}, (a_lat_ttft_s - a_lat_prefill_s) * 1000, NULL)"
ENGINE_PREFILL_MS = f"if({_IS_SGLANG_ROW}, NULL, a_lat_prefill_s * 1000)"


def _tgi_output_tokens() -> str:
    """TGI records no token count on its span, but time_per_token = inference_time / n, truncated to
    the ns, so n = round(inference_time / time_per_token) exactly while time_per_token > 2n ns."""
    per_token = _tgi_ms("per_token")
    return (
        f"if({per_token} > 0, "  # accurateCastOrNull: a NULL row's hidden value may be a NaN
        f"accurateCastOrNull(round({_tgi_ms('inference')} / {per_token}), 'UInt32'), NULL)"
    )


def _tgi_ms(timing: str) -> str:
    """One of TGI's timings (TGI_TIMINGS) in ms."""
    return rust_duration_ms(f"t_tgi_{timing}")


def _wall_offset_ms() -> str:
    """NTP-style ((t2 − t1) + (t3 − t4)) / 2 in ms: a diagnostic, never a budget term."""
    return "((a_received_wall_ns - a_sent_wall_ns) + (a_responded_wall_ns - a_done_wall_ns)) / 2e6"


def _span_model() -> str:
    """Whose spans the row was built from: the phaselens tree (it carries `phaselens.server.ttft_ms`),
    vLLM's native `llm_request`, SGLang's or TGI's native spans, Dynamo's frontend `http-request`,
    another server's de-facto keys;
    NULL without a server view."""
    return (
        f"multiIf(a_server_ttft_ms IS NOT NULL, '{n.SPAN_MODEL_PHASELENS}', "
        f"server_span = '{n.SPAN_VLLM_REQUEST}', '{n.SPAN_MODEL_VLLM}', native_model IS NOT NULL, native_model, "
        f"server_span = '{n.SPAN_DYNAMO_HTTP_REQUEST}', '{n.SPAN_MODEL_DYNAMO}', "
        f"server_span IS NOT NULL OR a_lat_ttft_s IS NOT NULL, '{n.SPAN_MODEL_ENGINE_KEYS}', NULL)"
    )


def _before_engine_ms() -> str:
    """For a span model with a server TTFT but no first-token term (native vLLM and SGLang spans):
        before_engine = server_ttft − ingress − queue − prefill      (ms; a missing term counts 0)
    vLLM (no ingress): tokenisation, the hop into the EngineCore and the first token's hop back to the
    API server. SGLang: the hop to the scheduler, its request_process, the first token's way back
    to the TokenizerManager. NULL when the span model separates those terms (the phaselens tree)."""
    return (
        "if(first_token_ms IS NULL AND server_ttft_ms IS NOT NULL, server_ttft_ms - coalesce(ingress_ms, 0) "
        "- coalesce(ttft_queue_ms, 0) - coalesce(prefill_ms, 0), NULL)"
    )


# An array attribute reaches the map as JSON, written two ways: phaselens's collector writes a JSON
# array (`[1,2]`, `["a"]`); Rotel writes OTLP's JSON ArrayValue (`{"values":[{"intValue":"1"}]}`, an
# int64 as a string). A scalar attribute stays as it is.
def json_int_array(column: str) -> str:
    """An int-array attribute as Array(Int64), from either collector's JSON ([] when absent)."""
    v = f"ifNull({column}, '[]')"
    otlp = f"arrayMap(x -> toInt64OrZero(JSONExtractString(x, 'intValue')), JSONExtractArrayRaw({v}, 'values'))"
    return f"if(startsWith({v}, '{{'), {otlp}, JSONExtract({v}, 'Array(Int64)'))"


def json_first_string(column: str) -> str:
    """A string-array attribute's first value (either collector's JSON), or the scalar itself."""
    return (
        f"multiIf(startsWith({column}, '['), JSONExtractString({column}, 1), startsWith({column}, '{{\"values\"'), "
        f"JSONExtractString({column}, 'values', 1, 'stringValue'), {column})"
    )


def _client_late_est_ms() -> str:
    """An ESTIMATE of the client's wait that TCP hid: when the read holding the first content chunk
    also held later chunks, the kernel stamped it with their packet's arrival, and `client_read`
    starts there. With the server's sends from the first content chunk on (`sends_ns`: stamp − the
    first's; `sends_body_bytes`: body bytes through each) and the body bytes the client had through
    that read's newest byte (`read_body_bytes`):
        k = the first send with sends_body_bytes[k] ≥ read_body_bytes (the last stamped one when
            none: then a lower bound)
        client_late_est = sends_ns[k]       (server clock: the gap between the two chunks' sends,
                                             taken as their arrival gap at the client, i.e. equal
                                             network delay for both)
    0 when the read ended within the first content chunk; NULL without both views."""
    sends = json_int_array("t_sends_ns")
    upto = json_int_array("t_sends_body_bytes")
    k = f"arrayFirstIndex(b -> b >= ifNull(a_client_read_body_bytes, 0), {upto})"
    return (
        "if(a_client_read_ms IS NULL OR a_client_read_body_bytes IS NULL OR t_sends_ns IS NULL, NULL, "
        f"{sends}[if({k} = 0, length({sends}), {k})] / 1e6)"
    )


def _x_request_id() -> str:
    """The harness's request id: the X-Request-ID header as the server recorded it (semconv
    `http.request.header.x-request-id`, a string array: its first value); else, on vLLM's spans
    (native, or the phaselens plugin's service), the base of vLLM's request id, which vLLM takes
    from X-Request-Id: `cmpl-{base}-{prompt index}` for completions, `chatcmpl-{base}` for chat
    (vLLM 0.32, entrypoints/openai/*/serving.py). For a request sent without the header that base
    is vLLM's own random id, which no harness record carries."""
    header = f"nullIf({json_first_string('t_x_request_id')}, '')"
    vllm_base = (
        "nullIf(multiIf(startsWith(request_id, 'chatcmpl-'), substring(request_id, 10), "
        "extract(request_id, '^cmpl-(.+)-[0-9]+$')), '')"
    )
    is_vllm = f"span_model = '{n.SPAN_MODEL_VLLM}' OR server_service = '{n.VLLM_SERVICE_NAME}'"
    return f"coalesce({header}, if({is_vllm}, {vllm_base}, NULL))"


# The wide per-request view: (name, expression over the merged parts). The first block is the
# documented `phaselens_requests` column set, in order; the rest serve the queries.
REQUEST_COLUMNS: tuple[tuple[str, str], ...] = (
    ("trace_id", "TraceId"),
    ("request_id", "coalesce(t_request_id, t_response_id, t_rid)"),
    ("service", "coalesce(server_service, client_service)"),
    ("model", "coalesce(t_response_model, t_request_model)"),
    ("server_start_time", "server_start"),
    ("status", "if(has_error = 1 OR t_error_type IS NOT NULL, 'error', 'ok')"),  # error.type: semconv failure
    ("error_type", "t_error_type"),
    ("input_tokens", "CAST(coalesce(a_input_tokens, a_prompt_tokens) AS Nullable(UInt32))"),
    (
        "output_tokens",
        f"CAST(coalesce(a_output_tokens, a_completion_tokens, {_tgi_output_tokens()}) AS Nullable(UInt32))",
    ),
    ("cached_tokens", "CAST(coalesce(a_cached_tokens, a_prefix_cached, a_usage_cached_tokens) AS Nullable(UInt32))"),
    ("reasoning_tokens", "CAST(a_reasoning_tokens AS Nullable(UInt32))"),
    ("client_ttft_ms", "a_client_ttft_ms"),
    ("client_ttfo_ms", "a_client_ttfo_ms"),
    ("client_tpot_ms", "a_client_tpot_ms"),
    ("client_e2e_ms", "a_client_e2e_ms"),
    (
        "server_ttft_ms",
        (
            "coalesce(a_server_ttft_ms, a_lat_ttft_s * 1000, a_dynamo_ttft_ms, if(d_first_token IS NULL, NULL, "
            "ingress_ms + ttft_queue_ms + prefill_ms + first_token_ms))"
        ),
    ),
    ("server_ttfc_ms", "coalesce(a_server_ttfc_ms, server_ttft_ms + ifNull(held_back_ms, 0) + first_chunk_ms)"),
    ("ingress_ms", _phase_ms("ingress", "a_ingress_ms", SGLANG_INGRESS_MS, _tgi_ms("validation"))),
    ("queue_ms", f"coalesce({_spans_ms('queue')}, a_queue_ms, a_lat_queue_s * 1000, {_tgi_ms('queue')})"),  # all waits
    ("prefill_ms", _phase_ms("prefill", "a_prefill_ms", ENGINE_PREFILL_MS)),
    (
        "prefill_chunks",
        (
            "CAST(coalesce(a_prefill_chunks, if(chunk_spans > 0, chunk_spans, "
            "if(d_prefill IS NULL, NULL, 1))) AS Nullable(UInt32))"
        ),
    ),
    ("first_token_ms", _phase_ms("first_token", "a_first_token_ms")),
    ("held_back_ms", "a_held_back_ms"),
    ("first_chunk_ms", _phase_ms("first_chunk", "a_first_chunk_ms")),
    ("decode_ms", _phase_ms("decode", "a_decode_ms", "a_lat_decode_s * 1000")),
    ("delivery_ms", _phase_ms("delivery", "a_delivery_ms")),
    ("server_tpot_ms", "coalesce(a_server_tpot_ms, if(output_tokens > 1, decode_ms / (output_tokens - 1), NULL))"),
    ("itl_p99_ms", "a_itl_p99_ms"),
    ("stall_ms", "a_stall_ms"),
    ("preemptions", "CAST(coalesce(a_preemptions, if(queue_spans = 0, NULL, queue_spans - 1)) AS Nullable(UInt32))"),
    # the server's inbound edge, and the client's own time: before its request's bytes left, after
    # the first content bytes arrived (kernel receive stamps)
    ("inbound_ms", "a_inbound_ms"),
    (
        "client_ms",
        (
            "if(a_client_send_ms IS NULL AND a_client_read_ms IS NULL, NULL, "
            "ifNull(a_client_send_ms, 0) + ifNull(a_client_read_ms, 0))"
        ),
    ),
    ("client_late_est_ms", _client_late_est_ms()),  # an estimate: the late client's wait TCP's coalescing hid
    # what no stamp explains (network both ways): against the server's first content bytes where it
    # stamped them, less the edges observed on either side (an unobserved edge stays in it)
    (
        "residual_ms",
        (
            "client_ttft_ms - coalesce(server_ttfc_ms, server_ttft_ms) - ifNull(inbound_ms, 0) - ifNull(client_ms, 0) "
            "- ifNull(client_late_est_ms, 0)"
        ),
    ),
    # the same at the stream's end, less the start's edges and the client's read of the last content
    # bytes; TGI: total_time ends as its last token reaches the router, before that event's SSE encoding
    (
        "e2e_residual_ms",
        (
            f"client_e2e_ms - coalesce(a_server_last_chunk_ms, {_tgi_ms('total')}) - ifNull(inbound_ms, 0) "
            "- ifNull(a_client_send_ms, 0) - ifNull(a_client_end_read_ms, 0)"
        ),
    ),
    ("clock_offset_estimate_ms", _wall_offset_ms()),
    ("span_model", _span_model()),
    ("before_engine_ms", _before_engine_ms()),
    ("x_request_id", _x_request_id()),
    # who measured the client view: an imported harness's name, else phaselens's own client
    ("client_harness", f"if(client_start IS NULL, NULL, coalesce(t_client_harness, '{n.HARNESS_PHASELENS}'))"),
)
EXTRA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("start_time", "coalesce(server_start, client_start)"),
    # the waits before the first token
    ("ttft_queue_ms", _phase_ms("queue", "a_queue_ms", "a_lat_queue_s * 1000", _tgi_ms("queue"))),
    ("server_end_time", "server_start + toIntervalNanosecond(server_duration_ns)"),
    ("server_e2e_ms", "server_duration_ns / 1e6"),
    ("server_last_chunk_ms", "a_server_last_chunk_ms"),
    ("loop_wait_ms", "a_loop_wait_ms"),
    ("encode_ms", "a_encode_ms"),
    ("write_ms", "a_write_ms"),
    ("held_back_tokens", "CAST(a_held_back_tokens AS Nullable(UInt32))"),
    ("kernel_wait_ms", "a_kernel_wait_ms"),
    ("dispatch_ms", "a_dispatch_ms"),
    ("client_send_ms", "a_client_send_ms"),
    ("client_read_ms", "a_client_read_ms"),
    ("client_end_read_ms", "a_client_end_read_ms"),
    ("has_client", "client_start IS NOT NULL"),
    ("has_server", "server_start IS NOT NULL"),
    ("finish_reason", "t_finish_reason"),
    ("queue_waits", "queue_spans"),
    ("itl_p50_ms", "a_itl_p50_ms"),
    ("client_itl_p50_ms", "a_client_itl_p50_ms"),
    ("client_itl_p99_ms", "a_client_itl_p99_ms"),
    ("ttft_ms", "coalesce(client_ttft_ms, server_ttft_ms)"),
    ("tpot_ms", "coalesce(client_tpot_ms, server_tpot_ms)"),
    ("client_harness_version", "t_client_harness_version"),
)
REQUESTS_VIEW_COLUMNS = tuple(name for name, _ in REQUEST_COLUMNS)

STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("time", "Timestamp"),
    ("service", "ServiceName"),
    ("trace_id", "TraceId"),
    ("span_id", "SpanId"),
    ("step_index", f"toUInt64OrNull({attr(n.PL_STEP_INDEX)})"),
    ("batch_size", f"toUInt32OrNull({attr(n.PL_STEP_NUM_SEQS)})"),
    ("prefill_tokens", f"toUInt32OrZero({attr(n.PL_STEP_PREFILL_TOKENS)})"),
    ("decode_tokens", f"toUInt32OrZero({attr(n.PL_STEP_DECODE_TOKENS)})"),
    ("kv_blocks_used", f"toUInt32OrNull({attr(n.PL_STEP_KV_BLOCKS_USED)})"),
    ("kv_blocks_total", f"toUInt32OrNull({attr(n.PL_STEP_KV_BLOCKS_TOTAL)})"),
    ("preemptions", f"toUInt32OrZero({attr(n.PL_STEP_PREEMPTIONS)})"),
    ("queue_depth", f"toUInt32OrNull({attr(n.PL_STEP_QUEUE_DEPTH)})"),
    ("duration_ms", "Duration / 1e6"),
    ("linked_requests", "length(Links.TraceId)"),
)
STEPS_VIEW_COLUMNS = tuple(name for name, _ in STEP_COLUMNS)


def parts_select(traces: str) -> str:
    """The materialized view's SELECT: one insert's spans folded into partial rows per TraceId."""
    mv_cols = ",\n    ".join(f"{p.insert_expr} AS {p.column}" for p in PARTS)
    return (
        f"SELECT TraceId,\n    {mv_cols}\nFROM {traces}\n"
        f"WHERE SpanName != '{n.SPAN_ENGINE_STEP}' AND TraceId != '' AND {OUTSIDE_PD_INSTANCES}\nGROUP BY TraceId"
    )


def merged_parts(parts: str) -> str:
    """`parts` rows merged into one row per TraceId by GROUP BY (what FINAL does on the table)."""
    merged = ",\n        ".join(f"{p.merge}({p.column}) AS {p.column}" for p in PARTS)
    return f"(SELECT TraceId,\n        {merged}\n    FROM {parts}\n    GROUP BY TraceId)"


def facts_select(parts: str, final: bool = True) -> str:
    """The per-request facts over the parts table read with FINAL (the merge functions applied on
    read: ~2× faster than a GROUP BY TraceId), or over any relation with one row per TraceId."""
    return (
        f"SELECT\n    {_select_list(REQUEST_COLUMNS + EXTRA_COLUMNS)}\n"
        f"FROM {parts}{' FINAL' if final else ''}\n"
        "WHERE server_start IS NOT NULL OR client_start IS NOT NULL"
    )


def statements(
    database: str = "otel", cluster: str | None = None, ttl: str | None = None, on_cluster: bool = True
) -> list[str]:
    """CREATE statements (idempotent), to run after `phaselens.collectors.schema.statements(...)`; `ttl`
    (e.g. 72h, as for otel_traces) drops request rows that long after their first span.

    With `cluster`: the parts table per shard, fed from the local `otel_traces` (the collector's
    Distributed table shards by TraceId, so a request's spans meet on one shard and FINAL merges
    them there), and a Distributed table over the parts that the views read. `on_cluster`: ON
    CLUSTER DDL and a ReplicatedAggregatingMergeTree; else statements for every node in turn, with
    a plain AggregatingMergeTree.
    """
    db = ident(database)
    replicated = bool(cluster) and on_cluster
    on = f" ON CLUSTER {ident(cluster)}" if replicated and cluster else ""
    engine = "ReplicatedAggregatingMergeTree()" if replicated else "AggregatingMergeTree()"
    parts, traces = f"{db}.{ident(PARTS_TABLE)}", f"{db}.{ident(TRACES_TABLE)}"
    parts_read = f"{db}.{ident(PARTS_DISTRIBUTED)}" if cluster else parts
    part_cols = ",\n    ".join(p.ddl() for p in PARTS)
    add_columns = ",\n    ".join(f"ADD COLUMN IF NOT EXISTS {p.ddl()}" for p in PARTS)
    out = [
        f"CREATE TABLE IF NOT EXISTS {parts}{on} (\n    TraceId String CODEC(ZSTD(1)),\n    {part_cols}\n)"
        f" ENGINE = {engine}\nORDER BY TraceId"
        + (f"\nTTL toDateTime(first_seen) + {ttl_interval(ttl)}" if ttl else "")
        + ("" if replicated else f"\nSETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW_BLOCKS}"),
        # a schema applied by an older phaselens gains the newer columns (before the view, whose
        # query is checked against the table), and its view writes them
        f"ALTER TABLE {parts}{on}\n    {add_columns}",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{ident(PARTS_MV)}{on} TO {parts}\nAS {parts_select(traces)}",
        f"ALTER TABLE {db}.{ident(PARTS_MV)}{on} MODIFY QUERY {parts_select(traces)}",
    ]
    if cluster:
        out += [
            (
                f"CREATE TABLE IF NOT EXISTS {parts_read}{on} AS {parts}\n"
                f"ENGINE = {collector_schema.distributed_engine(cluster, database, PARTS_TABLE)}"
            ),
            f"ALTER TABLE {parts_read}{on}\n    {add_columns}",
        ]  # an upgrade reaches the reads too
    pd_ttl = f"\nTTL toDateTime(first_seen) + {ttl_interval(ttl)}" if ttl else ""
    out += pd_schema.statements(database, pd_ttl, cluster, on_cluster)
    spans = f"{db}.{ident(DISTRIBUTED_TABLE)}" if cluster else traces
    lookup = f"{db}.{ident(TRACE_ID_TS_DISTRIBUTED if cluster else TRACE_ID_TS_TABLE)}"
    out += [
        f"CREATE OR REPLACE VIEW {db}.{ident(SPANS_VIEW)}{on} AS\nSELECT * FROM {spans}",
        f"CREATE OR REPLACE VIEW {db}.{ident(TRACE_TIMES_VIEW)}{on} AS\nSELECT TraceId, Start, End FROM {lookup}",
        f"CREATE OR REPLACE VIEW {db}.{ident(FACTS_VIEW)}{on} AS\n{facts_select(parts_read)}",
        (
            f"CREATE OR REPLACE VIEW {db}.{ident(REQUESTS_VIEW)}{on} AS\n"
            f"SELECT {', '.join(REQUESTS_VIEW_COLUMNS)}, {pd_schema.requests_columns()}\n"
            f"FROM {db}.{ident(FACTS_VIEW)}\n{pd_schema.requests_join(database)}"
        ),
        (
            f"CREATE OR REPLACE VIEW {db}.{ident(STEPS_VIEW)}{on} AS\nSELECT\n    {_select_list(STEP_COLUMNS)}\n"
            f"FROM {spans}\nWHERE SpanName = '{n.SPAN_ENGINE_STEP}'"
        ),
    ]
    return out


def script(statements: list[str]) -> str:
    """Statements as one SQL script, each ended by `;` (what `phaselens schema apply --print` prints)."""
    return ";\n\n".join(statements) + ";"
