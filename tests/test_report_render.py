"""The HTML report: waterfall placement math, self-containment, and real rendering in Chromium."""

from __future__ import annotations

import re

import pytest

from phaselens.analysis.report import report_charts as charts
from phaselens.analysis.report import report_data as D
from phaselens.analysis.report import report_page as P
from phaselens.instrumentation import names as n
from tests.report_fixtures import colour_stats, console_messages, decode_png, run_chromium

MS = 1_000_000
T0 = 1_764_400_000_000_000_000  # wall ns; only placement uses it


def span(name, kind, start_ms, dur_ms, sid, parent, service="server", t0=T0):
    return D.TraceSpan(name, kind, service, t0 + int(start_ms * MS), int(dur_ms * MS), sid, parent)


def server_tree(t0: int) -> list[D.TraceSpan]:
    """A server request of 400 ms: ingress 2, queue 50, prefill 30 (2 chunks), first token 3, decode 310, delivery 5."""
    return [
        span("text_completion tiny", "Server", 0, 400, "s", "c", t0=t0),
        span(n.SPAN_INGRESS, "Internal", 0, 2, "i", "s", t0=t0),
        span(n.SPAN_QUEUE, "Internal", 2, 50, "q", "s", t0=t0),
        span(n.SPAN_PREFILL, "Internal", 52, 30, "p", "s", t0=t0),
        span(n.SPAN_PREFILL_CHUNK, "Internal", 52, 15, "p1", "p", t0=t0),
        span(n.SPAN_PREFILL_CHUNK, "Internal", 67, 15, "p2", "p", t0=t0),
        span(n.SPAN_FIRST_TOKEN, "Internal", 82, 3, "f", "s", t0=t0),
        span(n.SPAN_DECODE, "Internal", 85, 310, "d", "s", t0=t0),
        span(n.SPAN_DELIVERY, "Internal", 395, 5, "dl", "s", t0=t0),
    ]


def test_waterfall_centres_server_in_client_span_whatever_the_clocks():
    """Server spans sit at offset (client − server)/2 = 10 ms, whatever the server's wall clock says."""
    client = span("text_completion tiny", "Client", 0, 420, "c", "", service="loadgen")
    for skew_ms in (0, 3_600_000, -3_600_000):  # the server clock an hour ahead or behind
        lanes, total = P.layout_trace([client, *server_tree(T0 + skew_ms * MS)])
        by_label = {ln.label: ln for ln in lanes}
        assert total == pytest.approx(420)
        assert by_label["client · text_completion tiny"].start_ms == 0
        assert by_label["server · text_completion tiny"].start_ms == pytest.approx(10)
        assert by_label[n.SPAN_QUEUE].start_ms == pytest.approx(12)
        assert by_label[n.SPAN_DECODE].start_ms == pytest.approx(95)
        assert by_label[n.SPAN_DECODE].duration_ms == pytest.approx(310)
    assert [ln.depth for ln in lanes if ln.label == n.SPAN_PREFILL_CHUNK] == [3, 3]
    assert [ln.depth for ln in lanes if ln.label == n.SPAN_PREFILL] == [2]
    assert [ln.label for ln in lanes][:3] == [
        "client · text_completion tiny",
        "server · text_completion tiny",
        n.SPAN_INGRESS,
    ]


def test_waterfall_without_client_span_starts_at_server_root():
    lanes, total = P.layout_trace(server_tree(T0))
    assert lanes[0].label == "server · text_completion tiny" and lanes[0].start_ms == 0 and lanes[0].depth == 0
    assert total == pytest.approx(400)
    assert {ln.label for ln in lanes} >= {n.SPAN_QUEUE, n.SPAN_DELIVERY}


def test_nice_ticks_and_log_ticks():
    assert charts.nice_ticks(0, 97) == [0, 20, 40, 60, 80]
    assert charts.nice_ticks(0, 1.0) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert charts.log_ticks(1, 1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def synthetic_report() -> D.ReportData:
    """A report with every section filled; values are arbitrary but plausible."""
    points = [
        D.RequestPoint(
            f"{i:032x}",
            20 + (i % 7) * 90,
            30 + i * 1.5,
            28 + i * 1.5,
            12 + i % 5 * 0.5,
            11 + i % 5 * 0.5,
            2 + (i % 7) * 6,
        )
        for i in range(120)
    ]
    budget = [
        D.BudgetRow(
            label,
            {
                "ingress_ms": 1 * m,
                "queue_ms": 40 * m,
                "prefill_ms": 10 * m,
                "first_token_ms": 2 * m,
                "residual_ms": 1.5 * m,
            },
            54.5 * m,
        )
        for label, m in (("p50", 1), ("p90", 2.2), ("p99", 4), ("mean", 1.3))
    ]
    client = span("text_completion tiny", "Client", 0, 420, "c", "", service="loadgen")
    steps = [D.StepPoint(i * 0.02, 128 if i % 9 == 0 else 0, 1 + i % 16) for i in range(900)]
    return D.ReportData(
        "phaselens report",
        "synthetic run",
        [("55 ms", "p50 TTFT"), ("3.2 req/s", "goodput")],
        budget,
        points,
        [
            D.TraceView("Typical request", "a" * 32, [client, *server_tree(T0)]),
            D.TraceView("Slowest request", "b" * 32, server_tree(T0)),
        ],
        steps,
        {"model": "tiny", "requests": "120", "note": "<script>alert(1)</script>"},
    )


def test_report_is_self_contained_and_escaped(tmp_path):
    html = P.render(synthetic_report())
    assert html.count("<svg") >= 7  # budget, 2 CDFs, scatter, 2 waterfalls, engine
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "external reference"
    assert "<script" not in html and "&lt;script&gt;alert(1)" in html
    assert "residual (network: what no stamp explains)" in html and "centred inside the client span" in html


def test_report_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "report.html"
    P.write(str(page), synthetic_report())
    shot = tmp_path / "shot.png"
    proc = run_chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2600")
    assert shot.exists(), proc.stderr[-2000:]
    assert console_messages(proc.stderr) == []
    width, height, rows = decode_png(shot.read_bytes())
    assert (width, height) == (1280, 2600)
    distinct, painted = colour_stats(rows)
    assert distinct > 200 and painted > 0.3, (distinct, painted)  # charts drawn, not a blank page
    dom = run_chromium(page, tmp_path, "--dump-dom").stdout
    assert dom.count("<rect") > 300 and dom.count("<polyline") == 4 and dom.count("<circle") > 100


def test_console_error_detection_works(tmp_path):
    """The check above would catch a script error (so its empty result means something)."""
    page = tmp_path / "bad.html"
    page.write_text('<html><body><script>console.error("boom"); undefinedFn();</script></body></html>')
    messages = console_messages(run_chromium(page, tmp_path, "--dump-dom").stderr)
    assert any("boom" in m for m in messages) and any("Uncaught ReferenceError" in m for m in messages)
