"""The span-builder thread: drains the hand-offs and turns records into spans and metrics.

It polls (the producers only do a deque append: no Event, no lock on the loop thread). A request
handed over before the engine is done with it (a client that disconnected mid-stream) waits in
`pending` until the engine stamps `finished`, or at most `engine_grace_ns`, so its spans are built
from a timeline no one writes any more. A failure while building is counted, never raised.

Staying out of the loop's way: the thread runs at a lower CPU priority (nice +10, Linux, best
effort) and gives up the GIL after every record it builds (`time.sleep(0)`), so a serving loop
coming back from a GIL-free model call waits at most one record's build for the GIL, not the
interpreter's 5 ms switch interval.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from .clock import ClockAnchor, ClockNs
from .genai_metrics import GenAiServerMetrics
from .handle import RequestHandle
from .phases import compute_phases
from .spans import SpanWriter, build_request_spans, build_step_span
from .timeline import BoundedHandOff, StepRecord

_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BuildOptions:
    token_events: bool = False
    engine_grace_ns: int = 5_000_000_000


class PendingRequests:
    """Requests closed before the engine was done with them (a client that left mid-stream): held
    until the engine stamps `finished`, or `grace_ns` after `responded`, so no one writes a
    timeline while it is read."""

    __slots__ = ("_clock_ns", "grace_ns", "_items")

    def __init__(self, clock_ns: ClockNs, grace_ns: int) -> None:
        self._clock_ns = clock_ns
        self.grace_ns = grace_ns
        self._items: list[RequestHandle] = []

    def add(self, handle: RequestHandle) -> None:
        self._items.append(handle)

    def take_ready(self, force: bool) -> list[RequestHandle]:
        """The requests ready to read (all of them with `force`); the rest stay."""
        if not self._items:
            return []
        now, grace = self._clock_ns(), self.grace_ns
        ready, waiting = [], []
        for handle in self._items:
            done = force or handle.engine_done or now - handle.responded_ns >= grace
            (ready if done else waiting).append(handle)
        self._items = waiting
        return ready

    def __len__(self) -> int:
        return len(self._items)


COUNTERS = ("requests_built", "requests_unsampled", "steps_built", "steps_unsampled", "build_errors")


class SpanBuilder:
    """Consumes `requests` (RequestHandle) and `steps` (StepRecord) on a daemon thread."""

    def __init__(self, tracer: Tracer, metrics: GenAiServerMetrics, anchor: ClockAnchor, clock_ns: ClockNs,
                 requests: BoundedHandOff, steps: BoundedHandOff, options: BuildOptions,
                 poll_interval_s: float) -> None:
        self._writer = SpanWriter(tracer, anchor)
        self._metrics = metrics
        self._requests = requests
        self._steps = steps
        self._options = options
        self._poll_interval_s = poll_interval_s
        self._pending = PendingRequests(clock_ns, options.engine_grace_ns)
        self._done = 0  # records built (or failed): a flush is complete when all accepted ones are
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phaselens-span-builder", daemon=True)
        self._counts = dict.fromkeys(COUNTERS, 0)  # written by the builder thread only

    def start(self) -> None:
        self._thread.start()

    def counters(self) -> dict[str, int]:
        return {**self._counts, "spans_built": self._writer.ended, "requests_pending": len(self._pending)}

    def flush(self, timeout_s: float) -> bool:
        """Wait until every record handed off so far has been built (pending ones included)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # counted from what the hand-offs accepted: a record just taken but not built still counts
            if self._done >= sum(h.offered - h.dropped for h in (self._requests, self._steps)):
                return True
            time.sleep(0.002)
        return False

    def stop(self, timeout_s: float) -> None:
        """Build everything left (pending requests without waiting for the engine), then stop."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
            pass
        while not self._stop.is_set():
            if not self._drain(force=False):
                self._stop.wait(self._poll_interval_s)
        self._drain(force=True)

    def _drain(self, force: bool) -> bool:
        """Build what is ready; True when anything was taken."""
        took = False
        while (step := self._steps.take()) is not None:
            took = True
            self._guarded(self._build_step, step)
        while (handle := self._requests.take()) is not None:
            took = True
            self._pending.add(handle)
        for handle in self._pending.take_ready(force):
            self._guarded(self._build_request, handle)
        return took

    def _guarded(self, build, record) -> None:
        try:
            build(record)
        except Exception:  # telemetry must never take the server down; count and log once per kind
            self._counts["build_errors"] += 1
            if self._counts["build_errors"] == 1:
                _logger.exception("phaselens: building spans failed (counted in build_errors)")
        finally:
            self._done += 1
            time.sleep(0)  # hand the GIL to a waiting serving loop

    def _build_request(self, handle: RequestHandle) -> None:
        phases = compute_phases(handle)
        self._metrics.record(handle, phases)
        if not handle.sampled:
            self._counts["requests_unsampled"] += 1
            return
        build_request_spans(self._writer, handle, phases, self._options.token_events)
        self._counts["requests_built"] += 1

    def _build_step(self, step: StepRecord) -> None:
        if build_step_span(self._writer, step):
            self._counts["steps_built"] += 1
        else:
            self._counts["steps_unsampled"] += 1
