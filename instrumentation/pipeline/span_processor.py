"""A batch span processor that counts every span it loses.

The SDK's BatchSpanProcessor evicts from a `deque(maxlen)` without counting (it logs), and its
queue is private, so losses could only be guessed. This one keeps the same shape — bounded queue,
batches exported on a worker thread, `OTEL_BSP_*` settings — but the queue check and the append
happen under one lock (taken by the span builder and the export worker, never by the serving loop),
so `dropped` is exact: a span that finds the queue full is refused and counted. Spans in failed
(or raising) exports are counted in `failed`, delivered ones in `exported`.

Invariant once flushed: spans ended = exported + failed + dropped + suppressed.

As the SDK's own processors: exports run with instrumentation suppressed (the context key the SDK
sets, `_SUPPRESS_INSTRUMENTATION_KEY`), so an instrumented HTTP client inside the exporter makes no
span of its own call; and a span that ends while instrumentation is suppressed (such a span, if an
instrumentation made one anyway) is not queued, so export never feeds itself — it is counted in
`suppressed`. After a fork the child starts with an empty queue, fresh locks and its own export
thread (the parent's thread does not exist there), as the SDK's BatchSpanProcessor does.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, Context, attach, detach, get_current, set_value
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from phaselens.common.threads import name_os_thread

_logger = logging.getLogger(__name__)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


SDK_SCHEDULE_DELAY_MS = 5000  # the SDK's default OTEL_BSP_SCHEDULE_DELAY


def schedule_delay_ms() -> int:
    """OTEL_BSP_SCHEDULE_DELAY (ms, the SDK's default when unset); ValueError naming it when it is not
    an integer."""
    return _env_int("OTEL_BSP_SCHEDULE_DELAY", SDK_SCHEDULE_DELAY_MS)


@dataclass(slots=True)
class BatchSettings:
    """OTEL_BSP_MAX_QUEUE_SIZE, _MAX_EXPORT_BATCH_SIZE, _SCHEDULE_DELAY (ms); SDK defaults."""

    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    schedule_delay_ms: int = SDK_SCHEDULE_DELAY_MS

    @classmethod
    def from_env(cls) -> BatchSettings:
        queue = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        batch = min(queue, _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
        return cls(queue, batch, schedule_delay_ms())


@dataclass(slots=True)
class ExportCounts:
    exported: int = 0
    failed: int = 0
    dropped: int = 0
    suppressed: int = 0  # ended while instrumentation was suppressed (e.g. inside an export): not exported
    queued: int = 0  # spans ever put in the queue: a span's position, as the queue is first in, first out
    settled: int = 0  # of those, the first `settled` are exported or failed


class CountingBatchSpanProcessor(SpanProcessor):
    """Bounded queue → batches → `exporter` on a daemon thread; every loss counted in `counts`."""

    def __init__(self, exporter: SpanExporter, settings: BatchSettings | None = None) -> None:
        self.exporter = exporter
        self.settings = settings or BatchSettings.from_env()
        self.counts = ExportCounts()
        self.on_settled: Callable[[], None] | None = None  # called after each export (`settled` moved)
        self.full_batch_on_caller = False  # True: full batches are exported by the thread that filled them
        self._stopped = False
        self._start_worker()
        if hasattr(os, "register_at_fork"):  # weakly: the registration outlives the processor
            reinit = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (method := reinit()) and method())

    def _start_worker(self) -> None:
        self._queue: deque[ReadableSpan] = deque()
        self._lock = threading.Lock()  # guards _queue and counts
        self._export_lock = threading.Lock()  # one export at a time (worker or flush)
        self._wake = threading.Event()
        self._worker = threading.Thread(target=self._run, name="phaselens-span-export", daemon=True)
        self._worker.start()

    def _after_fork(self) -> None:
        """In a forked child: the parent's queued spans are the parent's to export; this process
        counts from zero (`counts` is the object export_counters() reads: reset in place)."""
        counts = self.counts
        counts.exported = counts.failed = counts.dropped = counts.suppressed = counts.queued = counts.settled = 0
        if not self._stopped:
            self._start_worker()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.offer([span])

    def offer(self, spans: list[Any]) -> None:
        """Queue what fits, refuse and count the rest; never blocks. The spans are the exporter's
        items: ReadableSpans from on_end, or encoded spans (bytes) from `otlp_fast.FastEmitter`."""
        if get_current().get(_SUPPRESS_INSTRUMENTATION_KEY):  # get_value's lookup, a call less
            with self._lock:
                self.counts.suppressed += len(spans)
            return
        queue, counts, settings = self._queue, self.counts, self.settings
        with self._lock:
            room = 0 if self._stopped else max(0, settings.max_queue_size - len(queue))
            if len(spans) <= room:  # no copy when all fit
                queue.extend(spans)
                counts.queued += len(spans)
            else:
                queue.extend(spans[:room])
                counts.queued += room
                counts.dropped += len(spans) - room
            full = len(queue) >= settings.max_export_batch_size
        if full and self.full_batch_on_caller:
            self._export_all(whole_batches=True)
        elif full:
            self._wake.set()

    def _run(self) -> None:
        name_os_thread("span-export")
        while not self._stopped:
            self._wake.wait(self.settings.schedule_delay_ms / 1000)
            self._wake.clear()
            self._export_all()

    def _take_batch(self, whole: bool) -> list[ReadableSpan]:
        """The next batch from the queue's front ([] when empty, or `whole` and short of a batch)."""
        with self._lock:
            size = self.settings.max_export_batch_size
            if whole and len(self._queue) < size:
                return []
            return [self._queue.popleft() for _ in range(min(len(self._queue), size))]

    def _export_all(self, whole_batches: bool = False) -> None:
        """Everything queued, in batches; `whole_batches`: only full ones, the rest waits for the next
        full batch or checkpoint (an export's CPU is mostly per request, not per span: the span-builder
        process's remainder exports of a few spans after each full one were ~1/3 of its exports)."""
        with self._export_lock:
            while batch := self._take_batch(whole_batches):
                self._export(batch)

    def _export(self, batch: list[ReadableSpan]) -> None:
        token = attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
        except Exception:  # an exporter bug must not kill the worker
            _logger.exception("phaselens: span export raised (counted as failed)")
            ok = False
        finally:
            detach(token)
        with self._lock:
            if ok:
                self.counts.exported += len(batch)
            else:
                self.counts.failed += len(batch)
            self.counts.settled += len(batch)  # batches leave the queue's front one export at a time
        if self.on_settled is not None:
            self.on_settled()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._export_all()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._worker.join()
        self._export_all()
        self.exporter.shutdown()
