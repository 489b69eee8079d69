"""Steady span load through the real OpenTelemetry SDK: tracer → BatchSpanProcessor → OTLPSpanExporter
(gRPC), with a ledger of what the SDK reported for every span.

What a client loses is decided by the SDK, not by us: its exporter retries retryable codes
(UNAVAILABLE, RESOURCE_EXHAUSTED, honouring RetryInfo) with backoff until its timeout, then gives
the batch up; while an export blocks, the processor's queue fills and drops what does not fit. The
ledger sees both: a span ended but never handed to the exporter was dropped from the queue, a span
in a batch the exporter gave up on was dropped after the retry budget.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

EXPORT_TIMEOUT_S = 10.0  # the SDK's default OTEL_EXPORTER_OTLP_TIMEOUT: its whole retry budget per batch
QUEUE_SPANS = 20_000  # OTEL_BSP_MAX_QUEUE_SIZE (SDK default 2048): ~10 s of this load, a restart's worth
SCHEDULE_DELAY_MS = 200


@dataclass(slots=True)
class Ledger:
    """Per span id (hex), what the SDK said; thread-safe through `lock`."""

    sent: int = 0  # spans ended (handed to the processor)
    acknowledged: set[str] = field(default_factory=set)
    given_up: int = 0  # spans in batches the exporter returned FAILURE for
    handed: int = 0  # spans the processor passed to the exporter
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client_dropped(self) -> int:
        """Queue drops + spans the exporter gave up on (once the processor is flushed)."""
        return (self.sent - self.handed) + self.given_up


class _Recording(SpanExporter):
    """The real OTLP exporter, with the outcome of each batch written to the ledger."""

    def __init__(self, inner: OTLPSpanExporter, ledger: Ledger):
        self._inner, self._ledger = inner, ledger

    def export(self, spans) -> SpanExportResult:
        result = self._inner.export(spans)
        with self._ledger.lock:
            self._ledger.handed += len(spans)
            if result is SpanExportResult.SUCCESS:
                self._ledger.acknowledged.update(format(s.context.span_id, "016x") for s in spans)
            else:
                self._ledger.given_up += len(spans)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


@dataclass(slots=True)
class SpanLoad:
    """`senders` SDK pipelines, each ending spans at `spans_per_s / senders` until stop() (or `max_s`)."""

    endpoint: str  # host:port of an OTLP/gRPC receiver
    service: str
    spans_per_s: float = 2000.0
    senders: int = 2
    max_s: float = 600.0  # a bound: the load stops itself
    ledger: Ledger = field(default_factory=Ledger)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False)
    _providers: list[TracerProvider] = field(default_factory=list, init=False)

    def start(self) -> SpanLoad:
        for i in range(self.senders):
            exporter = OTLPSpanExporter(endpoint=f"http://{self.endpoint}", insecure=True, timeout=EXPORT_TIMEOUT_S)
            provider = TracerProvider(resource=Resource.create({"service.name": self.service}))
            provider.add_span_processor(
                BatchSpanProcessor(
                    _Recording(exporter, self.ledger),
                    max_queue_size=QUEUE_SPANS,
                    schedule_delay_millis=SCHEDULE_DELAY_MS,
                    export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000),
                )
            )
            self._providers.append(provider)
            thread = threading.Thread(target=self._emit, args=(provider, i), name=f"fault-load-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def _emit(self, provider: TracerProvider, index: int) -> None:
        tracer = provider.get_tracer("phaselens.faults")
        interval_s = self.senders / self.spans_per_s
        started = next_at = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - started < self.max_s:
            with tracer.start_as_current_span("fault.request", attributes={"sender": index}):
                tracer.start_span("fault.phase").end()
            with self.ledger.lock:
                self.ledger.sent += 2
            next_at += 2 * interval_s
            if (delay := next_at - time.monotonic()) > 0:
                self._stop.wait(delay)

    def stop(self, flush_timeout_s: float = 30.0) -> Ledger:
        """Stops emitting, then lets each processor export what it holds (its retries included)."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for provider in self._providers:
            provider.force_flush(int(flush_timeout_s * 1000))
            provider.shutdown()
        return self.ledger
