"""Spans built as SGLang and TGI build them, with the real OpenTelemetry SDK, exported over real OTLP/gRPC.

Sources read (names, kinds, parents, attribute keys and value types follow them):
- SGLang 0.5.23 (PyPI wheel): sglang/srt/observability/trace.py (TraceReqContext: root `{role} Req {rid[:8]}`,
  role "" when not disaggregated, parent = the `traceparent` the HTTP request carried; one thread span per
  process under the root; stage spans ("slices") under the thread span, nested by level, each first-level
  slice linked to the previous one), req_time_stats.py (which stamps open and close each slice; the root's
  `gen_ai.latency.*` keys in seconds from the TokenizerManager's perf_counter) and
  managers/tokenizer_manager.py (`convert_to_span_attrs`: usage, request id, sampling, model).
- TGI (text-generation-inference at v3.3.7-1-gdb931fcf): router/src/server.rs (the handler span of
  `#[instrument]`, timings recorded as `format!("{:?}", Duration)` strings), router/src/logging.rs (the
  traceparent becomes the handler span's remote parent), router/src/infer/mod.rs and backends/v3/src
  (the spans below it), through tracing-opentelemetry 0.21 (span kind INTERNAL unless `otel.kind`;
  code.*, thread.* at creation, busy_ns/idle_ns at close).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phaselens.instrumentation import names as n

MS = 1_000_000
HOST_ID = "5f1c0a2e9b7d4e3f8a6b1c2d3e4f5a6b"  # SGLang's host id: /etc/machine-id
TGI_SERVICE = "text-generation-inference.router"


class SixtyFourBitIds(IdGenerator):
    """SGLang's id generator draws 64-bit trace and span ids (several scheduler processes)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(64) or 1


def provider(endpoint: str, service: str, ids: IdGenerator | None = None) -> TracerProvider:
    """One process's provider, exporting each span as it ends to the collector over OTLP/gRPC."""
    tp = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=ids)
    tp.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return tp


def client_span(tracer, start_ns: int, ttft_ms: float, e2e_ms: float) -> tuple[object, dict[str, str]]:
    """The phaselens client's CLIENT span (started; the caller ends it) and the headers it sends."""
    span = tracer.start_span(
        n.root_span_name(n.OP_TEXT_COMPLETION, "tiny"),
        kind=SpanKind.CLIENT,
        start_time=start_ns,
        attributes={
            n.GEN_AI_OPERATION_NAME: n.OP_TEXT_COMPLETION,
            n.PL_CLIENT_TTFT_MS: ttft_ms,
            n.PL_CLIENT_E2E_MS: e2e_ms,
        },
    )
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
    return span, headers


# --- SGLang ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SglangRequest:
    """One request's stamps, as ms after `created` (the TokenizerManager's receipt)."""

    rid: str
    tokenize_ms: float  # created → tokenized
    dispatch_ms: float  # tokenized → sent to the scheduler (api_server_dispatch)
    hop_ms: float  # sent → the scheduler received it
    request_process_ms: float  # received → in the waiting queue
    queue_ms: float  # prefill_waiting: waiting queue → first forward
    chunks_ms: tuple[float, ...]  # the prefill chunks (prefill_forward = their sum)
    back_ms: float  # prefill finished → first token at the TokenizerManager
    decode_ms: float  # first token → finished, at the TokenizerManager
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def ingress_ms(self) -> float:
        return self.tokenize_ms + self.dispatch_ms

    @property
    def prefill_ms(self) -> float:
        return sum(self.chunks_ms)

    @property
    def before_engine_ms(self) -> float:
        return self.hop_ms + self.request_process_ms + self.back_ms

    @property
    def ttft_ms(self) -> float:
        return self.ingress_ms + self.queue_ms + self.prefill_ms + self.before_engine_ms


def _at(t0: int, ms: float) -> int:
    return t0 + round(ms * MS)


def _thread_span(tracer, label: str, pid: int, start_ns: int, root_ctx, tp_rank: int | None = None):
    name = label + (f" [TP {tp_rank}] " if tp_rank is not None else "") + f"(host:{HOST_ID[:8]} | pid:{pid})"
    span = tracer.start_span(name, start_time=start_ns, context=root_ctx)
    if tp_rank is not None:
        span.set_attributes({"tp_rank": tp_rank})
    span.set_attributes({"host_id": HOST_ID, "pid": pid, "thread_label": label})
    return span


def _slice(tracer, name: str, start_ns: int, end_ns: int, parent, prev=None, attrs=None):
    """One slice: a child of `parent`, linked to the previous first-level slice when there is one."""
    span = tracer.start_span(name, start_time=start_ns, context=trace.set_span_in_context(parent))
    if prev is not None:
        span.add_link(prev.get_span_context())
    if attrs:
        span.set_attributes(attrs)
    span.end(end_time=end_ns)
    return span


def _root_finish_attrs(r: SglangRequest) -> dict:
    """What the TokenizerManager sets on the root when the request finishes (seconds, floats)."""
    dispatched, first, finished = r.ingress_ms / 1e3, r.ttft_ms / 1e3, (r.ttft_ms + r.decode_ms) / 1e3
    return {
        "gen_ai.usage.completion_tokens": r.completion_tokens,
        "gen_ai.usage.prompt_tokens": r.prompt_tokens,
        "gen_ai.usage.cached_tokens": r.cached_tokens,
        "gen_ai.request.id": r.rid,
        "gen_ai.request.max_tokens": r.completion_tokens,
        "gen_ai.response.model": "tiny",
        "gen_ai.response.finish_reasons": json.dumps(["length"]),
        "gen_ai.latency.time_to_first_token": first,
        "gen_ai.latency.e2e": finished,
        "gen_ai.latency.time_in_model_decode": finished - first,
        "gen_ai.latency.time_in_model_inference": finished - dispatched,
        "gen_ai.latency.time_in_model_prefill": first - dispatched,
    }


def sglang_request(tokenizer, scheduler, r: SglangRequest, t0: int, headers: dict[str, str]) -> None:
    """The spans of one request: the TokenizerManager's (`tokenizer`) and the scheduler's tracer."""
    root = tokenizer.start_span(
        f" Req {r.rid[:8]}",
        start_time=t0,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes={"rid": r.rid, "module": "sglang::request"},
    )
    root_ctx = trace.set_span_in_context(root)
    tok_thread = _thread_span(tokenizer, "Tokenizer", 101, t0, root_ctx)
    tokenized, dispatched = _at(t0, r.tokenize_ms), _at(t0, r.ingress_ms)
    tokenize = _slice(tokenizer, "tokenize", t0, tokenized, tok_thread)
    dispatch = _slice(tokenizer, "api_server_dispatch", tokenized, dispatched, tok_thread, prev=tokenize)
    tok_thread.end(end_time=dispatched)  # thread_finish_flag on the dispatch slice
    _scheduler_spans(scheduler, r, t0, root_ctx, dispatch)
    root.set_attributes(_root_finish_attrs(r))
    root.end(end_time=_at(t0, r.ttft_ms + r.decode_ms))


def _scheduler_spans(tracer, r: SglangRequest, t0: int, root_ctx, prev) -> None:
    """The scheduler's thread span and slices; the root context and the previous slice arrive with
    the request (SGLang pickles them into the request it sends)."""
    received = r.ingress_ms + r.hop_ms
    queued = received + r.request_process_ms
    forward = queued + r.queue_ms
    prefilled = forward + r.prefill_ms
    thread = _thread_span(tracer, "Scheduler", 202, _at(t0, received), root_ctx, tp_rank=0)
    process = _slice(tracer, "request_process", _at(t0, received), _at(t0, queued), thread, prev=prev)
    waiting = _slice(tracer, "prefill_waiting", _at(t0, queued), _at(t0, forward), thread, prev=process)
    prefill = tracer.start_span(
        "prefill_forward", start_time=_at(t0, forward), context=trace.set_span_in_context(thread)
    )
    prefill.add_link(waiting.get_span_context())
    if len(r.chunks_ms) > 1:
        start = forward
        for chunk in r.chunks_ms:
            _slice(tracer, "chunked_prefill", _at(t0, start), _at(t0, start + chunk), prefill)
            start += chunk
    prefill.end(end_time=_at(t0, prefilled))
    steps = r.completion_tokens - 1
    decode_start, step_ms = prefilled + 0.1, (r.decode_ms - 0.1) / steps
    _slice(tracer, "decode_waiting", _at(t0, prefilled), _at(t0, decode_start), thread, prev=prefill)
    decode = tracer.start_span(
        "decode_forward", start_time=_at(t0, decode_start), context=trace.set_span_in_context(thread)
    )
    for i in range(steps):
        start = decode_start + i * step_ms
        _slice(tracer, "decode_loop", _at(t0, start), _at(t0, start + step_ms), decode, attrs={"decode_ct": i})
    end = _at(t0, decode_start + steps * step_ms)
    decode.end(end_time=end)
    thread.end(end_time=end)


# --- TGI ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TgiRequest:
    """The strings TGI records on its handler span (Rust `Duration` Debug), and its span's length."""

    validation_time: str
    queue_time: str
    inference_time: str
    time_per_token: str
    total_time: str
    span_ms: float  # handler span start → close (the SSE stream dropped after the last event)


def _remote_parent(headers: dict[str, str]):
    """TGI's trace_context_middleware: the traceparent's four fields → a remote parent context."""
    _, trace_id, span_id, flags = headers["traceparent"].split("-")
    parent = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _code_attrs(namespace: str, file: str, line: int) -> dict:
    """tracing-opentelemetry's attributes of every span: callsite and thread."""
    return {
        "code.filepath": file,
        "code.namespace": namespace,
        "code.lineno": line,
        "thread.id": 4,
        "thread.name": "tokio-runtime-worker",
    }


def _close(span, end_ns: int, busy_ns: int) -> None:
    span.set_attributes({"busy_ns": busy_ns, "idle_ns": max(end_ns - span.start_time - busy_ns, 0)})
    span.end(end_time=end_ns)


def tgi_request(tracer, r: TgiRequest, t0: int, headers: dict[str, str], handler: str = "generate_stream") -> None:
    """The handler span (with the timings), and below it the Infer and backend spans."""
    end = _at(t0, r.span_ms)
    span = tracer.start_span(
        handler,
        start_time=t0,
        context=_remote_parent(headers),
        attributes={
            **_code_attrs("text_generation_router::server", "router/src/server.rs", 464),
            "parameters": "GenerateParameters { best_of: None, temperature: None, "
            "max_new_tokens: Some(20), stream: true, .. }",
        },
    )
    stream = tracer.start_span(
        "async_stream",
        start_time=t0 + 1000,
        context=trace.set_span_in_context(span),
        attributes=_code_attrs("text_generation_router::server", "router/src/server.rs", 555),
    )
    _backend_spans(tracer, stream, t0 + 2000, end - 2000)
    _close(stream, end - 1000, 300_000)
    span.set_attributes(
        {
            "total_time": r.total_time,
            "validation_time": r.validation_time,
            "queue_time": r.queue_time,
            "inference_time": r.inference_time,
            "time_per_token": r.time_per_token,
            "seed": "None",
        }
    )
    _close(span, end, 400_000)


def _backend_spans(tracer, parent, start: int, end: int) -> None:
    """Infer's `generate_stream` (no timings), the backend's `schedule`, its `queued` and `infer` spans,
    and the `batch` span (a trace of its own) that `infer` and it link both ways."""
    infer_ns = "text_generation_router::infer"
    gen = tracer.start_span(
        "generate_stream",
        start_time=start,
        context=trace.set_span_in_context(parent),
        attributes=_code_attrs(infer_ns, "router/src/infer/mod.rs", 99),
    )
    schedule = tracer.start_span(
        "schedule",
        start_time=start + 1000,
        context=trace.set_span_in_context(gen),
        attributes=_code_attrs("text_generation_router_v3::backend", "backends/v3/src/backend.rs", 78),
    )
    mid = (start + end) // 2
    queued = tracer.start_span("queued", start_time=start + 2000, context=trace.set_span_in_context(schedule))
    _close(queued, mid, 10_000)
    infer = tracer.start_span("infer", start_time=mid, context=trace.set_span_in_context(schedule))
    batch = tracer.start_span(
        "batch",
        start_time=mid,
        context=Context(),  # `parent: None`: a root
        attributes={"batch_size": 1},
        links=[trace.Link(infer.get_span_context())],
    )
    infer.add_link(batch.get_span_context())
    _close(batch, end - 3000, 200_000)
    _close(infer, end - 3000, 20_000)
    _close(schedule, end - 2000, 30_000)
    _close(gen, end - 1000, 40_000)
