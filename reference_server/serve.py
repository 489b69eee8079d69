"""The `phaselens serve` process: engine + telemetry + HTTP server, READY line, clean shutdown.

Start-up order: load the model → start the engine loop → bind the socket (port 0 picks a free
one) → serve → print `READY server http://HOST:PORT` (https:// with TLS) once uvicorn accepts. SIGTERM/SIGINT stop
uvicorn gracefully; then the engine stops (requests still inside finish as aborted) and the
telemetry flushes its spans. Exit status 0.

Disaggregated serving (docs/disaggregation.md): `role` prefill or decode serves the same API with
the P/D routes (reference_server.pd.pd_api); a decode instance also listens for KV transfers on
`kv_port` (same host; no authentication, so only on loopback unless --insecure). Each instance's
spans carry its role and URL as resource attributes (`phaselens.pd.role`, `phaselens.pd.instance`),
which is how the analysis tells a trace's three span trees apart. `serve_router` runs the router.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import anyio
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from phaselens.common.exposure import check_exposure, is_loopback
from phaselens.common.ports import bind_reusable
from phaselens.common.tls import ServerTls
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath import enable_kernel_stamps
from phaselens.instrumentation.pipeline import tag_pd_resource
from phaselens.instrumentation.server import inbound_protocol
from phaselens.reference_server.engine.config import EngineConfig
from phaselens.reference_server.engine.engine import Engine
from phaselens.reference_server.engine.kv_transfer import KvReceiver
from phaselens.reference_server.pd.pd_api import (
    ROLE_DECODE,
    ROLE_PREFILL,
    ROLE_ROUTER,
    DecodeRoutes,
    PrefillRoutes,
    kv_handler,
)
from phaselens.reference_server.pd.pd_protocol import PROTOCOL_PHASELENS
from phaselens.reference_server.pd.pd_spans import PdSpans
from phaselens.reference_server.process.engine_client import EngineClient
from phaselens.reference_server.serving.api import ApiSettings, create_app

ENGINE_THREAD, ENGINE_PROCESS = "thread", "process"
ENGINE_MODES = (ENGINE_THREAD, ENGINE_PROCESS)


@dataclass(slots=True)
class ServeOptions:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    reasoning_tokens: int = 0
    auth_token: str | None = None
    insecure: bool = False
    tls: ServerTls | None = None  # HTTPS
    telemetry: bool = True
    served_model_names: tuple[str, ...] = ()  # empty: the --model argument as given
    role: str = ""  # "" colocated, or prefill | decode (disaggregated)
    kv_port: int = 0  # decode: the KV-transfer port (0 picks a free one)
    engine_mode: str = ENGINE_THREAD  # thread: beside the event loop; process: its own (docs/engine-process.md)


@dataclass(slots=True)
class RouterOptions:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    auth_token: str | None = None
    insecure: bool = False
    telemetry: bool = True
    pd_protocol: str = PROTOCOL_PHASELENS  # reference_server.pd_protocol


def model_names(options: ServeOptions, loaded_name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(served names, aliases), as vLLM names models: `--served-model-name` when given, else the
    `--model` argument exactly as typed (often a path, and harnesses send it back as typed), with
    the model's own name (a folder's base name) accepted too."""
    if options.served_model_names:
        return tuple(dict.fromkeys(options.served_model_names)), ()
    given = options.engine.model
    return (given,), (() if loaded_name == given else (loaded_name,))


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and an
    # accepted socket inherits proto 0 from `socket(family, SOCK_STREAM)`. Without it, Nagle holds a
    # response's first chunk until the client's delayed ACK (~40 ms on Linux) of the previous write.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        bind_reusable(sock, host, port, "HTTP")  # rebinds at once after a crash; a live owner still fails
    except OSError:
        sock.close()
        raise
    enable_kernel_stamps(sock)  # the inbound edge's kernel receive stamps (instrumentation/inbound.py)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(options: ServeOptions) -> int:
    check_exposure(options.host, options.auth_token, options.insecure)
    if options.role == ROLE_DECODE and not is_loopback(options.host) and not options.insecure:
        raise ValueError("the KV port of a decode instance has no authentication: --insecure to listen off loopback")
    tls_context = options.tls.ssl_context() if options.tls else None  # bad files fail before the model loads
    engine = _engine(options)  # loads the model: bad flags fail here, before anything starts
    sock = bind(options.host, options.port)
    if options.role:
        _pd_resource(options.role, _url(sock))
    telemetry = _telemetry() if options.telemetry else None
    if telemetry is not None:
        engine.step_observer = telemetry.step_observer
    spans = (
        PdSpans(telemetry.tracer_provider, telemetry.anchor) if telemetry is not None and options.role else PdSpans()
    )
    served, aliases = model_names(options, engine.model_name)
    settings = ApiSettings(
        served_model_names=served,
        model_aliases=aliases,
        reasoning_tokens=options.reasoning_tokens,
        auth_token=options.auth_token,
    )
    receiver, routes = _pd_routes(options, engine, spans) if isinstance(engine, Engine) else (None, None)
    app = create_app(engine, settings, telemetry, routes)
    on_loop = engine.attach if isinstance(engine, EngineClient) else engine.start
    try:
        asyncio.run(_run(app, sock, tls_context, telemetry, on_loop))
    finally:
        if receiver is not None:
            receiver.stop()
        engine.stop()
        sock.close()
        spans.shutdown()
        if telemetry is not None:
            telemetry.shutdown()
    return 0


def _engine(options: ServeOptions) -> Engine | EngineClient:
    """The thread engine, or the client of an engine process (colocated only: a P/D instance's KV
    send and receive live beside its engine's thread)."""
    if options.engine_mode not in ENGINE_MODES:
        raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {options.engine_mode!r}")
    if options.engine_mode == ENGINE_THREAD:
        return Engine(options.engine)
    if options.role:
        raise ValueError(f"--role {options.role} runs the engine thread: --engine process serves colocated only")
    return EngineClient(options.engine, observe_steps=options.telemetry)


def _pd_routes(options: ServeOptions, engine: Engine, spans: PdSpans):
    """(the KV receiver, the routes factory) of a P/D instance; (None, None) when colocated."""
    if options.role == ROLE_PREFILL:
        return None, lambda e, s, t: PrefillRoutes(e, s, t, spans)
    if options.role == ROLE_DECODE:
        receiver = KvReceiver(options.host, options.kv_port, kv_handler(engine, spans), check=engine.check_kv_header)
        receiver.start()
        return receiver, lambda e, s, t: DecodeRoutes(e, s, t, receiver.address)
    return None, None


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _pd_resource(role: str, url: str) -> None:
    """Tag every span of this process (and of its span-builder child, which reads the same
    environment) with its role and URL."""
    tag_pd_resource(os.environ, role, url)


def serve_router(options: RouterOptions) -> int:
    from phaselens.instrumentation.pipeline import StampedSpans, configure
    from phaselens.reference_server.pd.router import Router
    from phaselens.reference_server.pd.router_spans import RouterSpans

    check_exposure(options.host, options.auth_token, options.insecure)
    sock = bind(options.host, options.port)
    _pd_resource(ROLE_ROUTER, _url(sock))
    providers = configure(names.SERVER_SERVICE_NAME) if options.telemetry else None
    provider = providers.tracer_provider if providers is not None else None
    spans = StampedSpans(provider)
    router = Router(
        list(options.prefill),
        list(options.decode),
        RouterSpans(spans),
        options.auth_token,
        pd_protocol=options.pd_protocol,
    )
    try:
        asyncio.run(_run(router.app(), sock, None))
    finally:
        sock.close()
        spans.shutdown()
        if providers is not None:
            providers.shutdown()
    return 0


def _nothing() -> None:
    """No start-up step (the router)."""


def _telemetry():
    from phaselens.instrumentation import ServerTelemetry

    return ServerTelemetry.from_env(names.SERVER_SERVICE_NAME)


async def _run(
    app, sock: socket.socket, tls_context: ssl.SSLContext | None, telemetry=None, on_loop: Callable[[], None] = _nothing
) -> None:
    """Serve until a signal; `on_loop` first, on the loop (the engine's start, or its attachment)."""
    on_loop()
    # Each connection's HTTP protocol wrapped to stamp its reads (the inbound edge) when traced.
    http: type[asyncio.BaseProtocol] = AutoHTTPProtocol
    if telemetry is not None:
        http = inbound_protocol(AutoHTTPProtocol, telemetry.inbound)
    # uvicorn takes any protocol class; its annotation names only plain (non-buffered) ones
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        ssl_context_factory=(lambda *_: tls_context) if tls_context else None,
        http=cast(type[asyncio.Protocol], http),
    )
    await _warm_event_loop()
    server = uvicorn.Server(config)
    # uvicorn re-raises the signals it caught after shutdown; keep them from killing us mid-cleanup.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"READY server {'https' if tls_context else 'http'}://{shown}:{port}", flush=True)
    await task
    sys.stdout.flush()


async def _warm_event_loop() -> None:
    """Import what the first streamed response would import on the event loop: anyio loads its
    asyncio backend at the first task group (~60 ms here, ~300 ms on a busy machine), and every
    request arriving meanwhile waits in the kernel (measured: 7 of a burst of 8, 294 ms each)."""
    async with anyio.create_task_group():
        pass
