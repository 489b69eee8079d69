"""The two renderings of one query template: ClickHouse bound parameters (CLI, Python API, report)
and Grafana macros/variables (dashboards).

A template is a function `template(d: Dialect) -> str` that asks its dialect `d` for every piece that is a
user value or a time range; it never formats a user value itself. `CliDialect` answers with
server-side parameters `{name:Type}` and records their values; `GrafanaDialect` with `$__timeFilter`,
`$__timeInterval`, `$__interval_s`, `$__conditionalAll` and `${var}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from phaselens.collectors.schema import ident

_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
# The user's filter values (database, service, since, limit, approx, SLOs, …) by name; None = not set.
# A dialect's bound parameters have the same shape.
Filters = dict[str, str | float | None]


class QueryError(ValueError):
    """A bad filter value or an unknown query; the message says which."""


def duration_ms(text: str | float) -> int:
    """`15m` → 900000; a bare number is seconds."""
    if isinstance(text, (int, float)):
        return int(text * 1000)
    m = _DURATION.match(text.strip())
    if not m:
        raise QueryError(f"a duration looks like 500ms, 30s, 15m, 2h or 7d, not {text!r}")
    return int(float(m["n"]) * _UNIT_MS[m["unit"]])


class Dialect(Protocol):
    """What a query template may ask for; `CliDialect` and `GrafanaDialect` answer it."""

    def table(self, name: str) -> str:
        """`name` qualified by the database being read."""

    def time_filter(self, column: str) -> str:
        """A condition keeping the rows of the time range (`1` when there is none)."""

    def bucket_filter(self, column: str) -> str:
        """A condition keeping the minute buckets (`column`: their starts) that overlap the time range."""

    def time_bucket(self, column: str) -> str:
        """`column` rounded down to the start of its time bucket."""

    def bucket_seconds(self) -> str:
        """The bucket length in seconds, as an SQL expression."""

    def match(self, var: str, column: str) -> str:
        """A condition `column` = the user's `var` filter (`1` when the user set none)."""

    def value(self, var: str, ch_type: str, default: str | float | None = None) -> str:
        """The user's value of `var`, of ClickHouse type `ch_type`."""

    def limit(self, default: int) -> str:
        """The row limit."""

    def approximate(self) -> bool:
        """True: t-digest percentiles instead of exact ones."""


def client_params(parameters: Filters) -> str:
    """`clickhouse-client` flags that bind `{name:Type}` server-side: `--param_<name>='<value>'`."""
    return " ".join(f"--param_{k}='{v}'" for k, v in parameters.items() if v is not None)


@dataclass(slots=True)
class CliDialect:
    """Bound parameters only. `filters` holds the user's values; `parameters` what the SQL binds."""

    filters: Filters
    database: str = "otel"
    parameters: Filters = field(default_factory=dict)

    def table(self, name: str) -> str:
        ident(self.database)  # validates; the name still travels as a bound Identifier
        self.parameters["database"] = self.database
        return f"{{database:Identifier}}.{name}"

    def time_filter(self, column: str) -> str:
        since = self.filters.get("since")
        if since is None:
            return "1"
        self.parameters["since_ms"] = duration_ms(since)
        return f"{column} >= now64(9) - toIntervalMillisecond({{since_ms:UInt64}})"

    def bucket_filter(self, column: str) -> str:
        since = self.filters.get("since")
        if since is None:
            return "1"
        self.parameters["since_ms"] = duration_ms(since)
        return f"{column} >= toStartOfMinute(now64(9) - toIntervalMillisecond({{since_ms:UInt64}}))"

    def time_bucket(self, column: str) -> str:
        return f"toStartOfInterval({column}, toIntervalSecond({self.bucket_seconds()}))"

    def bucket_seconds(self) -> str:
        self.parameters["bucket_s"] = max(1, int(self.filters.get("bucket_s") or 10))
        return "{bucket_s:UInt32}"

    def match(self, var: str, column: str) -> str:
        value = self.filters.get(var)
        if value is None:
            return "1"
        self.parameters[var] = str(value)
        return f"{column} = {{{var}:String}}"

    def value(self, var: str, ch_type: str, default: str | float | None = None) -> str:
        self.parameters[var] = self.filters.get(var, default)
        return f"{{{var}:{ch_type}}}"

    def limit(self, default: int) -> str:
        return self.value("limit", "UInt32", int(self.filters.get("limit") or default))

    def approximate(self) -> bool:
        """t-digest percentiles instead of exact ones (the `approx` filter)."""
        return bool(self.filters.get("approx"))


@dataclass(slots=True)
class GrafanaDialect:
    """Grafana's ClickHouse plugin macros and dashboard variables; no values of its own."""

    database: str = "otel"

    def table(self, name: str) -> str:
        return f"{ident(self.database)}.{name}"

    def time_filter(self, column: str) -> str:
        return f"$__timeFilter({column})"

    def bucket_filter(self, column: str) -> str:
        return f"{column} >= toStartOfMinute($__fromTime) AND {column} <= $__toTime"

    def time_bucket(self, column: str) -> str:
        return f"$__timeInterval({column})"

    def bucket_seconds(self) -> str:
        return "$__interval_s"

    def match(self, var: str, column: str) -> str:
        return f"$__conditionalAll({column} IN (${{{var}:singlequote}}), ${var})"

    def value(self, var: str, ch_type: str, default: str | float | None = None) -> str:
        return f"'${{{var}}}'" if ch_type == "String" else f"${{{var}}}"

    def limit(self, default: int) -> str:
        return str(default)

    def approximate(self) -> bool:
        return False
