"""Run-level metrics from per-request `StreamResult`s (per-request formulas: phaselens.instrumentation.client.traced_client).

- Statistics: mean, std (population), min, max and the requested percentiles
  (`phaselens.common.quantile`: linear interpolation between closest ranks) over the successful
  requests; ITL is pooled over every gap of every request.
- Latency from the intended send time (coordinated-omission aware):
      ttft_from_intended = TTFT + schedule lag,  e2e_from_intended = e2e + schedule lag,
  schedule lag = actual send − intended send (a full client semaphore or a late event loop shows here).
- Failure-adjusted tails: percentiles over all requests with a failure counted as +∞ latency.
- Throughput over the run's duration D (first intended send → last response closed):
      requests/s = completed / D, output tokens/s = Σ output_tokens / D, total = (Σ input + Σ output) / D.
- SLOs (any of ttft, tpot, e2el in ms): a request meets them when it succeeded and every SLO given holds,
  TTFT and e2e taken from the intended send time; TPOT holds trivially for ≤ 1 output token.
      attainment = met / all requests,  goodput = met / D (requests per second).
- usage mismatch: requests whose `usage.completion_tokens` differs from the counted chunk tokens.
- The client's own time per request, client = send + read (the request started → its bytes handed
  over, less a new connection's connect; the first content bytes in this host's kernel → read; kernel
  receive stamps). The client is the bottleneck when client p90 ≥ CLIENT_BOTTLENECK_SHARE × TTFT p90:
  its own lateness then inflates the TTFT it reports (`client_bottleneck`). A first-chunk read that
  also held later chunks (`read_coalesced`) carries the newest packet's stamp, so its read time is
  understated: the count is reported beside the figure (the server's spans estimate the rest:
  `client_late_est_ms`, docs/budget-method.md).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

from phaselens.common.quantile import quantile
from phaselens.common.slo import SLO
from phaselens.instrumentation import StreamResult

INF = float("inf")
CLIENT_BOTTLENECK_SHARE = 0.1  # the client's own time at p90, as a share of TTFT p90


@dataclass(slots=True)
class Stat:
    count: int
    mean: float
    std: float
    min: float
    max: float
    percentiles: dict[str, float | None]  # quantile() of ≥ 1 value: never None


def pct_label(p: float) -> str:
    return f"p{p:g}"


def stat(values: list[float], percentiles: tuple[float, ...]) -> Stat | None:
    """Summary of `values` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    mean = math.fsum(ordered) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in ordered) / n)
    return Stat(
        count=n,
        mean=mean,
        std=std,
        min=ordered[0],
        max=ordered[-1],
        percentiles={pct_label(p): quantile(ordered, p / 100) for p in percentiles},
    )


def meets(slo: SLO, r: StreamResult) -> bool:
    """The request succeeded and holds every SLO given (TTFT and e2e from the intended send time)."""
    if not r.ok:
        return False
    lag = r.schedule_lag_ms or 0.0
    return (
        (slo.ttft_ms is None or (r.ttft_ms is not None and r.ttft_ms + lag <= slo.ttft_ms))
        and (slo.tpot_ms is None or r.tpot_ms is None or r.tpot_ms <= slo.tpot_ms)
        and (slo.e2el_ms is None or (r.e2e_ms is not None and r.e2e_ms + lag <= slo.e2el_ms))
    )


def attainment(results: list[StreamResult], slo: SLO) -> float:
    return sum(meets(slo, r) for r in results) / len(results) if results else 0.0


def _tail(results: list[StreamResult], value, percentiles) -> dict[str, float | None] | None:
    """Percentiles with each failed request (or one without the value) counted as +∞."""
    values = sorted(INF if not r.ok or value(r) is None else value(r) for r in results)
    return {pct_label(p): quantile(values, p / 100) for p in percentiles} if values else None


def _lagged(value):
    return lambda r: None if value(r) is None else value(r) + (r.schedule_lag_ms or 0.0)


def client_own_ms(r: StreamResult) -> float | None:
    """send + read (a part not observed counts 0); None when neither was observed."""
    if r.send_ms is None and r.read_ms is None:
        return None
    return (r.send_ms or 0.0) + (r.read_ms or 0.0)


_LATENCIES = {
    "ttft": lambda r: r.ttft_ms,
    "ttfo": lambda r: r.ttfo_ms,
    "tpot": lambda r: r.tpot_ms,
    "e2e": lambda r: r.e2e_ms,
    "schedule_lag": lambda r: r.schedule_lag_ms,
    "client": client_own_ms,
}
_LATENCIES["ttft_from_intended"] = _lagged(_LATENCIES["ttft"])
_LATENCIES["e2e_from_intended"] = _lagged(_LATENCIES["e2e"])


def client_bottleneck(results: list[StreamResult]) -> dict | None:
    """The client's own time at p90 against TTFT p90 (module docstring); None when not observed."""
    ttft = sorted(r.ttft_ms for r in results if r.ok and r.ttft_ms is not None)
    own = sorted(v for r in results if r.ok and r.ttft_ms is not None and (v := client_own_ms(r)) is not None)
    ttft_p90, own_p90 = quantile(ttft, 0.9), quantile(own, 0.9)
    if ttft_p90 is None or own_p90 is None:
        return None
    share = own_p90 / ttft_p90 if ttft_p90 > 0 else 0.0
    return {
        "client_p90_ms": own_p90,
        "ttft_p90_ms": ttft_p90,
        "share": share,
        "bottleneck": share >= CLIENT_BOTTLENECK_SHARE,
        "coalesced_reads": sum(r.read_coalesced for r in results if r.ok and r.ttft_ms is not None),
        "first_reads": len(ttft),
    }


def summarize(
    results: list[StreamResult], duration_s: float, percentiles: tuple[float, ...], slo: SLO | None = None
) -> dict:
    """Every run-level figure as a JSON-ready dict (see the module docstring for the formulas)."""
    ok = [r for r in results if r.ok]
    latency = {name: stat([v for r in ok if (v := fn(r)) is not None], percentiles) for name, fn in _LATENCIES.items()}
    latency["itl"] = stat([g for r in ok for g in r.itl_ms], percentiles)
    latency["itl_per_token"] = stat([g for r in ok for g in r.itl_per_token_ms], percentiles)
    input_tokens = sum(r.input_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens_used for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary = {
        "requests": {
            "total": len(results),
            "completed": len(ok),
            "failed": len(results) - len(ok),
            "no_output": sum(r.no_output for r in ok),
            "error_rate": (len(results) - len(ok)) / len(results) if results else 0.0,
            "errors": dict(Counter(r.error_type for r in results if not r.ok)),
        },
        "duration_s": duration_s,
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(output_tokens),
            "total_tokens_per_s": per_s(input_tokens + output_tokens),
        },
        "tokens": _token_figures(ok, input_tokens, output_tokens),
        "latency_ms": {k: (asdict(v) if v else None) for k, v in latency.items()},
        "client_bottleneck": client_bottleneck(results),
        "failure_adjusted_ms": {
            name: _tail(results, _LATENCIES[name], percentiles)
            for name in ("ttft", "e2e", "ttft_from_intended", "e2e_from_intended")
        },
    }
    if slo is not None:
        met = sum(meets(slo, r) for r in results)
        summary["goodput"] = {
            "slo_ms": slo.describe(),
            "met": met,
            "attainment": met / len(results) if results else 0.0,
            "requests_per_s": per_s(met),
        }
    return summary


def _token_figures(ok: list[StreamResult], input_tokens: int, output_tokens: int) -> dict:
    mismatched = [r for r in ok if r.usage_mismatch]
    return {
        "input": input_tokens,
        "output": output_tokens,
        "counted": sum(r.counted_tokens for r in ok),
        "usage_missing": sum(r.output_tokens is None for r in ok),
        "usage_mismatch_requests": len(mismatched),
        "usage_mismatch_tokens": sum(r.usage_mismatch for r in mismatched),
    }
