"""Realistic request span sets with KNOWN durations, emitted through the real OpenTelemetry SDK.

`generate(n_requests, seed, …) -> Workload` draws requests (client CLIENT span → server SERVER span
→ phase spans) and engine steps (`llm.engine_step`, own traces, linked to the server spans) with
durations in whole microseconds, so the expected budget is exact. `emit(workload, clickhouse_url, …)`
builds the spans with separate TracerProviders (client and server service names, explicit
start/end times) and ships them over OTLP with the real exporter (to a given endpoint, or to a
private `collectors.Collector` it starts and drains) or, with `transport="insert"`, encodes them as
the OTLP exporter does and inserts the rows the collector would write (`phaselens.collectors.render` +
`phaselens.collectors.writer.ClickHouseSink`).

Clock games, as on real machines: the client's wall clock may be shifted (`client_clock_shift_ns`)
and may step mid-request (`wall_step_ns`: a naive SDK reading the wall clock at the end of the
request moves the client span's end, its late events and `done_wall_ns`). Durations measured on the
monotonic clock (the `phaselens.client.*_ms` attributes, server phase spans) do not move.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from phaselens.instrumentation import names as n

MS = 1_000_000  # ns per ms


def _ns(ms: float) -> int:
    return round(ms * MS)


@dataclass(slots=True)
class RequestTruth:
    """One request's durations (ms, whole µs) and wall anchors; properties give the expected budget."""

    trace_id: str = ""
    server_span_id: str = ""
    request_id: str = ""
    model: str = "tiny"
    start_ns: int = 0  # server received, server wall clock
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ingress_ms: float = 0.0
    queue_waits_ms: list[float] = field(default_factory=list)  # [0] before prefill; [1] preempted in decode
    prefill_ms: float = 0.0
    prefill_chunks: int = 1
    first_token_ms: float = 0.0
    # the server's first-chunk delivery, = loop_wait + encode (each a whole µs); write beside it
    loop_wait_ms: float = 0.0
    encode_ms: float = 0.0
    write_ms: float = 0.0
    decode_ms: float = 0.0
    delivery_ms: float = 0.0
    uplink_ms: float = 0.0  # client sent → server received
    downlink_ms: float = 0.0  # server hands a chunk → client reads it
    has_client: bool = True
    aborted: bool = False
    itl_p99_ms: float = 0.0
    stall_ms: float = 0.0
    client_clock_shift_ns: int = 0
    wall_step_ns: int = 0

    @property
    def server_ttft_ms(self) -> float:
        return self.ingress_ms + self.queue_waits_ms[0] + self.prefill_ms + self.first_token_ms

    @property
    def first_chunk_ms(self) -> float:
        return round(self.loop_wait_ms + self.encode_ms, 3)

    @property
    def server_ttfc_ms(self) -> float:
        return round(self.server_ttft_ms + self.first_chunk_ms, 3)

    @property
    def server_e2e_ms(self) -> float:
        return self.server_ttft_ms + self.decode_ms + self.delivery_ms

    @property
    def client_ttft_ms(self) -> float | None:
        return self.uplink_ms + self.server_ttfc_ms + self.downlink_ms if self.has_client else None

    @property
    def client_e2e_ms(self) -> float | None:
        return self.client_ttft_ms + self.decode_ms if self.has_client else None

    @property
    def tpot_ms(self) -> float | None:
        """Server and client TPOT agree here: (e2e − TTFT)/(n − 1) = decode/(n − 1)."""
        return self.decode_ms / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def residual_ms(self) -> float | None:
        return self.uplink_ms + self.downlink_ms if self.has_client else None

    @property
    def status(self) -> str:
        return "error" if self.aborted else "ok"

    @property
    def preemptions(self) -> int:
        return len(self.queue_waits_ms) - 1

    def wall_stamps_ns(self) -> tuple[int, int, int, int]:
        """t1 client sent, t2 server received, t3 server responded, t4 client done (each on its clock)."""
        t2 = self.start_ns
        t3 = t2 + _ns(self.server_e2e_ms)
        t1 = t2 - _ns(self.uplink_ms) + self.client_clock_shift_ns
        t4 = t1 + _ns(self.client_e2e_ms or 0.0) + self.wall_step_ns
        return t1, t2, t3, t4

    @property
    def clock_offset_estimate_ms(self) -> float | None:
        if not self.has_client:
            return None
        t1, t2, t3, t4 = self.wall_stamps_ns()
        return ((t2 - t1) + (t3 - t4)) / 2e6


@dataclass(slots=True)
class StepTruth:
    start_ns: int
    duration_ms: float
    prefill_tokens: int
    decode_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    queue_depth: int
    index: int
    linked: list[int]  # indexes into Workload.requests

    @property
    def batch_size(self) -> int:
        return len(self.linked)


@dataclass(slots=True)
class Workload:
    requests: list[RequestTruth]
    steps: list[StepTruth]
    server_service: str
    client_service: str


def _ms(rng: random.Random, median: float, sigma: float = 0.35) -> float:
    """A log-normal duration in ms rounded to whole µs (≥ 1 µs)."""
    return max(0.001, round(rng.lognormvariate(0.0, sigma) * median, 3))


def generate(
    n_requests: int,
    seed: int = 0,
    *,
    models: tuple[str, ...] = ("tiny",),
    rate_rps: float = 50.0,
    start_ns: int | None = None,
    client_clock_shift_ns: int = 0,
    wall_step_ns: int = 0,
    server_only_every: int = 0,
    abort_every: int = 0,
    preempt_every: int = 0,
    n_steps: int = 0,
    server_service: str = "phaselens-server",
    client_service: str = "phaselens-loadgen",
) -> Workload:
    """Draw `n_requests` requests arriving at `rate_rps` from `start_ns` (default: 2 min ago), for
    `models` in turn; every k-th request is server-only / aborted / preempted (a second queue wait
    during decode) when the matching `*_every` is k > 0."""
    rng = random.Random(seed)
    t0 = start_ns if start_ns is not None else time.time_ns() - 120 * 10**9
    requests = []
    for i in range(n_requests):
        out = rng.randint(2, 64)
        r = RequestTruth(
            request_id=f"cmpl-{seed}-{i}",
            model=models[i % len(models)],
            start_ns=t0 + round(i * 1e9 / rate_rps),
            input_tokens=rng.randint(8, 512),
            output_tokens=out,
            cached_tokens=rng.choice((0, 0, 16)),
            ingress_ms=_ms(rng, 0.8),
            queue_waits_ms=[_ms(rng, 5.0, 0.8)],
            prefill_ms=_ms(rng, 20.0),
            prefill_chunks=rng.choice((1, 1, 2)),
            first_token_ms=_ms(rng, 0.5),
            loop_wait_ms=_ms(rng, 2.0),
            encode_ms=_ms(rng, 0.1),
            write_ms=_ms(rng, 0.05),
            decode_ms=_ms(rng, 10.0 * (out - 1)),
            delivery_ms=_ms(rng, 0.3),
            uplink_ms=_ms(rng, 1.0),
            downlink_ms=_ms(rng, 1.0),
            has_client=not (server_only_every and i % server_only_every == server_only_every - 1),
            aborted=bool(abort_every and i % abort_every == abort_every - 1),
            client_clock_shift_ns=client_clock_shift_ns,
            wall_step_ns=wall_step_ns,
        )
        if preempt_every and i % preempt_every == preempt_every - 1:
            r.queue_waits_ms.append(round(r.decode_ms / 3, 3))  # waits again, inside decode
        r.itl_p99_ms = round(r.decode_ms / (out - 1) * 1.8, 3)
        r.stall_ms = r.queue_waits_ms[1] if r.preemptions else 0.0
        requests.append(r)
    return Workload(requests, _steps(rng, requests, n_steps), server_service, client_service)


def _steps(rng: random.Random, requests: list[RequestTruth], n_steps: int) -> list[StepTruth]:
    """Engine steps spread over the run: decode-only ones (~20 ms), and one in four mixed with a
    prefill chunk (longer by the prefill work)."""
    if not requests or n_steps <= 0:
        return []
    t0, span_ns = requests[0].start_ns, max(1, requests[-1].start_ns - requests[0].start_ns)
    steps = []
    for i in range(n_steps):
        linked = sorted(rng.sample(range(len(requests)), min(len(requests), rng.randint(1, 4))))
        mixed = i % 4 == 3 and len(linked) > 1
        decode = len(linked) - 1 if mixed else len(linked)
        duration = _ms(rng, 20.0, 0.05) + (_ms(rng, 15.0) if mixed else 0.0)
        steps.append(
            StepTruth(
                t0 + span_ns * i // n_steps,
                round(duration, 3),
                rng.randint(32, 256) if mixed else 0,
                decode,
                rng.randint(10, 90),
                100,
                int(rng.random() < 0.05),
                rng.randint(0, 8),
                i,
                linked,
            )
        )
    return steps


def expected_stalls(steps: list[StepTruth]) -> tuple[float, int, float, float]:
    """(baseline_ms, mixed_steps, stall_ms, request_stall_ms) as phaselens.analysis.queries defines them:
    baseline = median (linear interpolation) of decode-only step durations; a mixed step has
    prefill and decode tokens; extra = max(0, duration − baseline); stall = Σ extra;
    request stall = Σ decode_tokens × extra."""
    decode_only = [s.duration_ms for s in steps if s.prefill_tokens == 0 and s.decode_tokens > 0]
    baseline = statistics.median(decode_only) if decode_only else 0.0
    mixed = [s for s in steps if s.prefill_tokens > 0 and s.decode_tokens > 0]
    extras = [(s.decode_tokens, max(0.0, s.duration_ms - baseline)) for s in mixed]
    return baseline, len(mixed), sum(e for _, e in extras), sum(d * e for d, e in extras)


class _SeededIds(IdGenerator):
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed ^ 0x5EED)

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(128) or 1


class _Collect(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _provider(service: str, ids: IdGenerator, sink: _Collect) -> TracerProvider:
    tp = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=ids)
    tp.add_span_processor(SimpleSpanProcessor(sink))
    return tp


def build_spans(workload: Workload, seed: int = 0, phase_attributes: bool = True) -> list[ReadableSpan]:
    """Every span of the workload, built with the OTel SDK; fills trace/span ids into the truths.
    `phase_attributes=False` leaves the `phaselens.*_ms` phase attributes off the server span, so
    the analysis must fall back to the phase spans' own Durations."""
    sink, ids = _Collect(), _SeededIds(seed)
    client_tp = _provider(workload.client_service, ids, sink)
    server_tp = _provider(workload.server_service, ids, sink)
    client_tracer, server_tracer = client_tp.get_tracer("phaselens.loadgen"), server_tp.get_tracer("phaselens")
    contexts = [_emit_request(r, client_tracer, server_tracer, phase_attributes) for r in workload.requests]
    for s in workload.steps:
        _emit_step(s, server_tracer, [contexts[i] for i in s.linked])
    client_tp.shutdown()
    server_tp.shutdown()
    return sink.spans


def _server_attrs(r: RequestTruth, phase_attributes: bool) -> dict:
    attrs = {
        n.GEN_AI_OPERATION_NAME: n.OP_TEXT_COMPLETION,
        n.GEN_AI_PROVIDER_NAME: n.PROVIDER_PHASELENS,
        n.GEN_AI_REQUEST_MODEL: r.model,
        n.GEN_AI_RESPONSE_MODEL: r.model,
        n.GEN_AI_REQUEST_ID: r.request_id,
        n.GEN_AI_RESPONSE_ID: r.request_id,
        n.GEN_AI_USAGE_INPUT_TOKENS: r.input_tokens,
        n.GEN_AI_USAGE_OUTPUT_TOKENS: r.output_tokens,
        n.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: r.cached_tokens,
        n.PL_SERVER_TTFT_MS: r.server_ttft_ms,
        n.PL_SERVER_TTFC_MS: r.server_ttfc_ms,
        n.PL_PREEMPTIONS: r.preemptions,
        n.PL_FINISH_REASON: "abort" if r.aborted else "length",
        n.PL_RECEIVED_WALL_NS: r.wall_stamps_ns()[1],
        n.PL_RESPONDED_WALL_NS: r.wall_stamps_ns()[2],
    }
    if r.tpot_ms is not None:
        attrs[n.PL_SERVER_TPOT_MS] = r.tpot_ms
    if phase_attributes:
        attrs.update(
            {
                n.PL_INGRESS_MS: r.ingress_ms,
                n.PL_QUEUE_MS: r.queue_waits_ms[0],
                n.PL_PREFILL_MS: r.prefill_ms,
                n.PL_FIRST_TOKEN_MS: r.first_token_ms,
                n.PL_FIRST_CHUNK_MS: r.first_chunk_ms,
                **_split_attrs(r),
                n.PL_DECODE_MS: r.decode_ms,
                n.PL_DELIVERY_MS: r.delivery_ms,
                n.PL_PREFILL_CHUNKS: r.prefill_chunks,
            }
        )
    if r.aborted:
        attrs[n.ERROR_TYPE] = n.ERROR_CLIENT_DISCONNECTED
    return attrs


def _split_attrs(r: RequestTruth) -> dict:
    return {
        n.PL_FIRST_CHUNK_LOOP_WAIT_MS: r.loop_wait_ms,
        n.PL_FIRST_CHUNK_ENCODE_MS: r.encode_ms,
        n.PL_FIRST_CHUNK_WRITE_MS: r.write_ms,
    }


def _client_attrs(r: RequestTruth) -> dict:
    t1, _, _, t4 = r.wall_stamps_ns()
    attrs = {
        n.GEN_AI_OPERATION_NAME: n.OP_TEXT_COMPLETION,
        n.GEN_AI_REQUEST_MODEL: r.model,
        n.GEN_AI_RESPONSE_ID: r.request_id,
        n.GEN_AI_USAGE_INPUT_TOKENS: r.input_tokens,
        n.GEN_AI_USAGE_OUTPUT_TOKENS: r.output_tokens,
        n.PL_CLIENT_TTFT_MS: r.client_ttft_ms,
        n.PL_CLIENT_TTFO_MS: r.client_ttft_ms,
        n.PL_CLIENT_E2E_MS: r.client_e2e_ms,
        n.PL_CLIENT_ITL_P99_MS: r.itl_p99_ms,
        n.PL_CLIENT_SENT_WALL_NS: t1,
        n.PL_CLIENT_DONE_WALL_NS: t4,
    }
    if r.tpot_ms is not None:
        attrs[n.PL_CLIENT_TPOT_MS] = r.tpot_ms
    if r.aborted:
        attrs[n.ERROR_TYPE] = n.ERROR_CLIENT_DISCONNECTED
    return attrs


def _emit_request(r: RequestTruth, client_tracer, server_tracer, phase_attributes: bool):
    name = n.root_span_name(n.OP_TEXT_COMPLETION, r.model)
    parent_ctx, client_span = Context(), None
    t1, t2, t3, t4 = r.wall_stamps_ns()
    if r.has_client:
        client_span = client_tracer.start_span(name, kind=SpanKind.CLIENT, start_time=t1, attributes=_client_attrs(r))
        parent_ctx = trace.set_span_in_context(client_span)
    server = server_tracer.start_span(
        name, context=parent_ctx, kind=SpanKind.SERVER, start_time=t2, attributes=_server_attrs(r, phase_attributes)
    )
    ctx = server.get_span_context()
    r.trace_id, r.server_span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
    _emit_phases(r, server_tracer, trace.set_span_in_context(server))
    if r.aborted:
        server.set_status(Status(StatusCode.ERROR, "client disconnected"))
    server.end(end_time=t3)
    if client_span is not None:
        first_chunk = t1 + _ns(r.client_ttft_ms)  # before any wall step: stamped early in the request
        client_span.add_event(n.EVENT_FIRST_CHUNK, timestamp=first_chunk)
        client_span.add_event(n.EVENT_FIRST_OUTPUT, timestamp=first_chunk)
        client_span.add_event(n.EVENT_LAST_CHUNK, timestamp=t4)
        if r.aborted:
            client_span.set_status(Status(StatusCode.ERROR, "cancelled"))
        client_span.end(end_time=t4)
    return ctx


def _emit_phases(r: RequestTruth, tracer, ctx) -> None:
    """ingress → queue → prefill(+chunks) → first_token → decode (with a second queue wait when
    preempted) → delivery, back to back on the server clock; first_chunk from the first token on,
    beside decode."""
    t = r.start_ns

    def span(name: str, start: int, dur_ms: float, attrs: dict | None = None, parent=ctx) -> int:
        s = tracer.start_span(name, context=parent, start_time=start, attributes=attrs or {})
        s.end(end_time=start + _ns(dur_ms))
        return start + _ns(dur_ms)

    t = span(n.SPAN_INGRESS, t, r.ingress_ms)
    t = span(n.SPAN_QUEUE, t, r.queue_waits_ms[0], {n.PL_QUEUE_WAIT_INDEX: 0})
    prefill = tracer.start_span(
        n.SPAN_PREFILL, context=ctx, start_time=t, attributes={n.PL_PREFILL_CHUNKS: r.prefill_chunks}
    )
    chunk_ms = round(r.prefill_ms / r.prefill_chunks, 3)
    chunk_ctx, c = trace.set_span_in_context(prefill), t
    for k in range(r.prefill_chunks):
        c = span(n.SPAN_PREFILL_CHUNK, c, chunk_ms, {n.PL_CHUNK_INDEX: k}, parent=chunk_ctx)
    prefill.end(end_time=t + _ns(r.prefill_ms))
    t = span(n.SPAN_FIRST_TOKEN, t + _ns(r.prefill_ms), r.first_token_ms)
    span(n.SPAN_FIRST_CHUNK, t, r.first_chunk_ms, _split_attrs(r))
    decode_attrs = {
        n.PL_DECODE_TOKENS: r.output_tokens - 1,
        n.PL_DECODE_STEPS: r.output_tokens - 1,
        n.PL_ITL_P99_MS: r.itl_p99_ms,
        n.PL_STALL_MS: r.stall_ms,
    }
    if r.preemptions:
        span(n.SPAN_QUEUE, t + _ns(r.decode_ms / 3), r.queue_waits_ms[1], {n.PL_QUEUE_WAIT_INDEX: 1})
    t = span(n.SPAN_DECODE, t, r.decode_ms, decode_attrs)
    span(n.SPAN_DELIVERY, t, r.delivery_ms)


def _emit_step(s: StepTruth, tracer, linked_contexts) -> None:
    attrs = {
        n.PL_STEP_INDEX: s.index,
        n.PL_STEP_NUM_SEQS: s.batch_size,
        n.PL_STEP_PREFILL_TOKENS: s.prefill_tokens,
        n.PL_STEP_DECODE_TOKENS: s.decode_tokens,
        n.PL_STEP_KV_BLOCKS_USED: s.kv_blocks_used,
        n.PL_STEP_KV_BLOCKS_TOTAL: s.kv_blocks_total,
        n.PL_STEP_PREEMPTIONS: s.preemptions,
        n.PL_STEP_QUEUE_DEPTH: s.queue_depth,
    }
    span = tracer.start_span(
        n.SPAN_ENGINE_STEP,
        context=Context(),
        start_time=s.start_ns,
        attributes=attrs,
        links=[Link(c) for c in linked_contexts],
    )
    span.end(end_time=s.start_ns + _ns(s.duration_ms))


def insert_spans(
    spans: list[ReadableSpan], clickhouse_url: str, database: str, batch: int = 5000, token_prefix: str | None = None
) -> int:
    """Without a collector: the OTLP exporter's own protobuf encoding, rendered into rows by the
    collector's renderer and inserted through its sink (one insert per batch, as it would).
    `token_prefix` makes the batches' deduplication tokens repeatable, as a spool replay's are."""
    from phaselens.collectors import render
    from phaselens.collectors.writer import ClickHouseSink

    sink, rows = ClickHouseSink(clickhouse_url, database), 0
    try:
        for i in range(0, len(spans), batch):
            block, count = render.render(encode_spans(spans[i : i + batch]).SerializeToString())
            sink.insert([block], token=f"{token_prefix}-{i}" if token_prefix else uuid.uuid4().hex)
            rows += count
    finally:
        sink.close()
    return rows


def export_otlp(spans: list[ReadableSpan], endpoint: str, batch: int = 512) -> None:
    """Through the real OTLP/gRPC exporter to a collector at `endpoint` (e.g. 127.0.0.1:4317)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    try:
        for i in range(0, len(spans), batch):
            if exporter.export(spans[i : i + batch]) is not SpanExportResult.SUCCESS:
                raise RuntimeError(f"OTLP export to {endpoint} failed")
    finally:
        exporter.shutdown()


def emit(
    workload: Workload,
    clickhouse_url: str,
    database: str = "otel",
    *,
    transport: str = "otlp",
    otlp_endpoint: str | None = None,
    seed: int = 0,
    phase_attributes: bool = True,
    token_prefix: str | None = None,
    services: tuple[str, ...] | None = None,
) -> int:
    """Builds the spans and ships them (only those of `services` when given: the others not
    arrived yet); returns the span count.

    transport="otlp": the real OTLP/gRPC exporter, to `otlp_endpoint` when given, else to a private
    `collectors.Collector` (loopback, free ports) started for this call and drained into
    `clickhouse_url`/`database` before returning. transport="insert": no collector, the rows its
    renderer would write, inserted directly."""
    spans = [
        s
        for s in build_spans(workload, seed, phase_attributes)
        if services is None or s.resource.attributes["service.name"] in services
    ]
    if transport == "insert":
        insert_spans(spans, clickhouse_url, database, token_prefix=token_prefix)
    elif otlp_endpoint:
        export_otlp(spans, otlp_endpoint)
    else:
        from phaselens.collectors import Collector

        collector = Collector(clickhouse_url=clickhouse_url, database=database).start()
        try:
            export_otlp(spans, collector.grpc_endpoint)
        finally:
            if not collector.stop():
                raise RuntimeError("the collector could not drain its spool into ClickHouse")
    return len(spans)
