"""The report's data from a real ClickHouse: spans with known durations (tests/spangen) in, the same
figures out — budget rows, points, the two timelines, engine steps — and `phaselens report` itself."""

from __future__ import annotations

import pytest

from phaselens import cli
from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.report import report as R
from phaselens.analysis.report import report_page as P
from phaselens.instrumentation import names as n
from tests import spangen
from tests.analysis_fixtures import loaded

HOUR_NS = 3_600 * 10**9


@pytest.fixture(scope="module")
def run(clickhouse):
    """60 requests (every 10th server-only) and 120 engine steps, client clock one hour ahead."""
    workload = spangen.generate(60, seed=7, n_steps=120, server_only_every=10, client_clock_shift_ns=HOUR_NS)
    database = loaded(clickhouse, workload)
    return workload, database


def test_report_data_equals_the_known_run(run, ch_client):
    workload, database = run
    data = R.build(ch_client, database=database, since="1h", config={"run": "spangen"})
    truth = {r.trace_id: r for r in workload.requests}

    assert len(data.requests) == 60
    for p in data.requests:
        t = truth[p.trace_id]
        assert p.server_ttft_ms == pytest.approx(t.server_ttft_ms, abs=1e-3)
        assert p.prefill_ms == pytest.approx(t.prefill_ms, abs=1e-3)
        assert p.input_tokens == t.input_tokens
        assert (p.client_ttft_ms is None) == (not t.has_client)

    summary = budget(ch_client, database=database, since="1h")
    assert [b.label for b in data.budget] == ["p50", "p90", "p99", "mean"]
    for row in data.budget:
        for c in summary.components:
            assert row.components[c.name] == getattr(c.ms, row.label)
        assert row.ttft_ms == getattr(summary.distributions["client_ttft_ms"], row.label)

    assert [s.decode_tokens for s in data.steps] == [s.decode_tokens for s in workload.steps]
    assert [s.prefill_tokens for s in data.steps] == [s.prefill_tokens for s in workload.steps]
    assert data.steps[0].t_s == 0 and data.steps[-1].t_s == pytest.approx(
        (workload.steps[-1].start_ns - workload.steps[0].start_ns) / 1e9
    )
    assert data.config["run"] == "spangen" and data.config["ClickHouse database"] == database


def test_timelines_are_the_median_and_the_slowest_request(run, ch_client):
    workload, database = run
    data = R.build(ch_client, database=database, since="1h")
    ttft = {r.trace_id: (r.client_ttft_ms if r.has_client else r.server_ttft_ms) for r in workload.requests}
    ranked = sorted(ttft, key=ttft.get)
    assert [t.trace_id for t in data.traces] == [ranked[(len(ranked) - 1) // 2], ranked[-1]]

    slowest = next(r for r in workload.requests if r.trace_id == ranked[-1])
    lanes, total = P.layout_trace(data.traces[1].spans)
    by_label = {ln.label: ln for ln in lanes}
    queue = by_label[n.SPAN_QUEUE]
    assert queue.duration_ms == pytest.approx(slowest.queue_waits_ms[0], abs=1e-3)
    assert by_label[n.SPAN_DECODE].duration_ms == pytest.approx(slowest.decode_ms, abs=1e-3)
    if slowest.has_client:
        # the server root is centred in the client span: the hour of clock skew plays no part
        offset = (slowest.client_e2e_ms - slowest.server_e2e_ms) / 2
        assert queue.start_ms == pytest.approx(offset + slowest.ingress_ms, abs=1e-3)
        assert total == pytest.approx(slowest.client_e2e_ms, abs=1e-3)


def test_report_command_writes_the_page(run, clickhouse, tmp_path, capsys):
    _, database = run
    out = tmp_path / "r.html"
    code = cli.main(
        [
            "report",
            "--clickhouse",
            clickhouse.url,
            "--database",
            database,
            "--since",
            "1h",
            "--slo",
            "ttft:40,tpot:20",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    html = out.read_text()
    assert "60 requests (54 with a client view by phaselens, 60 with a server view)" in html
    assert "SLO ttft ≤ 40 ms, tpot ≤ 20 ms;" in html and html.count("<svg") >= 8
    assert "r.html" in capsys.readouterr().out


def test_report_command_fails_clearly(clickhouse, tmp_path, capsys):
    from phaselens.common.process import free_port

    code = cli.main(["report", "--clickhouse", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "x.html")])
    assert code == 1 and "cannot reach ClickHouse" in capsys.readouterr().err
    code = cli.main(
        ["report", "--clickhouse", clickhouse.url, "--database", "no_such_db", "--out", str(tmp_path / "x.html")]
    )
    assert code == 1 and "schema is missing" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()
