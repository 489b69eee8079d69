"""The explicit interface between a serving loop and the instrumentation.

A serving loop never calls OpenTelemetry. It calls these observers at phase boundaries; each call
only appends integers (monotonic nanoseconds, counts) to a per-request or per-step record. Spans are
built later, off the loop thread, from those records (see `phaselens.instrumentation.pipeline.spans`).

Order of calls for one request (the middleware stamps `received` and `responded`):

    received → enqueued → scheduled → prefill_chunk… → first_token → token… → finished → responded
                             ↑ preempted ─┘ (back to waiting; a new queue wait starts)

Every method must be safe to call on the loop thread: no I/O, no lock, no exception escapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from phaselens.common.clocks import MonoTs
from phaselens.instrumentation.hotpath.records import RequestInfo, StepStats

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"  # client went away or cancelled
FINISH_ERROR = "error"


class RequestObserver(Protocol):
    """Per-request phase stamps, called by the engine (loop thread) and the API layer."""

    def enqueued(self) -> None:
        """The request was handed to the engine: ends `llm.ingress`, starts the first queue wait."""

    def scheduled(self) -> None:
        """The scheduler took the request from the waiting queue: ends the current queue wait."""

    def prefill_chunk(self, start_ts: MonoTs, end_ts: MonoTs, tokens: int, cached_tokens: int) -> None:
        """One prefill chunk ran over [start_ts, end_ts) (monotonic ns) for `tokens` prompt tokens;
        `cached_tokens` were served from the prefix cache instead of being computed."""

    def first_token(self) -> None:
        """The first sampled id is on the host (after `.tolist()`/sync) and handed to the stream."""

    def token(self, n: int = 1) -> None:
        """A decode step produced `n` more tokens for this request, already on the host."""

    def preempted(self) -> None:
        """KV was taken back (recompute preemption): the request waits again."""

    def finished(self, reason: str) -> None:
        """Generation ended (`FINISH_*`). The response may still be delivering."""


class StepObserver(Protocol):
    """Per-engine-iteration record, called once per step by the loop thread."""

    def step(self, stats: StepStats, requests: Sequence[RequestObserver]) -> None:
        """One `schedule() → run() → postprocess()` iteration; `requests` are the batch's members
        (their server spans become the links of the `llm.engine_step` span)."""


class RequestHandle(RequestObserver, Protocol):
    """What the API layer holds for one request (`ServerTelemetry.request(scope)`): the engine's
    stamps plus the request's description and outcome. `complete`/`fail` also close the request
    when no ingress middleware does."""

    def describe(self, info: RequestInfo) -> None:
        """The request as parsed (GenAI request attributes); `info.prompt` is kept only with content
        capture on."""

    def complete(
        self,
        output_tokens: int | None = None,
        finish_reason: str | None = None,
        cached_tokens: int = 0,
        reasoning_tokens: int = 0,
        completion: str | None = None,
    ) -> None:
        """Usage as reported to the client."""

    def fail(self, error_type: str, status_code: int | None = None) -> None:
        """The request failed or was rejected (`error.type`)."""

    def output_ready(self, output_tokens: int = 0) -> None:
        """Streaming: the API layer took output that carries content (text or reasoning, not a
        role-only chunk) off the engine's stream; the next body chunk it sends carries it. The
        ingress middleware stamps when that chunk is handed to the server's `send` (the `first_chunk`
        budget term). `output_tokens`: the request's tokens so far (0: not known); when the first
        content came only with a later token (a byte-level token that renders no text yet), the
        decode steps until it are the `held_back` term, not the event loop's lateness."""


class NullRequest:
    """The one no-op request handle (tracing off): every call does nothing. `link` None: an engine
    step never links it."""

    __slots__ = ()
    link = None

    def enqueued(self) -> None: ...
    def scheduled(self) -> None: ...
    def prefill_chunk(self, start_ts: MonoTs, end_ts: MonoTs, tokens: int, cached_tokens: int) -> None: ...
    def first_token(self) -> None: ...
    def token(self, n: int = 1) -> None: ...
    def preempted(self) -> None: ...
    def finished(self, reason: str) -> None: ...

    def describe(self, info: RequestInfo) -> None: ...

    def complete(
        self,
        output_tokens: int | None = None,
        finish_reason: str | None = None,
        cached_tokens: int = 0,
        reasoning_tokens: int = 0,
        completion: str | None = None,
    ) -> None: ...

    def fail(self, error_type: str, status_code: int | None = None) -> None: ...
    def output_ready(self, output_tokens: int = 0) -> None: ...


class NullStepObserver:
    __slots__ = ()

    def step(self, stats: StepStats, requests: Sequence[Any]) -> None: ...


NULL_REQUEST = NullRequest()
NULL_STEP = NullStepObserver()
