"""The queries of `phaselens report`: one row per request (the CDFs and the scatter), the steps."""

from __future__ import annotations

from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import from_requests, from_steps

REPORT_MAX_POINTS = 100_000
REPORT_MAX_STEPS = 200_000


def report_points(d: Dialect) -> str:
    """One row per selected request: the points of the report's CDFs and prompt-length scatter."""
    return (
        "SELECT trace_id, input_tokens, client_ttft_ms, server_ttft_ms, client_tpot_ms, server_tpot_ms,\n"
        f"    prefill_ms, ttft_ms, has_server\n{from_requests(d)}\nORDER BY start_time\n"
        f"LIMIT {d.limit(REPORT_MAX_POINTS)}"
    )


def report_steps(d: Dialect) -> str:
    """Every engine step in range (the report's batch-composition chart buckets them)."""
    return (
        "SELECT toUnixTimestamp64Nano(time) AS t_ns, prefill_tokens, decode_tokens\n"
        f"{from_steps(d)}\nORDER BY time\nLIMIT {d.limit(REPORT_MAX_STEPS)}"
    )
