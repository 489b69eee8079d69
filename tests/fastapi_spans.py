"""Run in a process of its own (a global tracer provider can be set once per process): serve an app
on loopback with uvicorn, send requests, print the finished spans as JSON lines (name, kind).

    python -m tests.fastapi_spans MODE REQUESTS

MODE: `fastapi` a user's FastAPI app alone (FastAPI's own telemetry on, as installed); `ours` the same
app wrapped in the phaselens middleware; `contrib` the same, also instrumented by
opentelemetry-instrumentation-fastapi with the LLM route excluded, as docs/instrument-your-loop.md says;
`reference` the reference server's app with phaselens telemetry.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestInfo
from phaselens.instrumentation.server.telemetry import ServerTelemetry

LLM_ROUTE = "/v1/completions"


def user_app(telemetry: ServerTelemetry | None) -> FastAPI:
    """A user's own streaming endpoint, reporting to the phaselens handle when there is one."""
    app = FastAPI()

    @app.post(LLM_ROUTE)
    async def completions(request: Request):
        handle = telemetry.request(request.scope) if telemetry else None
        if handle:
            handle.describe(RequestInfo(operation=names.OP_TEXT_COMPLETION, model="user-model", stream=True))

        async def chunks():
            for word in ("a", "b"):
                await asyncio.sleep(0.001)
                if handle:
                    handle.output_ready()
                yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n"
            if handle:
                handle.complete(output_tokens=2, finish_reason="length")
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    return app


def build(mode: str, provider: TracerProvider):
    telemetry = None if mode == "fastapi" else ServerTelemetry(provider, builder="thread")
    if mode == "reference":
        from phaselens.reference_server.engine.config import EngineConfig
        from phaselens.reference_server.engine.engine import Engine
        from phaselens.reference_server.serving.api import ApiSettings, create_app

        engine = Engine(EngineConfig(max_num_seqs=4, kv_cache_tokens=1024))
        engine.step_observer = telemetry.step_observer
        engine.start()
        return create_app(engine, ApiSettings(served_model_names=("tiny",)), telemetry), telemetry, engine
    app = user_app(telemetry)
    if mode.startswith("contrib"):
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(
            app, tracer_provider=provider, excluded_urls=None if mode == "contrib-all" else LLM_ROUTE.lstrip("/")
        )
    return (telemetry.asgi(app) if telemetry else app), telemetry, None


def main(mode: str, requests: int) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    app, telemetry, engine = build(mode, provider)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.Client(timeout=30) as client:
        for _ in range(requests):
            assert client.post(f"{url}{LLM_ROUTE}", json=body).status_code == 200
        assert client.get(f"{url}/health").status_code == 200
    server.should_exit = True
    thread.join(10)
    if telemetry:
        telemetry.flush(10)
    if engine:
        engine.stop()
    for span in exporter.get_finished_spans():
        print(json.dumps({"name": span.name, "kind": span.kind.name}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
