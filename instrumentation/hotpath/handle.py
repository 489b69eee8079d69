"""The per-request handle the API layer and the engine share (`observer.RequestHandle`).

It is a `RequestTimeline` (the engine's stamps) plus what the API layer knows: the request's
description (`describe`), its outcome (`complete` / `fail`) and the HTTP facts the middleware saw,
and the ids of its SERVER span, chosen at receipt (`ids.RootDecider`) so that step links and the
app's own spans can name it before it exists. `close()` stamps `responded`; the `Closer` then
freezes the handle into a `record.RequestRecord` and submits it, exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan

from phaselens.common.clocks import MonoClock, MonoTs, monotonic_ts
from phaselens.instrumentation.hotpath.ids import span_context
from phaselens.instrumentation.hotpath.records import (
    NO_OUTCOME,
    HttpFacts,
    KvStamps,
    RequestInfo,
    RequestOutcome,
    RequestRecord,
    SpanIds,
    int64s,
    pack_link,
)
from phaselens.instrumentation.hotpath.timeline import RequestTimeline


class Closer:
    """Where closed requests go. One the engine is done with is frozen and submitted at once; one
    closed while the engine still works on it (a client that left mid-stream) waits until the
    engine stamps `finished`, or `grace_ns` after `responded`, so no timeline is frozen while it is
    written. `expire()` runs on the sink's thread at each wake-up, and at flush and stop."""

    __slots__ = ("_clock_ns", "_submit", "_waiting", "grace_ns")

    def __init__(self, submit: Callable[[RequestRecord], Any], clock_ns: MonoClock, grace_ns: int) -> None:
        self._submit = submit
        self._clock_ns = clock_ns
        self.grace_ns = grace_ns
        self._waiting: dict[int, ServerRequest] = {}  # added on the event loop, taken by expire()

    def closed(self, handle: ServerRequest) -> None:
        if handle.engine_done:
            self._submit(handle.freeze())
        else:
            self._waiting[id(handle)] = handle

    def expire(self, force: bool = False) -> None:
        """Submit the waiting requests that are ready (all of them with `force`)."""
        if not self._waiting:
            return
        now = self._clock_ns()
        for key, handle in list(self._waiting.items()):
            ready = force or handle.engine_done or now - handle.responded_ts >= self.grace_ns
            # pop() decides who submits when expire() runs on two threads (sink wake-up and stop)
            if ready and self._waiting.pop(key, None) is not None:
                self._submit(handle.freeze())

    def __len__(self) -> int:
        return len(self._waiting)


class ServerRequest(RequestTimeline):
    """observer.RequestHandle for one request of this server. The timeline's content-chunk stamps
    are written on the event loop by the C base's methods: `output_ready(output_tokens=0)` (the API
    layer took output that renders text: see observer.RequestHandle.output_ready),
    `body_sending(nbytes, carries_output=False)` (the middleware hands `nbytes` of response body to
    `send`, a chunk carrying output when `carries_output`: `first_chunk` / `last_chunk` stamped,
    and from the first content chunk on the first FIRST_SENDS_MAX non-empty ones with the body
    bytes through them, timeline `sends`) and `chunk_sent()` (that `send` returned)."""

    __slots__ = (
        "_closed",
        "_closer",
        "capture_content",
        "context",
        "http",
        "info",
        "kv",
        "managed",
        "outcome",
        "parent",
        "root",
        "span",
    )

    def __init__(
        self,
        root: SpanIds,
        parent: SpanIds | None,
        incoming: Context,
        closer: Closer,
        http: HttpFacts,
        *,
        capture_content: bool,
        clock_ns: MonoClock = monotonic_ts,
        received_ts: MonoTs | None = None,
        managed: bool = False,
    ) -> None:
        RequestTimeline.__init__(self, clock_ns, received_ts)
        self.root = root
        self.parent = parent  # the remote parent's ids, or None
        # what an engine step links (kept in the C base): the SERVER span's ids packed, None when not sampled
        self.link = pack_link(root) if root.sampled else None
        self.span = NonRecordingSpan(span_context(root))  # current while the app runs: its spans nest
        self.context = trace.set_span_in_context(self.span, incoming)  # incoming baggage + the root
        self.info: RequestInfo | None = None
        self.outcome = NO_OUTCOME
        self.http = http
        self.kv: KvStamps | None = None
        self.managed = managed  # True: the middleware closes it when the response ends
        self.capture_content = capture_content
        self._closer = closer
        self._closed = False

    @property
    def sampled(self) -> bool:
        return self.root.sampled

    def describe(self, info: RequestInfo) -> None:
        """The request as the API layer parsed it; `info.prompt` (str or chat messages) is kept only
        with content capture on."""
        self.info = info if self.capture_content or info.prompt is None else info._replace(prompt=None)

    def complete(
        self,
        output_tokens: int | None = None,
        finish_reason: str | None = None,
        cached_tokens: int = 0,
        reasoning_tokens: int = 0,
        completion: str | None = None,
    ) -> None:
        """Usage as reported to the client. Without middleware this also closes the request."""
        failed = self.outcome
        self.outcome = RequestOutcome(
            output_tokens,
            finish_reason,
            cached_tokens,
            reasoning_tokens,
            completion if self.capture_content else None,
            failed.error_type,
            failed.status_code,
        )
        if not self.managed:
            self.close()

    def fail(self, error_type: str, status_code: int | None = None) -> None:
        """The request failed or was rejected (`error.type`). Without middleware this closes it."""
        self.outcome = self.outcome._replace(error_type=error_type, status_code=status_code)
        if not self.managed:
            self.close()

    def kv_moved(self, save: bool, start_ts: MonoTs, end_ts: MonoTs, busy_ns: int, nbytes: int | None) -> None:
        """A KV connector saved (`save`) or loaded this request's KV in one engine step, from
        `start_ts` to `end_ts`, `busy_ns` of it inside its calls; steps add up (a chunked prefill
        saves in each of its steps)."""
        kv = self.kv or KvStamps()
        first, last, busy, moved = kv[0:4] if save else kv[4:8]
        first = min(first, start_ts) if first else start_ts
        if busy:  # an earlier step's: the total is known only while every step's is
            moved = None if moved is None or nbytes is None else moved + nbytes
        else:
            moved = nbytes
        stamps = (first, max(last, end_ts), busy + busy_ns, moved)
        self.kv = KvStamps(*stamps, *kv[4:8]) if save else KvStamps(*kv[0:4], *stamps)

    def note_http(self, **facts: Any) -> None:
        """The middleware's view of the exchange (HttpFacts fields)."""
        self.http = self.http._replace(**facts)

    def close(self, responded_ts: MonoTs | None = None) -> None:
        """Stamp `responded` (now, unless given) and hand the request on, once."""
        if self._closed:
            return
        self._closed = True
        self.responded_ts = self.clock_ns() if responded_ts is None else responded_ts
        self._closer.closed(self)

    def freeze(self) -> RequestRecord:
        """The request as a frozen record (the timeline arrays copied into read-only int64 views)."""
        return RequestRecord(
            self.root,
            self.parent,
            self.received_ts,
            self.enqueued_ts,
            self.first_token_ts,
            self.finished_ts,
            self.responded_ts,
            self.output_ready_ts,
            self.first_chunk_ts,
            self.first_chunk_sent_ts,
            self.last_chunk_ts,
            self.arrived_ts,
            self.read_ts,
            self.visible_tokens,
            self.finish_reason,
            int64s(self.waits.tobytes()),
            int64s(self.chunks.tobytes()),
            self.token_ts,  # already read-only int64 copies
            self.token_n,
            self.sends,  # a read-only int64 copy, as token_ts
            self.info,
            self.outcome,
            self.http,
            self.kv,
        )
