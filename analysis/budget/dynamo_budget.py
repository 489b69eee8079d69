"""The TTFT budget of requests served by NVIDIA Dynamo, from Dynamo's own spans
(docs/disaggregation.md#dynamo): its rows of `phaselens_requests` (`span_model` dynamo-native), the
time range on the frontend's `http-request` start (`server_start_time`).

Every term a duration on one clock:

    client TTFT     = client_ms + client_late_est_ms + residual_ms + server_ttft_ms
                      (client clock; the edges count 0 where nobody stamped them, as in every budget)
    server_ttft_ms  = Dynamo's frontend TTFT
                    = frontend_dispatch_ms + prefill_call_ms + kv_transfer_est_ms   (frontend clock, P/D)

`kv_transfer_est_ms` is an estimate: the prefill's answer back at the frontend → the first token
there, so it holds the KV transfer, the decode worker's first step and both of its hops. Beside the
budget, each worker's own figures on its clock: the prefill worker's request (`prefill_worker_ms`),
and each worker's busy time (its request task being polled) and idle time (the task waiting).
A P/D term of an aggregated request is NULL, never 0: those rows count in the TTFT rows only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from clickhouse_connect.driver.exceptions import ClickHouseError
from rich.console import Group
from rich.table import Table

from phaselens.analysis.budget.latency_budget import AnalysisError, Stat, _clean
from phaselens.analysis.queries.dialect import CliDialect, QueryError
from phaselens.analysis.queries.dynamo_queries import SIDE, TERMS, dynamo_summary
from phaselens.analysis.queries.facts import UNOBSERVED


@dataclass(slots=True)
class DynamoBudget:
    requests: int = 0
    errors: int = 0
    disaggregated: int = 0  # went through a prefill worker
    terms: dict[str, Stat] = field(default_factory=dict)
    side: dict[str, Stat] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stat(row: dict[str, Any], name: str) -> Stat:
    qs = [_clean(v) for v in row.get(f"{name}_q") or []] + [None] * 3
    return Stat(qs[0], qs[1], qs[2], _clean(row.get(f"{name}_mean")))


def dynamo_budget(
    client: Any, database: str = "otel", model: str | None = None, since: str | None = "15m"
) -> DynamoBudget:
    """The Dynamo budget of the selection; an empty one when no request was served by Dynamo."""
    d = CliDialect({"since": since, "model": model}, database=database)
    try:
        result = client.query(dynamo_summary(d), parameters=d.parameters)
    except QueryError as e:
        raise AnalysisError(str(e)) from None
    except (ClickHouseError, OSError) as e:
        raise AnalysisError(f"ClickHouse query failed: {str(e).splitlines()[0][:300]}") from None
    row = dict(zip(result.column_names, result.result_rows[0], strict=False)) if result.result_rows else {}
    return DynamoBudget(
        requests=int(row.get("requests") or 0),
        errors=int(row.get("errors") or 0),
        disaggregated=int(row.get("disaggregated") or 0),
        terms={name: _stat(row, name) for name, _, _ in TERMS},
        side={name: _stat(row, name) for name in SIDE},
    )


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def to_rich(report: DynamoBudget) -> Group:
    title = (
        f"Dynamo TTFT budget (its own spans): {report.requests} requests, {report.disaggregated} through a "
        f"prefill worker, {report.errors} failed"
    )
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(("term (ms, its own clock)", "p50", "p90", "p99", "mean")):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    estimated = {name for name, _, est in TERMS if est}
    for name, stat in (*report.terms.items(), *report.side.items()):
        label = f"{name} (estimate)" if name in estimated else name
        if all(v is None for v in stat.values()):  # as the budget table says it: never 0.00
            label = f"{label} {UNOBSERVED}"
        table.add_row(label, *(_ms(v) for v in stat.values()))
    note = (
        "client TTFT = client + client_late_est + residual + server_ttft (Dynamo's frontend TTFT) = ... + "
        "frontend_dispatch + prefill_call + kv_transfer_est (P/D, frontend clock; the estimate holds the KV "
        "transfer, the decode worker's first step and its hops); prefill_worker and busy/idle on each worker's clock"
    )
    return Group(table, note)


def to_json(report: DynamoBudget) -> str:
    return json.dumps(report.to_dict(), indent=2)
