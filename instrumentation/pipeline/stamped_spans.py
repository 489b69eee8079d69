"""Spans the request tree does not hold (a transfer between instances, a router's hop), made after
the fact from monotonic stamps of this process.

Ids are chosen up front (`new_span_id`, `decide_root`), so a caller can send a span's context to
another process before the span exists; the span is made later on a one-thread executor (never a
serving loop, never an event loop), as a finished ReadableSpan (`SpanEmitter`), its times placed by
the process's clock anchor: `wall_ts = anchor.wall_ts + (mono_ts − anchor.mono_ts)` (ns). Every call is a
no-op without an SDK tracer provider to emit to.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from opentelemetry import propagate
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phaselens.common.clocks import MonoTs
from phaselens.instrumentation.hotpath.clock import ClockAnchor, process_anchor
from phaselens.instrumentation.hotpath.ids import RootDecider
from phaselens.instrumentation.hotpath.records import SpanIds
from phaselens.instrumentation.pipeline.emitter import SpanEmitter

_PROPAGATOR = TraceContextTextMapPropagator()
log = logging.getLogger(__name__)


def traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The W3C `traceparent` header of a span context given as integers."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def parse_traceparent(value: str) -> SpanContext | None:
    """The remote span context of a `traceparent` header; None when absent or malformed."""
    context = get_current_span(_PROPAGATOR.extract({"traceparent": value})).get_span_context()
    return context if context.is_valid else None


class StampedSpans:
    """Emits spans made from monotonic stamps through `tracer_provider`'s processors; counts what it
    emitted and what failed (a telemetry failure is logged and counted, never raised to the caller)."""

    def __init__(self, tracer_provider: Any = None, anchor: ClockAnchor | None = None) -> None:
        self._emitter = SpanEmitter.of_provider(tracer_provider) if tracer_provider is not None else None
        self._anchor = anchor or process_anchor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stamped-spans") if self._emitter else None
        # without an emitter every request is unsampled: nothing could carry its spans
        emitter = self._emitter
        self._roots = RootDecider(emitter.sampler, emitter.ids) if emitter else RootDecider(None, RandomIdGenerator())
        self.emitted = 0
        self.failed = 0

    @property
    def enabled(self) -> bool:
        return self._emitter is not None

    def new_span_id(self) -> int:
        """A span id for a span emitted later (0 when nothing is emitted)."""
        return self._emitter.ids.generate_span_id() if self._emitter else 0

    def decide_root(self, headers: Mapping[str, str], name: str) -> tuple[SpanIds, SpanIds | None]:
        """(the ids of a SERVER span for an incoming request, its remote parent's or None), the
        sampling decided now as the SDK would, without starting a span."""
        return self._roots.decide(propagate.extract(dict(headers)), name)

    def submit(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ts: MonoTs,
        end_ts: MonoTs,
        attrs: Mapping[str, Any],
        error: str = "",
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> None:
        """Make and emit the span on the executor; `start_ts`/`end_ts` are monotonic instants (ns)
        of this process; an attribute whose value is None is left out; `error` sets the ERROR status."""
        if self._pool is None:
            return
        self._pool.submit(self._emit_counted, name, context, parent, start_ts, end_ts, attrs, error, kind)

    def _emit_counted(self, *args: Any) -> None:
        try:
            self._emit(*args)
        except Exception:  # any SDK or processor failure: count it, keep serving
            self.failed += 1
            log.exception("a stamped span could not be emitted (%d so far)", self.failed)

    def _emit(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ts: MonoTs,
        end_ts: MonoTs,
        attrs: Mapping[str, Any],
        error: str,
        kind: SpanKind,
    ) -> None:
        assert self._emitter is not None
        attributes = {k: v for k, v in attrs.items() if v is not None}
        status = Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET)
        to_wall = self._anchor.to_wall_ts
        span = self._emitter.span(
            name, context, parent, to_wall(start_ts), to_wall(end_ts), attributes, kind=kind, status=status
        )
        self._emitter.emit([span])
        self.emitted += 1

    def shutdown(self) -> None:
        """Emit what is queued (before the providers flush)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
