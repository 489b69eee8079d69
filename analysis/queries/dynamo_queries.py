"""The query of the Dynamo budget (analysis.budget.dynamo_budget; docs/disaggregation.md#dynamo): the
rows of `phaselens_requests` built from Dynamo's own spans (`span_model` dynamo-native), the time
range on the frontend's `http-request` start (`server_start_time`).

    client TTFT     = client_ms + client_late_est_ms + residual_ms + server_ttft_ms
                      (client clock; an edge counts 0 in a request that lacks it, and is NULL —
                      unobserved — when no request of the selection was stamped with it)
    server_ttft_ms  = Dynamo's frontend TTFT
                    = frontend_dispatch_ms + prefill_call_ms + kv_transfer_est_ms   (frontend clock, P/D)
"""

from __future__ import annotations

from phaselens.analysis import terms
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import unless_unstamped
from phaselens.analysis.schema.schema import REQUESTS_VIEW
from phaselens.instrumentation import names as n


def _declared(name: str) -> tuple[str, str, bool]:
    term = terms.REGISTRY.term(name)
    return name, term.sql, term.estimate


# (row, SQL over phaselens_requests, estimate?), in TTFT order: the first four add up to client
# TTFT, the last three to the frontend's TTFT (server_ttft_ms)
TERMS: tuple[tuple[str, str, bool], ...] = (
    *(_declared(name) for name in ("client_ms", "client_late_est_ms", "residual_ms")),
    ("server_ttft_ms", "server_ttft_ms", False),
    ("frontend_dispatch_ms", "frontend_dispatch_ms", False),
    ("prefill_call_ms", "prefill_call_ms", False),
    ("kv_transfer_est_ms", "kv_transfer_est_ms", True),
)
SIDE = ("client_ttft_ms", "prefill_worker_ms", "prefill_busy_ms", "prefill_idle_ms", "decode_busy_ms", "decode_idle_ms")


def dynamo_summary(d: Dialect) -> str:
    """One row: counts, then p50/p90/p99 and mean of each term and figure over the successful requests."""
    ok = "status = 'ok'"
    exprs = [(name, sql) for name, sql, _ in TERMS] + [(name, name) for name in SIDE]
    stats = ",\n    ".join(_stat(name, sql, ok) for name, sql in exprs)
    where = (
        f"span_model = '{n.SPAN_MODEL_DYNAMO}' AND {d.time_filter('server_start_time')} AND {d.match('model', 'model')}"
    )
    return (
        "SELECT count() AS requests, countIf(status = 'error') AS errors,\n"
        "    countIf(prefill_instance IS NOT NULL) AS disaggregated,\n"
        f"    {stats}\nFROM {d.table(REQUESTS_VIEW)}\nWHERE {where}"
    )


def _stat(name: str, sql: str, ok: str) -> str:
    """p50/p90/p99 and mean of one term over the successful requests; NULL at each when no such
    request was stamped with it (STAMPED_BY): unobserved, never 0."""
    quantiles = unless_unstamped(name, f"quantilesExactInclusiveIf(0.5, 0.9, 0.99)({sql}, {ok})", "[]", ok)
    return f"{quantiles} AS {name}_q, {unless_unstamped(name, f'avgIf({sql}, {ok})', 'NULL', ok)} AS {name}_mean"
