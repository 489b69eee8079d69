"""The load generator against the real reference server (tiny model, real engine, real middleware):
traces link across the HTTP hop, and the client's token accounting is checked against the server's usage."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from phaselens.instrumentation import names as N
from phaselens.instrumentation.client.traced_client import TracedClient
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from phaselens.loadgen import runner, session
from phaselens.loadgen.workloads import LengthDist, SyntheticWorkload
from phaselens.reference_server import Engine, EngineConfig
from phaselens.reference_server.serving.api import ApiSettings
from tests.server_fixtures import LiveServer


def in_memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_client_span_is_parent_of_the_server_span_and_usage_is_used():
    server_provider, server_spans = in_memory()
    client_provider, client_spans = in_memory()
    telemetry = ServerTelemetry(tracer_provider=server_provider, meter_provider=MeterProvider())
    engine = Engine(EngineConfig(), step_observer=telemetry.step_observer)
    work = SyntheticWorkload(LengthDist.parse("6"), LengthDist.parse("8"), seed=0)
    plan = runner.RunPlan("chat", "tiny", concurrency=2, requests=4, ignore_eos=True)

    async def drive(url: str, token_counter) -> runner.RunResult:
        async with TracedClient(
            url, tracer_provider=client_provider, token_counter=token_counter, timeout_s=60, keep_text=True
        ) as client:
            return await runner.run(plan, client, work.requests())

    with LiveServer(engine, ApiSettings(served_model_names=("tiny",), reasoning_tokens=2), telemetry) as server:
        per_chunk = asyncio.run(drive(server.url, None))
        per_byte = asyncio.run(drive(server.url, session.CHUNK_TOKEN_COUNTERS["bytes"]))
    telemetry.shutdown()

    assert [r.error for r in per_chunk.results + per_byte.results] == [None] * 8
    for r in per_chunk.results:
        # a token whose bytes are not yet whole UTF-8 streams no text: its chunk comes later, merged
        assert r.output_tokens == 8 and r.counted_tokens == len(r.chunk_ts) <= 8
        assert r.usage_mismatch == 8 - r.counted_tokens
        # 2 reasoning tokens come before the content. Stamps are per network read, and this in-process
        # server (one GIL) often lands a whole stream in one read: then the stamps are equal
        assert r.ttft_ms <= r.ttfo_ms <= r.e2e_ms and r.reasoning_tokens == 2
        assert r.tpot_ms == (r.e2e_ms - r.ttft_ms) / 7
    for r in per_byte.results:  # ByT5: one token per UTF-8 byte (special tokens stream no text)
        assert r.chunk_tokens == [len(text.encode()) for text in r.chunk_text]
        assert r.usage_mismatch == 8 - r.counted_tokens
    servers = {s.context.span_id: s for s in server_spans.get_finished_spans() if s.kind == SpanKind.SERVER}
    clients = [s for s in client_spans.get_finished_spans() if s.kind == SpanKind.CLIENT]
    assert len(clients) == 8 and len(servers) == 8
    children = {s.parent.span_id: s for s in servers.values() if s.parent is not None}
    for client in clients:
        server_span = children[client.context.span_id]
        assert server_span.context.trace_id == client.context.trace_id
        assert server_span.name == client.name == "chat tiny"
        assert server_span.attributes[N.GEN_AI_USAGE_OUTPUT_TOKENS] == client.attributes[N.GEN_AI_USAGE_OUTPUT_TOKENS]
