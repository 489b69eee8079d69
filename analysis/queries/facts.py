"""The building blocks every query family shares: the budget's levels, components and
distributions (from the term declarations, analysis/terms.py), the FROM + WHERE of the per-request
facts and of the engine steps under the user's filters, the SLO test, the window and time series.

A term a request was not stamped with counts 0 in a budget; a term no request in the selection has
is shown as UNOBSERVED, never 0 (`OBSERVED_BY`, `STAMPED_BY`).
"""

from __future__ import annotations

from phaselens.analysis import terms
from phaselens.analysis import thresholds as th
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.schema.schema import (
    FACTS_VIEW,
    STEPS_VIEW,
)

LEVELS = (0.5, 0.9, 0.99)
LEVEL_LABELS = ("p50", "p90", "p99")
# Budget components: (name shown, value over the facts), in TTFT order (analysis/terms.py).
# `before_engine_ms` is set only for span models that cannot split ingress and first_token (vLLM's
# native span): server TTFT − queue − prefill (analysis/schema/schema.py).
COMPONENTS = tuple((t.name, t.sql) for t in terms.REGISTRY.components())
# Components that are estimates, not differences of stamps: labelled so wherever they are shown.
ESTIMATED = terms.REGISTRY.estimated()


def _parts_of(whole: str) -> tuple[tuple[str, str], ...]:
    return tuple((t.name, t.sql) for t in terms.REGISTRY.parts(whole))


# Where the inbound edge went (inbound = kernel_wait + dispatch): the bytes waiting in the kernel for
# a busy event loop, against HTTP parsing and the task start.
INBOUND_SPLIT = _parts_of("inbound_ms")
# The client's own time (client = send + read): a load generator short of CPU shows here.
CLIENT_SPLIT = _parts_of("client_ms")
# Where the server's first-chunk time went (first_chunk = loop_wait + encode): a late event loop
# (loop_wait) against SSE encoding and the framework (encode); write (send until it returned) beside it.
FIRST_CHUNK_SPLIT = _parts_of("first_chunk_ms")
# Every distribution the budget reports: (name, expression over the facts view).
DISTRIBUTIONS = (
    ("ttft_ms", "ttft_ms"),
    ("client_ttft_ms", "client_ttft_ms"),
    ("server_ttft_ms", "server_ttft_ms"),
    ("client_ttfo_ms", "client_ttfo_ms"),
    ("server_ttfc_ms", "server_ttfc_ms"),
    *COMPONENTS,
    *FIRST_CHUNK_SPLIT,
    *INBOUND_SPLIT,
    *CLIENT_SPLIT,
    *terms.REGISTRY.witnesses(),
    ("e2e_residual_ms", "e2e_residual_ms"),
    ("client_end_read_ms", "client_end_read_ms"),
    ("client_tpot_ms", "client_tpot_ms"),
    ("server_tpot_ms", "server_tpot_ms"),
    ("client_itl_p99_ms", "client_itl_p99_ms"),
    ("server_itl_p99_ms", "itl_p99_ms"),
    ("client_e2e_ms", "client_e2e_ms"),
    ("server_e2e_ms", "server_e2e_ms"),
    ("stall_ms", "stall_ms"),
    ("queue_all_waits_ms", "queue_ms"),
)
# A component counted 0 where not stamped, and the distribution whose mean is NULL when no request
# in the selection was stamped: the budget then shows the component as unobserved, not as 0 ms.
OBSERVED_BY = terms.REGISTRY.observed_by()
# ...and the facts column whose NULL says one request was not stamped with the component
UNOBSERVED = "unobserved"  # the word every surface shows for such a term (never 0)
STAMPED_BY = {name: dict(DISTRIBUTIONS)[witness] for name, witness in OBSERVED_BY.items()}


def unless_unstamped(name: str, aggregate: str, empty: str, where: str = "") -> str:
    """`aggregate` of component `name`, or `empty` (NULL, []) when no request (of those `where` keeps)
    was stamped with it: unobserved, never the 0 ms it counts as in each row."""
    stamp = STAMPED_BY.get(name)
    if stamp is None:
        return aggregate
    stamped = f"{where} AND {stamp} IS NOT NULL" if where else f"{stamp} IS NOT NULL"
    return f"if(countIf({stamped}) = 0, {empty}, {aggregate})"


ERROR = "status = 'error'"
# completed, seen by a client, and no content chunk reached it: no client TTFT, not an error
NO_OUTPUT = "status = 'ok' AND has_client AND client_ttft_ms IS NULL"


def quantiles(d: Dialect, expr: str) -> str:
    fn = "quantilesTDigest" if d.approximate() else "quantilesExactInclusive"
    return f"{fn}({', '.join(map(str, LEVELS))})({expr})"


def where(*conditions: str) -> str:
    """Conditions joined by AND; a filter the user did not set renders as `1` and is left out."""
    return "WHERE " + (" AND ".join(c for c in conditions if c != "1") or "1")


def from_requests(d: Dialect) -> str:
    """FROM + WHERE of the per-request facts under the time, service and model filters."""
    return f"FROM {d.table(FACTS_VIEW)}\n" + where(
        d.time_filter("start_time"), d.match("service", "service"), d.match("model", "model")
    )


def from_steps(d: Dialect) -> str:
    return f"FROM {d.table(STEPS_VIEW)}\n" + where(d.time_filter("time"), d.match("service", "service"))


def slo_value(d: Dialect, key: str, default: float) -> str:
    return d.value(f"{key}_slo_ms", "Float64", default)


def meets_slo(d: Dialect) -> str:
    """Completed OK within both SLOs (defaults: common.slo.DEFAULT_SLO); a one-token request has no TPOT."""
    ttft, tpot = slo_value(d, "ttft", th.DEFAULT_TTFT_SLO_MS), slo_value(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
    return f"status = 'ok' AND ttft_ms <= {ttft} AND (tpot_ms IS NULL OR tpot_ms <= {tpot})"


def window_s(start: str = "min(server_start_time)", end: str = "max(server_end_time)") -> str:
    """Seconds from the first request received to the last response closed, on the server clock."""
    return f"greatest((toUnixTimestamp64Nano({end}) - toUnixTimestamp64Nano({start})) / 1e9, 1e-9)"


def series(d: Dialect, time_col: str, source: str, selects: list[str]) -> str:
    """One row per time bucket of `time_col` (Grafana time-series format: `time` first)."""
    body = ",\n    ".join(selects)
    return (
        f"SELECT {d.time_bucket('bucket_start')} AS time,\n    {body}\n"
        f"FROM (SELECT *, {time_col} AS bucket_start {source})\nGROUP BY time\nORDER BY time"
    )
