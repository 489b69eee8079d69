"""Every analysis query, by name (`QUERIES`), rendered for the CLI with bound parameters
(`render_cli`) or for Grafana with macros (`render_grafana`); each family of templates in its own
module over the shared building blocks of `facts`. Also the rollups' columns and quantile sketch
(`sketch`) and ids as bound parameters (`slices`)."""

from phaselens.analysis.queries import sketch
from phaselens.analysis.queries.catalog import FILTERS, PANEL_COLUMNS, QUERIES, Query, render_cli, render_grafana
from phaselens.analysis.queries.dialect import (
    CliDialect,
    Dialect,
    Filters,
    GrafanaDialect,
    QueryError,
    client_params,
    duration_ms,
)
from phaselens.analysis.queries.facts import (
    CLIENT_SPLIT,
    COMPONENTS,
    DISTRIBUTIONS,
    ESTIMATED,
    FIRST_CHUNK_SPLIT,
    INBOUND_SPLIT,
    LEVELS,
    OBSERVED_BY,
    UNOBSERVED,
)
from phaselens.analysis.queries.id_batches import slices
from phaselens.analysis.queries.pd_queries import ADDED_BY_DISAGG, SIDE, TTFT_TERMS, pd_summary
from phaselens.analysis.queries.rollups import ROLLUP_POSITIONS, ROLLUP_TERMS, SLOWEST_KEPT, rollup_columns, rollup_key
from phaselens.analysis.queries.steps import step_rollup_columns

__all__ = [
    "ADDED_BY_DISAGG",
    "CLIENT_SPLIT",
    "COMPONENTS",
    "DISTRIBUTIONS",
    "ESTIMATED",
    "FILTERS",
    "FIRST_CHUNK_SPLIT",
    "INBOUND_SPLIT",
    "LEVELS",
    "OBSERVED_BY",
    "PANEL_COLUMNS",
    "QUERIES",
    "ROLLUP_POSITIONS",
    "ROLLUP_TERMS",
    "SIDE",
    "SLOWEST_KEPT",
    "TTFT_TERMS",
    "UNOBSERVED",
    "CliDialect",
    "Dialect",
    "Filters",
    "GrafanaDialect",
    "Query",
    "QueryError",
    "client_params",
    "duration_ms",
    "pd_summary",
    "render_cli",
    "render_grafana",
    "rollup_columns",
    "rollup_key",
    "sketch",
    "slices",
    "step_rollup_columns",
]
