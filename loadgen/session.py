"""One benchmark session as `phaselens bench` runs it: options → plan + workload → run → figures.

Client spans go to the providers of `phaselens.instrumentation.pipeline.otel_setup.configure("phaselens-loadgen")`
(standard `OTEL_*` variables) and are flushed before the session returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from phaselens.common.slo import SLO, parse_slo
from phaselens.common.tls import client_context
from phaselens.instrumentation import TracedClient
from phaselens.instrumentation.pipeline import compact_env_sampler, configure, export_counters
from phaselens.loadgen import metrics, report, runner, sweep
from phaselens.loadgen.arrivals import GammaArrivals, TraceArrivals
from phaselens.loadgen.token_prompts import TokenPrompts
from phaselens.loadgen.workloads import DatasetWorkload, LengthDist, SyntheticWorkload, TraceWorkload

SERVICE_NAME = "phaselens-loadgen"


DEFAULT_INPUT_LEN = "128"  # prompt length distribution of synthetic prompts (--input-len)


@dataclass(slots=True)
class BenchOptions:
    url: str
    model: str
    endpoint: str = "completions"
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop without a rate; with a rate, the in-flight cap
    trace: str | None = None
    requests: int | None = None
    duration_s: float | None = None
    warmup: int = 0
    input_len: str = DEFAULT_INPUT_LEN
    output_len: str | None = None  # None: 128, or the dataset's lengths
    dataset: str | None = None
    shared_prefix: int = 0
    ignore_eos: bool = False
    slo: list[str] = field(default_factory=list)
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
    seed: int = 0
    api_key: str | None = None
    ca_cert: str | None = None  # PEM bundle that verifies an https:// server (None: the system's)
    timeout_s: float = 300.0
    chunk_tokens: str = "chunk"  # tokens per content chunk: "chunk" (1 each) or "bytes" (UTF-8 bytes)
    tokenizer: str | None = None  # --input-len in this tokenizer's tokens (local files only), else words


def build_plan(
    opts: BenchOptions, rate: float | None = None
) -> tuple[runner.RunPlan, SyntheticWorkload | DatasetWorkload | TraceWorkload]:
    """(plan, workload) for the options; `rate` overrides `opts.rate` (sweep probes)."""
    rate = rate if rate is not None else opts.rate
    output = LengthDist.parse(opts.output_len) if opts.output_len else None
    tokens = TokenPrompts.load(opts.tokenizer) if opts.tokenizer else None
    synthetic = SyntheticWorkload(
        LengthDist.parse(opts.input_len), output or LengthDist("fixed", 128), opts.shared_prefix, opts.seed, tokens
    )
    arrivals: GammaArrivals | TraceArrivals | None
    workload: SyntheticWorkload | DatasetWorkload | TraceWorkload
    if opts.trace:
        arrivals = TraceArrivals(opts.trace)
        workload = TraceWorkload(arrivals.entries, synthetic)
    else:
        arrivals = GammaArrivals(rate, opts.burstiness, opts.seed) if rate is not None else None
        workload = (
            DatasetWorkload(opts.dataset, output, 128, opts.shared_prefix, opts.seed) if opts.dataset else synthetic
        )
    requests = opts.requests
    if requests is None and opts.duration_s is None and not opts.trace:
        requests = 100
    plan = runner.RunPlan(
        endpoint=opts.endpoint,
        model=opts.model,
        arrivals=arrivals,
        concurrency=opts.concurrency,
        requests=requests,
        duration_s=opts.duration_s,
        warmup=opts.warmup,
        ignore_eos=opts.ignore_eos,
    )
    return plan, workload


def config_of(opts: BenchOptions, plan: runner.RunPlan, workload) -> dict:
    """The full configuration recorded beside the figures (the API key left out)."""
    arrival = plan.arrivals.describe() if plan.arrivals else {"process": "closed_loop"}
    slo = slo_of(opts)
    return {
        "url": opts.url,
        "model": opts.model,
        "endpoint": opts.endpoint,
        "arrival": {**arrival, "max_concurrency" if plan.arrivals else "concurrency": plan.concurrency},
        "requests": plan.requests,
        "duration_s": plan.duration_s,
        "warmup": plan.warmup,
        "workload": workload.describe(),
        "ignore_eos": opts.ignore_eos,
        "seed": opts.seed,
        "percentiles": list(opts.percentiles),
        "slo_ms": slo.describe() if slo else None,
        "timeout_s": opts.timeout_s,
        "versions": report.versions(),
        "options": {k: v for k, v in asdict(opts).items() if k != "api_key"},
    }


def slo_of(opts: BenchOptions) -> SLO | None:
    return parse_slo(opts.slo) if opts.slo else None


CHUNK_TOKEN_COUNTERS = {"chunk": None, "bytes": lambda text: len(text.encode())}  # None: 1 per chunk


def _client(opts: BenchOptions, providers, tracer_provider) -> TracedClient:
    headers = {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
    return TracedClient(
        opts.url,
        tracer_provider=tracer_provider,
        timeout_s=opts.timeout_s,
        headers=headers,
        meter_provider=providers.meter_provider if providers else None,
        token_counter=CHUNK_TOKEN_COUNTERS[opts.chunk_tokens],
        ssl_context=client_context(opts.ca_cert) if opts.ca_cert else None,
    )


def _providers(tracer_provider):
    """(providers to flush or None, tracer provider): `configure()`'s unless one is given."""
    if tracer_provider is not None:
        return None, tracer_provider
    providers = configure(SERVICE_NAME, sampler=compact_env_sampler())  # every request's CLIENT span exported
    return providers, providers.tracer_provider


def _flush(providers) -> dict:
    """Flush and close what `configure()` made; return its span export counters."""
    if providers is None:
        return {}
    providers.shutdown()
    return export_counters(providers.tracer_provider)


@dataclass(slots=True)
class BenchOutcome:
    run: runner.RunResult
    summary: dict
    config: dict
    span_export: dict  # counters of the client-span exporter ({} with a caller's provider)


async def bench(opts: BenchOptions, on_done=None, tracer_provider=None) -> BenchOutcome:
    """One measured run. `tracer_provider` None: the `configure()` providers (flushed at the end)."""
    plan, workload = build_plan(opts)
    providers, provider = _providers(tracer_provider)
    try:
        async with _client(opts, providers, provider) as client:
            result = await runner.run(plan, client, workload.requests(), on_done)
    finally:
        exported = _flush(providers)
    summary = metrics.summarize(result.results, result.duration_s, opts.percentiles, slo_of(opts))
    return BenchOutcome(result, summary, config_of(opts, plan, workload), exported)


async def capacity(
    opts: BenchOptions, target: float, max_rate: float, on_probe=None, tracer_provider=None, rel_tol: float = 0.05
) -> sweep.SweepResult:
    """Capacity sweep over the request rate (start: `opts.rate`, default 1 req/s)."""
    slo = slo_of(opts)
    if slo is None:
        raise ValueError("a sweep needs --slo")
    providers, provider = _providers(tracer_provider)
    warm = [opts.warmup]

    async def probe(rate: float) -> tuple[float, dict]:
        plan, workload = build_plan(replace(opts, warmup=warm[0]), rate)
        warm[0] = 0  # warm the server once, before the first probe
        result = await runner.run(plan, client, workload.requests())
        summary = metrics.summarize(result.results, result.duration_s, opts.percentiles, slo)
        return summary["goodput"]["attainment"], summary

    try:
        async with _client(opts, providers, provider) as client:
            return await sweep.find_capacity(
                probe, target, opts.rate or 1.0, max_rate, rel_tol=rel_tol, on_probe=on_probe
            )
    finally:
        _flush(providers)
