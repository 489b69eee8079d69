"""The OpenAI-compatible API on a real uvicorn server (loopback, free port), with the real
instrumentation: the `openai` package as client, SSE shape, errors, disconnects, overload."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from server_fixtures import LiveServer, make_engine

from phaselens.instrumentation import names
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from phaselens.reference_server.serving.api import ApiSettings

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = ServerTelemetry(provider, MeterProvider(metric_readers=[InMemoryMetricReader()]))
    yield telemetry, exporter
    telemetry.shutdown()


@pytest.fixture(scope="module")
def server(traced):
    telemetry, _ = traced
    engine = make_engine(max_num_seqs=64, max_num_batched_tokens=256, kv_cache_tokens=8192, block_size=16)
    engine.step_observer = telemetry.step_observer
    with LiveServer(
        engine, ApiSettings(served_model_names=("tiny",), reasoning_tokens=3, max_body_bytes=64 << 10), telemetry
    ) as live:
        yield live


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def wait_idle(server, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(server.url + "/health").json()
        idle = (health["running"], health["waiting"], health["kv_blocks_used"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return health


def test_openai_client_completions_and_chat(server):
    c = client(server)
    kw = {
        "model": "tiny",
        "prompt": "Hello there",
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    done = c.completions.create(**kw)
    assert done.choices[0].finish_reason == "length" and len(done.choices[0].text) == 12
    assert done.usage.completion_tokens == 12 and done.usage.prompt_tokens == len("Hello there")
    again = c.completions.create(**kw)
    assert again.choices[0].text == done.choices[0].text
    chat = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    message = chat.choices[0].message
    assert len(message.content) == 5 and chat.usage.completion_tokens == 8
    assert chat.usage.completion_tokens_details.reasoning_tokens == 3
    assert c.models.list().data[0].id == "tiny"


def test_openai_client_streams(server):
    c = client(server)
    stream = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and not first.content
    reasoning = [getattr(ch.choices[0].delta, "reasoning_content", None) for ch in chunks if ch.choices]
    content = [ch.choices[0].delta.content for ch in chunks[1:] if ch.choices and ch.choices[0].delta.content]
    assert len([r for r in reasoning if r]) == 3 and len(content) == 7  # one token per chunk
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    text = c.completions.create(
        model="tiny", prompt="abc", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = [ch.choices[0].text for ch in text]
    assert (
        "".join(pieces)
        == c.completions.create(
            model="tiny", prompt="abc", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


def test_server_spans_cover_every_phase(server, traced):
    telemetry, exporter = traced
    exporter.clear()
    c = client(server)
    list(
        c.completions.create(
            model="tiny", prompt="trace me", max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert telemetry.flush(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        spans = {s.name for s in exporter.get_finished_spans()}
        if names.SPAN_DELIVERY in spans and names.SPAN_ENGINE_STEP in spans:
            break
        time.sleep(0.05)
    for name in (*names.PHASE_SPANS, names.SPAN_ENGINE_STEP, names.root_span_name(names.OP_TEXT_COMPLETION, "tiny")):
        assert name in spans, name


@pytest.mark.parametrize(
    "endpoint,body,param",
    [
        ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ("completions", {"prompt": "x" * 9000}, "prompt"),
        ("completions", {"prompt": "x", "temperature": 3}, "temperature"),
        ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("completions", {"prompt": "x", "n": 2}, "n"),
        ("completions", {"prompt": "x", "model": "gpt-9"}, "model"),
        ("completions", {"prompt": 42}, "prompt"),
        ("completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ],
)
def test_bad_parameters_get_openai_400(server, endpoint, body, param):
    payload = {"model": "tiny", **body}
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_malformed_and_oversized_bodies(server):
    bad_json = httpx.post(
        f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    huge = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x" * (100 << 10)})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="tiny", prompt="x", max_tokens=0)


def test_disconnect_mid_stream_frees_the_slot(server):
    payload = {"model": "tiny", "prompt": "long one", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=payload) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        health = httpx.get(server.url + "/health").json()
        assert health["running"] == 1 and health["kv_blocks_used"] > 0
    health = wait_idle(server)
    assert (health["running"], health["kv_blocks_used"]) == (0, 0)
    assert server.engine.stats.aborted >= 1


def test_200_concurrent_streams_complete_and_kv_returns_to_zero(server):
    rng = random.Random(4)
    jobs = [("x" * rng.randint(1, 80), rng.randint(1, 6)) for _ in range(200)]

    async def one(http: httpx.AsyncClient, prompt: str, max_tokens: int):
        payload = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        events = []
        async with http.stream("POST", "/v1/completions", json=payload) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
        return usage["completion_tokens"], len(text), max_tokens

    async def main():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http:
            return await asyncio.gather(*(one(http, p, n) for p, n in jobs))

    results = asyncio.run(main())
    assert len(results) == 200
    assert all(tokens == n and chars <= n for tokens, chars, n in results)
    # every tiny-model token is one character, except EOS (kept under ignore_eos, no text)
    assert sum(chars for _, chars, _ in results) >= 0.9 * sum(n for _, _, n in results)
    health = wait_idle(server)
    assert (health["running"], health["waiting"], health["kv_blocks_used"]) == (0, 0, 0)


def test_queue_full_answers_503():
    engine = make_engine(max_num_seqs=1, max_waiting=1)
    payload = {"model": "tiny", "prompt": "hold", "max_tokens": 3000, "stream": True, "ignore_eos": True}

    async def hold(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/completions", json=payload) as response:
            async for _ in response.aiter_lines():
                pass

    async def main(url: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # One holder at a time: two arriving together could both meet an unscheduled first
            # request in the waiting queue, and the second would be refused instead of waiting.
            holders = []
            for state in ((1, 0), (1, 1)):
                holders.append(asyncio.create_task(hold(http)))
                deadline = time.monotonic() + 60  # generous: CI machines are slow and shared
                while (engine.num_running, engine.num_waiting) != state and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert (engine.num_running, engine.num_waiting) == state, "the holders never filled the engine"
            refused = await http.post("/v1/completions", json={**payload, "stream": False})
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return refused

    with LiveServer(engine, ApiSettings(served_model_names=("tiny",))) as live:
        refused = asyncio.run(main(live.url))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "queue_full"
        health = wait_idle(live)
        assert (health["running"], health["waiting"], health["kv_blocks_used"]) == (0, 0, 0)


def test_bearer_token_is_required_when_configured():
    engine = make_engine()
    with LiveServer(engine, ApiSettings(served_model_names=("tiny",), auth_token=TOKEN)) as live:
        denied = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=live.url + "/v1", api_key=TOKEN, max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=2
        )
        assert ok.usage.completion_tokens >= 1
        assert httpx.get(f"{live.url}/health").status_code == 200


@pytest.mark.parametrize("chat", [False, True])
def test_pre_encoded_content_event_is_the_chunk_byte_for_byte(chat):
    """The per-token event built from encoded-once bytes equals encoding the chunk whole, for text
    that JSON must escape, and with the stand-in character inside the client's model name."""
    from phaselens.reference_server.serving.responses import Envelope
    from phaselens.reference_server.serving.sse import encode_event

    envelope = Envelope("cmpl-1", 'tiny "\x00" model', chat, prompt_tokens=3)
    for text in ("a", ' "quoted"\n', "é ü 😀", "\x00", "\\"):
        assert envelope.delta_event("", text) == encode_event(envelope.chunk(content=text))
        assert json.loads(envelope.delta_event("", text)[6:])["model"] == 'tiny "\x00" model'
    assert envelope.delta_event("thinking", "x") == encode_event(envelope.chunk("thinking", "x"))
