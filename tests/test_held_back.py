"""A first token that renders no text: the reference server with the tiny model (ByT5 byte-level
tokens) sampling only the two bytes of 'é' (C3 A9), as a model with byte-fallback tokens does for
rare characters. A lone C3 is half a character: the detokenizer holds it back, and the first chunk
carrying text comes one or more decode steps later. Those steps are `held_back` (with their count),
and `first_chunk` stays the delivery of the chunk once there is text."""

from __future__ import annotations

import asyncio

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from phaselens.instrumentation import names
from phaselens.instrumentation.client.traced_client import TracedClient
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from phaselens.reference_server.engine.detokenizer import BYTE_OFFSET
from phaselens.reference_server.engine.model_loader import TINY_VOCAB
from phaselens.reference_server.engine.sampler import Sampler
from phaselens.reference_server.serving.api import ApiSettings
from tests.server_fixtures import LiveServer, make_engine

REQUESTS = 6
UTF8_E_ACUTE = (0xC3, 0xA9)


def test_decode_steps_until_the_first_visible_text_are_held_back():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = ServerTelemetry(provider, MeterProvider(), builder="thread")
    engine = make_engine()
    allowed = {b + BYTE_OFFSET for b in UTF8_E_ACUTE}  # no EOS either: every request runs max_tokens
    engine.runner.sampler = Sampler(
        tuple(i for i in range(TINY_VOCAB) if i not in allowed), torch.device("cpu"), seed=0
    )

    async def run(url: str) -> list:
        async with TracedClient(url, tracer_provider=TracerProvider()) as client:
            return [
                await client.stream("completions", {"model": "tiny", "prompt": f"caf{i}", "max_tokens": 8})
                for i in range(REQUESTS)
            ]

    with LiveServer(engine, ApiSettings(served_model_names=("tiny",)), telemetry) as live:
        results = asyncio.run(run(live.url))
    assert telemetry.flush(10)
    telemetry.shutdown()
    assert all(r.ok and r.ttft_ms is not None for r in results)
    roots = [dict(s.attributes) for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert len(roots) == REQUESTS
    for a in roots:
        held, tokens = a[names.PL_HELD_BACK_MS], a[names.PL_HELD_BACK_TOKENS]
        assert tokens >= 0 and held >= 0 and (held > 0) == (tokens > 0)
        # server TTFC = TTFT + the held-back decode steps + the delivery (ms rounding aside)
        total = a[names.PL_SERVER_TTFT_MS] + held + a[names.PL_FIRST_CHUNK_MS]
        assert total == pytest.approx(a[names.PL_SERVER_TTFC_MS], abs=1e-3)
        assert a[names.PL_FIRST_CHUNK_LOOP_WAIT_MS] >= 0
    # a first token C3 (half of 'é') renders nothing: at least one stream waited for its next byte
    assert any(a[names.PL_HELD_BACK_TOKENS] >= 1 for a in roots), roots
    assert all(r.chunk_ts for r in results)
