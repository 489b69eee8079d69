"""Spans of one request through SGLang's disaggregated prefill and decode instances, built as SGLang
builds them (real OpenTelemetry SDK, exported over OTLP/gRPC by the caller's providers).

Sources read (sglang 0.5.23, PyPI wheel):
- srt/observability/trace.py: each instance's TokenizerManager opens the root `{role} Req {rid[:8]}`
  (role `prefill` or `decode`; attributes rid, module `sglang::request`, bootstrap_room as hex) under
  the `traceparent` its HTTP request carried, one thread span per process under the root
  (`{label} [TP n] (host:… | pid:…)`), the slices under the thread span, each first-level slice
  linked to the previous one; the root's `gen_ai.latency.*` keys at its end (seconds).
- srt/entrypoints/http_server.py, srt/managers/scheduler.py: thread labels `PrefillTokenizer`,
  `DecodeTokenizer`, `Prefill Scheduler`, `Decode Scheduler`.
- srt/observability/req_time_stats.py (SchedulerReqTimeStats): the prefill scheduler's slices
  prefill_prepare (received → bootstrap queue), prefill_bootstrap (→ waiting queue), prefill_waiting
  (→ first forward), prefill_forward (→ prefill finished, chunked_prefill below it),
  prefill_transfer_kv_cache (transfer queue → the transfer polled done); the decode scheduler's
  decode_prepare (received → prealloc queue), decode_bootstrap (→ transfer queue), decode_transferred
  (→ waiting queue: the KV arrived), decode_waiting (→ first forward), decode_forward with
  fake_output (the prebuilt batch handing out the prefill's token) and decode_loop below it.
- srt/disaggregation/prefill.py: the transfer queue entry comes after the last KV chunk is handed to
  the sender; the transfer's end is when the prefill scheduler polls KVPoll.Success.

and vLLM 0.32.0's (vllm/v1/engine/output_processor.py do_tracing: one `llm_request` SERVER span per
request per instance, built when it finished, the de-facto keys in seconds; vllm/tracing/otel.py:
`Resource.create`, which reads OTEL_RESOURCE_ATTRIBUTES).

SGLang's router sends the request to both instances at once (the bootstrap room pairs them), so the
two trees run in parallel, each on its own host's clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tests.native_spans import MS, _slice, _thread_span


@dataclass(frozen=True, slots=True)
class SglangPdSide:
    """One instance's stamps, as ms after its TokenizerManager's receipt (its own clock)."""

    tokenize_ms: float
    dispatch_ms: float
    hop_ms: float  # dispatched → the scheduler received it (in no slice)
    prepare_ms: float  # prefill_prepare / decode_prepare
    bootstrap_ms: float  # prefill_bootstrap / decode_bootstrap
    transferred_ms: float  # decode_transferred (decode only; 0 on the prefill side)
    queue_ms: float  # prefill_waiting / decode_waiting
    work_ms: tuple[float, ...]  # prefill: the chunks; decode: fake_output, then the decode steps
    kv_ms: float  # prefill_transfer_kv_cache (prefill only)
    back_ms: float  # → the first token (prefill: its output) at the TokenizerManager

    @property
    def ingress_ms(self) -> float:
        return self.tokenize_ms + self.dispatch_ms

    def ttft_ms(self, decode: bool) -> float:
        ahead = self.ingress_ms + self.hop_ms + self.prepare_ms + self.bootstrap_ms + self.transferred_ms
        work = self.work_ms[0] if decode else sum(self.work_ms) + self.kv_ms
        return ahead + self.queue_ms + work + self.back_ms


@dataclass(frozen=True, slots=True)
class SglangPdRequest:
    rid: str
    bootstrap_room: int
    prefill: SglangPdSide
    decode: SglangPdSide
    prompt_tokens: int


def _at(t0: int, ms: float) -> int:
    return t0 + round(ms * MS)


def _root(tracer, role: str, r: SglangPdRequest, t0: int, headers: dict[str, str]):
    return tracer.start_span(
        f"{role} Req {r.rid[:8]}",
        start_time=t0,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes={"rid": r.rid, "module": "sglang::request", "bootstrap_room": hex(r.bootstrap_room)},
    )


def _tokenizer_slices(tracer, label: str, side: SglangPdSide, t0: int, root_ctx):
    thread = _thread_span(tracer, label, 101, t0, root_ctx)
    tokenize = _slice(tracer, "tokenize", t0, _at(t0, side.tokenize_ms), thread)
    dispatch = _slice(
        tracer, "api_server_dispatch", _at(t0, side.tokenize_ms), _at(t0, side.ingress_ms), thread, prev=tokenize
    )
    thread.end(end_time=_at(t0, side.ingress_ms))
    return dispatch


def _finish_root(root, side: SglangPdSide, t0: int, decode: bool, r: SglangPdRequest, tokens: int, e2e_ms: float):
    first = side.ttft_ms(decode) / 1e3
    root.set_attributes(
        {
            "gen_ai.usage.prompt_tokens": r.prompt_tokens,
            "gen_ai.usage.completion_tokens": tokens,
            "gen_ai.request.id": r.rid,
            "gen_ai.latency.time_to_first_token": first,
            "gen_ai.latency.e2e": e2e_ms / 1e3,
            "gen_ai.latency.time_in_model_decode": e2e_ms / 1e3 - first,
            "gen_ai.latency.time_in_model_prefill": first - side.ingress_ms / 1e3,
            "gen_ai.latency.time_in_model_inference": (e2e_ms - side.ingress_ms) / 1e3,
        }
    )
    root.end(end_time=_at(t0, e2e_ms))


def prefill_instance(tokenizer, scheduler, r: SglangPdRequest, t0: int, headers: dict[str, str]) -> None:
    """The prefill instance's tree, `t0` its TokenizerManager's receipt on the prefill host's clock."""
    p = r.prefill
    root = _root(tokenizer, "prefill", r, t0, headers)
    root_ctx = trace.set_span_in_context(root)
    prev = _tokenizer_slices(tokenizer, "PrefillTokenizer", p, t0, root_ctx)
    at = p.ingress_ms + p.hop_ms
    thread = _thread_span(scheduler, "Prefill Scheduler", 202, _at(t0, at), root_ctx, tp_rank=0)
    for name, ms in (("prefill_prepare", p.prepare_ms), ("prefill_bootstrap", p.bootstrap_ms)):
        prev = _slice(scheduler, name, _at(t0, at), _at(t0, at + ms), thread, prev=prev)
        at += ms
    prev = _slice(scheduler, "prefill_waiting", _at(t0, at), _at(t0, at + p.queue_ms), thread, prev=prev)
    at += p.queue_ms
    forward = scheduler.start_span("prefill_forward", start_time=_at(t0, at), context=trace.set_span_in_context(thread))
    forward.add_link(prev.get_span_context())
    for chunk in p.work_ms if len(p.work_ms) > 1 else ():
        _slice(scheduler, "chunked_prefill", _at(t0, at), _at(t0, at + chunk), forward)
        at += chunk
    at = p.ingress_ms + p.hop_ms + p.prepare_ms + p.bootstrap_ms + p.queue_ms + sum(p.work_ms)
    forward.end(end_time=_at(t0, at))
    _slice(scheduler, "prefill_transfer_kv_cache", _at(t0, at), _at(t0, at + p.kv_ms), thread, prev=forward)
    thread.end(end_time=_at(t0, at + p.kv_ms))
    _finish_root(root, p, t0, False, r, 1, p.ttft_ms(False) + 0.5)


def decode_instance(tokenizer, scheduler, r: SglangPdRequest, t0: int, headers: dict[str, str]) -> float:
    """The decode instance's tree on the decode host's clock; returns its e2e (ms)."""
    d = r.decode
    root = _root(tokenizer, "decode", r, t0, headers)
    root_ctx = trace.set_span_in_context(root)
    prev = _tokenizer_slices(tokenizer, "DecodeTokenizer", d, t0, root_ctx)
    at = d.ingress_ms + d.hop_ms
    thread = _thread_span(scheduler, "Decode Scheduler", 303, _at(t0, at), root_ctx, tp_rank=0)
    for name, ms in (
        ("decode_prepare", d.prepare_ms),
        ("decode_bootstrap", d.bootstrap_ms),
        ("decode_transferred", d.transferred_ms),
        ("decode_waiting", d.queue_ms),
    ):
        prev = _slice(scheduler, name, _at(t0, at), _at(t0, at + ms), thread, prev=prev)
        at += ms
    forward = scheduler.start_span("decode_forward", start_time=_at(t0, at), context=trace.set_span_in_context(thread))
    forward.add_link(prev.get_span_context())
    first, *steps = d.work_ms
    _slice(scheduler, "fake_output", _at(t0, at), _at(t0, at + first), forward)
    at += first
    for i, step in enumerate(steps):
        _slice(scheduler, "decode_loop", _at(t0, at), _at(t0, at + step), forward, attrs={"decode_ct": i})
        at += step
    forward.end(end_time=_at(t0, at))
    thread.end(end_time=_at(t0, at))
    e2e_ms = at + d.back_ms
    _finish_root(root, d, t0, True, r, len(d.work_ms), e2e_ms)
    return e2e_ms


# --- vLLM ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VllmPdSide:
    """One instance's request as vLLM 0.32 stamps it (output_processor.do_tracing), in ms after its
    arrival, on that instance's clock. On the decode instance the request is not SCHEDULED before
    its KV arrived (WAITING_FOR_REMOTE_KVS): its queue holds the KV pull and the wait for a seat."""

    queue_ms: float  # queued → scheduled (time_in_queue)
    before_queue_ms: float  # arrival → queued (the API server and the hop to the EngineCore)
    prefill_ms: float  # scheduled → first token (time_in_model_prefill)
    decode_ms: float  # first token → last token
    tokens: int

    @property
    def ttft_ms(self) -> float:
        return self.before_queue_ms + self.queue_ms + self.prefill_ms


def vllm_instance(tracer, side: VllmPdSide, t0: int, headers: dict[str, str], prompt_tokens: int) -> None:
    """The instance's one `llm_request` SERVER span, made when the request finished, under the
    request's `traceparent` (a proxy that forwards it; vLLM's toy proxy does not)."""
    e2e_ms = side.ttft_ms + side.decode_ms
    tracer.start_span(
        "llm_request",
        kind=trace.SpanKind.SERVER,
        start_time=t0,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes={
            "gen_ai.latency.time_to_first_token": side.ttft_ms / 1e3,
            "gen_ai.latency.e2e": e2e_ms / 1e3,
            "gen_ai.latency.time_in_queue": side.queue_ms / 1e3,
            "gen_ai.usage.prompt_tokens": prompt_tokens,
            "gen_ai.usage.completion_tokens": side.tokens,
            "gen_ai.latency.time_in_model_prefill": side.prefill_ms / 1e3,
            "gen_ai.latency.time_in_model_decode": side.decode_ms / 1e3,
            "gen_ai.latency.time_in_model_inference": (side.prefill_ms + side.decode_ms) / 1e3,
            "gen_ai.request.id": "cmpl-5b0c1d2e-0",
            "gen_ai.request.max_tokens": side.tokens,
        },
    ).end(end_time=_at(t0, e2e_ms))


# --- Dynamo --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DynamoPdWorker:
    """One worker's request as Dynamo's EngineAdapter stamps it (ai-dynamo/dynamo
    lib/backend-common/src/adapter.rs at 052692a7), in ms after its `handle_payload` began, on that
    worker's clock (`Instant`)."""

    setup_ms: float  # handle_payload → the engine's stream set up (in no attribute)
    ttft_ms: float  # stream set up → first non-empty chunk (`ttft_ms`)
    itl_ms: tuple[float, ...]  # gaps between non-empty chunks (the `itl_*_ms` samples)
    input_tokens: int

    @property
    def e2e_ms(self) -> float:
        return self.setup_ms + self.ttft_ms + sum(self.itl_ms)

    def itl_p99_ms(self) -> float:
        """Nearest rank, as adapter.rs record_itl_distribution: sorted[round((n − 1) · 0.99)]."""
        ordered = sorted(self.itl_ms)
        return ordered[round((len(ordered) - 1) * 0.99)]


def _ms2(value: float) -> str:
    return f"{value:.2f}"  # adapter.rs records each figure as `format!("{:.2}", …)`: a string attribute


def dynamo_worker(tracer, role: str, w: DynamoPdWorker, t0: int, headers: dict[str, str], link=None):
    """The worker's `handle_payload` (lib/runtime/src/logging.rs make_handle_payload_span, parent from
    the request's headers) and its child `engine.generate` (adapter.rs: fields at entry, `ttft_ms` at
    the first non-empty chunk, the rest at the terminal chunk); `link`: the prefill worker's span
    context, which a decode worker records as `migration_*` and an OTel link. Returns `engine.generate`."""
    payload = tracer.start_span(
        "handle_payload",
        start_time=t0,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes={
            "component": "backend" if role == "decode" else role,
            "endpoint": "generate",
            "namespace": "dynamo",
            "instance_id": 7587890000000000000 + len(role),
        },
    )
    attrs = {"model": "Qwen/Qwen3-0.6B", "input_tokens": w.input_tokens, "disagg_role": role}
    if link is not None:
        attrs |= {"migration_trace_id": f"{link.trace_id:032x}", "migration_span_id": f"{link.span_id:016x}"}
    gen = tracer.start_span(
        "engine.generate",
        start_time=_at(t0, w.setup_ms),
        context=trace.set_span_in_context(payload),
        attributes=attrs,
        links=[trace.Link(link)] if link is not None else None,
    )
    gen.set_attribute("ttft_ms", _ms2(w.ttft_ms))
    gen.set_attributes({"output_tokens": 1 + len(w.itl_ms), "finish_reason": "Length", "cancelled": False})
    if w.itl_ms:
        ordered = sorted(w.itl_ms)
        nearest = ordered[round((len(ordered) - 1) * 0.5)]
        gen.set_attributes(
            {
                "avg_itl_ms": _ms2(sum(w.itl_ms) / len(w.itl_ms)),
                "itl_p50_ms": _ms2(nearest),
                "itl_p99_ms": _ms2(w.itl_p99_ms()),
                "itl_max_ms": _ms2(ordered[-1]),
            }
        )
    gen.end(end_time=_at(t0, w.e2e_ms))
    payload.end(end_time=_at(t0, w.e2e_ms + 0.25))
    return gen
