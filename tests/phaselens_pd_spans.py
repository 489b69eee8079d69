"""Spans of one request through phaselens's own disaggregated serving (reference_server/pd), built as
its router, prefill and decode instances emit them (real OpenTelemetry SDK; the caller's providers
export them over OTLP): the router's SERVER span with its terms (router_spans.py), each instance's
SERVER span with its phase terms, the prefill instance's `llm.kv_transfer` and the decode instance's
`llm.kv_receive` (pd_spans.py). Every figure is a duration on its emitter's clock; the hops are what
the caller's call took beyond the callee's answer, so the P/D terms add up to client TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phaselens.instrumentation import names as n
from tests.native_spans import MS, client_span

INSTANCES = {"router": "http://router-0:8000", "prefill": "http://prefill-0:8100", "decode": "http://decode-0:8200"}
KV_BYTES = 81920


@dataclass(frozen=True, slots=True)
class PdRequest:
    """One request's terms (ms); the edges (client send/read, the router's inbound) None where unstamped."""

    prefill: tuple[float, float, float, float]  # ingress, queue, prefill, first token
    kv_wait_ms: float
    kv_transfer_ms: float
    respond_ms: float
    decode: tuple[float, float, float, float]  # ingress, queue, first token, first chunk
    router: tuple[float, float, float]  # ingress, gap, relay
    hops_ms: tuple[float, float]  # prefill hop, decode hop
    network_ms: float  # the residual, with no edge stamped
    client_send_ms: float | None = None
    client_read_ms: float | None = None
    inbound_ms: float | None = None

    @property
    def answer_ms(self) -> float:
        return sum(self.prefill) + self.kv_wait_ms + self.kv_transfer_ms + self.respond_ms

    @property
    def router_ttfc_ms(self) -> float:
        return sum(self.router) + sum(self.hops_ms) + self.answer_ms + sum(self.decode)

    @property
    def client_ttft_ms(self) -> float:
        edges = (self.client_send_ms, self.client_read_ms, self.inbound_ms)
        return self.router_ttfc_ms + self.network_ms + sum(e or 0.0 for e in edges)


def provider(endpoint: str, role: str) -> TracerProvider:
    """A P/D process's provider, its role and instance in the resource as reference_server/pd sets them."""
    resource = Resource.create(
        {"service.name": f"phaselens-{role}", n.PL_PD_ROLE: role, n.PL_PD_INSTANCE: INSTANCES[role]}
    )
    tp = TracerProvider(resource=resource)
    tp.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return tp


def _server(tracer, start_ns: int, headers: dict[str, str], end_ms: float, attrs: dict):
    span = tracer.start_span(
        n.root_span_name(n.OP_TEXT_COMPLETION, "tiny"),
        kind=SpanKind.SERVER,
        start_time=start_ns,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes={n.GEN_AI_OPERATION_NAME: n.OP_TEXT_COMPLETION, n.GEN_AI_REQUEST_MODEL: "tiny", **attrs},
    )
    return span, start_ns + round(end_ms * MS)


def emit(tracers: dict[str, object], r: PdRequest, start_ns: int) -> str:
    """The request's client, router, prefill and decode spans; returns its trace id."""
    (p_ingress, p_queue, p_prefill, p_first), (d_ingress, d_queue, d_first, d_chunk) = r.prefill, r.decode
    r_ingress, r_gap, r_relay = r.router
    prefill_call_ms, decode_first_chunk_ms = r.hops_ms[0] + r.answer_ms, r.hops_ms[1] + sum(r.decode)
    client, headers = client_span(tracers["client"], start_ns, r.client_ttft_ms, r.client_ttft_ms + 40.0)
    stamps = {n.PL_CLIENT_SEND_MS: r.client_send_ms, n.PL_CLIENT_READ_MS: r.client_read_ms}
    client.set_attributes({k: v for k, v in stamps.items() if v is not None})
    router_terms = {
        n.PL_ROUTER_INGRESS_MS: r_ingress,
        n.PL_ROUTER_PREFILL_CALL_MS: prefill_call_ms,
        n.PL_ROUTER_GAP_MS: r_gap,
        n.PL_ROUTER_DECODE_FIRST_CHUNK_MS: decode_first_chunk_ms,
        n.PL_ROUTER_RELAY_MS: r_relay,
        n.PL_SERVER_TTFT_MS: r.router_ttfc_ms - r_relay,
        n.PL_SERVER_TTFC_MS: r.router_ttfc_ms,
        n.PL_INGRESS_MS: r_ingress,
        **({n.PL_INBOUND_MS: r.inbound_ms} if r.inbound_ms is not None else {}),
    }
    router, router_end = _server(tracers["router"], start_ns, headers, r.router_ttfc_ms + 30.0, router_terms)
    prefill_phases = {n.PL_INGRESS_MS: p_ingress, n.PL_QUEUE_MS: p_queue, n.PL_PREFILL_MS: p_prefill}
    prefill, prefill_end = _server(
        tracers["prefill"], start_ns, headers, r.answer_ms + 0.5, {**prefill_phases, n.PL_FIRST_TOKEN_MS: p_first}
    )
    kv_start = start_ns + round((sum(r.prefill) + r.kv_wait_ms) * MS)
    tracers["prefill"].start_span(
        n.SPAN_KV_TRANSFER,
        start_time=kv_start,
        context=trace.set_span_in_context(prefill),
        attributes={
            n.PL_KV_BYTES: KV_BYTES,
            n.PL_KV_WAIT_MS: r.kv_wait_ms,
            n.PL_KV_TRANSFER_MS: r.kv_transfer_ms,
            n.PL_PD_PREFILL_ANSWER_MS: r.answer_ms,
        },
    ).end(end_time=kv_start + round(r.kv_transfer_ms * MS))
    decode_terms = {n.PL_INGRESS_MS: d_ingress, n.PL_QUEUE_MS: d_queue, n.PL_PREFILL_MS: 0.0}
    decode_terms |= {n.PL_FIRST_TOKEN_MS: d_first, n.PL_FIRST_CHUNK_MS: d_chunk, n.PL_SERVER_TTFC_MS: sum(r.decode)}
    decode, decode_end = _server(tracers["decode"], start_ns, headers, sum(r.decode) + 30.0, decode_terms)
    receive = tracers["decode"].start_span(
        n.SPAN_KV_RECEIVE,
        start_time=kv_start,
        context=trace.set_span_in_context(decode),
        attributes={n.PL_KV_BYTES: KV_BYTES},
    )
    receive.end(end_time=kv_start + round(r.kv_transfer_ms * MS))
    for span, end in ((prefill, prefill_end), (decode, decode_end), (router, router_end)):
        span.end(end_time=end)
    client.end(end_time=start_ns + round((r.client_ttft_ms + 40.0) * MS))
    return f"{client.get_span_context().trace_id:032x}"
