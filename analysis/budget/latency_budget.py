"""The latency budget as Python objects: two queries, rendered from `phaselens.analysis.queries`: the summary
(percentiles, shares, goodput, tail attribution: one pass over the per-request facts) and the decode
stalls (one pass over the engine steps).

Shares: a component's statistic divided by the TTFT statistic of the same kind (client TTFT where
any request has a client view, else server TTFT). For the mean the shares of the five terms sum to
1 over requests with both views (mean is linear); percentiles of parts do not add up to the
percentile of the whole, so p50/p90/p99 shares are ratios, not a partition.

Tail attribution: requests with TTFT above its p99 (`ttft_ms`: client TTFT, else server TTFT);
for each component, delta = mean over the tail − median over all requests; the component with the
largest delta is the one that grew.

Goodput = requests completed OK and meeting both SLOs (TTFT ≤ ttft_slo_ms and TPOT ≤ tpot_slo_ms;
DEFAULT_SLO unless given) / window_s, where window_s runs from the first request received to the
last response closed (server clock). Attainment = good / requests. Each request is judged on its
client TTFT/TPOT where it has a client view, else on its server's (`judged_on`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from clickhouse_connect.driver.client import Client

from phaselens.analysis import queries as q
from phaselens.analysis.queries import sketch
from phaselens.analysis.queries.dialect import Filters, QueryError
from phaselens.analysis.schema import span_models
from phaselens.common.slo import DEFAULT_SLO, SLO

TDIGEST_NOTE = "approximate: t-digest quantiles over every request (error not bounded); counts and means exact"
# One result row of a named query, {column: value}; values as clickhouse-connect decodes them.
Row = dict[str, Any]


class AnalysisError(RuntimeError):
    """ClickHouse unreachable, schema missing, or a bad filter: a one-line message for the user."""


@dataclass(slots=True)
class Stat:
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None

    def ratio(self, whole: Stat) -> Stat:
        return Stat(*(_div(a, b) for a, b in zip(self.values(), whole.values(), strict=False)))

    def values(self) -> tuple[float | None, float | None, float | None, float | None]:
        return self.p50, self.p90, self.p99, self.mean


@dataclass(slots=True)
class ComponentBudget:
    name: str
    ms: Stat
    share: Stat
    estimated: bool = False  # an estimate, not a difference of stamps (`queries.ESTIMATED`)


@dataclass(slots=True)
class TailComponent:
    name: str
    tail_mean_ms: float | None
    median_ms: float | None
    delta_ms: float | None
    share_of_growth: float | None  # delta / (tail TTFT mean − median TTFT)


@dataclass(slots=True)
class TailAttribution:
    threshold_ms: float | None
    requests: int
    ttft_tail_mean_ms: float | None
    ttft_median_ms: float | None
    components: list[TailComponent]
    grew_most: str | None


@dataclass(slots=True)
class Goodput:
    ttft_slo_ms: float
    tpot_slo_ms: float
    good_requests: int
    window_s: float | None
    goodput_rps: float | None
    attainment: float | None
    slo_is_default: bool  # the SLO is DEFAULT_SLO: nobody asked for it
    judged_on: str  # whose TTFT/TPOT were judged: "client", "server" or "client, else server"


@dataclass(slots=True)
class DecodeStalls:
    baseline_ms: float | None
    steps: int
    decode_steps: int
    mixed_steps: int
    stall_ms: float
    request_stall_ms: float
    delayed_decodes: int


@dataclass(slots=True)
class BudgetReport:
    requests: int
    with_client: int
    with_server: int
    errors: int
    no_output: int  # completed with a client view but no content chunk: no client TTFT, not an error
    reference: str  # which TTFT the shares divide by: "client" or "server"
    components: list[ComponentBudget]
    distributions: dict[str, Stat]
    tail: TailAttribution | None
    goodput: Goodput
    stalls: DecodeStalls
    filters: Filters = field(default_factory=dict)
    span_models: list[str] = field(default_factory=list)  # whose spans the rows came from
    unseparated: list[str] = field(default_factory=list)  # what those span models cannot separate
    # which path the figures came from: "exact" (every request) or "rollup", and what that approximates
    source: str = "exact"
    approximation: str | None = None
    client_harnesses: list[str] = field(default_factory=list)  # who measured the client views (`aiperf 0.13.0`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_client(url: str) -> Client:
    """A clickhouse-connect client for `url`, or AnalysisError saying ClickHouse is unreachable."""
    from phaselens.storage.clickhouse_url import connect

    # clickhouse-connect also logs a failed connect; the one-line error below says it all
    logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)
    try:
        return connect(url)
    except ValueError as e:
        raise AnalysisError(str(e)) from None
    except Exception as e:  # noqa: BLE001 — any failure to connect becomes one AnalysisError
        text = str(e)
        refused = "NewConnectionError" in text or "refused" in text.lower()
        reason = "connection refused" if refused else text.splitlines()[0][:160]
        raise AnalysisError(f"cannot reach ClickHouse at {url} ({reason})") from None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) and not _nan(a) and not _nan(b) else None


def _nan(x: object) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _clean(x: float | None) -> float | None:
    return None if x is None or _nan(x) else x


def query_rows(client: Client, name: str, filters: Filters) -> list[Row]:
    """The rows of a named query as {column: value}; ClickHouse errors become AnalysisError."""
    try:
        sql, params = q.render_cli(name, **filters)
        result = client.query(sql, parameters=params)
    except QueryError as e:
        raise AnalysisError(str(e)) from None
    except Exception as e:  # noqa: BLE001 — clickhouse-connect raises DatabaseError/OperationalError subclasses
        raise AnalysisError(_explain(e, str(filters.get("database", "otel")))) from None
    return [dict(zip(result.column_names, row, strict=False)) for row in result.result_rows]


def _run(client: Client, name: str, filters: Filters) -> Row:
    """The first row of a named query as {column: value} ({} when there is none)."""
    rows = query_rows(client, name, filters)
    return rows[0] if rows else {}


def _explain(error: Exception, database: str) -> str:
    text = str(error)
    if "UNKNOWN_TABLE" in text or "UNKNOWN_DATABASE" in text or "Code: 60" in text or "Code: 81" in text:
        return (
            f"the phaselens schema is missing in database {database!r}: "
            "run `phaselens schema apply --clickhouse URL` first"
        )
    return f"ClickHouse query failed: {text.splitlines()[0][:300]}"


def _stat(row: Row, name: str) -> Stat:
    qs = row.get(f"{name}_q") or []
    values = [_clean(v) for v in qs] + [None] * (3 - len(qs))
    return Stat(values[0], values[1], values[2], _clean(row.get(f"{name}_mean")))


def _unobserved(dists: dict[str, Stat]) -> None:
    """A component no request in the selection stamped (`q.OBSERVED_BY`) is unobserved: no figures,
    rather than the 0 ms it counts as inside the mean identity."""
    for name, witness in q.OBSERVED_BY.items():
        if dists[witness].mean is None:
            dists[name] = Stat()


def budget(
    client: Client,
    database: str = "otel",
    service: str | None = None,
    model: str | None = None,
    since: str | None = "15m",
    slo: SLO = DEFAULT_SLO,
    approx: bool = False,
    exact: bool = True,
) -> BudgetReport:
    """The whole budget for the selection (two queries); goodput against `slo` (its ttft and tpot,
    both required: `common.slo.goodput_slo` fills a key left out);
    `since=None` means all time. `exact=False`: the summary from the rollups (DDSketch quantiles,
    goodput and tail from log buckets: `sketch.NOTE`; a window widened to whole minutes), whose cost
    follows the window's minutes, not its requests; `approx`: t-digest over every request."""
    ttft_slo_ms, tpot_slo_ms = slo.ttft_ms, slo.tpot_ms
    if ttft_slo_ms is None or tpot_slo_ms is None:
        raise ValueError(f"goodput needs a TTFT and a TPOT SLO, got {slo.describe()}")
    slos = {"ttft_slo_ms": ttft_slo_ms, "tpot_slo_ms": tpot_slo_ms}
    filters: Filters = {
        "database": database,
        "service": service,
        "model": model,
        "since": since,
        "approx": approx or None,
        **slos,
    }
    rollup = not exact and not approx
    row = _run(client, "budget_summary_rollup" if rollup else "budget_summary", filters)
    dists = {name: _stat(row, name) for name, _ in q.DISTRIBUTIONS}
    reference = "client" if row.get("with_client") else "server"
    whole = dists[f"{reference}_ttft_ms"]
    _unobserved(dists)
    components = [
        ComponentBudget(name, dists[name], dists[name].ratio(whole), name in q.ESTIMATED) for name, _ in q.COMPONENTS
    ]
    requests = int(row.get("requests") or 0)
    return BudgetReport(
        requests=requests,
        with_client=int(row.get("with_client") or 0),
        with_server=int(row.get("with_server") or 0),
        errors=int(row.get("errors") or 0),
        no_output=int(row.get("no_output") or 0),
        reference=reference,
        components=components,
        distributions=dists,
        tail=_tail(row, dists) if requests else None,
        goodput=_goodput(row, (ttft_slo_ms, tpot_slo_ms), slo == DEFAULT_SLO, requests),
        stalls=_stalls(_run(client, "decode_stalls_rollup" if rollup else "decode_stalls", filters)),
        filters={k: v for k, v in filters.items() if v is not None},
        span_models=list(row.get("span_models") or []),
        unseparated=span_models.notes(row.get("span_models") or []),
        source="rollup" if rollup else "exact",
        approximation=sketch.NOTE if rollup else TDIGEST_NOTE if approx else None,
        client_harnesses=list(row.get("client_harnesses") or []),
    )


def _stalls(row: Row) -> DecodeStalls:
    steps, decode_steps, mixed_steps = (int(row.get(k) or 0) for k in ("steps", "decode_steps", "mixed_steps"))
    return DecodeStalls(
        _clean(row.get("baseline_ms")),
        steps,
        decode_steps,
        mixed_steps,
        float(row.get("stall_ms") or 0.0),
        float(row.get("request_stall_ms") or 0.0),
        int(row.get("delayed_decodes") or 0),
    )


def _goodput(row: Row, slo_ms: tuple[float, float], slo_is_default: bool, requests: int) -> Goodput:
    good = int(row.get("good") or 0)
    window = _clean(row.get("window_s")) if row.get("with_server") else None
    judged = judged_on(int(row.get("with_client") or 0), requests)
    return Goodput(*slo_ms, good, window, _div(good, window), _div(good, requests), slo_is_default, judged)


def judged_on(with_client: int, requests: int) -> str:
    """Whose TTFT/TPOT an SLO judges: each request's client view where it has one, else its server's."""
    return "client" if with_client == requests else "server" if not with_client else "client, else server"


def _tail(row: Row, dists: dict[str, Stat]) -> TailAttribution:
    tail_ttft, median_ttft = _clean(row.get("ttft_tail_mean")), dists["ttft_ms"].p50
    growth = None if tail_ttft is None or median_ttft is None else tail_ttft - median_ttft
    comps: list[TailComponent] = []
    for name, _ in q.COMPONENTS:
        tail_mean, median = _clean(row.get(f"{name}_tail_mean")), dists[name].p50
        if name in q.OBSERVED_BY and dists[name].mean is None:  # counted 0 in the rows: unobserved
            tail_mean = None
        delta = None if tail_mean is None or median is None else tail_mean - median
        comps.append(TailComponent(name, tail_mean, median, delta, _div(delta, growth)))
    deltas = {c.name: c.delta_ms for c in comps if c.delta_ms is not None}
    grew_most = max(deltas, key=deltas.__getitem__) if deltas else None
    return TailAttribution(
        _clean(row.get("threshold_ms")), int(row.get("tail_requests") or 0), tail_ttft, median_ttft, comps, grew_most
    )
