"""`phaselens diagnose`: why is it slow? Six steps over what is in ClickHouse, in the order an
inference engineer checks them, then a verdict from a fixed vocabulary (CAUSES).

1. TTFT or decode: which SLO is at risk (figure > MARGIN × SLO) at p50 and at p99.
2. Queueing or prefill: their shares of TTFT, and whether queueing grows with the arrival rate
   (arrival-rate buckets of `queueing_vs_load`; one rate only: the second run to make).
3. Shapes: input and output tokens (p50, p99), which phase the workload stresses.
4. Percentiles: p99 / p50 of TTFT and TPOT; the p50 and p99 verdicts side by side.
5. Goodput: requests within every SLO per second, against completed requests per second.
6. Cause: the verdict of `queries.diagnosis_causes` (the same SQL as the Grafana verdict panel):
   `primary_cause` and the contributing `causes`, each level's own, and the levers (analysis/diagnose/levers.py).

Thresholds: analysis/thresholds.py. The functions below the query calls are pure: figures in,
findings out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from clickhouse_connect.driver.client import Client

from phaselens.analysis import thresholds as th
from phaselens.analysis.budget import pd_budget
from phaselens.analysis.budget.budget_format import slo_text
from phaselens.analysis.budget.latency_budget import AnalysisError, Row, judged_on, query_rows
from phaselens.analysis.diagnose import levers as lv
from phaselens.analysis.diagnose import pd_diagnose
from phaselens.analysis.diagnose.diagnose_figures import (
    Figures,
    LoadDependence,
    bucket_seconds,
    load_dependence,
    num,
    pct,
)
from phaselens.analysis.queries.dialect import Filters
from phaselens.common.slo import DEFAULT_SLO, SLO, with_defaults

CAUSES = (
    "queue",
    "prefill",
    "decode",
    "prefill_stalls",
    "kv_pressure",
    "delivery",
    "network",
    "ingress",
    "client",
    "kv_transfer",  # disaggregated serving only (analysis/diagnose/pd_diagnose.py)
    "none",
)
LEVELS = ("p50", "p99")


@dataclass(slots=True)
class Step:
    number: int
    question: str
    finding: str
    evidence: list[str]


@dataclass(slots=True)
class Signal:
    """One cause's row of the verdict query (rank order)."""

    cause: str
    role: str  # primary | contributing | none | ''
    p50_signal: float | None
    p99_signal: float | None
    threshold: float
    flagged_p50: bool
    flagged_p99: bool


@dataclass(slots=True)
class LevelVerdict:
    """The verdict at one percentile: what is at risk there and what caused it."""

    level: str
    ttft_ms: float | None
    tpot_ms: float | None
    at_risk: list[str]  # "ttft", "tpot"
    primary_cause: str
    causes: list[str]


@dataclass(slots=True)
class Diagnosis:
    primary_cause: str
    causes: list[str]
    levels: dict[str, LevelVerdict]
    steps: list[Step]
    levers: list[lv.Lever]
    signals: list[Signal]
    load: LoadDependence
    requests: int
    slo: dict[str, float]
    filters: Filters = field(default_factory=dict)
    client_harnesses: list[str] = field(default_factory=list)  # who measured the client views
    slo_is_default: bool = False  # `slo` is DEFAULT_SLO: nobody asked for it
    judged_on: str = "client"  # whose TTFT/TPOT the SLO judged (budget.judged_on)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(
    client: Client,
    database: str = "otel",
    service: str | None = None,
    model: str | None = None,
    since: str | None = "15m",
    slo: SLO = DEFAULT_SLO,
) -> Diagnosis:
    """Read the figures, the engine steps, the verdict and the load buckets; assemble the six steps
    (against `slo`, a key left out taking DEFAULT_SLO's)."""
    slo = with_defaults(slo)
    filters: Filters = {
        "database": database,
        "service": service,
        "model": model,
        "since": since,
        "ttft_slo_ms": slo.ttft_ms,
        "tpot_slo_ms": slo.tpot_ms,
    }
    figures = Figures.from_rows(
        query_rows(client, "diagnosis_figures", filters), query_rows(client, "diagnosis_engine", filters)
    )
    if not figures.requests:  # a verdict over nothing would read as "none": say what is missing instead
        raise AnalysisError(f"no requests in the selection ({_describe(filters)}): nothing to diagnose")
    figures.server_url = _server_url(query_rows(client, "diagnosis_target", filters))
    signals = [_signal(row) for row in query_rows(client, "diagnosis_causes", filters)]
    bucket_s = bucket_seconds(figures.window_s)
    load = load_dependence(query_rows(client, "queueing_vs_load", {**filters, "bucket_s": bucket_s}), bucket_s, figures)
    disagg = pd_budget.pd_budget(client, database=database, model=model, since=since)
    signals = pd_diagnose.with_kv_transfer(signals, pd_diagnose.signal(disagg, Signal))
    result = assemble(figures, signals, load, slo, {k: v for k, v in filters.items() if v is not None})
    if pd_diagnose.CAUSE in result.causes:
        result.levers += pd_diagnose.levers(disagg)
    return result


def _describe(filters: Filters) -> str:
    since = filters.get("since")
    parts = [f"database {filters['database']}", "all time" if since is None else f"last {since}"]
    return ", ".join(parts + [f"{k} {filters[k]}" for k in ("service", "model") if filters.get(k)])


def _server_url(rows: list[Row]) -> str | None:
    row = rows[0] if rows else {}
    host, port = row.get("server_address"), row.get("server_port")
    return f"http://{'[' + host + ']' if ':' in (host or '') else host}:{port}" if host and port else None


def _signal(row: Row) -> Signal:
    return Signal(
        row["cause"],
        row["role"],
        row["p50_signal"],
        row["p99_signal"],
        float(row["threshold"]),
        bool(row["flagged_p50"]),
        bool(row["flagged_p99"]),
    )


def assemble(figures: Figures, signals: list[Signal], load: LoadDependence, slo: SLO, filters: Filters) -> Diagnosis:
    """The diagnosis from fetched figures (pure)."""
    primary = next((s.cause for s in signals if s.role == "primary"), "none")
    causes = [s.cause for s in signals if s.role in ("primary", "contributing")] or ["none"]
    levels = {level: _level(level, i, figures, signals, slo) for i, level in enumerate(LEVELS)}
    steps = [
        _step_ttft_or_decode(figures, levels, slo),
        _step_queue_or_prefill(figures, load),
        _step_shapes(figures),
        _step_percentiles(figures, levels),
        _step_goodput(figures, slo),
        _step_cause(primary, causes, levels),
    ]
    return Diagnosis(
        primary,
        causes,
        levels,
        steps,
        lv.levers(causes, figures, load),
        signals,
        load,
        figures.requests,
        slo.describe(),
        filters,
        figures.client_harnesses,
        slo == DEFAULT_SLO,
        judged_on(figures.with_client, figures.requests),
    )


def _level(level: str, i: int, f: Figures, signals: list[Signal], slo: SLO) -> LevelVerdict:
    ttft, tpot = f.at("ttft_ms", i), f.at("tpot_ms", i)
    risk = [
        name
        for name, value, target in (("ttft", ttft, slo.ttft_ms), ("tpot", tpot, slo.tpot_ms))
        if value is not None and target is not None and value > th.MARGIN * target
    ]
    flagged = [s.cause for s in signals if (s.flagged_p50, s.flagged_p99)[i]]
    if not risk:
        return LevelVerdict(level, ttft, tpot, risk, "none", ["none"])
    # nothing reached its threshold at this level: the overall rank order still names the likeliest
    causes = flagged or [s.cause for s in signals[:1]] or ["none"]
    return LevelVerdict(level, ttft, tpot, risk, causes[0], causes)


def _stat(f: Figures, name: str, label: str, unit: str = " ms") -> str:
    """`label p50 = a, p99 = b (n = N)`: a figure with its percentiles and sample size."""
    return f"{label} p50 = {num(f.at(name, 0), unit)}, p99 = {num(f.at(name, 1), unit)} (n = {f.requests})"


def _step_ttft_or_decode(f: Figures, levels: dict[str, LevelVerdict], slo: SLO) -> Step:
    risky = {name for v in levels.values() for name in v.at_risk}
    if "ttft" in risky:
        finding = "users wait before any output: start with TTFT, not with decode kernels"
    elif "tpot" in risky:
        finding = "the first token comes in time; the stream is slow: look at decode"
    else:
        finding = f"TTFT and TPOT hold with margin (≤ {th.MARGIN:g} × SLO) at p50 and p99"
    share = f"time to first token is {pct(f.share('ttft_ms', 'e2e_ms', 0))} of e2e at p50"
    return Step(
        1,
        "TTFT or decode?",
        finding,
        [
            f"{_stat(f, 'ttft_ms', 'TTFT')} against SLO {slo.ttft_ms:g} ms",
            f"{_stat(f, 'tpot_ms', 'TPOT')} against SLO {slo.tpot_ms:g} ms",
            share,
        ],
    )


def _step_queue_or_prefill(f: Figures, load: LoadDependence) -> Step:
    q50, p50 = f.share("queue_ms", "ttft_ms", 0), f.share("prefill_ms", "ttft_ms", 0)
    q99, p99 = f.share("queue_ms", "ttft_ms", 1), f.share("prefill_ms", "ttft_ms", 1)
    bigger = (
        "queueing (capacity, scheduling)"
        if (q99 or 0) + (q50 or 0) > (p99 or 0) + (p50 or 0)
        else "prefill (prompt compute)"
    )
    return Step(
        2,
        "Queueing or prefill?",
        f"{bigger} takes more of TTFT; {load.finding}",
        [
            f"{_stat(f, 'queue_ms', 'queue')}: {pct(q50)} of TTFT p50, {pct(q99)} of TTFT p99",
            f"{_stat(f, 'prefill_ms', 'prefill')}: {pct(p50)} of TTFT p50, {pct(p99)} of TTFT p99",
            *load.evidence,
        ],
    )


def _step_shapes(f: Figures) -> Step:
    inp, out = f.at("input_tokens", 0), f.at("output_tokens", 0)
    ratio = None if not inp or not out else inp / out
    if ratio is None:
        finding = "no token counts in the spans"
    elif ratio >= th.PROMPT_HEAVY:
        finding = f"prompt-heavy ({ratio:.0f} input tokens per output token at p50): the workload stresses prefill"
    else:
        finding = f"output-heavy ({ratio:.1f} input tokens per output token at p50): the workload stresses decode"
    return Step(
        3,
        "Which phase does the workload stress?",
        finding,
        [
            _stat(f, "input_tokens", "input tokens", ""),
            _stat(f, "output_tokens", "output tokens", ""),
            f"prefix-cache hit rate {pct(f.prefix_hit_rate)} of input tokens",
        ],
    )


def _step_percentiles(f: Figures, levels: dict[str, LevelVerdict]) -> Step:
    p50, p99 = levels["p50"], levels["p99"]
    same = p50.primary_cause == p99.primary_cause
    finding = (
        f"p50 and p99 have the same cause ({p50.primary_cause})"
        if same
        else f"the tail has its own cause: p50 → {p50.primary_cause}, p99 → {p99.primary_cause}"
    )
    ratios = [
        f"{name} p99 / p50 = {high / low:.1f}"
        for name, col in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))
        if (low := f.at(col, 0)) and (high := f.at(col, 1)) is not None
    ]
    return Step(
        4,
        "Percentiles, not means",
        finding,
        [
            *ratios,
            f"p50: at risk {', '.join(p50.at_risk) or 'nothing'}; causes {', '.join(p50.causes)}",
            f"p99: at risk {', '.join(p99.at_risk) or 'nothing'}; causes {', '.join(p99.causes)}",
        ],
    )


def _step_goodput(f: Figures, slo: SLO) -> Step:
    """goodput = requests within every SLO / window_s; completed = (requests − errors) / window_s;
    attainment = requests within every SLO / requests."""
    window = f.window_s or 0
    completed = (f.requests - f.errors) / window if window else None
    goodput = f.good / window if window else None
    attainment = f.good / f.requests if f.requests else None
    finding = f"{pct(attainment)} of requests meet every SLO" if attainment is not None else "no requests"
    against = slo_text(slo.ttft_ms or 0, slo.tpot_ms or 0, slo == DEFAULT_SLO, judged_on(f.with_client, f.requests))
    return Step(
        5,
        "Goodput under the SLO",
        finding,
        [
            (
                f"goodput {goodput or 0:.2f} req/s of {completed or 0:.2f} completed req/s over {window:.1f} s "
                f"({f.good} of {f.requests} requests, {f.errors} errors; "
                f"{against})"
            )
        ],
    )


def _step_cause(primary: str, causes: list[str], levels: dict[str, LevelVerdict]) -> Step:
    finding = (
        "every SLO holds with margin: none"
        if primary == "none"
        else f"primary cause {primary}" + (f"; contributing {', '.join(causes[1:])}" if causes[1:] else "")
    )
    return Step(
        6,
        "Cause, from server-side evidence",
        finding,
        [f"{v.level}: {v.primary_cause} (causes: {', '.join(v.causes)})" for v in levels.values()],
    )
