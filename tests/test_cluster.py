"""Scale-out on a real 2-shard cluster of embedded ClickHouse servers: the schema applied node by
node (twice), spans through the collector's Distributed insert land one request per shard, the
budget over 2 shards equals the budget over one node, and a shard SIGKILLed mid-ingest loses and
duplicates nothing once it is back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import grpc
import pytest

from phaselens.analysis import queries as queries
from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.queries import sketch
from phaselens.analysis.rollup import rollup, step_rollup
from phaselens.collectors.schema import ident
from phaselens.collectors.service import Collector
from phaselens.collectors.shard_sink import make_sink
from phaselens.commands import budget as budget_command
from phaselens.commands import clickhouse as clickhouse_command
from phaselens.commands import rollup as rollup_command
from phaselens.commands import schema as schema_command
from phaselens.instrumentation import names
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.cluster import EmbeddedCluster
from phaselens.storage.cluster_nodes import ClusterError, cluster_nodes
from phaselens.storage.embedded import EmbeddedClickHouse
from tests import spangen
from tests import test_pd_native_spans as pd_spans
from tests.cli_fixtures import run_command
from tests.collector_payloads import export_request
from tests.conftest import stop_running_views

CLUSTER = "phaselens"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _apply(url: str, database: str, *extra: str) -> int:
    return run_command(
        schema_command.register,
        "schema",
        "apply",
        "--clickhouse",
        url,
        "--database",
        database,
        "--cluster",
        CLUSTER,
        *extra,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with EmbeddedCluster(str(tmp_path_factory.mktemp("cluster")), shards=2, name=CLUSTER) as c:
        yield c


@pytest.fixture(scope="module")
def clients(cluster):
    out = [connect(url) for url in cluster.urls]
    yield out
    for c in out:
        c.close()


@pytest.fixture(autouse=True)
def _views_stopped_after_each_test(clients):
    """A database's views refresh every 10 s on each node (~5 % of a core each, docs/development.md):
    nine databases on two nodes ran for the whole module, though each test reads only its own."""
    yield
    for client in clients:
        stop_running_views(client)


@pytest.fixture(scope="module")
def own_rows_db(cluster) -> str:
    """One database for the tests that read only their own rows (by service or trace id): a schema
    apply costs ~2.5 s of CPU on each node."""
    assert _apply(cluster.urls[0], "own_rows", "--ddl", "per-node") == 0
    return "own_rows"


def _tables(client, database: str) -> dict[str, str]:
    rows = client.query(
        "SELECT name, engine FROM system.tables WHERE database = {db:String}", parameters={"db": database}
    ).result_rows
    return dict(rows)


def test_nodes_are_found_through_system_clusters(cluster, clients):
    nodes = cluster_nodes(clients[0], cluster.urls[0], CLUSTER)
    assert [(n.shard_num, n.url) for n in nodes] == [(1, cluster.urls[0]), (2, cluster.urls[1])]
    with pytest.raises(ClusterError, match=r"no cluster 'nope'.*knows: .*phaselens"):
        cluster_nodes(clients[0], cluster.urls[0], "nope")


def test_schema_per_node_twice_and_on_cluster_points_at_the_flag(cluster, clients, capsys):
    assert _apply(cluster.urls[0], "sch") == 1
    assert "--ddl per-node" in capsys.readouterr().err
    for _ in range(2):  # idempotent: the second run (an upgrade, too) changes nothing
        assert _apply(cluster.urls[0], "sch", "--ddl", "per-node") == 0
    assert "on 2 nodes of cluster phaselens" in capsys.readouterr().out
    for client in clients:
        tables = _tables(client, "sch")
        assert tables["otel_traces"] == "MergeTree" and tables["phaselens_request_parts"] == "AggregatingMergeTree"
        assert tables["otel_traces_distributed"] == tables["phaselens_request_parts_distributed"] == "Distributed"
        assert tables["phaselens_budget_rollup"] == "AggregatingMergeTree"
        assert tables["phaselens_budget_states_local"] == "Merge"
        # every node keeps a complete copy of the rollups: written through these, read locally
        assert tables["phaselens_budget_rollup_copies"] == tables["phaselens_steps_rollup_copies"] == "Distributed"
        assert "phaselens_budget_states_distributed" not in tables
        assert {"phaselens_requests", "phaselens_request_facts", "phaselens_steps"} <= set(tables)


def test_asynchronous_distributed_inserts_are_sent(cluster, clients):
    """chdb leaves the distributed send pool at 0 threads; the generated config raises it."""
    for client in clients:
        client.command("CREATE TABLE IF NOT EXISTS default.k (k UInt64) ENGINE = MergeTree ORDER BY k")
        client.command(
            f"CREATE TABLE IF NOT EXISTS default.k_d AS default.k ENGINE = Distributed('{CLUSTER}', 'default', 'k', k)"
        )
    clients[0].command(
        "INSERT INTO default.k_d SELECT number FROM numbers(100)", settings={"distributed_foreground_insert": 0}
    )
    deadline = time.monotonic() + 20
    while clients[1].query("SELECT count() FROM default.k").result_rows[0][0] < 50 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [c.query("SELECT count() FROM default.k").result_rows[0][0] for c in clients] == [50, 50]


def _budget(url: str, database: str, capsys) -> dict:
    capsys.readouterr()
    assert (
        run_command(
            budget_command.register,
            "budget",
            "--clickhouse",
            url,
            "--database",
            database,
            "--slo",
            "ttft:40,tpot:15",
            "--format",
            "json",
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


WORKLOAD = spangen.generate(60, seed=15, server_only_every=6, n_steps=10)


@pytest.fixture(scope="module")
def spans():
    return spangen.build_spans(WORKLOAD)


@pytest.fixture(scope="module")
def single(clickhouse, spans, tmp_path_factory) -> str:
    """The same spans on one node: the database the cluster's budget must equal."""
    assert (
        run_command(schema_command.register, "schema", "apply", "--clickhouse", clickhouse.url, "--database", "single")
        == 0
    )
    with Collector(clickhouse.url, database="single", spool_dir=str(tmp_path_factory.mktemp("spool"))) as c:
        spangen.export_otlp(spans, c.grpc_endpoint)
    assert c.metrics.snapshot()["spans_written"] == len(spans)
    one = connect(clickhouse.url)
    rollup.refresh_now(one, "single")  # the views run: the live states as of now
    rollup.stop_refreshes(one, "single")  # and stop: the tests read these states, not new passes
    one.close()
    return "single"


@pytest.mark.parametrize("insert", ["direct", "distributed"])
def test_spans_shard_by_request_and_the_budget_equals_one_nodes(
    cluster, clients, clickhouse, single, spans, insert, tmp_path, capsys
):
    db = f"shard_{insert}"
    assert _apply(cluster.urls[0], db, "--ddl", "per-node") == 0
    with Collector(
        cluster.urls[0], database=db, cluster=CLUSTER, cluster_insert=insert, spool_dir=str(tmp_path / "spool")
    ) as c:
        spangen.export_otlp(spans, c.grpc_endpoint)
    assert c.metrics.snapshot()["spans_written"] == len(spans)
    per_shard = [c.query(f"SELECT count() FROM {db}.otel_traces").result_rows[0][0] for c in clients]
    assert sum(per_shard) == len(spans) and min(per_shard) > len(spans) / 4
    # one shard per trace, and the one a Distributed insert would have chosen
    split, misplaced, traces = (
        clients[0]
        .query(
            f"SELECT countIf(shards > 1), sum(misplaced), count() FROM (SELECT TraceId, uniqExact(_shard_num) AS shards, "
            f"countIf(_shard_num != cityHash64(TraceId) % 2 + 1) AS misplaced FROM {db}.otel_traces_distributed "
            "GROUP BY TraceId)"
        )
        .result_rows[0]
    )
    assert (split, misplaced) == (0, 0) and traces >= 60
    _trace_level_queries_see_every_shard(clients, db)
    # the budget reads the rollups (each shard's own) by default; the views run, so they are asked to
    # refresh (a refresh by hand beside the view's own could insert the live rows twice)
    for c in clients:
        rollup.refresh_now(c, db)
    # each node answers the whole cluster's budget from its own complete copy of the rollups
    for url in cluster.urls:
        _assert_budget_equals_one_nodes(url, db, clickhouse.url, single, capsys)


def _assert_budget_equals_one_nodes(url: str, db: str, single_url: str, single: str, capsys) -> None:
    sharded, one_node = _budget(url, db, capsys), _budget(single_url, single, capsys)
    assert sharded["source"] == one_node["source"] == "rollup"
    assert sharded["requests"] == one_node["requests"] == 60, (sharded["requests"], one_node["requests"])
    assert sharded["filters"].pop("database") == db and one_node["filters"].pop("database") == single
    got, want = _flat(sharded), _flat(one_node)
    assert got.keys() == want.keys() and len(got) > 100
    # means summed in another order differ in the last bits; everything else is exact
    assert got == {k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v for k, v in want.items()}


def _own_rows(client, db: str) -> list[tuple]:
    """This node's request and engine-step rollup rows: (sealer or origin, Σ requests or steps)."""
    requests = f"SELECT sealer, sum(requests) FROM {db}.{sketch.ROLLUP_TABLE} GROUP BY sealer"
    steps = f"SELECT origin, sum(steps) FROM {db}.{sketch.STEPS_ROLLUP_TABLE} GROUP BY origin"
    return sorted(client.query(requests).result_rows) + sorted(client.query(steps).result_rows)


def test_a_stopped_shard_catches_up_and_the_upgrade_push_is_idempotent(
    cluster, clients, clickhouse, single, spans, tmp_path, capsys
):
    """Shard 2 seals and is stopped: shard 1 seals on (its view's pass, its copy queued) and alone
    answers the whole cluster's budget from its copy; shard 2, restarted, gets the copies, and
    answers it too. Then the
    layout before the copies (each node its own rows; engine steps without `origin`): `phaselens
    rollup backfill` pushes them once, and a second run changes nothing."""
    db = "copies"
    assert _apply(cluster.urls[0], db, "--ddl", "per-node") == 0
    for c in clients:
        rollup.stop_refreshes(c, db)
    with Collector(cluster.urls[0], database=db, cluster=CLUSTER, spool_dir=str(tmp_path / "spool")) as collector:
        spangen.export_otlp(spans, collector.grpc_endpoint)
    seal, own = f"{db}.{rollup.SEAL_VIEW}", f"sealer = {rollup.SEALER}"
    victim = cluster.nodes[1]
    queued = f"SELECT sum(data_files) FROM system.distribution_queue WHERE database = '{db}'"
    rollup.seal_now(clients[1], db)  # its copies sent to shard 1
    victim.stop()
    try:
        # the sealing view again, with no wait: created, it runs a pass at once
        ddl = rollup.statements(db, cluster=CLUSTER, on_cluster=False, wait_s=0)
        create = next(
            sql for sql in ddl if sql.startswith(f"CREATE MATERIALIZED VIEW {ident(db)}.{ident(rollup.SEAL_VIEW)}")
        )
        for sql in (f"DROP VIEW {seal}", create, f"SYSTEM WAIT VIEW {seal}", f"SYSTEM STOP VIEW {seal}"):
            clients[0].command(sql)
        mine = f"SELECT sum(requests) FROM {db}.{sketch.ROLLUP_TABLE} WHERE {own}"
        sealed = clients[0].query(mine).result_rows[0][0]
        assert 0 < sealed < 60  # this shard's requests, once the wait is over
        assert clients[0].query(queued).result_rows[0][0] > 0  # the copy for shard 2 waits in the queue
        # the rollup budget, from this node's copy
        with connect(clickhouse.url) as one:
            want = _flat(asdict(budget(one, database=single, since=None, exact=False)))
        got = _flat(asdict(budget(clients[0], database=db, since=None, exact=False)))
        assert got.pop("filters.database.") == db and want.pop("filters.database.") == single
        assert got == {k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v for k, v in want.items()}
        assert got["requests."] == 60 and len(got) > 100
        # the CLI: the same budget, and a warning for the exact P/D summary (a Distributed read)
        capsys.readouterr()
        argv = ("budget", "--clickhouse", cluster.urls[0], "--database", db, "--format", "json")
        assert run_command(budget_command.register, *argv) == 0
        printed = capsys.readouterr()
        assert json.loads(printed.out)["requests"] == 60 and "disaggregated" not in json.loads(printed.out)
        assert printed.err.startswith("warning: no disaggregated budget:") and printed.err.count("\n") == 1
    finally:
        victim.start()
    others = f"SELECT sum(requests) FROM {db}.{sketch.ROLLUP_TABLE} WHERE sealer != {rollup.SEALER}"
    rollup.flush_copies(clients[0], db)  # sent now rather than at the queue's next retry
    assert clients[1].query(others).result_rows[0][0] == sealed
    assert clients[0].query(queued).result_rows[0][0] == 0
    stop_running_views(clients[1])  # the restarted node's views run again, every database's
    for url in cluster.urls:
        _assert_budget_equals_one_nodes(url, db, clickhouse.url, single, capsys)
    complete = [_own_rows(c, db) for c in clients]
    assert complete[0] == complete[1] and len(complete[0]) == 4
    # the layout before: each node only its own request rows, its engine steps with origin ''
    step_columns = ", ".join("''" if c == "origin" else c for c in step_rollup.column_names())
    for c in clients:
        c.command(f"DELETE FROM {db}.{sketch.ROLLUP_TABLE} WHERE sealer != {rollup.SEALER}")
        c.command(f"DELETE FROM {db}.{sketch.STEPS_ROLLUP_TABLE} WHERE origin != {step_rollup.ORIGIN}")
        c.command(
            f"INSERT INTO {db}.{sketch.STEPS_ROLLUP_TABLE} SELECT {step_columns} FROM {db}.{sketch.STEPS_ROLLUP_TABLE}"
        )
        c.command(f"DELETE FROM {db}.{sketch.STEPS_ROLLUP_TABLE} WHERE origin != ''")
    assert _budget(cluster.urls[1], db, capsys)["requests"] < 60
    backfill = ("rollup", "backfill", "--clickhouse", cluster.urls[0], "--database", db, "--since", "1d")
    assert run_command(rollup_command.register, *backfill) == 0
    assert capsys.readouterr().out.count("request rows to the other nodes") == 2
    assert [_own_rows(c, db) for c in clients] == complete
    assert run_command(rollup_command.register, *backfill) == 0  # twice: nothing copied, nothing changed
    assert "copied" not in capsys.readouterr().out
    assert [_own_rows(c, db) for c in clients] == complete
    for url in cluster.urls:
        _assert_budget_equals_one_nodes(url, db, clickhouse.url, single, capsys)


def test_pd_columns_on_a_cluster_from_either_node(cluster, clients, own_rows_db, tmp_path):
    """SGLang's P/D spans (tests/native_pd_spans.py) through the collector's sharded insert: every
    node's `phaselens_requests` reads the P/D columns of every request, whichever shard holds it."""
    db = own_rows_db
    for client in clients:
        assert _tables(client, db)["phaselens_pd_parts_distributed"] == "Distributed"
    with Collector(cluster.urls[0], database=db, cluster=CLUSTER, spool_dir=str(tmp_path / "spool")) as c:
        traces = {**pd_spans.emit(c.grpc_endpoint), **pd_spans.emit(c.grpc_endpoint)}
    for client in clients:
        got = pd_spans.pd_rows(client, db, traces)
        assert got.keys() == traces.keys()
        for trace_id, r in traces.items():
            if r is None:
                assert got[trace_id]["prefill_instance"] is None
            else:
                pd_spans.assert_pd_columns(got[trace_id], r)


def _trace_level_queries_see_every_shard(clients, db: str) -> None:
    """A trace stored on shard 2, asked of shard 1; the services of both shards' engine-step rollups
    (the drop-down lists the services the panels can select: the requests' and the steps')."""
    trace_id, spans = (
        clients[1]
        .query(
            f"SELECT TraceId, count() FROM {db}.otel_traces WHERE SpanName != {{s:String}} "
            "GROUP BY TraceId ORDER BY TraceId LIMIT 1",
            parameters={"s": names.SPAN_ENGINE_STEP},
        )
        .result_rows[0]
    )
    sql, params = queries.render_cli("request_spans", database=db, trace_id=trace_id)
    assert len(clients[0].query(sql, parameters=params).result_rows) == spans > 1
    sql, params = queries.render_cli("services", database=db)
    served = {r[0] for r in clients[0].query(sql, parameters=params).result_rows}
    assert served == {WORKLOAD.server_service}
    # each node's engine-step rollup holds both shards' steps (its own, and the other's copies)
    origins = f"SELECT uniqExact(origin), sum(steps) FROM {db}.{sketch.STEPS_ROLLUP_TABLE}"
    for c in clients:
        rollup.flush_copies(c, db)
    stored = f"SELECT count() FROM {db}.otel_traces_distributed WHERE SpanName = {{s:String}}"
    steps = clients[0].query(stored, parameters={"s": names.SPAN_ENGINE_STEP}).result_rows[0][0]
    assert [c.query(origins).result_rows[0] for c in clients] == [(2, steps), (2, steps)] and steps > 0


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix: value}


def _sender(
    endpoint: str, bodies: list[bytes], acked: list[int], refused: list[grpc.StatusCode], stop: threading.Event
) -> None:
    """Exports until every body is acknowledged; a refused export (spool full: back-pressure) is
    retried, as an OTLP exporter does with a retryable status."""
    with grpc.insecure_channel(endpoint) as channel:
        export = channel.unary_unary(EXPORT)
        for body in bodies:
            while not stop.is_set():
                try:
                    export(body, timeout=10)
                    acked.append(len(body))
                    break
                except grpc.RpcError as exc:
                    refused.append(exc.code())
                    time.sleep(0.05)


def _wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_shard_sigkilled_mid_ingest_loses_and_duplicates_nothing(cluster, clients, tmp_path):
    assert _apply(cluster.urls[0], "kill", "--ddl", "per-node") == 0
    bodies = [export_request(50, time.time_ns() + i, service="kill").SerializeToString() for i in range(60)]
    spool_cap = 12 * len(bodies[0])  # small, so that the outage fills it
    victim: EmbeddedClickHouse = cluster.nodes[1]
    acked, refused, stop = [], [], threading.Event()
    with Collector(
        cluster.urls[0],
        database="kill",
        cluster=CLUSTER,
        spool_dir=str(tmp_path / "spool"),
        flush_interval_s=0.05,
        batch_spans=200,
        max_spool_bytes=spool_cap,
    ) as c:
        sender = threading.Thread(target=_sender, args=(c.grpc_endpoint, bodies, acked, refused, stop))
        sender.start()
        try:
            assert _wait_for(lambda: len(acked) >= 10)
            os.kill(victim.pid, signal.SIGKILL)
            victim.stop()
            with pytest.raises(ClusterError, match=r"shard 2.*does not answer"):
                cluster_nodes(clients[0], cluster.urls[0], CLUSTER)
            refused_before = len(refused)
            # the inserts fail, the spool fills, exports are refused with a retryable code
            assert _wait_for(lambda: c.metrics.snapshot()["insert_retries"] >= 2 and len(refused) > refused_before)
            assert set(refused) <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
            victim.start()
            stop_running_views(clients[1])  # a restart starts every database's views again
            sender.join(60)
        finally:
            stop.set()
            if not victim.running():
                victim.start()
    assert len(acked) == len(bodies)
    assert c.metrics.snapshot()["spans_written"] == 60 * 50
    total, unique = (
        clients[0].query("SELECT count(), uniqExact(SpanId) FROM kill.otel_traces_distributed").result_rows[0]
    )
    assert (total, unique) == (3000, 3000)
    parts = (
        clients[0]
        .query("SELECT count(), uniqExact(TraceId) FROM kill.phaselens_request_parts_distributed FINAL")
        .result_rows[0]
    )
    assert parts[0] == parts[1] == 60 * 13  # 50 spans: 13 traces of 4 spans or fewer


@pytest.mark.parametrize("insert", ["direct", "distributed"])
def test_a_replayed_batch_is_dropped_by_every_shard(cluster, clients, own_rows_db, insert):
    """The collector's retry after a partial success: the same rows, the same token, again."""
    db, service = own_rows_db, f"replay-{insert}"
    body = export_request(40, time.time_ns(), service=service).SerializeToString()
    sink = make_sink(cluster.urls[0], db, CLUSTER, insert)
    try:
        for _ in range(2):
            sink.insert([sink.render(body)], f"replay-token-{insert}")
    finally:
        sink.close()
    count = f"SELECT count() FROM {db}.otel_traces WHERE ServiceName = {{s:String}}"
    per_shard = [c.query(count, parameters={"s": service}).result_rows[0][0] for c in clients]
    assert sum(per_shard) == 40 and min(per_shard) > 0


def test_clickhouse_command_starts_a_cluster(tmp_path):
    """`phaselens clickhouse --shards 2`: a cluster that answers, stopped by SIGTERM."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaselens", "clickhouse", "--data", str(tmp_path), "--shards", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().split()
        assert line[:2] == ["READY", "clickhouse"] and len(line) == 4
        client = connect(line[2])
        rows = client.query("SELECT _shard_num FROM clusterAllReplicas('phaselens', system.one) ORDER BY 1").result_rows
        assert rows == [(1,), (2,)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        proc.kill()
    assert run_command(clickhouse_command.register, "clickhouse", "--data", str(tmp_path / "x"), "--shards", "0") == 1
