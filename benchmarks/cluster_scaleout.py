"""Scale-out benchmark: ingest and budget-query time on one node vs a 2-shard embedded cluster,
the same spans, one run; and which shard-aware write path the collector should use.

The spans are budget_query.py's (client span + server tree + engine steps per request), generated
once server-side, read back as the RowBinary the collector sends, and inserted in batches of
`--batch-spans` (the collector's default) four ways, each into a fresh database:
- single: one node, `otel_traces` (what `phaselens collector` does without --cluster);
- distributed_sync: the cluster's Distributed table, foreground insert (the insert returns when
  every shard has its rows: `phaselens collector --cluster NAME --cluster-insert distributed`);
- distributed_async: the Distributed table, background insert, timed until the queue is flushed
  (acknowledges before the shards have the rows: not what the collector may use);
- direct: each batch split by cityHash64(TraceId) % shards and inserted into each shard's local
  table in parallel by `ShardedSink` (what `phaselens collector --cluster NAME` does; its renderer
  splits the rows, here they are split up front).
Ingest figures are the server side only (rendering excluded: benchmarks/collector_ingest.py
measures the collector). Then the full budget (`phaselens.analysis.budget.latency_budget`) over single and over
distributed_sync, best of `--repeat`, exact and from the rollups (sealed on every node), and a
back-of-envelope for a fleet at the measured rate.
Prints ONE JSON object.

    python benchmarks/cluster_scaleout.py [--requests N] [--shards 2] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.budget_query import _client_insert, _server_insert, _steps_insert, cpu_s
from phaselens.analysis.budget import budget
from phaselens.analysis.rollup import rollup
from phaselens.analysis.sql import ddl
from phaselens.collectors import schema as CS
from phaselens.collectors.clickhouse_sink import ClickHouseSink
from phaselens.collectors.shard_sink import ShardedSink
from phaselens.common.slo import GOODPUT_SLO_KEYS, parse_slo
from phaselens.instrumentation import names as n
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.cluster import EmbeddedCluster
from phaselens.storage.embedded import EmbeddedClickHouse

CLUSTER = "bench"
STAGE = "stage"
SPREAD_S = 600


def stage(client, n_requests: int) -> int:
    """budget_query.py's spans in `stage.otel_traces` (no views); returns the span count."""
    client.command(f"DROP DATABASE IF EXISTS {STAGE}")
    CS.apply(client, CS.statements(STAGE)[:2])
    t0 = time.time_ns() - (SPREAD_S + 60) * 10**9
    for make in (_client_insert, _server_insert, _steps_insert):
        client.command(make(STAGE).format(t0=t0, n=n_requests, first=0, count=n_requests, spread_s=SPREAD_S))
    return client.query(f"SELECT count() FROM {STAGE}.otel_traces").result_rows[0][0]


def batches(client, batch_spans: int, where: str = "1") -> list[bytes]:
    """The staged rows as RowBinary in the collector's column order, `batch_spans` rows a batch."""
    columns = ", ".join(f"`{c}`" for c in CS.INSERT_COLUMNS)
    out, offset = [], 0
    while True:
        body = client.raw_query(
            f"SELECT {columns} FROM {STAGE}.otel_traces WHERE {where} "
            f"ORDER BY ServiceName, Timestamp, SpanId LIMIT {batch_spans} OFFSET {offset}",
            fmt="RowBinary",
        )
        if not body:
            return out
        out.append(body)
        offset += batch_spans


def _schema(urls: list[str], database: str, cluster: str | None) -> None:
    """The schema on every node, the rollups' own passes stopped (sealed once ingest is done)."""
    for url in urls:
        client = connect(url)
        CS.apply(client, ddl.all_statements(database, cluster=cluster, on_cluster=False))
        rollup.stop_refreshes(client, database)
        client.close()


def seal(urls: list[str], database: str) -> None:
    """A sealing pass on every node: each seals its own requests into its own rollup."""
    for url in urls:
        client = connect(url)
        rollup.seal_now(client, database)
        client.close()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measured(fn, pids: list[int]) -> tuple[float, float]:
    """(wall s, server CPU s summed over `pids`): on a shared machine CPU time is the figure to
    compare, wall time includes waiting for other processes."""
    cpu0 = sum(cpu_s(pid) for pid in pids)
    wall = _timed(fn)
    return wall, sum(cpu_s(pid) for pid in pids) - cpu0


def ingest_sink(url: str, database: str, cluster: str | None, bodies: list[bytes]) -> float:
    sink = ClickHouseSink(url, database, cluster)
    try:
        return _timed(lambda: [sink.insert([body], f"{database}-{i}") for i, body in enumerate(bodies)])
    finally:
        sink.close()


def ingest_async(url: str, database: str, bodies: list[bytes]) -> float:
    client = connect(url, compress=False)
    table = f"{database}.{CS.DISTRIBUTED_TABLE}"

    def run() -> None:
        for body in bodies:
            client.raw_insert(
                table, CS.INSERT_COLUMNS, body, fmt="RowBinary", settings={"distributed_foreground_insert": 0}
            )
        client.command(f"SYSTEM FLUSH DISTRIBUTED {table}")

    try:
        return _timed(run)
    finally:
        client.close()


def ingest_direct(url: str, database: str, per_shard: list[list[bytes]]) -> float:
    """The collector's path (`ShardedSink`), fed batches already split per shard."""
    sink = ShardedSink(url, database, CLUSTER)
    batches_ = [list(parts) for parts in itertools.zip_longest(*per_shard, fillvalue=b"")]
    try:
        return _timed(lambda: [sink.insert([parts], f"{database}-{i}") for i, parts in enumerate(batches_)])
    finally:
        sink.close()


def budget_s(url: str, database: str, repeat: int, exact: bool = True) -> tuple[float, dict]:
    """Best of `repeat` full budgets, exact (every request) or from the rollups."""
    client = connect(url)
    slo = parse_slo("ttft:60,tpot:12", GOODPUT_SLO_KEYS)
    run = lambda: budget(client, database=database, since="1h", slo=slo, exact=exact)  # noqa: E731
    report = run()
    best = min(_timed(run) for _ in range(repeat))
    client.close()
    return best, report.to_dict()


def stored_bytes(urls: list[str], database: str) -> int:
    """Compressed bytes on disk of every table of `database`, summed over nodes."""
    total = 0
    for url in urls:
        client = connect(url)
        total += client.query(
            "SELECT sum(data_compressed_bytes) FROM system.parts WHERE active AND database = {db:String}",
            parameters={"db": database},
        ).result_rows[0][0]
        client.close()
    return total


def _close(a, b) -> bool:
    """Equal, floats within 1e-9 relative: a mean summed in another order differs in the last bits."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _same_budget(a: dict, b: dict) -> bool:
    """Every figure of the two reports but the database each was read from."""
    return _close({**a, "filters": None}, {**b, "filters": None})


def fleet(spans_per_cpu_s: float, request_spans: float, bytes_per_span: float, args) -> dict:
    """`--servers` × (`--requests-per-server-s` × spans per request + `--steps-per-server-s` engine
    step spans): spans/s, stored bytes/day, and shards needed:
        shards = ⌈fleet spans/s ÷ (measured spans per server CPU-second × cores per shard × headroom)⌉
    (headroom: the share of a shard's CPU given to ingest, the rest is for queries and merges;
    assumes ingest scales with a shard's cores, which one 2-core machine cannot show)."""
    spans_per_s = args.servers * (args.requests_per_server_s * request_spans + args.steps_per_server_s)
    per_shard = spans_per_cpu_s * args.cores_per_shard * args.headroom
    return {
        "servers": args.servers,
        "requests_per_server_s": args.requests_per_server_s,
        "steps_per_server_s": args.steps_per_server_s,
        "spans_per_request": round(request_spans, 2),
        "spans_per_s": round(spans_per_s),
        "stored_gib_per_day": round(spans_per_s * bytes_per_span * 86400 / 2**30),
        "cores_per_shard": args.cores_per_shard,
        "headroom": args.headroom,
        "shards_needed": max(1, math.ceil(spans_per_s / per_shard)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=25_000)
    parser.add_argument("--quick", action="store_true", help="2,000 requests in batches of 5,000 spans")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--batch-spans", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--servers", type=int, default=1000)
    parser.add_argument("--requests-per-server-s", type=float, default=10.0)
    parser.add_argument("--steps-per-server-s", type=float, default=30.0, help="engine steps with a sampled request")
    parser.add_argument("--headroom", type=float, default=0.5)
    parser.add_argument("--cores-per-shard", type=int, default=16, help="for the fleet estimate")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.batch_spans = 2000, 5000
    with (
        tempfile.TemporaryDirectory(prefix="phaselens-scaleout-") as tmp,
        EmbeddedClickHouse(os.path.join(tmp, "single")) as single,
        EmbeddedCluster(os.path.join(tmp, "cluster"), shards=args.shards, name=CLUSTER) as cluster,
    ):
        client = connect(single.url)
        spans = stage(client, args.requests)
        request_spans = (
            client.query(f"SELECT countIf(SpanName != '{n.SPAN_ENGINE_STEP}') FROM {STAGE}.otel_traces").result_rows[0][
                0
            ]
            / args.requests
        )
        bodies = batches(client, args.batch_spans)
        per_shard = [
            batches(client, args.batch_spans // args.shards, f"cityHash64(TraceId) % {args.shards} = {k}")
            for k in range(args.shards)
        ]
        client.close()
        _schema([single.url], "single", None)
        for database in ("sync", "async", "direct"):
            _schema(cluster.urls, database, CLUSTER)
        nodes = [node.pid for node in cluster.nodes]
        ingest = {
            "single": measured(lambda: ingest_sink(single.url, "single", None, bodies), [single.pid]),
            "distributed_sync": measured(lambda: ingest_sink(cluster.urls[0], "sync", CLUSTER, bodies), nodes),
            "distributed_async": measured(lambda: ingest_async(cluster.urls[0], "async", bodies), nodes),
            "direct": measured(lambda: ingest_direct(cluster.urls[0], "direct", per_shard), nodes),
        }
        budget_single, report_single = budget_s(single.url, "single", args.repeat)
        budget_sharded, report_sharded = budget_s(cluster.urls[0], "sync", args.repeat)
        seal([single.url], "single")
        seal(cluster.urls, "sync")
        rollup_single, rollup_report_single = budget_s(single.url, "single", args.repeat, exact=False)
        rollup_sharded, rollup_report_sharded = budget_s(cluster.urls[0], "sync", args.repeat, exact=False)
        bytes_per_span = stored_bytes([single.url], "single") / spans
    rates = {mode: round(spans / wall) for mode, (wall, _) in ingest.items()}
    per_cpu = {mode: round(spans / cpu) for mode, (_, cpu) in ingest.items()}
    result = {
        "benchmark": "cluster_scaleout",
        "requests": args.requests,
        "spans": spans,
        "shards": args.shards,
        "batch_spans": args.batch_spans,
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "ingest_spans_per_s": rates,
        "ingest_spans_per_server_cpu_s": per_cpu,
        "baseline": "single",
        "collector_path": "direct",
        "budget_s_best": {"single": round(budget_single, 3), "sharded": round(budget_sharded, 3)},
        "same_budget": _same_budget(report_single, report_sharded),
        "budget_rollup_s_best": {"single": round(rollup_single, 3), "sharded": round(rollup_sharded, 3)},
        "same_rollup_budget": _same_budget(rollup_report_single, rollup_report_sharded),
        "requests_in_budget": report_sharded["requests"],
        "stored_bytes_per_span": round(bytes_per_span, 1),
        "fleet": fleet(per_cpu["single"], request_spans, bytes_per_span, args),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
