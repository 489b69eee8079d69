"""A request's incoming context: what `opentelemetry.propagate.extract` gives, cheaper on the event loop.

With the default global propagator (W3C TraceContext + Baggage, as OTEL_PROPAGATORS unset builds
it) a request carrying a well-formed version-00 `traceparent`, at most one `tracestate` value within
its length limit and no `baggage` is the common case: its context is built here directly, as the
TraceContext propagator builds it, without the composite's per-propagator calls, the getter's list
per header and the Baggage propagator's pass. Anything else (another propagator, baggage, an
invalid, over-long or other-version traceparent, an over-long tracestate) goes through
`propagate.extract` itself, so its result and its warnings are OTel's own.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator as _TraceContext
from opentelemetry.trace.span import _TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH, TraceState

_DEFAULT_KINDS = [_TraceContext, W3CBaggagePropagator]
# the propagator's own pattern and limit: a header it rejects is never accepted here
_TRACEPARENT = _TraceContext._TRACEPARENT_HEADER_FORMAT_RE
_TRACEPARENT_MAX = _TraceContext._TRACEPARENT_MAXIMUM_LENGTH
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
# the only headers the default propagator reads, and the request id the server keeps
FAST_HEADERS = frozenset((b"traceparent", b"tracestate", b"baggage", b"x-request-id"))


def is_default(propagator: Any) -> bool:
    """The composite OTel builds when OTEL_PROPAGATORS is unset (or "tracecontext,baggage"): these
    exact classes, so a subclass or a reordered list keeps its own extract."""
    kinds = getattr(propagator, "_propagators", None)  # the composite's list; no public accessor
    return type(propagator) is CompositePropagator and [type(p) for p in kinds or ()] == _DEFAULT_KINDS


def headers_carrier(scope: MutableMapping[str, Any], wanted: frozenset[bytes] | None = None) -> dict[str, str]:
    """ASGI headers as a carrier for the propagator (lower-case names; repeated ones joined with ","),
    only those named in `wanted` when given."""
    carrier: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers") or ():
        if wanted is not None and raw_name.lower() not in wanted:
            continue
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        carrier[name] = f"{carrier[name]},{value}" if name in carrier else value
    return carrier


def _fast_context(carrier: dict[str, str]) -> Context | None:
    """The context the default propagator extracts, or None where this path does not decide it."""
    if "baggage" in carrier:
        return None
    header = carrier.get("traceparent")
    if header is None:
        return Context()
    match = _TRACEPARENT.search(header) if len(header) <= _TRACEPARENT_MAX else None
    if match is None or match.group(5) or match.group(1) != "00":
        return None
    trace_id, span_id, flags = match.group(2, 3, 4)
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    state = carrier.get("tracestate")
    if state is not None and len(state) > _TRACECONTEXT_MAXIMUM_TRACESTATE_LENGTH:
        return None
    span_context = trace.SpanContext(
        trace_id=int(trace_id, 16),
        span_id=int(span_id, 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(flags, 16)),
        trace_state=None if state is None else TraceState.from_header([state]),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context), Context())


class IncomingExtractor:
    """`extract(scope)` -> (the carrier, the incoming context), as `propagate.extract` over the
    scope's headers would give; the carrier holds only FAST_HEADERS while the global propagator is
    the default one (it reads no other), every header otherwise. The global propagator is looked up
    per call: one set later (`set_global_textmap`) is honoured."""

    __slots__ = ("_fast", "_seen")

    def __init__(self) -> None:
        self._seen: Any = None
        self._fast = False

    def extract(self, scope: MutableMapping[str, Any]) -> tuple[dict[str, str], Context]:
        propagator = propagate.get_global_textmap()
        if propagator is not self._seen:
            self._seen, self._fast = propagator, is_default(propagator)
        if not self._fast:
            carrier = headers_carrier(scope)
            return carrier, propagate.extract(carrier)
        carrier = headers_carrier(scope, FAST_HEADERS)
        context = _fast_context(carrier)
        return carrier, propagate.extract(carrier) if context is None else context
