"""The data of the HTML report, read from ClickHouse: budget, per-request points, two traces, steps.

`build(client, …) -> ReportData` uses the analysis Python API (`phaselens.analysis.budget.latency_budget.budget`) and
the named queries of `phaselens.analysis.queries`: `report_points` (the CDFs and the scatter),
`report_steps` (the batch-composition chart) and `request_spans` (the timelines).
`write_report(client, path, …)` builds the data and writes the page (`phaselens.analysis.report.report_page`).
The data types live in `phaselens.analysis.report.report_data`, which both modules import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clickhouse_connect.driver.client import Client

from phaselens.analysis import queries as queries
from phaselens.analysis.budget.budget_format import slo_note
from phaselens.analysis.budget.latency_budget import AnalysisError, BudgetReport, budget
from phaselens.analysis.diagnose.diagnose_format import headline
from phaselens.analysis.diagnose.diagnosis import Diagnosis, diagnose
from phaselens.analysis.queries.dialect import Filters, QueryError
from phaselens.analysis.report import report_page
from phaselens.analysis.report.report_data import (
    BudgetRow,
    DiagnosisView,
    ReportData,
    RequestPoint,
    StepPoint,
    TraceSpan,
    TraceView,
)
from phaselens.common.slo import DEFAULT_SLO, SLO

STATISTICS = ("p50", "p90", "p99", "mean")
BUDGET_NOTE = (
    "Bars: each term at its own statistic; percentiles of parts do not add up to the "
    "percentile of the whole (the mean row does add up). The dashed mark is TTFT itself at "
    "that statistic."
)


def _measured_by(summary: BudgetReport) -> str:
    """Who measured the client views (`phaselens`, or an imported harness such as `aiperf 0.13.0`)."""
    return f" by {', '.join(summary.client_harnesses)}" if summary.client_harnesses else ""


def build(
    client: Client,
    database: str = "otel",
    since: str | None = "1h",
    service: str | None = None,
    model: str | None = None,
    slo: SLO = DEFAULT_SLO,
    config: dict[str, str] | None = None,
    title: str = "phaselens latency report",
) -> ReportData:
    """Everything the page shows, for the requests selected by the filters (as `phaselens budget`)."""
    summary = budget(client, database=database, service=service, model=model, since=since, slo=slo)
    filters: Filters = {"database": database, "since": since, "service": service, "model": model}
    points, ttft_by_trace = _points(client, filters)
    traces = [
        TraceView(label, tid, _trace_spans(client, database, tid), _pd_hops(client, database, tid))
        for label, tid in _chosen_traces(ttft_by_trace)
    ]
    window = "all time" if since is None else f"last {since}"
    subtitle = (
        f"{summary.requests} requests ({summary.with_client} with a client view{_measured_by(summary)}, "
        f"{summary.with_server} with a server view) · {window} · database {database}"
    )
    settings = {
        "ClickHouse database": database,
        "time range": window,
        "service filter": service or "all",
        "model filter": model or "all",
        **(config or {}),
    }
    verdict = (
        diagnose(client, database=database, service=service, model=model, since=since, slo=slo)
        if summary.requests
        else None
    )
    return ReportData(
        title,
        subtitle,
        _kpis(summary),
        _budget_rows(summary),
        points,
        traces,
        _steps(client, filters),
        settings,
        _budget_note(summary),
        f"{summary.reference} TTFT",
        _diagnosis_view(verdict) if verdict else None,
    )


def _diagnosis_view(d: Diagnosis) -> DiagnosisView:
    return DiagnosisView(
        headline(d),
        [(f"{s.number}. {s.question}", s.finding, s.evidence) for s in d.steps],
        [(lv.cause, lv.action, lv.evidence) for lv in d.levers],
    )


def write_report(client: Client, path: str, **build_args: Any) -> ReportData:
    """Build the report and write it to `path` (one self-contained HTML file)."""
    data = build(client, **build_args)
    report_page.write(path, data)
    return data


def _budget_note(summary: BudgetReport) -> str:
    """The method note, plus what the span models in the selection cannot separate."""
    return " ".join([BUDGET_NOTE, *(f"Not separated by {note}." for note in summary.unseparated)])


def _budget_rows(summary: BudgetReport) -> list[BudgetRow]:
    ttft = summary.distributions[f"{summary.reference}_ttft_ms"]
    return [
        BudgetRow(stat, {c.name: getattr(c.ms, stat) for c in summary.components}, getattr(ttft, stat))
        for stat in STATISTICS
    ]


def _kpis(s: BudgetReport) -> list[tuple[str, str]]:
    ttft, tpot = s.distributions[f"{s.reference}_ttft_ms"], s.distributions[f"{s.reference}_tpot_ms"]
    g = s.goodput
    kpis = [
        (str(s.requests), f"requests ({s.errors} errors, {s.no_output} with no output)"),
        (_fmt_ms(ttft.p50), f"p50 {s.reference} TTFT"),
        (_fmt_ms(ttft.p99), f"p99 {s.reference} TTFT"),
        (_fmt_ms(tpot.p50), f"p50 {s.reference} TPOT"),
        (
            "–" if g.goodput_rps is None else f"{g.goodput_rps:.2f} req/s",
            f"goodput ({slo_note(g)})",
        ),
        ("–" if g.attainment is None else f"{100 * g.attainment:.1f}%", "SLO attainment"),
    ]
    if s.tail is not None and s.tail.grew_most:
        kpis.append((s.tail.grew_most.removesuffix("_ms"), "grew most in the p99 tail"))
    return kpis


def _fmt_ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} ms"


def _rows(client: Client, name: str, filters: Filters) -> Sequence[Sequence[Any]]:
    """The rows of a named query; bad filters and ClickHouse errors become one-line AnalysisErrors."""
    try:
        sql, params = queries.render_cli(name, **filters)
    except QueryError as e:
        raise AnalysisError(str(e)) from None
    try:
        return client.query(sql, parameters=params).result_rows
    except Exception as e:  # noqa: BLE001 — clickhouse-connect's errors: one line for the user
        raise AnalysisError(f"ClickHouse query failed: {str(e).splitlines()[0][:300]}") from None


def _points(client: Client, filters: Filters) -> tuple[list[RequestPoint], dict[str, float]]:
    """The points, and TTFT by trace id of the requests with a server view (timeline candidates)."""
    points, ttft = [], {}
    for tid, inp, c_ttft, s_ttft, c_tpot, s_tpot, prefill, any_ttft, has_server in _rows(
        client, "report_points", filters
    ):
        points.append(RequestPoint(tid, int(inp or 0), c_ttft, s_ttft, c_tpot, s_tpot, prefill))
        if has_server and any_ttft is not None:
            ttft[tid] = any_ttft
    return points, ttft


def _chosen_traces(ttft_by_trace: dict[str, float]) -> list[tuple[str, str]]:
    """The typical request (median TTFT, lower middle) and the slowest one."""
    if not ttft_by_trace:
        return []
    ranked = sorted(ttft_by_trace, key=ttft_by_trace.__getitem__)
    median, slowest = ranked[(len(ranked) - 1) // 2], ranked[-1]
    chosen = [(f"Typical request (median TTFT, {ttft_by_trace[median]:.1f} ms)", median)]
    if slowest != median:
        chosen.append((f"Slowest request (TTFT {ttft_by_trace[slowest]:.1f} ms)", slowest))
    return chosen


def _trace_spans(client: Client, database: str, trace_id: str) -> list[TraceSpan]:
    rows = _rows(client, "request_spans", {"database": database, "trace_id": trace_id})
    return [
        TraceSpan(span, kind, service, round(offset_ms * 1e6), round(duration_ms * 1e6), sid, parent, role, instance)
        for service, span, kind, sid, parent, offset_ms, duration_ms, _, role, instance in rows
    ]


def _pd_hops(client: Client, database: str, trace_id: str) -> dict[str, float]:
    """The request's hops as its P/D budget has them (analysis.schema.pd_schema); empty when colocated."""
    rows = _rows(client, "pd_hops", {"database": database, "trace_id": trace_id})
    hops = dict(zip(("prefill", "decode"), rows[0], strict=True)) if rows else {}
    return {role: ms for role, ms in hops.items() if ms is not None}


def _steps(client: Client, filters: Filters) -> list[StepPoint]:
    rows = _rows(client, "report_steps", filters)
    if not rows:
        return []
    t0 = rows[0][0]  # one server's wall stamps: differences within one process are one clock
    return [StepPoint((t_ns - t0) / 1e9, int(p), int(dc)) for t_ns, p, dc in rows]
