"""Recompute the engine-step rollup (`analysis/rollup/step_rollup.py`) of a window from the stored steps:
what puts the steps inserted before the rollup's view existed into it.

A step is one span and the view counts it once, at its insert, so a minute × service of the rollup
is complete exactly when

    Σ steps of its rollup rows = count of its step spans stored

A recompute takes the minutes of the window where that does not hold (steps missing, or more
counted than stored), deletes their rollup rows and inserts the states of every stored step of
theirs. A minute that holds is left alone, so a second run over the same window recomputes nothing.
A step inserted into a minute while it is recomputed may be counted twice or not at all; its
minute's counts then differ, and the next run repairs it. On a cluster each node recomputes its own
shard's steps (each node's view rolls up its shard's, `origin`): the minutes' rows of that origin
are deleted on every node (each keeps a copy) and the new ones copied to every node. A node's rows
from before `origin` existed have it '' (only there): they count as its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.rollup import step_rollup
from phaselens.analysis.rollup.rollup_copies import cluster_of, copies_select
from phaselens.collectors.schema import TRACES_TABLE, ident
from phaselens.instrumentation import names as n

MINUTES_PER_STATEMENT = 1000  # a 7-day window is 10,080 minutes: under ClickHouse's parameter size in runs
# whole minutes: a minute the window cuts is compared, and recomputed, whole
_WINDOW = (
    "Timestamp >= toStartOfMinute(now64(3) - toIntervalMillisecond({since:Int64})) "
    "AND Timestamp < toStartOfMinute(now64(3) - toIntervalMillisecond({until:Int64})) + toIntervalMinute(1)"
)
_IN_MINUTES = "toUInt32(toStartOfMinute(Timestamp)) IN {minutes:Array(UInt32)}"
_OWN = f"origin IN ('', {step_rollup.ORIGIN})"  # this node's rows, here


def _tables(database: str) -> tuple[str, str]:
    db = ident(database)
    return f"{db}.{ident(TRACES_TABLE)}", f"{db}.{ident(sk.STEPS_ROLLUP_TABLE)}"


def stale_minutes(client: Any, database: str, since_ms: int, until_ms: int) -> list[int]:
    """The minutes (epoch seconds) with steps in [now − since, now − until), widened to whole
    minutes, whose rollup rows do not count exactly the step spans stored for them, per service."""
    traces, rollup = _tables(database)
    stored = (
        f"SELECT toUInt32(toStartOfMinute(Timestamp)) AS minute, ServiceName AS service, count() AS steps "
        f"FROM {traces} WHERE SpanName = '{n.SPAN_ENGINE_STEP}' AND {_WINDOW} GROUP BY minute, service"
    )
    counted = (
        f"SELECT toUInt32(bucket) AS minute, service, sum(steps) AS steps FROM {rollup} "
        f"WHERE {_OWN} AND toUInt32(bucket) IN (SELECT minute FROM ({stored})) GROUP BY minute, service"
    )
    sql = (
        f"SELECT DISTINCT minute FROM (SELECT if(s.minute = 0, c.minute, s.minute) AS minute, "
        f"s.steps != c.steps AS differs FROM ({stored}) AS s FULL OUTER JOIN ({counted}) AS c "
        "ON s.minute = c.minute AND s.service = c.service) WHERE differs ORDER BY minute"
    )
    return [row[0] for row in client.query(sql, parameters={"since": since_ms, "until": until_ms}).result_rows]


def recompute(client: Any, database: str, minutes: list[int], nodes: Sequence[Any] = ()) -> None:
    """Replace this node's rollup rows of `minutes` (epoch seconds), on every node of `nodes` (a
    cluster's, this one among them; default: this one), by the states of every stored step of theirs."""
    traces, rollup = _tables(database)
    cluster = cluster_of(client, database, step_rollup.COPIES)
    columns = ", ".join([*step_rollup.column_names(), *(["copy_to"] if cluster else [])])
    into = f"{ident(database)}.{ident(step_rollup.COPIES)}" if cluster else rollup
    if cluster:  # the view's queued copies arrive before the deletes, not after
        client.command(f"SYSTEM FLUSH DISTRIBUTED {into}")
    origin = client.query(f"SELECT {step_rollup.ORIGIN}").result_rows[0][0]
    for start in range(0, len(minutes), MINUTES_PER_STATEMENT):
        params = {"minutes": minutes[start : start + MINUTES_PER_STATEMENT], "origin": origin}
        for node in nodes or [client]:
            own = _OWN if node is client else "origin = {origin:String}"
            node.command(
                f"DELETE FROM {rollup} WHERE {own} AND toUInt32(bucket) IN {{minutes:Array(UInt32)}}", parameters=params
            )
        steps = copies_select(step_rollup.rollup_select(f"(SELECT * FROM {traces} WHERE {_IN_MINUTES})"), cluster)
        client.command(f"INSERT INTO {into} ({columns})\n{steps}", parameters=params)


def backfill_steps(client: Any, database: str, since_ms: int, until_ms: int, nodes: Sequence[Any] = ()) -> int:
    """Recompute this node's step minutes in [now − since, now − until) that are not complete (on
    every node of `nodes`: `recompute`); returns how many."""
    minutes = stale_minutes(client, database, since_ms, until_ms)
    recompute(client, database, minutes, nodes)
    return len(minutes)
