"""The ingress middleware driven as pure ASGI (the server side of the protocol played by the test)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import baggage, trace
from opentelemetry.trace import SpanKind, StatusCode

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestInfo
from phaselens.instrumentation.server.telemetry import SCOPE_KEY
from tests.instrumentation_fixtures import http_scope, make_rig


def drive(app, scope, incoming=({"type": "http.request", "body": b"{}", "more_body": False},), send_error=None):
    """Run `app` once; `incoming` are the messages `receive` returns, then it waits forever."""
    sent = []

    async def receive():
        if incoming_left:
            return incoming_left.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        if send_error is not None and message.get("more_body"):
            raise send_error
        sent.append(message)

    incoming_left = list(incoming)
    asyncio.run(app(scope, receive, send))
    return sent


def root_of(rig):
    return next(s for s in rig.spans() if s.kind == SpanKind.SERVER)


def test_responded_is_the_final_body_chunk_and_app_spans_nest():
    rig = make_rig()
    seen = {}

    async def app(scope, receive, send):
        seen["current"] = trace.get_current_span()
        seen["handle"] = rig.telemetry.request(scope)
        rig.clock.advance(10_000)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        rig.clock.advance(5_000)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        rig.clock.advance(70_000)  # work after the response ended is not the request's

    drive(rig.telemetry.asgi(app), http_scope())
    root = root_of(rig)
    assert seen["current"] is seen["handle"].span  # the app's own spans become children
    assert root.end_time - root.start_time == 15_000
    assert root.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 200
    assert root.status.status_code == StatusCode.UNSET


def test_app_rejection_404_still_one_server_span():
    rig = make_rig()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"not found"})

    drive(rig.telemetry.asgi(app), http_scope("/nowhere"))
    root = root_of(rig)
    assert root.name == "POST" and root.status.status_code == StatusCode.ERROR
    assert root.attributes[names.ERROR_TYPE] == "404"
    assert root.attributes[names.URL_PATH] == "/nowhere"


def test_app_exception_is_recorded_and_reraised():
    rig = make_rig()

    async def app(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        drive(rig.telemetry.asgi(app), http_scope())
    root = root_of(rig)
    assert root.attributes[names.ERROR_TYPE] == "RuntimeError"
    assert root.attributes[names.HTTP_RESPONSE_STATUS_CODE] == 500


def streaming_app(rig):
    async def app(scope, receive, send):
        req = rig.telemetry.request(scope)
        req.describe(RequestInfo(operation=names.OP_CHAT, model="tiny"))
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
            if (await receive())["type"] == "http.disconnect":
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def test_disconnect_message_marks_client_disconnected():
    rig = make_rig()
    incoming = ({"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"})
    drive(rig.telemetry.asgi(streaming_app(rig)), http_scope(), incoming)
    root = root_of(rig)
    assert root.name == "chat tiny" and root.status.status_code == StatusCode.ERROR
    assert root.attributes[names.ERROR_TYPE] == names.ERROR_CLIENT_DISCONNECTED
    assert root.attributes[names.PL_CLIENT_DISCONNECTED] is True


def test_send_failure_marks_client_disconnected():
    rig = make_rig()
    with pytest.raises(OSError):
        drive(rig.telemetry.asgi(streaming_app(rig)), http_scope(), send_error=OSError("broken pipe"))
    root = root_of(rig)
    assert root.attributes[names.ERROR_TYPE] == names.ERROR_CLIENT_DISCONNECTED


def test_non_http_scopes_pass_through():
    rig = make_rig()
    scopes = []

    async def app(scope, receive, send):
        scopes.append(scope)

    drive(rig.telemetry.asgi(app), {"type": "lifespan"})
    assert SCOPE_KEY not in scopes[0] and rig.spans() == []


def test_tracestate_and_baggage_are_extracted():
    rig = make_rig()
    seen = {}

    async def app(scope, receive, send):
        seen["baggage"] = baggage.get_baggage("tenant")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = http_scope(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    scope["headers"] += [(b"tracestate", b"vendor=abc"), (b"baggage", b"tenant=acme")]
    drive(rig.telemetry.asgi(app), scope)
    root = root_of(rig)
    assert seen["baggage"] == "acme"
    assert root.context.trace_state.get("vendor") == "abc"
    assert format(root.parent.span_id, "016x") == "b7ad6b7169203331"
