"""OpenAI-compatible HTTP front end (FastAPI) over the engine.

    POST /v1/completions, POST /v1/chat/completions   (stream SSE or not; n=1)
    GET  /v1/models, GET /health

Each request: parse + validate (400) → tokenize → `describe` → `engine.submit` (503 when the
waiting queue is full) → stream engine outputs. The engine thread hands outputs to this event
loop with `call_soon_threadsafe`; a client that goes away aborts its sequence, which frees its KV
at the engine's next iteration. Errors are always OpenAI-shaped JSON, FastAPI's 422 included.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from phaselens.common.exposure import authorized
from phaselens.instrumentation import (
    FINISH_ABORT,
    FINISH_ERROR,
    NULL_REQUEST,
    RequestHandle,
    RequestInfo,
    RequestObserver,
    names,
)
from phaselens.reference_server.engine.engine import EngineDeadError, QueueFullError
from phaselens.reference_server.engine.sequence import SamplingParams, SeqOutput, Sink
from phaselens.reference_server.serving import chat_template
from phaselens.reference_server.serving.handoff import Mailbox
from phaselens.reference_server.serving.protocol import ApiError, ParsedRequest, bad, parse_chat, parse_completion
from phaselens.reference_server.serving.responses import Envelope
from phaselens.reference_server.serving.sse import DONE_EVENT, encode_event

DEFAULT_MAX_BODY_BYTES = 1 << 20
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(slots=True)
class ApiSettings:
    """`served_model_names` are listed by /v1/models and accepted in requests, as are `model_aliases`
    (not listed). A response names the model exactly as the request did."""

    served_model_names: tuple[str, ...]
    model_aliases: tuple[str, ...] = ()
    reasoning_tokens: int = 0  # chat only: the first N output tokens stream as reasoning_content
    auth_token: str | None = None  # when set, /v1/* needs `Authorization: Bearer <token>`
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class ServingEngine(Protocol):
    """What the routes need of an engine: the thread engine (reference_server.engine.engine) or the
    client of an engine process (reference_server.process.engine_client)."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def add_special_tokens(self) -> bool: ...
    def health(self) -> dict[str, object]: ...
    def abort(self, seq_id: int) -> None: ...
    def submit(self, prompt_ids: list[int], params: SamplingParams, observer: RequestObserver, sink: Sink) -> int: ...


class OutputStream:
    """Engine → this event loop, for one request: from the engine thread (through the loop's
    mailbox: one wake-up a step), or on the loop itself (the engine process's outputs are read there)."""

    __slots__ = ("mailbox", "queue", "thread")

    def __init__(self) -> None:
        self.mailbox = Mailbox.of(asyncio.get_running_loop())
        self.queue: asyncio.Queue[SeqOutput] = asyncio.Queue()
        self.thread = threading.get_ident()

    def sink(self, out: SeqOutput) -> None:
        try:
            if threading.get_ident() == self.thread:
                self.queue.put_nowait(out)
            else:
                self.mailbox.post(self.queue.put_nowait, out)
        except RuntimeError:  # the event loop is closed: the server is gone, nobody listens
            pass


class EventStreamResponse(StreamingResponse):
    """SSE that always watches for `http.disconnect`. Starlette skips that on ASGI spec 2.4 and only
    notices a gone client at its next write; a request still queued would keep its place."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as group:

            async def stream_then_stop() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream_then_stop)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()
        await self.body_iterator.aclose()


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    envelope: Envelope
    parsed: ParsedRequest


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


# FastAPI ≥ 0.165 traces, meters and logs every request by itself once a global provider is set:
# a second SERVER span per request (a sibling of ours, from the same traceparent) and its operation
# spans, all built on the event loop. The phaselens middleware is this server's telemetry.
NO_FASTAPI_TELEMETRY: dict[str, Any] = (  # FastAPI keyword arguments: which exist depends on its version
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)


def create_app(
    engine: ServingEngine, settings: ApiSettings, telemetry: Any = None, routes_class: Callable[..., Any] | None = None
):
    """The ASGI app; wrapped in the telemetry ingress middleware when `telemetry` is given.
    `routes_class`: a `Routes` subclass (a disaggregated instance's, reference_server.pd.pd_api)."""
    app = FastAPI(
        title="phaselens reference server", docs_url=None, redoc_url=None, openapi_url=None, **NO_FASTAPI_TELEMETRY
    )
    routes = (routes_class or Routes)(engine, settings, telemetry)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(bad(f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error"))

    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    return telemetry.asgi(app) if telemetry is not None else app


class Routes:
    """The endpoints of one instance, bound to its engine; a disaggregated instance subclasses it."""

    def __init__(self, engine: ServingEngine, settings: ApiSettings, telemetry: Any) -> None:
        self.engine, self.settings, self.telemetry = engine, settings, telemetry

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as error:
            return error_response(error)
        cards = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "phaselens",
                "max_model_len": self.engine.max_model_len,
            }
            for name in self.settings.served_model_names
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def health(self) -> Response:
        """200 with the engine's load; 503 when the engine cannot serve (its process is gone)."""
        body = self.engine.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    async def _serve(self, request: Request, chat: bool) -> Response:
        handle = self.telemetry.request(request.scope) if self.telemetry is not None else NULL_REQUEST
        try:
            self._authorize(request)
            parsed = (parse_chat if chat else parse_completion)(await self._read_json(request))
            job = self._prepare(parsed, chat)
            self._describe(handle, job, chat)
            stream = OutputStream()
            seq_id = self._submit(job, handle, stream)
        except ApiError as error:
            handle.fail(error_type=error.code or error.type, status_code=error.status)
            return error_response(error)
        if parsed.stream:
            return EventStreamResponse(
                self._events(job, stream, handle, seq_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._respond(request, job, stream, handle, seq_id)

    def _authorize(self, request: Request) -> None:
        if not authorized(request.headers.get("authorization"), self.settings.auth_token):
            raise ApiError(401, "missing or wrong bearer token", type_="authentication_error", code="invalid_api_key")

    async def _read_json(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        too_big = ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length") or "0"
        if not declared.isdigit():
            raise bad("invalid Content-Length header")
        if int(declared) > limit:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_big
        try:
            return json.loads(body)
        except ValueError as exc:
            raise bad(f"the body is not valid JSON: {exc}") from None

    def _prepare(self, parsed: ParsedRequest, chat: bool) -> Job:
        """Tokenize and check lengths against the context; fill the OpenAI defaults."""
        settings = self.settings
        if parsed.model not in settings.served_model_names and parsed.model not in settings.model_aliases:
            raise bad(
                f"model {parsed.model!r} is not served here (serving "
                f"{', '.join(map(repr, settings.served_model_names))})",
                "model",
                code="model_not_found",
            )
        prompt_ids = self._tokenize(parsed, chat)
        context = self.engine.max_model_len
        room = context - len(prompt_ids)
        if room < 1:
            raise bad(
                f"the prompt has {len(prompt_ids)} tokens; the context is {context}",
                "messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = parsed.max_tokens or (room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room))
        if max_tokens > room:
            name = parsed.max_tokens_param
            raise bad(
                f"{name} {max_tokens} + prompt {len(prompt_ids)} tokens exceed the context {context}",
                name,
                code="context_length_exceeded",
            )
        params = replace(
            parsed.sampling, max_tokens=max_tokens, reasoning_tokens=self.settings.reasoning_tokens if chat else 0
        )
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        return Job(prompt_ids, params, Envelope(request_id, parsed.model, chat, len(prompt_ids)), parsed)

    def _tokenize(self, parsed: ParsedRequest, chat: bool) -> list[int]:
        engine = self.engine
        if isinstance(parsed.prompt, list):
            vocab = engine.vocab_size
            if not all(0 <= t < vocab for t in parsed.prompt):
                raise bad(f"token ids must be in [0, {vocab})", "prompt")
            return list(parsed.prompt)
        if chat:
            text = chat_template.render(parsed.messages, engine.tokenizer)
            return engine.tokenizer.encode(text, add_special_tokens=False)
        return engine.tokenizer.encode(parsed.prompt, add_special_tokens=engine.add_special_tokens)

    def _describe(self, handle: RequestHandle, job: Job, chat: bool) -> None:
        parsed, params = job.parsed, job.params
        handle.describe(
            RequestInfo(
                operation=names.OP_CHAT if chat else names.OP_TEXT_COMPLETION,
                model=parsed.model,
                request_id=job.envelope.request_id,
                input_tokens=len(job.prompt_ids),
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                stream=parsed.stream,
                prompt=parsed.messages if chat else parsed.prompt,
            )
        )

    def _submit(self, job: Job, handle: RequestHandle, stream: OutputStream) -> int:
        try:
            return self._start(job, handle, stream)
        except QueueFullError as exc:
            raise ApiError(503, str(exc), type_="server_overloaded", code="queue_full") from None
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type_="server_error", code="engine_dead") from None
        except ValueError as exc:
            raise bad(str(exc), "max_tokens", code="context_length_exceeded") from None

    def _start(self, job: Job, handle: RequestHandle, stream: OutputStream) -> int:
        """Hand the request to the engine (a disaggregated instance's routes hand it on differently)."""
        return self.engine.submit(job.prompt_ids, job.params, observer=handle, sink=stream.sink)

    async def _events(self, job: Job, stream: OutputStream, handle: RequestHandle, seq_id: int) -> AsyncIterator[bytes]:
        """SSE body: role chunk (chat), deltas, finish chunk, usage chunk (if asked), [DONE]. The
        last delta and what follows it are one write (each write is a send on the socket)."""
        envelope, finished, text = job.envelope, False, []
        try:
            if envelope.chat:
                yield encode_event(envelope.chunk(role=True))
            while True:
                out = await stream.queue.get()
                if out.finish_reason in (FINISH_ABORT, FINISH_ERROR):
                    finished = True
                    yield encode_event(self._engine_failure(out, handle).body())
                    return
                delta = b""
                if out.reasoning or out.content:
                    text.append(out.content)
                    handle.output_ready(out.output_tokens)  # the middleware stamps this chunk's send (first_chunk)
                    delta = envelope.delta_event(out.reasoning, out.content)
                if out.finish_reason:
                    break
                if delta:
                    yield delta
            tail = [delta, encode_event(envelope.chunk(finish_reason=out.finish_reason))]
            if job.parsed.include_usage:
                tail.append(encode_event(envelope.usage_chunk(out)))
            finished = True
            self._complete(handle, out, "".join(text))
            yield b"".join((*tail, DONE_EVENT))
        finally:
            if not finished:
                self.engine.abort(seq_id)

    async def _respond(
        self, request: Request, job: Job, stream: OutputStream, handle: RequestHandle, seq_id: int
    ) -> Response:
        """Non-streaming: wait for the end, unless the client leaves first (then abort)."""
        collect = asyncio.ensure_future(_collect(stream))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not collect.done():
            collect.cancel()
            self.engine.abort(seq_id)
            return Response(status_code=499)
        reasoning, content, final = collect.result()
        if final.finish_reason in (FINISH_ABORT, FINISH_ERROR):
            return error_response(self._engine_failure(final, handle))
        self._complete(handle, final, content)
        return JSONResponse(job.envelope.full(reasoning, content, final))

    def _engine_failure(self, out: SeqOutput, handle: RequestHandle) -> ApiError:
        if out.finish_reason == FINISH_ERROR:
            why = f": {out.error}" if out.error else ""
            error = ApiError(
                500, f"the engine failed while running this request{why}", type_="server_error", code="engine_error"
            )
        else:
            error = ApiError(503, "the server is shutting down", type_="server_overloaded", code="shutting_down")
        handle.fail(error_type=error.code, status_code=error.status)
        return error

    @staticmethod
    def _complete(handle: RequestHandle, final: SeqOutput, completion: str) -> None:
        handle.complete(
            output_tokens=final.output_tokens,
            finish_reason=final.finish_reason,
            cached_tokens=final.cached_tokens,
            reasoning_tokens=final.reasoning_tokens,
            completion=completion,
        )


async def _collect(stream: OutputStream) -> tuple[str, str, SeqOutput]:
    reasoning, content = [], []
    while True:
        out = await stream.queue.get()
        reasoning.append(out.reasoning)
        content.append(out.content)
        if out.finish_reason:
            return "".join(reasoning), "".join(content), out


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
