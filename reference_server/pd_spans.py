"""The spans of disaggregated serving that the request tree of one instance does not hold: the KV
transfer on the prefill instance, the KV receive on the decode instance (docs/disaggregation.md).

Times are stamped as monotonic integers where things happen; the span is made later, on a
one-thread executor (never the engine loop, never the event loop), as a finished ReadableSpan
(instrumentation.emitter) with ids chosen up front, so the prefill instance can put the transfer
span's context into the KV header before the span exists: the receive span on the decode
instance is its child, on the decode instance's clock. Every duration attribute is a difference
of two stamps of the emitting process.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phaselens.common.clocks import MonoTs
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.clock import ClockAnchor, process_anchor
from phaselens.instrumentation.pipeline.emitter import SpanEmitter
from phaselens.reference_server.disagg import KvHandoff, ReceivedKv

_PROPAGATOR = TraceContextTextMapPropagator()
log = logging.getLogger(__name__)


def traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def parse_traceparent(value: str) -> SpanContext | None:
    from opentelemetry.trace import get_current_span

    context = get_current_span(_PROPAGATOR.extract({"traceparent": value})).get_span_context()
    return context if context.is_valid else None


def ms(start_ts: MonoTs, end_ts: MonoTs) -> float:
    return (end_ts - start_ts) / 1e6


class PdSpans:
    """Emits P/D spans through `tracer_provider`'s processors; every call is a no-op without one
    (or for an unsampled request)."""

    def __init__(self, tracer_provider: Any = None, anchor: ClockAnchor | None = None) -> None:
        self._emitter = SpanEmitter.of_provider(tracer_provider) if tracer_provider is not None else None
        self._anchor = anchor or process_anchor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pd-spans") if self._emitter else None
        self.emitted = 0
        self.failed = 0  # spans that could not be made or handed to the processors (logged, counted)

    def new_span_id(self) -> int:
        return self._emitter.ids.generate_span_id() if self._emitter else 0

    def kv_send_traceparent(self, handle: Any) -> str:
        """The context of this request's future llm.kv_transfer span ('' when it is not traced)."""
        root = getattr(handle, "root", None)
        if self._emitter is None or root is None or not root.trace_flags & TraceFlags.SAMPLED:
            return ""
        return traceparent(root.trace_id, self.new_span_id(), root.trace_flags)

    def kv_sent(self, handle: Any, handoff: KvHandoff, answer_ts: MonoTs) -> None:
        """llm.kv_transfer, child of the prefill instance's SERVER span: send start → acknowledgement;
        with the request's received → answer built (`answer_ts`, before the framework sends it: the
        SERVER span ends after `send` returned, which may be after the router read the answer)."""
        context = parse_traceparent(handoff.traceparent)
        if context is None:
            return
        root = handle.root
        parent = SpanContext(root.trace_id, root.span_id, False, TraceFlags(root.trace_flags))
        host, port = handoff.address
        attrs: dict[str, Any] = {
            names.PL_PD_TRANSFER_ID: handoff.transfer_id,
            names.PL_KV_BYTES: handoff.kv_bytes,
            names.PL_KV_ACKED_BYTES: handoff.received_bytes,
            names.PL_KV_TRANSFER_MS: ms(handoff.send_start_ts, handoff.ack_ts),
            names.PL_KV_WAIT_MS: ms(handle.first_token_ts, handoff.send_start_ts) if handle.first_token_ts else None,
            names.PL_KV_PEER: f"{host}:{port}",
            names.PL_PD_PREFILL_ANSWER_MS: ms(handle.received_ts, answer_ts),
        }
        self.submit(
            names.SPAN_KV_TRANSFER, context, parent, handoff.send_start_ts, handoff.ack_ts, attrs, handoff.error
        )

    def kv_received(self, received: ReceivedKv, done_ts: MonoTs) -> None:
        """llm.kv_receive, child of the sender's llm.kv_transfer: accepted → staged and acknowledged."""
        transfer = received.transfer
        parent = parse_traceparent(str(transfer.header.get("traceparent", "")))
        if parent is None or self._emitter is None:
            return
        context = SpanContext(parent.trace_id, self.new_span_id(), False, parent.trace_flags)
        attrs: dict[str, Any] = {
            names.PL_PD_TRANSFER_ID: received.transfer_id,
            names.PL_KV_BYTES: transfer.nbytes,
            names.PL_KV_READ_MS: ms(transfer.accepted_ts, received.received_ts),
            names.PL_KV_STAGE_MS: ms(received.received_ts, done_ts),
        }
        self.submit(names.SPAN_KV_RECEIVE, context, parent, transfer.accepted_ts, done_ts, attrs, received.error)

    def submit(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ts: MonoTs,
        end_ts: MonoTs,
        attrs: dict[str, Any],
        error: str = "",
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> None:
        """Make and emit the span on the executor; start/end are monotonic ns of this process."""
        if self._pool is None:
            return
        self._pool.submit(self._emit_counted, name, context, parent, start_ts, end_ts, attrs, error, kind)

    def _emit_counted(self, *args: Any) -> None:
        """A telemetry failure never reaches the request; it is counted in `failed`."""
        try:
            self._emit(*args)
        except Exception:  # any SDK or processor failure: count it, keep serving
            self.failed += 1
            log.exception("a P/D span could not be emitted (%d so far)", self.failed)

    def _emit(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ts: MonoTs,
        end_ts: MonoTs,
        attrs: dict[str, Any],
        error: str,
        kind: SpanKind,
    ) -> None:
        assert self._emitter is not None
        attributes = {k: v for k, v in attrs.items() if v is not None}
        status = Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET)
        if error:
            attributes.setdefault(names.ERROR_TYPE, "kv_transfer_failed")
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
