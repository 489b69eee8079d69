"""The engine in its own process (`phaselens serve --engine process`, reference_server.process.engine_client
and engine_core): the same outputs as the thread engine, the budget identity exact with stamps from
two processes, and an engine process killed mid-stream failing its clients without a hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.observer import NULL_REQUEST
from phaselens.instrumentation.pipeline.sink import wait_until
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from phaselens.reference_server import Engine, EngineConfig, SamplingParams, SeqOutput
from phaselens.reference_server.process.engine_client import EngineClient
from phaselens.reference_server.serve import ServeOptions, _engine, bind
from phaselens.reference_server.serving.api import ApiSettings, create_app

PROMPTS = [[40 + i + j % 50 for j in range(8 + 37 * i)] for i in range(6)]
PARAMS = [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.0, stop=("e",)),
    SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=7),
]


def _thread_outputs() -> list[str]:
    engine = Engine(EngineConfig(max_num_seqs=4))
    texts: list[list[str]] = [[] for _ in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        engine.submit(prompt, PARAMS[i % len(PARAMS)], sink=lambda out, t=texts[i]: t.append(out.content))
    while engine.scheduler.has_work() or engine.num_waiting:
        engine.step()
    return ["".join(t) for t in texts]


async def _process_outputs(client: EngineClient) -> list[str]:
    client.attach()
    texts: list[list[str]] = [[] for _ in PROMPTS]
    finished = asyncio.Semaphore(0)

    def sink(out: SeqOutput, text: list[str]) -> None:
        text.append(out.content)
        if out.finish_reason:
            finished.release()

    for i, prompt in enumerate(PROMPTS):
        client.submit(prompt, PARAMS[i % len(PARAMS)], NULL_REQUEST, lambda out, t=texts[i]: sink(out, t))
    for _ in PROMPTS:
        await asyncio.wait_for(finished.acquire(), 60)
    return ["".join(t) for t in texts]


def test_outputs_are_the_thread_engines_greedy_stop_and_seeded():
    client = EngineClient(EngineConfig(max_num_seqs=4))
    try:
        assert client.vocab_size == 384 and client.max_model_len == 4096 and client.model_name == "tiny"
        got = asyncio.run(_process_outputs(client))
    finally:
        client.stop()
    assert client._proc.returncode == 0  # asked to stop: exited by itself
    want = _thread_outputs()
    assert got == want and all(want)
    assert len(got[0]) == 24  # greedy, EOS ignored: one visible character per token


def test_a_model_the_engine_process_cannot_load_is_a_clear_error_and_the_child_is_reaped():
    """The config is checked here; the load fails there (no CUDA on this machine): its message."""
    if torch_cuda_available():
        pytest.skip("a CUDA device is present: --device cuda loads")
    before = _children(os.getpid())
    with pytest.raises(ValueError, match="no CUDA device"):
        EngineClient(EngineConfig(device="cuda"))
    assert _children(os.getpid()) == before  # no engine child left, not even a zombie


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_prefill_or_decode_instance_runs_the_thread_engine():
    options = ServeOptions(engine=EngineConfig(), role="prefill", engine_mode="process")
    with pytest.raises(ValueError, match="colocated only"):
        _engine(options)


@pytest.fixture(scope="module")
def traced_server():
    """The app over an engine process, traced into memory (the thread span builder)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = ServerTelemetry(provider, MeterProvider())
    client = EngineClient(EngineConfig(max_num_seqs=4), observe_steps=True)
    client.step_observer = telemetry.step_observer
    sock = bind("127.0.0.1", 0)
    app = create_app(client, ApiSettings(served_model_names=("tiny",)), telemetry)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))

    async def serve() -> None:
        client.attach()
        await server.serve(sockets=[sock])

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", telemetry, exporter
    server.should_exit = True
    thread.join(10)
    client.stop()
    sock.close()
    telemetry.shutdown()


def _stream(url: str, max_tokens: int) -> list[dict]:
    body = {"model": "tiny", "prompt": "x" * 120, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]


def test_budget_identity_is_exact_with_stamps_from_both_processes(traced_server):
    url, telemetry, exporter = traced_server
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: _stream(url, 12), range(4)))
    assert [r[-1]["choices"][0]["finish_reason"] for r in replies] == ["length"] * 4
    # a client can read the last chunk before the app returns and the server closes the request
    assert wait_until(lambda: _closed(telemetry) == 4, 30), telemetry.stats()
    assert telemetry.flush(30)
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(servers) == 4
    for span in servers:
        a = span.attributes
        terms = [a[names.PL_INGRESS_MS], a[names.PL_QUEUE_MS], a[names.PL_PREFILL_MS], a[names.PL_FIRST_TOKEN_MS]]
        assert all(term >= 0 for term in terms), terms
        assert sum(terms) == pytest.approx(a[names.PL_SERVER_TTFT_MS], abs=1e-6)  # exact to the ns
        assert a[names.PL_PREFILL_MS] > 0 and a[names.PL_FIRST_TOKEN_MS] > 0  # the engine's chunk, the hop back
        ttfc = a[names.PL_SERVER_TTFT_MS] + a.get(names.PL_HELD_BACK_MS, 0.0) + a[names.PL_FIRST_CHUNK_MS]
        assert a[names.PL_SERVER_TTFC_MS] == pytest.approx(ttfc, abs=1e-6)
    # engine steps, logged in the engine process, link the requests' SERVER spans in their traces
    server_ids = {(s.context.trace_id, s.context.span_id) for s in servers}
    steps = [s for s in spans if s.name == names.SPAN_ENGINE_STEP]
    linked = {(link.context.trace_id, link.context.span_id) for s in steps for link in s.links}
    assert steps and linked == server_ids


def _closed(telemetry: ServerTelemetry) -> int:
    """Requests the server has closed: handed to the span builder, or waiting for the engine."""
    stats = telemetry.stats()
    return stats.requests_offered + stats.requests_pending


def _proc_state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie, not reaped), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _children(pid: int) -> list[int]:
    """Every thread's children (a zombie stays listed until it is reaped)."""
    return sorted(
        int(p) for task in os.listdir(f"/proc/{pid}/task") for p in _read(f"/proc/{pid}/task/{task}/children")
    )


def _read(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


def test_engine_process_killed_mid_stream_fails_the_clients_and_is_reaped():
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    argv = [sys.executable, "-m", "phaselens", "serve", "--engine", "process", "--port", "0", "--max-num-seqs", "4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY server http://127.0.0.1:"), line
        url = line.split()[-1]
        health = httpx.get(f"{url}/health", timeout=10).json()
        engine_pid = health["engine_pid"]
        assert health["status"] == "ok" and engine_pid in _children(proc.pid)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
            lines = reply.iter_lines()
            for text in lines:  # wait for text: the request is decoding in the engine process
                if text.startswith("data: {") and json.loads(text[6:])["choices"][0]["text"]:
                    break
            os.kill(engine_pid, signal.SIGKILL)
            started = time.monotonic()
            events = [text for text in lines if text.startswith("data: ")]  # ends: no hang (timeout 30 s)
        assert time.monotonic() - started < 10
        error = json.loads(next(e[6:] for e in events if '"error"' in e))["error"]
        assert error["code"] == "engine_error" and "killed by signal 9" in error["message"], error
        deadline = time.monotonic() + 10
        while _proc_state(engine_pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _proc_state(engine_pid) is None  # reaped by the server, not left a zombie
        reply = httpx.get(f"{url}/health", timeout=10)
        assert reply.status_code == 503 and reply.json()["status"] == "unhealthy"
        refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert all(_proc_state(pid) is None for pid in children)  # no orphan (the span builder included)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
