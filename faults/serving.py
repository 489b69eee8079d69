"""The reference server for the serving faults: the tiny model, phaselens telemetry with its span-builder
child, under uvicorn on a loopback port in a thread of this process (so the scenarios can read the
engine's KV blocks and the telemetry's loss counters), exporting to a collector of the pipeline."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import uvicorn

from phaselens.common.process import LOOPBACK
from phaselens.instrumentation.pipeline import Counters

if TYPE_CHECKING:  # imported by start(): the model and the server load only when a scenario runs
    from phaselens.instrumentation import ServerTelemetry
    from phaselens.reference_server.engine.engine import Engine

_OTEL_ENV = {
    "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "none",
    "OTEL_LOGS_EXPORTER": "none",
    "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    "OTEL_BSP_SCHEDULE_DELAY": "200",
}


def set_otel_env(grpc_endpoint: str) -> dict[str, str | None]:
    """OTEL_* pointing at `grpc_endpoint` (the span-builder child, and each replacement of it, reads
    them when it starts); returns what they were, for restore_env."""
    wanted = {**_OTEL_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{grpc_endpoint}"}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    return saved


def restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@dataclass(slots=True)
class Reply:
    trace_id: str
    status: int  # HTTP status, 0 when the connection failed
    latency_s: float
    error: str = ""  # the transport error's class when status is 0, e.g. ReadError


@dataclass(slots=True)
class ServingRig:
    grpc_endpoint: str
    service: str
    max_num_seqs: int = 8
    max_waiting: int = 1024
    engine: Engine = field(init=False)  # these four: set by start()
    telemetry: ServerTelemetry = field(init=False)
    url: str = field(default="", init=False)
    _server: uvicorn.Server = field(init=False)
    _thread: threading.Thread = field(init=False)
    _saved_env: dict = field(default_factory=dict, init=False)

    def start(self) -> ServingRig:
        from phaselens.instrumentation import ServerTelemetry
        from phaselens.instrumentation.pipeline import configure
        from phaselens.reference_server.engine.config import EngineConfig
        from phaselens.reference_server.engine.engine import Engine
        from phaselens.reference_server.serve import bind
        from phaselens.reference_server.serving.api import ApiSettings, create_app

        self.engine = Engine(EngineConfig(max_num_seqs=self.max_num_seqs, max_waiting=self.max_waiting))
        self._saved_env = set_otel_env(self.grpc_endpoint)  # until stop(): a replaced child reads them too
        providers = configure(self.service, set_global=False)  # not global: tests share this process
        self.telemetry = ServerTelemetry(
            providers.tracer_provider,
            providers.meter_provider,
            owns_providers=True,
            builder="process",
            service_name=self.service,
        )
        self.engine.step_observer = self.telemetry.step_observer
        sock = bind(LOOPBACK, 0)
        self.url = f"http://{LOOPBACK}:{sock.getsockname()[1]}"
        app = create_app(self.engine, ApiSettings(served_model_names=("tiny",)), self.telemetry)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="error", access_log=False))
        self.engine.start()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[sock])), name="fault-server", daemon=True
        )
        self._thread.start()
        started = time.monotonic()
        while not self._server.started and time.monotonic() - started < 30:
            time.sleep(0.02)
        return self

    def kv_blocks_used(self) -> int:
        return self.engine.scheduler.blocks.num_used

    def stop(self) -> Counters:
        """Stops serving; returns the telemetry's counters after everything was flushed."""
        self._server.should_exit = True
        self._thread.join(15)
        self.engine.stop()
        self.telemetry.flush(15)
        stats = self.telemetry.stats()
        self.telemetry.shutdown()
        restore_env(self._saved_env)
        return stats


def request(max_tokens: int) -> tuple[str, dict, dict]:
    """(trace id, headers, body) of a streamed completion of exactly `max_tokens`, in a trace of our own."""
    trace_id = secrets.token_hex(16)
    body = {"model": "tiny", "prompt": "fault suite", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    return trace_id, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}, body


def complete(client: httpx.Client, url: str, max_tokens: int = 8) -> Reply:
    """One streamed completion, read to its end."""
    trace_id, headers, body = request(max_tokens)
    started = time.monotonic()
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            for _ in r.iter_bytes():
                pass
            status = r.status_code
    except httpx.HTTPError as e:
        return Reply(trace_id, 0, time.monotonic() - started, type(e).__name__)
    return Reply(trace_id, status, time.monotonic() - started)


def leave_after_first_chunk(url: str, max_tokens: int) -> str:
    """A streamed completion whose client goes away after the first chunk; returns its trace id."""
    trace_id, headers, body = request(max_tokens)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            next(r.iter_bytes())
    return trace_id


@dataclass(slots=True)
class ClosedLoop:
    """`clients` threads, each sending the next request when the last one ended, until stop()."""

    url: str
    clients: int = 2
    max_tokens: int = 8
    max_s: float = 600.0
    replies: list[Reply] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False)

    def start(self) -> ClosedLoop:
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def _client(self) -> None:
        started = time.monotonic()
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set() and time.monotonic() - started < self.max_s:
                self.replies.append(complete(client, self.url, self.max_tokens))

    def stop(self) -> list[Reply]:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        return self.replies
