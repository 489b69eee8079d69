"""The per-request handle the API layer and the engine share (contract A: `telemetry.request(scope)`).

It is a `RequestTimeline` (the engine's stamps) plus what the API layer knows: the request's
description (`describe`), its outcome (`complete` / `fail`), the HTTP facts the middleware saw,
and the open SERVER root span, started at receipt so its SpanContext is known for links and
children. `close()` stamps `responded` and hands the handle to the span builder exactly once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span

from .clock import ClockNs
from .timeline import RequestTimeline


@dataclass(slots=True)
class RequestInfo:
    """What `describe()` was told: GenAI request attributes."""

    operation: str
    model: str
    request_id: str | None = None
    input_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool | None = None
    prompt: Any = None  # kept only when content capture is on


@dataclass(slots=True)
class RequestOutcome:
    """What `complete()` or `fail()` was told."""

    output_tokens: int | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    completion: str | None = None  # kept only when content capture is on
    error_type: str | None = None
    status_code: int | None = None


@dataclass(slots=True)
class HttpFacts:
    """What the ingress middleware saw of the HTTP exchange."""

    method: str = ""
    path: str = ""
    server_address: str | None = None
    server_port: int | None = None
    status_code: int | None = None
    client_disconnected: bool = False
    exception_type: str | None = None


class RequestHandle(RequestTimeline):
    """observer.RequestObserver + describe/complete/fail for one request."""

    __slots__ = ("span", "parent", "context", "sampled", "info", "outcome", "http", "managed", "capture_content",
                 "_submit", "_closed")

    def __init__(self, span: Span, submit: Callable[["RequestHandle"], Any], *, capture_content: bool,
                 parent: Context | None = None,
                 clock_ns: ClockNs = time.monotonic_ns, received_ns: int | None = None,
                 managed: bool = False) -> None:
        RequestTimeline.__init__(self, clock_ns, received_ns)
        self.span = span
        self.parent = parent  # the incoming context (the remote parent span, baggage)
        self.context = trace.set_span_in_context(span, parent)  # incoming baggage + the root span
        # the one sampling decision: a recording root span, or (process builder) a sampled flag
        self.sampled = span.is_recording() or span.get_span_context().trace_flags.sampled
        self.info: RequestInfo | None = None
        self.outcome = RequestOutcome()
        self.http = HttpFacts()
        self.managed = managed  # True: the middleware closes it when the response ends
        self.capture_content = capture_content
        self._submit = submit
        self._closed = False

    def describe(self, operation: str, model: str, request_id: str | None = None,
                 input_tokens: int | None = None, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None, stream: bool | None = None, prompt: Any = None) -> None:
        """The request as the API layer parsed it; `prompt` (str or chat messages) is kept only with
        content capture on."""
        self.info = RequestInfo(operation, model, request_id, input_tokens, max_tokens, temperature,
                                top_p, top_k, seed, stream, prompt if self.capture_content else None)

    def complete(self, output_tokens: int | None = None, finish_reason: str | None = None,
                 cached_tokens: int = 0, reasoning_tokens: int = 0, completion: str | None = None) -> None:
        """Usage as reported to the client. Without middleware this also closes the request."""
        outcome = self.outcome
        outcome.output_tokens = output_tokens
        outcome.finish_reason = finish_reason
        outcome.cached_tokens = cached_tokens
        outcome.reasoning_tokens = reasoning_tokens
        outcome.completion = completion if self.capture_content else None
        if not self.managed:
            self.close()

    def fail(self, error_type: str, status_code: int | None = None) -> None:
        """The request failed or was rejected (`error.type`). Without middleware this closes it."""
        self.outcome.error_type = error_type
        self.outcome.status_code = status_code
        if not self.managed:
            self.close()

    def close(self, responded_ns: int | None = None) -> None:
        """Stamp `responded` (now, unless given) and hand the handle to the builder, once."""
        if self._closed:
            return
        self._closed = True
        self.responded_ns = self.clock_ns() if responded_ns is None else responded_ns
        self._submit(self)
