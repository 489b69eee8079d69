"""The one-time push of a cluster's rollups built before every node kept a complete copy
(`analysis/rollup/rollup_copies.py`): each node's own rows copied to every other node. Idempotent: a
second run copies nothing.

- Request rollup: a node's sealed rows reach another node in order of `sealed_to` from the upgrade
  on (each pass's copies), so the rows missing there are exactly those sealed before the sealer's
  earliest row there (all of them when it has none):

      copied to node Y = this node's rows with sealed_to < min(sealed_to of this node's rows on Y)

- Engine-step rollup: the rows from before `origin` existed have it '' and are this node's own;
  they are copied, named, to every node (this one too) and the unnamed ones deleted here. On one
  node that names them.

Run by `phaselens rollup backfill` before it recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.rollup import rollup, step_rollup
from phaselens.analysis.rollup.rollup_copies import cluster_of, copies_select, own_start
from phaselens.collectors.schema import ident


def push_requests(client: Any, database: str, nodes: Sequence[Any]) -> int:
    """Copy this node's sealed request-rollup rows that each other node of `nodes` misses; returns
    how many rows were sent."""
    cluster = rollup.copy_cluster(client, database)
    if not cluster:
        return 0
    table = f"{ident(database)}.{ident(sk.ROLLUP_TABLE)}"
    sealer = client.query(f"SELECT {rollup.SEALER}").result_rows[0][0]
    first_there = (
        f"SELECT toUnixTimestamp64Milli(min(sealed_to)), count() FROM {table} WHERE sealer = {{sealer:String}}"
    )
    columns = ", ".join(rollup.column_names())
    sent = 0
    for node in nodes:
        if node is client:
            continue
        first_ms, rows = node.query(first_there, parameters={"sealer": sealer}).result_rows[0]
        missing = (
            f"sealer = {{sealer:String}}{' AND toUnixTimestamp64Milli(sealed_to) < {first:Int64}' if rows else ''}"
        )
        params = {"sealer": sealer, "first": first_ms, "to": own_start(node, cluster)}
        sent += int(client.query(f"SELECT count() FROM {table} WHERE {missing}", parameters=params).result_rows[0][0])
        rollup.insert_rows(
            client,
            database,
            sk.ROLLUP_TABLE,
            f"SELECT {columns}, {{to:UInt16}} FROM {table} WHERE {missing}",
            cluster,
            params,
        )
    rollup.flush_copies(client, database)
    return sent


def push_steps(client: Any, database: str) -> int:
    """Name this node's engine-step rows from before `origin` existed, copied to every node (this
    one too, on one node only this one); returns how many rows there were."""
    table = f"{ident(database)}.{ident(sk.STEPS_ROLLUP_TABLE)}"
    unnamed = int(client.query(f"SELECT count() FROM {table} WHERE origin = ''").result_rows[0][0])
    if not unnamed:
        return 0
    cluster = cluster_of(client, database, step_rollup.COPIES)
    kept = ", ".join(f"{step_rollup.ORIGIN} AS origin" if c == "origin" else c for c in step_rollup.column_names())
    # filtered inside: in ClickHouse an alias (origin, named) shadows the column in the WHERE
    named = f"SELECT {kept} FROM (SELECT * FROM {table} WHERE origin = '')"
    into = f"{ident(database)}.{ident(step_rollup.COPIES)}" if cluster else table
    columns = [*step_rollup.column_names(), *(["copy_to"] if cluster else [])]
    client.command(f"INSERT INTO {into} ({', '.join(columns)})\n{copies_select(named, cluster)}")
    client.command(f"DELETE FROM {table} WHERE origin = ''")
    if cluster:
        client.command(f"SYSTEM FLUSH DISTRIBUTED {into}")
    return unnamed


def push(client: Any, database: str, nodes: Sequence[Any]) -> tuple[int, int]:
    """Both pushes from this node: (request rows sent, engine-step rows named)."""
    return push_requests(client, database, nodes), push_steps(client, database)
