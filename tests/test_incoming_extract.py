"""The server's incoming context (instrumentation/server/incoming.py) is `propagate.extract`'s."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import baggage, propagate, trace
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phaselens.instrumentation.server import incoming
from phaselens.instrumentation.server.incoming import IncomingExtractor, headers_carrier

TRACE_ID, SPAN_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
VALID = f"00-{TRACE_ID}-{SPAN_ID}-01"


def scope_of(*headers: tuple[str, str]) -> dict:
    plain = [(b"host", b"h:1"), (b"content-type", b"application/json"), (b"X-Request-ID", b"req-7")]
    return {"headers": plain + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]}


def facts(context) -> tuple:
    """Everything a context carries to the server: its keys, the remote span context (ids, flags,
    remote, validity), its tracestate as sent on, the baggage."""
    span = trace.get_current_span(context).get_span_context()
    return sorted(context), tuple(span), span.trace_state.to_header(), dict(baggage.get_all(context))


def assert_same(scope: dict) -> None:
    carrier, context = IncomingExtractor().extract(scope)
    assert facts(context) == facts(propagate.extract(headers_carrier(scope)))
    assert carrier.get("x-request-id") == "req-7"


CASES = {
    "valid": [("traceparent", VALID)],
    "valid, unsampled, with tracestate": [("traceparent", VALID[:-2] + "00"), ("tracestate", "a=1,b=2")],
    "two tracestate fields": [("traceparent", VALID), ("tracestate", "a=1"), ("tracestate", "b=2")],
    "a bad tracestate": [("traceparent", VALID), ("tracestate", "not a list member")],
    "an over-long tracestate": [("traceparent", VALID), ("tracestate", ",".join(f"k{i}=v" for i in range(130)))],
    "missing": [],
    "uppercase": [("traceparent", VALID.upper())],
    "upper-case header name": [("TraceParent", VALID)],
    "version ff": [("traceparent", "ff" + VALID[2:])],
    "a future version with an extra field": [("traceparent", "01" + VALID[2:] + "-extra")],
    "version 00 with an extra field": [("traceparent", VALID + "-extra")],
    "zero trace id": [("traceparent", f"00-{'0' * 32}-{SPAN_ID}-01")],
    "zero span id": [("traceparent", f"00-{TRACE_ID}-{'0' * 16}-01")],
    "short": [("traceparent", VALID[:-1])],
    "surrounding blanks": [("traceparent", f" \t{VALID} ")],
    "two traceparent fields": [("traceparent", VALID), ("traceparent", VALID)],
    "empty": [("traceparent", "")],
    "over-long": [("traceparent", VALID + " " * 600)],
    "baggage": [("traceparent", VALID), ("baggage", "user=alice,tier=gold%20plus")],
    "baggage alone": [("baggage", "k=v")],
}


@pytest.mark.parametrize("headers", CASES.values(), ids=CASES.keys())
def test_the_same_context_as_the_global_propagator(headers):
    assert_same(scope_of(*headers))


def test_the_common_headers_take_the_direct_path():
    """Without this the equality above could hold by always falling back."""
    for headers in (CASES["valid"], CASES["valid, unsampled, with tracestate"], CASES["missing"]):
        carrier = headers_carrier(scope_of(*headers), incoming.FAST_HEADERS)
        assert incoming._fast_context(carrier) is not None
        assert set(carrier) <= {"traceparent", "tracestate", "x-request-id"}
    assert incoming.is_default(propagate.get_global_textmap())


HEX = "0123456789abcdefABCDEF"
field = st.text(alphabet=HEX, min_size=0, max_size=34)
latin1 = st.characters(max_codepoint=255)  # what an ASGI header decodes to
traceparents = st.one_of(
    st.builds(
        lambda v, t, s, f, tail: f"{v}-{t}-{s}-{f}{tail}",
        st.sampled_from(["00", "01", "ff", "0", "AB"]) | field,
        st.text(alphabet="0123456789abcdef", min_size=32, max_size=32) | field,
        st.text(alphabet="0123456789abcdef", min_size=16, max_size=16) | field,
        st.sampled_from(["00", "01", "03", "ff"]) | field,
        st.sampled_from(["", " ", "\t", "-", "-x", ",", "\n"]),
    ),
    st.text(latin1, max_size=80),
)
tracestates = (
    st.none() | st.sampled_from(["a=1", "a=1,b=2", "x@y=z", "=", "a=1,a=2", "A=1"]) | st.text(latin1, max_size=40)
)


@settings(max_examples=400, deadline=None)
@given(traceparents, tracestates, st.none() | st.sampled_from(["k=v", "k=v;p", "bad"]))
def test_any_headers_give_the_same_context(traceparent, tracestate, bag):
    headers = [("traceparent", traceparent)]
    headers += [] if tracestate is None else [("tracestate", tracestate)]
    headers += [] if bag is None else [("baggage", bag)]
    assert_same(scope_of(*headers))


class OtherHeaderPropagator(TraceContextTextMapPropagator):
    """A propagator reading its own header: the direct path must not stand in for it."""

    _TRACEPARENT_HEADER_NAME = "x-other-parent"


def test_another_global_propagator_is_used_and_sees_every_header():
    extractor, before = IncomingExtractor(), propagate.get_global_textmap()
    scope = scope_of(("x-other-parent", VALID))
    assert not trace.get_current_span(extractor.extract(scope)[1]).get_span_context().is_valid
    try:
        propagate.set_global_textmap(CompositePropagator([OtherHeaderPropagator()]))
        carrier, context = extractor.extract(scope)
        assert trace.get_current_span(context).get_span_context().trace_id == int(TRACE_ID, 16)
        assert carrier["host"] == "h:1"  # the whole carrier for a propagator that may read any header
    finally:
        propagate.set_global_textmap(before)
