"""Hot-path records: what the serving loop writes, and nothing more.

`RequestTimeline` implements `observer.RequestObserver`; `StepRecorder` implements
`observer.StepObserver`. Every method appends integers (monotonic ns from the injected clock,
counts) to int64 buffers (`array`; the per-token ones in the C base `_stamps.TimelineCore`) or int
slots: no OpenTelemetry call, no lock, no object kept per token. Records reach the span pipeline through a sink's `BoundedHandOff`, which never blocks and
never raises: when full it drops the record and counts it.

Layout of a request timeline (all monotonic ns, 0 = not stamped):
    received_ts, enqueued_ts, first_token_ts, finished_ts, responded_ts
    output_ready_ts, first_chunk_ts, first_chunk_sent_ts, last_chunk_ts   the response's content
               chunks, stamped on the event loop (`handle.ServerRequest`): the API layer took the
               first output carrying content off the engine's stream; its body chunk handed to the
               server's `send`; that `send` returned; the last content chunk handed to `send`
               (held in the C base with `first_token_ts`, written by its `output_ready`,
               `body_sending` and `chunk_sent`: one C call per output and per body chunk)
    visible_tokens   the output tokens so far when the first content reached the API layer
    arrived_ts, read_ts   the request's first bytes reached the server's kernel; the event loop
               handed them to the HTTP protocol (`inbound`; 0 = not observed)
    waits      flat [start0, end0, start1, end1, …]  queue waits; odd length = a wait still open
    chunks     flat [start, end, tokens, cached, …]  prefill chunks (initial and recompute)
    token_ts   one stamp per `token()` call (a decode step that gave this request tokens)
    token_n    tokens that step gave (usually 1)
               both held by the C base as (stamp, count) pairs in one buffer; these two read
               them as read-only int64 memoryviews (copies), as a frozen record holds them
    sends      flat [stamp, body_bytes, …]  the body chunks handed to the server's `send` from the
               first content chunk on (at most names.FIRST_SENDS_MAX): the stamp just before the
               call, the response body bytes handed over through that chunk (the C base's, read as
               a read-only int64 copy like token_ts)
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from phaselens.common.clocks import NOT_STAMPED, MonoClock, MonoTs, monotonic_ts
from phaselens.instrumentation.hotpath._stamps import StepRecorderCore, TimelineCore
from phaselens.instrumentation.hotpath.records import StepRecord

CHUNK_FIELDS = 4  # start, end, tokens, cached
# the stamps' array type: native int64s. "l" where a C long is 8 bytes (LP64: Linux, macOS): its
# append converts an int with PyLong_AsLong; "q"'s goes through _PyLong_AsByteArray for any int past
# 30 bits, as every monotonic ns stamp is (~240 instructions an append more, two appends a token)
INT64 = "l" if array("l").itemsize == 8 else "q"


class RequestTimeline(TimelineCore):
    """Per-request phase stamps (observer.RequestObserver). Written by the loop thread only.

    `token(n=1)` (a decode step gave n tokens, stamped now) and `token_at(t, n)` (stamped t by the
    caller) are the C base's: one call, no Python frame, a token's stamp and count stored together.
    So are the content-chunk stamps and their writers (module docstring)."""

    __slots__ = (
        "arrived_ts",
        "chunks",
        "enqueued_ts",
        "finish_reason",
        "finished_ts",
        "read_ts",
        "received_ts",
        "responded_ts",
        "waits",
    )

    # the stamps (class-level annotations only: the slots hold them; the C base the others)
    received_ts: MonoTs
    enqueued_ts: MonoTs
    finished_ts: MonoTs
    responded_ts: MonoTs
    arrived_ts: MonoTs
    read_ts: MonoTs

    def __init__(self, clock_ns: MonoClock = monotonic_ts, received_ts: MonoTs | None = None) -> None:
        self.clock_ns = clock_ns
        self.received_ts = clock_ns() if received_ts is None else received_ts
        self.enqueued_ts = self.finished_ts = self.responded_ts = NOT_STAMPED
        self.arrived_ts = self.read_ts = NOT_STAMPED
        self.finish_reason = ""
        self.waits = array(INT64)
        self.chunks = array(INT64)

    def enqueued(self) -> None:
        t = self.clock_ns()
        self.enqueued_ts = t
        self.waits.append(t)

    def scheduled(self) -> None:
        self.scheduled_at(self.clock_ns())

    def scheduled_at(self, t: MonoTs) -> None:
        """`scheduled` stamped at `t` on this clock by another process (an engine process on this
        host: CLOCK_MONOTONIC is one clock for every process of the host)."""
        waits = self.waits
        if not len(waits) & 1:  # scheduled without an open wait: record a zero-length one
            waits.append(t)
        waits.append(t)

    def prefill_chunk(self, start_ts: MonoTs, end_ts: MonoTs, tokens: int, cached_tokens: int) -> None:
        self.chunks.extend((start_ts, end_ts, tokens, cached_tokens))

    def first_token(self) -> None:
        self.first_token_ts = self.clock_ns()

    def preempted(self) -> None:
        self.waits.append(self.clock_ns())

    def preempted_at(self, t: MonoTs) -> None:
        """`preempted` stamped at `t` by another process (as `scheduled_at`)."""
        self.waits.append(t)

    def finished(self, reason: str) -> None:
        self.finish_reason = reason  # before finished_ts: a reader that sees `engine_done` sees both
        self.finished_ts = self.clock_ns()

    @property
    def engine_done(self) -> bool:
        """The engine will write no more stamps (finished, or never handed to the engine)."""
        return self.finished_ts != 0 or self.enqueued_ts == 0


class StepRecorder(StepRecorderCore):
    """observer.StepObserver: one StepRecord per engine iteration, handed to `submit`.

    `step(stats, requests)` is the C base's, one call: the record's links are the members' `link`s
    (their SERVER span's ids, fixed at receipt) copied from each timeline's struct into one bytes;
    a member not sampled or not ours is counted in `num_seqs`, not linked. No OTel object."""

    __slots__ = ()

    def __init__(self, submit: Callable[[StepRecord], Any]) -> None:
        super().__init__(submit, StepRecord)
