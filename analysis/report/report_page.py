"""The report page: `ReportData` → one HTML string (template and CSS from `report_assets/`)."""

from __future__ import annotations

import datetime as dt
from html import escape
from pathlib import Path
from string import Template

from phaselens.analysis import terms
from phaselens.analysis.queries import UNOBSERVED
from phaselens.analysis.report import report_charts as charts
from phaselens.analysis.report.report_data import (
    BudgetRow,
    DiagnosisView,
    ReportData,
    RequestPoint,
    StepPoint,
    TraceSpan,
    TraceView,
)
from phaselens.analysis.report.report_waterfall import (
    HOP_COLOR,
    KV_COLOR,
    ROLE_COLORS,
    is_disaggregated,
    layout_disaggregated,
    tree_order,
)
from phaselens.instrumentation import names

ASSETS = Path(__file__).resolve().parent / "report_assets"
# Budget components in TTFT order (the analysis API's names), with their labels and colours.
COMPONENTS = tuple((t.name, t.label, t.colour) for t in terms.REGISTRY.components())
SPAN_COLORS = {
    names.SPAN_INGRESS: "#7aa6d8",
    names.SPAN_QUEUE: "#f0a04b",
    names.SPAN_PREFILL: "#5bb07a",
    names.SPAN_PREFILL_CHUNK: "#8fd0a4",
    names.SPAN_FIRST_TOKEN: "#b07ad0",
    names.SPAN_FIRST_CHUNK: "#e07b9a",
    names.SPAN_DECODE: "#4f7fc0",
    names.SPAN_DELIVERY: "#6cc0c0",
}
CLIENT_COLOR, SERVER_COLOR = "#39424f", "#8893a5"
PREFILL_COLOR, DECODE_COLOR = "#5bb07a", "#4f7fc0"
MAX_SCATTER_POINTS = 2000
STEP_COLUMNS = 160


def render(data: ReportData) -> str:
    """The whole page as one string."""
    assets = ASSETS
    page = Template((assets / "template.html").read_text(encoding="utf-8"))
    step_cols = _step_columns(data.steps)
    return page.substitute(
        title=escape(data.title),
        subtitle=escape(data.subtitle),
        css=(assets / "report.css").read_text(encoding="utf-8"),
        diagnosis=_diagnosis(data.diagnosis),
        kpis="".join(f'<div class="kpi"><b>{escape(v)}</b><span>{escape(k)}</span></div>' for v, k in data.kpis),
        budget_note=escape(data.budget_note),
        budget_chart=_budget_chart(data.budget, data.ttft_label),
        budget_table=_budget_table(data.budget, data.ttft_label),
        ttft_cdf=_cdf(data.requests, "ttft"),
        tpot_cdf=_cdf(data.requests, "tpot"),
        scatter=_scatter(data.requests),
        waterfall_note=escape(WATERFALL_NOTE),
        waterfalls="".join(_waterfall(t) for t in data.traces),
        step_bucket_note=escape(step_cols[0]),
        engine_chart=step_cols[1],
        config_table=_kv_table(data.config),
        version=_version(),
        generated=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    )


def write(path: str, data: ReportData) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(data))
    return path


def _diagnosis(d: DiagnosisView | None) -> str:
    """The verdict, the six steps with their evidence, and the levers with theirs."""
    if d is None:
        return ""
    steps = "".join(
        f"<tr><td>{escape(q)}</td><td>{escape(finding)}</td><td>{'<br>'.join(map(escape, ev))}</td></tr>"
        for q, finding, ev in d.steps
    )
    levers = "".join(f"<tr><td>{escape(c)}</td><td>{escape(a)}</td><td>{escape(ev)}</td></tr>" for c, a, ev in d.levers)
    lever_table = f"<table><tr><th>cause</th><th>lever</th><th>evidence</th></tr>{levers}</table>" if levers else ""
    return (
        f'<section id="diagnosis"><h2>Diagnosis: why is it slow?</h2><p class="verdict"><b>{escape(d.verdict)}'
        f"</b></p><table><tr><th>step</th><th>finding</th><th>evidence</th></tr>{steps}</table>{lever_table}"
        "</section>"
    )


def _budget_chart(rows: list[BudgetRow], ttft_label: str) -> str:
    bars = [
        charts.BarRow(
            r.label,
            [charts.Segment(label, color, max(r.components.get(key) or 0.0, 0.0)) for key, label, color in COMPONENTS],
            r.ttft_ms,
            f"{ttft_label} {r.label}",
        )
        for r in rows
    ]
    keys = [(label, color) for _, label, color in COMPONENTS] + [(f"{ttft_label} at that statistic (dashed)", "#111")]
    return charts.stacked_bars(bars) + charts.legend(keys)


def _budget_table(rows: list[BudgetRow], ttft_label: str) -> str:
    if not rows:
        return ""
    head = "".join(f"<th class='num'>{escape(r.label)}</th>" for r in rows)
    body = []
    for key, label, _ in COMPONENTS:
        values = [r.components.get(key) for r in rows]
        cells = "".join(f"<td class='num'>{_ms(v)}</td>" for v in values)
        # a term no request stamped has no figure at any statistic: say so, as `phaselens budget` does
        shown = f"{label}: {UNOBSERVED}" if all(v is None for v in values) else label
        body.append(f"<tr><td>{escape(shown)}</td>{cells}</tr>")
    totals = "".join(f"<td class='num'><b>{_ms(r.ttft_ms)}</b></td>" for r in rows)
    body.append(f"<tr><td><b>{escape(ttft_label)}</b></td>{totals}</tr>")
    return f"<table><tr><th>component (ms)</th>{head}</tr>{''.join(body)}</table>"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _cdf(points: list[RequestPoint], metric: str) -> str:
    client = [getattr(p, f"client_{metric}_ms") for p in points]
    server = [getattr(p, f"server_{metric}_ms") for p in points]
    series = [
        charts.Series(f"client {metric.upper()}", CLIENT_COLOR, [v for v in client if v is not None]),
        charts.Series(f"server {metric.upper()}", SERVER_COLOR, [v for v in server if v is not None]),
    ]
    return charts.cdf(series, f"{metric.upper()} (ms)") + charts.legend(
        [(s.name + f" (n={len(s.xs)})", s.color) for s in series]
    )


def _scatter(points: list[RequestPoint]) -> str:
    sample = points[:: max(1, len(points) // MAX_SCATTER_POINTS)]
    series = []
    for name, attr, color in (
        ("client TTFT", "client_ttft_ms", CLIENT_COLOR),
        ("prefill", "prefill_ms", PREFILL_COLOR),
    ):
        pairs = [(p.input_tokens, getattr(p, attr)) for p in sample if getattr(p, attr) is not None]
        series.append(charts.Series(name, color, [x for x, _ in pairs], [y for _, y in pairs]))
    return charts.scatter(series, "prompt length (input tokens)", "ms") + charts.legend(
        [(s.name, s.color) for s in series]
    )


WATERFALL_NOTE = (
    "Client and server spans side by side. Placement: each process's spans are placed by that "
    "process's own timestamps relative to its own root span (one clock, one anchor per process); the "
    "server root is then centred inside the client span, the residual (client duration − server "
    "duration) split evenly before and after it, because the two clocks are never compared. So the "
    "horizontal position of server spans against client spans is an assumption; every duration shown "
    "is measured on one clock."
)


def layout_trace(spans: list[TraceSpan], hops_ms: dict[str, float] | None = None) -> tuple[list[charts.Lane], float]:
    """Lanes for one trace: client root at 0, server tree centred in it (see WATERFALL_NOTE); a
    disaggregated trace: router, prefill and decode instances, each on its own clock (report_waterfall).

    offset(server) = (client_duration − server_root_duration) / 2;
    start(span) = offset(process) + (span.start − root_of_its_process.start).
    """
    if is_disaggregated(spans):
        return layout_disaggregated(spans, lambda name: SPAN_COLORS.get(name, "#999"), CLIENT_COLOR, hops_ms or {})
    client = next((s for s in spans if s.kind.lower().endswith("client")), None)
    server = next((s for s in spans if s.kind.lower().endswith("server")), None)
    lanes: list[charts.Lane] = []
    total = 0.0
    if client:
        total = client.duration_ns / 1e6
        lanes.append(charts.Lane(f"client · {client.name}", 0.0, total, CLIENT_COLOR, 0, client.service))
    if server:
        offset = max((client.duration_ns - server.duration_ns) / 2e6, 0.0) if client else 0.0
        for s, depth in tree_order(spans, server):
            color = SERVER_COLOR if s is server else SPAN_COLORS.get(s.name, "#999")
            label = f"server · {s.name}" if s is server else s.name
            lanes.append(
                charts.Lane(
                    label,
                    offset + (s.start_ts - server.start_ts) / 1e6,
                    s.duration_ns / 1e6,
                    color,
                    depth + (1 if client else 0),
                    s.service,
                )
            )
        total = max(total, offset + server.duration_ns / 1e6)
    return lanes, total


def _waterfall(trace: TraceView) -> str:
    lanes, total = layout_trace(trace.spans, trace.hops_ms)
    title = (
        f"<h3 style='margin:14px 0 4px;font-size:14px'>{escape(trace.title)} <code>{escape(trace.trace_id)}</code></h3>"
    )
    roots = [(f"{role} instance root", c) for role, c in ROLE_COLORS.items()] + [("hop (residual)", HOP_COLOR)]
    if is_disaggregated(trace.spans):
        roots += [("KV transfer", KV_COLOR)]
    keys = (
        [("client span", CLIENT_COLOR)]
        + (roots if is_disaggregated(trace.spans) else [("server root", SERVER_COLOR)])
        + [(n, c) for n, c in SPAN_COLORS.items() if any(s.name == n for s in trace.spans)]
    )
    return title + charts.waterfall(lanes, total) + charts.legend(keys)


def _step_columns(steps: list[StepPoint]) -> tuple[str, str]:
    """Average tokens per step in at most STEP_COLUMNS time buckets: (bucket description, chart)."""
    if not steps:
        return "time buckets", charts.empty("no engine steps in range")
    end = max(s.t_s for s in steps)
    width = max(end / STEP_COLUMNS, 1e-3)
    n = int(end / width) + 1
    sums = [[0, 0, 0] for _ in range(n)]
    for s in steps:
        b = sums[min(int(s.t_s / width), n - 1)]
        b[0] += s.prefill_tokens
        b[1] += s.decode_tokens
        b[2] += 1
    ts = [i * width for i in range(n)]
    avg = [(p / c if c else 0.0, d / c if c else 0.0) for p, d, c in sums]
    # Two panels on one time axis: prefill chunks are ~100× larger than a step's decode tokens.
    panels = [
        (charts.Series("prefill tokens", PREFILL_COLOR, ts, [a[0] for a in avg]), "prefill tokens / step"),
        (charts.Series("decode tokens", DECODE_COLOR, ts, [a[1] for a in avg]), "decode tokens / step"),
    ]
    chart = "".join(
        charts.stacked_columns(ts, [series], "seconds since the first step", label, height=200)
        for series, label in panels
    )
    note = f"{width * 1000:.0f} ms buckets ({len(steps)} steps)"
    return note, chart + charts.legend([(series.name, series.color) for series, _ in panels])


def _kv_table(config: dict[str, str]) -> str:
    rows = "".join(f"<tr><th>{escape(k)}</th><td><code>{escape(str(v))}</code></td></tr>" for k, v in config.items())
    return f"<table>{rows}</table>"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("phaselens")
    except PackageNotFoundError:
        return "dev"
