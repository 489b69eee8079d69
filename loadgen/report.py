"""Output of a run: live progress bar, summary table, `--json` document, `--per-request` JSONL."""

from __future__ import annotations

import json
import math
import platform
from importlib import metadata
from typing import Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from phaselens.instrumentation import StreamResult

_LATENCY_ROWS = (
    ("ttft", "TTFT (ms)"),
    ("ttfo", "TTFO (ms)"),
    ("tpot", "TPOT (ms)"),
    ("itl", "ITL per chunk (ms)"),
    ("itl_per_token", "ITL per token (ms)"),
    ("e2e", "E2E latency (ms)"),
    ("ttft_from_intended", "TTFT from intended (ms)"),
    ("e2e_from_intended", "E2E from intended (ms)"),
    ("schedule_lag", "Schedule lag (ms)"),
    ("client", "Client own time: send + read (ms)"),
)


def versions() -> dict:
    found = {"python": platform.python_version()}
    for dist in ("phaselens", "httpx", "opentelemetry-sdk", "numpy"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


class LiveProgress:
    """A rich progress bar over the measured requests (on stderr); `on_done` is the runner callback."""

    def __init__(self, total: int | None, console: Console | None = None):
        self.failed = 0
        self._progress = Progress(
            TextColumn("[bold]bench"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=True,
        )
        self._task = self._progress.add_task("requests", total=total, failed=0)

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def on_done(self, result: StreamResult) -> None:
        self.failed += not result.ok
        self._progress.update(self._task, advance=1, failed=self.failed)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str) or (isinstance(value, float) and math.isinf(value)):
        return "inf"
    return f"{value:,.2f}" if isinstance(value, float) else f"{value:,}"


def summary_tables(summary: dict, percentiles: tuple[float, ...], title: str) -> list[Table]:
    """The headline figures and one row per latency statistic."""
    head = Table(title=title, show_header=False, title_justify="left")
    head.add_column("figure")
    head.add_column("value", justify="right")
    req, thr, tok = summary["requests"], summary["throughput"], summary["tokens"]
    rows = [
        ("Requests completed / failed", f"{req['completed']} / {req['failed']}"),
        ("Error rate", f"{req['error_rate']:.1%}"),
        ("Completed with no output (no TTFT)", str(req["no_output"])),
        *((f"  errors: {k}", str(v)) for k, v in req["errors"].items()),
        ("Duration (s)", _fmt(summary["duration_s"])),
        ("Request throughput (req/s)", _fmt(thr["requests_per_s"])),
        ("Output token throughput (tok/s)", _fmt(thr["output_tokens_per_s"])),
        ("Total token throughput (tok/s)", _fmt(thr["total_tokens_per_s"])),
        ("Input / output tokens (usage)", f"{tok['input']:,} / {tok['output']:,}"),
        ("Usage ≠ counted (requests, tokens)", f"{tok['usage_mismatch_requests']}, {tok['usage_mismatch_tokens']}"),
    ]
    if "goodput" in summary:
        good = summary["goodput"]
        rows += [
            ("SLO (ms)", " ".join(f"{k.removesuffix('_ms')}≤{v:g}" for k, v in good["slo_ms"].items())),
            ("SLO attainment", f"{good['attainment']:.1%}"),
            ("Goodput (req/s)", _fmt(good["requests_per_s"])),
        ]
    for row in rows:
        head.add_row(*row)
    labels = [f"p{p:g}" for p in percentiles]
    lat = Table(show_header=True, title_justify="left")
    for col in ("metric", "mean", "std", *labels, "max"):
        lat.add_column(col, justify="left" if col == "metric" else "right", no_wrap=col == "metric")
    for key, label in _LATENCY_ROWS:
        s = summary["latency_ms"].get(key)
        if s:
            lat.add_row(
                label, _fmt(s["mean"]), _fmt(s["std"]), *(_fmt(s["percentiles"][x]) for x in labels), _fmt(s["max"])
            )
    for key, tail in summary["failure_adjusted_ms"].items():
        if tail and summary["requests"]["failed"]:
            lat.add_row(f"{key} failure-adjusted", "", "", *(_fmt(tail[x]) for x in labels), "")
    return [head, lat]


def jsonable(value):
    """JSON has no infinity: a failure-adjusted +∞ is written as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_json(path: str, summary: dict, config: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(jsonable({"config": config, "summary": summary}), f, indent=2)
        f.write("\n")


def client_bottleneck_note(summary: dict) -> str | None:
    """What to tell at the end of a run whose client was its own bottleneck (metrics.client_bottleneck)."""
    figure = summary.get("client_bottleneck")
    if not figure or not figure["bottleneck"]:
        return None
    coalesced = figure.get("coalesced_reads") or 0
    hidden = (
        f" {coalesced} of {figure['first_reads']} first-chunk reads also held later chunks, so TCP stamped them "
        "late and the figure understates the wait (`phaselens budget`: client_late_est_ms estimates the rest)."
        if coalesced
        else ""
    )
    return (
        f"the client was a bottleneck: its own time (before each request's bytes left, and reading the "
        f"first chunk after it arrived) was {figure['client_p90_ms']:.1f} ms at p90, "
        f"{100 * figure['share']:.0f} % of TTFT p90 ({figure['ttft_p90_ms']:.1f} ms): the TTFT figures "
        f"include it.{hidden} Run fewer streams per client process, or more client processes."
    )


def request_row(index: int, r: StreamResult, start_ts: int) -> dict:
    """One `--per-request` line: timings (ms, client monotonic clock), tokens, trace id, error."""
    rel = lambda ts: None if ts is None else (ts - start_ts) / 1e6  # noqa: E731
    return {
        "index": index,
        "intended_ms": rel(r.intended_ts),
        "sent_ms": rel(r.sent_ts),
        "schedule_lag_ms": r.schedule_lag_ms,
        "ttft_ms": r.ttft_ms,
        "client_send_ms": r.send_ms,
        "client_read_ms": r.read_ms,
        "client_end_read_ms": r.end_read_ms,
        "client_read_coalesced": r.read_coalesced,
        "ttfo_ms": r.ttfo_ms,
        "tpot_ms": r.tpot_ms,
        "e2e_ms": r.e2e_ms,
        "elapsed_ms": r.elapsed_ms,
        "itl_ms": r.itl_ms,
        "chunk_tokens": r.chunk_tokens,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "counted_tokens": r.counted_tokens,
        "usage_mismatch": r.usage_mismatch,
        "finish_reasons": r.finish_reasons,
        "status": r.status,
        "error_type": r.error_type,
        "error": r.error,
        "trace_id": r.trace_id,
        "span_id": r.span_id,
        "response_id": r.response_id,
        "sent_wall_ns": r.sent_wall_ts,
    }


def write_per_request(path: str, results: list[StreamResult], start_ts: int) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(request_row(i, r, start_ts)) + "\n" for i, r in enumerate(results))
