"""The router speaking vLLM's P/D protocol (`--pd-protocol vllm`) to two instances that answer as
vLLM 0.32 does (real HTTP servers on loopback recording what they got): the prefill half with
`max_tokens` 1 and `do_remote_decode`, the decode half with the prefill answer's
`kv_transfer_params`, each with its hop's `traceparent` in the client's trace and one X-Request-ID."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phaselens.instrumentation import names
from phaselens.instrumentation.pipeline import StampedSpans
from phaselens.reference_server.pd.pd_protocol import PROTOCOL_VLLM
from phaselens.reference_server.pd.router import Router
from phaselens.reference_server.pd.router_spans import RouterSpans

KV_PARAMS = {"remote_engine_id": "e1", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 5600}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SSE = b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}]}\n\ndata: [DONE]\n\n'


class Instance(ThreadingHTTPServer):
    """Answers POSTs as a vLLM instance would and keeps (headers, body) of each."""

    def __init__(self, answer: bytes, content_type: str) -> None:
        self.got: list[tuple[dict[str, str], dict]] = []
        self.answer, self.content_type = answer, content_type
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        server: Instance = self.server  # type: ignore[assignment]
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        server.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.send_header("content-type", server.content_type)
        self.send_header("content-length", str(len(server.answer)))
        self.end_headers()
        self.wfile.write(server.answer)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def instances():
    answer = {"id": "cmpl-1", "choices": [{"index": 0, "text": "h", "finish_reason": "length"}]}
    prefill = Instance(json.dumps(answer | {"kv_transfer_params": KV_PARAMS}).encode(), "application/json")
    decode = Instance(SSE, "text/event-stream")
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (prefill, decode)]
    for t in threads:
        t.start()
    yield prefill, decode
    for s in (prefill, decode):
        s.shutdown()
        s.server_close()


def _route(prefill: Instance, decode: Instance, headers: dict[str, str]) -> tuple[httpx.Response, list]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = StampedSpans(provider)
    router = Router([prefill.url], [decode.url], RouterSpans(spans), pd_protocol=PROTOCOL_VLLM)
    body = {
        "model": "tiny",
        "prompt": "the queue",
        "max_tokens": 8,
        "min_tokens": 8,
        "stream": True,
        "stream_options": {},
    }

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=router.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            response = await client.post("/v1/completions", json=body, headers=headers)
        await router.client.aclose()
        return response

    response = asyncio.run(call())
    spans.shutdown()
    return response, exporter.get_finished_spans()


def test_prefill_half_asks_for_one_token_and_remote_decode_and_decode_half_gets_its_kv_params(instances):
    prefill, decode = instances
    response, _ = _route(prefill, decode, {})
    assert response.status_code == 200 and response.content == SSE
    (_, first), (_, second) = prefill.got[0], decode.got[0]
    assert first["max_tokens"] == 1 and first["stream"] is False and "stream_options" not in first
    assert "min_tokens" not in first and second["min_tokens"] == 8  # vLLM refuses min_tokens > max_tokens
    assert first["kv_transfer_params"]["do_remote_decode"] is True
    assert first["kv_transfer_params"]["do_remote_prefill"] is False
    assert second["kv_transfer_params"] == KV_PARAMS
    assert second["max_tokens"] == 8 and second["stream"] is True and second["prompt"] == "the queue"


def test_both_halves_carry_the_client_trace_and_one_request_id(instances):
    prefill, decode = instances
    traceparent = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
    _, spans = _route(prefill, decode, {"traceparent": traceparent, "x-request-id": "client-7"})
    (p_headers, _), (d_headers, _) = prefill.got[0], decode.got[0]
    assert p_headers["x-request-id"] == d_headers["x-request-id"] == "client-7"
    by_name = {s.name: s for s in spans}
    for headers, call in ((p_headers, names.SPAN_PD_PREFILL_CALL), (d_headers, names.SPAN_PD_DECODE_CALL)):
        _, trace_id, span_id, _ = headers["traceparent"].split("-")
        assert trace_id == CLIENT_TRACE
        assert int(span_id, 16) == by_name[call].context.span_id
    root = next(s for s in spans if s.parent is not None and s.parent.span_id == 0x00F067AA0BA902B7)
    assert root.attributes[names.HTTP_REQUEST_HEADER_X_REQUEST_ID] == ("client-7",)


def test_without_a_client_request_id_the_router_gives_both_halves_the_same_one(instances):
    prefill, decode = instances
    _route(prefill, decode, {})
    request_id = prefill.got[0][0]["x-request-id"]
    assert request_id and decode.got[0][0]["x-request-id"] == request_id
