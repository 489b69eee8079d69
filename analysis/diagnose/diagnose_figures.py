"""The figures a diagnosis reads (queries `diagnosis_figures`, `diagnosis_engine`) and the load
dependence, from the arrival-rate buckets of `queueing_vs_load`:

    bucket_s  = max(1 s, window / LOAD_BUCKETS)
    rate(b)   = arrivals in time bucket b / bucket_s, for the interior buckets (the first and the last
                are partly outside the run) with ≥ MIN_BUCKET_REQUESTS arrivals
    one rate  ⇔ fewer than 2 such buckets, or max rate / min rate < RATE_SPREAD
    grows     ⇔ median queue p50 of the faster half ≥ QUEUE_GROWTH × that of the slower half

With one rate the low-load TTFT is unknown: the finding says so and names the `phaselens bench` run
that would measure it (a quarter of the measured rate, same request count, prompt and output length).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from phaselens.analysis import thresholds as th
from phaselens.analysis.budget.latency_budget import Row
from phaselens.loadgen.workloads import BYTES_PER_WORD

BYTE_LEVEL_MODELS = ("tiny",)  # the reference server's built-in model: ByT5, one token per UTF-8 byte


@dataclass(slots=True)
class Figures:
    requests: int = 0
    errors: int = 0
    with_client: int = 0
    good: int = 0
    window_s: float | None = None
    prefix_hit_rate: float | None = None
    preempted_share: float | None = None
    models: list[str] = field(default_factory=list)
    client_harnesses: list[str] = field(default_factory=list)  # who measured the client views
    server_url: str | None = None  # what the clients called (their CLIENT spans' server.address:port)
    quantiles: dict[str, list[float | None]] = field(default_factory=dict)  # name → [p50, p99]
    engine: dict[str, float | None] = field(default_factory=dict)  # the diagnosis_engine row

    @classmethod
    def from_rows(cls, figures: list[Row], engine: list[Row]) -> Figures:
        row = figures[0] if figures else {}
        requests, errors, with_client, good = (
            int(row.get(k) or 0) for k in ("requests", "errors", "with_client", "good")
        )
        return cls(
            requests,
            errors,
            with_client,
            good,
            _clean(row.get("window_s")) if requests else None,
            _clean(row.get("prefix_hit_rate")),
            _clean(row.get("preempted_share")),
            list(row.get("models") or []),
            list(row.get("client_harnesses") or []),
            quantiles={k.removesuffix("_q"): [_clean(v) for v in vals] for k, vals in row.items() if k.endswith("_q")},
            engine={k: _clean(v) for k, v in (engine[0] if engine else {}).items()},
        )

    def at(self, name: str, i: int) -> float | None:
        """Level `i` (0 = p50, 1 = p99) of figure `name`."""
        values = self.quantiles.get(name) or []
        return values[i] if i < len(values) else None

    def share(self, part: str, whole: str, i: int) -> float | None:
        """part / whole at level `i` (both the same percentile), None when either is unknown or whole is 0."""
        a, b = self.at(part, i), self.at(whole, i)
        return None if a is None or not b else a / b


def pct(x: float | None) -> str:
    """A share as a whole percentage ("42 %"), "–" when unknown."""
    return "–" if x is None else f"{100 * x:.0f} %"


def num(x: float | None, unit: str = " ms") -> str:
    """A figure with one decimal and its unit ("12.5 ms"), "–" when unknown."""
    return "–" if x is None else f"{x:.1f}{unit}"


def _clean(x: float | None) -> float | None:
    """NaN (ClickHouse's quantile of nothing, 0/0) → None."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


@dataclass(slots=True)
class LoadDependence:
    buckets: int
    bucket_s: int
    rate_low_rps: float | None
    rate_high_rps: float | None
    queue_low_ms: float | None  # median of the slower half's bucket queue p50
    queue_high_ms: float | None
    single_rate: bool
    grows: bool | None  # queueing grows with the arrival rate; None with a single rate
    next_run: str | None  # the bench command that measures a second rate
    finding: str = ""
    evidence: list[str] = field(default_factory=list)


def bucket_seconds(window_s: float | None) -> int:
    return max(1, round((window_s or 0) / th.LOAD_BUCKETS))


def load_dependence(rows: list[Row], bucket_s: int, f: Figures) -> LoadDependence:
    """`rows`: the `queueing_vs_load` buckets in time order."""
    usable = sorted(
        (
            r
            for r in rows[1:-1]
            if (r.get("arrivals_per_s") or 0) * bucket_s >= th.MIN_BUCKET_REQUESTS
            and _clean(r.get("queue_p50_ms")) is not None
        ),
        key=lambda r: r["arrivals_per_s"],
    )
    rates = [r["arrivals_per_s"] for r in usable]
    if len(usable) < 2 or rates[-1] < th.RATE_SPREAD * rates[0]:
        return _single_rate(rates, bucket_s, f)
    half = len(usable) // 2
    low = statistics.median(r["queue_p50_ms"] for r in usable[:half])
    high = statistics.median(r["queue_p50_ms"] for r in usable[half:])
    grows = high >= th.QUEUE_GROWTH * max(low, 1e-3)
    finding = "queueing grows with the arrival rate" if grows else "queueing does not grow with the arrival rate"
    evidence = [
        (
            f"queue p50 {high:.1f} ms in the faster half of {len(usable)} {bucket_s}-s buckets "
            f"({rates[half]:.2f}–{rates[-1]:.2f} req/s) vs {low:.1f} ms in the slower half "
            f"({rates[0]:.2f}–{rates[half - 1]:.2f} req/s)"
        )
    ]
    return LoadDependence(len(usable), bucket_s, rates[0], rates[-1], low, high, False, grows, None, finding, evidence)


def _single_rate(rates: list[float], bucket_s: int, f: Figures) -> LoadDependence:
    rate = f.requests / f.window_s if f.window_s else None
    command = next_run_command(f, rate)
    spread = f" ({rates[0]:.2f}–{rates[-1]:.2f} req/s)" if rates else ""
    evidence = [
        f"{len(rates)} comparable {bucket_s}-s arrival bucket(s){spread}; "
        + (f"{rate:.2f} req/s over the run" if rate else "no arrival rate")
    ]
    if command:
        evidence.append(f"low-load run: {command}")
    return LoadDependence(
        len(rates),
        bucket_s,
        rate,
        rate,
        None,
        None,
        True,
        None,
        command,
        "one arrival rate only: whether TTFT grows with load needs a second run at a lower rate",
        evidence,
    )


def next_run_command(f: Figures, rate: float | None) -> str | None:
    """`phaselens bench` at a quarter of the measured rate against the server the clients called,
    same model, request count, p50 prompt (input_len_words) and output length."""
    if not rate or not f.requests:
        return None
    output, words = f.at("output_tokens", 0), input_len_words(f)
    opts = [
        f"--url {f.server_url or 'http://SERVER:PORT'}",
        *([f"--model {f.models[0]}"] if f.models else []),
        f"--rate {max(rate / 4, 0.05):.2f}",
        f"--requests {max(f.requests, 20)}",
        *([f"--input-len {words}"] if words else []),
        *([f"--output-len {int(output)}"] if output else []),
        "--ignore-eos",
    ]
    return "phaselens bench " + " ".join(opts)


def input_len_words(f: Figures) -> int | None:
    """`phaselens bench --input-len` (words, no --tokenizer is known here) for the measured prompt p50:
        byte-level model (BYTE_LEVEL_MODELS): words = max(1, round(tokens / BYTES_PER_WORD))
        otherwise:                            words = tokens  (≈ one token a word in an English BPE vocabulary)
    The byte-level case matters: its prompt tokens as words would be ~4.8× as many tokens."""
    tokens = f.at("input_tokens", 0)
    if not tokens:
        return None
    if f.models and all(model in BYTE_LEVEL_MODELS for model in f.models):
        return max(1, round(tokens / BYTES_PER_WORD))
    return int(tokens)
