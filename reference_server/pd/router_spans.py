"""The router's telemetry: per request, monotonic stamps on the event loop (`RouterRecord`), and at
its end a SERVER span with two CLIENT children, made by instrumentation's `StampedSpans`.

Router terms (ms, router clock; docs/disaggregation.md), for a streamed request that went through
both instances:

    ingress            = prefill_start − received
    prefill_call       = prefill_end − prefill_start          (the pd.prefill_call span)
    gap                = decode_start − prefill_end
    decode_first_chunk = first_chunk − decode_start            (first content chunk back from decode)
    relay              = relayed − first_chunk                 (that chunk handed to the router's send)
    router TTFC        = relayed − received = the sum of the five, exactly

The router's SERVER span carries TTFT (received → first content chunk back) and TTFC as the
phaselens server keys, so the per-request row of a disaggregated request has the server view the
client talks to; the instances' spans hold the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from phaselens.common.clocks import NOT_STAMPED, MonoTs
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath import SpanIds, span_context
from phaselens.instrumentation.pipeline import StampedSpans, traceparent
from phaselens.reference_server.pd.pd_spans import ms


@dataclass(slots=True)
class RouterRecord:
    received_ts: MonoTs
    chat: bool = False
    model: str = ""
    stream: bool = False
    transfer_id: str = ""
    request_id: str = ""  # the X-Request-ID both instances got (the client's, else the router's)
    prefill_url: str = ""
    decode_url: str = ""
    prefill_start_ts: MonoTs = NOT_STAMPED
    prefill_end_ts: MonoTs = NOT_STAMPED
    decode_start_ts: MonoTs = NOT_STAMPED
    first_chunk_ts: MonoTs = NOT_STAMPED  # the first content chunk arrived from the decode instance
    relayed_ts: MonoTs = NOT_STAMPED  # ... and was handed to the router's send
    done_ts: MonoTs = NOT_STAMPED
    error_type: str = ""
    status_code: int = 200
    root: SpanIds | None = None
    parent: SpanIds | None = None
    prefill_span_id: int = 0
    decode_span_id: int = 0

    def fail(self, error_type: str, status_code: int) -> None:
        if not self.error_type:
            self.error_type, self.status_code = error_type, status_code

    @property
    def sampled(self) -> bool:
        return self.root is not None and bool(self.root.trace_flags & TraceFlags.SAMPLED)

    def terms_ms(self) -> dict[str, float]:
        """The router terms that this request's stamps define (module docstring)."""
        pairs = {
            names.PL_ROUTER_INGRESS_MS: (self.received_ts, self.prefill_start_ts),
            names.PL_ROUTER_PREFILL_CALL_MS: (self.prefill_start_ts, self.prefill_end_ts),
            names.PL_ROUTER_GAP_MS: (self.prefill_end_ts, self.decode_start_ts),
            names.PL_ROUTER_DECODE_FIRST_CHUNK_MS: (self.decode_start_ts, self.first_chunk_ts),
            names.PL_ROUTER_RELAY_MS: (self.first_chunk_ts, self.relayed_ts),
            names.PL_SERVER_TTFT_MS: (self.received_ts, self.first_chunk_ts),
            names.PL_SERVER_TTFC_MS: (self.received_ts, self.relayed_ts),
            names.PL_INGRESS_MS: (self.received_ts, self.prefill_start_ts),
        }
        return {key: ms(a, b) for key, (a, b) in pairs.items() if a and b and b >= a}


class RouterSpans:
    def __init__(self, spans: StampedSpans) -> None:
        self._spans = spans

    def open(self, rec: RouterRecord, headers: Mapping[str, str]) -> None:
        """Decide the request's ids at receipt (child of an incoming traceparent)."""
        rec.root, rec.parent = self._spans.decide_root(headers, "POST")
        if rec.sampled:
            rec.prefill_span_id, rec.decode_span_id = self._spans.new_span_id(), self._spans.new_span_id()

    def prefill_traceparent(self, rec: RouterRecord) -> str:
        return traceparent(rec.root.trace_id, rec.prefill_span_id, rec.root.trace_flags) if rec.sampled else ""

    def decode_traceparent(self, rec: RouterRecord) -> str:
        return traceparent(rec.root.trace_id, rec.decode_span_id, rec.root.trace_flags) if rec.sampled else ""

    def close(self, rec: RouterRecord) -> None:
        """Emit the request's spans (off the event loop)."""
        if not rec.sampled or rec.root is None:
            return
        end_ts = max(rec.done_ts, rec.relayed_ts, rec.prefill_end_ts, rec.received_ts)
        root = span_context(rec.root)
        operation = names.OP_CHAT if rec.chat else names.OP_TEXT_COMPLETION
        attrs: dict[str, Any] = {
            names.GEN_AI_OPERATION_NAME: operation,
            names.GEN_AI_PROVIDER_NAME: names.PROVIDER_PHASELENS,
            names.GEN_AI_REQUEST_MODEL: rec.model,
            names.GEN_AI_REQUEST_STREAM: rec.stream,
            names.HTTP_RESPONSE_STATUS_CODE: rec.status_code,
            names.PL_PD_TRANSFER_ID: rec.transfer_id,
            names.PL_ROUTER_PREFILL: rec.prefill_url,
            names.PL_ROUTER_DECODE: rec.decode_url,
            **rec.terms_ms(),
        }
        if rec.request_id:
            attrs[names.HTTP_REQUEST_HEADER_X_REQUEST_ID] = [rec.request_id[: names.X_REQUEST_ID_MAX_CHARS]]
        if rec.error_type:
            attrs[names.ERROR_TYPE] = rec.error_type
        parent = span_context(rec.parent, is_remote=True) if rec.parent else None
        name = names.root_span_name(operation, rec.model)
        self._spans.submit(name, root, parent, rec.received_ts, end_ts, attrs, rec.error_type, kind=SpanKind.SERVER)
        for span_id, start, end, span_name, url in (
            (
                rec.prefill_span_id,
                rec.prefill_start_ts,
                rec.prefill_end_ts,
                names.SPAN_PD_PREFILL_CALL,
                rec.prefill_url,
            ),
            (rec.decode_span_id, rec.decode_start_ts, rec.done_ts, names.SPAN_PD_DECODE_CALL, rec.decode_url),
        ):
            if start and end:
                child = SpanContext(root.trace_id, span_id, False, root.trace_flags)
                self._spans.submit(span_name, child, root, start, end, {names.URL_PATH: url}, kind=SpanKind.CLIENT)
