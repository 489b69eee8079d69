"""The SQL cookbook (docs/sql-cookbook.md), rendered from the named queries (never written out by hand).

    python -m phaselens.analysis.sql.cookbook > cookbook.md

Each entry: the question, the SQL with its bound parameters, and the `clickhouse-client` line that
runs it (`--param_<name>=<value>` binds `{name:Type}` server-side).
"""

from __future__ import annotations

from phaselens.analysis import queries as q
from phaselens.analysis.queries.dialect import Filters, client_params

ENTRIES = (
    (
        "slowest_requests",
        "Which requests were slowest to the first token, and which phase made them slow?",
        {"since": "1h", "limit": 20},
    ),
    ("budget_by_model", "What is the TTFT budget of each model?", {"since": "1h"}),
    (
        "ttft_vs_prompt_length",
        "How do TTFT and prefill grow with the prompt length?",
        {"since": "1h", "bucket_tokens": 256},
    ),
    ("queueing_vs_load", "Does queueing grow with the arrival rate?", {"since": "1h", "bucket_s": 60}),
    (
        "goodput_per_minute",
        "Goodput and SLO attainment per minute (TTFT ≤ 200 ms, TPOT ≤ 50 ms).",
        {"since": "1h", "ttft_slo_ms": 200, "tpot_slo_ms": 50},
    ),
    (
        "request_spans",
        "Every span of one request, placed on its own service's clock.",
        {"trace_id": "<32-hex trace id>"},
    ),
)


def _client_line(parameters: Filters) -> str:
    return f"clickhouse-client {client_params(parameters)} --queries-file query.sql"


def markdown(database: str = "otel") -> str:
    parts = []
    for name, question, example in ENTRIES:
        sql, parameters = q.render_cli(name, database=database, **example)
        parts.append(
            f"### {question}\n\n`phaselens.analysis.queries` name: `{name}`\n\n```sql\n{sql}\n```\n\n"
            f"```sh\n{_client_line(parameters)}\n```\n"
        )
    return "\n".join(parts)


if __name__ == "__main__":
    print(markdown())
