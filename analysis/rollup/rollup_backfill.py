"""Recompute the sealed rollup rows of given minutes from the exact per-request rows: what makes a
client view imported after its request was sealed (`phaselens import`) count in the default budget.

On one node (every node of a cluster in turn: each seals its own requests, `analysis/rollup/rollup.py`;
every node keeps a copy of every node's rows, so the delete runs on each, and the insert is copied):

    W = the node's watermark (max sealed_to of its rows)
    S = the requests of the minutes whose first part was inserted at or before W, or that have left
        the pending table: the requests the sealing passes have already counted
    delete the node's sealed rows of the minutes; insert the states of S, merged from every part
    (as the exact path merges them), with sealed_to = W; claim S in the pending table

Every request counts once:
- a request not sealed by W is left to the sealing pass that will seal it (with its imported view,
  when that arrived first); a pass already running when the import inserted is waited for first;
- S is claimed in the pending table (a row per request, inserted = W): a request whose parts were
  already stored but whose pending copy was not yet visible when S was read is then never sealed
  again, since a pass skips requests with a part at or before its watermark;
- a pass that commits while the minutes are recomputed moves the watermark: its rows may have been
  deleted, so the recompute runs again (the watermark is read before and after each round; a round
  ends only when it did not move). A pass whose rows the delete removed whole is undone: the
  watermark is the newest row's, so it is back at W and the next pass seals those requests again.

A read between the delete and the insert misses those minutes; the recompute reads every request
of the node (as `phaselens budget --exact` does), once per round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.queries.id_batches import slices
from phaselens.analysis.rollup import rollup
from phaselens.analysis.rollup.rollup_copies import copies_select
from phaselens.analysis.schema import schema as s
from phaselens.collectors.schema import ident
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.cluster_nodes import cluster_nodes

MAX_ROUNDS = 5  # a pass every 30 s and a round of a second or so: a second round is rare
_IN_MINUTES = "toUInt32(toStartOfMinute(start_time)) IN {minutes:Array(UInt32)}"


class BackfillError(RuntimeError):
    pass


@dataclass(slots=True)
class Backfilled:
    """One node's recompute: its `requests` counted in `minutes`, in `rounds` rounds."""

    minutes: int
    requests: int
    rounds: int


def _tables(database: str) -> tuple[str, str, str]:
    db = ident(database)
    return f"{db}.{ident(sk.ROLLUP_TABLE)}", f"{db}.{ident(sk.PENDING_TABLE)}", f"{db}.{ident(s.PARTS_TABLE)}"


def watermark_ms(client: Any, database: str) -> int:
    """This node's watermark, in ms since the epoch (0 before its first sealing pass)."""
    rollup_table = _tables(database)[0]
    sql = f"SELECT toUnixTimestamp64Milli(toDateTime64({rollup._watermark(rollup_table)}, 3))"
    return int(client.query(sql).result_rows[0][0])


def minutes_of(client: Any, database: str, trace_ids: Sequence[str]) -> list[int]:
    """The minutes (epoch seconds) of these requests' start, as the rollup files them."""
    sql = (
        f"SELECT DISTINCT toUInt32(toStartOfMinute(start_time)) FROM {ident(database)}.{ident(s.FACTS_VIEW)} "
        "WHERE trace_id IN {ids:Array(String)}"
    )
    out: set[int] = set()
    for part in slices(trace_ids):
        out |= {row[0] for row in client.query(sql, parameters={"ids": list(trace_ids[part])}).result_rows}
    return sorted(out)


def sealed_requests(client: Any, database: str, minutes: Sequence[int], mark_ms: int) -> list[str]:
    """This node's requests of `minutes` the sealing passes have counted by watermark `mark_ms`:
    all but those whose first part (an imported view alone aside) came after it."""
    _, pending, parts = _tables(database)
    unsealed = (
        f"SELECT TraceId FROM {pending} GROUP BY TraceId "
        "HAVING min(harness_only) = 0 AND min(inserted) > fromUnixTimestamp64Milli({mark:Int64})"
    )
    sql = f"SELECT trace_id FROM ({s.facts_select(parts)}) WHERE {_IN_MINUTES} AND trace_id NOT IN ({unsealed})"
    rows = client.query(sql, parameters={"minutes": list(minutes), "mark": mark_ms}).result_rows
    return [row[0] for row in rows]


def _recompute(client: Any, database: str, minutes: Sequence[int], mark_ms: int, nodes: Sequence[Any]) -> int:
    """One round: claim and count the requests sealed by `mark_ms`, in place of the minutes' rows
    (this node's rows, on every node of `nodes`)."""
    rollup_table, pending, parts = _tables(database)
    cluster = rollup.copy_cluster(client, database)
    ids = sealed_requests(client, database, minutes, mark_ms)
    mark = "fromUnixTimestamp64Milli({mark:Int64})"
    for part in slices(ids):  # claimed before the delete: a pass skips them from now on
        client.command(
            f"INSERT INTO {pending} (TraceId, inserted, harness_only) SELECT arrayJoin({{ids:Array(String)}}), {mark}, 1",
            parameters={"ids": ids[part], "mark": mark_ms},
        )
    rollup.flush_copies(client, database)  # a pass's queued copies arrive before the deletes, not after
    sealer = client.query(f"SELECT {rollup.SEALER}").result_rows[0][0]
    for node in nodes:
        node.command(
            f"DELETE FROM {rollup_table} WHERE sealer = {{sealer:String}} AND toUInt32(bucket) IN {{minutes:Array(UInt32)}}",
            parameters={"sealer": sealer, "minutes": list(minutes)},
        )
    for part in slices(ids):
        requests = f"(SELECT * FROM {parts} FINAL WHERE TraceId IN {{ids:Array(String)}})"
        facts = rollup.with_pd(s.facts_select(requests, final=False), database, "TraceId IN {ids:Array(String)}")
        states = copies_select(rollup.states_select(facts, mark), cluster)
        rollup.insert_rows(client, database, sk.ROLLUP_TABLE, states, cluster, {"ids": ids[part], "mark": mark_ms})
    return len(ids)


def backfill(client: Any, database: str, minutes: Sequence[int], nodes: Sequence[Any] = ()) -> Backfilled:
    """Recompute this node's sealed rows of `minutes` (epoch seconds of whole minutes) from every
    part of their requests, on every node of `nodes` (a cluster's, this one among them; default:
    this one). Nothing before the node's first sealing pass: no request is sealed."""
    if not minutes:
        return Backfilled(0, 0, 0)
    # a pass that read the pending table before the caller's insert must have committed first
    client.command(f"SYSTEM WAIT VIEW {ident(database)}.{ident(rollup.SEAL_VIEW)}")
    mark_ms = watermark_ms(client, database)
    for rounds in range(1, MAX_ROUNDS + 1):
        if mark_ms == 0:
            return Backfilled(len(minutes), 0, rounds)
        requests = _recompute(client, database, minutes, mark_ms, nodes or [client])
        after_ms = watermark_ms(client, database)
        if after_ms == mark_ms:
            return Backfilled(len(minutes), requests, rounds)
        mark_ms = after_ms  # a pass committed meanwhile: its rows may be gone, count them again
    raise BackfillError(
        f"the sealing pass committed during each of {MAX_ROUNDS} recomputes of {len(minutes)} minutes: "
        "run `phaselens rollup backfill` again"
    )


def node_urls(client: Any, url: str, cluster: str | None) -> list[str]:
    """Every node that seals requests: each node of `cluster`, or the one at `url`."""
    return [node.url for node in cluster_nodes(client, url, cluster)] if cluster else [url]


T = TypeVar("T")


def on_each_node(client: Any, url: str, cluster: str | None, work: Callable[[Any, list[Any]], T]) -> list[T]:
    """`work(node_client, every_node_client)` on every node that seals requests (`node_urls`), one
    connection each (every node keeps a copy of every node's rollup rows)."""
    nodes: list[Any] = []
    try:
        for node_url in node_urls(client, url, cluster):
            nodes.append(connect(node_url))
        return [work(node, nodes) for node in nodes]
    finally:
        for node in nodes:
            node.close()


def backfill_requests(
    client: Any, url: str, database: str, cluster: str | None, trace_ids: Sequence[str]
) -> list[Backfilled]:
    """Recompute the minutes of these requests on every node, then bring each node's live states up
    to now (the requests not sealed yet count there, with their parts as of now)."""
    return backfill_minutes(client, url, database, cluster, minutes_of(client, database, trace_ids))


def backfill_minutes(
    client: Any, url: str, database: str, cluster: str | None, minutes: Sequence[int]
) -> list[Backfilled]:
    """`backfill` on every node, then its live states brought up to now."""

    def on_node(node: Any, nodes: list[Any]) -> Backfilled:
        done = backfill(node, database, minutes, nodes)
        rollup.refresh_now(node, database)
        return done

    return on_each_node(client, url, cluster, on_node)


def minutes_between(client: Any, database: str, since_ms: int, until_ms: int) -> list[int]:
    """The minutes (epoch seconds) of the requests that started in [now − since, now − until)."""
    sql = (
        f"SELECT DISTINCT toUInt32(toStartOfMinute(start_time)) FROM {ident(database)}.{ident(s.FACTS_VIEW)} "
        "WHERE start_time >= now64(3) - toIntervalMillisecond({since:Int64}) "
        "AND start_time < now64(3) - toIntervalMillisecond({until:Int64})"
    )
    rows = client.query(sql, parameters={"since": since_ms, "until": until_ms}).result_rows
    return sorted(row[0] for row in rows)
