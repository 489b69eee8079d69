"""Hot-path records: what the serving loop writes, and nothing more.

`RequestTimeline` implements `observer.RequestObserver`; `StepRecorder` implements
`observer.StepObserver`. Every method appends integers (monotonic ns from the injected clock,
counts) to `array('q')` buffers or int slots: no OpenTelemetry call, no lock, no object kept per
token. Records reach the span pipeline through a sink's `BoundedHandOff`, which never blocks and
never raises: when full it drops the record and counts it.

Layout of a request timeline (all monotonic ns, 0 = not stamped):
    received_ns, enqueued_ns, first_token_ns, finished_ns, responded_ns
    output_ready_ns, first_chunk_ns, first_chunk_sent_ns, last_chunk_ns   the response's content
               chunks, stamped on the event loop (`handle.ServerRequest`): the API layer took the
               first output carrying content off the engine's stream; its body chunk handed to the
               server's `send`; that `send` returned; the last content chunk handed to `send`
    arrived_ns, read_ns   the request's first bytes reached the server's kernel; the event loop
               handed them to the HTTP protocol (`inbound`; 0 = not observed)
    waits      flat [start0, end0, start1, end1, …]  queue waits; odd length = a wait still open
    chunks     flat [start, end, tokens, cached, …]  prefill chunks (initial and recompute)
    token_ns   one stamp per `token()` call (a decode step that gave this request tokens)
    token_n    tokens that step gave (usually 1)
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .clock import ClockNs
from .record import StepRecord

CHUNK_FIELDS = 4  # start, end, tokens, cached


class RequestTimeline:
    """Per-request phase stamps (observer.RequestObserver). Written by the loop thread only."""

    __slots__ = (
        "arrived_ns",
        "chunks",
        "clock_ns",
        "enqueued_ns",
        "finish_reason",
        "finished_ns",
        "first_chunk_ns",
        "first_chunk_sent_ns",
        "first_token_ns",
        "last_chunk_ns",
        "output_ready_ns",
        "read_ns",
        "received_ns",
        "responded_ns",
        "token_n",
        "token_ns",
        "waits",
    )

    def __init__(self, clock_ns: ClockNs = time.monotonic_ns, received_ns: int | None = None) -> None:
        self.clock_ns = clock_ns
        self.received_ns = clock_ns() if received_ns is None else received_ns
        self.enqueued_ns = 0
        self.first_token_ns = 0
        self.finished_ns = 0
        self.responded_ns = 0
        self.output_ready_ns = self.first_chunk_ns = self.first_chunk_sent_ns = self.last_chunk_ns = 0
        self.arrived_ns = self.read_ns = 0
        self.finish_reason = ""
        self.waits = array("q")
        self.chunks = array("q")
        self.token_ns = array("q")
        self.token_n = array("q")

    def enqueued(self) -> None:
        t = self.clock_ns()
        self.enqueued_ns = t
        self.waits.append(t)

    def scheduled(self) -> None:
        t = self.clock_ns()
        waits = self.waits
        if not len(waits) & 1:  # scheduled without an open wait: record a zero-length one
            waits.append(t)
        waits.append(t)

    def prefill_chunk(self, start_ns: int, end_ns: int, tokens: int, cached_tokens: int) -> None:
        self.chunks.extend((start_ns, end_ns, tokens, cached_tokens))

    def first_token(self) -> None:
        self.first_token_ns = self.clock_ns()

    def token(self, n: int = 1) -> None:
        self.token_ns.append(self.clock_ns())
        self.token_n.append(n)

    def preempted(self) -> None:
        self.waits.append(self.clock_ns())

    def finished(self, reason: str) -> None:
        self.finish_reason = reason  # before finished_ns: a reader that sees `engine_done` sees both
        self.finished_ns = self.clock_ns()

    @property
    def engine_done(self) -> bool:
        """The engine will write no more stamps (finished, or never handed to the engine)."""
        return self.finished_ns != 0 or self.enqueued_ns == 0


class BoundedHandOff:
    """A bounded single-consumer queue: `offer` is one GIL-atomic deque append, never blocks.

    When `capacity` items are waiting, the new item is dropped and counted in `dropped` (the count
    is written by producers only; a lost increment under a thread race under-counts by one at most
    per race, it never raises).
    """

    __slots__ = ("_items", "capacity", "dropped", "offered")

    def __init__(self, capacity: int) -> None:
        self._items: deque = deque()
        self.capacity = capacity
        self.offered = 0
        self.dropped = 0

    def offer(self, item: Any) -> bool:
        self.offered += 1
        if len(self._items) >= self.capacity:
            self.dropped += 1
            return False
        self._items.append(item)
        return True

    def take(self) -> Any | None:
        """The oldest item, or None when empty (consumer thread only)."""
        try:
            return self._items.popleft()
        except IndexError:
            return None

    def close(self) -> None:
        """Refuse (and count) every later offer; what is still queued is counted as dropped too."""
        self.capacity = 0
        while self.take() is not None:
            self.dropped += 1

    def __len__(self) -> int:
        return len(self._items)


class StepRecorder:
    """observer.StepObserver: one StepRecord per engine iteration, handed to `submit`.

    The links are read from the members' `link` (their SERVER span's ids, fixed at receipt): one
    list comprehension per step, no OTel object."""

    __slots__ = ("_index", "_submit")

    def __init__(self, submit: Callable[[StepRecord], Any]) -> None:
        self._submit = submit
        self._index = 0

    def step(
        self,
        start_ns: int,
        end_ns: int,
        prefill_tokens: int,
        decode_tokens: int,
        kv_blocks_used: int,
        kv_blocks_total: int,
        preemptions: int,
        queue_depth: int,
        requests: Sequence[Any],
    ) -> None:
        index = self._index
        self._index = index + 1
        try:
            links = tuple([request.link for request in requests])
        except AttributeError:  # a loop that also batches observers of its own: counted, not linked
            links = tuple([getattr(request, "link", None) for request in requests])
        self._submit(
            StepRecord(
                index,
                start_ns,
                end_ns,
                prefill_tokens,
                decode_tokens,
                kv_blocks_used,
                kv_blocks_total,
                preemptions,
                queue_depth,
                links,
            )
        )
