"""The TTFT budget of disaggregated requests, across the router, the prefill and the decode instance
(docs/disaggregation.md#the-budget-across-machines): the query of analysis.queries.pd_queries, rendered
with the analysis dialect (bound parameters), and its text form.

A request counts when it went through both instances and every term is known (`complete`):

    client TTFT = inbound_ms + client_ms + client_late_est_ms + residual_ms + Σ PD_TERMS
(each term a duration on one clock; analysis.schema.pd_schema; the edges, docs/budget-method.md, count 0
where nobody stamped them; an edge no complete request stamped has no figures and reads `unobserved`)

so for the mean the terms' shares of client TTFT sum to 1. Percentiles of the parts do not add up
to the percentile of the whole; the p50/p99 shares are ratios. Beside the TTFT terms: KV bytes,
decode-side ITL p99 and stall (what disaggregation is for), and the requests that failed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from clickhouse_connect.driver.exceptions import ClickHouseError
from rich.console import Group
from rich.table import Table

from phaselens.analysis.budget.latency_budget import AnalysisError, ComponentBudget, Stat, _clean
from phaselens.analysis.queries import ESTIMATED, UNOBSERVED
from phaselens.analysis.queries.dialect import CliDialect, QueryError
from phaselens.analysis.queries.pd_queries import ADDED_BY_DISAGG, SIDE, TTFT_TERMS, pd_summary
from phaselens.analysis.schema import span_models

__all__ = ["ADDED_BY_DISAGG", "SIDE", "TTFT_TERMS", "PdBudget", "pd_budget", "to_json", "to_rich"]


@dataclass(slots=True)
class PdBudget:
    requests: int = 0
    complete: int = 0
    errors: int = 0
    prefill_instances: int = 0
    decode_instances: int = 0
    kv_bytes_mismatch: int = 0
    terms: list[ComponentBudget] = field(default_factory=list)
    side: dict[str, Stat] = field(default_factory=dict)
    span_models: list[str] = field(default_factory=list)  # whose spans the rows came from (pd_span_model)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def term(self, name: str) -> Stat:
        return next(c.ms for c in self.terms if c.name == name)

    def added_mean_ms(self) -> float:
        """Σ mean of the terms disaggregation adds (ADDED_BY_DISAGG)."""
        return sum(self.term(name).mean or 0.0 for name in ADDED_BY_DISAGG)


def _stat(row: dict[str, Any], name: str) -> Stat:
    qs = [_clean(v) for v in row.get(f"{name}_q") or []] + [None] * 3
    return Stat(qs[0], qs[1], qs[2], _clean(row.get(f"{name}_mean")))


def pd_budget(client: Any, database: str = "otel", model: str | None = None, since: str | None = "15m") -> PdBudget:
    """The P/D budget of the selection; an empty PdBudget when there is no disaggregated request."""
    d = CliDialect({"since": since, "model": model}, database=database)
    try:
        sql = pd_summary(d)
        result = client.query(sql, parameters=d.parameters)
    except QueryError as e:
        raise AnalysisError(str(e)) from None
    except (ClickHouseError, OSError) as e:  # a missing schema, a failing or unreachable server
        raise AnalysisError(f"ClickHouse query failed: {str(e).splitlines()[0][:300]}") from None
    row = dict(zip(result.column_names, result.result_rows[0], strict=False)) if result.result_rows else {}
    whole = _stat(row, "client_ttft_ms")
    return PdBudget(
        requests=int(row.get("requests") or 0),
        complete=int(row.get("complete_requests") or 0),
        errors=int(row.get("errors") or 0),
        prefill_instances=int(row.get("prefill_instances") or 0),
        decode_instances=int(row.get("decode_instances") or 0),
        kv_bytes_mismatch=int(row.get("kv_bytes_mismatch") or 0),
        terms=[ComponentBudget(t, _stat(row, t), _stat(row, t).ratio(whole), t in ESTIMATED) for t in TTFT_TERMS],
        side={name: _stat(row, name) for name in SIDE},
        span_models=list(row.get("span_models") or []),
    )


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _label(c: ComponentBudget) -> str:
    if c.ms.mean is None:  # no complete request stamped it (an edge), or none is complete
        return f"{c.name} {UNOBSERVED}"
    return f"{c.name} (estimate)" if c.estimated else c.name


def to_rich(report: PdBudget) -> Group:
    table = Table(
        title=f"Disaggregated TTFT budget: {report.complete} complete of {report.requests} requests, "
        f"{report.prefill_instances} prefill + {report.decode_instances} decode instances, {report.errors} errors",
        title_justify="left",
    )
    for i, h in enumerate(("term (ms, its own clock)", "p50", "p90", "p99", "mean", "share of mean")):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for c in report.terms:
        share = "–" if c.share.mean is None else f"{100 * c.share.mean:.1f}%"
        table.add_row(_label(c), *(_ms(v) for v in c.ms.values()), share)
    table.add_row("client_ttft_ms", *(_ms(v) for v in report.side["client_ttft_ms"].values()), "100.0%")
    side = Table(title="Beside the budget", title_justify="left")
    for i, h in enumerate(("figure", "p50", "p90", "p99", "mean")):
        side.add_column(h, justify="left" if i == 0 else "right")
    for name, stat in report.side.items():
        if name != "client_ttft_ms":
            side.add_row(name, *(_ms(v) for v in stat.values()))
    notes = span_models.pd_notes(report.span_models)
    if report.kv_bytes_mismatch:
        notes.append(f"KV bytes received ≠ sent in {report.kv_bytes_mismatch} requests")
    return Group(table, side, *notes)


def to_json(report: PdBudget) -> str:
    return json.dumps(report.to_dict(), indent=2)
