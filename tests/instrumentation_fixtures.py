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

from instrumentation import names
from instrumentation.clock import ClockAnchor
from instrumentation.observer import FINISH_ABORT, FINISH_LENGTH
from instrumentation.server import ServerTelemetry

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
        return [p for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
                if m.name == name for p in m.data.data_points]


def make_rig(sampler=None, wall_ns=None, **kwargs) -> Rig:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    clock = ScriptedClock()
    anchor = ClockAnchor.capture(clock, wall_ns or (lambda: WALL_BASE_NS))
    telemetry = ServerTelemetry(tracer_provider, MeterProvider(metric_readers=[reader]), clock_ns=clock,
                                anchor=anchor, **kwargs)
    return Rig(telemetry, exporter, reader, clock, anchor)


def http_scope(path: str = "/v1/completions", traceparent: str | None = None) -> dict:
    headers = [(b"content-type", b"application/json")]
    if traceparent:
        headers.append((b"traceparent", traceparent.encode()))
    return {"type": "http", "method": "POST", "path": path, "headers": headers,
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}


TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def script_request(rig, traceparent=TRACEPARENT, prompt="hello", completion="world"):
    """received 1.000 ms … responded 1.990 ms: chunked prefill, one preemption during decode."""
    clock = rig.clock
    clock.now_ns = 1_000_000
    req = rig.telemetry.request(http_scope(traceparent=traceparent))
    req.describe(operation=names.OP_TEXT_COMPLETION, model="tiny", request_id="cmpl-1", input_tokens=12,
                 max_tokens=7, temperature=0.0, top_p=1.0, top_k=0, seed=None, stream=True, prompt=prompt)
    clock.now_ns = 1_100_000; req.enqueued()
    clock.now_ns = 1_400_000; req.scheduled()
    req.prefill_chunk(1_410_000, 1_500_000, 8, 4)
    req.prefill_chunk(1_600_000, 1_700_000, 4, 0)
    clock.now_ns = 1_720_000; req.first_token()
    for t_ns, n in ((1_730_000, 1), (1_740_000, 1), (1_750_000, 2)):
        clock.now_ns = t_ns; req.token(n)
    clock.now_ns = 1_760_000; req.preempted()
    clock.now_ns = 1_900_000; req.scheduled()
    req.prefill_chunk(1_905_000, 1_950_000, 16, 0)
    for t_ns in (1_960_000, 1_970_000):
        clock.now_ns = t_ns; req.token()
    clock.now_ns = 1_975_000; req.finished(FINISH_LENGTH)
    rig.telemetry.step_observer.step(1_940_000, 1_970_000, 16, 1, 3, 16, 0, 2, [req])
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
        step_observer.step(step_start, time.monotonic_ns(), 5 if not index else 0, 1 if index else 0,
                           1, 16, 0, 0, [req])
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
        req.describe(operation=names.OP_TEXT_COMPLETION, model="tiny", request_id="cmpl-test",
                     input_tokens=5, max_tokens=body["max_tokens"], stream=True, prompt=body.get("prompt"))
        job = EngineJob(req, body["max_tokens"], body.get("delay_s", 0.001), asyncio.Queue(),
                        asyncio.get_running_loop())
        threading.Thread(target=run_engine_job, args=(job, telemetry.step_observer), daemon=True).start()

        async def chunks():
            try:
                while (text := await job.out.get()) is not None:
                    yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n"
                yield "data: [DONE]\n\n"
                req.complete(output_tokens=body["max_tokens"], finish_reason=FINISH_LENGTH)
            finally:
                job.cancelled.set()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def serve(fd: int, spans_path: str) -> None:
    """Uvicorn on an inherited listening socket; spans as JSON lines to `spans_path`, written as
    each span ends (the test reads them while the server runs, then terminates it)."""
    import uvicorn
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    out = open(spans_path, "a", buffering=1)
    provider = TracerProvider(resource=Resource.create({"service.name": "instrumentation-test-server"}))
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
        out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    telemetry = ServerTelemetry(provider, MeterProvider())
    server = uvicorn.Server(uvicorn.Config(telemetry.asgi(make_app(telemetry)), fd=fd, log_level="warning",
                                           lifespan="off"))
    print("READY", flush=True)
    server.run()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
