"""The report's data types: what `phaselens.analysis.report.report` reads from ClickHouse and
`phaselens.analysis.report.report_page` draws. Both import them from here, so neither imports the other's
types (report builds the data, then hands it to the page)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BudgetRow:
    """The TTFT budget at one statistic (p50, p90, p99, mean): components in ms and TTFT itself."""

    label: str
    components: dict[str, float]
    ttft_ms: float | None


@dataclass(slots=True)
class RequestPoint:
    trace_id: str
    input_tokens: int
    client_ttft_ms: float | None
    server_ttft_ms: float | None
    client_tpot_ms: float | None
    server_tpot_ms: float | None
    prefill_ms: float | None


@dataclass(slots=True)
class TraceSpan:
    """One stored span; `start_ts` (an instant, ns) counts from the first span of the same service and P/D instance (that
    process's own clock: never compared across processes), `duration_ns` is the span's own duration."""

    name: str
    kind: str
    service: str
    start_ts: int
    duration_ns: int
    span_id: str
    parent_span_id: str
    role: str = ""  # resource `phaselens.pd.role` of a disaggregated process (router, prefill, decode)
    instance: str = ""  # resource `phaselens.pd.instance`: with the service, one process and one clock


@dataclass(slots=True)
class TraceView:
    title: str
    trace_id: str
    spans: list[TraceSpan]
    hops_ms: dict[str, float] = field(default_factory=dict)  # P/D role → its hop in the P/D budget


@dataclass(slots=True)
class StepPoint:
    t_s: float  # seconds since the first step of the range (server clock)
    prefill_tokens: int
    decode_tokens: int


@dataclass(slots=True)
class DiagnosisView:
    """What the report shows of `phaselens diagnose`: the verdict line, the six steps
    (question, finding, evidence lines) and the levers (cause, action, evidence)."""

    verdict: str
    steps: list[tuple[str, str, list[str]]] = field(default_factory=list)
    levers: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass(slots=True)
class ReportData:
    title: str
    subtitle: str
    kpis: list[tuple[str, str]] = field(default_factory=list)  # (value, label)
    budget: list[BudgetRow] = field(default_factory=list)
    requests: list[RequestPoint] = field(default_factory=list)
    traces: list[TraceView] = field(default_factory=list)
    steps: list[StepPoint] = field(default_factory=list)
    config: dict[str, str] = field(default_factory=dict)
    budget_note: str = ""
    ttft_label: str = "client TTFT"  # the TTFT the budget divides: the client's, else the server's
    diagnosis: DiagnosisView | None = None  # the page opens with it
