"""`phaselens bench` (one measured run) and `phaselens bench sweep` (capacity search): flags → loadgen."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

from rich.console import Console

from phaselens.commands._flags import refuse
from phaselens.common.slo import parse_slo
from phaselens.instrumentation.pipeline import check_sampling_env
from phaselens.loadgen import report, session
from phaselens.loadgen.workloads import LengthDist

_EPILOG = """formulas (client monotonic clock): TTFT = first non-empty content chunk − sent (role-only chunks
don't count); TTFO = first non-reasoning chunk − sent; TPOT = (e2e − TTFT)/(output_tokens − 1) with
usage tokens; ITL = gaps between content chunks (and per token); e2e = last content chunk − sent."""


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be ≥ 0, not {text}")
    return value


def _dist(text: str) -> str:
    try:
        LengthDist.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 < p < 100 for p in values):
        raise argparse.ArgumentTypeError(f"want a comma list of numbers in (0, 100), not {text!r}")
    return values


def _common(p: argparse.ArgumentParser, default) -> None:
    """The run flags; `default(value)` gives each default (SUPPRESS on `sweep`, so flags may stand
    before or after the word `sweep`)."""
    p.add_argument("--url", default=default(None), help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=default(None), help="model name sent in each request")
    p.add_argument("--endpoint", choices=("completions", "chat"), default=default("completions"))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--rate", type=_positive(float), default=default(None), help="open loop: mean requests/s (inf: all at once)"
    )
    mode.add_argument(
        "--concurrency", type=_positive(int), default=default(None), help="closed loop: C requests always in flight"
    )
    mode.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        default=default(None),
        help="replay: lines with timestamp (s) or timestamp_ms [, input_len, output_len, prompt]",
    )
    p.add_argument(
        "--burstiness",
        type=_positive(float),
        default=default(None),
        help="gamma arrivals shape B with --rate (1 = Poisson, <1 burstier)",
    )
    p.add_argument(
        "--max-concurrency",
        type=_positive(int),
        default=default(None),
        help="cap in-flight requests of an open loop (waits show as schedule lag)",
    )
    bound = p.add_mutually_exclusive_group()
    bound.add_argument("--requests", type=_positive(int), default=default(None), help="measured requests (default 100)")
    bound.add_argument("--duration", type=_positive(float), default=default(None), help="seconds of arrivals")
    p.add_argument("--warmup", type=_non_negative_int, default=default(0), help="unmeasured requests first")
    p.add_argument(
        "--input-len",
        type=_dist,
        default=default(None),
        help="prompt length: N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEAN:SIGMA; in tokens "
        f"of --tokenizer, else in English words (≈ 1 token each for an English BPE vocabulary; default "
        f"{session.DEFAULT_INPUT_LEN})",
    )
    p.add_argument(
        "--tokenizer",
        metavar="NAME|PATH",
        default=default(None),
        help="count --input-len in this tokenizer's tokens (transformers, local files only: a "
        "folder or a cached model id)",
    )
    p.add_argument("--output-len", type=_dist, default=default(None), help="max_tokens distribution (default 128)")
    p.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        default=default(None),
        help="prompts: {prompt}, {messages} or ShareGPT {conversations} per line",
    )
    p.add_argument(
        "--shared-prefix", type=_non_negative_int, default=default(0), help="words of prefix common to all prompts"
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        default=default(False),
        help="send ignore_eos and min_tokens=max_tokens to hold output lengths",
    )
    p.add_argument(
        "--chunk-tokens",
        choices=tuple(session.CHUNK_TOKEN_COUNTERS),
        default=default("chunk"),
        help="tokens in a streamed chunk: 1 per chunk, or its UTF-8 bytes (byte-level tokenizers "
        "such as the tiny model's ByT5); the final usage is compared either way",
    )
    p.add_argument("--percentiles", type=_percentiles, default=default((50.0, 90.0, 95.0, 99.0)))
    p.add_argument("--seed", type=int, default=default(0))
    p.add_argument("--timeout", type=_positive(float), default=default(300.0), help="per-request seconds")
    p.add_argument("--api-key", default=default(None), help="sent as Authorization: Bearer KEY")
    p.add_argument("--ca-cert", metavar="PEM", default=default(None), help="CA bundle that verifies an https:// --url")
    p.add_argument("--json", metavar="OUT", default=default(None), help="write every figure and the config")
    p.add_argument("--quiet", action="store_true", default=default(False), help="no progress bar")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server, emitting client spans",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, lambda value: value)
    parser.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--per-request", metavar="OUT.jsonl", help="one line of timings per request")
    parser.set_defaults(func=run, _parser=parser)
    sub = parser.add_subparsers(dest="bench_action", metavar="{sweep}")
    sweep = sub.add_parser(
        "sweep",
        help="find the highest rate whose SLO attainment meets --attainment",
        argument_default=argparse.SUPPRESS,
    )
    _common(sweep, lambda value: argparse.SUPPRESS)
    sweep.add_argument("--slo", required=True, help="e.g. ttft:500,tpot:50 (ms)")
    sweep.add_argument("--attainment", type=float, default=0.9, help="target fraction meeting the SLO")
    sweep.add_argument("--max-rate", type=_positive(float), default=256.0, help="highest rate probed")
    sweep.add_argument("--tolerance", type=_positive(float), default=0.05, help="relative bisection width")
    sweep.set_defaults(func=run_sweep, _parser=sweep)


def _options(args, slo: list[str]) -> session.BenchOptions:
    p = args._parser
    if not args.url or not args.model:
        p.error("--url and --model are required")
    if args.burstiness is not None and args.rate is None:
        p.error("--burstiness needs --rate")
    if args.max_concurrency is not None and args.concurrency is not None:
        p.error("--max-concurrency caps an open loop (--rate/--trace); --concurrency is a closed loop")
    if args.dataset and args.trace:
        p.error("--dataset and --trace both choose prompts: give one")
    if args.dataset:
        synthetic = [f for f, v in (("--input-len", args.input_len), ("--tokenizer", args.tokenizer)) if v is not None]
        refuse(args, synthetic, "size synthetic prompts; --dataset brings its own")
    try:
        parse_slo(slo) if slo else None
        check_sampling_env()  # OTEL_TRACES_SAMPLER_ARG, PHASELENS_TAIL_SLO
    except ValueError as exc:
        p.error(str(exc))
    return session.BenchOptions(
        url=args.url,
        model=args.model,
        endpoint=args.endpoint,
        rate=args.rate,
        burstiness=args.burstiness or 1.0,
        concurrency=args.concurrency or args.max_concurrency,
        trace=args.trace,
        requests=args.requests,
        duration_s=args.duration,
        warmup=args.warmup,
        input_len=args.input_len or session.DEFAULT_INPUT_LEN,
        output_len=args.output_len,
        dataset=args.dataset,
        shared_prefix=args.shared_prefix,
        ignore_eos=args.ignore_eos,
        slo=slo,
        percentiles=args.percentiles,
        seed=args.seed,
        api_key=args.api_key,
        ca_cert=args.ca_cert,
        timeout_s=args.timeout,
        chunk_tokens=args.chunk_tokens,
        tokenizer=args.tokenizer,
    )


def _loaded(args, build):
    """Run `build()`; a bad file (dataset, trace) is a usage error, not a traceback."""
    try:
        return build()
    except (OSError, ValueError) as exc:
        args._parser.error(str(exc))


def run(args) -> int:
    opts = _options(args, args.goodput or [])
    if opts.rate is None and opts.concurrency is None and opts.trace is None:
        opts.concurrency = 1
    plan, _ = _loaded(args, lambda: session.build_plan(opts))
    console = Console()
    total = plan.requests or (len(plan.arrivals.entries) if opts.trace else None)
    with report.LiveProgress(total, console=Console(stderr=True, quiet=args.quiet)) as progress:
        outcome = asyncio.run(session.bench(opts, on_done=progress.on_done))
    title = f"phaselens bench · {opts.model} @ {opts.url} · {outcome.config['arrival']['process']}"
    for table in report.summary_tables(outcome.summary, opts.percentiles, title):
        console.print(table)
    if note := report.client_bottleneck_note(outcome.summary):
        console.print(note)
    if outcome.span_export:
        console.print(
            "client spans: " + ", ".join(f"{k.removeprefix('export_')} {v}" for k, v in outcome.span_export.items())
        )
        if outcome.span_export.get("export_failed"):
            console.print(
                "  (is a collector listening at OTEL_EXPORTER_OTLP_ENDPOINT? "
                "OTEL_TRACES_EXPORTER=none OTEL_METRICS_EXPORTER=none skip the export)"
            )
    if args.json:
        report.write_json(args.json, outcome.summary, outcome.config)
    if args.per_request:
        report.write_per_request(args.per_request, outcome.run.results, outcome.run.start_ts)
    return 1 if outcome.summary["requests"]["completed"] == 0 else 0


def run_sweep(args) -> int:
    opts = _options(args, [args.slo])
    if (opts.concurrency is not None and args.max_concurrency is None) or opts.trace:
        args._parser.error("a sweep varies --rate: --concurrency and --trace do not apply")
    if not 0 < args.attainment <= 1:
        args._parser.error("--attainment must be in (0, 1]")
    if (opts.rate is not None and math.isinf(opts.rate)) or (opts.rate or 1.0) > args.max_rate:
        args._parser.error("the start --rate must be finite and ≤ --max-rate")
    _loaded(args, lambda: session.build_plan(opts, rate=opts.rate or 1.0))
    console = Console()

    def on_probe(probe) -> None:
        ttft = (probe.summary["latency_ms"]["ttft_from_intended"] or {}).get("percentiles", {})
        console.print(
            f"probe rate {probe.rate:8.3f} req/s  attainment {probe.attainment:6.1%}  "
            f"p99 TTFT {ttft.get('p99', float('nan')):8.1f} ms  → {'pass' if probe.passed else 'fail'}"
        )

    result = asyncio.run(
        session.capacity(opts, args.attainment, args.max_rate, on_probe=on_probe, rel_tol=args.tolerance)
    )
    bound = "" if result.bounded else f" (max-rate {args.max_rate:g} passed: capacity is at least that)"
    console.print(
        f"capacity: {result.capacity:.3f} req/s at SLO {args.slo} with attainment ≥ {args.attainment:.0%}{bound}"
    )
    if args.json:
        doc = {
            "capacity_rps": result.capacity,
            "bounded": result.bounded,
            "slo": args.slo,
            "attainment_target": args.attainment,
            "probes": [
                {"rate": p.rate, "attainment": p.attainment, "passed": p.passed, "summary": p.summary}
                for p in result.probes
            ],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.jsonable(doc), f, indent=2)
    return 0
