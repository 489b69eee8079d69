"""Budget rollups: per minute × service × model × span model, -State aggregates of every budget term
(`queries.ROLLUP_TERMS`), so a budget or a dashboard panel merges one row per minute instead of
reading every request.

When a request counts. Its spans arrive in several inserts (client, server), so a rollup fed per
insert would count a request once per insert, each time with a part of its row. Instead the
per-request parts the view already builds are copied, stamped with their insert time (server
clock), into a small pending table, and a refreshable materialized view seals them:

    a request is sealed by the first pass at which its FIRST part is older than `wait_s`; the
    pass puts its row, merged from every part that has arrived by then, exactly as the
    per-request view merges it, into the minute of its start_time; a disaggregated request's
    P/D columns are joined from this node's P/D parts as `phaselens_requests` joins them (with_pd).

Each pass seals the requests whose first part was inserted in (sealed_to of the previous pass,
now − wait_s]: every request once. A part that arrives after its request was sealed is left out of
the rollup (the exact path still merges it), unless the request's earlier parts have already left
the pending table (`PENDING_RETENTION_S`): then it counts as a request of its own. An imported
harness's client view (`phaselens import`) is never a request of its own (`harness_only`): it is
sealed with its request when it arrives first, else `rollup_backfill` recomputes its minute.

Reads see the sealed minutes plus the requests not sealed yet (`phaselens_budget_states`): those
are aggregated from the pending table with the same -State functions every LIVE_EVERY_S by a second
refreshable view (no FINAL; its cost follows the traffic of the last `wait_s`, not the time range)
into a small table that each refresh replaces. Reads take a node's live rows only while they were
computed against that node's current end of the rollup (`sealed_to`; current_select, a view on each node), so a
request is never read twice; right after a sealing pass, until the next refresh, the requests not
sealed yet are missing for a few seconds. (Computing them at read time instead cost ~0.2 s of query analysis per read,
measured: the per-request expressions are large.) On a cluster every node seals its own pending
table (the spans of a request meet on one shard), and every node keeps a complete copy of every
node's rollup and live rows: each pass and each live refresh writes through a Distributed table
sharded by `copy_to`, one row per shard (`copies_select`), so a read is one node's local tables,
never a Distributed read (which cost the node asked ~25 % more server CPU than one node: it plans
the outer query and its own shard's part). The copy on the sealing node is synchronous (its
watermark is read there); the others are sent by ClickHouse's queue (a shard that is down gets
them when it is back). Live rows are appended, stamped `refreshed`; a read takes each sealer's
newest ones.
"""

from __future__ import annotations

from typing import Any

from phaselens.analysis import queries as q
from phaselens.analysis.queries import pd_queries
from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.rollup import step_rollup
from phaselens.analysis.rollup.rollup_copies import cluster_of, copies_ddl, copies_select
from phaselens.analysis.schema import pd_schema
from phaselens.analysis.schema import schema as s
from phaselens.collectors.schema import DEDUP_WINDOW_BLOCKS, ident, ttl_interval

PENDING_MV = f"{sk.PENDING_TABLE}_mv"
SEAL_VIEW = "phaselens_budget_seal"
LIVE_VIEW = "phaselens_budget_live_refresh"
STATES_DISTRIBUTED = "phaselens_budget_states_distributed"  # dropped: reads are local (upgrade)
COPIES = f"{sk.ROLLUP_TABLE}_copies"  # Distributed, sharded by copy_to: a row per shard
LIVE_COPIES = f"{sk.LIVE_TABLE}_copies"
DEFAULT_WAIT_S = 60  # a request's spans come from 2 processes within seconds of each other
# Each pass costs ~0.17 s of server CPU, mostly ClickHouse's analysis of the per-request expressions
# (measured: five idle databases with passes every 15 s and refreshes every 5 s kept 0.29 of a core busy)
DEFAULT_EVERY_S = 30
LIVE_EVERY_S = 10
PENDING_RETENTION_S = 900  # a part later than this after its request's first part counts on its own
# 1 for a pending row of an imported client view alone (min: 0 once merged with its request's own parts)
HARNESS_ONLY_DDL = "harness_only SimpleAggregateFunction(min, UInt8) DEFAULT 0"
# which node sealed a row: the watermark is per node, on that node's clock
SEALER = "concat(hostName(), ':', toString(getServerPort('tcp_port')))"


def _watermark(rollup: str) -> str:
    """The end of the insert times this node has sealed (1970 before its first pass)."""
    return f"(SELECT max(sealed_to) FROM {rollup} WHERE sealer = {SEALER})"


def column_names() -> list[str]:
    """The rollup's columns, in the order states_select gives them."""
    return [*(name for name, _ in q.rollup_key()), "sealer", "sealed_to", "is_live", "refreshed"] + [
        name for name, _, _ in q.rollup_columns()
    ]


def requests_between(pending: str, after: str, upto: str | None) -> str:
    """One merged row per request whose first part was inserted in (`after`, `upto`] (no upper
    bound: `upto` None), from every part of it in the pending table. A request with a part at or
    before `after` was sealed already: its later parts are left out, not counted again. Parts that
    are all an imported client view's (`harness_only`) are no request of their own."""
    merged = ",\n        ".join(f"{p.merge}({p.column}) AS {p.column}" for p in s.PARTS)
    having = "\n    HAVING min(harness_only) = 0" + (f" AND min(inserted) <= {upto}" if upto else "")
    return (
        f"(SELECT TraceId,\n        {merged}\n    FROM {pending}\n    WHERE inserted > {after}\n"
        f"        AND TraceId NOT IN (SELECT TraceId FROM {pending} WHERE inserted <= {after}\n"
        f"            AND TraceId IN (SELECT TraceId FROM {pending} WHERE inserted > {after}))\n"
        f"    GROUP BY TraceId{having})"
    )


def with_pd(facts: str, database: str, traces: str) -> str:
    """The per-request `facts` (a SELECT) with the P/D columns of their traces, NULL for a colocated
    request, as `phaselens_requests` joins them: from this node's P/D parts of the traces matching
    `traces` (a condition on TraceId; a request's spans meet on one shard). P/D parts that arrive
    after their request was sealed are left out of the rollup, as the request's own late parts are."""
    parts = f"{ident(database)}.{ident(pd_schema.PD_PARTS_TABLE)}"
    pd = pd_schema.pd_requests_select(parts, traces, ("prefill_instance", *pd_schema.PD_TERMS))
    return (
        f"SELECT *, {pd_queries.PD_COMPLETE} AS pd_complete\n"
        f"FROM ({facts}) AS facts\nLEFT ANY JOIN ({pd}) AS pd USING (trace_id)"
    )


def states_select(facts: str, sealed_to: str, live: int = 0) -> str:
    """The rollup row of each minute × group of the per-request `facts` (a SELECT); `live` 1 for
    the states of requests not sealed yet, stamped `refreshed` now (a sealed row: the epoch)."""
    key = ", ".join(f"{expr} AS {name}" for name, expr in q.rollup_key())
    cols = ",\n    ".join(f"{expr} AS {name}" for name, _, expr in q.rollup_columns())
    group = ", ".join(name for name, _ in q.rollup_key())
    return (
        f"SELECT {key}, {SEALER} AS sealer, {sealed_to} AS sealed_to, toUInt8({live}) AS is_live,\n"
        f"    {'now64(3)' if live else 'toDateTime64(0, 3)'} AS refreshed,\n    {cols}\n"
        f"FROM ({facts})\nGROUP BY {group}"
    )


def copy_cluster(client: Any, database: str) -> str | None:
    """The cluster that every rollup row of `database` is copied to (None on one node)."""
    return cluster_of(client, database, COPIES)


def insert_target(database: str, table: str, cluster: str | None) -> str:
    """Where new rows of `table` (the rollup or the live table) go: its copies table on a cluster."""
    name = {sk.ROLLUP_TABLE: COPIES, sk.LIVE_TABLE: LIVE_COPIES}[table] if cluster else table
    return f"{ident(database)}.{ident(name)}"


def _key_order() -> str:
    return ", ".join([*(name for name, _ in q.rollup_key()), "sealer", "is_live", "refreshed"])


def _columns(copy_to: str) -> str:
    return ",\n    ".join(
        [
            "bucket DateTime CODEC(Delta, ZSTD(1))",
            *(f"{name} LowCardinality(String)" for name, _ in q.rollup_key()[1:]),
            "sealer LowCardinality(String)",
            "sealed_to SimpleAggregateFunction(max, DateTime64(3))",
            "is_live UInt8 DEFAULT 0",
            "refreshed DateTime64(3)",
            *(f"{name} {ch_type}" for name, ch_type, _ in q.rollup_columns()),
            f"copy_to UInt16 {copy_to}",
        ]
    )


def _new_columns() -> str:
    return ",\n    ".join(f"ADD COLUMN IF NOT EXISTS {name} {t}" for name, t, _ in q.rollup_columns())


def _rollup_ddl(rollup: str, on: str, engine: str, ttl: str | None) -> list[str]:
    """The table, and the upgrade of one made before: new columns (`refreshed` joins the key)."""
    return [
        f"CREATE TABLE IF NOT EXISTS {rollup}{on} (\n    {_columns('EPHEMERAL')}\n) ENGINE = {engine}\n"
        f"PARTITION BY toYYYYMM(bucket)\nORDER BY ({_key_order()})" + (f"\nTTL {ttl}" if ttl else ""),
        (
            f"ALTER TABLE {rollup}{on}\n    ADD COLUMN IF NOT EXISTS refreshed DateTime64(3),\n"
            f"    MODIFY ORDER BY ({_key_order()}),\n    ADD COLUMN IF NOT EXISTS copy_to UInt16 EPHEMERAL,\n"
            f"    {_new_columns()}"
        ),
    ]


def _pending_ddl(pending: str, on: str) -> str:
    cols = ",\n    ".join(p.ddl() for p in s.PARTS)
    return (
        f"CREATE TABLE IF NOT EXISTS {pending}{on} (\n    TraceId String CODEC(ZSTD(1)),\n"
        f"    inserted SimpleAggregateFunction(min, DateTime64(3)),\n    {HARNESS_ONLY_DDL},\n    {cols}\n"
        ") ENGINE = AggregatingMergeTree()\nPARTITION BY toStartOfFiveMinutes(inserted)\nORDER BY TraceId\n"
        f"TTL toDateTime(inserted) + toIntervalSecond({PENDING_RETENTION_S})\n"
        "SETTINGS ttl_only_drop_parts = 1, merge_with_ttl_timeout = 60, "
        f"non_replicated_deduplication_window = {DEDUP_WINDOW_BLOCKS}"
    )


def statements(
    database: str = "otel",
    cluster: str | None = None,
    ttl: str | None = None,
    on_cluster: bool = True,
    wait_s: int = DEFAULT_WAIT_S,
    every_s: int = DEFAULT_EVERY_S,
) -> list[str]:
    """CREATE statements (idempotent; an upgrade adds new columns and rewrites the queries), to run
    after `schema.statements`. The pending table is per node even with replicas (each replica
    seals what was inserted on it); the rollup and live tables are replicated with ON CLUSTER DDL.
    On a cluster both views write through the copies tables (every node gets every row)."""
    db = ident(database)
    replicated = bool(cluster) and on_cluster
    on = f" ON CLUSTER {ident(cluster)}" if cluster and on_cluster else ""
    engine = "ReplicatedAggregatingMergeTree()" if replicated else "AggregatingMergeTree()"
    rollup, pending = f"{db}.{ident(sk.ROLLUP_TABLE)}", f"{db}.{ident(sk.PENDING_TABLE)}"
    parts = f"{db}.{ident(s.PARTS_TABLE)}"
    local = f"{db}.{ident(sk.STATES_LOCAL)}"
    # an imported harness's client view (`phaselens import`, docs/harness-import.md) is marked, so
    # that it is sealed with its request but never counted as a request of its own
    copy = f"SELECT *, now64(3) AS inserted, toUInt8(t_client_harness IS NOT NULL) AS harness_only FROM {parts}"
    live_table = f"{db}.{ident(sk.LIVE_TABLE)}"
    # a cluster's live rows are appended, a refresh at a time: the newest per sealer is read
    live_ttl = f"toDateTime(refreshed) + toIntervalSecond({PENDING_RETENTION_S})"
    out = [
        *_rollup_ddl(rollup, on, engine, f"bucket + {ttl_interval(ttl)}" if ttl else None),
        *_rollup_ddl(live_table, on, engine, live_ttl),
        f"ALTER TABLE {live_table}{on} MODIFY TTL {live_ttl}",
        # expired refreshes dropped within a minute, not at ClickHouse's default of 4 hours
        f"ALTER TABLE {live_table}{on} MODIFY SETTING merge_with_ttl_timeout = 60",
        _pending_ddl(pending, on),
        f"ALTER TABLE {pending}{on}\n    "
        + ",\n    ".join(f"ADD COLUMN IF NOT EXISTS {d}" for d in (HARNESS_ONLY_DDL, *(p.ddl() for p in s.PARTS))),
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{ident(PENDING_MV)}{on} TO {pending}\nAS {copy}",
        f"ALTER TABLE {db}.{ident(PENDING_MV)}{on} MODIFY QUERY {copy}",
        f"DROP VIEW IF EXISTS {db}.{ident(SEAL_VIEW)}{on}",
        f"DROP VIEW IF EXISTS {db}.{ident(LIVE_VIEW)}{on}",
    ]
    if cluster:
        for table in (sk.ROLLUP_TABLE, sk.LIVE_TABLE):
            copies = insert_target(database, table, cluster)
            out += [
                copies_ddl(copies, table, _columns("DEFAULT 0"), on, cluster, database),
                f"ALTER TABLE {copies}{on}\n    {_new_columns()}",
            ]
    live_into = f"APPEND TO {insert_target(database, sk.LIVE_TABLE, cluster)}" if cluster else f"TO {live_table}"
    out += [
        (
            f"CREATE MATERIALIZED VIEW {db}.{ident(SEAL_VIEW)}{on}\nREFRESH EVERY {int(every_s)} SECOND "
            f"APPEND TO {insert_target(database, sk.ROLLUP_TABLE, cluster)}\nAS {seal_select(database, wait_s, cluster)}"
        ),
        (
            f"CREATE MATERIALIZED VIEW {db}.{ident(LIVE_VIEW)}{on}\nREFRESH EVERY {LIVE_EVERY_S} SECOND {live_into}\n"
            f"AS {live_select(database, cluster)}"
        ),
        f"DROP TABLE IF EXISTS {local}{on}",  # a Merge table: a new column reaches the reads
        (
            f"CREATE TABLE {local}{on} AS {rollup}\n"
            f"ENGINE = Merge('{database}', '^({sk.ROLLUP_TABLE}|{sk.LIVE_TABLE})$')"
        ),
        f"CREATE OR REPLACE VIEW {db}.{ident(sk.STATES_CURRENT)}{on} AS\n{current_select(local)}",
        f"DROP TABLE IF EXISTS {db}.{ident(STATES_DISTRIBUTED)}{on}",
        f"CREATE OR REPLACE VIEW {db}.{ident(sk.STATES_VIEW)}{on} AS\nSELECT * FROM {db}.{ident(sk.STATES_CURRENT)}",
    ]
    return out


def current_select(local: str) -> str:
    """The rows a read may merge: every sealed row, and of each sealer's live rows those of its
    newest refresh computed against its current end of the rollup (its latest `sealed_to` here;
    the epoch before its first pass), so a request just sealed is never read twice. On a cluster
    the copies of one sealer's pass and refresh may arrive in either order: a refresh computed
    against a pass not here yet waits for it, an older one is read meanwhile."""
    ends = f"SELECT sealer, max(if(is_live = 1, toDateTime64(0, 3), sealed_to)) FROM {local} GROUP BY sealer"
    newest = (
        f"SELECT sealer, sealed_to, max(refreshed) FROM {local}\n"
        f"    WHERE is_live = 1 AND (sealer, sealed_to) IN ({ends}) GROUP BY sealer, sealed_to"
    )
    return f"SELECT * FROM {local}\nWHERE is_live = 0 OR (sealer, sealed_to, refreshed) IN ({newest})"


def _unsealed_facts(database: str, upto: str | None) -> str:
    """The facts, P/D columns joined, of the requests requests_between gives after the watermark."""
    db = ident(database)
    rollup, pending = f"{db}.{ident(sk.ROLLUP_TABLE)}", f"{db}.{ident(sk.PENDING_TABLE)}"
    after = _watermark(rollup)
    facts = s.facts_select(requests_between(pending, after, upto), final=False)
    return with_pd(facts, database, f"TraceId IN (SELECT TraceId FROM {pending} WHERE inserted > {after})")


def live_select(database: str, cluster: str | None = None) -> str:
    """The states of the requests not sealed yet (what the live view refreshes its table with)."""
    rollup = f"{ident(database)}.{ident(sk.ROLLUP_TABLE)}"
    return copies_select(states_select(_unsealed_facts(database, None), _watermark(rollup), live=1), cluster)


def seal_select(database: str, wait_s: int, cluster: str | None = None) -> str:
    """The sealing pass: the rows of the requests whose first part is older than `wait_s`, from the
    previous pass's end on (what the refreshable view appends to the rollup, on a cluster a copy
    for each shard)."""
    upto = f"now64(3) - toIntervalSecond({int(wait_s)})"
    return copies_select(states_select(_unsealed_facts(database, upto), upto), cluster)


def insert_rows(
    client: Any, database: str, table: str, select: str, cluster: str | None, parameters: dict[str, Any] | None = None
) -> None:
    """Append `select`'s rows (column_names, then copy_to on a cluster) to `table`: the rollup or the
    live table, through its copies table on a cluster."""
    columns = [*column_names(), *(["copy_to"] if cluster else [])]
    target = insert_target(database, table, cluster)
    client.command(f"INSERT INTO {target} ({', '.join(columns)})\n{select}", parameters=parameters)


def seal_now(client: Any, database: str = "otel", wait_s: int = 0) -> None:
    """One sealing pass now, of the requests whose first part is older than `wait_s` (tests and
    benchmarks, with the view's own passes stopped: `SYSTEM STOP VIEW`, or a longer wait)."""
    cluster = copy_cluster(client, database)
    insert_rows(client, database, sk.ROLLUP_TABLE, seal_select(database, wait_s, cluster), cluster)
    refresh_live(client, database)


def flush_copies(client: Any, database: str) -> None:
    """Send this node's queued copies to the other shards now (and wait for them): a read on
    another node right after sees them. Nothing on one node."""
    if copy_cluster(client, database):
        for table in (COPIES, LIVE_COPIES, step_rollup.COPIES):
            client.command(f"SYSTEM FLUSH DISTRIBUTED {ident(database)}.{ident(table)}")


def refresh_now(client: Any, database: str = "otel") -> None:
    """Bring the live table up to now and wait for it (on a cluster, for its copies on the other
    nodes too): the view refreshes by itself every LIVE_EVERY_S, so a reader that must see the last
    seconds' requests (right after a load run) asks."""
    view = f"{ident(database)}.{ident(LIVE_VIEW)}"
    client.command(f"SYSTEM REFRESH VIEW {view}")
    client.command(f"SYSTEM WAIT VIEW {view}")
    flush_copies(client, database)


def stop_refreshes(client: Any, database: str = "otel") -> None:
    """Stop both views' own passes (tests and benchmarks seal and refresh when they choose)."""
    for view in (SEAL_VIEW, LIVE_VIEW):
        client.command(f"SYSTEM STOP VIEW {ident(database)}.{ident(view)}")


def refresh_live(client: Any, database: str = "otel") -> None:
    """What a refresh of the live view does, now (tests and benchmarks, with the views stopped:
    on one node not atomic, the live states are missing between the two statements), and the
    copies sent."""
    cluster = copy_cluster(client, database)
    if not cluster:
        client.command(f"TRUNCATE TABLE {ident(database)}.{ident(sk.LIVE_TABLE)}")
    insert_rows(client, database, sk.LIVE_TABLE, live_select(database, cluster), cluster)
    flush_copies(client, database)
