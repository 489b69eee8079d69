"""The report's waterfall of a disaggregated request: client, router, prefill instance (with its KV
transfer), decode instance, each placed on its own clock, the hops drawn as residuals of durations,
whatever the hosts' wall clocks say."""

from __future__ import annotations

import pytest

from phaselens.analysis.report import report_data as D
from phaselens.analysis.report import report_page as P
from phaselens.analysis.report.report_waterfall import HOP_COLOR, KV_COLOR
from phaselens.instrumentation import names as n

MS = 1_000_000
T0 = 1_764_400_000_000_000_000
HOUR_MS = 3_600_000
PREFILL, DECODE = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def span(name, kind, start_ms, dur_ms, sid, parent, *, role="", instance="", service="phaselens-server", skew_ms=0):
    start = T0 + int((start_ms + skew_ms) * MS)
    return D.TraceSpan(name, kind, service, start, int(dur_ms * MS), sid, parent, role, instance)


def trace(prefill_skew_ms: float, decode_skew_ms: float) -> list[D.TraceSpan]:
    """Client 300 ms; router 290 ms: prefill call 5 → 125, decode call 130 → 288; the prefill instance's
    request 110 ms (KV transfer 20 ms at its 80 ms); the decode instance's 150 ms, its KV receive at
    its −45 ms (the KV arrived before the router called it). Every process has the default service
    name: the instance tells the processes apart."""
    router = {"role": "router", "instance": "http://127.0.0.1:8000"}
    pre = {"role": "prefill", "instance": PREFILL, "skew_ms": prefill_skew_ms}
    dec = {"role": "decode", "instance": DECODE, "skew_ms": decode_skew_ms}
    return [
        span("text_completion tiny", "Client", 0, 300, "c", "", service="loadgen"),
        span("text_completion tiny", "Server", 0, 290, "r", "c", **router),
        span(n.SPAN_PD_PREFILL_CALL, "Client", 5, 120, "rp", "r", **router),
        span(n.SPAN_PD_DECODE_CALL, "Client", 130, 158, "rd", "r", **router),
        span("text_completion tiny", "Server", 0, 110, "p", "rp", **pre),
        span(n.SPAN_QUEUE, "Internal", 2, 30, "pq", "p", **pre),
        span(n.SPAN_PREFILL, "Internal", 32, 45, "pp", "p", **pre),
        span(n.SPAN_KV_TRANSFER, "Internal", 80, 20, "kv", "p", **pre),
        span("text_completion tiny", "Server", 0, 150, "d", "rd", **dec),
        span(n.SPAN_KV_RECEIVE, "Internal", -45, 12, "kr", "kv", **dec),
        span(n.SPAN_DECODE, "Internal", 10, 135, "dd", "d", **dec),
    ]


def test_each_instance_on_its_own_clock_and_the_hops_as_residuals():
    for skews in ((0, 0), (-HOUR_MS, HOUR_MS), (HOUR_MS, -HOUR_MS)):
        lanes, total = P.layout_trace(trace(*skews))
        by = {ln.label: ln for ln in lanes}
        assert total == pytest.approx(300)
        assert by["router · http://127.0.0.1:8000 (router clock)"].start_ms == pytest.approx(5)  # (300 − 290) / 2
        prefill, decode = by[f"prefill · {PREFILL} (prefill clock)"], by[f"decode · {DECODE} (decode clock)"]
        # the prefill root centred in the router's prefill call (10 + (120 − 110) / 2), the decode root in
        # its decode call (135 + (158 − 150) / 2): the hops are residuals of durations
        assert (prefill.start_ms, prefill.duration_ms) == (pytest.approx(15), pytest.approx(110))
        assert (decode.start_ms, decode.duration_ms) == (pytest.approx(139), pytest.approx(150))
        hops = [ln for ln in lanes if ln.color == HOP_COLOR]
        assert [(h.label, h.start_ms, h.duration_ms) for h in hops] == [
            ("hop → prefill (residual)", pytest.approx(10), pytest.approx(10)),
            ("hop → decode (residual)", pytest.approx(135), pytest.approx(8)),
        ]
        # the rest of each process at its offset from that process's root, on its clock
        assert by[n.SPAN_KV_TRANSFER].start_ms == pytest.approx(15 + 80) and by[n.SPAN_KV_TRANSFER].color == KV_COLOR
        assert by[n.SPAN_KV_RECEIVE].start_ms == pytest.approx(139 - 45)
        assert by[n.SPAN_DECODE].start_ms == pytest.approx(149)
    labels = [ln.label for ln in lanes]
    assert labels.index(n.SPAN_KV_TRANSFER) < labels.index("hop → decode (residual)") < labels.index(n.SPAN_DECODE)
    depth = {ln.label: ln.depth for ln in lanes}
    assert depth[f"prefill · {PREFILL} (prefill clock)"] == depth[n.SPAN_PD_PREFILL_CALL] + 1 == 3


def test_the_hops_of_the_pd_budget_place_the_instances_when_the_report_has_them():
    """A root span outlasts its answer: the report places each instance by its hop in the P/D budget
    (caller's duration − the callee's to where its answer was handed on), split evenly."""
    lanes, _ = P.layout_trace(trace(-HOUR_MS, HOUR_MS), {"prefill": 12.0, "decode": 4.0})
    by = {ln.label: ln for ln in lanes}
    assert by["hop → prefill (residual)"].duration_ms == 12.0 and by["hop → decode (residual)"].duration_ms == 4.0
    assert by[f"prefill · {PREFILL} (prefill clock)"].start_ms == pytest.approx(10 + 6)
    assert by[f"decode · {DECODE} (decode clock)"].start_ms == pytest.approx(135 + 2)
    assert by[n.SPAN_KV_TRANSFER].start_ms == pytest.approx(16 + 80)


def test_the_page_draws_the_instances_and_a_colocated_trace_is_unchanged():
    page = P._waterfall(D.TraceView("Typical request", "ab" * 16, trace(-HOUR_MS, HOUR_MS)))
    assert f"prefill · {PREFILL} (prefill clock)" in page and "hop → decode (residual)" in page
    assert "KV transfer" in page and "server root" not in page
    client, router = trace(0, 0)[:2]
    colocated = [
        client,
        D.TraceSpan(router.name, router.kind, router.service, router.start_ts, router.duration_ns, "r", "c"),
    ]
    lanes, _ = P.layout_trace(colocated)  # no P/D role: the colocated layout, as before
    assert lanes[1].label == "server · text_completion tiny" and lanes[1].start_ms == pytest.approx(5)
