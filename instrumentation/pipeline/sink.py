"""Where records go: one protocol, two places the spans are built.

    sink.start()                 its thread (and process) start
    sink.submit_request(record)  hot path: one bounded hand-off's append, never blocks, never raises
    sink.submit_step(record)     the same for an engine step's record
    sink.flush(timeout_s)        every record submitted so far is built (and, for a process, exported)
    sink.stop(timeout_s)         build what is left, stop; later submits are counted as dropped
    sink.counters()              every count of the records' way: hand-off, shipping, building, export

`ThreadSink` builds on a thread of this process; `shipper.ProcessSink` ships the records to a
span-builder process. Both feed the same `builder.SpanBuilder`, and both poll their hand-offs
(producers do one append in C, `_handoff.c`: no Python frame, no Event, no lock on the loop thread).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from phaselens.instrumentation.hotpath.records import Record, RequestRecord, StepRecord
from phaselens.instrumentation.pipeline._handoff import BoundedHandOff
from phaselens.instrumentation.pipeline.builder import SpanBuilder

NICE = 10  # span building runs at a lower CPU priority: on a busy machine the serving loop goes first


class Sink(Protocol):
    def start(self) -> None: ...
    def submit_request(self, record: RequestRecord) -> bool: ...  # False: dropped (full, or stopped), counted
    def submit_step(self, record: StepRecord) -> bool: ...
    def flush(self, timeout_s: float) -> bool: ...
    def stop(self, timeout_s: float) -> None: ...
    def counters(self) -> dict[str, int]: ...


class HandOffs:
    """A sink's bounded hand-offs, one per record kind (each `capacity` long), drops counted per kind.
    The producers call each one's `offer` (C, `_handoff.c`) as the sink's `submit_request` /
    `submit_step`: no Python frame between the loop and the append."""

    __slots__ = ("requests", "steps")

    def __init__(self, capacity: int) -> None:
        self.requests, self.steps = BoundedHandOff(capacity), BoundedHandOff(capacity)

    def take(self) -> list[Record]:
        """Everything waiting, steps first (consumer thread only)."""
        return self.steps.drain() + self.requests.drain()

    def accepted(self) -> int:
        """Records accepted so far: a flush is complete when this many are done."""
        return sum(h.offered - h.dropped for h in (self.requests, self.steps))

    def close(self) -> None:
        self.requests.close()
        self.steps.close()

    def counters(self) -> dict[str, int]:
        requests, steps = self.requests, self.steps
        return {
            "requests_offered": requests.offered,
            "requests_dropped": requests.dropped,
            "steps_offered": steps.offered,
            "steps_dropped": steps.dropped,
            "queue_full": requests.dropped + steps.dropped,
            "queued": len(requests) + len(steps),
        }


def lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


def wait_until(done: Callable[[], bool], timeout_s: float, nudge: Callable[[], None] = lambda: None) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        nudge()
        time.sleep(0.002)
    return True


class ThreadSink:
    """Builds records on a daemon thread of this process; `tick()` runs at every wake-up.

    Staying out of the loop's way: the thread runs at nice +NICE (Linux, best effort) and gives up
    the GIL after every record it builds (`time.sleep(0)`), so a serving loop coming back from a
    GIL-free model call waits at most one record's build for the GIL, not the 5 ms switch interval."""

    def __init__(self, builder: SpanBuilder, capacity: int, poll_interval_s: float, tick: Callable[[], None]) -> None:
        self._builder = builder
        self._handoffs = HandOffs(capacity)
        self.submit_request, self.submit_step = self._handoffs.requests.offer, self._handoffs.steps.offer
        self._poll_interval_s = poll_interval_s
        self._tick = tick
        self._done = 0  # records built (or failed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phaselens-span-builder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        lower_priority()
        while not self._stop.is_set():
            self._tick()
            if not self._drain():
                self._stop.wait(self._poll_interval_s)
        self._drain()

    def _drain(self) -> bool:
        """Build what is waiting; True when there was anything."""
        records = self._handoffs.take()
        for record in records:
            self._builder.build(record)
            self._done += 1
            time.sleep(0)  # hand the GIL to a waiting serving loop
        return bool(records)

    def flush(self, timeout_s: float) -> bool:
        return wait_until(lambda: self._done >= self._handoffs.accepted(), timeout_s)

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._handoffs.close()  # from now on a submit is counted as dropped

    def counters(self) -> dict[str, int]:
        return {**self._handoffs.counters(), **self._builder.counters()}
