"""Ingress middleware (pure ASGI): the server's `received` and `responded` stamps.

For each HTTP request it stamps `received` on arrival, extracts the W3C traceparent/tracestate and
baggage with the global propagator, decides the SERVER span's ids and sampling (here, once) and
leaves the request handle in the scope for `telemetry.request(scope)`. While the app runs, the
SERVER span's context is the current span (with the incoming baggage), so the app's own spans nest
under it.

`responded` is stamped when the last body chunk (`more_body` false) has been handed to the server.
(A stream's body chunks after the first content chunk's `send` returned, but the last, are stamped
and handed to `send` in C, `_send_guard.BodySender`: no coroutine of ours per chunk.)
A body chunk sent after the app called `output_ready()` carries output: the middleware stamps
around its `send` (the `first_chunk` budget term and its loop-wait / encode / write split, in
`phases`); from it on, the first few non-empty body chunks are stamped with the body bytes
through them (`body_sending`: what estimates a late client's wait that TCP hid by coalescing).
A client that goes away first — an `http.disconnect` received, or `send` raising — marks the request
`client_disconnected` (error.type, status ERROR). Requests the app rejects (4xx/5xx) still give one
SERVER span, with the status code and `error.type`. The request is closed (and goes on to the span
builder) when the app returns or raises.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any, Protocol

from opentelemetry import context

from phaselens.common.clocks import NOT_STAMPED, MonoTs
from phaselens.instrumentation.hotpath.handle import ServerRequest
from phaselens.instrumentation.server._send_guard import BodySender

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# FastAPI ≥ 0.165 traces every request by itself once a global tracer provider is set: its own SERVER
# span (from the same traceparent: a sibling of ours) and operation spans. It skips a request whose
# scope already holds this key (how it hands a request to a mounted app), so marking the scope keeps
# one SERVER span per request, ours, and spares the event loop the spans nobody asked for.
FASTAPI_TELEMETRY_KEY = "fastapi.telemetry"


class RequestOpener(Protocol):
    """What the middleware needs of `server.ServerTelemetry` (which imports this module)."""

    def open_request(self, scope: Scope, *, managed: bool, received_ts: MonoTs | None = None) -> ServerRequest: ...


class IngressMiddleware:
    """ASGI middleware; `telemetry` is the ServerTelemetry that owns the handles. `carries_content`,
    when given, tells whether a body chunk sent after `output_ready()` carries the output (a server
    whose API layer also sends chunks without it after that call, such as vLLM's role-only chat
    chunk or its empty-text completion chunks); by default each such chunk does. It is asked only until
    the first chunk that carries output: vLLM sends those chunks before its first text.

    For a host that joins its own work to the request (the vLLM plugin): `current`, a ContextVar
    that holds the handle while the app runs, and `ended(handle)`, called when the app returned or
    raised, before the handle is closed. (In this middleware's own frame: a wrapper around the app
    would be one more coroutine frame resumed at every await of the request.)"""

    def __init__(
        self,
        app: Any,
        telemetry: RequestOpener,
        carries_content: Callable[[Message], bool] | None = None,
        *,
        current: ContextVar[Any] | None = None,
        ended: Callable[[ServerRequest], Any] | None = None,
    ) -> None:
        self.app = app
        self.telemetry = telemetry
        self.carries_content = carries_content
        self.current = current
        self.ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        handle = self.telemetry.open_request(scope, managed=True)
        scope.setdefault(FASTAPI_TELEMETRY_KEY, None)
        clock_ns = handle.clock_ns
        carries_content = self.carries_content
        responded_ts = NOT_STAMPED

        async def receive_stamped() -> Message:
            message = await receive()
            if message.get("type") == "http.disconnect" and not responded_ts:
                handle.note_http(client_disconnected=True)
            return message

        async def send_tracked(message: Message) -> None:
            nonlocal responded_ts
            kind = message.get("type")
            if kind == "http.response.start":
                handle.note_http(status_code=message.get("status"))
            carries_output = (
                handle.output_pending
                and kind == "http.response.body"
                and (carries_content is None or bool(handle.first_chunk_ts) or carries_content(message))
            )
            if kind == "http.response.body":
                handle.body_sending(len(message.get("body") or b""), carries_output)
            try:
                await send(message)
            except Exception:  # the server could not write: the client is gone
                if not responded_ts:
                    handle.note_http(client_disconnected=True)
                raise
            if carries_output:
                handle.chunk_sent()
            if kind == "http.response.body" and not message.get("more_body", False):
                responded_ts = clock_ns()

        def client_gone() -> None:  # the server could not write a body chunk before the last one
            handle.note_http(client_disconnected=True)

        # the body chunks after the first content chunk's `send` returned, but the last, are stamped
        # in C and their `send` awaited through a C guard (no coroutine of ours: most chunks of a
        # stream); every other message goes through `send_tracked` (_send_guard.c)
        send_stamped = BodySender(handle, send, send_tracked, client_gone)

        token = context.attach(handle.context)
        current = self.current
        current_token = current.set(handle) if current is not None else None
        try:
            await self.app(scope, receive_stamped, send_stamped)
        except BaseException as exc:
            if not handle.http.client_disconnected:
                handle.note_http(exception_type=type(exc).__qualname__)
            if handle.http.status_code is None:
                handle.note_http(status_code=500)  # what the server answers for an app that raised
            raise
        finally:
            if current is not None and current_token is not None:
                current.reset(current_token)
            if self.ended is not None:
                self.ended(handle)
            context.detach(token)
            handle.close(responded_ts or None)
