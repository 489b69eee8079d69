"""Records → span descriptions (`SpanData`), on the builder's thread only: what every span of a
record is, as plain values, made once for both backends.

Per request (one trace, child of the client's span when a traceparent arrived):

    {operation} {model}  SERVER   received → responded          (started at receipt, ended here)
    ├ llm.ingress                 received → enqueued
    ├ llm.queue ×N                one per wait (phaselens.queue.wait_index 0, then 1… after preemptions)
    ├ llm.prefill                 scheduled₀ → end of the last prefill chunk before the first token
    │ └ llm.prefill.chunk ×k      only when the request was prefilled in more than one chunk
    ├ llm.first_token             prefill end → first token on the host
    ├ llm.decode                  first token → last token (recompute chunks after a preemption are
    │                             its llm.prefill.chunk children, phaselens.prefill.recompute=true)
    └ llm.delivery                last token → responded

Budget terms and formulas: see `phaselens.instrumentation.pipeline.phases`. The SERVER span carries them all as
attributes (phaselens.*_ms, the GenAI semconv keys and the de-facto gen_ai.latency.* keys in
seconds), so a per-request query needs no join.

Engine steps: one `llm.engine_step` span per iteration in a trace of its own, linked to the SERVER
spans of the batch's sampled requests; a step whose batch holds no sampled request is not built, and
the step's own trace is sampled by the provider's root sampler (always, by default; with a ratio
sampler, that share of steps). The SDK keeps 128 links per span by default
(OTEL_SPAN_LINK_COUNT_LIMIT) and 128 events (OTEL_SPAN_EVENT_COUNT_LIMIT, per-token events).

Every span of a request shares the trace id, flags and trace state of its SERVER span: the one
sampling decision, taken at receipt, holds for the whole tree. Child span ids come from the
provider's id generator.

Two backends turn the descriptions into exported spans: `emitter.SpanEmitter` makes SDK
ReadableSpans for a tracer provider's span processors (a provider the user brought, with their
sampling and exporters), and `otlp_fast.FastEmitter` encodes OTLP protobuf bytes in C
(`_otlp_encode`) where phaselens owns the provider. An attribute added to llm.decode here reaches
both with no other code; the SERVER span, the other phase spans and llm.engine_step the fast
backend writes from the record, the stamps and the step (`encode_root`, `encode_phases`,
`encode_step`), so a change to them goes into `_otlp_encode.c` too (the byte-for-byte property
tests in tests/test_otlp_fast.py fail until both agree). Times in a `SpanData` are wall-clock ns (the process anchor's), ids ints,
`kind` and `status_code` OTLP's numbers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol, overload

from opentelemetry.context import Context
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, StaticSampler
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.ids import child_flags, state_header
from phaselens.instrumentation.hotpath.observer import FINISH_ERROR
from phaselens.instrumentation.hotpath.records import LINK, Int64s, RequestRecord, StepRecord, unpack_link
from phaselens.instrumentation.hotpath.timeline import CHUNK_FIELDS
from phaselens.instrumentation.pipeline._otlp_encode import present
from phaselens.instrumentation.pipeline._token_gaps import itl_ms
from phaselens.instrumentation.pipeline.phases import Phases

NS_PER_MS = 1e6
NS_PER_S = 1e9


def error_type(record: RequestRecord) -> str | None:
    """The request's `error.type`: what the app said, else what the transport or engine saw."""
    http, outcome = record.http, record.outcome
    status = outcome.status_code or http.status_code
    if outcome.error_type:
        return outcome.error_type
    if http.client_disconnected:
        return names.ERROR_CLIENT_DISCONNECTED
    if http.exception_type:
        return http.exception_type
    if status is not None and status >= 400:
        return str(status)
    if record.finish_reason == FINISH_ERROR:
        return FINISH_ERROR
    return None


def output_tokens(record: RequestRecord, phases: Phases) -> int:
    """Usage as reported by `complete()`, else counted from the stamps (1 + Σ tokens per step)."""
    if record.outcome.output_tokens is not None:
        return record.outcome.output_tokens
    return (1 + phases.decode_tokens) if phases.first_token_ts else 0


def tpot_ns(phases: Phases, tokens: int) -> float | None:
    """(last_token − first_token) / (output_tokens − 1), for output_tokens > 1."""
    if not phases.first_token_ts or tokens <= 1:
        return None
    return phases.decode_ns / (tokens - 1)


def _ms(ns: float) -> float:
    return ns / NS_PER_MS


def _messages(role: str, content: Any, finish_reason: str | None = None) -> str:
    """GenAI semconv message JSON: a str becomes one text part; chat messages keep their roles."""
    if isinstance(content, str):
        message: dict[str, Any] = {"role": role, "parts": [{"type": "text", "content": content}]}
        if finish_reason:
            message["finish_reason"] = finish_reason
        return json.dumps([message])
    return json.dumps(
        [{"role": m.get("role", role), "parts": [{"type": "text", "content": m.get("content")}]} for m in content],
        default=str,
    )


def content_messages(record: RequestRecord) -> tuple[str | None, str | None]:
    """gen_ai.input.messages and gen_ai.output.messages (None: not captured)."""
    info, outcome = record.info, record.outcome
    prompt = info.prompt if info is not None else None
    finish_reason = outcome.finish_reason or record.finish_reason or None
    return (
        _messages("user", prompt) if prompt is not None else None,
        _messages("assistant", outcome.completion, finish_reason) if outcome.completion is not None else None,
    )


# the SERVER root's attributes, in export order; values in `request_attributes` (one tuple, the
# pairs whose value is None left out by `present`: None means the attribute is not recorded)
_ROOT_KEYS = (
    names.GEN_AI_PROVIDER_NAME,
    names.HTTP_REQUEST_METHOD,
    names.URL_PATH,
    names.HTTP_RESPONSE_STATUS_CODE,
    names.SERVER_ADDRESS,
    names.SERVER_PORT,
    names.HTTP_REQUEST_HEADER_X_REQUEST_ID,
    names.ERROR_TYPE,
    names.PL_INGRESS_MS,
    names.PL_QUEUE_MS,
    names.PL_PREFILL_MS,
    names.PL_FIRST_TOKEN_MS,
    names.PL_DECODE_MS,
    names.PL_DELIVERY_MS,
    names.PL_SERVER_TTFT_MS,
    names.PL_SERVER_TPOT_MS,
    names.PL_PREEMPTIONS,
    names.PL_FINISH_REASON,
    names.PL_CLIENT_DISCONNECTED,
    names.PL_RECEIVED_WALL_NS,
    names.PL_RESPONDED_WALL_NS,
    names.GEN_AI_RESPONSE_FINISH_REASONS,
    names.GEN_AI_USAGE_OUTPUT_TOKENS,
    names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
    names.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS,
    # de-facto engine keys, vLLM's definitions, seconds
    names.LATENCY_TIME_IN_QUEUE,
    names.LATENCY_TIME_TO_FIRST_TOKEN,
    names.LATENCY_E2E,
    names.LATENCY_TIME_IN_MODEL_PREFILL,
    names.LATENCY_TIME_IN_MODEL_DECODE,
    names.LATENCY_TIME_IN_MODEL_INFERENCE,
)
_INFO_KEYS = (
    names.GEN_AI_OPERATION_NAME,
    names.GEN_AI_REQUEST_MODEL,
    names.GEN_AI_RESPONSE_MODEL,
    names.GEN_AI_RESPONSE_ID,
    names.GEN_AI_REQUEST_ID,
    names.GEN_AI_USAGE_INPUT_TOKENS,
    names.GEN_AI_REQUEST_MAX_TOKENS,
    names.GEN_AI_REQUEST_TEMPERATURE,
    names.GEN_AI_REQUEST_TOP_P,
    names.GEN_AI_REQUEST_TOP_K,
    names.GEN_AI_REQUEST_SEED,
    names.GEN_AI_REQUEST_STREAM,
)


def request_attributes(record: RequestRecord, phases: Phases, anchor: ClockAnchor) -> dict[str, Any]:
    """Every attribute of the SERVER root span (docs/span-model.md#server-root-span); None values
    are not recorded."""
    info, outcome, http = record.info, record.outcome, record.http
    tokens = output_tokens(record, phases)
    finish_reason = outcome.finish_reason or record.finish_reason or None
    tpot = tpot_ns(phases, tokens)
    ttft = phases.ttft_ns if phases.first_token_ts else None
    prefill_ns, first_token_ns, decode_ns = phases.prefill_ns, phases.first_token_phase_ns, phases.decode_ns
    queue_ns = phases.queue_ns
    cached = outcome.cached_tokens or sum(record.chunks[3::CHUNK_FIELDS])
    attributes = present(
        _ROOT_KEYS,
        (
            names.PROVIDER_PHASELENS,
            http.method or None,
            http.path or None,
            outcome.status_code or http.status_code,
            http.server_address,
            http.server_port,
            [http.x_request_id] if http.x_request_id else None,
            error_type(record),
            phases.ingress_ns / NS_PER_MS,
            queue_ns / NS_PER_MS,
            prefill_ns / NS_PER_MS,
            first_token_ns / NS_PER_MS,
            decode_ns / NS_PER_MS,
            phases.delivery_ns / NS_PER_MS,
            ttft / NS_PER_MS if ttft is not None else None,
            tpot / NS_PER_MS if tpot is not None else None,
            max(0, len(phases.waits) - 1),
            finish_reason,
            http.client_disconnected,
            anchor.to_wall_ts(phases.received_ts),
            anchor.to_wall_ts(phases.end_ts),
            [finish_reason] if finish_reason else None,
            tokens,
            cached,
            outcome.reasoning_tokens,
            queue_ns / NS_PER_S,
            ttft / NS_PER_S if ttft is not None else None,
            phases.e2e_ns / NS_PER_S,
            (prefill_ns + first_token_ns) / NS_PER_S,
            decode_ns / NS_PER_S,
            (prefill_ns + first_token_ns + decode_ns) / NS_PER_S,
        ),
    )
    if info is not None:
        present(
            _INFO_KEYS,
            (
                info.operation,
                info.model,
                info.model,
                info.request_id,
                info.request_id,
                info.input_tokens,
                info.max_tokens,
                info.temperature,
                info.top_p,
                info.top_k,
                info.seed,
                info.stream,
            ),
            attributes,
        )
    input_messages, output_messages = content_messages(record)
    if input_messages is not None:
        attributes[names.GEN_AI_INPUT_MESSAGES] = input_messages
    if output_messages is not None:
        attributes[names.GEN_AI_OUTPUT_MESSAGES] = output_messages
    if phases.first_chunk_ts:  # a content chunk was streamed
        add_first_chunk(attributes, phases)
    if record.sends:
        add_first_sends(attributes, record.sends)
    if phases.read_ts:  # the server has an inbound protocol
        add_inbound(attributes, phases)
    return attributes


def first_chunk_split(phases: Phases) -> dict[str, Any]:
    """What llm.first_chunk carries: loop_wait + encode (= the term) and write beside it."""
    return {
        names.PL_FIRST_CHUNK_LOOP_WAIT_MS: _ms(phases.loop_wait_ns),
        names.PL_FIRST_CHUNK_ENCODE_MS: _ms(phases.encode_ns),
        names.PL_FIRST_CHUNK_WRITE_MS: _ms(phases.write_ns),
    }


def add_first_sends(attributes: dict[str, Any], sends: Int64s) -> None:
    """The body chunks handed to `send` from the first content chunk on (timeline `sends`, not
    empty): each one's stamp − the first's (ns) and the body bytes through it."""
    first = sends[0]
    attributes[names.PL_FIRST_SENDS_NS] = tuple(t - first for t in sends[0::2])
    attributes[names.PL_FIRST_SENDS_BODY_BYTES] = tuple(sends[1::2])


def add_inbound(attributes: dict[str, Any], phases: Phases) -> None:
    """The inbound edge on the root (exact, kernel receive stamp); dispatch alone when the kernel gave
    no stamp. For a server with an inbound protocol (`read_ts` stamped)."""
    attributes[names.PL_INBOUND_DISPATCH_MS] = _ms(phases.dispatch_ns)
    if phases.arrived_ts:
        attributes[names.PL_INBOUND_MS] = _ms(phases.inbound_ns)
        attributes[names.PL_INBOUND_KERNEL_WAIT_MS] = _ms(phases.kernel_wait_ns)


def add_first_chunk(attributes: dict[str, Any], phases: Phases) -> None:
    """The first_chunk term, the held-back decode steps before it, its split, server TTFC and last
    chunk, on the root, for a request that streamed a content chunk (`first_chunk_ts`)."""
    attributes[names.PL_FIRST_CHUNK_MS] = _ms(phases.first_chunk_phase_ns)
    if phases.held_back_known:
        attributes[names.PL_HELD_BACK_MS] = _ms(phases.held_back_ns)
        attributes[names.PL_HELD_BACK_TOKENS] = phases.held_back_tokens
    attributes.update(first_chunk_split(phases))
    attributes[names.PL_SERVER_TTFC_MS] = _ms(phases.ttfc_ns)
    attributes[names.PL_SERVER_LAST_CHUNK_MS] = _ms(phases.last_chunk_ts - phases.received_ts)


def decode_attributes(phases: Phases) -> dict[str, Any]:
    """ITL p50, p99 (`common.quantile`), max and stall (`phases`' formula) of the sorted gaps, in ms
    (0.0 each with no gap), from `itl_ms` in C."""
    p50_ms, p99_ms, max_ms, stall_ms = itl_ms(phases.itl_sorted_ns)
    return {
        names.PL_DECODE_TOKENS: phases.decode_tokens,
        names.PL_DECODE_STEPS: phases.decode_steps,
        names.PL_ITL_P50_MS: p50_ms,
        names.PL_ITL_P99_MS: p99_ms,
        names.PL_ITL_MAX_MS: max_ms,
        names.PL_STALL_MS: stall_ms,
    }


def prefill_attributes(record: RequestRecord, phases: Phases) -> dict[str, Any]:
    initial = record.chunks[: phases.initial_chunks * CHUNK_FIELDS]
    return {
        names.PL_PREFILL_CHUNKS: phases.initial_chunks,
        names.PL_CHUNK_TOKENS: sum(initial[2::CHUNK_FIELDS]),
        names.PL_CACHED_TOKENS: sum(initial[3::CHUNK_FIELDS]),
    }


KIND_INTERNAL, KIND_SERVER = 1, 2  # OTLP Span.SpanKind
STATUS_UNSET, STATUS_ERROR = 0, 2  # OTLP Status.StatusCode (= the API's StatusCode values)

Event = tuple[str, int, dict[str, Any]]  # (name, time_ts, attributes)
# a link: packed SERVER span ids (records.pack_link), or (trace_id, span_id, trace_flags[, attributes])
LinkIds = bytes | tuple[int, int, int] | tuple[int, int, int, dict[str, Any]]
# a span's links: one entry per link, or packed links end to end in one bytes (LINK.size bytes each)
Links = tuple[LinkIds, ...] | bytes


class SpanData(NamedTuple):
    """One finished span. Field order is the C encoder's (`_otlp_encode.c`, enum F_*)."""

    name: str
    kind: int
    trace_id: int
    span_id: int
    parent_id: int | None
    parent_remote: bool
    trace_flags: int
    trace_state: str  # W3C tracestate header form
    start_ts: int
    end_ts: int
    attributes: dict[str, Any]
    events: tuple[Event, ...] = ()
    links: Links = ()
    status_code: int = STATUS_UNSET
    status_message: str | None = None


class SpanBackend(Protocol):
    """Where described spans go: `emitter.SpanEmitter` (SDK) or `otlp_fast.FastEmitter` (C → OTLP)."""

    ids: IdGenerator  # child span ids and step trace ids
    sampler: Sampler  # decides each engine step's own trace
    emitted: int  # spans given to emit()

    def emit_data(self, spans: Sequence[SpanData]) -> None: ...
    def emit_steps(self, anchor: ClockAnchor, steps: Sequence[PackedStep]) -> int: ...  # how many built (sampled)
    def emit_request(
        self, anchor: ClockAnchor, record: RequestRecord, phases: Phases, token_events: bool, full: str = ...
    ) -> None: ...
    def emit_compact(self, anchor: ClockAnchor, record: RequestRecord, phases: Phases) -> None: ...


_new_tuple = tuple.__new__  # SpanData from all its fields: no NamedTuple __new__ frame (~2k instructions a span)


class _Tree:
    """The spans of one request's trace, collected in the order they would have ended."""

    __slots__ = ("ids", "root", "spans", "wall_offset_ns")

    def __init__(self, ids: IdGenerator, anchor: ClockAnchor, root: RequestRecord) -> None:
        self.ids, self.root = ids, root.root
        self.wall_offset_ns = anchor.wall_offset_ns  # wall = mono + offset (the anchor's formula)
        self.spans: list[SpanData] = []

    def leaf(
        self,
        name: str,
        start_ts: int,
        end_ts: int,
        attributes: dict[str, Any] | None = None,
        parent_id: int | None = None,
        span_id: int | None = None,
        events: tuple[Event, ...] = (),
    ) -> None:
        """A child span (of the root unless `parent_id`), with the root's trace, flags and state."""
        root, offset = self.root, self.wall_offset_ns
        self.spans.append(
            _new_tuple(
                SpanData,
                (
                    name,
                    KIND_INTERNAL,
                    root.trace_id,
                    span_id or self.ids.generate_span_id(),
                    parent_id or root.span_id,
                    False,
                    root.trace_flags,
                    root.trace_state,
                    start_ts + offset,
                    end_ts + offset,
                    attributes or {},
                    events,
                    (),
                    STATUS_UNSET,
                    None,
                ),
            )
        )


def _chunk_spans(tree: _Tree, record: RequestRecord, phases: Phases, prefill: int | None, decode: int | None) -> None:
    """llm.prefill.chunk spans: initial chunks under llm.prefill (when more than one), recompute
    chunks after the first token under llm.decode."""
    chunks = record.chunks
    for index in range(len(chunks) // CHUNK_FIELDS):
        start, end, tokens, cached = chunks[index * CHUNK_FIELDS : (index + 1) * CHUNK_FIELDS]
        recompute = index >= phases.initial_chunks
        parent = decode if recompute else prefill
        if parent is None or (not recompute and phases.initial_chunks < 2):
            continue
        attributes = {
            names.PL_CHUNK_INDEX: index,
            names.PL_CHUNK_TOKENS: tokens,
            names.PL_CACHED_TOKENS: cached,
            names.PL_PREFILL_RECOMPUTE: recompute,
        }
        tree.leaf(names.SPAN_PREFILL_CHUNK, start, end, attributes, parent)


def _token_events(anchor: ClockAnchor, record: RequestRecord) -> tuple[Event, ...]:
    wall_offset_ns = anchor.wall_offset_ns
    return tuple(
        (names.EVENT_TOKEN, t_ts + wall_offset_ns, {names.PL_TOKEN_COUNT: n})
        for t_ts, n in zip(record.token_ts, record.token_n, strict=False)
    )


def request_spans(
    ids: IdGenerator,
    anchor: ClockAnchor,
    record: RequestRecord,
    phases: Phases,
    token_events: bool,
    full: str = names.TRACE_FULL_HEAD,
) -> list[SpanData]:
    """The spans of one sampled request: phase spans, then the SERVER span (docs/span-model.md);
    `full` why its tree is kept (`sampling.TailRule.full`)."""
    tree = _Tree(ids, anchor, record)
    # rejected before reaching the engine: the whole request was ingress
    tree.leaf(names.SPAN_INGRESS, phases.received_ts, phases.enqueued_ts or phases.end_ts)
    for index, (start, end) in enumerate(phases.waits):
        tree.leaf(names.SPAN_QUEUE, start, end, {names.PL_QUEUE_WAIT_INDEX: index})
    prefill = ids.generate_span_id() if phases.scheduled_ts else None
    decode = None
    if phases.first_token_ts:
        tree.leaf(names.SPAN_FIRST_TOKEN, phases.prefill_end_ts, phases.first_token_ts)
        if phases.first_chunk_ts:
            tree.leaf(names.SPAN_FIRST_CHUNK, phases.visible_ts, phases.first_chunk_ts, first_chunk_split(phases))
        decode = ids.generate_span_id()
        tree.leaf(names.SPAN_DELIVERY, phases.last_token_ts, phases.end_ts)
    _chunk_spans(tree, record, phases, prefill, decode)
    if prefill is not None:
        attributes = prefill_attributes(record, phases)
        tree.leaf(names.SPAN_PREFILL, phases.scheduled_ts, phases.prefill_end_ts, attributes, span_id=prefill)
    if decode is not None:
        attributes, events = decode_description(anchor, record, phases, token_events)
        tree.leaf(names.SPAN_DECODE, phases.first_token_ts, phases.last_token_ts, attributes, None, decode, events)
    tree.spans += kv_spans(ids, anchor, record)
    tree.spans.append(root_span(anchor, record, phases, full))
    return tree.spans


def kv_spans(ids: IdGenerator, anchor: ClockAnchor, record: RequestRecord) -> list[SpanData]:
    """llm.kv_save / llm.kv_load, children of the SERVER span, for a request a KV connector moved
    (`record.kv`; none otherwise): each its calls' span, the time inside them, the bytes where known."""
    kv = record.kv
    if kv is None:
        return []
    tree = _Tree(ids, anchor, record)
    for name, key, (start, end, busy_ns, nbytes) in (
        (names.SPAN_KV_SAVE, names.PL_KV_SAVE_MS, kv[0:4]),
        (names.SPAN_KV_LOAD, names.PL_KV_LOAD_MS, kv[4:8]),
    ):
        if start:
            attributes: dict[str, Any] = {key: _ms(busy_ns)}
            if nbytes is not None:
                attributes[names.PL_KV_BYTES] = nbytes
            tree.leaf(name, start, end, attributes)
    return tree.spans


def decode_description(
    anchor: ClockAnchor, record: RequestRecord, phases: Phases, token_events: bool
) -> tuple[dict[str, Any], tuple[Event, ...]]:
    """llm.decode's attributes and its token events (none unless `token_events`)."""
    return decode_attributes(phases), _token_events(anchor, record) if token_events else ()


def emit_request_spans(
    backend: SpanBackend,
    anchor: ClockAnchor,
    record: RequestRecord,
    phases: Phases,
    token_events: bool,
    full: str = names.TRACE_FULL_HEAD,
) -> None:
    """A sampled request's spans described (`request_spans`) and emitted."""
    backend.emit_data(request_spans(backend.ids, anchor, record, phases, token_events, full))


# a request's phase spans as `_otlp_encode.encode_phases` takes them (it writes what `request_spans`
# describes for them): names, attribute keys, and the stamps and terms in `phase_stamps`'s order
PHASE_NAMES = (
    names.SPAN_INGRESS,
    names.SPAN_QUEUE,
    names.SPAN_FIRST_TOKEN,
    names.SPAN_FIRST_CHUNK,
    names.SPAN_DELIVERY,
    names.SPAN_PREFILL_CHUNK,
    names.SPAN_PREFILL,
    names.SPAN_DECODE,
)
PHASE_KEYS = (
    names.PL_QUEUE_WAIT_INDEX,
    names.PL_FIRST_CHUNK_LOOP_WAIT_MS,
    names.PL_FIRST_CHUNK_ENCODE_MS,
    names.PL_FIRST_CHUNK_WRITE_MS,
    names.PL_CHUNK_INDEX,
    names.PL_CHUNK_TOKENS,
    names.PL_CACHED_TOKENS,
    names.PL_PREFILL_RECOMPUTE,
    names.PL_PREFILL_CHUNKS,
)


def phase_stamps(phases: Phases) -> tuple[int, ...]:
    """What `encode_phases` reads of the phases (monotonic ns, then the first_chunk split's ns and
    the count of initial chunks)."""
    p = phases
    return (
        p.received_ts,
        p.enqueued_ts or p.end_ts,  # llm.ingress's end, as request_spans takes it
        p.end_ts,
        p.scheduled_ts,
        p.prefill_end_ts,
        p.first_token_ts,
        p.visible_ts,
        p.first_chunk_ts,
        p.last_token_ts,
        p.loop_wait_ns,
        p.encode_ns,
        p.write_ns,
        p.initial_chunks,
    )


def root_span(
    anchor: ClockAnchor,
    record: RequestRecord,
    phases: Phases,
    full: str = names.TRACE_FULL_HEAD,
    summary: dict[str, Any] | None = None,
) -> SpanData:
    """The SERVER span: `request_attributes`, why its tree is kept (`full`) and `summary`."""
    attributes = request_attributes(record, phases, anchor)
    attributes[names.PL_TRACE_FULL] = full
    if summary:
        attributes.update(summary)
    root, parent = record.root, record.parent
    failure = attributes.get(names.ERROR_TYPE)
    return _new_tuple(
        SpanData,
        (
            root_name(record),
            KIND_SERVER,
            root.trace_id,
            root.span_id,
            parent.span_id if parent is not None else None,
            parent is not None,
            root.trace_flags,
            root.trace_state,
            attributes[names.PL_RECEIVED_WALL_NS],  # the span's ends, on the anchor's wall clock
            attributes[names.PL_RESPONDED_WALL_NS],
            attributes,
            (),
            (),
            STATUS_ERROR if failure else STATUS_UNSET,
            failure or None,
        ),
    )


def compact_span(anchor: ClockAnchor, record: RequestRecord, phases: Phases) -> SpanData:
    """A request's compact record, for a request whose tree is not kept: its SERVER span alone,
    also carrying what its llm.prefill and llm.decode would (chunks, ITL, stall), with the root's
    flags as `record` has them (the builder marks it sampled: collectors may drop unsampled spans)."""
    return root_span(anchor, record, phases, names.TRACE_FULL_NONE, compact_summary(record, phases))


def compact_summary(record: RequestRecord, phases: Phases) -> dict[str, Any]:
    """What a compact record carries of its llm.prefill and llm.decode."""
    summary: dict[str, Any] = {}
    if phases.scheduled_ts:
        summary.update(prefill_attributes(record, phases))
    if phases.first_token_ts:
        summary.update(decode_attributes(phases))
    return summary


ROOT_UNNAMED = "request"  # the SERVER span's name without a RequestInfo or method


def root_name(record: RequestRecord) -> str:
    info = record.info
    return names.root_span_name(info.operation, info.model) if info is not None else record.http.method or ROOT_UNNAMED


# every key the SERVER span may carry but a compact record's summary, in `_otlp_encode.encode_root`'s
# order (its R_*): `request_attributes`'s in the order they are added, then phaselens.trace.full
ROOT_SPAN_KEYS = (
    *_ROOT_KEYS,
    *_INFO_KEYS,
    names.GEN_AI_INPUT_MESSAGES,
    names.GEN_AI_OUTPUT_MESSAGES,
    names.PL_FIRST_CHUNK_MS,
    names.PL_HELD_BACK_MS,
    names.PL_HELD_BACK_TOKENS,
    names.PL_FIRST_CHUNK_LOOP_WAIT_MS,
    names.PL_FIRST_CHUNK_ENCODE_MS,
    names.PL_FIRST_CHUNK_WRITE_MS,
    names.PL_SERVER_TTFC_MS,
    names.PL_SERVER_LAST_CHUNK_MS,
    names.PL_FIRST_SENDS_NS,
    names.PL_FIRST_SENDS_BODY_BYTES,
    names.PL_INBOUND_DISPATCH_MS,
    names.PL_INBOUND_MS,
    names.PL_INBOUND_KERNEL_WAIT_MS,
    names.PL_TRACE_FULL,
)


# the strings `encode_root` writes as they are (its C_*): the provider, error.type's values, a name
ROOT_SPAN_CONSTANTS = (names.PROVIDER_PHASELENS, names.ERROR_CLIENT_DISCONNECTED, FINISH_ERROR, ROOT_UNNAMED)


def root_texts(record: RequestRecord, full: str) -> tuple[str | None, ...]:
    """The SERVER span's strings `encode_root` takes made: phaselens.trace.full, the captured messages."""
    return (full, *content_messages(record))


# An engine step as the builder takes it: the loop's record as it is (its stats, batch size and
# sampled members' links packed end to end by `timeline.StepRecorder`, `LINK.size` bytes each), which
# the encoder copies as they are (no tuple of 64 links to walk, copy and filter per step).
PackedStep = StepRecord


def packed_links(links: bytes) -> list[bytes]:
    """Packed links, one bytes each."""
    return [links[i : i + LINK.size] for i in range(0, len(links), LINK.size)]


class _SamplerLinks(Sequence[Link]):
    """A step's links as the sampler's `links` argument: SDK Links made only if it reads them (the
    SDK's own samplers do not; 64 Links would cost ~0.5 ms a step)."""

    __slots__ = ("_links",)

    def __init__(self, links: bytes) -> None:
        self._links = packed_links(links)

    def __len__(self) -> int:
        return len(self._links)

    @overload
    def __getitem__(self, index: int) -> Link: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Link]: ...
    def __getitem__(self, index: int | slice) -> Link | Sequence[Link]:
        if isinstance(index, slice):
            return [_link(ids) for ids in self._links[index]]
        return _link(self._links[index])

    def __iter__(self) -> Iterator[Link]:
        return (_link(ids) for ids in self._links)


def _link(packed: bytes) -> Link:
    trace_id, span_id, flags = unpack_link(packed)
    return Link(SpanContext(trace_id, span_id, False, TraceFlags(flags)))


# an engine step span's attributes, in export order (`_otlp_encode.encode_step` takes the values in
# this order from a PackedStep: step_index, num_seqs, prefill, decode, kv used, kv total, preemptions,
# queue depth, then the duration)
STEP_KEYS = (
    names.PL_STEP_INDEX,
    names.PL_STEP_NUM_SEQS,
    names.PL_STEP_PREFILL_TOKENS,
    names.PL_STEP_DECODE_TOKENS,
    names.PL_STEP_KV_BLOCKS_USED,
    names.PL_STEP_KV_BLOCKS_TOTAL,
    names.PL_STEP_PREEMPTIONS,
    names.PL_STEP_QUEUE_DEPTH,
    names.PL_STEP_DURATION_MS,
)


def emit_step_span(backend: SpanBackend, anchor: ClockAnchor, step: PackedStep) -> bool:
    """A step's span described (`step_span`) and emitted; False when it is not built."""
    span = step_span(backend.ids, backend.sampler, anchor, step)
    if span is None:
        return False
    backend.emit_data((span,))
    return True


def step_span(ids: IdGenerator, sampler: Sampler, anchor: ClockAnchor, step: PackedStep) -> SpanData | None:
    """One llm.engine_step span in a trace of its own, linked to the batch's sampled SERVER spans;
    None when no member is sampled or the sampler does not record the step's trace."""
    links = step.links
    if not links:
        return None
    values = (
        step.step_index,
        step.num_seqs,
        step.prefill_tokens,
        step.decode_tokens,
        step.kv_blocks_used,
        step.kv_blocks_total,
        step.preemptions,
        step.queue_depth,
        (step.end_ts - step.start_ts) / 1e6,
    )
    attributes = dict(zip(STEP_KEYS, values, strict=True))
    trace_id = ids.generate_trace_id()
    sampled, trace_state = True, ""
    if not samples_every_root(sampler):
        result = sampler.should_sample(
            Context(), trace_id, names.SPAN_ENGINE_STEP, SpanKind.INTERNAL, attributes, _SamplerLinks(links)
        )
        if not result.decision.is_recording():  # type: ignore[no-untyped-call]
            return None
        sampled = result.decision.is_sampled()  # type: ignore[no-untyped-call]
        trace_state = state_header(result.trace_state)
        attributes = dict(result.attributes) if result.attributes is not None else {}
    return _new_tuple(
        SpanData,
        (
            names.SPAN_ENGINE_STEP,
            KIND_INTERNAL,
            trace_id,
            ids.generate_span_id(),
            None,
            False,
            child_flags(sampled, ids.is_trace_id_random()),
            trace_state,
            anchor.to_wall_ts(step.start_ts),
            anchor.to_wall_ts(step.end_ts),
            attributes,
            (),
            links,
            STATUS_UNSET,
            None,
        ),
    )


_EVERY_ROOT = frozenset({ALWAYS_ON.get_description(), ParentBased(ALWAYS_ON).get_description()})  # type: ignore[no-untyped-call]


@functools.lru_cache(maxsize=8)
def samples_every_root(sampler: Sampler) -> bool:
    """The SDK's always_on and parentbased_always_on (the default): a step's trace is a root, which
    they record and sample with its attributes as given and no trace state; asking costs ~20k
    instructions a step (two steps a request at B = 64), so it is not asked."""
    description = sampler.get_description()
    return type(sampler) in (StaticSampler, ParentBased) and description in _EVERY_ROOT
