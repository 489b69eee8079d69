"""The spans of disaggregated serving that the request tree of one instance does not hold: the KV
transfer on the prefill instance, the KV receive on the decode instance (docs/disaggregation.md).

Times are stamped as monotonic integers where things happen; the spans are made later by
instrumentation's `StampedSpans`, with ids chosen up front, so the prefill instance can put the
transfer span's context into the KV header before the span exists: the receive span on the decode
instance is its child, on the decode instance's clock. Every duration attribute is a difference
of two stamps of the emitting process.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanContext, TraceFlags

from phaselens.common.clocks import MonoTs
from phaselens.instrumentation import names
from phaselens.instrumentation.pipeline import StampedSpans, parse_traceparent, traceparent
from phaselens.reference_server.engine.disagg import KvHandoff, ReceivedKv

KV_ERROR_TYPE = "kv_transfer_failed"


def ms(start_ts: MonoTs, end_ts: MonoTs) -> float:
    return (end_ts - start_ts) / 1e6


class PdSpans(StampedSpans):
    """The P/D spans of one instance; every call is a no-op without a tracer provider (or for an
    unsampled request)."""

    def kv_send_traceparent(self, handle: Any) -> str:
        """The context of this request's future llm.kv_transfer span ('' when it is not traced)."""
        root = getattr(handle, "root", None)
        if not self.enabled or root is None or not root.trace_flags & TraceFlags.SAMPLED:
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
            names.ERROR_TYPE: KV_ERROR_TYPE if handoff.error else None,
        }
        self.submit(
            names.SPAN_KV_TRANSFER, context, parent, handoff.send_start_ts, handoff.ack_ts, attrs, handoff.error
        )

    def kv_received(self, received: ReceivedKv, done_ts: MonoTs) -> None:
        """llm.kv_receive, child of the sender's llm.kv_transfer: accepted → staged and acknowledged."""
        transfer = received.transfer
        parent = parse_traceparent(str(transfer.header.get("traceparent", "")))
        if parent is None or not self.enabled:
            return
        context = SpanContext(parent.trace_id, self.new_span_id(), False, parent.trace_flags)
        attrs: dict[str, Any] = {
            names.PL_PD_TRANSFER_ID: received.transfer_id,
            names.PL_KV_BYTES: transfer.nbytes,
            names.PL_KV_READ_MS: ms(transfer.accepted_ts, received.received_ts),
            names.PL_KV_STAGE_MS: ms(received.received_ts, done_ts),
            names.ERROR_TYPE: KV_ERROR_TYPE if received.error else None,
        }
        self.submit(names.SPAN_KV_RECEIVE, context, parent, transfer.accepted_ts, done_ts, attrs, received.error)
