"""The server's edges in vLLM's API server: the first chunk's delivery and the inbound wait
(docs/vllm.md#the-first-chunk).

vLLM 0.32's API server adds ASGI middleware named by import path:

    vllm serve MODEL --otlp-traces-endpoint URL \\
        --middleware phaselens.integrations.vllm.middleware.FirstChunkMiddleware

For a generation request (POST /v1/completions, /v1/chat/completions) the middleware is phaselens's
ingress middleware (`instrumentation/server/asgi.py`) on the plugin's `ServerTelemetry`: it stamps
`received` when the API server's ASGI stack starts the request, opens the request's handle there
(the W3C trace context from the HTTP headers, the `X-Request-Id` header), stamps each body chunk
that carries output where it is handed to uvicorn's `send` (the first: `first_chunk`; the last:
`server_last_chunk`), and closes the handle when the response ends. The handle is current in `HTTP_REQUEST` while vLLM runs the request,
so the hooks join it to the engine-side request by vLLM's request id (`OutputProcessor.add_request`
runs in the request's task) and stamp `output_ready` when the request's task takes output that
renders text off vLLM's per-request stream (`RequestOutputCollector.get`). All stamps are the API
server's `time.monotonic_ns()`, the clock of the plugin's other stamps.

Other paths, and a vLLM where the plugin is off (unknown version, or no `--otlp-traces-endpoint`),
pass through untouched.

The inbound edge (kernel receive → the ASGI call) is read below the ASGI stack: `VllmInboundProtocol`
wraps uvicorn's own HTTP protocol (`instrumentation/server/inbound.py`), installed by the module the
`--middleware` path names (`middleware.py`, `use_inbound_protocol`).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Awaitable
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from phaselens.instrumentation import ServerTelemetry
from phaselens.instrumentation.hotpath import enable_kernel_stamps
from phaselens.instrumentation.server import (
    InboundProtocol,
    IngressMiddleware,
    Message,
    Receive,
    Scope,
    Send,
)

from . import hooks
from .http_request import HTTP_REQUEST, MIDDLEWARE_PATH

__all__ = ["MIDDLEWARE_PATH", "FirstChunkMiddleware", "sse_carries_content", "use_inbound_protocol"]
UVICORN_AUTO_HTTP = "uvicorn.protocols.http.auto:AutoHTTPProtocol"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # vLLM sets it from --otlp-traces-endpoint
CONTENT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls")  # a chat delta's output
SSE_DATA, SSE_DONE = b"data: ", b"data: [DONE]"
# a non-empty string of output, as vLLM's compact JSON writes it: a key's quote and a value's
# opening quote, then anything but the closing quote (inside a JSON string a quote is escaped)
CONTENT_MARKS = tuple(f'"{key}":"'.encode() for key in ("text", "content", "reasoning_content", "reasoning"))


def sse_carries_content(message: Message) -> bool:
    """Whether an SSE body chunk of vLLM's completions or chat stream carries output: a choice with
    non-empty `text`, or a delta with content, reasoning or tool calls (not a role-only chunk, not
    the empty-text chunk of a token that renders no text yet); a whole JSON answer (not streamed)
    always does: it is the output. Called only between `output_ready` and the first such chunk:
    once or twice per request. A chunk with a non-empty text or content string in vLLM's compact
    JSON is found by its bytes (`CONTENT_MARKS`); any other is parsed."""
    body = message.get("body") or b""
    if body.startswith(b"{") or _marked_content(body):
        return True
    for line in body.split(b"\n"):
        if not line.startswith(SSE_DATA) or line.startswith(SSE_DONE):
            continue
        try:
            event = json.loads(line[len(SSE_DATA) :])
        except ValueError:
            continue
        for choice in event.get("choices") or () if isinstance(event, dict) else ():
            delta = choice.get("delta") or {}
            if choice.get("text") or any(delta.get(key) for key in CONTENT_KEYS):
                return True
    return False


def _marked_content(body: bytes) -> bool:
    """Whether a `CONTENT_MARKS` key holds a non-empty string: `"text":"` not followed by `"`."""
    for mark in CONTENT_MARKS:
        at = body.find(mark)
        while at >= 0:
            end = at + len(mark)
            if body[end : end + 1] != b'"':
                return True
            at = body.find(mark, end)
    return False


def traced_telemetry() -> ServerTelemetry | None:
    """The plugin's telemetry in this process while the plugin traces (installed, vLLM started with
    `--otlp-traces-endpoint`, not idle), else None."""
    if not hooks.installed() or not os.environ.get(TRACES_ENDPOINT) or hooks.tracker().idle_reason:
        return None
    return hooks.tracker().telemetry


class FirstChunkMiddleware:
    """The ASGI middleware vLLM's `--middleware` instantiates with the app (module docstring).

    A call returns the awaitable that serves the request (vLLM's app's, or the ingress middleware's
    around it), not a coroutine of its own: a coroutine here would be one more frame resumed at every
    await of the request (each output it waits for). The ingress middleware holds the handle in
    `HTTP_REQUEST` while vLLM's app runs and calls `hooks.http_done` when it ends."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._ingress: IngressMiddleware | None = None
        self._traced: ServerTelemetry | None = None  # the telemetry the ingress middleware was made for

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        telemetry = self._telemetry() if scope.get("type") == "http" else None
        if telemetry is None:
            return self.app(scope, receive, send)
        if scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            telemetry.inbound.discard(scope.get("client"))  # its read is not a generation request's
            return self.app(scope, receive, send)
        if self._ingress is None:
            self._ingress = IngressMiddleware(
                self.app, telemetry, sse_carries_content, current=HTTP_REQUEST, ended=hooks.http_done
            )
            self._traced = telemetry
        return self._ingress(scope, receive, send)

    def _telemetry(self) -> ServerTelemetry | None:
        """`traced_telemetry()`, its installation and environment read once they hold (they do not
        change in a running server: ~5k instructions a request less); only going idle is asked each time."""
        if self._traced is None:
            return traced_telemetry()
        return None if hooks.tracker().idle_reason else self._traced


class VllmInboundProtocol(InboundProtocol):
    """uvicorn's own HTTP protocol for vLLM's API server, each read stamped into the plugin's
    telemetry (`instrumentation/server/inbound.py`: the kernel's receive stamp, the loop's read) while
    the plugin traces; otherwise it only hands the bytes on."""

    inner_class = AutoHTTPProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        telemetry = traced_telemetry()
        if telemetry is None:  # no stamps: `_peer` stays empty and no stamper is made
            self.inner.connection_made(transport)
            return
        self.stamps = telemetry.inbound
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer:
            super().connection_lost(exc)
        else:
            self.inner.connection_lost(exc)


def use_inbound_protocol() -> bool:
    """Make uvicorn's `http="auto"` (what vLLM's API server asks for) `VllmInboundProtocol` in this
    process, and keep the kernel stamping received packets (`keep_kernel_stamps`); True when done.
    vLLM offers no setting for uvicorn's protocol, so this changes uvicorn's table of protocol names
    (`uvicorn.config.HTTP_PROTOCOLS`), and only while it holds uvicorn's own default."""
    from uvicorn import config

    if config.HTTP_PROTOCOLS.get("auto") != UVICORN_AUTO_HTTP:
        return False
    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:{VllmInboundProtocol.__qualname__}"
    keep_kernel_stamps()
    return True


_stamps_holder: list[socket.socket] = []  # the socket `keep_kernel_stamps` holds, for the process's life


def keep_kernel_stamps() -> bool:
    """Hold one socket that asks for receive stamps (a UDP socket, never bound). Linux stamps every
    received packet while any socket asks, and turns that on lazily, after the ask: the first
    packets of a request on a new connection, queued before the server accepts it, carry no stamp
    when no socket asked before (their `inbound` unobserved; the first request after a quiet spell,
    as the first connection's ask came too late). The reference server asks on its listener; vLLM's
    listener is not ours, so the API server holds this one. True when the kernel took the ask."""
    if not _stamps_holder:
        holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if not enable_kernel_stamps(holder):
            holder.close()
            return False
        _stamps_holder.append(holder)
    return True
