"""The traced streaming client against a scripted SSE server on loopback with known timings.

Every stamp of the client is compared with the server's write stamps (one process, one event loop,
one monotonic clock): a chunk is stamped after its write and before the server's next write that
follows a sleep. The loop runs a socket's read callback (where the client stamps) before the timer
callback that resumes the writer, so no stall of a loaded machine can reorder the two; a client that
stamped a chunk at a later read, or at the end of the stream, cannot pass. The nominal script delays
are lower bounds (a sleep never ends early).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from phaselens.instrumentation import names as N
from phaselens.instrumentation.client.traced_client import TracedClient
from phaselens.loadgen.scripted_server import Reply, ScriptedServer, Step, chat_chunk, completion_chunk, usage_chunk
from phaselens.reference_server.serving.sse import DONE_EVENT, encode_event


@pytest.fixture()
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def run_against(handler, endpoint, payload, tracer_provider=None, **client_kw):
    async def main():
        async with ScriptedServer(handler) as server:
            async with TracedClient(server.url, tracer_provider=tracer_provider, **client_kw) as client:
                called_ns = time.perf_counter_ns()
                result = await client.stream(endpoint, payload)
                assert called_ns <= result.sent_ts  # stamped by this request, not before it
                return result, server.requests

    return asyncio.run(main())


def scripted(*steps, status=200, body=b"", abort=False):
    async def handler(request):
        return Reply(status=status, steps=list(steps), body=body, abort=abort)

    return handler


def near(actual_ms, srv, i):
    """The client stamp of the chunk written at `srv[i]` (ms after the client's send) is at or after
    that write and before the next one, `srv[i + 1]`, which must follow a sleep."""
    return srv[i] <= actual_ms < srv[i + 1]


CHAT = [  # (delay ms, chunk): role-only, reasoning, empty, content, 3 tokens at once, last, usage
    Step(20, chat_chunk(role="assistant")),
    Step(30, chat_chunk(reasoning="Let me think")),
    Step(20, chat_chunk(content="")),
    Step(10, chat_chunk(content="Hello")),
    Step(
        20,
        encode_event(
            {
                "id": "c1",
                "model": "m",
                "usage": {"completion_tokens": 5},
                "choices": [{"index": 0, "delta": {"content": " big chunk"}, "finish_reason": None}],
            }
        ),
    ),
    Step(20, chat_chunk(content="!", finish="stop")),
    Step(10, usage_chunk(7, 6, reasoning_tokens=1) + DONE_EVENT),
]


def test_chat_stream_metrics_match_the_script(spans):
    provider, exporter = spans
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.5}
    r, requests = run_against(scripted(*CHAT), "chat", payload, provider)
    srv = [(t - r.sent_ts) / 1e6 for t in requests[0].sent_ts]  # server write times, ms after sent
    assert r.ok and r.status == 200 and r.saw_done and r.sent_ts <= requests[0].received_ts
    # role-only chunk (srv[0]) and empty chunk (srv[2]) are not content
    assert r.chunk_tokens == [1, 1, 3, 1]
    assert [near((c - r.sent_ts) / 1e6, srv, i) for c, i in zip(r.chunk_ts, (1, 3, 4, 5), strict=True)] == [True] * 4
    assert near(r.ttft_ms, srv, 1) and r.ttft_ms >= 50
    assert near(r.ttfo_ms, srv, 3) and r.ttfo_ms >= 80
    assert near(r.e2e_ms, srv, 5) and r.e2e_ms >= 120
    assert (r.input_tokens, r.output_tokens, r.reasoning_tokens, r.counted_tokens) == (7, 6, 1, 6)
    assert r.usage_mismatch == 0
    assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / 5, rel=1e-12)
    assert r.itl_ms == pytest.approx([(b - a) / 1e6 for a, b in itertools.pairwise(r.chunk_ts)], rel=1e-12)
    assert r.itl_per_token_ms == pytest.approx([r.itl_ms[0], r.itl_ms[1] / 3, r.itl_ms[2]])
    assert r.finish_reasons == ["stop"] and r.response_model == "scripted"
    _check_span(exporter.get_finished_spans(), r, requests[0].headers)


def _check_span(finished, r, headers):
    (span,) = finished
    assert span.name == "chat m" and span.kind == SpanKind.CLIENT
    assert span.status.status_code == StatusCode.UNSET
    ctx = span.get_span_context()
    # W3C level 1 flags on the wire: the sampled bit alone, though the span's own flags carry the
    # SDK's random-trace-id bit too (strict propagators, Dynamo's, refuse `03`)
    assert (int(ctx.trace_flags), headers["traceparent"]) == (3, f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01")
    assert (r.trace_id, r.span_id) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")
    assert span.start_time == r.sent_wall_ts and span.end_time - span.start_time == r.done_ts - r.sent_ts
    events = {e.name: e.timestamp - span.start_time for e in span.events}
    assert events == {
        N.EVENT_FIRST_CHUNK: r.first_chunk_ts - r.sent_ts,
        N.EVENT_FIRST_OUTPUT: r.first_output_ts - r.sent_ts,
        N.EVENT_LAST_CHUNK: r.last_chunk_ts - r.sent_ts,
    }
    a = span.attributes
    assert (
        a[N.GEN_AI_OPERATION_NAME],
        a[N.GEN_AI_REQUEST_MODEL],
        a[N.GEN_AI_REQUEST_MAX_TOKENS],
        a[N.GEN_AI_REQUEST_TEMPERATURE],
        a[N.GEN_AI_REQUEST_STREAM],
    ) == ("chat", "m", 6, 0.5, True)
    assert (a[N.SERVER_ADDRESS], a[N.GEN_AI_PROVIDER_NAME]) == ("127.0.0.1", "openai")
    assert (a[N.GEN_AI_USAGE_INPUT_TOKENS], a[N.GEN_AI_USAGE_OUTPUT_TOKENS]) == (7, 6)
    assert a[N.GEN_AI_USAGE_REASONING_OUTPUT_TOKENS] == 1
    assert a[N.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",) and a[N.GEN_AI_RESPONSE_ID] == "chatcmpl-scripted"
    assert a[N.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(r.ttft_ms / 1e3)
    assert (a[N.PL_CLIENT_TTFT_MS], a[N.PL_CLIENT_TTFO_MS], a[N.PL_CLIENT_TPOT_MS], a[N.PL_CLIENT_E2E_MS]) == (
        r.ttft_ms,
        r.ttfo_ms,
        r.tpot_ms,
        r.e2e_ms,
    )
    assert a[N.PL_CLIENT_ITL_MAX_MS] == max(r.itl_ms)
    assert a[N.PL_CLIENT_ITL_P50_MS] == sorted(r.itl_ms)[1]
    assert a[N.PL_CLIENT_ITL_TOKEN_P50_MS] == sorted(r.itl_per_token_ms)[1]
    assert (a[N.PL_CLIENT_CHUNKS], a[N.PL_CLIENT_COUNTED_TOKENS], a[N.PL_CLIENT_USAGE_MISMATCH]) == (4, 6, 0)
    assert a[N.PL_CLIENT_SENT_WALL_NS] == span.start_time and a[N.PL_CLIENT_DONE_WALL_NS] == span.end_time
    assert N.ERROR_TYPE not in a and N.GEN_AI_INPUT_MESSAGES not in a  # no content without opt-in


def test_completions_slow_start_and_usage_mismatch():
    steps = [
        Step(150, completion_chunk("a")),
        *(Step(10, completion_chunk("b")) for _ in range(3)),
        Step(10, completion_chunk("", finish="length")),
        Step(0, usage_chunk(3, 10) + DONE_EVENT),
    ]
    r, requests = run_against(scripted(*steps), "completions", {"model": "m", "prompt": "x", "max_tokens": 10})
    assert requests[0].path == "/v1/completions"
    assert requests[0].body["stream"] is True and requests[0].body["stream_options"] == {"include_usage": True}
    srv = [(t - r.sent_ts) / 1e6 for t in requests[0].sent_ts]
    assert near(r.ttft_ms, srv, 0) and r.ttft_ms >= 150
    assert r.ttfo_ms == r.ttft_ms  # no reasoning: TTFO = TTFT
    assert (r.counted_tokens, r.output_tokens, r.usage_mismatch) == (4, 10, 6)
    assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / 9, rel=1e-12)  # usage tokens, not counted
    assert near(r.e2e_ms, srv, 3) and r.finish_reasons == ["length"]


def test_pluggable_token_counter_sets_tokens_per_chunk():
    steps = [
        Step(0, completion_chunk("one two")),
        Step(10, completion_chunk("three four five")),
        Step(0, completion_chunk("", finish="stop") + DONE_EVENT),
    ]
    r, _ = run_against(
        scripted(*steps),
        "completions",
        {"model": "m", "prompt": "x"},
        token_counter=lambda text: len(text.split()),
        keep_text=True,
    )
    assert r.chunk_tokens == [2, 3] and r.counted_tokens == 5 and r.output_tokens is None
    assert r.chunk_text == ["one two", "three four five"]
    assert r.itl_per_token_ms == pytest.approx([r.itl_ms[0] / 3])
    assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / 4)


def test_usage_on_the_last_content_chunk_counts_its_tokens():
    steps = [
        Step(0, completion_chunk("a")),
        Step(5, completion_chunk("b")),
        Step(5, completion_chunk("cd", finish="stop", usage={"prompt_tokens": 2, "completion_tokens": 4}) + DONE_EVENT),
    ]
    r, _ = run_against(scripted(*steps), "completions", {"model": "m", "prompt": "x"})
    assert (r.chunk_tokens, r.output_tokens, r.input_tokens, r.usage_mismatch) == ([1, 1, 2], 4, 2, 0)
    assert r.itl_per_token_ms == pytest.approx([r.itl_ms[0], r.itl_ms[1] / 2])


def test_content_capture_is_opt_in(spans, monkeypatch):
    monkeypatch.setenv(N.ENV_CAPTURE_CONTENT, "true")
    provider, exporter = spans
    run_against(
        scripted(Step(0, completion_chunk("hey", finish="stop") + DONE_EVENT)),
        "completions",
        {"model": "m", "prompt": "secret"},
        provider,
    )
    attrs = exporter.get_finished_spans()[0].attributes
    assert json.loads(attrs[N.GEN_AI_INPUT_MESSAGES]) == "secret"
    assert json.loads(attrs[N.GEN_AI_OUTPUT_MESSAGES]) == "hey"


ERROR_BODY = json.dumps({"error": {"message": "max_tokens too large", "type": "invalid_request_error"}}).encode()


@pytest.mark.parametrize(
    "handler, error_type, status",
    [
        (scripted(status=400, body=ERROR_BODY), "invalid_request_error", 400),
        (scripted(status=503, body=b"upstream down"), "503", 503),
        (
            scripted(
                Step(0, completion_chunk("a")),
                Step(10, encode_event({"error": {"message": "OOM", "type": "server_error"}})),
            ),
            "server_error",
            200,
        ),
        (
            scripted(
                Step(0, completion_chunk("a")),
                Step(0, b'event: error\ndata: {"object": "error", "message": "boom", "type": "engine_dead"}\n\n'),
            ),
            "engine_dead",
            200,
        ),
        (scripted(Step(0, completion_chunk("a")), Step(0, b"<html>502</html>\n\n")), "malformed_sse", 200),
        (scripted(Step(0, b"data: {not json\n\n")), "malformed_chunk", 200),
        (scripted(Step(0, completion_chunk("a")), abort=True), "connection_error", 200),
        (scripted(Step(0, completion_chunk("a"))), "truncated_stream", 200),
    ],
)
def test_errors_end_the_span_and_come_back_in_the_result(spans, handler, error_type, status):
    provider, exporter = spans
    r, _ = run_against(handler, "completions", {"model": "m", "prompt": "x"}, provider)
    assert (r.error_type, r.status, r.ok) == (error_type, status, False) and r.error
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR and span.attributes[N.ERROR_TYPE] == error_type


def test_timeout_is_a_result_not_an_exception():
    r, _ = run_against(
        scripted(Step(20000, completion_chunk("late"))), "completions", {"model": "m", "prompt": "x"}, timeout_s=0.2
    )
    # 10× the timeout: a timeout taken in the wrong unit or never armed is 20 s (the chunk's delay)
    assert r.error_type == "timeout" and 200 <= r.elapsed_ms < 2000
    assert r.ttft_ms is None and r.e2e_ms is None


def test_connection_refused_is_a_result(spans):
    provider, exporter = spans
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused

        async def main():
            async with TracedClient(f"http://127.0.0.1:{port}/v1", tracer_provider=provider) as client:
                return await client.stream("chat", {"model": "m", "messages": []})

        r = asyncio.run(main())
    assert r.error_type == "connection_error" and r.status == 0
    assert exporter.get_finished_spans()[0].attributes[N.SERVER_PORT] == port


def test_a_cancelled_stream_is_recorded_then_the_cancellation_goes_on(spans):
    provider, exporter = spans
    handler = scripted(Step(0, completion_chunk("a")), Step(5000, completion_chunk("b")))

    async def main():
        async with ScriptedServer(handler) as server, TracedClient(server.url, tracer_provider=provider) as client:
            task = asyncio.create_task(client.stream("completions", {"model": "m", "prompt": "x"}))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            try:  # an outer timeout still fires: the cancellation it sends is not swallowed
                async with asyncio.timeout(0.2):
                    await client.stream("completions", {"model": "m", "prompt": "y"})
            except TimeoutError:
                return "outer timeout fired"

    assert asyncio.run(main()) == "outer timeout fired"
    spans_ = exporter.get_finished_spans()
    assert [s.attributes[N.ERROR_TYPE] for s in spans_] == ["cancelled", "cancelled"]
    assert spans_[0].attributes[N.PL_CLIENT_CHUNKS] == 1  # the chunk before the cancel
    assert spans_[0].attributes[N.PL_CLIENT_TTFT_MS] > 0


def test_unknown_endpoint_is_a_programming_error():
    async def main():
        async with TracedClient("http://127.0.0.1:9") as client:
            await client.stream("embeddings", {})

    with pytest.raises(ValueError, match="endpoint"):
        asyncio.run(main())
