"""A real HTTP hop: this test process is the traced client, a uvicorn server process on loopback
runs the ingress middleware and a scripted engine thread. With the thread builder it writes its
spans as JSON lines (the SDK's ConsoleSpanExporter into a file); with the process builder its
span-builder process exports them over OTLP/HTTP to a receiver in this test process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phaselens.instrumentation import names
from tests.instrumentation_fixtures import OtlpReceiver, otlp_span_as_json, process_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["thread", "process"])
def server(tmp_path_factory, request):
    spans_path = tmp_path_factory.mktemp("http") / "server_spans.jsonl"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    receiver = OtlpReceiver()
    with pytest.MonkeyPatch.context() as env:
        process_env(env, receiver)
        env.setenv("OTEL_SERVICE_NAME", "instrumentation-test-server")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.instrumentation_fixtures",
                str(sock.fileno()),
                str(spans_path),
                request.param,
            ],
            cwd=REPO,
            pass_fds=[sock.fileno()],
            stdout=subprocess.PIPE,
        )
    if request.param == "thread":

        def spans() -> list[dict]:
            return list(map(json.loads, spans_path.read_text().splitlines())) if spans_path.exists() else []
    else:

        def spans() -> list[dict]:
            return [otlp_span_as_json(span) for span in list(receiver.spans)]

    try:
        assert proc.stdout.readline().strip() == b"READY"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", spans
    finally:
        proc.terminate()
        proc.wait(10)
        sock.close()
        receiver.close()


def server_spans(spans_source, trace_id: str, want: int, timeout_s: float = 15) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spans = [s for s in spans_source() if s["context"]["trace_id"] == trace_id]
        if len(spans) >= want:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"server spans of {trace_id} did not arrive: {len(spans)}")


@pytest.fixture()
def client_tracer():
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    return provider.get_tracer("test-client")


def traced(tracer, call):
    """Run `call(headers)` inside a CLIENT span whose traceparent is in `headers`."""
    with tracer.start_as_current_span("text_completion tiny", kind=trace.SpanKind.CLIENT) as client_span:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        result = call(headers)
    context = client_span.get_span_context()
    return context, f"0x{context.trace_id:032x}", result


def read_stream(url, body, headers, lines=None):
    """POST a streaming request; read `lines` lines (all when None) and hang up."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        got = [
            line
            for _, line in zip(range(lines or 10**6), response.iter_lines(), strict=False)
            if line.startswith("data:")
        ]
    return response.status_code, got


def test_traceparent_continues_across_the_hop(server, client_tracer):
    url, spans_path = server
    context, trace_id, (status, chunks) = traced(client_tracer, lambda h: read_stream(url, {"max_tokens": 4}, h))
    assert status == 200 and len(chunks) == 5
    spans = {s["name"]: s for s in server_spans(spans_path, trace_id, want=8)}
    root = spans["text_completion tiny"]
    assert root["kind"] == "SpanKind.SERVER" and root["parent_id"] == f"0x{context.span_id:016x}"
    phase_spans = (*names.PHASE_SPANS, names.SPAN_FIRST_CHUNK)  # a streamed response: all of them
    assert set(phase_spans) <= set(spans)
    assert all(spans[name]["parent_id"] == root["context"]["span_id"] for name in phase_spans)
    attributes = root["attributes"]
    phases_ms = sum(
        attributes[k] for k in (names.PL_INGRESS_MS, names.PL_QUEUE_MS, names.PL_PREFILL_MS, names.PL_FIRST_TOKEN_MS)
    )
    assert phases_ms == pytest.approx(attributes[names.PL_SERVER_TTFT_MS], abs=1e-6)
    split_ms = sum(attributes[k] for k in (names.PL_FIRST_CHUNK_LOOP_WAIT_MS, names.PL_FIRST_CHUNK_ENCODE_MS))
    assert split_ms == pytest.approx(attributes[names.PL_FIRST_CHUNK_MS], abs=1e-6)
    assert attributes[names.PL_SERVER_TTFT_MS] + attributes[names.PL_FIRST_CHUNK_MS] == pytest.approx(
        attributes[names.PL_SERVER_TTFC_MS], abs=1e-6
    )
    assert attributes[names.PL_SERVER_TTFC_MS] <= attributes[names.PL_SERVER_LAST_CHUNK_MS]
    assert attributes[names.GEN_AI_USAGE_OUTPUT_TOKENS] == 4 and attributes[names.HTTP_RESPONSE_STATUS_CODE] == 200
    assert spans[names.SPAN_DECODE]["attributes"][names.PL_DECODE_STEPS] == 3


def test_bad_request_is_one_error_server_span(server, client_tracer):
    url, spans_path = server
    _, trace_id, response = traced(
        client_tracer, lambda h: httpx.post(f"{url}/v1/completions", json={"max_tokens": "many"}, headers=h)
    )
    assert response.status_code == 400
    spans = server_spans(spans_path, trace_id, want=2)
    (root,) = [s for s in spans if s["kind"] == "SpanKind.SERVER"]
    assert root["status"]["status_code"] == "ERROR"
    assert root["attributes"][names.ERROR_TYPE] == "invalid_request_error"


def test_client_disconnect_mid_stream(server, client_tracer):
    url, spans_path = server
    _, trace_id, (status, chunks) = traced(
        client_tracer, lambda h: read_stream(url, {"max_tokens": 200, "delay_s": 0.02}, h, lines=1)
    )  # one chunk, then hang up
    assert status == 200 and len(chunks) == 1
    spans = server_spans(spans_path, trace_id, want=7)
    (root,) = [s for s in spans if s["kind"] == "SpanKind.SERVER"]
    assert root["status"]["status_code"] == "ERROR"
    assert root["attributes"][names.ERROR_TYPE] == names.ERROR_CLIENT_DISCONNECTED
    assert root["attributes"][names.PL_CLIENT_DISCONNECTED] is True
    assert root["attributes"][names.PL_FINISH_REASON] == "abort"
    assert root["attributes"][names.GEN_AI_USAGE_OUTPUT_TOKENS] < 200
