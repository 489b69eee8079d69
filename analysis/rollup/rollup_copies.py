"""Every node of a cluster keeps a complete copy of the rollups (analysis/rollup/rollup.py,
analysis/rollup/step_rollup.py): each row is written through a Distributed table sharded by `copy_to`,
once per shard, so a read is one node's local tables, never a Distributed read. The copy on the
writing node is inserted at once; the others go through ClickHouse's queue of asynchronous
Distributed inserts (a shard that is down gets them when it is back).
"""

from __future__ import annotations

from typing import Any

from phaselens.collectors.schema import ident


def cluster_of(client: Any, database: str, table: str) -> str | None:
    """The cluster of `database`.`table`, a Distributed table; None where there is no such table."""
    rows = client.query(
        "SELECT extract(engine_full, '^Distributed[(]\\'([^\\']+)\\'') FROM system.tables "
        "WHERE database = {db:String} AND name = {t:String}",
        parameters={"db": database, "t": table},
    ).result_rows
    return (rows[0][0] or None) if rows else None


def _slots(cluster: str) -> str:
    """Each shard of `cluster` with the first value of its weight's slot (`start`) and whether it
    is this node's: a Distributed table sharded by `copy_to` (value % Σ weights) sends a row whose
    `copy_to` is a shard's start to that shard."""
    ident(cluster)
    return (
        "SELECT shard_num, toUInt16(sum(w) OVER (ORDER BY shard_num) - w) AS start, local FROM "
        "(SELECT shard_num, any(shard_weight) AS w, max(is_local) AS local FROM system.clusters "
        f"WHERE cluster = '{cluster}' AND shard_weight > 0 GROUP BY shard_num)"
    )


def copy_starts(cluster: str) -> str:
    """The `copy_to` of every shard of `cluster` (an array expression)."""
    return f"(SELECT groupArray(start) FROM ({_slots(cluster)}))"


def own_start(client: Any, cluster: str) -> int:
    """The `copy_to` that reaches the shard of the node `client` talks to."""
    return int(client.query(f"SELECT start FROM ({_slots(cluster)}) WHERE local").result_rows[0][0])


def copies_select(select: str, cluster: str | None) -> str:
    """`select`'s rows once for each shard of `cluster` (`copy_to`); as they are without one."""
    if not cluster:
        return select
    return f"SELECT *, copy_to FROM ({select})\nARRAY JOIN {copy_starts(cluster)} AS copy_to"


def copies_ddl(copies: str, table: str, columns: str, on: str, cluster: str, database: str) -> str:
    """The Distributed table `copies` (with `columns`, copy_to among them) over `table` of every
    node, sharded by `copy_to`."""
    for name in (cluster, database, table):
        ident(name)
    return (
        f"CREATE TABLE IF NOT EXISTS {copies}{on} (\n    {columns}\n)\n"
        f"ENGINE = Distributed('{cluster}', '{database}', '{table}', copy_to)"
    )
