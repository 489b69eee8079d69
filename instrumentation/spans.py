"""Records → OpenTelemetry spans with explicit start/end times (runs on the builder thread only).

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

Budget terms and formulas: see `phaselens.instrumentation.phases`. The SERVER span carries them all as
attributes (phaselens.*_ms, the GenAI semconv keys and the de-facto gen_ai.latency.* keys in
seconds), so a per-request query needs no join.

Engine steps: one `llm.engine_step` span per iteration in a trace of its own, linked to the SERVER
spans of the batch's sampled requests; a step whose batch holds no sampled request is not built, and
the step's own trace is sampled by the provider's root sampler (always, by default; with a ratio
sampler, that share of steps). The SDK keeps 128 links per span by default
(OTEL_SPAN_LINK_COUNT_LIMIT) and 128 events (OTEL_SPAN_EVENT_COUNT_LIMIT, per-token events).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, Tracer

from phaselens.common.quantile import quantile

from . import names
from .clock import ClockAnchor
from .handle import RequestHandle
from .observer import FINISH_ERROR
from .phases import Phases, stall_ns
from .timeline import CHUNK_FIELDS, StepRecord

NS_PER_MS = 1e6
NS_PER_S = 1e9


@dataclass(slots=True)
class SpanWriter:
    """Starts and ends spans on explicit monotonic times; counts the spans it ended."""

    tracer: Tracer
    anchor: ClockAnchor
    ended: int = 0

    def child(self, parent: Context, name: str, start_ns: int, attributes: dict[str, Any] | None = None) -> Any:
        """A span under `parent` (a context holding the parent span)."""
        return self.tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL,
                                      start_time=self.anchor.to_wall_ns(start_ns), attributes=attributes)

    def end(self, span: Any, end_ns: int) -> None:
        span.end(end_time=self.anchor.to_wall_ns(end_ns))
        self.ended += 1

    def leaf(self, parent: Context, name: str, start_ns: int, end_ns: int,
             attributes: dict[str, Any] | None = None) -> None:
        self.end(self.child(parent, name, start_ns, attributes), end_ns)


def error_type(handle: RequestHandle) -> str | None:
    """The request's `error.type`: what the app said, else what the transport or engine saw."""
    http, outcome = handle.http, handle.outcome
    status = outcome.status_code or http.status_code
    if outcome.error_type:
        return outcome.error_type
    if http.client_disconnected:
        return names.ERROR_CLIENT_DISCONNECTED
    if http.exception_type:
        return http.exception_type
    if status is not None and status >= 400:
        return str(status)
    if handle.finish_reason == FINISH_ERROR:
        return FINISH_ERROR
    return None


def output_tokens(handle: RequestHandle, phases: Phases) -> int:
    """Usage as reported by `complete()`, else counted from the stamps (1 + Σ tokens per step)."""
    if handle.outcome.output_tokens is not None:
        return handle.outcome.output_tokens
    return (1 + phases.decode_tokens) if phases.first_token_ns else 0


def tpot_ns(phases: Phases, tokens: int) -> float | None:
    """(last_token − first_token) / (output_tokens − 1), for output_tokens > 1."""
    if not phases.first_token_ns or tokens <= 1:
        return None
    return phases.decode_ns / (tokens - 1)


def _ms(ns: float) -> float:
    return ns / NS_PER_MS


def _s(ns: float) -> float:
    return ns / NS_PER_S


def _drop_none(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


def _messages(role: str, content: Any, finish_reason: str | None = None) -> str:
    """GenAI semconv message JSON: a str becomes one text part; chat messages keep their roles."""
    if isinstance(content, str):
        message: dict[str, Any] = {"role": role, "parts": [{"type": "text", "content": content}]}
        if finish_reason:
            message["finish_reason"] = finish_reason
        return json.dumps([message])
    return json.dumps([{"role": m.get("role", role), "parts": [{"type": "text", "content": m.get("content")}]}
                       for m in content], default=str)


def request_attributes(handle: RequestHandle, phases: Phases, anchor: ClockAnchor) -> dict[str, Any]:
    """Every attribute of the SERVER root span (design §3)."""
    info, outcome, http = handle.info, handle.outcome, handle.http
    tokens = output_tokens(handle, phases)
    finish_reason = outcome.finish_reason or handle.finish_reason or None
    tpot = tpot_ns(phases, tokens)
    inference_ns = phases.prefill_ns + phases.first_token_phase_ns + phases.decode_ns
    cached = outcome.cached_tokens or sum(handle.chunks[3::CHUNK_FIELDS])
    attributes: dict[str, Any] = {
        names.GEN_AI_PROVIDER_NAME: names.PROVIDER_PHASELENS,
        names.HTTP_REQUEST_METHOD: http.method or None,
        names.URL_PATH: http.path or None,
        names.HTTP_RESPONSE_STATUS_CODE: outcome.status_code or http.status_code,
        names.SERVER_ADDRESS: http.server_address,
        names.SERVER_PORT: http.server_port,
        names.ERROR_TYPE: error_type(handle),
        names.PL_INGRESS_MS: _ms(phases.ingress_ns),
        names.PL_QUEUE_MS: _ms(phases.queue_ns),
        names.PL_PREFILL_MS: _ms(phases.prefill_ns),
        names.PL_FIRST_TOKEN_MS: _ms(phases.first_token_phase_ns),
        names.PL_DECODE_MS: _ms(phases.decode_ns),
        names.PL_DELIVERY_MS: _ms(phases.delivery_ns),
        names.PL_SERVER_TTFT_MS: _ms(phases.ttft_ns) if phases.first_token_ns else None,
        names.PL_SERVER_TPOT_MS: _ms(tpot) if tpot is not None else None,
        names.PL_PREEMPTIONS: max(0, len(phases.waits) - 1),
        names.PL_FINISH_REASON: finish_reason,
        names.PL_CLIENT_DISCONNECTED: http.client_disconnected,
        names.PL_RECEIVED_WALL_NS: anchor.to_wall_ns(phases.received_ns),
        names.PL_RESPONDED_WALL_NS: anchor.to_wall_ns(phases.end_ns),
        names.GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason] if finish_reason else None,
        names.GEN_AI_USAGE_OUTPUT_TOKENS: tokens,
        names.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached,
        names.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS: outcome.reasoning_tokens,
        # de-facto engine keys, vLLM's definitions, seconds
        names.LATENCY_TIME_IN_QUEUE: _s(phases.queue_ns),
        names.LATENCY_TIME_TO_FIRST_TOKEN: _s(phases.ttft_ns) if phases.first_token_ns else None,
        names.LATENCY_E2E: _s(phases.e2e_ns),
        names.LATENCY_TIME_IN_MODEL_PREFILL: _s(phases.prefill_ns + phases.first_token_phase_ns),
        names.LATENCY_TIME_IN_MODEL_DECODE: _s(phases.decode_ns),
        names.LATENCY_TIME_IN_MODEL_INFERENCE: _s(inference_ns),
    }
    if info is not None:
        attributes.update({
            names.GEN_AI_OPERATION_NAME: info.operation,
            names.GEN_AI_REQUEST_MODEL: info.model,
            names.GEN_AI_RESPONSE_MODEL: info.model,
            names.GEN_AI_RESPONSE_ID: info.request_id,
            names.GEN_AI_REQUEST_ID: info.request_id,
            names.GEN_AI_USAGE_INPUT_TOKENS: info.input_tokens,
            names.GEN_AI_REQUEST_MAX_TOKENS: info.max_tokens,
            names.GEN_AI_REQUEST_TEMPERATURE: info.temperature,
            names.GEN_AI_REQUEST_TOP_P: info.top_p,
            names.GEN_AI_REQUEST_TOP_K: info.top_k,
            names.GEN_AI_REQUEST_SEED: info.seed,
            names.GEN_AI_REQUEST_STREAM: info.stream,
        })
        if info.prompt is not None:
            attributes[names.GEN_AI_INPUT_MESSAGES] = _messages("user", info.prompt)
    if outcome.completion is not None:
        attributes[names.GEN_AI_OUTPUT_MESSAGES] = _messages("assistant", outcome.completion, finish_reason)
    return _drop_none(attributes)


def decode_attributes(phases: Phases) -> dict[str, Any]:
    itl = sorted(phases.itl_ns)
    return {
        names.PL_DECODE_TOKENS: phases.decode_tokens,
        names.PL_DECODE_STEPS: phases.decode_steps,
        names.PL_ITL_P50_MS: _ms(quantile(itl, 0.5) if itl else 0),
        names.PL_ITL_P99_MS: _ms(quantile(itl, 0.99) if itl else 0),
        names.PL_ITL_MAX_MS: _ms(itl[-1] if itl else 0),
        names.PL_STALL_MS: _ms(stall_ns(phases.itl_ns)),
    }


def _chunk_spans(writer: SpanWriter, handle: RequestHandle, phases: Phases, prefill: Any, decode: Any) -> None:
    """llm.prefill.chunk spans: initial chunks under llm.prefill (when more than one), recompute
    chunks after the first token under llm.decode."""
    chunks = handle.chunks
    count = len(chunks) // CHUNK_FIELDS
    for index in range(count):
        start, end, tokens, cached = chunks[index * CHUNK_FIELDS:(index + 1) * CHUNK_FIELDS]
        recompute = index >= phases.initial_chunks
        parent = decode if recompute else prefill
        if parent is None or (not recompute and phases.initial_chunks < 2):
            continue
        writer.leaf(trace.set_span_in_context(parent), names.SPAN_PREFILL_CHUNK, start, end, {
            names.PL_CHUNK_INDEX: index, names.PL_CHUNK_TOKENS: tokens, names.PL_CACHED_TOKENS: cached,
            names.PL_PREFILL_RECOMPUTE: recompute})


def _prefill_attributes(handle: RequestHandle, phases: Phases) -> dict[str, Any]:
    initial = handle.chunks[:phases.initial_chunks * CHUNK_FIELDS]
    return {names.PL_PREFILL_CHUNKS: phases.initial_chunks,
            names.PL_CHUNK_TOKENS: sum(initial[2::CHUNK_FIELDS]),
            names.PL_CACHED_TOKENS: sum(initial[3::CHUNK_FIELDS])}


def _token_events(writer: SpanWriter, span: Any, handle: RequestHandle) -> None:
    for t_ns, n in zip(handle.token_ns, handle.token_n):
        span.add_event(names.EVENT_TOKEN, {names.PL_TOKEN_COUNT: n}, timestamp=writer.anchor.to_wall_ns(t_ns))


def build_request_spans(writer: SpanWriter, handle: RequestHandle, phases: Phases, token_events: bool) -> None:
    """Emit the phase spans of one sampled request, then end its SERVER span."""
    root = trace.set_span_in_context(handle.span)
    # rejected before reaching the engine: the whole request was ingress
    writer.leaf(root, names.SPAN_INGRESS, phases.received_ns, phases.enqueued_ns or phases.end_ns)
    for index, (start, end) in enumerate(phases.waits):
        writer.leaf(root, names.SPAN_QUEUE, start, end, {names.PL_QUEUE_WAIT_INDEX: index})
    prefill = decode = None
    if phases.scheduled_ns:
        prefill = writer.child(root, names.SPAN_PREFILL, phases.scheduled_ns, _prefill_attributes(handle, phases))
    if phases.first_token_ns:
        writer.leaf(root, names.SPAN_FIRST_TOKEN, phases.prefill_end_ns, phases.first_token_ns)
        decode = writer.child(root, names.SPAN_DECODE, phases.first_token_ns, decode_attributes(phases))
        if token_events:
            _token_events(writer, decode, handle)
        writer.leaf(root, names.SPAN_DELIVERY, phases.last_token_ns, phases.end_ns)
    _chunk_spans(writer, handle, phases, prefill, decode)
    if prefill is not None:
        writer.end(prefill, phases.prefill_end_ns)
    if decode is not None:
        writer.end(decode, phases.last_token_ns)
    _end_root(writer, handle, phases)


def _end_root(writer: SpanWriter, handle: RequestHandle, phases: Phases) -> None:
    root = handle.span
    attributes = request_attributes(handle, phases, writer.anchor)
    if handle.info is not None:
        root.update_name(names.root_span_name(handle.info.operation, handle.info.model))
    root.set_attributes(attributes)
    failure = attributes.get(names.ERROR_TYPE)
    if failure:
        root.set_status(Status(StatusCode.ERROR, failure))
    writer.end(root, phases.end_ns)


def build_step_span(writer: SpanWriter, step: StepRecord) -> bool:
    """One llm.engine_step span in its own trace, linked to the batch's sampled SERVER spans."""
    links = [Link(h.span.get_span_context()) for h in step.requests if getattr(h, "sampled", False)]
    if not links:
        return False
    attributes = {
        names.PL_STEP_INDEX: step.index,
        names.PL_STEP_NUM_SEQS: len(step.requests),
        names.PL_STEP_PREFILL_TOKENS: step.prefill_tokens,
        names.PL_STEP_DECODE_TOKENS: step.decode_tokens,
        names.PL_STEP_KV_BLOCKS_USED: step.kv_blocks_used,
        names.PL_STEP_KV_BLOCKS_TOTAL: step.kv_blocks_total,
        names.PL_STEP_PREEMPTIONS: step.preemptions,
        names.PL_STEP_QUEUE_DEPTH: step.queue_depth,
        names.PL_STEP_DURATION_MS: _ms(step.end_ns - step.start_ns),
    }
    span = writer.tracer.start_span(names.SPAN_ENGINE_STEP, context=Context(),
                                    kind=SpanKind.INTERNAL, links=links, attributes=attributes,
                                    start_time=writer.anchor.to_wall_ns(step.start_ns))
    writer.end(span, step.end_ns)
    return True
