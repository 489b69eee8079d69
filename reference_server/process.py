"""The `phaselens serve` process: engine + telemetry + HTTP server, READY line, clean shutdown.

Start-up order: load the model → start the engine loop → bind the socket (port 0 picks a free
one) → serve → print `READY server http://HOST:PORT` once uvicorn accepts. SIGTERM/SIGINT stop
uvicorn gracefully; then the engine stops (requests still inside finish as aborted) and the
telemetry flushes its spans. Exit status 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from dataclasses import dataclass

import uvicorn

from phaselens.common.exposure import check_exposure
from phaselens.common.ports import bind_reusable
from phaselens.instrumentation import names
from phaselens.reference_server.api import ApiSettings, create_app
from phaselens.reference_server.config import EngineConfig
from phaselens.reference_server.engine import Engine


@dataclass(slots=True)
class ServeOptions:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    reasoning_tokens: int = 0
    auth_token: str | None = None
    insecure: bool = False
    telemetry: bool = True
    served_model_names: tuple[str, ...] = ()  # empty: the --model argument as given


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
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(options: ServeOptions) -> int:
    check_exposure(options.host, options.auth_token, options.insecure)
    engine = Engine(options.engine)  # loads the model: bad flags fail here, before anything starts
    sock = bind(options.host, options.port)
    telemetry = _telemetry() if options.telemetry else None
    if telemetry is not None:
        engine.step_observer = telemetry.step_observer
    served, aliases = model_names(options, engine.runner.loaded.name)
    settings = ApiSettings(
        served_model_names=served,
        model_aliases=aliases,
        reasoning_tokens=options.reasoning_tokens,
        auth_token=options.auth_token,
    )
    app = create_app(engine, settings, telemetry)
    engine.start()
    try:
        asyncio.run(_run(app, sock))
    finally:
        engine.stop()
        sock.close()
        if telemetry is not None:
            telemetry.shutdown()
    return 0


def _telemetry():
    from phaselens.instrumentation.server.telemetry import ServerTelemetry

    return ServerTelemetry.from_env(names.SERVER_SERVICE_NAME)


async def _run(app, sock: socket.socket) -> None:
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
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
        print(f"READY server http://{shown}:{port}", flush=True)
    await task
    sys.stdout.flush()
