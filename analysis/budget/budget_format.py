"""A BudgetReport as text: rich tables, JSON, or CSV (one `key,value` row per figure)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from rich.console import Group
from rich.table import Table

from phaselens.analysis import queries as q
from phaselens.analysis.budget.latency_budget import BudgetReport, Goodput, Stat

TPOT_ITL = (
    "client_tpot_ms",
    "server_tpot_ms",
    "client_itl_p99_ms",
    "server_itl_p99_ms",
    "client_e2e_ms",
    "server_e2e_ms",
    "e2e_residual_ms",
    "client_end_read_ms",
    "stall_ms",
    "queue_all_waits_ms",
)
FIRST_CHUNK_SPLIT = tuple(name for name, _ in q.FIRST_CHUNK_SPLIT)
INBOUND_SPLIT = tuple(name for name, _ in q.INBOUND_SPLIT)
CLIENT_SPLIT = tuple(name for name, _ in q.CLIENT_SPLIT)
UNOBSERVED = q.UNOBSERVED  # a term no request in the selection was stamped with (not 0 ms)
ESTIMATE = "(estimate)"  # a term estimated, not measured (`queries.ESTIMATED`)
ESTIMATE_MARK = "*"  # the same, where the table is too narrow for ESTIMATE


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _stat_cells(stat: Stat) -> list[str]:
    return [_ms(v) for v in stat.values()]


def _table(title: str, headers: list[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    return table


def to_rich(report: BudgetReport) -> Group:
    ref = f"{report.reference}_ttft_ms"
    budget = _table(
        f"TTFT budget ({report.requests} requests, {report.with_client} with a client view, "
        f"{report.errors} errors, {report.no_output} with no output; shares of {report.reference} TTFT)",
        ["term (ms)", "p50", "p90", "p99", "mean", "share p50", "share p99", "share mean"],
    )
    for c in report.components:
        name = (
            (f"{c.name} {ESTIMATE}" if c.estimated else c.name) if c.ms.mean is not None else f"{c.name} {UNOBSERVED}"
        )
        budget.add_row(name, *_stat_cells(c.ms), _pct(c.share.p50), _pct(c.share.p99), _pct(c.share.mean))
    for name in ("client_ttft_ms", "server_ttfc_ms", "server_ttft_ms", "client_ttfo_ms"):
        style = "bold" if name == ref else None
        budget.add_row(name, *_stat_cells(report.distributions[name]), "", "", "", style=style)
    tpot = _table("TPOT / ITL / e2e (ms)", ["statistic", "p50", "p90", "p99", "mean"])
    for name in TPOT_ITL:
        tpot.add_row(name, *_stat_cells(report.distributions[name]))
    split = _table(
        "first_chunk: where the server's delivery went (ms; loop_wait = event loop late, "
        "encode = SSE encoding and framework, write = send until it returned, outside the term)",
        ["part", "p50", "p90", "p99", "mean"],
    )
    for name in FIRST_CHUNK_SPLIT:
        split.add_row(name, *_stat_cells(report.distributions[name]))
    inbound = _table(
        "edges (ms, kernel receive stamps): inbound = kernel_wait (the request's bytes in the server's "
        "kernel until its event loop read them) + dispatch (HTTP parsing, task start), server clock; "
        "client = client_send (until the request's bytes left) + client_read (the first content bytes "
        "in the client's kernel until it read them), client clock; client_late_est (an estimate, in the "
        "budget) = the wait TCP hid when the client's read also held later chunks: the server's send gap "
        "from the first content chunk to the newest chunk of that read",
        ["part", "p50", "p90", "p99", "mean"],
    )
    for name in INBOUND_SPLIT + CLIENT_SPLIT:
        inbound.add_row(name, *_stat_cells(report.distributions[name]))
    parts: list[Table | str] = [budget, split, inbound, tpot]
    if report.span_models:
        parts.append(f"span models: {', '.join(report.span_models)}")
    if report.client_harnesses:
        parts.append(f"client views measured by: {', '.join(report.client_harnesses)}")
    parts += [f"not separated by {note}" for note in report.unseparated]
    if report.tail is not None:
        t = report.tail
        tail = _table(
            f"Tail: {t.requests} requests with TTFT > p99 = {_ms(t.threshold_ms)} ms "
            f"(mean {_ms(t.ttft_tail_mean_ms)} vs median {_ms(t.ttft_median_ms)}); "
            f"grew most: {t.grew_most}",
            ["term", "tail mean", "median", "delta", "share of growth"],
        )
        # a marker, not the budget's "(estimate)": that would widen the name column past 80 columns
        tail.caption, tail.caption_justify = f"{ESTIMATE_MARK} an estimate, not measured", "left"
        for tc in t.components:
            name = tc.name + ESTIMATE_MARK if tc.name in q.ESTIMATED else tc.name
            tail.add_row(name, _ms(tc.tail_mean_ms), _ms(tc.median_ms), _ms(tc.delta_ms), _pct(tc.share_of_growth))
        parts.append(tail)
    g, s = report.goodput, report.stalls
    parts.append(
        f"goodput: {g.good_requests} good requests, {_ms(g.goodput_rps)} req/s over {_ms(g.window_s)} s, "
        f"attainment {_pct(g.attainment)} ({slo_note(g)})"
    )
    parts.append(
        f"decode stalls from prefill: {s.mixed_steps} of {s.decode_steps} decode steps carried prefill; "
        f"+{_ms(s.stall_ms)} ms engine time vs a {_ms(s.baseline_ms)} ms decode-only step; "
        f"{_ms(s.request_stall_ms)} request-ms of delayed tokens ({s.delayed_decodes} tokens)"
    )
    parts.append(f"source: {report.source}" + (f" ({report.approximation})" if report.approximation else ""))
    return Group(*parts)


_JUDGED_ON = {
    "client": "judged on client TTFT/TPOT",
    "server": "judged on server TTFT/TPOT: no client view",
    "client, else server": "judged on client TTFT/TPOT, the server's where a request has no client view",
}


def slo_note(g: Goodput) -> str:
    """What the goodput judged against and on whose figures, e.g. `SLO ttft ≤ 500 ms, tpot ≤ 50 ms
    (the default: set one with --slo ttft:MS,tpot:MS); judged on server TTFT/TPOT: no client view`."""
    return slo_text(g.ttft_slo_ms, g.tpot_slo_ms, g.slo_is_default, g.judged_on)


def slo_text(ttft_slo_ms: float, tpot_slo_ms: float, is_default: bool, judged_on: str) -> str:
    default = " (the default: set one with --slo ttft:MS,tpot:MS)" if is_default else ""
    return f"SLO ttft ≤ {ttft_slo_ms:g} ms, tpot ≤ {tpot_slo_ms:g} ms{default}; {_JUDGED_ON[judged_on]}"


def to_json(report: BudgetReport) -> str:
    return json.dumps(report.to_dict(), indent=2, default=str)


def _flatten(prefix: str, value: object, out: list[tuple[str, object]]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            key = v.get("name", i) if isinstance(v, dict) else i
            _flatten(f"{prefix}.{key}", v, out)
    else:
        out.append((prefix, value))


def to_csv(report: BudgetReport, disaggregated: dict[str, Any] | None = None) -> str:
    """`key,value` rows of the budget's JSON, flattened; the disaggregated budget's under
    `disaggregated.*` when given."""
    rows: list[tuple[str, object]] = []
    _flatten("", report.to_dict(), rows)
    if disaggregated is not None:
        _flatten("disaggregated", disaggregated, rows)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(("key", "value"))
    writer.writerows(("" if v is None else v for v in row) for row in rows)
    return buf.getvalue()
