"""`phaselens demo --shards 2` end to end: the real reference server and a real `phaselens bench` run
through the collector into a real 2-shard embedded cluster. While the demo keeps running: rows on
both shards, every request's spans (client and server) and every engine-step trace on one shard, the
commands the demo prints work against the cluster (`budget`: one row per request bench sent), and
SIGTERM stops every node and child."""

from __future__ import annotations

import json
import shlex
import signal
import sys

from phaselens.commands import budget as budget_command
from phaselens.commands import schema as schema_command
from phaselens.faults.parts import wait_until
from phaselens.instrumentation import names
from phaselens.storage.clickhouse_url import connect
from tests.cli_fixtures import run_command
from tests.process_fixtures import Watched, cmdlines_with

REQUESTS = 16
KEEP_RUNNING = "Everything stays up until Ctrl-C."


def _printed(output: str, label: str) -> str:
    """The value of the demo's `label:` line in its keep-running instructions."""
    return next(line.split(":", 1)[1].strip() for line in output.splitlines() if line.strip().startswith(f"{label}:"))


def _command(output: str, label: str) -> list[str]:
    """A printed `phaselens …` command as argv, without the program name."""
    argv = shlex.split(_printed(output, label))
    assert argv[0] == "phaselens", argv
    return argv[1:]


def test_demo_on_a_two_shard_cluster(tmp_path, capsys):
    data = tmp_path / "data"
    demo = Watched(
        [
            sys.executable,
            "-m",
            "phaselens",
            "demo",
            "--shards",
            "2",
            "--requests",
            str(REQUESTS),
            "--rate",
            "8",
            "--data",
            str(data),
            "--report",
            str(tmp_path / "report.html"),
            "--keep-running",
        ]
    )
    try:
        assert demo.wait_for(KEEP_RUNNING, timeout_s=150), demo.output[-4000:]
        out = demo.output
        assert f"{REQUESTS}/{REQUESTS} requests queryable with client and server views" in out, out[-4000:]
        assert f"TTFT budget ({REQUESTS} requests, {REQUESTS} with a client view, 0 errors" in out
        storage = _printed(out, "storage")
        assert storage.startswith("ClickHouse cluster phaselens, 2 shards: ")
        urls = storage.rpartition(": ")[2].split()
        assert len(urls) == 2
        collector = _command(out, "collector")
        assert collector[:2] == ["collector", "--clickhouse"] and "--cluster" in collector
        trace_ids = [
            json.loads(line)["trace_id"] for line in (data / "run" / "requests.jsonl").read_text().splitlines()
        ]
        assert len(trace_ids) == REQUESTS
        _check_shards(urls, trace_ids)
        _check_printed_commands(out, capsys)
        demo.proc.send_signal(signal.SIGTERM)
        assert demo.finish(timeout_s=60) == 0, demo.output[-3000:]
    finally:
        if demo.proc.poll() is None:
            demo.proc.kill()
    # nothing left behind: both ClickHouse nodes, collector, server, bench all gone
    assert len(demo.seen) >= 5, demo.seen
    wait_until(lambda: not demo.survivors(), 10)  # a grandchild ends on its own time: seconds under load
    assert demo.survivors() == [] and cmdlines_with(str(data)) == []


def _check_shards(urls: list[str], trace_ids: list[str]) -> None:
    clients = [connect(url) for url in urls]
    try:
        per_shard = [c.query("SELECT count() FROM otel.otel_traces").result_rows[0][0] for c in clients]
        assert min(per_shard) > 0, per_shard
        requests = (
            clients[0]
            .query(
                "SELECT TraceId, uniqExact(_shard_num), countIf(SpanKind = 'Client'), countIf(SpanKind = 'Server'), "
                "countIf(_shard_num != cityHash64(TraceId) % 2 + 1) FROM otel.otel_traces_distributed "
                "WHERE TraceId IN {ids:Array(String)} GROUP BY TraceId",
                parameters={"ids": trace_ids},
            )
            .result_rows
        )
        assert len(requests) == len(trace_ids)
        for trace_id, shards, client_spans, server_spans, misplaced in requests:
            assert (shards, misplaced) == (1, 0) and client_spans >= 1 and server_spans >= 1, trace_id
        # engine steps: traces of their own, each on one shard, linked to the run's requests
        steps, split, linked = (
            clients[0]
            .query(
                "SELECT count(), countIf(shards > 1), length(arrayIntersect(groupUniqArrayArray(links), {ids:Array(String)})) "
                "FROM (SELECT TraceId, uniqExact(_shard_num) AS shards, groupUniqArrayArray(Links.TraceId) AS links "
                "FROM otel.otel_traces_distributed WHERE SpanName = {step:String} GROUP BY TraceId)",
                parameters={"ids": trace_ids, "step": names.SPAN_ENGINE_STEP},
            )
            .result_rows[0]
        )
        assert steps > REQUESTS and split == 0 and linked == len(trace_ids)
    finally:
        for c in clients:
            c.close()


def _check_printed_commands(output: str, capsys) -> None:
    """`budget` as printed: one row per request; `schema` as printed: per node, idempotent."""
    capsys.readouterr()
    assert run_command(budget_command.register, *_command(output, "budget"), "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["requests"] == REQUESTS
    schema = _command(output, "schema")
    assert schema[-4:] == ["--cluster", "phaselens", "--ddl", "per-node"]
    assert run_command(schema_command.register, *schema) == 0
    assert "on 2 nodes of cluster phaselens" in capsys.readouterr().out
