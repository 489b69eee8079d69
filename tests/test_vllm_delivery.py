"""vLLM's first-chunk delivery without vLLM: which of vLLM's SSE chunks carry output, and the ingress
middleware stamping the first of them (not vLLM's role-only chat chunk or its empty-text completion
chunk sent after the output was taken). The live run is in tests/test_vllm.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from types import SimpleNamespace

import pytest
from opentelemetry.trace import SpanKind

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.kernel_stamps import KernelStamper
from phaselens.instrumentation.hotpath.records import RequestInfo
from phaselens.instrumentation.server.asgi import IngressMiddleware
from phaselens.instrumentation.server.telemetry import SCOPE_KEY
from phaselens.integrations.vllm import hooks
from phaselens.integrations.vllm.delivery import FirstChunkMiddleware, keep_kernel_stamps, sse_carries_content
from phaselens.integrations.vllm.http_request import HTTP_REQUEST
from phaselens.integrations.vllm.tracker import VllmTracker
from tests.instrumentation_fixtures import http_scope, make_rig


def sse(*events: dict | str, separators: tuple[str, str] | None = None) -> dict:
    """One ASGI body message as vLLM's StreamingResponse sends it: `data: JSON` events (vLLM's own
    JSON is compact: `separators=(",", ":")`)."""
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e, separators=separators)}\n\n" for e in events)
    return {"type": "http.response.body", "body": body.encode(), "more_body": True}


COMPACT = (",", ":")


ROLE_ONLY = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
CHAT_CONTENT = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
CHAT_REASONING = {"choices": [{"index": 0, "delta": {"reasoning_content": "so"}}]}
EMPTY_TEXT = {"choices": [{"index": 0, "text": "", "logprobs": None}]}  # a token that renders no text yet
TEXT = {"choices": [{"index": 0, "text": "é"}]}


@pytest.mark.parametrize(
    ("message", "carries"),
    [
        (sse(ROLE_ONLY), False),
        (sse(EMPTY_TEXT), False),
        (sse("[DONE]"), False),
        (sse({"choices": [], "usage": {"completion_tokens": 3}}), False),
        ({"type": "http.response.body", "body": b"data: {not json\n\n"}, False),
        ({"type": "http.response.body", "body": b"data: [1, 2]\n\n"}, False),
        ({"type": "http.response.body"}, False),
        (sse(CHAT_CONTENT), True),
        (sse(CHAT_REASONING), True),
        (sse(TEXT), True),
        (sse(ROLE_ONLY, CHAT_CONTENT), True),
        # vLLM's compact JSON, read by its bytes when it carries text
        (sse(ROLE_ONLY, separators=COMPACT), False),
        (sse(EMPTY_TEXT, separators=COMPACT), False),
        (sse(TEXT, separators=COMPACT), True),
        (sse(CHAT_CONTENT, separators=COMPACT), True),
        (sse(CHAT_REASONING, separators=COMPACT), True),
        (sse({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}, separators=COMPACT), True),
        (sse({"choices": [{"index": 0, "text": '"'}]}, separators=COMPACT), True),  # an escaped quote
        (sse({"choices": [{"index": 0, "text": ""}, {"index": 1, "text": "b"}]}, separators=COMPACT), True),
        (
            sse({"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ['"text":""']}}]}, separators=COMPACT),
            False,
        ),
        (sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "t"}]}}]}, separators=COMPACT), True),
        # a whole answer (not streamed), even one whose only token renders no text: a P/D prefill half
        ({"type": "http.response.body", "body": json.dumps(EMPTY_TEXT).encode()}, True),
    ],
)
def test_which_sse_chunks_carry_output(message, carries):
    assert sse_carries_content(message) is carries


def test_the_first_chunk_is_the_one_carrying_text_not_the_role_chunk_sent_before_it():
    """vLLM's chat stream sends the role-only chunk once it took the first output: with the check,
    `first_chunk` ends at the chunk with the text (held_back: the token before it rendered none)."""
    rig = make_rig()

    async def app(scope, receive, send):
        handle = rig.telemetry.request(scope)
        handle.describe(RequestInfo(names.OP_CHAT, "tiny", stream=True))
        handle.enqueued()
        handle.scheduled()
        rig.clock.advance(1_000_000)
        handle.first_token()  # a byte-level token: no text yet
        rig.clock.advance(2_000_000)
        handle.token()  # the token that completes the character
        rig.clock.advance(300_000)
        handle.output_ready(2)  # the request's task took the output with text
        await send({"type": "http.response.start", "status": 200, "headers": []})
        rig.clock.advance(100_000)
        await send(sse(ROLE_ONLY))
        rig.clock.advance(400_000)
        await send(sse(CHAT_CONTENT))
        rig.clock.advance(1_000_000)
        handle.token()
        handle.output_ready()  # later text: its chunk ends server_last_chunk
        rig.clock.advance(200_000)
        await send(sse(CHAT_CONTENT))
        handle.finished("stop")
        handle.complete(output_tokens=3, finish_reason="stop")
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        pass

    asyncio.run(IngressMiddleware(app, rig.telemetry, sse_carries_content)(http_scope(), receive, send))
    rig.telemetry.flush()
    (root,) = [s for s in rig.spans() if s.kind == SpanKind.SERVER]
    attributes = root.attributes
    assert attributes[names.PL_HELD_BACK_MS] == pytest.approx(2.0)
    assert attributes[names.PL_FIRST_CHUNK_LOOP_WAIT_MS] == pytest.approx(0.3)
    assert attributes[names.PL_FIRST_CHUNK_ENCODE_MS] == pytest.approx(0.5)  # to the content chunk
    assert attributes[names.PL_FIRST_CHUNK_MS] == pytest.approx(0.8)
    assert attributes[names.PL_SERVER_LAST_CHUNK_MS] == pytest.approx(attributes[names.PL_SERVER_TTFC_MS] + 1.2)


def test_the_middleware_passes_other_requests_through_untouched():
    """Without the plugin installed and tracing (this process has no vLLM), and for paths other than
    generation, vLLM's app gets the very scope, receive and send it would get without it."""
    seen = []

    async def app(scope, receive, send):
        seen.append((scope, receive, send))

    async def receive():
        return {"type": "http.request"}

    async def send(message):
        pass

    middleware = FirstChunkMiddleware(app)
    scopes = (http_scope("/health"), http_scope(), {"type": "lifespan"})
    for scope in scopes:
        asyncio.run(middleware(scope, receive, send))
    assert len(seen) == len(scopes)
    for scope, (got_scope, got_receive, got_send) in zip(scopes, seen, strict=True):
        assert got_scope is scope and got_receive is receive and got_send is send
        assert "phaselens.request" not in scope


def test_the_api_server_keeps_the_kernel_stamping_so_a_new_connections_first_request_has_one():
    """vLLM's listener never asks for receive stamps, and Linux turns stamping on only after the
    first ask: a request queued on a new connection before the server's per-connection stamper asks
    carried none (its inbound unobserved; the first request after a quiet spell). The API server
    holds one socket that asks (`keep_kernel_stamps`), so such a request, from a client that asks
    for none, has its stamp. (Without it this fails only while no other socket on the machine asks.)"""
    assert keep_kernel_stamps() and keep_kernel_stamps()  # once per process, then a no-op
    time.sleep(0.1)  # the kernel's lazy switch-on
    for _ in range(5):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        client.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
        accepted, _ = listener.accept()
        stamper = KernelStamper(accepted.fileno(), time.monotonic_ns)  # the server's, made at accept
        try:
            assert stamper.arrived_ts() > 0
        finally:
            stamper.close()
            for s in (client, accepted, listener):
                s.close()


def request_state(req_id: str, queued_s: float) -> SimpleNamespace:
    """A stand-in for vLLM 0.32's output-processor RequestState (vLLM is not importable in this
    virtualenv, and real vLLM cannot be made to hit these timings on demand): the fields the tracker
    reads, for a request the EngineCore queued at `queued_s` (or not yet, for 0) with no output yet."""
    stats = SimpleNamespace(
        arrival_time=time.time(), queued_ts=queued_s, scheduled_ts=0.0, first_token_ts=0.0, num_generation_tokens=0
    )
    return SimpleNamespace(
        request_id=req_id,
        external_req_id="cmpl-" + req_id,
        stats=stats,
        prompt_len=16,
        num_cached_tokens=0,
        lora_name=None,
        max_tokens_param=2000,
        temperature=1.0,
        top_p=1.0,
    )


def output_batch(processor, outputs: list) -> None:
    """One EngineCore output batch as vLLM's output handler hands it to the hooks (`hooks.tracker()`
    the test's): `process_outputs`, then `update_scheduler_stats`, vLLM's own methods doing nothing."""
    process = hooks.WRAPPERS["process_outputs"](lambda self, outputs, timestamp=None, iteration_stats=None: None)
    process(processor, outputs, time.monotonic(), None)
    hooks.WRAPPERS["update_scheduler_stats"](lambda self, scheduler_stats: None)(processor, None)


@pytest.mark.parametrize("vllm_aborts", [True, False], ids=["vllm-aborted-it", "vllm-runs-on"])
def test_a_request_whose_client_left_before_its_first_output_is_client_disconnected(vllm_aborts, monkeypatch):
    """The client goes away while vLLM adds its request (before any output): the HTTP request ends
    with the vLLM request claimed, not opened. It is closed as `client_disconnected`, finish reason
    `abort` — whether vLLM aborted it or, cancelled inside `add_request`, runs it on (then its later
    outputs and its finish open no second SERVER span)."""
    rig = make_rig()
    tracker = VllmTracker(rig.telemetry, "tiny")
    monkeypatch.setattr(hooks, "tracker", lambda: tracker)
    states: dict = {}
    processor = SimpleNamespace(request_states=states, tracing_enabled=True)

    async def app(scope, receive, send):  # vLLM's app as the plugin sees it, ended before any output
        states["r1"] = request_state("r1", queued_s=0.0)
        tracker.claim("r1", scope[SCOPE_KEY], states)
        if vllm_aborts:
            del states["r1"]  # AsyncLLM.abort: the output processor forgets it
        tracker.http_done(scope[SCOPE_KEY])  # what FirstChunkMiddleware does when the app returns

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        pass

    asyncio.run(IngressMiddleware(app, rig.telemetry, sse_carries_content)(http_scope(), receive, send))
    if not vllm_aborts:  # its outputs go on arriving, to its end
        output_batch(processor, [SimpleNamespace(request_id="r1", new_token_ids=[5], trace_headers=None)])
        tracker.finished(states.pop("r1"), "length")
    (root,) = [s for s in rig.spans() if s.kind == SpanKind.SERVER]
    assert root.attributes[names.ERROR_TYPE] == names.ERROR_CLIENT_DISCONNECTED
    assert root.attributes[names.PL_FINISH_REASON] == "abort"
    assert root.attributes[names.GEN_AI_REQUEST_MAX_TOKENS] == 2000  # described from vLLM's state


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_request_the_middleware_claimed_goes_to_the_engine_core_without_its_trace_headers(monkeypatch):
    """The middleware's handle holds the request's trace context, so the vLLM request it claims in
    `add_request` goes on to the EngineCore without trace headers (vLLM echoes them in every output
    of the request). One it does not claim keeps them, and its first output opens its handle from
    them: an n > 1 request's later children, a request run without the middleware. All three are
    children of the client's span."""
    rig = make_rig()
    tracker = VllmTracker(rig.telemetry, "tiny")
    monkeypatch.setattr(hooks, "tracker", lambda: tracker)

    class Processor:  # vLLM 0.32's OutputProcessor as the wrapper sees it (vLLM is not importable here)
        tracing_enabled = True

        def __init__(self) -> None:
            self.request_states: dict = {}

        def add_request(self, request, prompt=None):
            self.request_states[request.request_id] = request_state(request.request_id, queued_s=time.monotonic())

    Processor.add_request = hooks.WRAPPERS["add_request"](Processor.add_request)
    processor = Processor()
    headers = {"traceparent": TRACEPARENT}
    requests = [SimpleNamespace(request_id=f"r{i}", trace_headers=dict(headers)) for i in range(3)]
    handle = rig.telemetry.open_request(http_scope(traceparent=TRACEPARENT), managed=True)
    token = HTTP_REQUEST.set(handle)
    try:
        for request in requests[:2]:  # n = 2: the first child claims the handle
            processor.add_request(request)
    finally:
        HTTP_REQUEST.reset(token)
    processor.add_request(requests[2])  # not the middleware's request
    assert [r.trace_headers for r in requests] == [None, headers, headers]

    outputs = [
        SimpleNamespace(request_id=r.request_id, new_token_ids=[5], trace_headers=r.trace_headers) for r in requests
    ]
    output_batch(processor, outputs)
    for request in requests:
        tracker.finished(processor.request_states.pop(request.request_id), "length")
    handle.close()
    rig.telemetry.flush()
    roots = [s for s in rig.spans() if s.kind == SpanKind.SERVER]
    _, trace_id, parent_id, _ = TRACEPARENT.split("-")
    assert len(roots) == 3
    assert {(s.context.trace_id, s.parent.span_id) for s in roots} == {(int(trace_id, 16), int(parent_id, 16))}
    assert handle.root.span_id in {s.context.span_id for s in roots}  # the claimed one is the middleware's
