"""Helpers for the instrumentation tests: a scripted clock, in-memory OTel providers, a tiny
streaming ASGI app driven by a scripted engine thread, and a uvicorn server entry point
(`python -m tests.instrumentation_fixtures FD SPANS_FILE`) that writes its spans as JSON lines
through the SDK's ConsoleSpanExporter."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from dataclasses import dataclass, field

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor
from phaselens.instrumentation.hotpath.observer import FINISH_ABORT, FINISH_LENGTH
from phaselens.instrumentation.hotpath.records import RequestInfo, StepStats
from phaselens.instrumentation.server.telemetry import ServerTelemetry

WALL_BASE_NS = 1_700_000_000_000_000_000


@dataclass(slots=True)
class ScriptedClock:
    """A monotonic clock the test advances by hand."""

    now_ns: int = 1_000_000

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, delta_ns: int) -> int:
        self.now_ns += delta_ns
        return self.now_ns


@dataclass(slots=True)
class Rig:
    telemetry: ServerTelemetry
    exporter: InMemorySpanExporter
    reader: InMemoryMetricReader
    clock: ScriptedClock
    anchor: ClockAnchor

    def spans(self) -> list:
        assert self.telemetry.flush(10), self.telemetry.stats()
        return list(self.exporter.get_finished_spans())

    def by_name(self) -> dict[str, list]:
        out: dict[str, list] = {}
        for span in self.spans():
            out.setdefault(span.name, []).append(span)
        return out

    def metric_points(self, name: str) -> list:
        data = self.reader.get_metrics_data()
        return [
            p
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == name
            for p in m.data.data_points
        ]


def make_rig(sampler=None, wall_ns=None, **kwargs) -> Rig:
    """In-memory SDK providers; with builder="process" the spans are exported by the span-builder
    process per the OTEL_* environment instead (see process_env)."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    clock = ScriptedClock()
    anchor = ClockAnchor.capture(clock, wall_ns or (lambda: WALL_BASE_NS))
    telemetry = ServerTelemetry(
        tracer_provider, MeterProvider(metric_readers=[reader]), clock_ns=clock, anchor=anchor, **kwargs
    )
    return Rig(telemetry, exporter, reader, clock, anchor)


def http_scope(path: str = "/v1/completions", traceparent: str | None = None) -> dict:
    headers = [(b"content-type", b"application/json")]
    if traceparent:
        headers.append((b"traceparent", traceparent.encode()))
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": headers,
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }


TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _send_chunk(req, clock, ready_ns: int, send_ns: int, sent_ns: int) -> None:
    """What the API layer and the middleware stamp for one streamed content chunk."""
    clock.now_ns = ready_ns
    req.output_ready()
    clock.now_ns = send_ns
    req.body_sending(0, True)
    clock.now_ns = sent_ns
    req.chunk_sent()


def script_request(rig, traceparent=TRACEPARENT, prompt="hello", completion="world"):
    """received 1.000 ms … responded 1.990 ms: chunked prefill, one preemption during decode; the
    first content chunk taken at 1.724, handed to send at 1.726, sent at 1.727; the last handed to
    send at 1.9715."""
    clock = rig.clock
    clock.now_ns = 1_000_000
    req = rig.telemetry.request(http_scope(traceparent=traceparent))
    req.describe(
        RequestInfo(
            operation=names.OP_TEXT_COMPLETION,
            model="tiny",
            request_id="cmpl-1",
            input_tokens=12,
            max_tokens=7,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=None,
            stream=True,
            prompt=prompt,
        )
    )
    clock.now_ns = 1_100_000
    req.enqueued()
    clock.now_ns = 1_400_000
    req.scheduled()
    req.prefill_chunk(1_410_000, 1_500_000, 8, 4)
    req.prefill_chunk(1_600_000, 1_700_000, 4, 0)
    clock.now_ns = 1_720_000
    req.first_token()
    _send_chunk(req, clock, 1_724_000, 1_726_000, 1_727_000)
    for t_ns, n in ((1_730_000, 1), (1_740_000, 1), (1_750_000, 2)):
        clock.now_ns = t_ns
        req.token(n)
    clock.now_ns = 1_760_000
    req.preempted()
    clock.now_ns = 1_900_000
    req.scheduled()
    req.prefill_chunk(1_905_000, 1_950_000, 16, 0)
    for t_ns in (1_960_000, 1_970_000):
        clock.now_ns = t_ns
        req.token()
    _send_chunk(req, clock, 1_971_000, 1_971_500, 1_972_000)
    clock.now_ns = 1_975_000
    req.finished(FINISH_LENGTH)
    rig.telemetry.step_observer.step(StepStats(1_940_000, 1_970_000, 16, 1, 3, 16, 0, 2), [req])
    clock.now_ns = 1_990_000
    req.complete(output_tokens=7, finish_reason=FINISH_LENGTH, cached_tokens=4, completion=completion)
    return req


# --- a tiny streaming app over a scripted engine thread -------------------------------------


@dataclass(slots=True)
class EngineJob:
    handle: object
    tokens: int
    delay_s: float
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)


def run_engine_job(job: EngineJob, step_observer) -> None:
    """A one-request 'engine' on its own thread: real stamps, sleeps instead of a model."""
    req = job.handle
    req.enqueued()
    req.scheduled()
    start = time.monotonic_ns()
    time.sleep(job.delay_s)
    req.prefill_chunk(start, time.monotonic_ns(), 5, 0)
    reason = FINISH_LENGTH
    for index in range(job.tokens):
        if job.cancelled.is_set():
            reason = FINISH_ABORT
            break
        step_start = time.monotonic_ns()
        if index:
            time.sleep(job.delay_s)
            req.token()
        else:
            req.first_token()
        stats = StepStats(
            step_start,
            time.monotonic_ns(),
            prefill_tokens=0 if index else 5,
            decode_tokens=1 if index else 0,
            kv_blocks_used=1,
            kv_blocks_total=16,
        )
        step_observer.step(stats, [req])
        job.loop.call_soon_threadsafe(job.out.put_nowait, f"tok{index} ")
    req.finished(reason)
    job.loop.call_soon_threadsafe(job.out.put_nowait, None)


def make_app(telemetry: ServerTelemetry):
    """Starlette app: POST /v1/completions streams `max_tokens` SSE chunks; 400 on a bad body."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        req = telemetry.request(request.scope)
        body = await request.json()
        if not isinstance(body.get("max_tokens"), int):
            req.fail("invalid_request_error", 400)
            return JSONResponse({"error": {"type": "invalid_request_error"}}, status_code=400)
        req.describe(
            RequestInfo(
                operation=names.OP_TEXT_COMPLETION,
                model="tiny",
                request_id="cmpl-test",
                input_tokens=5,
                max_tokens=body["max_tokens"],
                stream=True,
                prompt=body.get("prompt"),
            )
        )
        job = EngineJob(
            req, body["max_tokens"], body.get("delay_s", 0.001), asyncio.Queue(), asyncio.get_running_loop()
        )
        threading.Thread(target=run_engine_job, args=(job, telemetry.step_observer), daemon=True).start()

        async def chunks():
            try:
                while (text := await job.out.get()) is not None:
                    req.output_ready()
                    yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n"
                yield "data: [DONE]\n\n"
                req.complete(output_tokens=body["max_tokens"], finish_reason=FINISH_LENGTH)
            finally:
                job.cancelled.set()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def serve(fd: int, spans_path: str, builder: str) -> None:
    """Uvicorn on an inherited listening socket; with the thread builder spans as JSON lines to
    `spans_path`, written as each span ends (the test reads them while the server runs, then
    terminates it); with the process builder the span-builder process exports per OTEL_*."""
    import uvicorn
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    out = open(spans_path, "a", buffering=1)  # noqa: SIM115 — the exporter writes to it until the process ends
    provider = TracerProvider(resource=Resource.create({"service.name": "instrumentation-test-server"}))
    provider.add_span_processor(
        SimpleSpanProcessor(ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"))
    )
    telemetry = (
        ServerTelemetry(provider, MeterProvider())
        if builder == "thread"
        else ServerTelemetry(builder=builder, service_name="instrumentation-test-server")
    )
    server = uvicorn.Server(
        uvicorn.Config(telemetry.asgi(make_app(telemetry)), fd=fd, log_level="warning", lifespan="off")
    )
    print("READY", flush=True)
    server.run()
    telemetry.shutdown()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2], sys.argv[3])


# --- a loopback OTLP/HTTP receiver, and one comparable form for SDK spans and OTLP spans ----------


class OtlpReceiver:
    """Accepts OTLP/HTTP protobuf trace and metric exports on 127.0.0.1 (real exporter on the other
    side) and keeps the decoded protobuf spans and metric requests."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list = []
        self.metrics: list = []  # ExportMetricsServiceRequest, one per export
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest.FromString(body)
                    receiver.spans.extend(
                        span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans
                    )
                elif self.path == "/v1/metrics":
                    receiver.metrics.append(ExportMetricsServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def process_env(monkeypatch, receiver: OtlpReceiver, sampler: str = "parentbased_always_on") -> None:
    """The OTEL_* settings the span-builder process reads: export to `receiver`, no metrics."""
    for name, value in (
        ("OTEL_TRACES_EXPORTER", "otlp"),
        ("OTEL_METRICS_EXPORTER", "none"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
        ("OTEL_TRACES_SAMPLER", sampler),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)


def _any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_any_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


@dataclass(frozen=True, slots=True)
class SpanShape:
    """A span with its ids replaced by relations: comparable across processes."""

    name: str
    kind: int  # OTLP numbering
    start_ns: int
    end_ns: int
    status: int
    attributes: tuple
    events: tuple
    parent: str  # the parent span's name, or the remote parent's hex span id, or ""
    links: tuple  # names of the linked spans
    trace_id: str  # hex, kept only for a trace that came with a traceparent


def _shape(
    name, kind, start, end, status, attributes, events, span_id, parent_id, parent_remote, links, trace_id, names_by_id
) -> SpanShape:
    parent = "" if not parent_id else (format(parent_id, "016x") if parent_remote else names_by_id[parent_id])
    return SpanShape(
        name,
        kind,
        start,
        end,
        status,
        tuple(sorted(attributes.items())),
        events,
        parent,
        tuple(sorted(names_by_id.get(link, "?") for link in links)),
        format(trace_id, "032x") if format(trace_id, "032x") == TRACE_ID else "",
    )


def shapes_of_sdk_spans(spans) -> list[SpanShape]:
    by_id = {s.context.span_id: s.name for s in spans}
    shapes = [
        _shape(
            s.name,
            s.kind.value + 1,
            s.start_time,
            s.end_time,
            s.status.status_code.value,
            {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in s.attributes.items()},
            tuple((e.name, e.timestamp, tuple(sorted(e.attributes.items()))) for e in s.events),
            s.context.span_id,
            s.parent.span_id if s.parent else 0,
            bool(s.parent and s.parent.is_remote),
            [link.context.span_id for link in s.links],
            s.context.trace_id,
            by_id,
        )
        for s in spans
    ]
    return sorted(shapes, key=repr)


def shapes_of_otlp_spans(spans) -> list[SpanShape]:
    by_id = {int.from_bytes(s.span_id, "big"): s.name for s in spans}
    remote = 0x300  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE | SPAN_FLAGS_CONTEXT_IS_REMOTE
    shapes = [
        _shape(
            s.name,
            s.kind,
            s.start_time_unix_nano,
            s.end_time_unix_nano,
            s.status.code,
            {a.key: _any_value(a.value) for a in s.attributes},
            tuple(
                (e.name, e.time_unix_nano, tuple(sorted((a.key, _any_value(a.value)) for a in e.attributes)))
                for e in s.events
            ),
            int.from_bytes(s.span_id, "big"),
            int.from_bytes(s.parent_span_id, "big") if s.parent_span_id else 0,
            s.flags & remote == remote,
            [int.from_bytes(link.span_id, "big") for link in s.links],
            int.from_bytes(s.trace_id, "big"),
            by_id,
        )
        for s in spans
    ]
    return sorted(shapes, key=repr)


def otlp_span_as_json(span) -> dict:
    """An OTLP span in the shape of the SDK's `ReadableSpan.to_json()` (the fields the tests read)."""
    return {
        "name": span.name,
        "kind": f"SpanKind.{('INTERNAL', 'SERVER', 'CLIENT', 'PRODUCER', 'CONSUMER')[span.kind - 1]}",
        "parent_id": f"0x{span.parent_span_id.hex()}" if span.parent_span_id else None,
        "context": {"trace_id": f"0x{span.trace_id.hex()}", "span_id": f"0x{span.span_id.hex()}"},
        "attributes": {a.key: _any_value(a.value) for a in span.attributes},
        "status": {"status_code": ("UNSET", "OK", "ERROR")[span.status.code]},
    }
